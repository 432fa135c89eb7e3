"""The files of an extracted LoRA adapter besides its tensors: peft's adapter_config.json, the
per-module report (lora_report.json, and the table the CLI prints) and the README.md card."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from moemerge.analysis.render import public_name
from moemerge.terminal_tables import Column

if TYPE_CHECKING:
    from moemerge.built.extract.lora import LoraExtracted, ModuleDelta

COLUMNS = [Column("module", justify="left", key=True), Column("shape"), Column("rank"),
           Column("kept"), Column("‖τ‖"), Column("size")]
TERMINAL = [0, 1, 2, 3, 5]  # the columns printed (‖τ‖ only in the files), names without `model.`


def target_modules(lora: list[str], modules: list[str]) -> list[str]:
    """peft's target_modules for the `lora` modules among all the model's `modules`: a short
    name (`q_proj`, which peft matches as a suffix) where every module of that name is a
    target, else the targets' full names."""
    targets = set(lora)
    short = {m.rpartition(".")[2] for m in targets}
    whole = {s for s in short if all(m in targets for m in modules if m.rpartition(".")[2] == s)}
    return sorted(whole) + sorted(m for m in targets if m.rpartition(".")[2] not in whole)


def adapter_config(modules: list[ModuleDelta], names: list[str], where: tuple[str, str]
                   ) -> dict:
    """peft's LoraConfig as JSON: α = r for every module (scale 1); the most common rank is
    `r`, the others are in rank_pattern / alpha_pattern by full module name."""
    lora = [m for m in modules if m.lora]
    r = Counter(m.rank for m in lora).most_common(1)[0][0]
    others = {m.name: m.rank for m in lora if m.rank != r}
    whole = [m.name for m in modules if not m.lora]
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": where[1],
        "revision": None, "inference_mode": True, "r": r, "lora_alpha": r,
        "target_modules": target_modules([m.name for m in lora],
                                         list(dict.fromkeys(n.rpartition(".")[0] for n in names))),
        "rank_pattern": others, "alpha_pattern": dict(others),
        "modules_to_save": whole or None, "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None,
    }


def overall_kept(done: LoraExtracted) -> float:
    """The share of the LoRA modules' task vectors' energy the adapter keeps, all together."""
    lora = [m for m in done.modules if m.lora]
    total = sum(m.norm ** 2 for m in lora)
    return sum(m.kept * m.norm ** 2 for m in lora) / total if total else 1.0


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def rows(done: LoraExtracted) -> list[list[str]]:
    """One row per module: name, weight shape, rank (or `whole`), kept share, ‖τ‖_F, size."""
    return [[m.name, "×".join(map(str, m.shape)), str(m.rank) if m.lora else "whole",
             f"{100 * m.kept:.1f} %" if m.lora else "100 %",
             f"{m.norm:.4g}" if m.lora else "", _size(m.bytes)] for m in done.modules]


def terminal_table(done: LoraExtracted) -> tuple[list[Column], list[list[str]]]:
    """The columns and rows the CLI prints: fits 80 columns for a Llama's module names."""
    return ([COLUMNS[i] for i in TERMINAL],
            [[row[0].removeprefix("model."), *(row[i] for i in TERMINAL[1:])]
             for row in rows(done)])


def summary(done: LoraExtracted) -> str:
    lora = sum(m.lora for m in done.modules)
    return (f"{lora} LoRA modules keeping {100 * overall_kept(done):.1f} % of their task "
            f"vectors' energy, {len(done.modules) - lora} kept whole, {done.unchanged} "
            f"unchanged; {_size(done.adapter_bytes)} "
            f"({100 * done.adapter_bytes / max(done.model_bytes, 1):.1f} % of the model's "
            f"{_size(done.model_bytes)})")


def report_json(done: LoraExtracted, where: tuple[str, str], rank: int | None,
                share: float) -> dict:
    return {
        "model": public_name(where[0]), "base": where[1], "kind": done.kind, "label": done.label,
        "rank": rank if rank is not None else "auto", "share": None if rank else share,
        "kept": overall_kept(done), "adapter_bytes": done.adapter_bytes,
        "model_bytes": done.model_bytes, "unchanged_modules": done.unchanged,
        "seconds": round(done.seconds, 2),
        "modules": [{"module": m.name, "form": "lora" if m.lora else "whole",
                     "shape": list(m.shape), "rank": m.rank if m.lora else None,
                     "kept": m.kept, "norm": m.norm if m.lora else None, "bytes": m.bytes}
                    for m in done.modules],
    }


def card(done: LoraExtracted, where: tuple[str, str], rank: int | None, share: float) -> str:
    """README.md: where the adapter came from, how to load it, and the per-module table."""
    base = public_name(where[1])
    chosen = f"rank {rank}" if rank else f"the smallest rank keeping {100 * share:g} % of " \
        "each module's task-vector energy"
    lines = [f"# LoRA adapter: {done.label} on `{base}`", "",
             f"Written by `moemerge extract --lora` from `{public_name(where[0])}` ({done.kind}) "
             f"against the base `{base}`: each linear module's task vector τ = W − W_base "
             f"as the truncated SVD at {chosen} (B·A, lora_alpha = r so the scale is 1); "
             "modules that differ otherwise are in `modules_to_save` whole.", "",
             summary(done) + ".", "", "```python",
             "from peft import PeftModel",
             "from transformers import AutoModelForCausalLM",
             f'base = AutoModelForCausalLM.from_pretrained("{where[1]}")',
             'model = PeftModel.from_pretrained(base, "path/to/this/adapter")',
             "```", "", "kept: Σ_{i<r} s_i² / Σ s_i², the share of τ's energy (squared "
             "Frobenius norm) the rank keeps.", "",
             "| " + " | ".join(c.header for c in COLUMNS) + " |",
             "|" + "|".join("---" if c.justify == "left" else "---:" for c in COLUMNS) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(done)]
    return "\n".join(lines) + "\n"
