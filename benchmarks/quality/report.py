"""quality.md and quality.png from the result of run.py (run this file to write them again
from benchmarks/results/quality.json)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stamp import stamp_line  # noqa: E402

GROUPS = {  # label prefix: bar colour
    "base": "#7f7f7f", "expert": "#bcbd22", "dense": "#8c564b", "token_routed": "#1f77b4",
    "seq_routed": "#2ca02c", "merged_experts": "#d62728", "CAMEx": "#ff7f0e",
    "upcycled": "#9467bd",
}
DENSE_MERGES = ("dense_average", "dense_ties", "dense_dare")
BTX_CONTROL = "dense_btx"  # the base trained with the experts' compute and the MoE's steps
CALIBRATED = "token_cal"
FINE_TUNED_ROUTERS = ("token_random+r", "token_cal+r")


def summary(per_seed: list[dict[str, float]]) -> dict:
    """Mean over seeds per domain, and the mean over domains: its mean, min and max over seeds;
    the geometric mean over domains (mean over seeds), which one domain's large perplexities
    cannot dominate."""
    domains = list(per_seed[0])
    means = [sum(r.values()) / len(r) for r in per_seed]
    geo = [math.exp(sum(math.log(v) for v in r.values()) / len(r)) for r in per_seed]
    return {"domains": {d: sum(r[d] for r in per_seed) / len(per_seed) for d in domains},
            "mean": sum(means) / len(means), "min": min(means), "max": max(means),
            "geomean": sum(geo) / len(geo), "seeds": len(per_seed)}


def wins(row: dict, against: dict) -> str:
    """On how many domains `row` has the lower perplexity (means over seeds)."""
    a, b = row["summary"]["domains"], against["summary"]["domains"]
    return f"{sum(a[d] < b[d] for d in a)}/{len(a)}"


def _by_key(rows: dict) -> dict[str, tuple[str, dict]]:
    return {row["key"]: (label, row) for label, row in rows.items()}


def control(row: dict, rows: dict) -> tuple[str, dict] | None:
    """The dense row a row is measured against: the dense base trained for as many steps, or,
    for a row without training, the best dense merge (the same experts, no training)."""
    dense = [(label, r) for label, r in rows.items()
             if r["key"].startswith("dense") and r["key"] != BTX_CONTROL]
    if row["steps"]:
        matched = [(label, r) for label, r in dense if r["steps"] == row["steps"]]
        return matched[0] if matched else None
    merges = [(label, r) for label, r in dense if r["key"] in DENSE_MERGES]
    return min(merges, key=lambda x: x[1]["summary"]["mean"]) if merges else None


def oracle(rows: dict) -> float | None:
    """The mean over domains of each domain's own expert's perplexity on it: what routing every
    sequence to the right expert, and nothing more, would give."""
    experts = {r["key"].removeprefix("expert:"): r for r in rows.values()
               if r["key"].startswith("expert:")}
    domains = list(next(iter(rows.values()))["summary"]["domains"])
    if set(domains) - set(experts):
        return None
    return sum(experts[d]["summary"]["domains"][d] for d in domains) / len(domains)


def _change(value: float, reference: float) -> str:
    return f"{(value - reference) / reference:+.1%}"


def verdicts(rows: dict) -> list[str]:
    """The headline, computed: calibrate against the best fine-tuned router, and every MoE row
    against its dense control, whichever way it goes."""
    keyed, lines = _by_key(rows), []
    if CALIBRATED in keyed and any(k in keyed for k in FINE_TUNED_ROUTERS):
        cal = keyed[CALIBRATED][1]["summary"]["mean"]
        label, best = min((keyed[k] for k in FINE_TUNED_ROUTERS if k in keyed),
                          key=lambda x: x[1]["summary"]["mean"])
        gap = (cal - best["summary"]["mean"]) / best["summary"]["mean"]
        verdict = "within" if gap <= 0.02 else "NOT within"
        lines.append(f"**Training-free router vs the best fine-tuned one:** token_routed with "
                     f"`router.init: calibrate` has mean perplexity {cal:.2f}, the best fine-tuned "
                     f"router ({label}) {best['summary']['mean']:.2f}: {gap:+.1%}, {verdict} the "
                     f"2 % target.")
    for label, row in rows.items():
        matched = control(row, rows) if is_moe(row) else None
        if matched is None:
            continue
        c_label, c_row = matched
        mean, ref = row["summary"]["mean"], c_row["summary"]["mean"]
        lines.append(f"- {label}: {mean:.2f}, {_change(mean, ref)} against {c_label} "
                     f"({ref:.2f}): {_side(row['summary'], c_row['summary'])} the dense control; "
                     f"better on {wins(row, c_row)} domains; geometric mean "
                     f"{_change(row['summary']['geomean'], c_row['summary']['geomean'])}.")
    if BTX_CONTROL in keyed:
        c_label, c_row = keyed[BTX_CONTROL]
        ref = c_row["summary"]["mean"]
        moes = [(label, row) for label, row in rows.items() if is_moe(row)]
        ahead = [label for label, row in moes if row["summary"]["mean"] < ref]
        lines += ["", f"**Against the compute-matched dense control** ({c_label}, mean {ref:.2f}, "
                  f"geometric mean {c_row['summary']['geomean']:.2f}): "
                  f"{len(ahead)} of {len(moes)} MoE rows have a lower mean"
                  + (f" ({', '.join(ahead)})." if ahead else ".")]
        if (best := oracle(rows)) is not None:
            lines.append(f"The oracle (each domain scored by its own expert) is {best:.2f}: "
                         f"{_change(best, ref)} against it.")
    return lines


def is_moe(row: dict) -> bool:
    return not row["key"].startswith(("base", "expert", "dense"))


def _side(a: dict, b: dict) -> str:
    """Better or worse; with seeds on both sides, only when their min–max ranges do not meet."""
    if a["seeds"] > 1 and b["seeds"] > 1 and a["min"] <= b["max"] and b["min"] <= a["max"]:
        return "within the seeds' spread of"
    return "better than" if a["mean"] < b["mean"] else "worse than"


def own_by_domain(row: dict, domains: list[str]) -> list[float]:
    """Each domain's own-expert share, the mean over seeds."""
    return [sum(seed[d] for seed in row["own"]) / len(row["own"]) for d in domains]


