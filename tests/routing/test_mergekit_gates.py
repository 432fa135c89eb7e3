"""mergekit-moe's gate modes, computed as mergekit does (router.init mergekit_*), against a
plain reference of its formula: each prompt run alone, left-padded with BOS to its batch's
longest, the residual stream entering each layer at the last token (hidden) or summed over
every position, padding included, / the width (hidden_avg), or the sum of the prompt tokens'
embeddings (cheap_embed); averaged over the prompts, the
negative prompts' subtracted, unit rows, not centred. benchmarks/mergekit_parity.py compares
with mergekit itself (0 apart)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from moemerge.recipe.base import ExpertRef
from moemerge.routing.prompts import mergekit_gate_rows, prompt_router_rows

EXPERTS = [
    ExpertRef(model="e0", positive_prompts=["def main(argv):", "for item in items:"]),
    ExpertRef(model="e1", positive_prompts=["Once upon a time there was a river"],
              negative_prompts=["def helper():"]),
    ExpertRef(model="e2", positive_prompts=["2 + 2 = 4", "x squared"]),
]


def reference(base, init: str) -> torch.Tensor:
    """[L, E, H], one prompt at a time."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    embed = load_file(base / "model.safetensors")["model.embed_tokens.weight"].float()
    layers = model.config.num_hidden_layers

    pad = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else \
        tokenizer.eos_token_id

    def vector(prompts: list[str]) -> torch.Tensor:  # [L, H]
        tokens = [tokenizer((tokenizer.bos_token or "") + p, add_special_tokens=False)[
            "input_ids"] for p in prompts]
        width = max(map(len, tokens))  # mergekit pads the batch on the left to its longest
        per_prompt = []
        for ids in tokens:
            if init == "mergekit_cheap_embed":
                per_prompt.append(embed[ids].sum(0).repeat(layers, 1))
                continue
            padded = torch.tensor([[pad] * (width - len(ids)) + ids])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids)])
            with torch.no_grad():
                states = model(padded, attention_mask=mask,
                               output_hidden_states=True).hidden_states[:-1]
            # hidden: the last position; hidden_avg: every position, the padding's too
            per_prompt.append(torch.stack([s[0, -1] if init == "mergekit_hidden"
                                           else s[0].sum(0) / width for s in states]).float())
        if init == "mergekit_cheap_embed":
            summed = sum(per_prompt)
            return summed / summed.norm(dim=-1, keepdim=True)
        return sum(per_prompt) / len(per_prompt)

    rows = []
    for expert in EXPERTS:
        row = vector(expert.positive_prompts)
        if expert.negative_prompts:
            row = row - vector(expert.negative_prompts)
        rows.append(row / row.norm(dim=-1, keepdim=True))
    return torch.stack(rows, dim=1)


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


@pytest.mark.parametrize("init", ["mergekit_hidden", "mergekit_hidden_avg",
                                  "mergekit_cheap_embed"])
def test_mergekit_gates_follow_its_formula(init, model_factory):
    base = model_factory("llama")
    embed = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    layers = AutoModelForCausalLM.from_pretrained(base).config.num_hidden_layers
    rows = mergekit_gate_rows(base, EXPERTS, init, layers=layers, embed=embed)
    expected = reference(base, init)
    assert rows.shape == expected.shape == (layers, 3, embed.shape[1])
    torch.testing.assert_close(rows.norm(dim=-1).float(), torch.ones(layers, 3), atol=1e-2,
                               rtol=0)
    if init == "mergekit_cheap_embed":  # float32 throughout: the same sums, no padding effect
        torch.testing.assert_close(rows, expected, atol=1e-6, rtol=1e-5)
    else:  # bfloat16 states: a padded batch against one prompt at a time
        assert cosines(rows, expected).min() > 0.999


def test_the_comparison_can_fail(model_factory):
    """moemerge's own prompts init (the FFN input over every token, centred across experts) is
    another router: far from mergekit's hidden gate by the same measure."""
    base = model_factory("llama")
    layers = AutoModelForCausalLM.from_pretrained(base).config.num_hidden_layers
    own = prompt_router_rows(base, EXPERTS, include_base=False, max_tokens=512)
    assert own.shape == (layers, 3, own.shape[2])
    assert cosines(own, reference(base, "mergekit_hidden")).min() < 0.9


def test_a_build_writes_them_as_its_routers(model_factory, tmp_path):
    """Layer l's router is row block l (the base expert's row 0 with include_base_expert)."""
    from conftest import perturbed_copy, write_recipe

    from moemerge.api import build

    base = model_factory("llama")
    experts = [perturbed_copy(base, tmp_path / f"e{i}", scale=0.05, seed=i) for i in range(3)]
    lines = "".join(f"  - model: {m}\n    positive_prompts: {EXPERTS[i].positive_prompts}\n"
                    for i, m in enumerate(experts))
    recipe = write_recipe(tmp_path / "r.yaml", f"kind: moe\nbase_model: {base}\nexperts:\n"
                          f"{lines}include_base_expert: true\nexperts_per_token: 2\n"
                          "router: {init: mergekit_cheap_embed}\noutput: {dtype: float32}\n")
    build(recipe, tmp_path / "out", progress=False, verify="structure")
    built = load_file(tmp_path / "out" / "model.safetensors")
    embed = load_file(base / "model.safetensors")["model.embed_tokens.weight"]
    positive = [ExpertRef(model="x", positive_prompts=e.positive_prompts) for e in EXPERTS]
    rows = mergekit_gate_rows(base, positive, "mergekit_cheap_embed", layers=2, embed=embed)
    for layer in range(2):
        router = built[f"model.layers.{layer}.block_sparse_moe.gate.weight"]
        torch.testing.assert_close(router[:3], rows[layer], atol=0, rtol=0)
        assert router.shape == (4, embed.shape[1]) and not router[3].any()
