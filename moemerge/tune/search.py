"""Coordinate-wise search of λ and density per tensor role, scored by held-out perplexity.

The model of the output architecture is built once as the recipe says and loaded in memory;
each candidate re-merges only the tensors of one role (with the build's own `compute`, so the
bytes match a build with those values, DARE masks seeded per tensor as in the build), copies
them into the model and scores it. The sources of the role being tuned are read once and kept
in memory ((N + 1) copies of that role's tensors: base and experts), then dropped.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from moemerge.build_options import TuneOptions
from moemerge.data import domain_texts
from moemerge.errors import OutputError, RecipeError
from moemerge.eval.perplexity import scored_windows, windows_perplexity
from moemerge.execute import Load, compute
from moemerge.merge.registry import METHOD_SPECS, get
from moemerge.plan.jobs import Job, Plan, Source
from moemerge.words import plural

# from the registry: the methods whose `lambda` is tunable (density is tuned where they have one)
TUNABLE_METHODS = tuple(m.name for m in METHOD_SPECS if "lambda" in m.tunable)
ROLE_ORDER = ("embed", "attn", "norm", "ffn", "lm_head")
# a candidate must beat the best so far by this fraction of its perplexity: smaller gains are
# rounding (e.g. λ on a zero task vector) or noise of a few-thousand-token text, not signal
MIN_GAIN = 1e-4


@dataclass(frozen=True)
class Candidate:
    """One evaluation. lam/density None: the recipe's own values (the baseline row)."""

    role: str
    lam: float | None
    density: float | None
    perplexity: float


@dataclass
class TuneResult:
    baseline: float  # perplexity of the build as the recipe says
    tuned: float  # perplexity with the chosen values
    candidates: list[Candidate]
    chosen: dict[str, tuple[float, float | None]]  # role -> (λ, density); absent = recipe's
    stopped: str | None = None  # why the search ended early (--tune-budget), if it did
    # roles whose every input equals the base (no task vector: a LoRA adapter on the FFNs
    # leaves attention, norms and embeddings alone): no value can change them, none scored
    unchanged: tuple[str, ...] = ()


@dataclass(frozen=True)
class Progress:
    """Where a search stands after a candidate, for its progress line."""

    done: int  # candidates scored, the baseline included
    total: int  # candidates of the whole grid
    best: float  # the best perplexity so far
    seconds_left: float  # the rest of the grid at the mean time per candidate so far


def read_held_out(path: Path | str) -> dict[str, str]:
    """{domain: held-out text} of every domain `path` holds (moemerge.data's rules: a file is
    one domain, a directory one per file)."""
    return domain_texts([str(path)], what="--tune-on")


HeldOut = dict[str, list[torch.Tensor]]  # domain -> its scored windows


def held_out_windows(tokenizer, texts: dict[str, str], opts: TuneOptions) -> HeldOut:
    """Each domain's windows over its first max_tokens / N tokens, cut once for every
    candidate: every domain weighs the same, however long its text (scoring the first
    max_tokens of the texts joined would score mostly the first domain)."""
    share = opts.max_tokens // len(texts)
    return {domain: scored_windows(tokenizer, text, opts.seq_len, share, 0)
            for domain, text in texts.items()}


def held_out_perplexity(model, held_out: HeldOut) -> float:
    """The geometric mean over domains of each domain's perplexity."""
    logs = [math.log(windows_perplexity(model, windows)) for windows in held_out.values()]
    return math.exp(sum(logs) / len(logs))


def check_options(opts: TuneOptions) -> None:
    if not opts.lambdas:
        raise RecipeError("--tune-lambdas: give at least one value")
    if not all(lam >= 0 for lam in opts.lambdas):
        raise RecipeError(f"--tune-lambdas: each must be >= 0 (the scale of the task vectors "
                          f"added to the base), got {list(opts.lambdas)}")
    if not opts.densities or not all(0.0 < d <= 1.0 for d in opts.densities):
        raise RecipeError(f"--tune-densities: each must be in (0, 1], got {list(opts.densities)}")
    if opts.seq_len < 1 or opts.max_tokens < opts.seq_len + 1:
        raise RecipeError(f"--tune-max-tokens ({opts.max_tokens}) must exceed --tune-seq-len "
                          f"({opts.seq_len}) by at least 1")


def merges_of(job: Job) -> list[Job]:
    """The merges a job makes: itself, or each part of a fused tensor (Phi-3's qkv_proj,
    gate_up_proj), which is merged part by part."""
    return [part for group in job.parts for part in group] if job.operation == "fuse" else [job]


def with_values(job: Job, lam: float, density: float | None) -> Job:
    """`job` with λ and density set in its merge (in every part of a fused tensor)."""
    def one(merge_job: Job) -> Job:
        return replace(merge_job, merge=merge_job.merge.with_values(
            **{"lambda": lam, "density": density}))
    if job.operation == "fuse":
        return replace(job, parts=tuple(tuple(one(p) for p in group) for group in job.parts))
    return one(job)


def _tunable(job: Job) -> bool:
    return all(m.operation == "merge" and m.merge is not None and m.merge.method in TUNABLE_METHODS
               for m in merges_of(job))


