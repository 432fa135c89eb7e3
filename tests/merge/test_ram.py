"""RAM and RAM+ (tensor-local) on cases done by hand."""

import pytest
import torch

from moemerge.merge.dispatch import merge
from moemerge.merge.ram import ram, ramplus_tl

torch.set_num_threads(1)
T = torch.tensor
BASE = T([1.0, -1.0, 0.5, 2.0, 0.0, 3.0])
TAU_1 = T([0.5, 0.0, 0.2, 1e-6, 0.1, 0.0])  # 1e-6: below the default threshold 1e-5
TAU_2 = T([0.3, 0.4, 0.0, 0.0, 0.0, 0.0])


def close(a, b, atol=1e-6):
    torch.testing.assert_close(a, b if isinstance(b, torch.Tensor) else T(b), atol=atol, rtol=0)


def test_ram_by_hand():
    # contributors per entry: 2, 1, 1, 0, 1, 0: the mean of two, a lone change as it is
    out = ram(BASE, [BASE + TAU_1, BASE + TAU_2])
    close(out, BASE + T([0.4, 0.4, 0.2, 0.0, 0.1, 0.0]))
    close(merge("ram", base=BASE, tensors=[BASE + TAU_1, BASE + TAU_2]), out)
    with pytest.raises(AssertionError):  # not the plain mean of the task vectors
        close(out, BASE + (TAU_1 + TAU_2) / 2)
    # a threshold of 0.25 drops τ_1's 0.2 and 0.1: entry 0 is still shared
    close(ram(BASE, [BASE + TAU_1, BASE + TAU_2], nonzero_threshold=0.25),
          BASE + T([0.4, 0.4, 0.0, 0.0, 0.0, 0.0]))


def test_ram_one_model_and_no_change():
    close(ram(BASE, [BASE + TAU_1]), BASE + TAU_1 * (TAU_1.abs() > 1e-5))
    close(ram(BASE, [BASE.clone(), BASE.clone()]), BASE)


def test_ramplus_tl_by_hand():
    # model 1 changed entries 0 (shared), 2 and 4 (its own): ρ_1 = 1/2; model 2: 0 and 1: ρ_2 = 1
    # r = 0.5, α = 0.8: λ_1 = 1 + 0.5 · 0.5 = 1.25, λ_2 = 1 + 0.5 · min(1, 0.8) = 1.4
    out = ramplus_tl(BASE, [BASE + TAU_1, BASE + TAU_2], r=0.5, alpha=0.8)
    close(out, BASE + T([0.4, 0.4 * 1.4, 0.2 * 1.25, 0.0, 0.1 * 1.25, 0.0]))
    close(merge("ramplus_tl", base=BASE, tensors=[BASE + TAU_1, BASE + TAU_2], r=0.5,
                alpha=0.8), out)
    with pytest.raises(AssertionError):  # the boost is per model, not one for all
        close(out, BASE + T([0.4, 0.4 * 1.25, 0.2 * 1.25, 0.0, 0.1 * 1.25, 0.0]))


def test_ramplus_tl_edge_cases():
    pair = [BASE + TAU_1, BASE + TAU_2]
    close(ramplus_tl(BASE, pair, r=0.0), ram(BASE, pair))  # no boost: RAM
    close(ramplus_tl(BASE, [BASE + TAU_1]), ram(BASE, [BASE + TAU_1]))  # one model: ρ = 0
    # model 3 changes only a shared entry (no unique: ρ = 1/ε, capped at α); model 4 nothing
    # (ρ = 0, no 0/0): entry 0 now has 3 contributors; entry 1 stays model 2's, λ_2 = 1.1
    third = BASE + T([0.7, 0.0, 0.0, 0.0, 0.0, 0.0])
    out = ramplus_tl(BASE, [*pair, third, BASE.clone()], r=0.5, alpha=0.2)
    close(out, BASE + T([0.5, 0.44, 0.22, 0.0, 0.11, 0.0]))
    assert torch.isfinite(ramplus_tl(BASE, [BASE.clone()], nonzero_threshold=0.0)).all()
