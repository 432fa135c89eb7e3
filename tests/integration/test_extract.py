"""`moemerge extract`: an extracted expert computes what its MoE computes when forced to it.

The MoE forced to expert e is the same checkpoint with every expert slot holding expert e's
tensors: any router then mixes copies of one expert with weights summing to 1 (token_routed:
renormalised top-k; seq_routed: the one chosen expert's own logits), so no test depends on a
router's internals. merged_experts is forced by fixing every layer's routing scores. Experts
are distinct (perturbed copies), and each test checks that another expert's extraction does
not pass the same comparison.
"""

import json
import re

import pytest
import torch
from conftest import (
    TOKEN_ROUTED_FAMILIES,
    build_noting,
    needs_class,
    perturbed_copy,
    write_recipe,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moemerge.api import build
from moemerge.built.extract import extract_expert
from moemerge.cli import app
from moemerge.errors import MismatchError
from moemerge.loading import load_pretrained

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
EXACT = dict(atol=2e-5, rtol=1e-4)
NAMES = ("code", "prose", "math")


def dense_logits(path) -> torch.Tensor:
    """Plain transformers, no remote code: what a user of the extracted model gets."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def moe_logits(path, patch=None) -> torch.Tensor:
    model = load_pretrained("AutoModelForCausalLM", path, dtype=torch.float32).eval()
    if patch is not None:
        patch(model)
    with torch.no_grad():
        return model(input_ids=IDS).logits


def experts(root, base, count=3, only=""):
    return [perturbed_copy(base, root / "src" / NAMES[i], scale=0.05, seed=i + 1, only=only)
            for i in range(count)]


def moe_recipe(root, base, refs, **extra):
    lines = ["kind: moe", f"base_model: {base}", "experts:",
             *(f"  - {{model: {r}, name: {r.name}}}" for r in refs),
             *(f"{k}: {v}" for k, v in extra.items())]
    return write_recipe(root / "recipe.yaml", "\n".join(lines) + "\n")


def forced(moe, expert: int, dst):
    """A copy of `moe` whose every expert holds expert `expert`'s weights."""
    import shutil

    shutil.copytree(moe, dst)
    slot = re.compile(r"(experts\.)(\d+)(\.)")
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for name in list(tensors):
            own = slot.sub(lambda m: f"{m[1]}{expert}{m[3]}", name)
            if own != name:
                tensors[name] = tensors[own].clone()
            elif name.endswith(("input_linear.weight", "output_linear.weight")) and \
                    "shared_mlp" not in name:  # GraniteMoE's fused experts [E, rows, cols]
                tensors[name] = tensors[name][expert].expand_as(tensors[name]).clone()
        save_file(tensors, file, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family,shared", [
    pytest.param(f, "none", marks=needs_class("FlexOlmoForCausalLM")) if f == "olmo2"
    else (f, "none") for f in TOKEN_ROUTED_FAMILIES] + [("granite", "base"), ("llama", "base")])
def test_token_routed_expert_is_the_moe_forced_to_it(family, shared, model_factory, tmp_path):
    base = model_factory(family)
    refs = experts(tmp_path, base)  # attention and norms perturbed too: merged != base
    moe = tmp_path / "moe"
    build_noting(moe_recipe(tmp_path, base, refs, experts_per_token=2, shared_expert=shared),
                 moe, progress=False, verify="structure")
    got = extract_expert(moe, tmp_path / "prose", expert="prose")
    config = json.loads((tmp_path / "prose" / "config.json").read_text())
    source = json.loads((base / "config.json").read_text())
    assert config["model_type"] == source["model_type"] and got.kind == "token_routed"
    assert config["architectures"] == source["architectures"]
    want = moe_logits(forced(moe, 1, tmp_path / "forced"))
    logits = dense_logits(tmp_path / "prose")
    torch.testing.assert_close(logits, want, **EXACT)
    extract_expert(moe, tmp_path / "code", expert="0")  # the comparison can fail
    assert (dense_logits(tmp_path / "code") - want).abs().max() > 1e-3
    print(f"{family}/{shared}: max |Δlogit| {(logits - want).abs().max():.2e}")


def test_tied_source_stays_tied_and_base_expert_is_named(model_factory, tmp_path):
    base = model_factory("llama", tie_word_embeddings=True)
    refs = experts(tmp_path, base, 2, only="mlp")
    moe = tmp_path / "moe"
    build(moe_recipe(tmp_path, base, refs, include_base_expert="true", experts_per_token=1),
          moe, progress=False, verify="structure")
    extract_expert(moe, tmp_path / "base", expert="base")
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(tmp_path / "base" / "model.safetensors")
    torch.testing.assert_close(dense_logits(tmp_path / "base"), dense_logits(base), **EXACT)
    assert (tmp_path / "base" / "tokenizer.json").is_file()