def tunable_jobs(plan: Plan) -> dict[str, list[Job]]:
    """{role: jobs whose merges all have a λ (a merge, or a fused tensor merged part by part)},
    in ROLE_ORDER; RecipeError when there are none."""
    by_role: dict[str, list[Job]] = {}
    for job in plan.jobs:
        if _tunable(job):
            by_role.setdefault(job.role, []).append(job)
    if not by_role:
        raise RecipeError(
            "--tune-on: nothing to tune; the recipe's merge uses no method with a lambda or "
            f"density (tunable: {', '.join(TUNABLE_METHODS)})"
        )
    return {role: by_role[role] for role in ROLE_ORDER if role in by_role}


def check_length(tokenizer, texts: dict[str, str], opts: TuneOptions) -> None:
    """Every domain needs one window of seq_len + 1 tokens, within its share of max_tokens."""
    share = opts.max_tokens // len(texts)
    if share < opts.seq_len + 1:
        raise RecipeError(f"--tune-max-tokens ({opts.max_tokens}) shared by "
                          f"{plural(len(texts), 'domain')} of {opts.text} leaves "
                          f"{plural(share, 'token')} each, fewer than one window of "
                          f"--tune-seq-len + 1 = {opts.seq_len + 1}")
    for domain, text in texts.items():
        n = len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if n < opts.seq_len + 1:
            where = opts.text if len(texts) == 1 else f"{opts.text} ({domain})"
            raise RecipeError(f"--tune-on: {where} has {plural(n, 'token')}, fewer than one "
                              f"window of --tune-seq-len + 1 = {opts.seq_len + 1}")


def search(model, tokenizer, texts: dict[str, str], plan: Plan, load: Load, seed: int,
           opts: TuneOptions, report: Callable[[Candidate, Progress], None] | None = None
           ) -> TuneResult:
    """Tune each role in ROLE_ORDER over the grid, the other roles at their best so far; a role
    keeps the recipe's values unless a grid point beats the best so far by MIN_GAIN. With
    `opts.budget`, the search stops before a candidate that would end past it (at the mean
    time per candidate so far): the roles not reached keep the recipe's values."""
    jobs = tunable_jobs(plan)
    state = model.state_dict()  # shares storage with the model: copy_ updates it in place
    missing = [j.output for js in jobs.values() for j in js if j.output not in state]
    if missing:
        raise OutputError(f"tuning: the built model has no parameter {missing[0]!r}")
    held_out = held_out_windows(tokenizer, texts, opts)  # tokenised once, scored many times
    cache: dict[Source, torch.Tensor] = {}

    def cached(source: Source) -> torch.Tensor:
        if source not in cache:
            cache[source] = load(source)
        return cache[source]

    def fits(role: str, lam: float, density: float | None) -> bool:
        """Whether every job of the role takes these values (DELLA: density ± epsilon)."""
        return all(get(m.merge.method).problem(
            m.merge.with_values(**{"lambda": lam, "density": density}).params) is None
            for j in jobs[role] for m in merges_of(j))

    def unchanged(role: str) -> bool:
        """Every merged input of the role equals its base: the merge is the base whatever
        λ and density are (base + λ·f(0))."""
        found = all(m.base is not None
                    and all(torch.equal(cached(s), cached(m.base)) for s in m.sources)
                    for j in jobs[role] for m in merges_of(j))
        cache.clear()
        return found

    def set_role(role: str, lam: float | None, density: float | None) -> None:
        for job in jobs[role]:
            if lam is not None:  # density only where the method has one
                job = with_values(job, lam, density)
            with torch.no_grad():
                state[job.output].copy_(compute(job, cached, None, seed))

    still = tuple(role for role in jobs if unchanged(role))
    jobs = {role: role_jobs for role, role_jobs in jobs.items() if role not in still}
    grid = {role: [(lam, density) for lam in opts.lambdas
                   for density in (opts.densities if _with_density(role_jobs) else (None,))
                   if fits(role, lam, density)]  # e.g. DELLA's density + epsilon >= 1
            for role, role_jobs in jobs.items()}
    total = 1 + sum(map(len, grid.values()))
    started = time.monotonic()
    candidates: list[Candidate] = []

    def score(role: str, lam: float | None, density: float | None) -> float:
        ppl = held_out_perplexity(model, held_out)
        candidates.append(Candidate(role, lam, density, ppl))
        if report is not None:
            spent = time.monotonic() - started
            report(candidates[-1], Progress(len(candidates), total,
                                            min(c.perplexity for c in candidates),
                                            spent / len(candidates) * (total - len(candidates))))
        return ppl

    def over_budget() -> bool:
        spent = time.monotonic() - started
        return opts.budget is not None and spent + spent / len(candidates) > opts.budget

    best = baseline = score("recipe", None, None)
    chosen: dict[str, tuple[float, float | None]] = {}
    stopped = None
    for role, points in grid.items():
        scores = {}
        for lam, density in points:
            if over_budget():
                stopped = (f"--tune-budget {opts.budget:g} s: stopped after "
                           f"{len(candidates)} of {total} candidates")
                break
            set_role(role, lam, density)
            scores[lam, density] = score(role, lam, density)
        point = min(scores, key=scores.__getitem__) if scores else None  # first of equals
        if point is not None and scores[point] < best * (1 - MIN_GAIN):
            best, chosen[role] = scores[point], point
        set_role(role, *chosen.get(role, (None, None)))
        cache.clear()  # only one role's sources in memory at a time
        if stopped:
            break
    return TuneResult(baseline, best, candidates, chosen, stopped, still)


def _with_density(role_jobs: list[Job]) -> bool:
    return any(m.merge.get("density") is not None for j in role_jobs for m in merges_of(j))