def _own(row: dict, domains: list[str]) -> str:
    if not row.get("own"):
        return "–"
    means = own_by_domain(row, domains)
    return f"{sum(means) / len(means):.0%}"


def setup(result: dict) -> str:
    """The set-up paragraph: the toy presets' experts, or the real pretrained base's."""
    spec, s, domains = result["spec"], result["settings"], result["spec"]["domains"]
    if "hidden" in spec:
        made = (f"{len(domains)} experts ({', '.join(domains)}) of hidden {spec['hidden']}, "
                f"{spec['layers']} layers, vocabulary {spec['vocab']}, each branched from one "
                f"base ({spec['base_steps']} steps on all domains) and trained "
                f"{spec['expert_steps']} steps on its own domain.")
    else:
        made = (f"{len(domains)} experts ({', '.join(domains)}) branched from the real "
                "pretrained SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocabulary "
                "49152, tied embeddings; `moemerge toy DIR --preset smollm2-experts`): each is "
                f"the base with its FFNs trained {spec['steps']} steps of {spec['batch']} × "
                f"{spec['seq_len']} tokens at lr {spec['lr']:g} on its own domain, the rest "
                "frozen.")
    return (f"**Set-up.** {made} Perplexity (lower is better) on the last two thirds of each "
            f"domain's held-out text, at most {s['max_tokens']} tokens each, in windows of "
            f"{s['seq_len'] + 1} tokens: the first {s['prompt_tokens']} are a prompt "
            "(sequence-routed models choose their experts there), the rest go through the KV "
            "cache and are scored. The dense TIES and DARE-TIES merges"
            + (" (and the token_routed MoE whose shared tensors are merged by TIES)"
               if any(r["key"] == "token_cal_ties" for r in result["rows"].values()) else "")
            + " have λ and density tuned per tensor role on the first third (`build --tune-on`"
            + (", every domain weighing the same" if result.get("tune_balanced") else
               ", on the domains' texts joined: mostly the first domain")
            + "); routers are calibrated on the training text.")


