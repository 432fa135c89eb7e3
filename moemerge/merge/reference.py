"""The merge-method reference, generated from the registry: the tables of
docs/merge-methods.md (between the `registry:` markers; `python -m moemerge.merge.reference
docs/merge-methods.md` rewrites them, a test checks they are current) and `moemerge methods`."""

from __future__ import annotations

import sys
from pathlib import Path

from moemerge.merge.registry import METHOD_SPECS, MethodSpec, Param, all_params

BEGIN, END = "<!-- registry:begin (generated; do not edit) -->", "<!-- registry:end -->"


def models_text(spec: MethodSpec) -> str:
    if spec.target is None:
        return "–"
    if spec.max_models == spec.min_models:
        return str(spec.min_models)
    return f"≥ {spec.min_models}" if spec.max_models is None else (
        f"{spec.min_models}–{spec.max_models}")


def base_text(spec: MethodSpec) -> str:
    return {"required": "yes", "optional": "optional", "ignored": "no"}[spec.base]


def default_text(p: Param) -> str:
    value = p.default
    if value is None:
        return "required"
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(
        value, float) else str(value)


def params_text(spec: MethodSpec) -> str:
    return ", ".join(f"`{p.name}` {default_text(p)}" for p in spec.params) or "–"


def weights_text(spec: MethodSpec) -> str:
    """How a method takes the models' weights: signed, non-negative, or not at all."""
    if spec.target is None or not spec.weights:
        return "–"
    return "signed" if spec.signed_weights else "≥ 0"


def methods_table() -> list[list[str]]:
    """One row per method: name, what it does, base, models, parameters (default), paper, MoE,
    weights."""
    return [[m.name, m.summary, base_text(m), models_text(m), params_text(m), m.paper,
             "no: " + m.moe if m.moe else "yes", weights_text(m)] for m in METHOD_SPECS]


def params_table() -> list[list[str]]:
    """One row per parameter: name, values, tunable, per model, meaning, methods."""
    rows = []
    for name, p in all_params().items():
        users = [m.name for m in METHOD_SPECS if m.param(name)]
        kind = "per-layer list or " if p.kind is float else ""
        rows.append([name, kind + p.range_text(), "yes" if p.tunable else "",
                     "yes" if p.per_model else "", p.doc, ", ".join(users)])
    return rows


def _markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join([f"`{r[0]}`", *r[1:]]) + " |" for r in rows]


def markdown() -> str:
    out = [BEGIN, "", "Methods (defaults in the parameters column):", ""]
    out += _markdown(["method", "what it does", "needs a base", "models", "parameters",
                      "paper", "in an MoE's shared tensors", "models' weights"], methods_table())
    out += ["", "Parameters (a float may be a per-layer list, see [gradients](#gradients); "
            "those marked per model may also be set in a model's own entry, see "
            "[per-model parameters](recipes.md#per-model-parameters)):", ""]
    out += _markdown(["parameter", "values", "tuned by `--tune-on`", "per model", "meaning",
                      "methods"], params_table())
    return "\n".join([*out, "", END])


def update(path: Path) -> bool:
    """Rewrite the generated block of `path`; True when it changed."""
    text = path.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + markdown() + text[end:]
    path.write_text(new)
    return new != text


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: {'updated' if update(Path(arg)) else 'up to date'}")
