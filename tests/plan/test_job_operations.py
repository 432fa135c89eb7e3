"""Every job operation has its arm in the executor and in the plan's description, and one no arm
knows is an error, not a silent merge (the `else` of the switch this replaced)."""

import inspect
import re
import typing
from dataclasses import replace

import pytest
import torch

from moemerge.execute import compute
from moemerge.plan.jobs import Job, Operation, Plan

KINDS = set(typing.get_args(Operation))


def arms(function) -> set[str]:
    """The kinds a `match job.operation` switch names in its cases."""
    return set(re.findall(r'case "(\w+)"', inspect.getsource(function))) | {
        k for line in re.findall(r"case (\"\w+\"(?: \| \"\w+\")+)", inspect.getsource(function))
        for k in re.findall(r'"(\w+)"', line)}


@pytest.mark.parametrize("function", [compute, Plan.describe_job])
def test_every_kind_has_an_arm(function):
    assert arms(function) == KINDS


def test_a_kind_with_no_arm_is_refused():
    zeros = Job("t", (2, 3), torch.float32, "zeros", "attn", 0)
    assert compute(zeros, load=None, make_router=None, seed=0).shape == (2, 3)
    assert Plan(["m"], [], {}).describe_job(zeros) == "zeros"
    blend = replace(zeros, operation="blend")
    with pytest.raises(AssertionError):
        compute(blend, load=None, make_router=None, seed=0)
    with pytest.raises(AssertionError):
        Plan(["m"], [], {}).describe_job(blend)
