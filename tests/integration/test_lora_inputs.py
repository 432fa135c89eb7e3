"""A PEFT LoRA adapter on a model reference (`model: base+adapter`, `{model, lora}`): applied
as the model is read (io/adapter.py), in every recipe kind and in `import-mergekit`.

peft is the oracle: each adapter is made with peft's own `LoraConfig` / `get_peft_model` on a
tiny model (its factors random, so every delta is non-zero) and saved with `save_pretrained`.
The average of the one model `base+adapter` must be peft's `merge_and_unload()` weight for
weight, and its logits the unmerged `PeftModel`'s; an MoE of LoRA experts must be the MoE of
the same experts merged into dense models; a wrong scale is shown to fail the comparison."""

import json
import shutil

import pytest
import torch
import yaml
from lora_adapters import LINEARS, build, load, logits, make_adapter
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moemerge.api import build_file
from moemerge.build_options import BuildOptions
from moemerge.cli import app
from moemerge.errors import CheckpointError, MismatchError, RecipeError
from moemerge.recipe import parse_recipe
from moemerge.recipe.mergekit import convert

peft = pytest.importorskip("peft")

WEIGHTS = dict(atol=1e-6, rtol=1e-6)  # float32: the same sums (bit for bit here)
LOGITS = dict(atol=2e-5, rtol=1e-4)  # merged weights against the unmerged forward


def edit_config(adapter, dst, **changes):
    """A copy of `adapter` with adapter_config.json changed."""
    shutil.copytree(adapter, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def alone(base, adapter) -> dict:
    """`kind: merge`, method average, over the one model base+adapter: the model itself."""
    return {"kind": "merge", "models": [f"{base}+{adapter}"], "merge": {"method": "average"}}


def check_is_peft(out, base, adapter):
    """Every tensor of `out` is merge_and_unload()'s, and its logits the PeftModel's."""
    with_adapter = peft.PeftModel.from_pretrained(load(base), adapter).eval()
    want_logits = logits(with_adapter)
    merged = with_adapter.merge_and_unload().state_dict()
    got = load_file(out / "model.safetensors")
    assert set(got) == set(merged)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, merged[name], **WEIGHTS, msg=name)
    torch.testing.assert_close(logits(load(out)), want_logits, **LOGITS)
    assert (logits(load(base)) - want_logits).abs().max() > 1e-3  # the adapter changes it
    return got


@pytest.fixture(scope="module")
def llama(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def plain(llama, tmp_path_factory):
    return make_adapter(llama, tmp_path_factory.mktemp("lora") / "plain", r=4, lora_alpha=8,
                        target_modules=LINEARS)


CASES = {
    "rslora": dict(r=4, lora_alpha=6, use_rslora=True, target_modules=LINEARS),
    "patterns": dict(r=4, lora_alpha=8, target_modules=LINEARS,
                     rank_pattern={"q_proj": 2, "model.layers.1.mlp.down_proj": 6},
                     alpha_pattern={"v_proj": 3, r"layers\.0\.mlp\..*": 5}),
    "modules_to_save": dict(r=3, lora_alpha=5, target_modules=["q_proj", "v_proj"],
                            modules_to_save=["lm_head", "model.norm"], perturb_saved=True),
    "embedding": dict(r=4, lora_alpha=4, target_modules=["embed_tokens", "o_proj", "up_proj"]),
}


def test_plain_adapter_is_peft_merged(llama, plain, tmp_path):
    _, notes = build(tmp_path, alone(llama, plain))
    got = check_is_peft(tmp_path / "out", llama, plain)
    assert not notes, notes
    base = load_file(llama / "model.safetensors")  # untargeted tensors: the base's bytes
    assert torch.equal(got["model.norm.weight"], base["model.norm.weight"])
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])


@pytest.mark.parametrize("case", CASES)
def test_peft_options_are_applied_as_peft_applies_them(case, llama, tmp_path):
    config = dict(CASES[case])
    adapter = make_adapter(llama, tmp_path / "adapter", perturb_saved=config.pop(
        "perturb_saved", False), **config)
    recipe = {"kind": "merge", "models": [{"model": str(llama), "lora": str(adapter)}],
              "merge": {"method": "average"}}
    build(tmp_path, recipe)
    check_is_peft(tmp_path / "out", llama, adapter)


