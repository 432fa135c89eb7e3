"""SLERP, multi-SLERP, the Karcher mean, Model Stock and passthrough on cases done by hand."""

import math

import torch

from moemerge.merge.dispatch import merge
from moemerge.merge.sphere import karcher, model_stock, multislerp, passthrough, slerp, stock_ratio

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
