"""merged_experts builds (SMEAR / Lory / CAMEx), checked against the dense models they came from:
identical experts, one-hot merges, causality, generation, dynamic merging and export."""

import json

import pytest
import torch
from conftest import FAMILIES, generate_in_fresh_process, perturbed_copy, write_recipe
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moemerge.api import build
from moemerge.cli import app

IDS = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(0))


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                trust_remote_code=True).eval()


def merged(tmp_path, base, experts, name="moe", **extra):
    lines = ["kind: moe", "assembly: merged_experts", f"base_model: {base}",
             f"experts: [{', '.join(map(str, experts))}]", "segment_length: 4"]
    lines += [f"{k}: {v}" for k, v in extra.items()]
    build(write_recipe(tmp_path / f"{name}.yaml", "\n".join(lines) + "\n"), tmp_path / name,
          progress=False)
    return tmp_path / name


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("curvature, mask", [("none", "none"), ("{rank: 2}", "ties"),
                                             ("{rank: 1}", "dare")])
def test_identical_experts_give_the_dense_model(family, curvature, mask, model_factory,
                                                tmp_path):
    dense = model_factory(family)
    out = merged(tmp_path, dense, [dense, dense], curvature=curvature if curvature != "none"
                 else "{kind: none}", mask=f"{{kind: {mask}}}")
    torch.testing.assert_close(logits(load(out)), logits(load(dense)), atol=2e-6, rtol=1e-5)


def test_one_hot_scores_give_that_experts_dense_ffn(model_factory, tmp_path):
    """M = I, α = 1, scores one-hot on expert i: the layer is expert i's own FFN."""
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.1, seed=i, only="mlp")
               for i in range(3)]
    model = load(merged(tmp_path, base, experts, curvature="{rank: 2}"))
    h = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))
    for i, expert_dir in enumerate(experts):
        expert = load(expert_dir)
        for layer, mlp in enumerate(model.mlps()):
            mlp.scores = lambda h, i=i: torch.nn.functional.one_hot(
                torch.full(h.shape[:2], i), 3).float()
            model.step.weights = model.merged_weights()
            with torch.no_grad():
                ours, theirs = mlp(h), expert.model.layers[layer].mlp(h)
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dynamic", [False, True])
def test_no_output_depends_on_a_later_token(dynamic, model_factory, tmp_path):
    base = model_factory("qwen3")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.2, seed=i) for i in range(2)]
    model = load(merged(tmp_path, base, experts, dynamic=str(dynamic).lower()))
    reference = logits(model)
    for t in (0, 2, 5, 12):  # inside segment 0, at segment starts and ends
        changed = IDS.clone()
        changed[:, t] = (changed[:, t] + 7) % 256
        after = logits(model, changed)
        assert torch.equal(after[:, :t], reference[:, :t]), t
        assert not torch.equal(after[:, t:], reference[:, t:])


