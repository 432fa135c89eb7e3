"""The `calibration` block of a recipe -> routers set in closed form (`router.init: calibrate`):
the build's calibration stage, one call each for the text, the windows and targets, and the
routers.

The text is read by moemerge.data (the same forms as `finetune --data`, docs/data.md) and cut
into windows of `seq_len` + 1 tokens, at most `max_tokens` tokens per domain (windows evenly
spread over the domain's text).
Targets: a one-hot of each window's expert when every domain is named after an expert, or,
for one mixed text, the softmax over experts of each expert's negative next-token loss (each
dense expert is run once). The routers themselves are fitted by routing/calibrate.py on the
built model (written with placeholder routers, which `build` then overwrites in place).
"""

from __future__ import annotations

from pathlib import Path

import torch

from moemerge.data import read_domains
from moemerge.errors import RecipeError
from moemerge.io.reader import DerivedReader
from moemerge.loading import load_pretrained, quiet_transformers
from moemerge.plan.jobs import Plan
from moemerge.plan.sources import SourceModel
from moemerge.recipe.base import CalibrationSpec, CalibrationText
from moemerge.recipe.kinds import kind_of
from moemerge.routing.calibrate import Calibration, domain_targets, loss_targets, token_nll
from moemerge.token_blocks import make_blocks


def calibrates(recipe) -> bool:
    return getattr(getattr(recipe, "router", None), "init", None) == "calibrate"


def decided_later(recipe) -> list[str]:
    """What the calibration stage will decide on the written model, for --dry-run."""
    spec = getattr(recipe, "calibration", None)
    if not calibrates(recipe) or not isinstance(spec, CalibrationSpec):
        return []  # (a merge of MoEs recalibrates on text alone: CalibrationText)
    scale = ("each router's scale fitted to the targets of held-out calibration windows "
             "(calibration.confidence: fit)" if spec.confidence == "fit" else
             f"scaled to a mean top-1 probability of {spec.confidence:g}")
    lines = [f"routers: ridge regression on calibration.data (targets: {spec.targets}), {scale}"]
    if getattr(recipe, "experts_per_token", None) == "auto":
        lines.append(f"experts_per_token: auto: the smallest k in 1..{recipe.num_experts} within "
                     "0.1 % of the best loss on held-out calibration windows (the plan shows "
                     f"{recipe.top_k} until then)")
    return lines


def calibration_texts(spec: CalibrationText, recipe_dir: Path) -> dict[str, list[str]]:
    """{domain: documents}; errors name `calibration.data` (moemerge.data's messages)."""
    domains = read_domains(spec.data, text_field=spec.text_field, what="calibration.data",
                           near=recipe_dir)
    return {name: domain.documents for name, domain in domains.items()}


def expert_models(recipe, models: list[SourceModel]) -> list[SourceModel]:
    """The routed experts in router-row order (the base last with include_base_expert); a
    merge's merged models."""
    routed = getattr(recipe, "experts", None) or recipe.models
    experts = models[len(models) - len(routed):]
    return experts + [models[0]] if getattr(recipe, "include_base_expert", False) else experts