@pytest.mark.filterwarnings("ignore:Adapter 'default'.*invalid shape")  # peft's, of lora_B.bias
def test_bias_all_and_lora_bias_on_qwen2(model_factory, tmp_path):
    """bias: all saves every bias (trained): they replace the base's; lora_bias adds s·b."""
    qwen = model_factory("qwen2")
    adapter = make_adapter(qwen, tmp_path / "adapter", r=2, lora_alpha=3, bias="all",
                           lora_bias=True, target_modules=["q_proj", "k_proj", "v_proj"],
                           perturb_saved=True)
    result, _ = build(tmp_path, alone(qwen, adapter))
    check_is_peft(tmp_path / "out", qwen, adapter)
    described = "\n".join(result.plan.describe_job(j) for j in result.plan.jobs)
    assert "lora_bias of LoRA r=2" in described


def test_a_bfloat16_base_and_adapter_round_as_peft_does(model_factory, tmp_path):
    """A bf16 base with factors stored in bf16: peft upcasts the factors, adds the float32
    delta to the weight and rounds once to bf16; the build writes the same bits."""
    base = model_factory("llama", dtype=torch.bfloat16, seed=3)
    adapter = make_adapter(base, tmp_path / "adapter", r=4, lora_alpha=8,
                           target_modules="all-linear")
    file = adapter / "adapter_model.safetensors"
    save_file({n: t.bfloat16() for n, t in load_file(file).items()}, file)
    build(tmp_path, alone(base, adapter))
    with_adapter = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16), adapter)
    want = with_adapter.merge_and_unload().state_dict()
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert all(torch.equal(got[n], want[n]) for n in got), [
        n for n in got if not torch.equal(got[n], want[n])]


def test_fan_in_fan_out_on_linear_layers_is_ignored_as_peft_does(llama, plain, tmp_path):
    """No family moemerge reads stores GPT-2's Conv1D; peft ignores fan_in_fan_out on a
    torch.nn.Linear (with a warning), and so does moemerge, with a note."""
    adapter = edit_config(plain, tmp_path / "fifo", fan_in_fan_out=True)
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        _, notes = build(tmp_path, alone(llama, adapter))
        check_is_peft(tmp_path / "out", llama, adapter)
    assert any("fan_in_fan_out is ignored" in n for n in notes), notes


def test_a_wrong_scale_fails_the_comparison(llama, plain, tmp_path):
    """The comparison can fail: the same factors with lora_alpha doubled are not peft's merge
    of the adapter (and are peft's merge of the doubled one)."""
    doubled = edit_config(plain, tmp_path / "doubled", lora_alpha=16)
    build(tmp_path, alone(llama, doubled))
    with pytest.raises(AssertionError):
        check_is_peft(tmp_path / "out", llama, plain)
    check_is_peft(tmp_path / "out", llama, doubled)


def test_moe_of_lora_experts_is_the_moe_of_their_merged_models(llama, tmp_path):
    """kind: moe whose experts are base+adapter: the same bytes as the MoE of the experts
    written as dense models by peft's merge_and_unload, with no merged copy written."""
    adapters = [make_adapter(llama, tmp_path / f"a{i}", seed=i + 1, r=4, lora_alpha=8,
                             target_modules="all-linear") for i in range(2)]
    dense = []
    for i, adapter in enumerate(adapters):
        merged = peft.PeftModel.from_pretrained(load(llama), adapter).merge_and_unload()
        merged.save_pretrained(tmp_path / f"dense{i}")
        dense.append(tmp_path / f"dense{i}")
    moe = {"kind": "moe", "base_model": str(llama), "experts_per_token": 1,
           "router": {"init": "random"}}
    lora = {**moe, "experts": [{"model": f"{llama}+{a}", "name": f"e{i}"}
                               for i, a in enumerate(adapters)]}
    result, _ = build(tmp_path, lora, "lora_moe")
    build(tmp_path, {**moe, "experts": [{"model": str(d), "name": f"e{i}"}
                                         for i, d in enumerate(dense)]}, "dense_moe")
    got = load_file(tmp_path / "lora_moe" / "model.safetensors")
    want = load_file(tmp_path / "dense_moe" / "model.safetensors")
    assert set(got) == set(want)
    for name in got:
        torch.testing.assert_close(got[name], want[name], **WEIGHTS, msg=name)
    assert not list(tmp_path.glob("lora_moe/*merged*"))
    described = "\n".join(result.plan.describe_job(j) for j in result.plan.jobs)
    assert "e0 = base + LoRA r=4" in described and "e1 = base + LoRA r=4" in described


