"""Task-vector routing computes ‖τ_e‖ once per model, and again after a weight changes."""

import torch
from conftest import perturbed_copy
from transformers import AutoModelForCausalLM

from moemerge.modeling.routing_moemerge import TaskVectorScorer


def test_norms_are_cached_until_a_weight_changes(model_factory, tmp_path):
    base_dir = model_factory("llama")
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)  # noqa: E731
    base = load(base_dir)
    experts = [load(perturbed_copy(base_dir, tmp_path / f"e{i}", scale=0.05, seed=i))
               for i in range(2)]
    scorer = TaskVectorScorer(base, experts, ["layers."])
    first = scorer.norms()
    assert scorer.norms() is first  # cached: the same tensor, not recomputed
    with torch.no_grad():  # an optimizer step, in place
        experts[1].model.layers[0].mlp.up_proj.weight.add_(1.0)
    again = scorer.norms()
    assert again is not first and again[0] == first[0] and again[1] > first[1] + 1.0
    fresh = TaskVectorScorer(base, experts, ["layers."]).norms()
    torch.testing.assert_close(again, fresh, rtol=0, atol=0)
