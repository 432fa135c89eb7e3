"""NearSwap and Arcee Fusion on cases done by hand."""

import math

import pytest
import torch

from moemerge.merge.dispatch import merge
from moemerge.merge.swap import arcee_fusion, nearswap, row_kl, tukey_fence

torch.set_num_threads(1)
T = torch.tensor


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, b if isinstance(b, torch.Tensor) else T(b), atol=atol, rtol=0)


def test_nearswap_by_hand():
    base = T([1.0, 2.0, 3.0, 4.0])
    delta = T([0.05, -0.3, 1.0, 0.0])
    # t = 0.1: |Δ| 0.05 ≤ t: the model's; 0.3: w = 1/3, a step of 0.1 toward it; 1.0: w = 0.1;
    # Δ = 0: w = clamp(0.1 / 1e-6) = 1, the model's (= the base's)
    out = nearswap(base, [base + delta], swap_distance=0.1)
    close(out, base + T([0.05, -0.1, 0.1, 0.0]))
    close(merge("nearswap", base=base, tensors=[base + delta], swap_distance=0.1), out)
    with pytest.raises(AssertionError):  # it is not the model
        close(out, base + delta)


def test_nearswap_endpoints():
    base, model = T([0.0, 1.0]), T([0.5, -1.0])
    close(nearswap(base, [model], swap_distance=0.0), base)
    close(nearswap(base, [model], swap_distance=10.0), model)
    with pytest.raises(ValueError, match="needs swap_distance"):
        merge("nearswap", base=base, tensors=[model])
    with pytest.raises(ValueError, match="at most 1"):
        merge("nearswap", base=base, tensors=[model, model], swap_distance=0.1)


def test_row_kl_by_hand():
    # softmax(ln 3, 0) = (3/4, 1/4) against the uniform (1/2, 1/2)
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    close(row_kl(T([[math.log(3), 0.0], [5.0, 5.0]]), torch.zeros(2, 2)), [[kl], [0.0]])


def test_tukey_fence_by_hand():
    # n = 5: quartiles at ranks ⌊q·4⌋ = 1, 2, 3: 0.2, 0.3, 0.4; fence 0.3 + 1.5 · 0.2
    close(tukey_fence(T([0.4, 2.0, 0.1, 0.3, 0.2])), T(0.6))
    # n = 4: ranks ⌊0.75⌋ = 0, ⌊1.5⌋ = 1, ⌊2.25⌋ = 2 (no interpolation)
    close(tukey_fence(T([[4.0, 1.0], [2.0, 3.0]])), T(2.0 + 1.5 * 2.0))
    close(tukey_fence(T([7.0])), T(7.0))


def test_arcee_fusion_takes_the_outliers_of_a_vector():
    # one row: the KL is one positive factor, so the mask is |Δ| ≥ the fence of |Δ| (0.6)
    base = T([1.0, 0.0, -1.0, 2.0, 0.5])
    delta = T([0.1, -0.2, 0.3, -0.4, 2.0])
    out = arcee_fusion(base, [base + delta])
    close(out, base + T([0.0, 0.0, 0.0, 0.0, 2.0]))
    close(merge("arcee_fusion", base=base, tensors=[base + delta]), out)


def test_arcee_fusion_weighs_change_by_the_row_kl():
    """Row 0 changes most (Δ 3, 2.9) but almost uniformly, so its softmax barely moves;
    row 1 changes by 1 in one entry: only that entry is important enough."""
    base = torch.zeros(2, 2)
    model = T([[3.0, 2.9], [1.0, 0.0]])

    def kl(x):  # KL(softmax(x, 0) ‖ uniform) for a row (x, 0)
        p = math.exp(x) / (math.exp(x) + 1)
        return p * math.log(2 * p) + (1 - p) * math.log(2 * (1 - p))

    k0, k1 = kl(0.1), kl(1.0)  # softmax is shift-invariant: row 0 is (0.1, 0)
    # importances 3 k0, 2.9 k0, k1, 0: sorted 0, 2.9 k0, 3 k0, k1; quartiles at ranks 0, 1, 2
    fence = 2.9 * k0 + 1.5 * (3 * k0)
    assert 3 * k0 < fence < k1
    out = arcee_fusion(base, [model])
    close(out, [[0.0, 0.0], [1.0, 0.0]])
    magnitude_only = torch.where(model.abs() >= tukey_fence(model.abs()), model, 0.0)
    with pytest.raises(AssertionError):  # without the KL the large row would win
        close(out, magnitude_only)


def test_arcee_fusion_edge_cases():
    base = T([[1.0, 2.0], [3.0, 4.0]])
    close(arcee_fusion(base, [base.clone()]), base)  # no change: the base
    close(arcee_fusion(T([1.0]), [T([5.0])]), [5.0])  # one entry: its own fence, taken
