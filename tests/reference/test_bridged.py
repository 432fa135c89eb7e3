"""bridged as shipped (trust_remote_code) against the plain reference: experts of different
widths and families, projectors with a non-zero MLP branch, k = 2."""

import pytest
import torch
from conftest import write_recipe
from transformers import AutoModelForCausalLM

from moemerge.api import build
from reference.dense import dense, output_tensors, overwrite
from reference.sequence import bridged

TOLERANCE = 1e-5
IDS = torch.randint(4, 300, (4, 10), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def experts(model_factory):
    return [model_factory("llama", seed=1), model_factory("qwen3", hidden=48, seed=2),
            model_factory("mistral", layers=3, seed=3)]


def build_bridged(tmp_path, experts, router, temperature, how, init="lstsq"):
    recipe = "\n".join([
        "kind: moe", "assembly: bridged", "experts:", *(f"  - {e}" for e in experts),
        "experts_per_sequence: 2", f"mix: {how}",
        f"router: {{kind: {router}, temperature: {temperature}}}",
        f"projectors: {{init: {init}, hidden_size: 8}}"]) + "\n"
    build(write_recipe(tmp_path / "r.yaml", recipe), tmp_path / "moe", progress=False)
    # trained-like parts: the MLP branch of every projector and the router
    overwrite(tmp_path / "moe", lambda n: n.endswith(("proj_in.down.weight",
                                                      "proj_out.down.weight")), 0.3, seed=1)
    overwrite(tmp_path / "moe", lambda n: n == "router.weight", 0.3, seed=2)
    return tmp_path / "moe"


def compare(out, experts, router, temperature, how):
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 trust_remote_code=True).eval()
    with torch.no_grad():
        ours = model(input_ids=IDS).logits
        theirs = bridged(IDS, [dense(e) for e in experts], output_tensors(out), router=router,
                         k=2, temperature=temperature, how=how)
    return (ours - theirs).abs().max()


@pytest.mark.parametrize("router, temperature, how", [("learned", 0.7, "hidden"),
                                                      ("learned", 1.3, "logits"),
                                                      ("perplexity", 0.5, "logits")])
def test_shipped_equals_the_reference(router, temperature, how, experts, tmp_path, record):
    out = build_bridged(tmp_path, experts, router, temperature, how)
    assert record(compare(out, experts, router, temperature, how)) <= TOLERANCE


def test_the_comparison_can_fail(experts, tmp_path, record):
    """One projector weight changed in the checkpoint moves the shipped output far outside the
    tolerance of the (unchanged) reference."""
    out = build_bridged(tmp_path, experts, "learned", 0.7, "hidden")
    reference = output_tensors(out)
    overwrite(out, lambda n: n == "experts.1.proj_out.up.weight", 0.3, seed=9)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 trust_remote_code=True).eval()
    with torch.no_grad():
        ours = model(input_ids=IDS).logits
        theirs = bridged(IDS, [dense(e) for e in experts], reference, router="learned", k=2,
                         temperature=0.7, how="hidden")
    assert record((ours - theirs).abs().max(), "one projector weight changed") > 100 * TOLERANCE
