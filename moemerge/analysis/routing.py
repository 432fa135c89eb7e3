"""Routing report of an MoE: which experts each domain's tokens (or sequences) are sent to.

Forward hooks on every router (`…mlp.gate`, the module whose weight is [num_experts, hidden])
read its logits, take the top-k (k = config `num_experts_per_tok`) and count, per layer, how
many token slots each expert gets: each token fills k slots, so a layer's shares sum to 1 and
uniform routing gives every expert 1/E. The top-k is taken here from the logits (the order of
softmax(logits)), so it does not depend on what the gate returns: logits alone (transformers 4)
or (logits, scores, indices) (transformers 5). The forward passes are those of
`moemerge.eval.perplexity`, so one pass per window gives both the routing and the perplexity.

moemerge's sequence-routed kinds (seq_routed, bridged) route each window as a whole: the report
has one row ("sequence" level) counting, per expert, the windows among whose top k it is, read
from the model output's routing_weights [B, N].

A merged-experts model (SMEAR / CAMEx) sends no token anywhere: every token's FFN mixes every
expert with its routing scores s [N] (softmax over the experts, summing to 1). Its report
("weight" level) gives, per layer, each expert's mean score over the domain's tokens: a layer's
shares again sum to 1, and routing that ignores the domain gives 1/E each.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moemerge.architectures.forms import moe_names
from moemerge.architectures.tables import expert_count_keys
from moemerge.data import domain_texts
from moemerge.errors import CheckpointError, RecipeError
from moemerge.eval.perplexity import perplexity, window_counts
from moemerge.io.reader import read_config
from moemerge.loading import (
    check_seq_len,
    load_causal_lm,
    load_pretrained,
    read_recipe_copy,
)
from moemerge.recipe.kinds import Kind
from moemerge.routing.modules import find_routers

SCHEMA = "moemerge.routing/1"  # bump when a key changes meaning or disappears (docs/inspect.md)


@dataclass
class DomainRouting:
    tokens: int  # units routed: token positions (per layer), or windows at sequence level
    perplexity: float
    share: list[list[float]]  # [layer][expert]: fraction of the layer's slots (or score mass)

    @property
    def mean_share(self) -> list[float]:
        """[expert]: the per-layer shares averaged over layers."""
        return [sum(col) / len(col) for col in zip(*self.share, strict=True)]


@dataclass
class RoutingReport:
    model: str
    experts_per_token: int
    labels: list[str]  # one per expert, in the checkpoint's expert order
    layers: list[int]  # indices of the layers that have a router
    domains: dict[str, DomainRouting] = field(default_factory=dict)
    # "token"; "sequence" for seq_routed / bridged (one row, slots per window); "weight" for
    # merged_experts (mean routing score per token; experts_per_token is then every expert)
    level: str = "token"
    # the perplexity windows: {"seq_len": ..., "max_tokens": ..., "count": {domain: windows}}
    windows: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "model": self.model, "level": self.level,
            "experts_per_token": self.experts_per_token, "windows": self.windows,
            "num_experts": len(self.labels), "experts": self.labels, "layers": self.layers,
            "domains": {
                name: {"tokens": d.tokens, "perplexity": d.perplexity, "share": d.share,
                       "mean_share": d.mean_share}
                for name, d in self.domains.items()
            },
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"


def moe_shape(config, where: str) -> tuple[int, int]:
    """(num_experts, experts per token or per sequence; every expert for merged_experts) of an
    MoE config; CheckpointError for a dense one."""
    experts, k = Kind.of_config(config).shape(config)
    if not experts or not k:
        keys = expert_count_keys()
        raise CheckpointError(
            f"{where}: not an MoE checkpoint (its config has no {' / '.join(keys)} and "
            f"num_experts_per_tok); a routing report needs an MoE such as {moe_names()} "
            "(for task vectors, give BASE EXPERT... without --data)"
        )
    return experts, k


@torch.no_grad()
def routing_report(
    model: torch.nn.Module,
    tokenizer,
    texts: dict[str, str],
    *,
    seq_len: int = 256,
    max_tokens: int | None = 20000,
    prompt_tokens: int = 0,
    labels: list[str] | None = None,
    name: str = "",
) -> RoutingReport:
    """Route each domain's text (its first `max_tokens` tokens, in windows of `seq_len`)
    through an already-loaded MoE; shares per (domain, layer, expert) and perplexity.
    `prompt_tokens` reads each window as `perplexity` does (a prompt, then the rest through
    the KV cache). `labels` name the experts (numbered when absent or of the wrong length)."""
    num_experts, k = moe_shape(model.config, name or type(model).__name__)
    level = Kind.of_config(model.config).routing
    routers = {"sequence": lambda: [(0, model)], "weight": lambda: list(enumerate(model.mlps())),
               "token": lambda: token_routers(model, num_experts)}[level]()
    if not routers:
        raise CheckpointError(f"{name or type(model).__name__}: not an MoE (no router modules "
                              f"with {num_experts} outputs found)")
    if labels is None or len(labels) != num_experts:
        labels = [f"expert {e}" for e in range(num_experts)]
    counts = torch.zeros(len(routers), num_experts, dtype=torch.float64)  # [layer, expert] slots

    from moemerge.modeling.pretrained_moemerge import CACHE  # transformers' name for it

    def hook(row: int):
        def record(module, args, kwargs, output) -> None:
            if level == "sequence":  # the experts with weight in each window's routing: [B, N]
                if kwargs.get(CACHE) is None:  # after a prompt: its routing, kept
                    counts[row] += (output.routing_weights > 0).sum(0).cpu()
                return
            # the logits from the router's input and weight, whatever the module returns
            # (logits; transformers 5: a tuple; DeepSeek-V2 in transformers 4: its top-k)
            x = args[0] if args else next(iter(kwargs.values()))
            logits = x.reshape(-1, x.shape[-1]) @ module.weight.T  # [tokens, experts]
            chosen = logits.topk(k, dim=-1).indices  # [tokens, k]
            counts[row] += torch.bincount(chosen.flatten().cpu(), minlength=num_experts)
        return record

    report = RoutingReport(name, k, list(labels), [layer for layer, _ in routers], level=level,
                           windows={"seq_len": seq_len, "max_tokens": max_tokens, "count": {}})
    if level == "weight":
        restore = [_record_scores(mlp, counts[row]) for row, mlp in routers]
    else:
        handles = [m.register_forward_hook(hook(row), with_kwargs=True)
                   for row, (_, m) in enumerate(routers)]
        restore = [handle.remove for handle in handles]
    was_training = model.training
    per_unit = 1 if level == "weight" else k  # slots a token (or window) fills
    try:
        for domain, text in texts.items():
            counts.zero_()
            try:
                ppl = perplexity(model, tokenizer, text, seq_len=seq_len, max_tokens=max_tokens,
                                 prompt_tokens=prompt_tokens)
            except ValueError as exc:
                raise RecipeError(f"domain {domain!r}: its text is too short ({exc})") from None
            slots = counts.sum(dim=1, keepdim=True)  # [layer, 1] = tokens * k
            share = (counts / slots).tolist()
            report.domains[domain] = DomainRouting(round(float(slots[0, 0])) // per_unit, ppl,
                                                   share)
            report.windows["count"] |= window_counts(tokenizer, {domain: text}, seq_len=seq_len,
                                                     max_tokens=max_tokens,
                                                     prompt_tokens=prompt_tokens)
    finally:
        for undo in restore:
            undo()
        model.train(was_training)  # perplexity() switched to eval; a trainer may want it back
    return report


def token_routers(model: torch.nn.Module, num_experts: int) -> list[tuple[int, torch.nn.Module]]:
    """[(layer, router)] of a token-routed MoE; an MoE of LoRA experts lists its own (its FFN
    routers where the adapters target the FFN, else its attention routers)."""
    own = getattr(model, "router_modules", None)
    if not callable(own):
        return find_routers(model, num_experts)
    routers = own()  # {model.layers.{l}.<block>.router: module}
    ffn = {name: m for name, m in routers.items() if ".mlp." in name}
    return [(int(name.split(".")[2]), m) for name, m in (ffn or routers).items()]


def _record_scores(mlp, total: torch.Tensor):
    """Add each forward's routing scores [B, T, N], summed over tokens, to `total` [N]; returns
    the function that undoes it. (The scores are computed inside the merged MLP's forward, so
    its `scores` method is wrapped on the instance rather than hooked.)"""
    original = mlp.scores

    def scores(h: torch.Tensor) -> torch.Tensor:
        s = original(h)
        total.add_(s.detach().sum(dim=(0, 1)).double().cpu())
        return s

    mlp.scores = scores
    return lambda: delattr(mlp, "scores")


def expert_labels(model_dir: Path, num_experts: int) -> list[str]:
    """Expert names from the recipe copy `build` left in `model_dir` (the expert's `name`, else
    its directory's name; "base" last with include_base_expert), else "expert 0..N-1"."""
    default = [f"expert {e}" for e in range(num_experts)]
    try:
        config = read_config(model_dir)
    except CheckpointError:
        config = {}  # labels are a nicety: numbered experts will do
    if Kind.of_config(config).remote_code and len(config.get("expert_names") or []) == \
            num_experts:
        return list(config["expert_names"])
    recipe = read_recipe_copy(model_dir)
    try:
        labels: list[str] = []
        for ref in recipe["experts"]:
            ref = {"model": ref} if isinstance(ref, str) else ref
            label = ref.get("name") or Path(str(ref["model"]).rstrip("/")).name
            labels.append(label if label not in {"base", *labels} else f"{label}#{len(labels)+1}")
        if recipe.get("include_base_expert"):
            labels.append("base")
    except (KeyError, TypeError, AttributeError):
        return default  # no recipe copy (or not one of ours): numbered experts
    return labels if len(labels) == num_experts else default


def load_moe(model_dir: Path, **overrides):
    """(model, tokenizer) of a local MoE checkpoint in fp32; clear errors for the wrong kind.
    `overrides` replace config fields (e.g. router="perplexity" for a sequence-routed model)."""
    read_config(model_dir)  # a clear error for a missing or broken config.json
    try:
        moe_shape(load_pretrained("AutoConfig", model_dir), str(model_dir))  # before any weights
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot load an MoE config from {model_dir}: {exc}") from None
    return load_causal_lm(model_dir, what="an MoE", **overrides)


def routing_report_from_dir(
    model_dir: Path | str,
    data: Iterable[str],
    *,
    label_field: str = "domain",
    text_field: str = "text",
    seq_len: int = 256,
    max_tokens: int | None = 20000,
) -> RoutingReport:
    """`moemerge inspect routing MODEL_DIR --data ...`: the data is read (and checked) before
    the model."""
    model_dir = Path(model_dir)
    texts = domain_texts(data, label_field=label_field, text_field=text_field)
    model, tokenizer = load_moe(model_dir)
    check_seq_len(seq_len, "--seq-len", model.config, model_dir)
    labels = expert_labels(model_dir, moe_shape(model.config, str(model_dir))[0])
    return routing_report(model, tokenizer, texts, seq_len=seq_len, max_tokens=max_tokens,
                          labels=labels, name=str(model_dir))
