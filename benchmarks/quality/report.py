"""quality.md and quality.png from the result of run.py."""

from __future__ import annotations

from pathlib import Path

GROUPS = {  # label prefix: bar colour
    "base": "#7f7f7f", "expert": "#bcbd22", "dense": "#8c564b", "token_routed": "#1f77b4",
    "seq_routed": "#2ca02c", "bridged": "#9467bd", "merged_experts": "#d62728",
}


def summary(per_seed: list[dict[str, float]]) -> dict:
    """Mean over seeds per domain, and the mean over domains: its mean, min and max over seeds."""
    domains = list(per_seed[0])
    means = [sum(r.values()) / len(r) for r in per_seed]
    return {"domains": {d: sum(r[d] for r in per_seed) / len(per_seed) for d in domains},
            "mean": sum(means) / len(means), "min": min(means), "max": max(means),
            "seeds": len(per_seed)}


def markdown(result: dict) -> str:
    rows, s = result["rows"], result["settings"]
    domains = list(next(iter(rows.values()))["summary"]["domains"])
    lines = [
        f"# Quality: merge-into-MoE kinds and methods on the {result['preset']} toy experts", "",
        f"{result['machine']}; torch {result['torch']}; {result['date']}; whole run "
        f"{result['runtime_s'] / 60:.1f} min.", "",
        "Held-out perplexity (lower is better), windows of 129 tokens: the first "
        f"{s['prompt_tokens']} are the prompt (sequence-routed models choose their experts "
        "there), the rest are scored through the KV cache. Toy scale: 2-layer, hidden-64 "
        "experts branched from one base, 3 domains; the figures rank methods on this toy set "
        "only.", "",
        f"Fine-tuning: batches of {s['batch_size']} × {s['seq_len']} tokens from the experts' "
        f"training text (all domains), AdamW, warm-up + cosine. Router / projector / curvature "
        f"training: {s['steps']} steps at lr {s['lr']:g} (experts frozen). Full fine-tune: "
        f"{s['full_steps']} steps at lr {s['full_lr']:g}, starting from the router-trained "
        f"model. The dense controls train the base with the full fine-tune's loop, blocks, "
        f"batch and lr, for the full fine-tune's steps and for the whole pipeline's "
        f"({s['steps']} + {s['full_steps']}). Rows with several seeds (build seed and data "
        "order): per-domain means over the seeds, and the mean with its min–max over seeds.",
        "",
        "| model | " + " | ".join(domains) + " | mean | seeds |",
        "|---|" + "---:|" * (len(domains) + 2)]
    for label, row in rows.items():
        sm = row["summary"]
        spread = f" ({sm['min']:.2f}–{sm['max']:.2f})" if sm["seeds"] > 1 else ""
        lines.append(f"| {label} | " + " | ".join(f"{sm['domains'][d]:.2f}" for d in domains)
                     + f" | {sm['mean']:.2f}{spread} | {sm['seeds']} |")
    if result.get("notes"):
        lines += ["", *[f"- {n}" for n in result["notes"]]]
    lines += ["", "Stage times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                  result["times_s"].items()) + "."]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend; PNG goes through Agg

    rows = result["rows"]
    labels = list(rows)
    means = [rows[k]["summary"]["mean"] for k in labels]
    lo = [m - rows[k]["summary"]["min"] for k, m in zip(labels, means, strict=True)]
    hi = [rows[k]["summary"]["max"] - m for k, m in zip(labels, means, strict=True)]
    colours = [next((c for g, c in GROUPS.items() if k.startswith(g)), "#17becf") for k in labels]
    fig = Figure(figsize=(9, 1.2 + 0.32 * len(labels)))
    ax = fig.add_subplot()
    y = list(range(len(labels)))[::-1]
    ax.barh(y, means, color=colours, xerr=[lo, hi], capsize=2)
    ax.axvline(rows["base"]["summary"]["mean"], color="#7f7f7f", ls="--", lw=1)
    ax.set_yticks(y, labels, fontsize=7)
    right = min(max(means) * 1.02, 1.6 * rows["base"]["summary"]["mean"])  # outliers clipped
    ax.set_xlim(min(means) * 0.9, right)
    for yi, m, h in zip(y, means, hi, strict=True):
        clipped = m > right
        ax.text(right if clipped else m + h, yi, f"{m:.1f} →" if clipped else f" {m:.1f}",
                va="center", ha="right" if clipped else "left", fontsize=6,
                color="white" if clipped else "black")
    ax.set_xlabel("mean held-out perplexity over the domains (lower is better; bars: min–max "
                  "over seeds)", fontsize=8)
    ax.set_title(f"Merge-into-MoE kinds on the {result['preset']} toy experts "
                 f"({result['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
