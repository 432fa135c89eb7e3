"""`kind: merge` over fine-tunes of one MoE (HARC's setting: expert e merged with expert e,
routers merged or recalibrated), and experts of MoEs as the inputs of other recipes (BAR /
FlexOlmo: several MoEs sharing an anchor expert become one), on checkpoints saved by
transformers' own classes in either on-disk form (tests/moe_families.py).

Oracles: a merge of identical fine-tunes is the MoE bit for bit; an average of two MoEs is
the mean of its inputs, tensor by tensor, in any form; a fine-tune whose experts were
permuted gives another merge (expert e is merged with expert e, not with another); an
`expert:` input reads the same tensors `moemerge extract` writes."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from moe_families import FAMILIES as ALL_FAMILIES
from moe_families import IDS, logits, save_moe, tiny_moe_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.architectures.forms import CLASSIC, FORMS, FUSED
from moemerge.errors import CheckpointError, MismatchError
from moemerge.io.reader import CheckpointReader

FAMILIES = sorted(ALL_FAMILIES)


def classic(path) -> dict[str, torch.Tensor]:
    """Every tensor of `path` under its classic name (moemerge's view of either form)."""
    with CheckpointReader(path) as reader:
        return {name: reader.read(name) for name in reader.names()}


@pytest.fixture(scope="module")
def moes(tmp_path_factory, tokenizer):
    """moes(family) -> (base in the classic form, two fine-tunes of it: one classic, one
    fused), each with a tokenizer."""
    made = {}

    def make(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            model = tiny_moe_model(family)
            dirs = [save_moe(model, root / f"base-{CLASSIC}", CLASSIC),
                    save_moe(model, root / f"base-{FUSED}", FUSED)]
            tuned = [perturbed_copy(dirs[i], root / f"tuned{i}", scale=0.05, seed=i + 1)
                     for i in range(2)]
            for path in (*dirs, *tuned):
                tokenizer.save_pretrained(path)
            made[family] = (dirs[0], *tuned)
        return made[family]

    return make


def merge_recipe(tmp_path, models, method="average", base=None, extra="", name="merge"):
    lines = ["kind: merge", *([f"base_model: {base}"] if base else []), "models:",
             *(f"  - {m}" for m in models), f"merge: {{method: {method}}}", extra]
    return write_recipe(tmp_path / f"{name}.yaml", "\n".join(lines) + "\n")


@pytest.mark.parametrize("family", FAMILIES)
def test_an_average_of_two_moes_is_their_mean_in_either_form(family, moes, tmp_path):
    base, classic_tuned, fused_tuned = moes(family)
    build(merge_recipe(tmp_path, [classic_tuned, fused_tuned]), tmp_path / "out",
          progress=False)
    a, b, out = classic(classic_tuned), classic(fused_tuned), classic(tmp_path / "out")
    assert out.keys() == a.keys() == b.keys()
    for name in out:
        torch.testing.assert_close(out[name], (a[name] + b[name]) / 2, rtol=0, atol=1e-7,
                                   msg=name)
    assert torch.isfinite(logits(tmp_path / "out")).all()


@pytest.mark.parametrize("family", ["mixtral", "granitemoe"])
def test_identical_fine_tunes_merge_to_the_moe_bit_for_bit(family, moes, tmp_path):
    """One fine-tune twice (once in each form): their average is it, bit for bit, and task
    arithmetic against the base gives it back to rounding (base + the mean of two equal task
    vectors)."""
    base, tuned, _ = moes(family)
    fused = save_moe(AutoModelForCausalLM.from_pretrained(tuned), tmp_path / "fused", FUSED)
    want = classic(tuned)
    build(merge_recipe(tmp_path, [tuned, fused]), tmp_path / "mean", progress=False)
    out = classic(tmp_path / "mean")
    assert out.keys() == want.keys() and all(torch.equal(out[n], want[n]) for n in out)
    build(merge_recipe(tmp_path, [tuned, fused], "task_arithmetic", base, name="ta"),
          tmp_path / "ta", progress=False)
    out = classic(tmp_path / "ta")
    for name in out:
        torch.testing.assert_close(out[name], want[name], rtol=0, atol=1e-6, msg=name)


def test_expert_e_is_merged_with_expert_e(moes, tmp_path):
    """A fine-tune whose experts 0 and 1 are swapped on disk merges into another model: the
    merge pairs experts by index (and so the output's expert 0 is the mean of the inputs'
    experts 0)."""
    base, tuned, other = moes("mixtral")
    swapped = perturbed_copy(tuned, tmp_path / "swapped", scale=0.0, seed=0)
    tensors = load_file(swapped / "model.safetensors")
    for layer in range(2):
        for w in ("w1", "w2", "w3"):
            one, two = (f"model.layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                        for e in (0, 1))
            tensors[one], tensors[two] = tensors[two], tensors[one]
    save_file(tensors, swapped / "model.safetensors", metadata={"format": "pt"})
    name = "model.layers.1.block_sparse_moe.experts.0.w1.weight"
    outs = {}
    for label, first in (("kept", tuned), ("swapped", swapped)):
        build(merge_recipe(tmp_path, [first, other], name=label), tmp_path / f"out-{label}",
              progress=False)
        outs[label] = classic(tmp_path / f"out-{label}")[name]
    assert torch.equal(outs["kept"], (classic(tuned)[name] + classic(other)[name]) / 2)
    assert not torch.allclose(outs["kept"], outs["swapped"], atol=1e-3)


def test_moes_with_other_expert_counts_or_layouts_are_refused(moes, tmp_path):
    mixtral = moes("mixtral")[1]
    four = tmp_path / "four"
    model = tiny_moe_model("mixtral")
    model.config.num_local_experts = 4
    bigger = AutoModelForCausalLM.from_config(model.config)
    save_moe(bigger, four, CLASSIC)
    with pytest.raises(MismatchError, match="3 experts per layer but .* has 4"):
        build(merge_recipe(tmp_path, [mixtral, four], name="counts"), tmp_path / "a",
              progress=False)
    with pytest.raises(MismatchError, match="architecture mismatch"):
        build(merge_recipe(tmp_path, [mixtral, moes("olmoe")[1]], name="layouts"),
              tmp_path / "b", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_moe_is_refused_as_a_dense_expert_with_the_way_to_take_one(moes, tmp_path):
    base, tuned, _ = moes("mixtral")
    recipe = write_recipe(tmp_path / "moe.yaml", f"kind: moe\nbase_model: {base}\n"
                          f"experts: [{tuned}, {tuned}]\n")
    with pytest.raises(MismatchError, match=r"is an MoE \(mixtral\).*expert: N"):
        build(recipe, tmp_path / "out", progress=False)


@pytest.mark.parametrize("form", FORMS)
def test_an_expert_input_reads_what_extract_writes(form, moes, tmp_path):
    """`{model: moe, expert: 2}` as a merge's only model: the output is that expert's dense
    model, the tensors `moemerge extract --expert 2` writes."""
    from typer.testing import CliRunner

    from moemerge.cli import app

    moe = moes("mixtral")[1 if form == CLASSIC else 2]
    result = CliRunner().invoke(app, ["extract", str(moe), str(tmp_path / "extracted"),
                                      "--expert", "2"])
    assert result.exit_code == 0, result.output
    build(merge_recipe(tmp_path, [f"{{model: {moe}, expert: 2}}"], "average"),
          tmp_path / "merged", progress=False)
    want, got = (load_file(tmp_path / d / "model.safetensors") for d in ("extracted", "merged"))
    assert want.keys() == got.keys() and all(torch.equal(want[n], got[n]) for n in want)


def test_moes_sharing_an_anchor_become_one_moe(moes, tmp_path):
    """BAR / FlexOlmo: the anchor (expert 0, shared by both MoEs) as the base and the base
    expert, the other experts routed beside it; streamed like any build. Each output expert
    holds the bytes of the expert it came from."""
    _, a, b = moes("mixtral")  # (two fine-tunes of one MoE: expert 0 stands for the anchor)
    recipe = write_recipe(tmp_path / "bar.yaml", "\n".join([
        "kind: moe", f"base_model: {{model: {a}, expert: 0}}", "experts:",
        f"  - {{model: {a}, expert: 1, name: a1}}", f"  - {{model: {b}, expert: 1, name: b1}}",
        f"  - {{model: {b}, expert: 2, name: b2}}", "include_base_expert: true",
        "experts_per_token: 2"]) + "\n")
    build(recipe, tmp_path / "out", progress=False)
    out, inputs = classic(tmp_path / "out"), {"a": classic(a), "b": classic(b)}
    expert = "model.layers.{}.block_sparse_moe.experts.{}.w2.weight"
    for slot, (source, index) in enumerate([("a", 1), ("b", 1), ("b", 2), ("a", 0)]):
        assert torch.equal(out[expert.format(1, slot)], inputs[source][expert.format(1, index)])
    assert torch.isfinite(logits(tmp_path / "out")).all()


def test_a_bad_expert_index_names_the_model_and_the_count(moes, tmp_path):
    from typer.testing import CliRunner

    from moemerge.cli import app

    moe = moes("mixtral")[1]
    with pytest.raises(CheckpointError, match=r"expert: 7, but it has 3 experts per layer"):
        build(merge_recipe(tmp_path, [f"{{model: {moe}, expert: 7}}"], "average"),
              tmp_path / "out", progress=False)
    dense = tmp_path / "extracted"
    CliRunner().invoke(app, ["extract", str(moe), str(dense), "--expert", "0"])
    with pytest.raises(CheckpointError, match="is not one"):
        build(merge_recipe(tmp_path, [f"{{model: {dense}, expert: 0}}"], "average",
                           name="dense"), tmp_path / "out2", progress=False)


def router_logits(path, ids) -> list[torch.Tensor]:
    """transformers' own router logits of every layer ([tokens, E]), output_router_logits."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return list(model(input_ids=ids, output_router_logits=True).router_logits)


def agreement(path, teacher, ids) -> float:
    """The share of tokens whose top-1 expert under `path` is the teacher's, over layers."""
    pairs = zip(router_logits(path, ids), router_logits(teacher, ids), strict=True)
    return float(torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in pairs]).mean())


def calibrated_merge(tmp_path, models, texts, init="calibrate", name="cal", base=None):
    data = ", ".join(f"{m.name}={t}" for m, t in zip(models, texts, strict=True))
    extra = (f"router: {{init: calibrate}}\ncalibration: {{data: [{data}], max_tokens: 1024, "
             "seq_len: 32}" if init == "calibrate" else "")
    out = tmp_path / f"out-{name}"
    build(merge_recipe(tmp_path, models, "ties" if base else "average", base, extra, name),
          out, progress=False)
    return out


def test_recalibrated_routers_route_as_the_inputs_did(moes, tmp_path, tokenizer):
    """Two fine-tunes whose routers were trained apart (random rows, large), merged: after
    the merge each text goes through the merged model much as through its own fine-tune
    once the routers are recalibrated, more than with the routers merged like any tensor
    (measured top-1 agreement with the text's own fine-tune: 56 % -> 88 % and 27 % -> 80 %);
    identical inputs recalibrate to their own routing (>= 97 % top-1)."""
    base, a, b = moes("mixtral")
    for path, seed in ((a, 5), (b, 6)):  # routers that disagree: new random rows, scale 1
        tensors = load_file(path / "model.safetensors")
        gen = torch.Generator().manual_seed(seed)
        for name in [n for n in tensors if n.endswith(("gate.weight",)) and "experts" not in n]:
            tensors[name] = torch.randn(tensors[name].shape, generator=gen)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    texts = []
    for i, line in enumerate(["def add(a, b):\n    return a + b\n",
                              "The sum of two numbers is their total.\n"]):
        texts.append(tmp_path / f"t{i}.txt")
        texts[-1].write_text(line * 80)
    ids = [torch.tensor([tokenizer(t.read_text()[:400])["input_ids"][:64]]) for t in texts]
    merged = calibrated_merge(tmp_path, [a, b], texts, "merge", "merged")
    calibrated = calibrated_merge(tmp_path, [a, b], texts)
    for teacher, text in zip((a, b), ids, strict=True):
        before, after = agreement(merged, teacher, text), agreement(calibrated, teacher, text)
        assert after > before + 0.1 and after >= 0.7, (before, after)
    same = calibrated_merge(tmp_path, [a, a], texts[:1] * 2, name="same")
    assert agreement(same, a, ids[0]) >= 0.97


def test_calibration_needs_moe_inputs_and_softmax_routers(moes, model_factory, tmp_path):
    from moemerge.errors import RecipeError

    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    dense = model_factory("llama")
    with pytest.raises(RecipeError, match="dense models, which have no routers"):
        calibrated_merge(tmp_path, [dense, dense], [text, text], name="dense")
    v3 = moes("deepseek_v3")[1]
    with pytest.raises(RecipeError, match="deepseek_v3 scores experts with a sigmoid"):
        calibrated_merge(tmp_path, [v3, v3], [text, text], name="v3")
    with pytest.raises(RecipeError, match="router.init is not 'calibrate'"):
        build(merge_recipe(tmp_path, [v3, v3], extra=f"calibration: {{data: [{text}]}}",
                           name="unread"), tmp_path / "x", progress=False)


def test_moemerges_own_deepseek_moes_merge_with_their_code(model_factory, tmp_path):
    """moemerge's DeepSeek-MoE (its modeling code shipped beside the weights): the merge keeps
    `auto_map` and the code, and is the mean of its inputs."""
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i + 1)
               for i in range(2)]
    recipe = write_recipe(tmp_path / "ds.yaml", "\n".join([
        "kind: moe", f"base_model: {base}", f"experts: [{experts[0]}, {experts[1]}]",
        "layout: deepseek", "shared_expert: base", "experts_per_token: 1"]) + "\n")
    build(recipe, tmp_path / "a", progress=False, warn=lambda message: None)
    tuned = perturbed_copy(tmp_path / "a", tmp_path / "b", scale=0.05, seed=9)
    build(merge_recipe(tmp_path, [tmp_path / "a", tuned]), tmp_path / "out", progress=False)
    a, b, out = classic(tmp_path / "a"), classic(tuned), classic(tmp_path / "out")
    assert all(torch.allclose(out[n], (a[n] + b[n]) / 2, rtol=0, atol=1e-7) for n in out)
    assert (tmp_path / "out" / "modeling_deepseek.py").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=True)
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=IDS).logits).all()


