"""`moemerge inspect routing MODEL --data ...`: routing shares checked against hand-known and
independently computed routing, on the toy experts, through the CLI, and on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TEXT, perturbed_copy, write_recipe
from typer.testing import CliRunner

from moemerge.analysis.routing import (
    expert_labels,
    load_moe,
    routing_report,
    routing_report_from_dir,
)
from moemerge.api import build
from moemerge.cli import app
from moemerge.data import domain_texts
from moemerge.errors import RecipeError

torch.set_num_threads(1)
MATH = "Q: What is 12 * 7? A: 12 * 7 = 84.\n" * 40


@pytest.fixture(scope="module")
def moe(model_factory, tmp_path_factory):
    """make(n, k) -> an MoE of n identical copies of a tiny llama (experts 'code', 'math', …):
    its output does not depend on the routing, so routers can be rewritten freely."""
    dense, root, made = model_factory("llama"), tmp_path_factory.mktemp("routing"), {}

    def make(n: int, k: int) -> Path:
        if (n, k) not in made:
            names = ["code", "math", "prose"][:n]
            experts = "\n".join(f"  - {{model: {dense}, name: {name}}}" for name in names)
            recipe = write_recipe(root / f"r{n}{k}.yaml", f"kind: moe\nbase_model: {dense}\n"
                                  f"experts:\n{experts}\nexperts_per_token: {k}\nseed: 3\n")
            build(recipe, root / f"moe{n}{k}", progress=False)
            made[n, k] = root / f"moe{n}{k}"
        return made[n, k]

    return make


def moe_block(layer):
    """A Mixtral layer's MoE block: `mlp` in transformers 5, `block_sparse_moe` in 4."""
    return getattr(layer, "mlp", None) or layer.block_sparse_moe


@pytest.mark.parametrize("n, k, rows, expected", [
    (2, 1, ([0.0, 1.0], [1.0, 0.0]), ([0.0, 1.0], [1.0, 0.0])),  # layer 0 → 1, layer 1 → 0
    (3, 2, ([2.0, 0.0, 1.0], [0.0, 1.0, 2.0]), ([0.5, 0.0, 0.5], [0.0, 0.5, 0.5])),
])
def test_hand_known_routing(moe, n, k, rows, expected):
    """A large constant in embedding dimension 0 makes every router input's dimension 0
    positive (≈ +√hidden after the norm); router rows c·e₀ then rank the experts by c."""
    model, tokenizer = load_moe(moe(n, k))
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 10.0
        for layer, row in zip(model.model.layers, rows, strict=True):
            moe_block(layer).gate.weight.zero_()
            moe_block(layer).gate.weight[:, 0] = torch.tensor(row)
    report = routing_report(model, tokenizer, {"code": TEXT * 5}, seq_len=16)
    domain = report.domains["code"]
    assert report.labels == [f"expert {e}" for e in range(n)] and report.layers == [0, 1]
    assert domain.share == [list(r) for r in expected]
    assert domain.mean_share == pytest.approx([(a + b) / 2 for a, b in zip(*expected, strict=True)])


def test_shares_match_top_k_of_the_captured_router_inputs(moe):
    """Oracle: the MoE blocks' inputs h (captured by separate hooks) give top-k(h·Wᵀ) counts."""
    model, tokenizer = load_moe(moe(3, 2))
    captured: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    handles = [moe_block(layer).register_forward_pre_hook(
        lambda m, args, i=i: captured[i].append(args[0].reshape(-1, args[0].shape[-1])))
        for i, layer in enumerate(model.model.layers)]
    texts = {"code": TEXT * 8, "math": MATH}
    report = routing_report(model, tokenizer, texts, seq_len=32, max_tokens=300,
                            labels=["code", "math", "prose"])
    for handle in handles:
        handle.remove()

    offset = 0
    for domain, text in texts.items():
        n = min(len(tokenizer(text, add_special_tokens=False)["input_ids"]), 300)
        routed = sum(min(33, n - i) - 1 for i in range(0, n - 1, 33))  # windows of 32 + 1
        result = report.domains[domain]
        assert result.tokens == routed
        for layer, h in captured.items():
            h = torch.cat(h)[offset: offset + routed]  # [tokens, hidden]
            chosen = (h @ moe_block(model.model.layers[layer]).gate.weight.T).topk(2).indices
            counts = torch.bincount(chosen.flatten(), minlength=3)
            assert result.share[layer] == pytest.approx((counts / (2 * routed)).tolist())
            assert sum(result.share[layer]) == pytest.approx(1.0)
        assert sum(result.mean_share) == pytest.approx(1.0)
        offset += routed
    assert report.domains["math"].perplexity > 1.0


