"""SLERP, NuSLERP, multi-SLERP, the Karcher mean, Model Stock and passthrough, by hand."""

import math

import pytest
import torch

from moemerge.merge.dispatch import merge
from moemerge.merge.sphere import (
    karcher,
    model_stock,
    multislerp,
    nuslerp,
    passthrough,
    slerp,
    stock_ratio,
)

torch.set_num_threads(1)
T = torch.tensor
R = 1 / math.sqrt(2)


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, T(b) if not isinstance(b, torch.Tensor) else b, atol=atol,
                               rtol=0)


def test_slerp_by_hand():
    a, b = T([2.0, 0.0]), T([0.0, 1.0])  # θ = π/2, sin θ = 1
    close(slerp([a, b], 0.5), [2 * R, R])  # sin(π/4) (a + b)
    close(slerp([a, b], 1 / 3), [2 * math.sin(math.pi / 3), math.sin(math.pi / 6)])
    close(slerp([a, b], 0.0), a)
    close(slerp([a, b], 1.0), b)
    # (nearly) parallel: linear interpolation
    close(slerp([a, 3 * a], 0.5), 2 * a)


def test_slerp_gradient_comes_from_the_recipe_not_the_function():
    a, b = T([1.0, 0.0]), T([0.0, 1.0])
    close(merge("slerp", base=None, tensors=[a, b], t=0.5), [R, R])


def test_multislerp_by_hand():
    a, b = T([1.0, 0.0]), T([0.0, 1.0])
    close(multislerp([a, b]), [R, R])
    # weights 3:1 -> direction (3, 1)/√10 (the tangent components cancel at the weighted mean)
    close(multislerp([a, b], weights=[3, 1]), [3 / math.sqrt(10), 1 / math.sqrt(10)])
    # with a base: the task vectors are interpolated, the base added back
    base = T([1.0, 1.0])
    close(multislerp([a + base, b + base], base=base), [1 + R, 1 + R])
    # the weighted mean norm: (2 + 1) / 2
    close(multislerp([2 * a, b]), [1.5 * R, 1.5 * R], atol=1e-5)


def test_karcher_mean_of_angles_on_a_circle():
    a, b = T([2.0, 0.0]), T([0.0, 1.0])
    close(karcher([a, b]), [1.5 * R, 1.5 * R])
    # weights 3:1 -> the weighted mean angle 22.5°, scaled by .75 · 2 + .25 · 1 = 1.75
    angle = math.radians(22.5)
    close(karcher([a, b], weights=[3, 1], max_iter=50, tol=1e-7),
          [1.75 * math.cos(angle), 1.75 * math.sin(angle)], atol=1e-5)
    assert torch.equal(karcher([torch.zeros(2), torch.zeros(2)]), torch.zeros(2))


def test_model_stock_by_hand():
    base = torch.zeros(2)
    w1, w2 = T([1.0, 0.0]), T([0.5, math.sqrt(3) / 2])  # 60°: cos .5, t = 2 · .5 / 1.5 = 2/3
    close(stock_ratio(base, [w1, w2]), [[2 / 3]])
    close(model_stock(base, [w1, w2]), [(2 / 3) * 0.75, (2 / 3) * math.sqrt(3) / 4])
    # filter-wise: row 1 is orthogonal (cos 0, t 0: the base row), row 0 parallel (t = 1)
    base2 = T([[0.0, 0.0], [1.0, 1.0]])
    f1, f2 = T([[1.0, 0.0], [2.0, 1.0]]), T([[2.0, 0.0], [1.0, 2.0]])
    close(model_stock(base2, [f1, f2], filter_wise=True), [[1.5, 0.0], [1.0, 1.0]])


def test_passthrough_copies():
    a = T([1.0, 2.0])
    assert torch.equal(passthrough([a]), a)
    assert torch.equal(merge("passthrough", base=None, tensors=[a]), a)


def test_nuslerp_by_hand():
    a, b = T([2.0, 0.0]), T([0.0, 1.0])  # Ω = π/2, sin Ω = 1
    close(nuslerp([a, b]), [2 * R, R])  # weights 1, 1: t = 0.5
    # weights 1, 3: t = 3/4, sin(π/8) a + sin(3π/8) b
    close(nuslerp([a, b], weights=[1, 3]), [2 * math.sin(math.pi / 8), math.sin(3 * math.pi / 8)])
    close(nuslerp([a, b], weights=[1, 0]), a)  # t = 0
    close(nuslerp([a, b], weights=[0, 2]), b)  # t = 1
    close(nuslerp([a, b], weights=[0, 1e-7]), [2 * R, R])  # weights summing to < 1e-6: t = 0.5
    # with a base: the task vectors are interpolated, then added to it
    base = T([1.0, 1.0])
    close(nuslerp([base + a, base + b], base=base), [1 + 2 * R, 1 + R])
    close(merge("nuslerp", base=base, tensors=[base + a, base + b]), [1 + 2 * R, 1 + R])


def test_nuslerp_vectors_whole_rows_or_columns():
    a, b = T([[1.0, 0.0], [1.0, 0.0]]), T([[0.0, 1.0], [2.0, 0.0]])
    # whole tensor: |a| = √2, |b| = √5, cos Ω = 2/√10; at t = ½: (a + b) / (2 cos(Ω/2))
    half = math.sqrt((1 + 2 / math.sqrt(10)) / 2)
    close(nuslerp([a, b]), T([[1.0, 1.0], [3.0, 0.0]]) / (2 * half))
    # rows: row 0 orthogonal (R, R); row 1 parallel, linear: (1 + 2) / 2
    close(nuslerp([a, b], nuslerp_flatten=False), [[R, R], [1.5, 0.0]])
    # columns: col 0 (1, 1) vs (0, 2), Ω = π/4: sin(π/8)/sin(π/4) · (1, 3); col 1 (0, 0) vs (1, 0)
    # a zero vector counts as orthogonal: sin(π/4) · (1, 0)
    c = math.sin(math.pi / 8) / R
    close(nuslerp([a, b], nuslerp_flatten=False, nuslerp_row_wise=True), [[c, R], [3 * c, 0.0]])


def test_nuslerp_edge_cases_and_a_wrong_expectation_fails():
    a = T([3.0, 4.0])
    zero = torch.zeros(2)
    close(nuslerp([zero, a]), R * a)  # zero vector: orthogonal, sin(tπ/2) · a (mergekit's)
    close(nuslerp([zero, zero]), zero)
    close(nuslerp([a, -a]), zero)  # antiparallel: linear
    close(nuslerp([a, 2 * a], weights=[3, 1]), 1.25 * a)  # parallel: linear at t = 1/4
    out = nuslerp([T([2.0, 0.0]), T([0.0, 1.0])])
    with pytest.raises(AssertionError):  # the linear mean is not the spherical one
        close(out, [1.0, 0.5])
