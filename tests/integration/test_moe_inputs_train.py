"""`finetune` and `extend` on MoEs moemerge did not build, in both on-disk forms: checkpoints
saved by transformers' own classes (tests/moe_families.py), as test_moe_inputs.py reads them.

Oracles: finetune writes the source's own form back (the same on-disk names), its untrained
tensors bit for bit the input's and its trained routers not; extend keeps every old tensor bit
for bit (a grown stack or router: its first E slices), adds the dense expert's FFN as expert
E, routes the new expert's text to it and the MoE's own text away from it (the same check
fails with the new rows zeroed), writes a fused input fused and a classic one classic, the
two the same model (a fused moemerge build too); every output loads in transformers with
finite logits."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from conftest import TEXT, perturbed_copy
from moe_families import FAMILIES, hub_moes, logits
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from moemerge.architectures.forms import CLASSIC, FORMS, FUSED, layout_of, renamed_name
from moemerge.cli import app
from moemerge.io.reader import CheckpointReader
from moemerge.routing.modules import find_routers

runner = CliRunner()
TRAIN = ["--steps", 2, "--seq-len", 32, "--batch-size", 2, "--lr", 1e-2, "-q"]
MODES = {"router-only": "--router-only", "full": "--full"}
TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5
needs_5 = pytest.mark.skipif(TRANSFORMERS_4, reason="output.experts: fused needs transformers 5")
# families whose expert is a dense model of a transformers class (`extract` writes one)
EXTENDED = ["mixtral", "granitemoe", "qwen3_moe", "flex_olmo"]


def run(*args) -> tuple[int, str]:
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())


def tensors(path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under its on-disk names."""
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        found |= load_file(file)
    return found


def classic(path) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the classic names (a fused stack read per expert)."""
    with CheckpointReader(path) as reader:
        return {name: reader.read(name) for name in reader.names()}


def form_of(path) -> str | None:
    with CheckpointReader(path) as reader:
        return reader.form


def routers(path) -> set[str]:
    """The classic names of the MoE's routers."""
    with CheckpointReader(path) as reader:
        layout = layout_of(reader.config)
        return {name for layer in range(reader.config["num_hidden_layers"])
                if (name := layout.router_name(layer)) in reader}


@pytest.fixture(scope="module")
def hub_moe(tmp_path_factory, tokenizer):
    return hub_moes(tmp_path_factory, tokenizer)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "train.txt"
    path.write_text(TEXT * 40)
    return path


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_finetune_writes_the_source_form_back(family, mode, hub_moe, text, tmp_path):
    if TRANSFORMERS_4 and family.startswith("granitemoe") and mode == "router-only":
        pytest.skip("transformers 4's GraniteMoE router has no `experts` beside it: finetune "
                    "finds no router to train there (train/params.py)")
    for form in FORMS:
        source, out = hub_moe(family, form), tmp_path / form
        code, output = run("finetune", source, out, "--data", text, MODES[mode], *TRAIN)
        assert code == 0, output
        assert form_of(out) == form
        before, after = tensors(source), tensors(out)
        assert sorted(before) == sorted(after), form  # the source's own on-disk names
        assert all(before[n].shape == after[n].shape and before[n].dtype == after[n].dtype
                   for n in before)
        changed = {n for n in before if not torch.equal(before[n], after[n])}
        gates = routers(source)
        stored = {renamed_name(layout_of(json.loads((source / "config.json").read_text())), n)
                  for n in gates} if form == FUSED else gates
        trained = json.loads((out / "training" / "summary.json").read_text())["trained"]
        if mode == "router-only":
            assert len(trained) == len(gates) and changed == stored, (form, changed)
        else:  # every parameter trains: each tensor changes but a DeepSeek-V3 router's bias
            assert stored <= changed and len(trained) > len(gates)
            kept = {n for n in classic(source) if n not in changed}
            if form == CLASSIC:  # (fused: a stack changes when any of its experts does)
                assert all(".experts." in n or n.endswith("e_score_correction_bias")
                           for n in kept), kept
        assert torch.isfinite(logits(out)).all()


