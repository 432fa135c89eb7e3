"""The counter-based draws of DARE and DELLA (merge/draws.py, native/draws.c): the hash against
a plain Python reference, the kernel against torch, their statistics, and the pinned stream."""

import pytest
import torch

from moemerge.merge import native
from moemerge.merge.draws import Draws


def reference_uniform(key: int, model: int, j: int) -> float:
    """The hash, spelled out on Python integers, one entry at a time."""
    def mix(x):
        x ^= x >> 16
        x = (x * 0x21F0AAAD) % 2**32
        x ^= x >> 15
        x = (x * 0x735A2D97) % 2**32
        return x ^ (x >> 15)

    s1 = mix((key % 2**32) ^ mix(model))
    s2 = mix((key // 2**32 + model) % 2**32)
    h = mix(mix((j % 2**32) ^ s1) ^ (j // 2**32) ^ s2)
    return (h >> 8) / 2**24


@pytest.mark.parametrize("offset", [0, 1000, 2**32 - 3, 5 * 2**32 + 7])
def test_uniforms_are_the_hash_of_their_entry(offset):
    draws = Draws.of(11, "model.layers.0.mlp.up_proj.weight").at(offset)
    for model in (0, 3):
        got = draws.uniform(model, (2, 3)).reshape(-1).tolist()
        assert got == [reference_uniform(draws.key, model, offset + j) for j in range(6)]
    # the comparison can fail: another model, key or place gives other values
    assert draws.uniform(0, (6,)).tolist() != draws.uniform(1, (6,)).tolist()
    assert draws.uniform(0, (6,)).tolist() != draws.at(1).uniform(0, (6,)).tolist()


def test_the_stream_is_pinned():
    # sha256("0\x00x")[:8] little-endian and the hash: changing either would silently change
    # every DARE and DELLA build; pin them.
    draws = Draws.of(0, "x")
    assert draws.key == 16177674797561753107
    assert [u * 2**24 for u in draws.uniform(0, (3,)).tolist()] == [7057222, 14609937, 6067228]


def _inputs(n: int, seed: int = 0) -> torch.Tensor:
    tau = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    tau[:4] = torch.tensor([float("nan"), float("inf"), -0.0, -float("inf")])
    return tau


@pytest.mark.parametrize("offset", [0, 12345, 2**32 - 100])
@pytest.mark.parametrize("per_entry", [False, True])
def test_the_kernel_keeps_what_torch_keeps(monkeypatch, offset, per_entry):
    if native.library() is None:
        pytest.skip("no C compiler: the kernel is not built")
    tau = _inputs(4099)
    probs = (torch.rand(4099, generator=torch.Generator().manual_seed(1)) if per_entry
             else torch.tensor(0.3))
    draws = Draws.of(2, "t").at(offset)
    fast = draws.keep(1, tau, probs)
    monkeypatch.setattr(native, "library", lambda: None)
    slow = draws.keep(1, tau, probs)
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))
    assert not torch.equal(fast.nan_to_num(), draws.keep(2, tau, probs).nan_to_num())


def test_masks_are_unbiased_and_independent():
    """Keep rates over 2²⁰ entries within 5 standard deviations: overall, for two models
    together (independent models keep both at p²), for neighbours (no correlation along the
    row), and row by row and column by column of a [1024, 1024] tensor (no structure)."""
    p, n = 0.3, 1 << 20
    draws = Draws.of(5, "w")
    a, b = draws.uniform(0, (1024, 1024)) < p, draws.uniform(1, (1024, 1024)) < p

    def near(rate, expected, count):
        sigma = (expected * (1 - expected) / count) ** 0.5
        return abs(rate - expected) < 5 * sigma

    assert near(a.float().mean().item(), p, n)
    assert near((a & b).float().mean().item(), p * p, n)
    flat = a.reshape(-1)
    assert near((flat[1:] & flat[:-1]).float().mean().item(), p * p, n - 1)
    rows, cols = a.float().mean(1), a.float().mean(0)
    sigma = (p * (1 - p) / 1024) ** 0.5
    for rates in (rows, cols):  # each a mean of 1024 entries; their spread that of chance
        assert abs(rates.mean().item() - p) < 5 * sigma / 32
        assert 0.8 * sigma < rates.std().item() < 1.2 * sigma
    u = draws.uniform(2, (n,))
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    assert near((u < 0.5).float().mean().item(), 0.5, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["dare_linear", "dare_ties", "della", "della_linear"])
def test_cuda_draws_and_divides_as_the_cpu(method):
    """The same bytes on CUDA: the same masks, and the rescale divides by a device tensor
    (CUDA divides by a CPU scalar as a multiplication by its reciprocal, an ulp off)."""
    from moemerge.merge.dispatch import merge

    g = torch.Generator().manual_seed(0)
    base = torch.randn(700, 600, generator=g)
    models = [base + 0.05 * torch.randn(700, 600, generator=g) for _ in range(3)]
    params = {"density": 0.7} | ({"epsilon": 0.1} if "della" in method else {})
    out = {dev: merge(method, base=base.to(dev), tensors=[m.to(dev) for m in models],
                      draws=Draws.of(4, "w"), **params).cpu() for dev in ("cpu", "cuda")}
    assert torch.equal(out["cpu"].view(torch.int32), out["cuda"].view(torch.int32))
