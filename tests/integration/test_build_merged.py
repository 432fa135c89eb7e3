"""merged_experts builds (SMEAR / Lory / CAMEx), checked against the dense models they came from:
identical experts, one-hot merges, causality, generation, dynamic merging and export."""

import json

import pytest
import torch
from conftest import FAMILIES, perturbed_copy, write_recipe
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


def test_generation_routes_on_the_prompt_and_keeps_it(model_factory, tmp_path):
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.2, seed=i) for i in range(2)]
    model = load(merged(tmp_path, base, experts, mask="{kind: ties}"))
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    greedy = model.generate(IDS[:1], **kw)
    assert greedy.shape == (1, 19)
    # the same tokens one at a time: the prompt's scores are stored once and reused
    out = model(input_ids=IDS[:1], use_cache=True)
    assert set(out.past_key_values.scores) == set(range(len(model.mlps())))
    tokens, cache = [], out.past_key_values
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(6):
        tokens.append(int(token))
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
    assert greedy[0, 13:].tolist() == tokens
    assert model.generate(IDS[:1], num_beams=2, **kw).shape == (1, 19)


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
