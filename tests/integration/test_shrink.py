"""`moemerge shrink` / `kind: shrink`: the oracles of docs/shrink.md.

- K = N changes nothing: every tensor bit for bit, the logits too (the router repair has
  nothing to refit).
- Merging two identical experts with identical router rows (top-1 routing, --no-repair) is
  exact: the merged expert is that expert and its row that row.
- K = N − 1 prunes the least salient expert by a REAP saliency computed plainly here.
- prune / merge outputs (with repair) load in plain transformers and generate; the recipe copy
  rebuilds the same model; errors name what is wrong.
"""

import json

import pytest
import torch
import transformers
import yaml
from conftest import TEXT, build_noting, needs_class, perturbed_copy, write_recipe
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moemerge.api import build
from moemerge.built.shrink import shrink
from moemerge.cli import app
from moemerge.errors import CheckpointError, RecipeError
from moemerge.recipe.load import parse_recipe

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
runner = CliRunner()


def logits(path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def tensors(path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(path.glob("*.safetensors")):
        found |= load_file(file)
    return found


def make_moe(root, base, count=4, top_k=2, shared="none"):
    experts = [perturbed_copy(base, root / f"e{i}", scale=0.05, seed=i + 1, only="mlp")
               for i in range(count)]
    recipe = write_recipe(root / "moe.yaml", "\n".join([
        "kind: moe", f"base_model: {base}", "experts:", *(f"  - {e}" for e in experts),
        f"experts_per_token: {top_k}", f"shared_expert: {shared}",
        "router: {init: random, std: 0.3}"]) + "\n")
    build_noting(recipe, root / "moe", progress=False, verify="structure")
    return root / "moe"


@pytest.fixture
def calib(tmp_path):
    path = tmp_path / "calib.txt"
    path.write_text(TEXT * 60)
    return path


def run(moe, out, calib, **fields):
    fields.setdefault("experts", 3)
    data = {"kind": "shrink", "model": str(moe), "calibration": {"data": [str(calib)],
                                                                 "seq_len": 32}, **fields}
    recipe = parse_recipe(data)
    return shrink(recipe, out, recipe_dir=moe.parent, recipe_text=yaml.safe_dump(data))


FLEX_OLMO = pytest.param("olmo2", "none", marks=needs_class("FlexOlmoForCausalLM"))


@pytest.mark.parametrize("family,shared", [("llama", "none"), ("qwen2", "base"),
                                           ("qwen3", "none"), FLEX_OLMO])
@pytest.mark.parametrize("method", ["prune", "merge"])
def test_keeping_every_expert_changes_nothing(family, shared, method, model_factory, tmp_path,
                                              calib):
    moe = make_moe(tmp_path, model_factory(family), shared=shared)
    run(moe, tmp_path / "out", calib, experts=4, method=method)
    before, after = tensors(moe), tensors(tmp_path / "out")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert torch.equal(logits(moe), logits(tmp_path / "out"))


def duplicate_expert(moe, dst, top_k):
    """A copy of `moe` whose expert 1 (weights and router row) equals expert 0, routing top_k."""
    import shutil

    shutil.copytree(moe, dst)
    for file in dst.glob("*.safetensors"):
        found = load_file(file)
        for name in list(found):
            if ".experts.1." in name:
                found[name] = found[name.replace(".experts.1.", ".experts.0.")].clone()
            if name.endswith("block_sparse_moe.gate.weight"):
                found[name][1] = found[name][0]
        save_file(found, file, metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": top_k}))
    return dst


def test_merging_two_identical_experts_is_exact(model_factory, tmp_path, calib):
    """Top-1 routing: the original sends a token to expert 0 or 1 (the same FFN, weight 1)
    exactly when the merged router sends it to the merged expert, whose row is their common
    row (the frequency-weighted mean of equal rows)."""
    moe = duplicate_expert(make_moe(tmp_path, model_factory("llama")), tmp_path / "dup", 1)
    run(moe, tmp_path / "out", calib, experts=3, method="merge", repair=False)
    card = json.loads((tmp_path / "out" / "shrink.json").read_text())
    assert all(layer["groups"][0] == [0, 1] for layer in card["layers"])
    torch.testing.assert_close(logits(tmp_path / "out"), logits(moe), atol=2e-5, rtol=1e-4)
    run(moe, tmp_path / "repaired", calib, experts=3, method="merge", repair=True)
    assert (logits(tmp_path / "repaired") - logits(moe)).abs().max() < 1.0


def test_a_group_merged_by_a_registry_method_is_that_method_of_its_members(
        model_factory, tmp_path, calib):
    """merge_method karcher: K = 3 of 4 merges one pair per layer; the merged expert is the
    registry's karcher mean of the pair's weights (with their saliency weights), the rest
    copies; slerp cannot take a group of three, and prune takes no merge_method."""
    from moemerge.merge.dispatch import merge

    moe = make_moe(tmp_path, model_factory("llama"))
    run(moe, tmp_path / "out", calib, method="merge", merge_method="karcher", repair=False)
    card = json.loads((tmp_path / "out" / "shrink.json").read_text())
    original, out = tensors(moe), tensors(tmp_path / "out")
    name = "model.layers.{}.block_sparse_moe.experts.{}.w2.weight"
    for layer in card["layers"]:
        for j, (group, weights) in enumerate(zip(layer["groups"], layer["weights"],
                                                 strict=True)):
            members = [original[name.format(layer["layer"], e)] for e in group]
            expected = members[0] if len(group) == 1 else merge(
                "karcher", base=None, tensors=members, weights=weights)
            torch.testing.assert_close(out[name.format(layer["layer"], j)], expected)
            if len(group) > 1:  # not the weighted mean the default gives
                mean = sum(w * m for w, m in zip(weights, members, strict=True))
                assert (out[name.format(layer["layer"], j)] - mean).abs().max() > 1e-4
        assert sorted(map(len, layer["groups"])) == [1, 1, 2]
    with pytest.raises(RecipeError, match="slerp merges at most 2 experts"):
        run(moe, tmp_path / "slerp", calib, experts=1, method="merge", merge_method="slerp")
    with pytest.raises(RecipeError, match="merge_method: karcher applies to method: merge"):
        run(moe, tmp_path / "pruned", calib, method="prune", merge_method="karcher")
    with pytest.raises(RecipeError, match="'ties' cannot merge a group of experts"):
        run(moe, tmp_path / "ties", calib, method="merge", merge_method="ties")
    assert not any((tmp_path / d).exists() for d in ("slerp", "pruned", "ties"))


def plain_reap(moe, text_ids, layer, num_experts, top_k):
    """REAP of each expert of `layer`, computed with the model's own modules: mean over the
    tokens routed to e of (renormalised top-k weight) × ‖FFN_e(x)‖."""
    model = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
    decoder = model.model.layers[layer]  # transformers < 5 names Mixtral's block block_sparse_moe
    block = getattr(decoder, "mlp", None) or decoder.block_sparse_moe
    seen = []
    handle = block.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        for start in range(0, text_ids.shape[0], 8):
            model(input_ids=text_ids[start:start + 8, :-1])
    handle.remove()
    x = torch.cat([s.reshape(-1, s.shape[-1]) for s in seen]).detach()
    probs = torch.softmax(x @ block.gate.weight.detach().T, -1)
    top_w, top_i = probs.topk(top_k, -1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    gate_up = block.experts.gate_up_proj.detach()  # [E, 2I, H], gate rows first
    down = block.experts.down_proj.detach()  # [E, H, I]
    reap = []
    for e in range(num_experts):
        rows, slot = torch.nonzero(top_i == e, as_tuple=True)
        g, u = (x[rows] @ gate_up[e].T).chunk(2, -1)
        out = (torch.nn.functional.silu(g) * u) @ down[e].T
        reap.append(float((top_w[rows, slot] * out.norm(dim=-1)).mean()) if len(rows) else 0.0)
    return reap


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="the plain REAP "
                    "reference reads transformers 5's fused expert weights (gate_up_proj)")
def test_pruning_one_expert_removes_the_least_salient(model_factory, tmp_path, calib):
    from moemerge.eval.perplexity import load_tokenizer
    from moemerge.recipe.base import CalibrationText
    from moemerge.routing.calibration import calibration_windows

    moe = make_moe(tmp_path, model_factory("llama"))
    run(moe, tmp_path / "out", calib, experts=3, method="prune", repair=False)
    card = json.loads((tmp_path / "out" / "shrink.json").read_text())
    ids, _, _ = calibration_windows(CalibrationText(data=[str(calib)], seq_len=32),
                                    {"c": [calib.read_text()]}, load_tokenizer(moe))
    for layer in card["layers"]:
        reap = plain_reap(moe, ids, layer["layer"], 4, 2)
        torch.testing.assert_close(torch.tensor(layer["reap"]), torch.tensor(reap),
                                   atol=1e-5, rtol=1e-4)
        assert layer["removed"] == [min(range(4), key=lambda e: (reap[e], -e))]
        kept = [e for e in range(4) if e not in layer["removed"]]
        assert layer["groups"] == [[e] for e in kept]
    out, original = tensors(tmp_path / "out"), tensors(moe)
    removed = card["layers"][0]["removed"][0]
    kept = [e for e in range(4) if e != removed]
    for j, e in enumerate(kept):
        name = "model.layers.0.block_sparse_moe.experts.{}.w1.weight"
        assert torch.equal(out[name.format(j)], original[name.format(e)])
    router = "model.layers.0.block_sparse_moe.gate.weight"
    assert torch.equal(out[router], original[router][kept])


@pytest.mark.parametrize("family,shared", [("llama", "none"), ("qwen2", "base"),
                                           ("qwen3", "none"), ("granite", "none"), FLEX_OLMO])
@pytest.mark.parametrize("method", ["prune", "merge"])
def test_shrunk_moe_loads_and_generates(family, shared, method, model_factory, tmp_path, calib):
    moe = make_moe(tmp_path, model_factory(family), shared=shared)
    done = run(moe, tmp_path / "out", calib, experts=1, method=method)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config.get("num_local_experts", config.get("num_experts")) == 1
    assert config["num_experts_per_tok"] == 1 and done.notes  # clipped from 2, with a note
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    generated = model.generate(IDS[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape[1] == 8
    assert (tmp_path / "out" / "README.md").is_file()


def test_recipe_copy_rebuilds_the_same_model(model_factory, tmp_path, calib):
    moe = make_moe(tmp_path, model_factory("llama"))
    result = runner.invoke(app, ["shrink", str(moe), str(tmp_path / "out"), "--experts", "2",
                                 "--method", "merge", "--calibration", str(calib),
                                 "--seq-len", "32"])
    assert result.exit_code == 0, result.output
    copy = tmp_path / "out" / "moemerge_recipe.yaml"
    assert yaml.safe_load(copy.read_text())["kind"] == "shrink"
    recipe = write_recipe(tmp_path / "again.yaml", copy.read_text())
    build(recipe, tmp_path / "again", progress=False)
    first, again = tensors(tmp_path / "out"), tensors(tmp_path / "again")
    assert first.keys() == again.keys()
    assert all(torch.equal(first[n], again[n]) for n in first)


def test_errors_say_what_is_wrong(model_factory, tmp_path, calib):
    moe = make_moe(tmp_path, model_factory("llama"))
    with pytest.raises(RecipeError, match="experts: 5 is more than the 4"):
        run(moe, tmp_path / "out", calib, experts=5)
    with pytest.raises(CheckpointError, match="not a token-routed MoE"):
        run(model_factory("llama"), tmp_path / "out", calib)
    with pytest.raises(RecipeError, match="calibration.data"):
        run(moe, tmp_path / "out", tmp_path / "missing.txt")
    with pytest.raises(RecipeError, match="not both"):
        parse_recipe({"kind": "shrink", "model": "m", "experts": 2, "ratio": 0.5,
                      "calibration": {"data": "c.txt"}})
    assert not (tmp_path / "out").exists()
    bad = write_recipe(tmp_path / "bad.yaml", "kind: shrink\nmodel: m\nexperts: 0\n"
                       "method: cut\ncalibration: {data: c.txt}\n")
    with pytest.raises(RecipeError) as caught:
        build(bad, tmp_path / "out", progress=False)
    text = str(caught.value)
    assert "bad.yaml" in text and "experts:" in text and "method:" in text
