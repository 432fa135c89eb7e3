"""What tuning leaves behind: the recipe with the chosen values, a table and a JSON record."""

from __future__ import annotations

import json

import yaml

from moemerge.terminal_tables import Column, Fitted
from moemerge.tune.search import TuneOptions, TuneResult

TUNING_FILE = "moemerge_tuning.json"


def tuned_recipe_text(recipe_text: str, result: TuneResult, opts: TuneOptions) -> str:
    """The recipe with one `merge.overrides` entry per tuned role appended (later entries win, so
    they apply over the recipe's own overrides), headed by a comment saying where they came from.
    The recipe's comments are not kept (it is re-serialised)."""
    data = yaml.safe_load(recipe_text)
    merge = data.setdefault("merge", {})
    overrides = list(merge.get("overrides") or [])
    for role, (lam, density) in result.chosen.items():
        entry = {"roles": [role], "lambda": lam}
        if density is not None:
            entry["density"] = density
        overrides.append(entry)
    if overrides:
        merge["overrides"] = overrides
    chosen = ", ".join(_describe(role, *v) for role, v in result.chosen.items()) or "none"
    header = [
        f"# Tuned by `moemerge build --tune-on {opts.text.name}` ({opts.max_tokens} tokens max, "
        f"windows of {opts.seq_len}):",
        f"# held-out perplexity {result.baseline:.4f} as written -> {result.tuned:.4f} tuned.",
        f"# Chosen (the last merge.overrides entries): {chosen}.",
        f"# Grid: lambda {_floats(opts.lambdas)} x density {_floats(opts.densities)}, one role "
        f"at a time; every candidate is in {TUNING_FILE} next to the built model.",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None)


def tuning_json(result: TuneResult, opts: TuneOptions) -> str:
    return json.dumps({
        "held_out": str(opts.text), "max_tokens": opts.max_tokens, "seq_len": opts.seq_len,
        "lambdas": list(opts.lambdas), "densities": list(opts.densities),
        "baseline_perplexity": result.baseline, "tuned_perplexity": result.tuned,
        "chosen": {r: {"lambda": lam, "density": d} for r, (lam, d) in result.chosen.items()},
        "candidates": [vars(c) for c in result.candidates], "stopped": result.stopped,
        "unchanged_roles": list(result.unchanged),
    }, indent=2) + "\n"


def tuning_table(result: TuneResult) -> Fitted:
    """Every candidate in the order evaluated; the chosen one per role in bold green."""
    rows = []
    for c in result.candidates:
        picked = c.role in result.chosen and result.chosen[c.role] == (c.lam, c.density)
        cells = [c.role, "recipe" if c.lam is None else f"{c.lam:g}",
                 "" if c.density is None else f"{c.density:g}", f"{c.perplexity:.4f}"]
        rows.append([f"[bold green]{x}[/]" if picked else x for x in cells])
    columns = [Column("role", "left", key=True), Column("lambda"), Column("density"),
               Column("perplexity")]
    notes = ([result.stopped] if result.stopped else []) + (
        [f"not tuned, no task vector: {', '.join(result.unchanged)}"] if result.unchanged else [])
    note = f" ({'; '.join(notes)})" if notes else ""
    return Fitted(columns, rows,
                  title=f"tuning: perplexity {result.baseline:.4f} -> {result.tuned:.4f}{note}")


def _describe(role: str, lam: float, density: float | None) -> str:
    return f"{role} lambda {lam:g}" + (f" density {density:g}" if density is not None else "")


def _floats(values) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values) + "]"