def perturbed(model, scale=0.05, router_scale=1.0, seed=0):
    """Curvature factors moved off the identity and decisive routers: what a fine-tune leaves,
    so that routing weights, masks and curvature all reach the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".curvature." in name:
                param.add_(scale * torch.randn(param.shape, generator=gen))
            elif name.endswith("router.weight"):
                param.copy_(router_scale * torch.randn(param.shape, generator=gen))
    return model


def decoded_logits(model, ids, prompt, chunk):
    """Logits of every position of `ids` [B, T]: the prompt in one forward, then `chunk` tokens
    per forward through the cache, as generation does."""
    with torch.no_grad():
        out = model(input_ids=ids[:, :prompt], use_cache=True)
        pieces, cache = [out.logits], out.past_key_values
        for start in range(prompt, ids.shape[1], chunk):
            out = model(input_ids=ids[:, start:start + chunk], past_key_values=cache,
                        use_cache=True)
            pieces.append(out.logits)
    return torch.cat(pieces, dim=1)


@pytest.fixture(scope="module")
def distinct_merged(model_factory, tmp_path_factory):
    """make(mask, dynamic) -> a 3-expert merged model of distinct experts (FFNs perturbed),
    rank-2 curvature factors away from the identity, segment_length 4."""
    root = tmp_path_factory.mktemp("distinct")
    base = model_factory("llama")
    experts = [perturbed_copy(base, root / f"e{i}", scale=0.2, seed=i, only="mlp")
               for i in range(3)]

    made = {}

    def make(mask, dynamic):
        if (mask, dynamic) not in made:
            out = merged(root, base, experts, name=f"m-{mask}-{dynamic}", curvature="{rank: 2}",
                         mask=f"{{kind: {mask}}}", dynamic=str(dynamic).lower())
            made[mask, dynamic] = perturbed(load(out))
        return made[mask, dynamic]

    return make


@pytest.mark.parametrize("mask, dynamic", [("none", False), ("ties", False), ("dare", True),
                                           ("ties", True)])
@pytest.mark.parametrize("prompt", [4, 8, 5, 7])  # 4 and 8 divide segment_length, 5 and 7 not
def test_cached_decoding_equals_the_full_forward(distinct_merged, mask, dynamic, prompt):
    model = distinct_merged(mask, dynamic)
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(prompt))
    full = logits(model, ids)
    for chunk in (1, 3):
        step = decoded_logits(model, ids, prompt, chunk)
        torch.testing.assert_close(step, full, atol=1e-5, rtol=0)
    # the comparison can fail: the routing after the prompt moves the logits far more than
    # the tolerance (keeping the prompt's scores, as before, would have been caught)
    stale = model.model.layers[0].mlp.router.weight
    with torch.no_grad():
        saved = stale.clone()
        stale.mul_(0.0)
        assert (logits(model, ids)[:, prompt:] - full[:, prompt:]).abs().max() > 1e-3
        stale.copy_(saved)


def test_generation_continues_segment_routing(distinct_merged):
    """Greedy and beam search: every generated token is the argmax of one full forward over the
    generated sequence (left-padded batch included)."""
    model = distinct_merged("ties", True)
    model.generation_config.eos_token_id = None  # all 9 tokens, no early stop
    kw = {"max_new_tokens": 9, "do_sample": False, "pad_token_id": 0}
    ids = IDS[:, :6].clone()
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # row 1 is a left-padded 4-token prompt
    greedy = model.generate(ids, attention_mask=mask, **kw)
    assert greedy.shape == (2, 15)
    full_mask = torch.cat([mask, torch.ones(2, 9, dtype=mask.dtype)], 1)
    with torch.no_grad():
        full = model(input_ids=greedy, attention_mask=full_mask).logits
    assert torch.equal(full[:, 5:-1].argmax(-1), greedy[:, 6:])
    beams = model.generate(ids[:1], num_beams=3, **kw)
    assert beams.shape == (1, 15)
    cache = model(input_ids=ids[:1], use_cache=True).past_key_values
    assert set(cache.segments) == set(range(len(model.mlps())))


def test_dynamic_stores_one_reference_and_reports_the_saving(model_factory, tmp_path):
    base = model_factory("llama", layers=3)
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i) for i in range(2)]
    static = merged(tmp_path, base, experts, name="static")
    dynamic = merged(tmp_path, base, experts, name="dynamic", dynamic="true")

    def names(path):
        with safe_open(path / "model.safetensors", "pt") as f:
            return set(f.keys())

    refs = {n for n in names(dynamic) if ".mlp.reference." in n}
    assert refs == {f"model.layers.0.mlp.reference.{p}.weight"
                    for p in ("gate_proj", "up_proj", "down_proj")}
    saved = sum(p.numel() for p in load(static).parameters()) - \
        sum(p.numel() for p in load(dynamic).parameters())
    assert saved == 2 * 3 * 32 * 64  # two layers × three projections of [64, 32]


def test_export_bakes_the_curvature_and_keeps_the_outputs(model_factory, tmp_path):
    base = model_factory("qwen2")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.1, seed=i, only="mlp")
               for i in range(3)]
    out = merged(tmp_path, base, experts, curvature="{rank: 2}", mask="{kind: ties}",
                 dynamic="true")
    model = load(out)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a curvature fine-tune, simulated: factors away from the identity
        for name, param in model.named_parameters():
            if ".curvature." in name:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(tmp_path / "tuned")
    for extra in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tuned" / extra).write_bytes((out / extra).read_bytes())
    result = CliRunner().invoke(app, ["export", str(tmp_path / "tuned"), str(tmp_path / "baked")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "baked" / "config.json").read_text())
    assert config["curvature"] == "none"
    baked = load(tmp_path / "baked")
    assert not any(".curvature." in n for n, _ in baked.named_parameters())
    ids = torch.randint(0, 256, (2, 21), generator=gen)
    tuned = load(tmp_path / "tuned")
    assert (logits(tuned, ids) - logits(baked, ids)).abs().max() < 1e-5
    assert (logits(tuned, ids) - logits(model, ids)).abs().max() < 1e-5
    again = CliRunner().invoke(app, ["export", str(tmp_path / "baked"), str(tmp_path / "x")])
    assert again.exit_code == 2 and "nothing to bake" in again.output


def test_a_fresh_offline_process_loads_the_shipped_code_and_generates(model_factory, tmp_path):
    """With an empty module cache: every file the shipped code imports is next to the weights
    (transformers 4 copies only a module's direct relative imports)."""
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.1, seed=i) for i in range(2)]
    out = merged(tmp_path, base, experts, curvature="{rank: 2}", dynamic="true")
    assert generate_in_fresh_process(out, tmp_path) == ["8", "moemerge_merged"]