def test_gated_shared_expert_is_refused(model_factory, tmp_path):
    base = model_factory("qwen2")
    moe = tmp_path / "moe"
    build(moe_recipe(tmp_path, base, experts(tmp_path, base, 2), shared_expert="base"), moe,
          progress=False, verify="structure")
    with pytest.raises(MismatchError, match="non-zero shared expert"):
        extract_expert(moe, tmp_path / "out", expert="code")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("per_expert", ["[embed, lm_head]", "[]"])
def test_seq_routed_expert_is_its_own_stack(per_expert, model_factory, tmp_path):
    """per_expert embedding and head: the source expert's own logits; shared (merged) ones:
    the MoE's logits when the sequence goes to that expert."""
    base = model_factory("qwen3")
    refs = experts(tmp_path, base)
    moe = tmp_path / "moe"
    build(moe_recipe(tmp_path, base, refs, assembly="seq_routed", per_expert=per_expert,
                     experts_per_sequence=1), moe, progress=False, verify="structure")
    extract_expert(moe, tmp_path / "math", expert="math")
    logits = dense_logits(tmp_path / "math")
    want = dense_logits(refs[2]) if per_expert != "[]" else \
        moe_logits(forced(moe, 2, tmp_path / "forced"))
    torch.testing.assert_close(logits, want, **EXACT)
    extract_expert(moe, tmp_path / "prose", expert="prose")
    assert (dense_logits(tmp_path / "prose") - want).abs().max() > 1e-3
    print(f"seq_routed {per_expert}: max |Δlogit| {(logits - want).abs().max():.2e}")


def fixed_scores(scores):
    """Every merged-experts layer routes every token with `scores`."""
    fixed = torch.tensor(scores)

    def patch(model):
        for mlp in model.mlps():
            mlp.scores = lambda h: fixed.expand(*h.shape[:2], len(scores))
    return patch


@pytest.mark.parametrize("dynamic", ["false", "true"])
def test_merged_experts_at_fixed_scores_is_dense(dynamic, model_factory, tmp_path):
    """Kronecker curvature (perturbed away from the identity), TIES-CA mask, α 0.7."""
    base = model_factory("llama")
    moe = tmp_path / "moe"
    build(moe_recipe(tmp_path, base, experts(tmp_path, base, only="mlp"),
                     assembly="merged_experts", segment_length=4, alpha=0.7,
                     curvature="{kind: kronecker, rank: 2}", mask="{kind: ties}",
                     dynamic=dynamic), moe, progress=False, verify="structure")
    weights = moe / "model.safetensors"
    tensors = load_file(weights)
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if ".curvature." in name:
            tensors[name] = t + 0.05 * torch.randn(t.shape, generator=gen)
    save_file(tensors, weights, metadata={"format": "pt"})
    for option, scores in (("math", [0.0, 0.0, 1.0]), ("1,2,1", [0.25, 0.5, 0.25])):
        key = "expert" if option == "math" else "weights"
        extract_expert(moe, tmp_path / option, **{key: option})
        want = moe_logits(moe, fixed_scores(scores))
        logits = dense_logits(tmp_path / option)
        torch.testing.assert_close(logits, want, **EXACT)
        print(f"merged_experts dynamic={dynamic} {option}: max |Δlogit| "
              f"{(logits - want).abs().max():.2e}")
    extract_expert(moe, tmp_path / "code", expert="code")
    assert (dense_logits(tmp_path / "code") - moe_logits(moe, fixed_scores([0, 0, 1.0]))
            ).abs().max() > 1e-3


def cli(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, " ".join(result.output.split())


def test_cli_names_errors_and_generates(tiny_moe, tmp_path):
    code, text = cli("extract", tiny_moe, tmp_path / "x", "--expert", "nope")
    assert code == 2 and "0 ('e0')" in text and "1 ('e1')" in text, text
    code, text = cli("extract", tiny_moe, tmp_path / "x", "--weights", "1,1")
    assert code == 2 and "merged_experts" in text, text
    assert cli("extract", tiny_moe, tiny_moe / "x", "--expert", "e0")[0] == 2  # inside input
    assert not (tiny_moe / "x").exists()
    code, text = cli("extract", tiny_moe, tmp_path / "e1", "--expert", "e1")
    assert code == 0 and "extracted e1" in text, text
    assert "e1" in (tmp_path / "e1" / "README.md").read_text()
    assert cli("extract", tiny_moe, tmp_path / "e1", "--expert", "e1")[0] == 1  # exists
    assert cli("extract", tiny_moe, tmp_path / "e1", "--expert", "1", "--force")[0] == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "e1").eval()
    out = model.generate(IDS[:1, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8)
