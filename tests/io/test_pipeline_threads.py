"""The build pipeline sizes torch's thread pool with its reader, writer and merge workers,
and gives the caller's setting back."""

import os

import torch

from moemerge import execute
from moemerge.plan.jobs import Job, Plan


def test_threads_shared_by_the_workers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert [execute.intra_op_threads(w) for w in (1, 2, 4, 32)] == [15, 7, 3, 1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert execute.intra_op_threads(1) == 1  # this machine: the other core reads and writes


def test_run_jobs_merges_on_its_threads_and_restores_the_callers(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(5)))
    seen = []
    job = Job("w", (2, 2), torch.float32, "zeros", "other")
    real_compute = execute.compute
    monkeypatch.setattr(execute, "compute", lambda *a, **k: seen.append(
        torch.get_num_threads()) or real_compute(*a, **k))
    before = torch.get_num_threads()
    plan = Plan(labels=[], jobs=[job], config={})
    assert [j.output for j, _ in execute.run_jobs(plan, None, None, 0, workers=2)] == ["w"]
    assert seen == [2] and torch.get_num_threads() == before
