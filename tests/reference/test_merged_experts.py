"""merged_experts as shipped (trust_remote_code) against the plain reference: 3 distinct
experts, segment_length not dividing the length, rank 1 and 2 curvature with random factors,
each mask, dynamic on and off; and `moemerge bake` against the reference's baked experts."""

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from moemerge.api import build
from moemerge.cli import app
from moemerge.toy import TINY, cached_toy_experts
from reference.dense import output_tensors, overwrite
from reference.merged import merged_experts_model

TOLERANCE = 1e-5
SEGMENT = 4
IDS = torch.randint(4, 300, (3, 11), generator=torch.Generator().manual_seed(0))  # 11 % 4 ≠ 0


@pytest.fixture(scope="module")
def source_sets(model_factory, tmp_path_factory):
    """Perturbed copies of a Qwen3 base, and the TINY experts branched from theirs by training."""
    root = tmp_path_factory.mktemp("merged_sources")
    base = model_factory("qwen3")
    tiny = cached_toy_experts(TINY, progress=False)
    return {"perturbed": (base, [perturbed_copy(base, root / f"e{i}", scale=0.05, seed=20 + i)
                                 for i in range(3)]),
            "tiny": (tiny.base, list(tiny.experts.values()))}


@pytest.fixture(scope="module")
def sources(source_sets):
    return source_sets["perturbed"]


def build_merged(tmp_path, base, experts, rank, mask, dynamic, alpha=0.8):
    curvature = f"{{kind: kronecker, rank: {rank}}}" if rank else "{kind: none}"
    recipe = "\n".join([
        "kind: moe", "assembly: merged_experts", f"base_model: {base}",
        f"experts: [{', '.join(map(str, experts))}]", f"segment_length: {SEGMENT}",
        f"alpha: {alpha}", f"curvature: {curvature}", f"mask: {{kind: {mask}}}",
        f"dynamic: {str(dynamic).lower()}"]) + "\n"
    build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "moe", progress=False)
    # trained-like factors: identity plus noise; decisive routers
    gen = torch.Generator().manual_seed(3)
    out = tmp_path / "moe"
    overwrite(out, lambda n: n.endswith("router.weight"), 20.0, seed=4)
    tensors = output_tensors(out)
    for name in [n for n in tensors if ".curvature." in n]:
        tensors[name] = tensors[name] + 0.1 * torch.randn(tensors[name].shape, generator=gen)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def shipped(out, ids=IDS):
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 trust_remote_code=True).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def reference(out, base, experts, rank, mask, dynamic, alpha=0.8, tensors=None):
    model, baked = merged_experts_model(
        base, experts, tensors or output_tensors(out), alpha=alpha, segment=SEGMENT, mask=mask,
        dynamic=dynamic, kronecker=bool(rank))
    with torch.no_grad():
        return torch.cat([model(input_ids=row[None]).logits for row in IDS]), baked


CASES = [(0, "none", False), (1, "none", False), (2, "ties", False), (1, "dare", False),
         (2, "none", True), (1, "ties", True), (2, "dare", True)]


@pytest.mark.parametrize("rank, mask, dynamic", CASES)
@pytest.mark.parametrize("experts_set", ["perturbed", "tiny"])
def test_shipped_equals_the_reference(experts_set, rank, mask, dynamic, source_sets, tmp_path,
                                      record):
    base, experts = source_sets[experts_set]
    out = build_merged(tmp_path, base, experts, rank, mask, dynamic)
    theirs, _ = reference(out, base, experts, rank, mask, dynamic)
    assert record((shipped(out) - theirs).abs().max()) <= TOLERANCE


def export_mismatch(out, baked, tmp_path) -> float:
    """`moemerge bake` of `out`: max |Δ| of its expert weights from the reference's `baked`."""
    result = CliRunner().invoke(app, ["bake", str(out), str(tmp_path / "baked")])
    assert result.exit_code == 0, result.output
    written = output_tensors(tmp_path / "baked")
    return float(max((written[f"model.layers.{layer}.mlp.experts.{i}.{p}.weight"] - w).abs().max()
                     for layer, projs in enumerate(baked) for p, ws in projs.items()
                     for i, w in enumerate(ws)))


@pytest.mark.parametrize("rank, mask, dynamic", [(2, "none", True), (2, "ties", True),
                                                 (2, "dare", True), (1, "none", False),
                                                 (1, "ties", False), (2, "dare", False)])
def test_export_writes_the_reference_baked_experts(rank, mask, dynamic, sources, tmp_path,
                                                   record):
    base, experts = sources
    out = build_merged(tmp_path, base, experts, rank, mask, dynamic)
    theirs, baked = reference(out, base, experts, rank, mask, dynamic)
    assert record(export_mismatch(out, baked, tmp_path), "baked expert weights") <= 1e-6
    assert record((shipped(tmp_path / "baked") - theirs).abs().max(), "logits of the export") \
        <= TOLERANCE


def test_the_comparison_can_fail(sources, tmp_path, record):
    """One curvature factor entry changed in the reference's inputs moves it far outside the
    tolerance of the shipped model."""
    base, experts = sources
    out = build_merged(tmp_path, base, experts, 1, "none", False)
    tensors = output_tensors(out)
    tensors["model.layers.1.mlp.curvature.up_proj.C"][2, 0, 0, 1] += 0.5
    theirs, _ = reference(out, base, experts, 1, "none", False, tensors=tensors)
    assert record((shipped(out) - theirs).abs().max(), "one curvature entry changed") \
        > 100 * TOLERANCE


def test_the_export_comparison_can_fail(sources, tmp_path, record):
    """One curvature factor entry changed in the checkpoint after the reference baked it: the
    exported experts of that layer are far outside the tolerance."""
    base, experts = sources
    out = build_merged(tmp_path, base, experts, 1, "ties", False)
    _, baked = reference(out, base, experts, 1, "ties", False)
    tensors = output_tensors(out)
    tensors["model.layers.1.mlp.curvature.up_proj.C"][2, 0, 0, 1] += 0.5
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    assert record(export_mismatch(out, baked, tmp_path), "one factor changed after baking") \
        > 100 * 1e-6
