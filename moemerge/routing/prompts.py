"""Mean hidden states of prompts, for the `prompts` and `cheap_embed` router inits, and
mergekit-moe's gates (`mergekit_hidden`, `mergekit_hidden_avg`, `mergekit_cheap_embed`).

All need the base model's tokenizer; `prompts` also runs the base model (loaded once, in fp32,
with transformers) and records each layer's router input: the input of its FFN module (the
architecture table's `ffn_module`: after post_attention_layernorm in Llama, the residual stream
itself in OLMo 2). mergekit's gates are computed as mergekit-moe 0.1.5 computes them
(mergekit/moe/router.py), for a config imported from it: see `mergekit_gate_rows`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from moemerge.errors import CheckpointError
from moemerge.io.reader import read_config
from moemerge.loading import check_tokenizer_fits, load_pretrained, vocab_rows
from moemerge.recipe.base import ExpertRef
from moemerge.routing.init import contrast_rows


def _tokenize(tokenizer, prompts: list[str], max_tokens: int) -> list[torch.Tensor]:
    return [
        torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"][:max_tokens])
        for p in prompts
        if p.strip()
    ]


def _load_tokenizer(base_dir: Path):
    """The base's tokenizer, each id it gives a row of the base's embedding (the prompts run
    through the base, or index its embedding)."""
    try:
        tokenizer = load_pretrained("AutoTokenizer", base_dir)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"router init from prompts needs the base model's tokenizer, but none loads from "
            f"{base_dir}: {exc}"
        ) from None
    check_tokenizer_fits(tokenizer, vocab_rows(read_config(base_dir)), base_dir, base_dir)
    return tokenizer


def _load_base(base_dir: Path, dtype: torch.dtype, init: str):
    try:
        model = load_pretrained("AutoModelForCausalLM", base_dir, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"router init {init} runs the base model, but it does not load "
                              f"from {base_dir}: {exc}") from None
    return model.eval()


def _per_layer_means(model, ids_list: list[torch.Tensor], ffn_module: str) -> torch.Tensor:
    """Mean router input (the input of each layer's `ffn_module`: its FFN, or the block a LoRA
    expert's router sits in) over every token of the prompts: [L, H]."""
    layers = model.model.layers
    sums = [None] * len(layers)
    count = 0

    def hook(index):
        def record(_module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]  # attention: a keyword
            total = h[0].sum(dim=0)  # [1, T, H] -> [H]
            sums[index] = total if sums[index] is None else sums[index] + total

        return record

    handles = [
        layer.get_submodule(ffn_module).register_forward_pre_hook(hook(i), with_kwargs=True)
        for i, layer in enumerate(layers)
    ]
    try:
        with torch.no_grad():
            for ids in ids_list:
                model(input_ids=ids[None])
                count += ids.numel()
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack(sums) / count


def prompt_router_rows(
    base_dir: Path, experts: list[ExpertRef], *, include_base: bool, max_tokens: int,
    ffn_module: str = "mlp",
) -> torch.Tensor:
    """Router weights for every layer from the experts' prompts: [L, E, H]."""
    tokenizer = _load_tokenizer(base_dir)
    model = _load_base(base_dir, torch.float32, "prompts")

    def means(prompts: list[str]) -> torch.Tensor | None:
        ids = _tokenize(tokenizer, prompts, max_tokens)
        return _per_layer_means(model, ids, ffn_module) if ids else None

    positive = [means(e.positive_prompts) for e in experts]
    negative = [means(e.negative_prompts) for e in experts]
    return _stack_layers(positive, negative, include_base)


def embed_router_rows(
    base_dir: Path,
    experts: list[ExpertRef],
    embed: torch.Tensor,
    norms: list[torch.Tensor],
    *,
    include_base: bool,
    max_tokens: int,
) -> torch.Tensor:
    """cheap_embed: embed [V, H], norms[l] [H] the weights of the norm the FFN reads through
    (ones where it reads the residual stream unnormed) -> [L, E, H]."""
    tokenizer = _load_tokenizer(base_dir)
    scale = torch.stack([n.float() for n in norms])  # [L, H]

    def means(prompts: list[str]) -> torch.Tensor | None:
        ids = _tokenize(tokenizer, prompts, max_tokens)
        if not ids:
            return None
        mean = embed[torch.cat(ids)].float().mean(dim=0)  # [H]
        return mean[None] * scale  # [L, H]

    positive = [means(e.positive_prompts) for e in experts]
    negative = [means(e.negative_prompts) for e in experts]
    return _stack_layers(positive, negative, include_base)


def _stack_layers(positive, negative, include_base: bool) -> torch.Tensor:
    """positive[e], negative[e]: [L, H] (or None) -> [L, E(+1), H]; the base expert's row is 0."""
    num_layers, hidden = positive[0].shape
    per_layer = []
    for layer in range(num_layers):
        rows = contrast_rows(
            [p[layer] for p in positive], [n[layer] if n is not None else None for n in negative]
        )
        if include_base:
            rows = torch.cat([rows, torch.zeros(1, hidden)])
        per_layer.append(rows)
    return torch.stack(per_layer)


def mergekit_gate_rows(base_dir: Path, experts: list[ExpertRef], init: str, *, layers: int,
                       embed: torch.Tensor | None = None) -> torch.Tensor:
    """mergekit-moe's gate rows [L, E, H] for gate_mode hidden (`mergekit_hidden`),
    hidden_avg and cheap_embed: each prompt is the tokenizer's BOS text + the prompt, the
    prompts of an expert one left-padded batch (pad = BOS, else EOS). hidden: the base model in
    bfloat16, layer l's row the residual stream entering decoder layer l (hidden_states[l]) at
    the last position (hidden_avg: the sum over the padded positions / their count), averaged
    over the prompts. cheap_embed: the sum over the prompts' tokens of `embed` [V, H] in float32,
    as a unit vector, the same in every layer. Negative prompts' vectors are subtracted, then
    each layer's row made a unit vector; not centred across experts."""
    tokenizer = _load_tokenizer(base_dir)
    tokenizer.padding_side = "left"
    tokenizer.pad_token_id = tokenizer.bos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if init == "mergekit_cheap_embed":
        assert embed is not None

        def vectors(tokens) -> torch.Tensor:  # [L, H]
            h = F.one_hot(tokens["input_ids"], num_classes=embed.shape[0]).float() @ embed.float()
            summed = (h * tokens["attention_mask"].unsqueeze(-1)).sum(dim=1).sum(dim=0)
            return (summed / summed.norm().clamp(min=1e-8)).repeat(layers, 1)
    else:
        model = _load_base(base_dir, torch.bfloat16, init)

        def vectors(tokens) -> torch.Tensor:  # [L, H], bfloat16 as mergekit's
            with torch.no_grad():
                states = torch.stack(model(**tokens, output_hidden_states=True,
                                           return_dict=True).hidden_states[:-1])  # [L, B, T, H]
            if init == "mergekit_hidden_avg":
                states = states.sum(dim=2) / states.shape[2]
            else:
                states = states[:, :, -1, :]
            return states.sum(dim=1) / states.shape[1]

    def tokenized(prompts: list[str]):
        return tokenizer([(tokenizer.bos_token or "") + p for p in prompts],
                         return_tensors="pt", padding=True, add_special_tokens=False)

    rows = []
    for expert in experts:
        row = vectors(tokenized(expert.positive_prompts))
        if expert.negative_prompts:
            row = row - vectors(tokenized(expert.negative_prompts))
        rows.append(row / row.norm(p=2, dim=-1, keepdim=True).clamp(min=1e-8))
    return torch.stack(rows).permute(1, 0, 2)  # [L, E, H]