def reference_scores(h: torch.Tensor, router: torch.Tensor, size: int) -> torch.Tensor:
    """Merged-experts routing written plainly, one token at a time: h [T, H], router [N, H] ->
    scores [T, N]. Token t of segment 0 routes on the mean of tokens 0..t; a token of segment
    k >= 1 on the mean of segment k - 1 (modeling_merged_moemerge's docstring)."""
    rows = []
    for t in range(len(h)):
        k = t // size
        routed_on = h[: t + 1] if k == 0 else h[(k - 1) * size: k * size]
        rows.append(torch.softmax(router @ routed_on.mean(0), -1))
    return torch.stack(rows)


@pytest.mark.parametrize("prompt", [0, 12])
def test_merged_experts_report_mean_routing_weights(model_factory, tmp_path, prompt):
    """Level "weight": each layer's share is the experts' mean routing score over the domain's
    tokens, checked against `reference_scores` on the captured MLP inputs, with distinct
    experts and a random router; with the prompt read first and the rest through the cache
    (the merged cache carries the segment sums). Routing on each segment's own mean instead
    (not causal) misses by 5e-2 in a share, 5000x the tolerance: the check can fail. (The
    router is seeded: with an unseeded one the miss was at times under 1e-3.)"""
    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / d, scale=0.05, seed=i)
               for i, d in enumerate(("code", "math", "prose"))]
    listed = "\n".join(f"  - {{model: {e}, name: {e.name}}}" for e in experts)
    recipe = write_recipe(tmp_path / "m.yaml", f"kind: moe\nassembly: merged_experts\n"
                          f"base_model: {base}\nexperts:\n{listed}\nsegment_length: 5\nseed: 1\n")
    build(recipe, tmp_path / "merged", progress=False)
    model, tokenizer = load_moe(tmp_path / "merged")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a router that separates the experts clearly, different per layer
        for mlp in model.mlps():
            mlp.router.weight.copy_(torch.randn(mlp.router.weight.shape, generator=gen) * 2.0)
    inputs: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    handles = [mlp.register_forward_pre_hook(
        lambda m, args, i=i: inputs[i].append(args[0].detach())) for i, mlp in
        enumerate(model.mlps())]
    report = routing_report(model, tokenizer, {"code": TEXT * 6}, seq_len=32, max_tokens=200,
                            prompt_tokens=prompt, labels=expert_labels(tmp_path / "merged", 3))
    for handle in handles:
        handle.remove()
    assert report.level == "weight" and report.labels == ["code", "math", "prose"]
    assert report.experts_per_token == 3
    for layer, mlp in enumerate(model.mlps()):
        h = inputs[layer]  # per window: [B, T, H], or its prompt then its rest
        windows = [torch.cat(h[i: i + 2], 1) for i in range(0, len(h), 2)] if prompt else h
        expected, wrong = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        for batch in windows:
            for seq in batch:  # [T, H]
                expected += reference_scores(seq, mlp.router.weight, 5).sum(0).double()
                own = [seq[(t // 5) * 5: (t // 5 + 1) * 5].mean(0) for t in range(len(seq))]
                wrong += torch.softmax(torch.stack(own) @ mlp.router.weight.T, -1).sum(0).double()
        share = report.domains["code"].share[layer]
        assert share == pytest.approx((expected / expected.sum()).tolist(), abs=1e-5)
        misses = max(abs(a - b) for a, b in zip(share, (wrong / wrong.sum()).tolist(), strict=True))
        assert misses > 1e-4  # 10x the tolerance; measured 5.2e-2 to 6.0e-2
        assert max(share) > 0.4  # the router is decisive: not the uniform 1/3
    # every token position of every window, prompt and rest alike
    assert report.domains["code"].tokens == sum(x.shape[0] * x.shape[1] for x in inputs[0])


def test_toy_experts_get_their_own_domain(tmp_path_factory, tiny_toy):
    """recipes/toy_moe.yaml (prompts router, top-2 of 3) on the TINY toy experts. Measured
    (torch 2.13 CPU, transformers 5.23 and 4.56.2 alike): each domain's own expert gets 48.9 %
    (code), 49.4 % (prose), 46.8 % (math) of the slots, chance being 33.3 %; with top-1,
    42 / 66 / 90 %. On TINY seeds 1-4 the lowest share is 44.1 % (math, seed 2); code and prose
    stay at 49-50 %, math moves 44.1-47.3 %. The bound 40 % is 4 points under the lowest seed
    (more than math's 3-point spread) and 7 above chance, so an expert routed at chance fails."""
    root, toyset = tmp_path_factory.mktemp("toy"), tiny_toy
    recipe = yaml.safe_load((Path(__file__).parents[2] / "recipes/toy_moe.yaml").read_text())
    del recipe["calibration"]  # the prompts router these figures were measured with
    recipe |= {"base_model": str(toyset.base), "router": {"init": "prompts"}}
    for expert in recipe["experts"]:
        expert["model"] = str(toyset.experts[expert["name"]])
    (root / "toy.yaml").write_text(yaml.safe_dump(recipe))
    build(root / "toy.yaml", root / "moe", progress=False)

    specs = [f"{domain}={path}" for domain, path in toyset.eval_text.items()]
    report = routing_report_from_dir(root / "moe", specs)
    assert report.labels == ["code", "prose", "math"]  # from the recipe copy
    for domain in ("code", "prose", "math"):
        own = report.domains[domain].mean_share[report.labels.index(domain)]
        assert own > 0.40, (domain, own)


def test_data_specs(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "code.txt").write_text(TEXT)
    (tmp_path / "dir" / "notes.md").write_text("markdown too")
    rows = [{"domain": "math", "text": "1 + 1"}, {"domain": "prose", "text": "Hello."},
            {"domain": "math", "text": "2 + 2"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "x.txt").write_text("x")
    texts = domain_texts([str(tmp_path / "dir"), str(tmp_path / "d.jsonl"),
                          f"extra={tmp_path / 'x.txt'}"])
    assert texts == {"code": TEXT, "notes": "markdown too", "math": "1 + 1\n\n2 + 2",
                     "prose": "Hello.", "extra": "x"}

    (tmp_path / "empty.txt").write_text(" \n")
    for specs, message in [
        ([f"a={tmp_path / 'nope.txt'}"], "nope.txt: no such file or directory"),
        ([f"a={tmp_path / 'empty.txt'}"], "empty.txt: empty file"),
    ]:
        with pytest.raises(RecipeError, match=message):
            domain_texts(specs)
    # records without the label field: the file is one domain named by its stem
    assert list(domain_texts([str(tmp_path / "d.jsonl")], label_field="topic")) == ["d"]


def test_cli(moe, model_factory, tokenizer, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "code.txt").write_text(TEXT * 10)
    (data / "math.txt").write_text(MATH)
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", "routing", str(moe(2, 1)), "--data", str(data),
                                 "--json", str(js), "--plot", str(png), "--per-layer",
                                 "--seq-len", "64"])
    assert result.exit_code == 0, result.output
    assert "perplexity" in result.output and "per layer" in result.output
    assert "code" in result.output and "math" in result.output
    # which windows the perplexities are over, under the table (the demo's differ)
    tokens = {d: len(tokenizer(t, add_special_tokens=False)["input_ids"])
              for d, t in (("code", TEXT * 10), ("math", MATH))}
    counts = {d: -(-(n - 1) // 65) for d, n in tokens.items()}  # windows start every 65 tokens
    assert (f"perplexity windows: 65 tokens, stride 65 (non-overlapping; the last 64 of each "
            f"scored), over the first 20000 tokens of each domain: code {counts['code']}, math "
            f"{counts['math']}") in " ".join(result.output.split())
    doc = json.loads(js.read_text())
    assert set(doc) == {"schema", "model", "level", "experts_per_token", "num_experts", "experts",
                        "layers", "domains", "windows"}
    assert doc["windows"] == {"seq_len": 64, "max_tokens": 20000, "count": counts}
    assert doc["schema"] == "moemerge.routing/1" and doc["experts"] == ["code", "math"]
    assert doc["num_experts"] == 2 and doc["experts_per_token"] == 1
    assert set(doc["domains"]["math"]) == {"tokens", "perplexity", "share", "mean_share"}
    assert png.stat().st_size > 1024 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    dense = runner.invoke(app, ["inspect", "routing", str(model_factory("llama")), "--data",
                                str(data)])
    assert dense.exit_code == 1 and "not an MoE" in dense.output
    missing = runner.invoke(app, ["inspect", "routing", str(moe(2, 1)), "--data",
                                  f"a={data / 'no.txt'}"])
    assert missing.exit_code == 2 and "no.txt" in missing.output
    both = runner.invoke(app, ["inspect", "routing", str(moe(2, 1)), str(moe(2, 1)), "--data",
                               str(data)])
    assert both.exit_code == 2 and "unexpected extra argument" in both.output
    no_data = runner.invoke(app, ["inspect", "routing", str(moe(2, 1))])
    assert no_data.exit_code == 2 and "--data" in no_data.output
    # the form from before `inspect routing` still works, and says what replaced it
    old = runner.invoke(app, ["inspect", str(moe(2, 1)), "--data", str(data), "--seq-len", "64"])
    assert old.exit_code == 0, old.output
    assert "deprecated" in old.output and "inspect routing MODEL" in old.output
    assert "perplexity windows: 65 tokens" in " ".join(old.output.split())
