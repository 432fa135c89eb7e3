"""`moemerge route`: which experts a sequence-routed MoE sends each prompt to, and with what
weight. Prompts come from text files (one per line, per blank-line paragraph, or per file) or
JSONL (one per record); each is routed on its own, as generate() would route it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moemerge.analysis.routing import expert_labels, load_moe
from moemerge.bounds import MAX_EXPERTS  # the most a recipe may build
from moemerge.data import Split, read_domains
from moemerge.errors import CheckpointError, RecipeError
from moemerge.io.reader import read_config
from moemerge.loading import check_seq_len
from moemerge.modeling.routing_moemerge import sequence_nll
from moemerge.recipe.kinds import Kind

SCHEMA = "moemerge.route/1"


@dataclass
class RoutedPrompt:
    text: str
    tokens: int
    # [{"expert": index, "name": label, "weight": w}], heaviest first; perplexity routing adds
    # "perplexity": the expert's own perplexity on the prompt, the evidence behind the weight
    experts: list[dict]


@dataclass
class RouteReport:
    model: str
    router: str
    experts_per_sequence: int
    temperature: float
    experts: list[str]
    prompts: list[RoutedPrompt] = field(default_factory=list)
    # a perplexity router's scores: "log_inverse" (log 1/PPL) or "inverse" (1/PPL; older models)
    perplexity_score: str = "log_inverse"

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, indent=2) + "\n"


def read_prompts(files: list[Path | str], *, split: Split, text_field: str) -> list[str]:
    """Prompts from any --data source (docs/data.md): each JSONL record, and each text file
    cut by `split` (per line, blank-line paragraph, or whole file)."""
    domains = read_domains(map(str, files), text_field=text_field, split=split, what="prompts")
    return [doc for d in domains.values() for doc in d.documents + d.held_out if doc.strip()]



def check_sequence_config(config: dict, file: Path) -> None:
    """The keys of a sequence-routed config that route reads itself: `experts`, a list of
    expert configs (objects), and `expert_names`, absent or one string per expert."""
    experts, names = config.get("experts"), config.get("expert_names")
    if not (isinstance(experts, list) and 0 < len(experts) <= MAX_EXPERTS
            and all(isinstance(e, dict) for e in experts)):
        raise CheckpointError(f"{file}: experts is {repr(experts)[:60]}; it must be a list of "
                              f"1 to {MAX_EXPERTS} expert configs (objects)")
    if names is not None and not (isinstance(names, list) and len(names) == len(experts)
                                  and all(isinstance(n, str) for n in names)):
        raise CheckpointError(f"{file}: expert_names is {repr(names)[:60]}; it must be a list "
                              "of one name per expert")


@torch.no_grad()
def route_prompts(model_dir: Path, prompts: list[str], *, router: str | None = None,
                  k: int | None = None, temperature: float | None = None,
                  max_tokens: int = 2048) -> RouteReport:
    """Route each prompt (its first `max_tokens` tokens) through the model at `model_dir`;
    `router` / `k` / `temperature` override the model's routing for this run."""
    model_dir = Path(model_dir)
    overrides = {key: value for key, value in
                 (("router", router), ("num_experts_per_seq", k),
                  ("routing_temperature", temperature)) if value is not None}
    config = read_config(model_dir)
    Kind.of_config(config).require("route", model_dir)
    check_sequence_config(config, model_dir / "config.json")
    if k is not None and k > len(config["experts"]):
        raise RecipeError(f"-k {k}: the model has only {len(config['experts'])} experts")
    if router == "task_vector" and not config.get("base"):
        raise RecipeError(f"--router task_vector: {model_dir} does not keep the base model it "
                          "needs; build it with router kind task_vector")
    check_seq_len(max_tokens, "--max-tokens", config, model_dir)  # before any weights
    model, tokenizer = load_moe(model_dir, **overrides)
    model.eval()
    labels = expert_labels(model_dir, model.config.num_experts)
    report = RouteReport(str(model_dir), model.config.router, model.config.num_experts_per_seq,
                         model.config.routing_temperature, labels,
                         perplexity_score=model.config.perplexity_score)
    for text in prompts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        ids = ids[:, :max_tokens]
        if ids.shape[1] == 0:
            raise RecipeError(f"prompt {text[:40]!r} has no tokens")
        weights, ppl = _route(model, ids)
        chosen = [int(e) for e in weights.argsort(descending=True) if weights[e] > 0]
        report.prompts.append(RoutedPrompt(text, ids.shape[1], [
            {"expert": e, "name": labels[e], "weight": round(float(weights[e]), 6)}
            | ({} if ppl is None else {"perplexity": round(float(ppl[e]), 4)})
            for e in chosen]))
    return report


def _route(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ids [1, T] -> (routing weights [N], each expert's perplexity on ids [N] under perplexity
    routing, else None). The model's own route() decides, as in its forward; only the routing
    is run, and perplexity routing's expert forwards are reused for the perplexities."""
    embeds = model.embed_tokens(ids) if model.embed_tokens is not None else None

    def run(e):  # expert e's (final hidden [1, T, d], cache) on the prompt, as forward runs it
        return model.experts[e](ids, embeds, None, None, None)

    weights, _, done = model.route(ids, None, run)
    if model.config.router != "perplexity":
        return weights[0], None
    nll = torch.stack([sequence_nll(model._head(e, done[e][0]), ids, None)[0]
                       for e in range(model.config.num_experts)])
    return weights[0], nll.exp()