def calibration_windows(spec: CalibrationText, texts: dict[str, list[str]], tokenizer
                        ) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(windows ids [W, seq_len + 1], domain index of each [W], domain names): at most
    max_tokens // seq_len windows per domain, evenly spread over its text."""
    try:
        blocks = make_blocks(texts, tokenizer, spec.seq_len, 0.0)
    except RecipeError as exc:  # its advice names finetune's --seq-len
        raise RecipeError(f"calibration.data: {exc} (here: calibration.seq_len)") from None
    per_domain = max(1, spec.max_tokens // spec.seq_len)
    keep = torch.cat([_spread(torch.nonzero(blocks.domain == d).flatten(), per_domain)
                      for d in range(len(blocks.domains))])
    return blocks.tokens[keep], blocks.domain[keep], blocks.domains


def calibration_set(spec: CalibrationSpec, texts: dict[str, list[str]], tokenizer,
                    experts: list[SourceModel]) -> Calibration:
    ids, domain, domains = calibration_windows(spec, texts, tokenizer)
    labels = [m.label for m in experts]
    unknown = [d for d in domains if d not in labels]
    targets = spec.targets
    if targets == "auto":
        targets = "loss" if unknown and len(domains) == 1 else "domain"
    if targets == "domain":
        if unknown:
            raise RecipeError(
                f"calibration.data: domain(s) {', '.join(map(repr, unknown))} name no expert "
                f"(experts: {', '.join(labels)}); name each text after its expert (name=path), "
                "or give one mixed text (targets: loss)")
        return Calibration(ids, domain_targets(domain, [labels.index(d) for d in domains],
                                               len(labels), spec.seq_len), spec.confidence)
    nll = torch.stack([token_nll(source_as_stored(m), ids) for m in experts])  # [E, W, S]
    return Calibration(ids, loss_targets(nll), spec.confidence)


def _spread(index: torch.Tensor, count: int) -> torch.Tensor:
    """At most `count` entries of index [n], evenly spread over it (a long text's windows
    from all of it, not only its beginning: one mixed text is often domains one after another)."""
    if len(index) <= count:
        return index
    return index[torch.linspace(0, len(index) - 1, count).round().long()]


def model_as_stored(path: Path, **config):
    """The model in its checkpoint's dtype: a router is fitted on the inputs the model computes
    as it will run (a bf16 build in bf16), and a bf16 build is not doubled in memory (loaded
    in fp32, a 1.4 GB model's calibration peaked at 5.1 GB; in bf16 at 2.7 GB:
    benchmarks/results/calibrate.md). The fit's statistics are float64 whatever the dtype.
    `config`: values that override its config.json's (num_experts_per_tok)."""
    return load_pretrained("AutoModelForCausalLM", path, dtype="auto", **config).eval()


@torch.no_grad()
def source_as_stored(model: SourceModel):
    """An input model as the build reads it: its directory's model when it is read as stored;
    a model its reader makes (an MoE's `expert: N`, whose directory holds the whole MoE; a
    LoRA adapter on either, each targeted weight W + s·B·A) built from the reader's config
    and filled with the reader's tensors, in their stored dtype."""
    if not isinstance(model.reader, DerivedReader):
        return model_as_stored(model.path)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{k: v for k, v in model.reader.config.items()
                                     if k not in ("architectures", "auto_map")})
    tensors = {name: model.reader.read(name) for name in model.reader.names()}
    dtype = next(iter(tensors.values())).dtype
    with quiet_transformers():
        made = AutoModelForCausalLM.from_config(config).to(dtype)
    missing, unexpected = made.load_state_dict(tensors, strict=False)
    tied = {name for name in missing if name == "lm_head.weight"} \
        if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{model.where()}: its tensors do not fit its config (missing "
                         f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    made.tie_weights()
    return made.eval()


def calibrated_model(recipe, built: Path, cal: Calibration, stats: dict | None = None,
                     **config) -> tuple[torch.nn.Module, dict]:
    """(the model built at `built` with its routers fitted in place, {layer or name: router})
    by the kind's calibrator (the written routers are placeholders); `stats` receives what it
    keeps of each fit; `config` overrides config.json values (model_as_stored)."""
    model = model_as_stored(built, **config)
    return model, kind_of(recipe).load("calibrator")(model, cal, stats)


def router_tensors(plan: Plan, fitted: dict) -> dict[str, torch.Tensor]:
    """{classic tensor name: router} of a calibrator's {layer or name: router}."""
    return {job.name: fitted[job.name if job.name in fitted else job.layer]
            for job in plan.jobs
            if job.role == "router" and (job.name in fitted or job.layer in fitted)}


def calibrated_routers(recipe, plan: Plan, built: Path, cal: Calibration,
                       stats: dict | None = None) -> dict[str, torch.Tensor]:
    """{classic tensor name: router} fitted on the model built at `built`."""
    return router_tensors(plan, calibrated_model(recipe, built, cal, stats)[1])