@pytest.mark.parametrize("family", sorted(set(ALL_FAMILIES) - {"deepseek_v3"}))
def test_routers_recalibrate_in_every_softmax_family(family, moes, tmp_path, tokenizer):
    """Every family whose routers softmax their logits: the calibrated merge builds, loads
    with finite logits, and its routers are the fit's, not the merged ones."""
    _, a, b = moes(family)
    text = tmp_path / "t.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 60)
    merged = calibrated_merge(tmp_path, [a, b], [text, text], "merge", "merged")
    calibrated = calibrated_merge(tmp_path, [a, b], [text, text])
    before, after = classic(merged), classic(calibrated)
    routers = [n for n in before if n.endswith(("gate.weight", "router.layer.weight"))
               and before[n].shape[0] == 3]
    assert routers and all(not torch.equal(before[n], after[n]) for n in routers)
    assert all(torch.equal(before[n], after[n]) for n in before if n not in routers)
    assert torch.isfinite(logits(calibrated)).all()


def test_loss_targets_run_an_expert_input_as_the_dense_model_extract_writes(moes, tmp_path):
    """Loss-target calibration runs each expert: `{model: moe, expert: N}` must run as that
    expert's dense model, not as the MoE its directory holds, so the routers equal those
    calibrated on the extracted expert (and differ when the two experts are swapped)."""
    from conftest import TEXT
    from typer.testing import CliRunner

    from moemerge.cli import app

    _, a, _ = moes("mixtral")
    for index in (1, 2):
        result = CliRunner().invoke(app, ["extract", str(a), str(tmp_path / f"e{index}"),
                                          "--expert", str(index)])
        assert result.exit_code == 0, result.output
    (tmp_path / "mixed.txt").write_text(TEXT * 8)

    def routers(experts: list[str], name: str) -> torch.Tensor:
        recipe = write_recipe(tmp_path / f"{name}.yaml", "\n".join([
            "kind: moe", f"base_model: {tmp_path / 'e1'}", "experts:",
            *(f"  - {{{e}, name: x{i}}}" for i, e in enumerate(experts)),
            "router: {init: calibrate}",
            f"calibration: {{data: [{tmp_path / 'mixed.txt'}], targets: loss, seq_len: 16, "
            "max_tokens: 256}"]) + "\n")
        build(recipe, tmp_path / name, progress=False)
        return load_file(tmp_path / name / "model.safetensors")[
            "model.layers.0.block_sparse_moe.gate.weight"]

    taken = routers([f"model: {a}, expert: 1", f"model: {a}, expert: 2"], "taken")
    extracted = routers([f"model: {tmp_path / 'e1'}", f"model: {tmp_path / 'e2'}"], "extracted")
    torch.testing.assert_close(taken, extracted, atol=1e-5, rtol=1e-4)
    swapped = routers([f"model: {tmp_path / 'e2'}", f"model: {tmp_path / 'e1'}"], "swapped")
    assert (taken - swapped).abs().max() > 1e-3
