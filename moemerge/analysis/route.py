"""`moemerge route`: which experts a sequence-routed MoE sends each prompt to, and with what
weight. Prompts come from text files (one per line, per blank-line paragraph, or per file) or
JSONL (one per record); each is routed on its own, as generate() would route it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from moemerge.analysis.routing import expert_labels, load_moe
from moemerge.errors import CheckpointError, RecipeError
from moemerge.io.reader import read_config
from moemerge.modeling import is_sequence_routed

SCHEMA = "moemerge.route/1"
Split = Literal["line", "paragraph", "file"]


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


def read_prompts(files: list[Path], *, split: Split, text_field: str) -> list[str]:
    """Prompts from .jsonl records (`text_field`) or text files (cut by `split`)."""
    prompts: list[str] = []
    for file in map(Path, files):
        if not file.is_file():
            raise RecipeError(f"{file}: prompt file not found")
        text = file.read_text(encoding="utf-8")
        if file.suffix == ".jsonl":
            for number, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    prompts.append(_record_text(line, text_field, f"{file}:{number}"))
        elif split == "file":
            prompts.append(text)
        else:
            parts = text.split("\n\n") if split == "paragraph" else text.splitlines()
            prompts += [p.strip("\n") for p in parts]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise RecipeError(f"no prompts in {', '.join(map(str, files))}")
    return prompts


def _record_text(line: str, text_field: str, where: str) -> str:
    try:
        value = json.loads(line)[text_field]
    except (ValueError, KeyError, TypeError):
        raise RecipeError(f"{where}: not a JSON object with a {text_field!r} field") from None
    except RecursionError:
        raise RecipeError(f"{where}: the JSON is nested too deeply") from None
    if not isinstance(value, str):
        raise RecipeError(f"{where}: field {text_field!r} is not a string")
    return value


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
