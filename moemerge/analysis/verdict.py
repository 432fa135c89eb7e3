"""The one-paragraph advice at the end of an inspect report, from the per-role summaries."""

from __future__ import annotations

import math

from moemerge.analysis.task_vectors import TaskVectorReport

# Thresholds on the mean pairwise cosine of a role's task vectors (docs/inspect.md):
NEAR_IDENTICAL_COS = 0.9  # above: the experts moved the same way; averaging loses almost nothing
ORTHOGONAL_COS = 0.1  # |cos| below: independent directions; an average keeps ~1/N of each
CONFLICTING_COS = -0.1  # below: the experts pull against each other; averaging cancels them
# Mean pairwise sign-conflict rate among entries both experts changed. Unrelated updates give
# 0.5 and aligned ones ~0; at 0.4 TIES' sign election drops a large share of every expert.
HIGH_SIGN_CONFLICT = 0.4
# ‖τ‖/‖W_base‖ below which an expert "barely moved" that role (bf16 rounding is ~4e-3/entry).
TINY_RELATIVE_NORM = 1e-3
# Share of Σ τ² that TIES trimming at the chosen density may remove before we warn.
HIGH_TRIMMED_MASS = 0.25
# Difference in mean cosine between FFN and attention worth pointing out.
ROLE_CONTRAST = 0.3

def _finite(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


ROLE_NAMES = {
    "attn": "attention", "ffn": "FFN", "embed": "embedding", "lm_head": "LM-head", "norm": "norm",
}


def _category(cos: float) -> str:
    if cos > NEAR_IDENTICAL_COS:
        return "identical"
    if cos < CONFLICTING_COS:
        return "conflicting"
    if abs(cos) < ORTHOGONAL_COS:
        return "orthogonal"
    return "aligned"


def _cos(x: float) -> str:
    return f"{round(x, 2) + 0.0:.2f}"  # + 0.0: no "-0.00"


def _clause(category: str, roles: list[str], cosines: list[float], n: int) -> str:
    """One clause for the roles that fall in one cosine category, e.g. attention and embedding."""
    names = [ROLE_NAMES.get(r, r) for r in roles]
    what = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    them = names[0] if len(names) == 1 else "them"
    cos = f"mean cos {', '.join(_cos(c) for c in cosines)}"
    if category == "identical":
        return f"{what} task vectors are nearly identical ({cos}): averaging {them} is safe"
    if category == "aligned":
        return (f"{what} task vectors are partly aligned ({cos}): averaging {them} keeps the "
                "shared direction; task arithmetic or TIES keeps more of each")
    fixes = []
    if "ffn" in roles:
        fixes.append("keep each expert's FFN as an MoE expert (token_routed)")
    if set(roles) - {"ffn"}:
        fixes.append("consider seq_routed with separate attention or TIES with λ ≤ 0.5"
                     if category == "orthogonal"
                     else "keep them apart (seq_routed with separate attention) or use TIES, "
                     "whose sign election resolves the conflict")
    if category == "orthogonal":
        return (f"{what} task vectors are nearly orthogonal ({cos}): averaging {them} will "
                f"interfere, keeping about 1/{n} of each expert's change; {'; '.join(fixes)}")
    return f"{what} task vectors conflict ({cos}): averaging {them} cancels them; " + "; ".join(
        fixes)


def verdict(report: TaskVectorReport) -> str:
    """Advice a user can act on, one paragraph; every threshold is a constant above."""
    n = len(report.experts)
    summary = report.summary
    parts: list[str] = []
    if n == 1:
        parts.append("one expert: no pairwise statistics (give two or more to compare them)")
    by_category: dict[str, list[tuple[str, float]]] = {}
    for role in ("attn", "ffn", "embed", "lm_head"):
        if role in summary and (cos := summary[role].mean_cosine()) is not None:
            by_category.setdefault(_category(cos), []).append((role, cos))
    for category, items in by_category.items():
        parts.append(_clause(category, [r for r, _ in items], [c for _, c in items], n))
    attn, ffn = summary.get("attn"), summary.get("ffn")
    if attn and ffn and attn.mean_cosine() is not None and ffn.mean_cosine() is not None:
        a, f = attn.mean_cosine(), ffn.mean_cosine()
        if a - f > ROLE_CONTRAST:
            parts.append(f"the FFNs carry the specialisation (cos {_cos(f)} vs {_cos(a)} for "
                         "attention): a token_routed MoE with merged attention fits")
        elif f - a > ROLE_CONTRAST:
            parts.append(f"attention diverged more than the FFNs (cos {_cos(a)} vs {_cos(f)}): "
                         "merged attention loses most; prefer seq_routed with separate attention")
    conflicted = [ROLE_NAMES.get(r, r) for r, s in summary.items()
                  if (c := s.mean_sign_conflict()) is not None and c >= HIGH_SIGN_CONFLICT]
    if conflicted:
        parts.append(f"signs conflict often in {', '.join(conflicted)} (≥ "
                     f"{HIGH_SIGN_CONFLICT:.0%} of entries both experts changed): TIES' sign "
                     "election will discard much of each expert there")
    still = [ROLE_NAMES.get(r, r) for r, s in summary.items()
             if _finite(s.relative_norm) and max(_finite(s.relative_norm)) < TINY_RELATIVE_NORM]
    if still:
        parts.append(f"the experts barely moved {', '.join(still)} (‖τ‖/‖W‖ < "
                     f"{TINY_RELATIVE_NORM:g}): merging them any way stays close to the base")
    trimmed = [v for s in summary.values() for v in _finite(s.ties_trimmed_mass)]
    if trimmed and max(trimmed) > HIGH_TRIMMED_MASS:
        parts.append(f"TIES at density {report.density:g} would remove up to {max(trimmed):.0%} "
                     "of a task vector's mass (Σ τ²); raise the density or prefer DARE")
    if not parts:
        return "No statistics to judge (no tensors)."
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."