@pytest.mark.parametrize("kind", ["upcycle", "seq_routed"])
def test_other_kinds_read_the_adapted_model(kind, llama, plain, tmp_path):
    """upcycle's dense model and a seq_routed expert with an adapter: their tensors are
    peft's merge (an untouched expert stays the base)."""
    ref = f"{llama}+{plain}"
    recipe = ({"kind": "upcycle", "model": ref, "experts": 2} if kind == "upcycle" else
              {"kind": "moe", "assembly": "seq_routed", "base_model": str(llama),
               "router": {"init": "random"},
               "experts": [{"model": ref, "name": "a"}, {"model": str(llama), "name": "b"}]})
    build(tmp_path, recipe)
    got = load_file(tmp_path / "out" / "model.safetensors")
    merged = peft.PeftModel.from_pretrained(load(llama), plain).merge_and_unload().state_dict()
    name = "model.layers.1.self_attn.o_proj.weight"
    own = name if kind == "upcycle" else f"experts.0.{name}"
    torch.testing.assert_close(got[own], merged[name], **WEIGHTS)
    if kind == "seq_routed":
        base = load_file(llama / "model.safetensors")
        assert torch.equal(got[f"experts.1.{name}"], base[name])


def test_slices_of_two_adapters_on_one_base_stay_apart(llama, plain, tmp_path):
    """Layer stacking (passthrough slices) of base+plain's layer 0 and base+other's layer 1:
    two inputs, though their base is one directory."""
    other = make_adapter(llama, tmp_path / "other", seed=7, r=2, lora_alpha=2,
                         target_modules=LINEARS)
    recipe = {"kind": "merge", "merge": {"method": "passthrough"}, "slices": [
        {"sources": [{"model": f"{llama}+{plain}", "layers": [0, 1]}]},
        {"sources": [{"model": f"{llama}+{other}", "layers": [1, 2]}]}]}
    result, _ = build(tmp_path, recipe)
    assert result.plan.labels == ["plain", "other"]
    got = load_file(tmp_path / "out" / "model.safetensors")
    for layer, adapter in enumerate((plain, other)):
        merged = peft.PeftModel.from_pretrained(load(llama), adapter).merge_and_unload()
        want = merged.state_dict()
        for name in (f"model.layers.{layer}.self_attn.q_proj.weight",
                     f"model.layers.{layer}.mlp.down_proj.weight"):
            torch.testing.assert_close(got[name], want[name], **WEIGHTS, msg=name)


def test_dry_run_shows_lora_tensors_and_counts_the_delta(llama, plain, tmp_path, capsys):
    result, _ = build(tmp_path, alone(llama, plain), dry_run=True)
    lines = {j.output: result.plan.describe_job(j) for j in result.plan.jobs}
    assert lines["model.layers.0.mlp.down_proj.weight"].endswith("= base + LoRA r=4")
    assert "LoRA" not in lines["model.norm.weight"]
    assert result.plan.labels == ["plain"]  # named after the adapter
    # the delta and the float32 weight of the largest targeted tensor, and its factors
    numel = 64 * 32
    assert result.plan.making_bytes == 4 * numel + 4 * (4 * 64 + 4 * 32)
    assert result.estimate.peak_bytes >= result.plan.making_bytes