def test_finetune_refuses_a_balancing_loss_the_model_does_not_compute(hub_moe, text, tmp_path):
    """transformers' DeepSeek-V3 returns no aux_loss (it balances with its routing bias)."""
    code, output = run("finetune", hub_moe("deepseek_v3", FUSED), tmp_path / "out", "--data",
                       text, "--aux-loss-coef", 0.01, *TRAIN)
    assert code == 2 and "no load-balancing loss" in output, output
    assert not (tmp_path / "out").exists()


def planted_text(alphabet: str, seed: int, words: int = 1500) -> str:
    rng = random.Random(seed)
    return " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 6)))
                    for _ in range(words))


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """(the new expert's text, the MoE's own text): planted in disjoint alphabets."""
    root = tmp_path_factory.mktemp("extend-text")
    (root / "digits.txt").write_text(planted_text("0123456789+-*", 1))
    (root / "letters.txt").write_text(planted_text("abcdefghijklm", 2))
    return root / "digits.txt", root / "letters.txt"


@pytest.fixture(scope="module")
def grown(hub_moe, texts, tmp_path_factory):
    """grown(family) -> (the dense expert, {form: (the extended MoE, extend's output)}): the
    MoE's expert 1 extracted as a dense model and perturbed, added to either form."""
    done = {}

    def make(family: str):
        if family not in done:
            root = tmp_path_factory.mktemp(f"grown-{family}")
            code, output = run("extract", hub_moe(family, CLASSIC), root / "one", "--expert", 1)
            assert code == 0, output
            dense = perturbed_copy(root / "one", root / "digits", scale=0.05, seed=3, only="mlp")
            outs = {}
            for form in FORMS:
                code, output = run("extend", hub_moe(family, form), root / form, "--expert",
                                   dense, "--calibration", f"digits={texts[0]}",
                                   "--calibration", f"moe={texts[1]}")
                assert code == 0, output
                outs[form] = (root / form, output)
            done[family] = dense, outs
        return done[family]

    return make


@pytest.mark.parametrize("family", EXTENDED)
def test_extend_keeps_every_old_tensor_and_adds_the_expert_in_the_sources_form(
        family, hub_moe, grown):
    dense, outs = grown(family)
    new = tensors(dense)
    for form in FORMS:
        source, (out, output) = hub_moe(family, form), outs[form]
        assert "note:" in output and "no stored router statistics" in output, output
        assert form_of(out) == form
        before, after = tensors(source), tensors(out)
        added = set(after) - set(before)  # classic: the new expert's own tensors; fused: none
        assert set(before) <= set(after) and all(".experts.3." in n for n in added), added
        assert bool(added) == (form == CLASSIC and family != "granitemoe"), added
        for name, old in before.items():  # a grown tensor's first E slices are the old ones
            assert torch.equal(after[name][:old.shape[0]], old), name
            assert after[name].shape[1:] == old.shape[1:], name
        with CheckpointReader(out, per_expert=True) as reader:
            layout = layout_of(reader.config)
            assert layout.expert_count(reader.config) == 4
            for layer in range(2):
                for proj in ("gate", "up", "down"):
                    assert torch.equal(reader.read(layout.expert_name(layer, 3, proj)),
                                       new[f"model.layers.{layer}.mlp.{proj}_proj.weight"])
        assert torch.isfinite(logits(out)).all()
    mine, theirs = classic(outs[CLASSIC][0]), classic(outs[FUSED][0])
    assert mine.keys() == theirs.keys()  # the two forms give the same model
    assert all(torch.equal(t, theirs[n]) for n, t in mine.items())


def chosen(model, tokenizer, path, expert: int) -> list[float]:
    """Per layer: the share of the text's tokens whose top-k routing includes `expert`."""
    ids = torch.tensor([tokenizer(path.read_text()[:2000])["input_ids"][:256]])
    seen = {}
    gates = find_routers(model, expert + 1)
    hooks = [gate.register_forward_hook(
        lambda module, args, _, layer=layer: seen.__setitem__(
            layer, args[0].reshape(-1, args[0].shape[-1]) @ module.weight.T))
        for layer, gate in gates]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    k = model.config.num_experts_per_tok
    return [float((seen[layer].topk(k, dim=-1).indices == expert).any(-1).float().mean())
            for layer, _ in gates]


