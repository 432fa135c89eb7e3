"""What a benchmark result was made with: the provenance record every results writer includes.

    from stamp import provenance, stamp_line

    record = provenance()
    {"provenance": record, ...}    # JSON results: a "provenance" key
    stamp_line(record)             # markdown results: one line under the title

The scripts in benchmarks/ import it as `stamp` (their folder is on sys.path when run as
`python benchmarks/NAME.py`); one in a subfolder puts benchmarks/ on the path first:
`sys.path.insert(0, str(Path(__file__).resolve().parents[1]))`.

Nothing here imports torch: versions come from the installed packages' metadata, so a parent
that keeps itself free of torch (bench_build.py, whose children's peak RSS would start at its
own) stays so; torch threads and the GPU are read only when the writing process has torch
loaded already (None otherwise: its children used torch's defaults).

The commit is `git rev-parse --short HEAD` of this checkout, "dirty" when a tracked file
outside benchmarks/results/ differs from it (a results writer's own earlier output does not
count; untracked files do not, as in `git describe --dirty`). Outside a git checkout (a copy
of the tree without .git) the commit is $MOEMERGE_COMMIT, or None.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moemerge", "torch", "transformers", "safetensors")
KEYS = ("commit", "dirty", "date", "python", *PACKAGES, "machine", "cpus", "torch_threads",
        "memory_gib", "gpu")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def provenance() -> dict:
    """{commit, dirty, date, python, moemerge, torch, transformers, safetensors, machine, cpus,
    torch_threads, memory_gib, gpu} of this process, now (KEYS, in that order)."""
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = None
    if commit is None:
        commit = os.environ.get("MOEMERGE_COMMIT") or None
    else:
        status = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                      ":(exclude)benchmarks/results")
        dirty = None if status is None else bool(status)
    torch = sys.modules.get("torch")
    threads = gpu = None
    if torch is not None:
        threads = torch.get_num_threads()
        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    try:
        memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError, AttributeError):
        memory = None
    record = {"commit": commit, "dirty": dirty,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "python": platform.python_version()}
    record |= {package: _version(package) for package in PACKAGES}
    record |= {"machine": platform.machine(), "cpus": os.cpu_count(), "torch_threads": threads,
               "memory_gib": memory, "gpu": gpu}
    return record


def commit_text(record: dict | None) -> str:
    """'commit 65ff300', 'commit 65ff300 (dirty)' or 'commit not recorded'."""
    if not record or not record.get("commit"):
        return "commit not recorded"
    return f"commit {record['commit']}" + (" (dirty)" if record.get("dirty") else "")


def stamp_line(record: dict) -> str:
    """The markdown line: commit, date, versions, machine."""
    versions = ", ".join(f"{name} {record[key]}" for name, key in (
        ("moemerge", "moemerge"), ("Python", "python"), ("torch", "torch"),
        ("transformers", "transformers"), ("safetensors", "safetensors")) if record.get(key))
    machine = f"{record['machine']}, {record['cpus']} CPUs"
    if record.get("torch_threads"):
        machine += f", {record['torch_threads']} torch threads"
    if record.get("memory_gib"):
        machine += f", {record['memory_gib']} GiB"
    if record.get("gpu"):
        machine += f", {record['gpu']}"
    return f"Provenance: {commit_text(record)}, {record['date']}; {versions}; {machine}."


def parts_line(parts: dict[str, dict | None], what: str = "parts") -> str:
    """For results assembled from cached parts made in earlier runs (name: provenance or None):
    one markdown line grouping the parts by commit and day."""
    groups: dict[str, list[str]] = {}
    for name, record in parts.items():
        key = commit_text(record) + (f" on {record['date'][:10]}" if record else "")
        groups.setdefault(key, []).append(name)
    if len(groups) == 1:
        return f"{what.capitalize()} made at: {next(iter(groups))} (all {len(parts)})."
    return f"{what.capitalize()} made at: " + "; ".join(
        f"{key} ({', '.join(names)})" for key, names in groups.items()) + "."