def test_a_pickled_adapter_needs_allow_pickle(llama, tmp_path):
    torch.manual_seed(0)
    model = peft.get_peft_model(load(llama), peft.LoraConfig(
        r=2, lora_alpha=2, init_lora_weights=False, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    with pytest.raises(CheckpointError, match=r"adapter_model\.bin is a pickled adapter.*"
                                              r"--allow-pickle"):
        build(tmp_path, alone(llama, tmp_path / "bin"))
    build(tmp_path, alone(llama, tmp_path / "bin"), "allowed", allow_pickle=True)
    check_is_peft(tmp_path / "allowed", llama, tmp_path / "bin")


@pytest.mark.parametrize("changes, message", [
    ({"peft_type": "IA3"}, r"is a IA3 adapter \(peft_type\)"),
    ({"use_dora": True}, r"uses DoRA .*\(use_dora\)"),
    ({"target_parameters": ["mlp.experts.down_proj"]}, r"target_parameters"),
    ({"init_lora_weights": "pissa"}, r"init_lora_weights='pissa'.*changes the base weights"),
    ({"alora_invocation_tokens": [5, 6]}, r"aLoRA"),
    ({"r": 8}, r"not of rank 8"),
])
def test_other_adapters_are_refused_naming_the_type_and_file(llama, plain, tmp_path, changes,
                                                               message):
    adapter = edit_config(plain, tmp_path / "other", **changes)
    with pytest.raises(CheckpointError, match=message) as info:
        build(tmp_path, alone(llama, adapter))
    assert str(adapter) in str(info.value) and "adapter_config.json" in str(info.value)


def test_an_adapter_of_another_model_names_tensor_adapter_and_model(model_factory, plain,
                                                                     tmp_path):
    wider = model_factory("llama", hidden=48)
    with pytest.raises(MismatchError) as info:
        build(tmp_path, alone(wider, plain))
    text = str(info.value)
    assert "shape mismatch for tensor 'model.layers.0." in text
    assert str(plain) in text and str(wider) in text


def test_another_base_name_is_a_note(llama, plain, tmp_path):
    """base_model_name_or_path naming another local directory: a note, and it builds."""
    other = tmp_path / "other-base"
    shutil.copytree(llama, other)
    adapter = edit_config(plain, tmp_path / "named", base_model_name_or_path=str(other))
    _, notes = build(tmp_path, alone(llama, adapter))
    assert any(f"was trained on {other}" in n for n in notes), notes
    adapter = edit_config(plain, tmp_path / "hub", base_model_name_or_path="org/some-model")
    _, notes = build(tmp_path, alone(llama, adapter), "local")  # a hub id against a path
    assert not notes, notes


def test_the_plus_spelling_and_its_edge_cases():
    recipe = parse_recipe({"kind": "merge", "models": ["a/b+c/d", {"model": "x+y", "lora": None},
                                                      {"model": "m", "lora": "l",
                                                       "lora_revision": "v1"}],
                           "merge": {"method": "average"}})
    (one, literal, given) = recipe.models
    assert (one.model, one.lora) == ("a/b", "c/d")
    assert (literal.model, literal.lora) == ("x+y", None)
    assert (given.model, given.lora, given.lora_revision) == ("m", "l", "v1")
    for bad in ("a+b+c", "+b", "a+"):
        with pytest.raises(RecipeError, match=r"base\+adapter \(one '\+'\)"):
            parse_recipe({"kind": "merge", "models": [bad], "merge": {"method": "average"}})
    with pytest.raises(RecipeError, match="lora_revision: given without"):
        parse_recipe({"kind": "merge", "models": [{"model": "m", "lora_revision": "v"}],
                      "merge": {"method": "average"}})


def test_import_mergekit_translates_model_plus_lora(llama, plain, tmp_path):
    config = {"merge_method": "linear", "dtype": "float32",
              "models": [{"model": f"{llama}+{plain}", "parameters": {"weight": 1.0}}]}
    recipe = convert(config, "config.yml").recipe
    assert recipe["models"][0]["model"] == str(llama)
    assert recipe["models"][0]["lora"] == str(plain)
    revisions = convert({"merge_method": "linear", "models": [
        {"model": "org/base@main+org/adapter@v2", "parameters": {"weight": 1}},
        {"model": {"model": {"path": "org/b"}, "lora": {"path": "org/l", "revision": "r"}},
         "parameters": {"weight": 1}}]}, "config.yml").recipe["models"]
    assert {k: revisions[0][k] for k in ("model", "revision", "lora", "lora_revision")} == {
        "model": "org/base", "revision": "main", "lora": "org/adapter", "lora_revision": "v2"}
    assert (revisions[1]["model"], revisions[1]["lora"], revisions[1]["lora_revision"]) == (
        "org/b", "org/l", "r")
    build(tmp_path, recipe)
    check_is_peft(tmp_path / "out", llama, plain)


def test_validate_names_a_missing_adapter(llama, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(alone(llama, tmp_path / "no-such-adapter")))
    result = CliRunner().invoke(app, ["validate", str(recipe)])
    assert result.exit_code == 2, result.output
    assert "LoRA adapter" in result.output and "no-such-adapter" in result.output


def test_the_prompt_inits_refuse_a_base_with_an_adapter(llama, plain, tmp_path):
    """The prompt inits run the base in transformers from its directory, where the adapter
    would be left out."""
    experts = [{"model": str(llama), "name": "a", "positive_prompts": ["x"]},
               {"model": f"{llama}+{plain}", "name": "b", "positive_prompts": ["y"]}]
    recipe = {"kind": "moe", "base_model": f"{llama}+{plain}", "experts": experts,
              "router": {"init": "prompts"}}
    with pytest.raises(RecipeError, match="runs the base model from its directory"):
        build(tmp_path, recipe, dry_run=True)


def test_loss_targets_run_each_expert_with_its_adapter(llama, plain, tmp_path):
    """Loss-target calibration runs every expert: `base+adapter` must run with its adapter,
    so the routers equal those calibrated against the adapter merged into a dense model (and
    differ from the routers of an expert run without it)."""
    from conftest import TEXT

    build(tmp_path, alone(llama, plain), name="merged")
    (tmp_path / "mixed.txt").write_text(TEXT * 8)
    calibration = {"router": {"init": "calibrate"},
                   "calibration": {"data": [str(tmp_path / "mixed.txt")], "targets": "loss",
                                   "seq_len": 16, "max_tokens": 256}}

    def routers(expert, name):
        recipe = {"kind": "moe", "base_model": str(llama), "experts": [
            {"model": str(llama), "name": "a"}, {**expert, "name": "b"}], **calibration}
        build(tmp_path, recipe, name=name)
        return load_file(tmp_path / name / "model.safetensors")[
            "model.layers.0.block_sparse_moe.gate.weight"]

    adapted = routers({"model": str(llama), "lora": str(plain)}, "adapted")
    torch.testing.assert_close(adapted, routers({"model": str(tmp_path / "merged")}, "dense"),
                               atol=1e-5, rtol=1e-4)
    assert (adapted - routers({"model": str(llama)}, "without")).abs().max() > 1e-3


def test_shrink_refuses_an_adapter():
    with pytest.raises(RecipeError, match="shrink reads the MoE as it is stored"):
        parse_recipe({"kind": "shrink", "model": "moe+adapter", "experts": 2,
                      "calibration": {"data": ["t.txt"]}})


def test_the_output_may_not_be_the_adapter_or_inside_it(llama, plain, tmp_path):
    """An adapter is an input like a model: OUT on it, or inside it, is refused before any
    work, with --force too, and the adapter is left as it was."""
    from moemerge.errors import RecipeError

    before = {p.name: p.read_bytes() for p in plain.iterdir() if p.is_file()}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(alone(llama, plain)))
    for out in (plain, plain / "inside"):
        with pytest.raises(RecipeError, match="adapter of input model"):
            build_file(path, out, BuildOptions(force=True))
    assert {p.name: p.read_bytes() for p in plain.iterdir() if p.is_file()} == before
    assert not (plain / "inside").exists()
