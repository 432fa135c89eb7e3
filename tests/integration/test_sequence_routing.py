"""Routing without training on the TINY domain experts: perplexity and task-vector routing send
each domain's held-out windows to that domain's own expert."""

import pytest
import torch

from moemerge.analysis.routing import load_moe, routing_report
from moemerge.api import build
from moemerge.toy import TINY, cached_toy_experts


@pytest.fixture(scope="module")
def seq_moe(tmp_path_factory):
    """A seq_routed MoE of the TINY experts (code, prose, math), each keeping its own embedding
    and head, and the base kept for task-vector routing."""
    toy = cached_toy_experts(TINY, progress=False)
    root = tmp_path_factory.mktemp("seq")
    lines = ["kind: moe", "assembly: seq_routed", f"base_model: {toy.base}", "experts:"]
    lines += [f"  - {{model: {path}, name: {domain}}}" for domain, path in toy.experts.items()]
    lines += ["per_expert: [embed, lm_head]", "router: {kind: task_vector}"]
    (root / "recipe.yaml").write_text("\n".join(lines) + "\n")
    build(root / "recipe.yaml", root / "moe", progress=False)
    return root / "moe", toy


def own_shares(moe, toy, router: str) -> dict[str, float]:
    model, tokenizer = load_moe(moe, router=router)
    texts = {d: p.read_text() for d, p in toy.eval_text.items()}
    report = routing_report(model, tokenizer, texts, seq_len=64, max_tokens=3000,
                            labels=list(toy.experts))
    assert report.level == "sequence"
    return {d: report.domains[d].mean_share[e] for e, d in enumerate(toy.experts)}


@pytest.mark.parametrize("router", ["perplexity", "task_vector"])
def test_windows_go_to_their_own_domain_expert(seq_moe, router):
    """Share of each domain's held-out windows (64 tokens, ~47 per domain) routed top-1 to its
    own expert, measured on the TINY experts (chance 33 %):
        perplexity   code 79 %, prose 87 %, math 100 %
        task_vector  code 81 %, prose 85 %, math 95 %"""
    moe, toy = seq_moe
    shares = own_shares(moe, toy, router)
    assert min(shares.values()) >= 0.7, shares


def test_perplexity_routing_picks_the_lowest_perplexity_expert(seq_moe):
    """The oracle: an expert's 1/PPL is largest exactly where its NLL is smallest."""
    moe, toy = seq_moe
    model, tokenizer = load_moe(moe, router="perplexity")
    ids = tokenizer(toy.eval_text["math"].read_text()[:400], return_tensors="pt").input_ids
    with torch.no_grad():
        chosen = int(model(input_ids=ids).routing_weights.argmax())
        nll = [torch.nn.functional.cross_entropy(
            model.experts[e].lm_head(model.experts[e](ids, None, None, None, None)[0])[0, :-1],
            ids[0, 1:]) for e in range(3)]
    assert chosen == int(torch.stack(nll).argmin())
