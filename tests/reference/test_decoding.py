"""Decoding equals full forwards, for every MoE kind: generate() (greedy and beam search, through
each kind's cache, and without it where the kind's output does not depend on it) returns the
sequences and scores of a search written plainly over full forwards, and transformers warns of
nothing deprecated on the way.

The full forwards: the model itself without a cache for the kinds whose routing is causal
(a token-routed Mixtral; merged_experts, whose forward is checked against its own reference in
test_merged_experts.py); for the sequence-routed kinds, which keep the prompt's routing while
they generate, the plain reference of reference/sequence.py routed on the prompt."""

import logging
import warnings

import pytest
import torch
from conftest import perturbed_copy, write_recipe
from transformers import AutoModelForCausalLM

from moemerge.api import build
from reference.decoding import NEW_TOKENS, full_forward, search
from reference.dense import dense, output_tensors, overwrite
from reference.sequence import bridged, seq_routed

PROMPT = torch.randint(4, 256, (1, 6), generator=torch.Generator().manual_seed(3))
BEAMS = 3


def generated(model, beams: int, use_cache: bool):
    """generate()'s sequences [beams, T] and summed log-probabilities (no length penalty, no
    early stop), and what transformers warned while it ran."""
    model.generation_config.eos_token_id = None
    kw = {"num_beams": beams, "num_return_sequences": beams, "length_penalty": 0.0}
    logger = logging.getLogger("transformers")
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False,
                                 pad_token_id=0, use_cache=use_cache, output_scores=True,
                                 return_dict_in_generate=True, **(kw if beams > 1 else {}))
    finally:
        logger.removeHandler(handler)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in records]
    if beams == 1:  # greedy returns per-step scores: their sum along the chosen tokens
        chosen = out.sequences[:, PROMPT.shape[1]:]
        steps = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
        return out.sequences, steps.gather(-1, chosen[..., None]).sum((1, 2)), said
    return out.sequences, out.sequences_scores, said


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                trust_remote_code=True).eval()


@pytest.fixture(scope="module")
def sources(model_factory, tmp_path_factory):
    """root, base, experts differing in their FFNs, in their stacks, and in width and family."""
    root = tmp_path_factory.mktemp("decoding")
    base = model_factory("llama")
    return {"root": root, "base": base,
            "ffn": [perturbed_copy(base, root / f"f{i}", scale=0.2, seed=i, only="mlp")
                    for i in range(3)],
            "stacks": [perturbed_copy(base, root / f"s{i}", scale=0.3, seed=10 + i,
                                      only="layers.") for i in range(3)],
            "widths": [model_factory("llama", seed=1), model_factory("qwen3", hidden=48, seed=2)]}


def build_kind(sources, name: str, assembly: str, experts: str, *lines: str):
    root = sources["root"]
    recipe = "\n".join(["kind: moe", f"assembly: {assembly}", f"experts: [{experts}]", *lines])
    build(write_recipe(root / f"{name}.yaml", recipe + "\n"), root / name, progress=False)
    return root / name


def listed(dirs) -> str:
    return ", ".join(map(str, dirs))


def token_routed(sources):
    out = build_kind(sources, "mixtral", "token_routed", listed(sources["ffn"]),
                     f"base_model: {sources['base']}", "experts_per_token: 2",
                     "router: {init: random}")
    overwrite(out, lambda n: n.endswith("block_sparse_moe.gate.weight"), 0.5, seed=1)
    model = load(out)
    return model, lambda prompt_routed: full_forward(model), True


def merged_experts(sources):
    out = build_kind(sources, "merged", "merged_experts", listed(sources["ffn"]),
                     f"base_model: {sources['base']}", "segment_length: 4",
                     "curvature: {rank: 2}", "mask: {kind: ties}")
    overwrite(out, lambda n: n.endswith("mlp.router.weight"), 0.5, seed=1)
    model = load(out)
    return model, lambda prompt_routed: full_forward(model), True


def sequence_routed(router: str, k: int, temperature: float, how: str):
    def make(sources):
        out = build_kind(sources, f"seq-{router}-{k}-{how}", "seq_routed",
                         listed(sources["stacks"]), f"base_model: {sources['base']}",
                         f"experts_per_sequence: {k}", f"mix: {how}",
                         f"router: {{kind: {router}, temperature: {temperature}}}")
        if router == "learned":
            overwrite(out, lambda n: n == "router.weight", 0.3, seed=1)
        experts, tensors = [dense(e) for e in sources["stacks"]], output_tensors(out)
        base = dense(sources["base"])
        return load(out), lambda prompt_routed: lambda ids: seq_routed(
            ids, experts, router=router, k=k, temperature=temperature, how=how, shared=True,
            router_weight=tensors["router.weight"], base=base,
            prompt=PROMPT.shape[1] if prompt_routed else None)[:, -1], False
    return make


def bridged_kind(sources):
    out = build_kind(sources, "bridged", "bridged", listed(sources["widths"]),
                     "experts_per_sequence: 2", "mix: hidden",
                     "router: {kind: learned, temperature: 0.7}", "projectors: {hidden_size: 8}")
    overwrite(out, lambda n: n.endswith(("proj_in.down.weight", "proj_out.down.weight")), 0.3,
              seed=1)
    overwrite(out, lambda n: n == "router.weight", 0.3, seed=2)
    experts, tensors = [dense(e) for e in sources["widths"]], output_tensors(out)
    return load(out), lambda prompt_routed: lambda ids: bridged(
        ids, experts, tensors, router="learned", k=2, temperature=0.7, how="hidden",
        prompt=PROMPT.shape[1] if prompt_routed else None)[:, -1], False


KINDS = {
    "token_routed": token_routed,
    "merged_experts": merged_experts,
    "seq_routed-perplexity-k1": sequence_routed("perplexity", 1, 1.0, "logits"),
    "seq_routed-perplexity-k2": sequence_routed("perplexity", 2, 0.5, "logits"),
    "seq_routed-learned-k2-hidden": sequence_routed("learned", 2, 0.7, "hidden"),
    "bridged-learned-k2": bridged_kind,
}


@pytest.fixture(scope="module")
def kinds(sources):
    made = {}

    def make(kind):
        if kind not in made:
            made[kind] = KINDS[kind](sources)
        return made[kind]
    return make


@pytest.mark.parametrize("beams", [1, BEAMS], ids=["greedy", "beam"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_generate_equals_a_search_over_full_forwards(kind, beams, kinds):
    model, next_logits, causal = kinds(kind)
    theirs, their_scores = search(next_logits(True), PROMPT, beams)
    for use_cache in (True, False) if causal else (True,):
        ours, scores, said = generated(model, beams, use_cache)
        assert torch.equal(ours, theirs), (kind, use_cache)
        torch.testing.assert_close(scores, their_scores, atol=1e-4, rtol=1e-5)
        assert not [s for s in said if "deprecat" in s.lower()], said


@pytest.mark.parametrize("kind", ["seq_routed-perplexity-k2", "bridged-learned-k2"])
def test_the_comparison_can_fail(kind, kinds):
    """The same search with the sequence routed on the whole prefix at each step instead of on
    the prompt: its sequences or scores part from generate()'s."""
    model, next_logits, _ = kinds(kind)
    ours, scores, _ = generated(model, BEAMS, True)
    theirs, their_scores = search(next_logits(False), PROMPT, BEAMS)
    assert not torch.equal(ours, theirs) or (scores - their_scores).abs().max() > 1e-2
