"""Merge methods on cases small enough to compute by hand, and the identities they must obey."""

import pytest
import torch

from moemerge.merge.dispatch import merge
from moemerge.merge.draws import Draws
from moemerge.merge.methods import (
    average,
    dare_linear,
    dare_ties,
    task_arithmetic,
    ties,
)
from moemerge.merge.registry import REGISTRY

# the methods that merge any number of models (slerp takes two, passthrough one, base none)
METHODS = [m.name for m in REGISTRY.values() if m.target and m.max_models is None]
NEEDS_BASE = {m.name for m in REGISTRY.values() if m.needs_base and m.target}

torch.set_num_threads(1)
T = torch.tensor
ZERO = torch.zeros(4)
E1, E2 = T([1.0, -2.0, 3.0, 0.5]), T([2.0, 1.0, -1.0, 0.5])


def test_average_weighted_by_hand():
    assert torch.equal(average([T([0.0, 4.0]), T([4.0, 0.0])], weights=[1, 3]), T([3.0, 1.0]))


def test_task_arithmetic_by_hand():
    base, a, b = T([1.0, 1.0]), T([2.0, 0.0]), T([4.0, 1.0])  # τ = [1, -1], [3, 0]
    assert torch.equal(task_arithmetic(base, [a, b], lam=0.5), T([2.0, 0.75]))
    assert torch.equal(task_arithmetic(base, [a, b], lam=0.5, normalize=False), T([3.0, 0.5]))
    assert torch.equal(task_arithmetic(base, [a, b], weights=[3, 1]), T([2.5, 0.25]))


def test_ties_by_hand():
    # density 0.5 keeps 2 of 4 per τ (a tie at the threshold keeps both):
    #   τ1 -> [0, -2, 3, 0], τ2 -> [2, 1, -1, 0]; sum [2, -1, 2, 0] elects [+, -, +, 0];
    #   disjoint mean [2, -2, 3, 0] (entry 0: τ1's zero is excluded, not averaged in)
    assert torch.equal(ties(ZERO, [E1, E2], density=0.5), T([2.0, -2.0, 3.0, 0.0]))
    assert torch.equal(ties(ZERO, [E1, E2], density=0.5, lam=0.5), T([1.0, -1.0, 1.5, 0.0]))
    base = T([1.0, 1.0, 1.0, 1.0])
    assert torch.equal(ties(base, [base + E1, base + E2], density=0.5), T([3.0, -1.0, 4.0, 1.0]))


def test_ties_weights_enter_the_election_by_mass():
    # weights [1, 3]: w·trim(τ) sums to [6, 1, 0, 0]: entry 1 goes to τ2 (+1), entry 2 elects
    # nothing; disjoint means [2, 1, 0, 0]
    assert torch.equal(ties(ZERO, [E1, E2], weights=[1, 3], density=0.5), T([2.0, 1.0, 0.0, 0.0]))
    # ties ignores the scale of the weights
    assert torch.equal(ties(ZERO, [E1, E2], weights=[2, 6], density=0.5), T([2.0, 1.0, 0.0, 0.0]))


def test_dare_by_hand():
    # the draws of one output tensor: expert i's mask is model i's
    draws = Draws.of(5, "w")
    keep1, keep2 = draws.uniform(0, (4,)) < 0.5, draws.uniform(1, (4,)) < 0.5
    d1, d2 = E1 * keep1 / 0.5, E2 * keep2 / 0.5
    out = dare_linear(ZERO, [E1, E2], density=0.5, draws=Draws.of(5, "w"))
    torch.testing.assert_close(out, (d1 + d2) / 2, atol=0, rtol=0)
    sign = torch.sign(d1 + d2)
    agree1, agree2 = (torch.sign(d1) == sign) & (d1 != 0), (torch.sign(d2) == sign) & (d2 != 0)
    count = (agree1.float() + agree2.float()).clamp_min(1)
    expected = (d1 * agree1 + d2 * agree2) / count
    out = dare_ties(ZERO, [E1, E2], density=0.5, draws=Draws.of(5, "w"))
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("method", METHODS)
def test_identical_inputs_give_the_input(method):
    a = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    out = merge(method, base=a - 0.1, tensors=[a, a, a], density=1.0,
                draws=Draws.of(0, "t"))
    torch.testing.assert_close(out, a)


