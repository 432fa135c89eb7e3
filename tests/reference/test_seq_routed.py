"""seq_routed as shipped (trust_remote_code) against the plain reference, on distinct experts:
perturbed copies of a base (4 experts) and the TINY experts branched by training (3)."""

import json

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from transformers import AutoModelForCausalLM

from moemerge.api import build
from moemerge.toy import TINY, cached_toy_experts
from reference.dense import dense, output_tensors, overwrite
from reference.sequence import seq_routed

TOLERANCE = 1e-5
CASES = [  # router, k, temperature, mix, per-expert embed/head
    ("learned", 1, 1.0, "logits", False),
    ("learned", 2, 0.5, "logits", True),
    ("learned", 3, 2.0, "hidden", False),
    ("perplexity", 1, 1.0, "logits", True),
    ("perplexity", 2, 0.5, "logits", False),
    ("perplexity", 3, 0.3, "logits", True),
    ("task_vector", 2, 0.7, "hidden", False),
    ("task_vector", 3, 1.5, "logits", True),
]


@pytest.fixture(scope="module")
def sources(model_factory, tmp_path_factory):
    """name -> (base, experts, ids): two sets of distinct experts and token ids for each."""
    root = tmp_path_factory.mktemp("seq_sources")
    base = model_factory("llama")
    perturbed = [perturbed_copy(base, root / f"e{i}", scale=0.05, seed=10 + i)
                 for i in range(4)]
    tiny = cached_toy_experts(TINY, progress=False)
    gen = torch.Generator().manual_seed(0)
    return {"perturbed": (base, perturbed, torch.randint(4, 256, (4, 10), generator=gen)),
            "tiny": (tiny.base, list(tiny.experts.values()),
                     torch.randint(4, 512, (4, 10), generator=gen))}


def build_case(tmp_path, base, experts, router, k, temperature, how, per_expert):
    lines = ["kind: moe", "assembly: seq_routed", f"base_model: {base}", "experts:",
             *(f"  - {e}" for e in experts), f"experts_per_sequence: {k}", f"mix: {how}",
             f"router: {{kind: {router}, temperature: {temperature}}}"]
    if per_expert:
        lines.append("per_expert: [embed, lm_head]")
    build(write_recipe(tmp_path / "r.yaml", "\n".join(lines) + "\n"), tmp_path / "moe",
          progress=False)
    if router == "learned":  # a trained-like router (its input has RMS 1): sequences differ
        overwrite(tmp_path / "moe", lambda n: n == "router.weight", scale=0.3, seed=1)
    return tmp_path / "moe"


def shipped_logits(out, ids):
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 trust_remote_code=True).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def reference_logits(out, base, experts, ids, router, k, temperature, how, per_expert):
    with torch.no_grad():
        return seq_routed(ids, [dense(e) for e in experts], router=router, k=k,
                          temperature=temperature, how=how, shared=not per_expert,
                          router_weight=output_tensors(out)["router.weight"], base=dense(base))


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("experts", ["perturbed", "tiny"])
def test_shipped_equals_the_reference(experts, case, sources, tmp_path, record):
    """k of 4 experts (perturbed) and of 3 (tiny)."""
    base, dirs, ids = sources[experts]
    assert len(dirs) == {"perturbed": 4, "tiny": 3}[experts]
    out = build_case(tmp_path, base, dirs, *case)
    ours = shipped_logits(out, ids)
    theirs = reference_logits(out, base, dirs, ids, *case)
    assert record((ours - theirs).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[6]], ids=lambda c: c[0])
def test_the_comparison_can_fail(case, sources, tmp_path, record):
    """A reference with the temperature 1.5× higher, or top-1 instead of top-2, is far outside
    the tolerance: the routing weights reach the logits being compared."""
    base, dirs, ids = sources["tiny"]
    out = build_case(tmp_path, base, dirs, *case)
    ours = shipped_logits(out, ids)
    router, k, temperature, how, per_expert = case
    for wrong in ((router, k, temperature * 1.5, how, per_expert),
                  (router, 1, temperature, how, per_expert)):
        theirs = reference_logits(out, base, dirs, ids, *wrong)
        what = "vs top-1" if wrong[1] != k else "vs temperature x1.5"
        assert record((ours - theirs).abs().max(), what) > 100 * TOLERANCE, wrong


@pytest.mark.parametrize("key, case, written, before", [
    ("router_input", CASES[1], "rms_mean_embedding", "mean_embedding"),
    ("perplexity_score", CASES[4], "log_inverse", "inverse"),
])
def test_a_config_without_a_newer_key_computes_as_before(key, case, written, before, sources,
                                                          tmp_path, record):
    """A checkpoint written before `key` existed (its config lacks it) computes as it did then:
    the learned router reads the unnormalised mean embedding, perplexity routing scores 1/PPL
    itself; one written now has `written` (the RMS-normalised mean; log(1/PPL)). Each equals its
    reference and not the other's: the setting reaches the logits (top-2 at temperature 0.5)."""
    base, dirs, ids = sources["tiny"]
    out = build_case(tmp_path, base, dirs, *case)
    config = json.loads((out / "config.json").read_text())
    assert config.pop(key) == written
    new = shipped_logits(out, ids)
    (out / "config.json").write_text(json.dumps(config))
    old = shipped_logits(out, ids)

    def reference(value):
        router, k, temperature, how, per_expert = case
        with torch.no_grad():
            return seq_routed(ids, [dense(e) for e in dirs], router=router, k=k,
                              temperature=temperature, how=how, shared=not per_expert,
                              router_weight=output_tensors(out).get("router.weight"),
                              **{key: value})

    assert record((old - reference(before)).abs().max(), "old config") <= TOLERANCE
    assert record((new - reference(written)).abs().max()) <= TOLERANCE
    assert record((old - new).abs().max(), "old vs new") > 100 * TOLERANCE