@pytest.mark.parametrize("family", ["mixtral", "granitemoe"])
def test_the_new_rows_route_the_new_text_to_the_new_expert(family, grown, texts):
    """Fitted on the two texts, the new expert is in the top-k of most of its own text's
    tokens and of few of the MoE's; with its rows zeroed the first check fails."""
    _, outs = grown(family)
    out = outs[FUSED][0]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    own, other = chosen(model, tokenizer, texts[0], 3), chosen(model, tokenizer, texts[1], 3)
    print(f"{family}: new expert in the top-k of its text {own}, of the MoE's {other}")
    assert min(own) >= 0.8 and max(other) <= 0.2
    for _, gate in find_routers(model, 4):
        gate.weight.data[3] = 0
    assert min(chosen(model, tokenizer, texts[0], 3)) < 0.8


def test_extend_refusals_name_what_to_do(hub_moe, grown, texts, tmp_path):
    dense, _ = grown("mixtral")
    source = hub_moe("mixtral", FUSED)
    code, output = run("extend", source, tmp_path / "out", "--expert", dense, "--calibration",
                       f"digits={texts[0]}")
    assert code == 2 and "moe=PATH" in output and "not built by moemerge" in output, output
    code, output = run("extend", source, tmp_path / "out", "--expert", dense, "--calibration",
                       f"digits={texts[0]}", "--calibration", f"moe={texts[1]}",
                       "--recalibrate")
    assert code == 2 and "leave --recalibrate out" in output, output
    for family in ("olmoe", "deepseek_v3"):
        code, output = run("extend", hub_moe(family, FUSED), tmp_path / "out", "--expert",
                           dense, "--calibration", f"digits={texts[0]}", "--calibration",
                           f"moe={texts[1]}")
        assert code == 1 and "no dense model family" in output and family in output, output
    assert not (tmp_path / "out").exists()


@needs_5
def test_extend_of_a_fused_build_is_written_fused(model_factory, texts, tmp_path):
    """A calibrated build stored fused (`output.experts: fused`) grows in its own form: the
    classic build's extension, read under classic names (its deeper router within float
    rounding: captured through the fused stacks)."""
    from moemerge.api import build

    base = model_factory("llama")
    experts = {d: perturbed_copy(base, tmp_path / d, scale=0.05, seed=i, only="mlp")
               for i, d in enumerate(("digits", "letters", "marks"))}
    (tmp_path / "marks.txt").write_text(planted_text("!#$%&()[]{}<>", 3))
    outs = {}
    for form in FORMS:
        recipe = tmp_path / f"{form}.yaml"
        recipe.write_text("\n".join([
            "kind: moe", f"base_model: {base}", "experts_per_token: 1", "experts:",
            *(f"  - {{model: {experts[d]}, name: {d}}}" for d in ("digits", "letters")),
            f"calibration: {{data: [digits={texts[0]}, letters={texts[1]}], max_tokens: 512, "
            "seq_len: 32}", f"output: {{experts: {form}}}"]) + "\n")
        build(recipe, tmp_path / f"two-{form}", progress=False)
        code, output = run("extend", tmp_path / f"two-{form}", tmp_path / form, "--expert",
                           experts["marks"], "--calibration", f"marks={tmp_path}/marks.txt",
                           "--keep-shared")
        assert code == 0 and "note:" not in output, output
        assert form_of(tmp_path / form) == form
        outs[form] = classic(tmp_path / form)
    assert outs[CLASSIC].keys() == outs[FUSED].keys()
    for name, tensor in outs[CLASSIC].items():
        torch.testing.assert_close(outs[FUSED][name], tensor, rtol=0,
                                   atol=0 if "gate.weight" not in name else 1e-6)
    assert torch.isfinite(logits(tmp_path / FUSED)).all()
