"""`moemerge extract … --lora RANK|auto --base BASE`: a fine-tune as a PEFT LoRA adapter.

peft is the oracle: the adapter is loaded with `PeftModel.from_pretrained` on the base. At full
rank its logits, and its `merge_and_unload()`'s, are the fine-tune's; at a truncated rank each
module's merged weight is the plain truncated SVD of its task vector and the reported kept
share is Σ_{i<r} s_i² / Σ s_i² of singular values computed here; and the comparisons are shown
able to fail (a truncated rank, a perturbed factor)."""

import json

import pytest
import torch
from conftest import perturbed_copy
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moemerge.built.extract import extract_expert
from moemerge.cli import app

peft = pytest.importorskip("peft")

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
EXACT = dict(atol=2e-5, rtol=1e-4)
ADAPTER, CONFIG, REPORT = "adapter_model.safetensors", "adapter_config.json", "lora_report.json"


def run(*args, code=0):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    return result.output


def load(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model(input_ids=IDS).logits


def with_adapter(base, adapter):
    return peft.PeftModel.from_pretrained(load(base), adapter).eval()


def task_vectors(base, tuned) -> dict[str, torch.Tensor]:
    """τ per 2-D weight of the attention and FFN, as plain tensors."""
    a, b = load(base).state_dict(), load(tuned).state_dict()
    return {n[:-len(".weight")]: b[n] - a[n] for n in a
            if n.endswith("proj.weight") and not torch.equal(a[n], b[n])}


@pytest.fixture(scope="module")
def pair(model_factory, tmp_path_factory):
    """(base, fine-tune): every tensor perturbed, so embedding, head and norms differ too."""
    base = model_factory("llama")
    return base, perturbed_copy(base, tmp_path_factory.mktemp("lora") / "tuned", scale=0.05,
                                seed=1)


def test_full_rank_is_the_fine_tune(pair, tmp_path):
    base, tuned = pair
    out = tmp_path / "adapter"
    printed = run("extract", tuned, out, "--lora", "1000", "--base", base)
    assert "extracted tuned as a LoRA adapter" in printed and "100.0 %" in printed
    config = json.loads((out / CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == str(base)
    assert config["r"] == config["lora_alpha"] and config["alpha_pattern"] == \
        config["rank_pattern"]
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj",
                                             "gate_proj", "up_proj", "down_proj"}
    assert {"model.embed_tokens", "lm_head", "model.norm"} <= set(config["modules_to_save"])
    want = logits(load(tuned))
    model = with_adapter(base, out)
    torch.testing.assert_close(logits(model), want, **EXACT)
    torch.testing.assert_close(logits(model.merge_and_unload()), want, **EXACT)
    assert (logits(load(base)) - want).abs().max() > 1e-2

    factors = load_file(out / ADAPTER)  # the comparison can fail: one factor perturbed
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    factors[name] = factors[name] * 1.01
    save_file(factors, out / ADAPTER, metadata={"format": "pt"})
    assert (logits(with_adapter(base, out)) - want).abs().max() > 1e-4


def test_truncated_rank_is_the_truncated_svd(pair, tmp_path):
    base, tuned = pair
    out = tmp_path / "adapter"
    run("extract", tuned, out, "--lora", "4", "--base", base)
    report = {m["module"]: m for m in json.loads((out / REPORT).read_text())["modules"]}
    merged = with_adapter(base, out).merge_and_unload().state_dict()
    weights = load(base).state_dict()
    deltas = task_vectors(base, tuned)
    assert deltas
    for module, delta in deltas.items():
        u, s, vh = torch.linalg.svd(delta.double(), full_matrices=False)
        kept = float(s[:4].square().sum() / s.square().sum())
        assert report[module]["rank"] == 4 and report[module]["kept"] == pytest.approx(kept)
        truncated = (u[:, :4] * s[:4] @ vh[:4]).float()
        torch.testing.assert_close(merged[module + ".weight"] - weights[module + ".weight"],
                                   truncated, atol=1e-5, rtol=1e-4)
    assert (logits(with_adapter(base, out)) - logits(load(tuned))).abs().max() > 1e-3


def test_auto_rank_keeps_the_share(pair, tmp_path):
    base, tuned = pair
    out = tmp_path / "adapter"
    run("extract", tuned, out, "--lora", "auto", "--lora-share", "0.8", "--base", base)
    config = json.loads((out / CONFIG).read_text())
    report = {m["module"]: m for m in json.loads((out / REPORT).read_text())["modules"]}
    ranks = set()
    for module, delta in task_vectors(base, tuned).items():
        energy = torch.linalg.svdvals(delta.double()).square()
        share = energy.cumsum(0) / energy.sum()
        rank = int((share < 0.8).sum()) + 1  # the smallest rank reaching 0.8
        assert report[module]["rank"] == rank and report[module]["kept"] >= 0.8 > share[rank - 2]
        assert config["rank_pattern"].get(module, config["r"]) == rank
        ranks.add(rank)
    assert len(ranks) > 1 and config["rank_pattern"]
    model = with_adapter(base, out)  # peft sizes each module by rank_pattern: loads
    assert (logits(model) - logits(load(tuned))).abs().max() > 1e-4


def test_moe_expert_and_skipped_modules(tiny_moe, model_factory, tmp_path):
    """An MoE's expert against its base: its experts differ in their FFNs only, so attention,
    norms, embedding and head are left out; full rank is the extracted dense expert."""
    base = model_factory("llama")
    run("extract", tiny_moe, tmp_path / "adapter", "--lora", "1000", "--base", base, code=2)
    run("extract", tiny_moe, tmp_path / "adapter", "--expert", "0", "--lora", "1000",
        "--base", base)
    config = json.loads((tmp_path / "adapter" / CONFIG).read_text())
    assert config["target_modules"] == ["down_proj", "gate_proj", "up_proj"]
    assert config["modules_to_save"] is None
    extract_expert(tiny_moe, tmp_path / "dense", expert="0")
    torch.testing.assert_close(logits(with_adapter(base, tmp_path / "adapter")),
                               logits(load(tmp_path / "dense")), **EXACT)


@pytest.mark.parametrize("family,tied", [("llama", True), ("qwen2", False)])
def test_tied_head_and_changed_bias_are_kept_whole(family, tied, model_factory, tmp_path):
    """A tied embedding that changes: embedding and head both saved; a q/k/v whose bias
    changes: the whole linear saved, and spelled in full in neither list."""
    base = model_factory(family, tie_word_embeddings=tied)
    tuned = perturbed_copy(base, tmp_path / "tuned", scale=0.05, seed=2)
    run("extract", tuned, tmp_path / "adapter", "--lora", "1000", "--base", base)
    config = json.loads((tmp_path / "adapter" / CONFIG).read_text())
    assert {"model.embed_tokens", "lm_head"} <= set(config["modules_to_save"])
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj" in config["modules_to_save"]
        assert "q_proj" not in config["target_modules"]
    torch.testing.assert_close(logits(with_adapter(base, tmp_path / "adapter")),
                               logits(load(tuned)), **EXACT)


def test_refusals(pair, model_factory, tmp_path):
    base, tuned = pair
    out = tmp_path / "adapter"
    run("extract", tuned, out, "--lora", "4", code=2)  # no --base
    run("extract", tuned, out, "--lora", "4", "--lora-share", "0.5", "--base", base, code=2)
    run("extract", tuned, out, "--lora", "0", "--base", base, code=2)
    run("extract", tuned, out, "--lora", "auto", "--lora-share", "1.5", "--base", base, code=2)
    run("extract", tuned, out, "--lora", "4", "--base", base, "--expert", "0", code=2)
    assert "equal" in run("extract", base, out, "--lora", "4", "--base", base, code=1)
    other = model_factory("qwen3")
    assert "qwen3" in run("extract", tuned, out, "--lora", "4", "--base", other, code=1)
    assert "never" in run("extract", tuned, base / "adapter", "--lora", "4", "--base", base,
                          code=2)  # the base is an input: no output inside it
    assert not out.exists() and not (base / "adapter").exists()
    out.mkdir()
    assert "already exists" in run("extract", tuned, out, "--lora", "4", "--base", base, code=1)