def added_note(rows: dict) -> list[str]:
    """Where the rows that later `--only ... --update` runs added come from."""
    added = [f"{label} ({row['added']['date']}, commit {row['added']['provenance']['commit']}, "
             f"{row['summary']['seeds']} seed(s))" for label, row in rows.items()
             if "added" in row]
    return [f"**Rows added by later runs** (`run.py --only KEYS --update`, same expert set and "
            f"settings unless said): {'; '.join(added)}.", ""] if added else []


def _exact(row: dict, task: str) -> str:
    """Greedy exact-match accuracy on a task, the mean over seeds."""
    if not row.get("exact"):
        return "–"
    return f"{sum(seed[task] for seed in row['exact']) / len(row['exact']):.0%}"


def markdown(result: dict) -> str:
    rows, s = result["rows"], result["settings"]
    for row in rows.values():  # results saved before the geometric mean was kept lack it
        row["summary"] = summary(row["per_seed"])
    domains = list(next(iter(rows.values()))["summary"]["domains"])
    n = len(domains)
    tasks = list(next((r["exact"][0] for r in rows.values() if r.get("exact")), {}))
    what = "toy" if "hidden" in result["spec"] else "real (SmolLM2-135M)"
    lines = [
        f"# Quality: merge-into-MoE kinds, routers and methods on the {result['preset']} "
        f"{what} experts", "",
        f"`python benchmarks/quality/run.py --preset {result['preset']}` — {result['machine']}; "
        f"torch {result['torch']}, transformers {result.get('transformers', '?')}; "
        f"{result['date']}; whole run {result['runtime_s'] / 60:.1f} min, with the expert set "
        f"cached (making it the first time took {result['toy_make_s'] / 60:.1f} min more).", "",
        *([stamp_line(result["provenance"]), ""]
          if "provenance" in result else []),
        *(["**Partial**: the run wrote this after each row and stopped before the last "
           f"({len(rows)} rows here); the rows it did not reach are missing, not skipped.", ""]
          if result.get("complete") is False else []),
        *added_note(rows),
        *([f"**Left out of this run** (`--skip {s['skip']}`): measured in other runs, listed "
           "in benchmarks/README.md.", ""] if s.get("skip") else []),
        setup(result), "",
        f"**Training.** Batches of {s['batch_size']} × {s['seq_len']} tokens of the training "
        f"text (all domains), AdamW, warm-up + cosine. Routers (and CAMEx curvature): "
        f"{s['steps']} steps at lr {s['lr']:g}, experts frozen. "
        + (f"Full fine-tune: {s['full_steps']} steps at lr {s['full_lr']:g} after the routers. "
           if any(r["key"].endswith("+f") and r["key"] != "upcycle+f" for r in rows.values())
           else "")
        + (f"Upcycled: the base made into {n} copies (top-2), all weights trained "
           f"{s['steps'] + s['full_steps']} steps at lr {s['full_lr']:g} (before training it is "
           "the base exactly). " if any(r["key"] == "upcycle+f" for r in rows.values()) else "")
        + "Dense controls: the "
        "base trained with the same loop, batches and lr as the full fine-tune, for as many "
        "steps as the row it controls (post-merge steps only)"
        + (f"; and the BTX control: the base trained as the experts were (FFNs only, their lr "
           f"and batches) on all domains for the experts' steps together plus the routers' "
           f"{s['steps']}" if any(r["key"] == BTX_CONTROL for r in rows.values()) else "")
        + ". Rows over several seeds (build seed and data order): per-domain means, and the "
        "mean with its min–max.", "",
        "**Columns.** *geo mean*: the geometric mean over domains. *vs dense*: the change in "
        "mean perplexity against the dense row with the same post-merge training (no training: "
        "the best dense merge; "
        f"{s['steps']} / {s['steps'] + s['full_steps']} steps: the dense base trained as "
        "long); negative is better. *wins*: the domains on which it beats that row. "
        "*own expert*: averaged over the domains, the "
        "share of a domain's tokens whose top-2 holds its own expert (token_routed, every "
        f"layer; chance {2 / n:.0%}), of its windows sent to its own expert (seq_routed, "
        f"top-1; chance {1 / n:.0%}), or the mean routing weight on its own expert "
        f"(merged_experts / CAMEx, every layer; chance {1 / n:.0%})."
        + (f" *math EM*: the share of {s['exact_match']} held-out math problems whose final "
           "value (after the last ' = ' of the worked answer, given the problem, the working "
           "and up to 3 problems before it) greedy decoding gets exactly; *code EM*: the share "
           f"of {s['exact_match']} held-out code lines (at least 12 characters, given up to 96 "
           "tokens before them) it writes exactly and ends there." if tasks else ""), "",
        "| model | " + " | ".join(domains) + " | mean | geo mean | vs dense | wins | "
        "own expert | seeds |" + "".join(f" {t} EM |" for t in tasks),
        "|---|" + "---:|" * (n + 6 + len(tasks))]
    for label, row in rows.items():
        sm = row["summary"]
        spread = f" ({sm['min']:.2f}–{sm['max']:.2f})" if sm["seeds"] > 1 else ""
        matched = control(row, rows) if is_moe(row) else None
        versus = _change(sm["mean"], matched[1]["summary"]["mean"]) if matched else "–"
        won = wins(row, matched[1]) if matched else "–"
        lines.append(f"| {label} | " + " | ".join(f"{sm['domains'][d]:.2f}" for d in domains)
                     + f" | {sm['mean']:.2f}{spread} | {sm.get('geomean', float('nan')):.2f} | "
                     f"{versus} | {won} | {_own(row, domains)} | {sm['seeds']} |"
                     + "".join(f" {_exact(row, t)} |" for t in tasks))
    routed = {label: row for label, row in rows.items() if row.get("own")}
    if routed:
        lines += ["", "Own-expert share per domain (as the *own expert* column; mean over seeds):",
                  "", "| model | " + " | ".join(domains) + " |", "|---|" + "---:|" * n]
        for label, row in routed.items():
            lines.append(f"| {label} | " + " | ".join(
                f"{v:.0%}" for v in own_by_domain(row, domains)) + " |")
    if result.get("tuned"):
        chosen = "; ".join(f"{k}: " + ", ".join(f"{role} λ {v[0]:g}" + (
            f" d {v[1]:g}" if v[1] is not None else "") for role, v in roles.items())
            for k, roles in result["tuned"].items() if roles)
        lines += ["", "Tuned on the validation text (roles not listed keep λ 0.5, density 0.7): "
                  + (chosen or "every role kept the recipe's values") + "."]
    lines += ["", "## What the numbers say", "", *verdicts(rows)]
    if (best := oracle(rows)) is not None:
        lines += ["", f"Each domain scored by its own expert (the oracle of routing, no more): "
                  f"{best:.2f}."]
    times = ", ".join(f"{label} {row['seconds']:.0f}" for label, row in rows.items()
                      if row["seconds"] >= 30)
    lines += ["", f"Rows that took 30 s or more (s, models made and scored): {times}."]
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
    if (best := oracle(rows)) is not None:
        ax.axvline(best, color="#bcbd22", ls=":", lw=1.2)
    ax.set_yticks(y, labels, fontsize=7)
    right = min(max(means) * 1.02, 1.6 * rows["base"]["summary"]["mean"])  # outliers clipped
    ax.set_xlim(min(means) * 0.9, right)
    for yi, m, h in zip(y, means, hi, strict=True):
        clipped = m > right
        ax.text(right if clipped else m + h, yi, f"{m:.1f} →" if clipped else f" {m:.1f}",
                va="center", ha="right" if clipped else "left", fontsize=6,
                color="white" if clipped else "black")
    ax.set_xlabel("mean held-out perplexity over the domains (lower is better; bars: min–max "
                  "over seeds; dashed: the base; dotted: each domain's own expert)", fontsize=8)
    ax.set_title(f"Merge-into-MoE kinds on the {result['preset']} experts "
                 f"({result['date']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    import sys

    results = Path(__file__).parent.parent / "results"
    name = sys.argv[1] if len(sys.argv) > 1 else "quality"  # or quality-smollm2
    saved = json.loads((results / f"{name}.json").read_text())
    (results / f"{name}.md").write_text(markdown(saved))
    plot(saved, results / f"{name}.png")
