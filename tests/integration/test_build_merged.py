"""merged_experts builds (SMEAR / Lory / CAMEx), checked against the dense models they came from:
identical experts, one-hot merges, causality, generation, dynamic merging and export."""

import json
import sys

import pytest
import torch
from conftest import FAMILIES, generate_in_fresh_process, perturbed_copy, write_recipe
from reference.decoding import full_forward, search
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache
from typer.testing import CliRunner

from moemerge.api import build
from moemerge.cli import app
from moemerge.modeling.pretrained_moemerge import CACHE

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
        pieces, cache = [out.logits], out[CACHE]
        for start in range(prompt, ids.shape[1], chunk):
            out = model(input_ids=ids[:, start:start + chunk], use_cache=True,
                        **{CACHE: cache})
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


def remote_module(model):
    """The module of the shipped code the model was loaded from (trust_remote_code)."""
    return sys.modules[type(model).__module__]


@pytest.mark.parametrize("mask, dynamic", [("none", False), ("ties", True)])
def test_decoding_with_the_prompts_scores_is_caught(distinct_merged, mask, dynamic,
                                                    monkeypatch):
    """The behaviour before segment routing was carried through the cache: every generated
    token kept the scores of the prompt's last token. Decoding that way is outside the
    comparison's tolerance (1e-5) by orders of magnitude."""
    model = distinct_merged(mask, dynamic)
    mlp_class = type(model.mlps()[0])
    original, kept = mlp_class.scores, {}

    def prompt_scores(self, h):
        s = original(self, h)  # still updates the cache's segment state
        if self.step.offset == 0:
            kept[self.layer] = s[:, -1:]
            return s
        return kept[self.layer].expand_as(s)

    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(5))
    full = logits(model, ids)
    monkeypatch.setattr(mlp_class, "scores", prompt_scores)
    stale = decoded_logits(model, ids, 5, 1)
    assert (stale[:, :5] - full[:, :5]).abs().max() <= 1e-5  # the prompt itself is unchanged
    assert (stale[:, 5:] - full[:, 5:]).abs().max() > 100 * 1e-5


def beam_search(model, prompt):
    """generate()'s beam search through the MergedCache: all 3 beams and their summed
    log-probabilities (length_penalty 0), 9 tokens, no early stop."""
    model.generation_config.eos_token_id = None
    out = model.generate(prompt, num_beams=3, num_return_sequences=3, max_new_tokens=9,
                         do_sample=False, length_penalty=0.0, pad_token_id=0,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences, out.sequences_scores


def test_beam_search_equals_a_beam_search_over_full_forwards(distinct_merged):
    """Beam reordering carries each beam's segment sums: every beam generate() returns, and its
    score, equal a beam search that re-runs the full forward over each candidate prefix."""
    model = distinct_merged("ties", True)
    prompt = IDS[:1, :6]  # the 9 new tokens close segment 1 and fill segments 2 and 3
    sequences, scores = beam_search(model, prompt)
    theirs, their_scores = search(full_forward(model), prompt, 3, 9)
    assert torch.equal(sequences, theirs)
    torch.testing.assert_close(scores, their_scores, atol=1e-4, rtol=0)


def reorder_mismatch(model) -> float:
    """Three distinct 7-token prefixes (segment 0 closed, segment 1 open), the cache reordered
    as beam search does (a permutation with a repeat), then 6 tokens through it: max |Δ logit|
    from one full forward over the reordered prefixes and the new tokens."""
    gen = torch.Generator().manual_seed(11)
    ids, new = torch.randint(0, 256, (3, 7), generator=gen), torch.randint(0, 256, (3, 6),
                                                                           generator=gen)
    order = torch.tensor([2, 0, 0])
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True)[CACHE]
        cache.reorder_cache(order)
        cached = model(input_ids=new, use_cache=True, **{CACHE: cache}).logits
        full = model(input_ids=torch.cat([ids[order], new], 1)).logits[:, 7:]
    return float((cached - full).abs().max())


def test_a_reordered_cache_continues_the_reordered_prefixes(distinct_merged):
    assert reorder_mismatch(distinct_merged("ties", True)) <= 1e-5


def test_a_wrong_beam_reorder_is_caught(distinct_merged, monkeypatch):
    """Both comparisons with reorder_cache moving the keys and values but leaving each row's
    segment sums where they were: generate() no longer equals the reference beam search, and
    the continuation is far from the full forward."""
    model = distinct_merged("ties", True)
    prompt = IDS[:1, :6]
    theirs, their_scores = search(full_forward(model), prompt, 3, 9)
    monkeypatch.setattr(remote_module(model).MergedCache, "reorder_cache",
                        lambda self, beam_idx: DynamicCache.reorder_cache(self, beam_idx))
    sequences, scores = beam_search(model, prompt)
    assert not torch.equal(sequences, theirs) or \
        (scores - their_scores).abs().max() > 100 * 1e-4
    assert reorder_mismatch(model) > 100 * 1e-5


def test_greedy_generation_continues_segment_routing(distinct_merged):
    """Every greedy-generated token is the argmax of one full forward over the generated
    sequence (left-padded batch included)."""
    model = distinct_merged("ties", True)
    model.generation_config.eos_token_id = None  # all 9 tokens, no early stop
    ids = IDS[:, :6].clone()
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0  # row 1 is a left-padded 4-token prompt
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False,
                            pad_token_id=0)
    assert greedy.shape == (2, 15)
    full_mask = torch.cat([mask, torch.ones(2, 9, dtype=mask.dtype)], 1)
    with torch.no_grad():
        full = model(input_ids=greedy, attention_mask=full_mask).logits
    assert torch.equal(full[:, 5:-1].argmax(-1), greedy[:, 6:])
    cache = model(input_ids=ids[:1], use_cache=True)[CACHE]
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
    result = CliRunner().invoke(app, ["bake", str(tmp_path / "tuned"), str(tmp_path / "baked")])
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
    assert again.exit_code == 1 and "nothing to bake" in again.output  # the model's kind: 1


def test_a_fresh_offline_process_loads_the_shipped_code_and_generates(model_factory, tmp_path):
    """With an empty module cache: every file the shipped code imports is next to the weights
    (transformers 4 copies only a module's direct relative imports)."""
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.1, seed=i) for i in range(2)]
    out = merged(tmp_path, base, experts, curvature="{rank: 2}", dynamic="true")
    assert generate_in_fresh_process(out, tmp_path) == ["8", "moemerge_merged"]
