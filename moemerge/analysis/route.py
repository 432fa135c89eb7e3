"""`moemerge route`: which experts a sequence-routed MoE sends each prompt to, and with what
weight. Prompts come from text files (one per line, per blank-line paragraph, or per file) or
JSONL (one per record); each is routed on its own, as generate() would route it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moemerge.analysis.routing import expert_labels, load_moe
from moemerge.data import Split, read_domains
from moemerge.errors import CheckpointError, RecipeError
from moemerge.io.reader import read_config
from moemerge.modeling import is_sequence_routed

SCHEMA = "moemerge.route/1"


@dataclass
class RoutedPrompt:
    text: str
    tokens: int
    experts: list[dict]  # [{"expert": index, "name": label, "weight": w}], heaviest first


@dataclass
class RouteReport:
    model: str
    router: str
    experts_per_sequence: int
    experts: list[str]
    prompts: list[RoutedPrompt] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, indent=2) + "\n"


def read_prompts(files: list[Path | str], *, split: Split, text_field: str) -> list[str]:
    """Prompts from any --data source (docs/data.md): each JSONL record, and each text file
    cut by `split` (per line, blank-line paragraph, or whole file)."""
    domains = read_domains(map(str, files), text_field=text_field, split=split, what="prompts")
    return [doc for d in domains.values() for doc in d.documents + d.held_out if doc.strip()]


@torch.no_grad()
def route_prompts(model_dir: Path, prompts: list[str], *, router: str | None = None,
                  k: int | None = None, max_tokens: int = 2048) -> RouteReport:
    """Route each prompt (its first `max_tokens` tokens) through the model at `model_dir`;
    `router` / `k` override the model's routing for this run."""
    model_dir = Path(model_dir)
    overrides = {key: value for key, value in
                 (("router", router), ("num_experts_per_seq", k)) if value is not None}
    config = read_config(model_dir)
    if not is_sequence_routed(config):
        raise CheckpointError(f"{model_dir}: not a sequence-routed moemerge model (seq_routed or "
                              "bridged); a token-routed MoE routes each token, see `moemerge "
                              "inspect MODEL --data ...`")
    if k is not None and k > len(config["experts"]):
        raise RecipeError(f"-k {k}: the model has only {len(config['experts'])} experts")
    if router == "task_vector" and not config.get("base"):
        raise RecipeError(f"--router task_vector: {model_dir} does not keep the base model it "
                          "needs; build it with router kind task_vector")
    model, tokenizer = load_moe(model_dir, **overrides)
    model.eval()
    labels = expert_labels(model_dir, model.config.num_experts)
    report = RouteReport(str(model_dir), model.config.router, model.config.num_experts_per_seq,
                         labels)
    for text in prompts:
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        ids = ids[:, :max_tokens]
        if ids.shape[1] == 0:
            raise RecipeError(f"prompt {text[:40]!r} has no tokens")
        weights = model(input_ids=ids, use_cache=False).routing_weights[0]  # [N]
        chosen = [int(e) for e in weights.argsort(descending=True) if weights[e] > 0]
        report.prompts.append(RoutedPrompt(text, ids.shape[1], [
            {"expert": e, "name": labels[e], "weight": round(float(weights[e]), 6)}
            for e in chosen]))
    return report