def test_identities():
    gen = torch.Generator().manual_seed(0)
    base, a, b = (torch.randn(6, 5, generator=gen) for _ in range(3))
    assert torch.equal(average([a, a]), a)
    assert torch.equal(task_arithmetic(base, [a, b], lam=0.0), base)
    torch.testing.assert_close(
        dare_linear(base, [a, b], density=1.0, lam=0.7), task_arithmetic(base, [a, b], lam=0.7))
    # density 1 on sign-agreeing deltas: TIES and DARE-TIES are their mean
    up1, up2 = base + torch.rand(6, 5, generator=gen), base + torch.rand(6, 5, generator=gen)
    torch.testing.assert_close(ties(base, [up1, up2], density=1.0), (up1 + up2) / 2)
    torch.testing.assert_close(dare_ties(base, [up1, up2], density=1.0), (up1 + up2) / 2)


def test_dare_reproducible_per_seed_and_name():
    gen = torch.Generator().manual_seed(0)
    base, a, b = (torch.randn(64, 64, generator=gen) for _ in range(3))

    def run(method, seed, name):
        return merge(method, base=base, tensors=[a, b], density=0.5,
                     draws=Draws.of(seed, name))

    for method in ("dare_linear", "dare_ties"):
        assert torch.equal(run(method, 1, "x").view(torch.int32),
                           run(method, 1, "x").view(torch.int32))
        assert not torch.equal(run(method, 1, "x"), run(method, 1, "y"))
        assert not torch.equal(run(method, 1, "x"), run(method, 2, "x"))


@pytest.mark.parametrize("method", METHODS)
def test_low_precision_in_fp32_out(method):
    a, b = torch.randn(4, 4).bfloat16(), torch.randn(4, 4).bfloat16()
    out = merge(method, base=a, tensors=[a, b], draws=Draws.of(0, "t"))
    assert out.dtype == torch.float32


def test_integer_tensors_pass_through():
    ids = torch.arange(4)
    assert merge("average", base=None, tensors=[ids, ids + 1]) is ids
    tensors = [ids + 1, ids]
    assert merge("ties", base=ids, tensors=tensors) is tensors[0]


def test_average_ignores_base():
    a = torch.ones(3)
    assert torch.equal(merge("average", base=torch.zeros(7), tensors=[a, 3 * a]), 2 * a)
    assert NEEDS_BASE & set(METHODS) == set(METHODS) - {"average", "multislerp", "karcher"}


@pytest.mark.parametrize("kwargs, message", [
    ({"method": "slurp"}, "unknown merge method 'slurp'"),
    ({"method": "ties", "base": None}, "ties needs a base"),
    ({"method": "task_arithmetic", "base": None}, "task_arithmetic needs a base"),
    ({"method": "ties", "density": 0.0}, r"density must be in \(0, 1\]"),
    ({"method": "dare_ties", "density": 1.5}, r"density must be in \(0, 1\]"),
    ({"method": "average", "weights": [1.0]}, "1 weight for 2 models"),
    ({"method": "average", "weights": [0.0, 0.0]}, "sum to 0"),
    ({"method": "ties", "weights": [1.0, -2.0]}, "ties takes no negative weight"),
    ({"method": "ties", "weights": [0.0, 0.0]}, "sum to 0"),
    ({"method": "task_arithmetic", "weights": [1.0, -2.0], "normalize": True}, "sum to -1"),
    ({"method": "average", "weights": [1.0, -2.0]}, "sum to -1"),
    ({"method": "average", "tensors": [torch.zeros(2), torch.zeros(3)]}, "different shapes"),
    ({"method": "ties", "base": torch.zeros(3)}, "different shapes"),
    ({"method": "average", "tensors": []}, "nothing to merge"),
])
def test_bad_arguments(kwargs, message):
    args = {"base": torch.zeros(2), "tensors": [torch.zeros(2), torch.ones(2)], **kwargs}
    with pytest.raises(ValueError, match=message):
        merge(args.pop("method"), **args)
