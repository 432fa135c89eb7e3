"""Row-block merging: the blocked result is the whole-tensor result, bit for bit, for every
method that declares blocks; thresholds from the streaming histogram select equal kthvalue's."""

from __future__ import annotations

import pytest
import torch

from moemerge.merge.blocks import kth_largest, row_blocks
from moemerge.merge.dispatch import merge
from moemerge.merge.draws import Draws
from moemerge.merge.primitives import dare_drop
from moemerge.merge.registry import METHOD_SPECS, get

ROWS, COLS = 37, 29  # 1073 entries: blocks of 64 entries are 2 rows, the last one short
BLOCK = 64

pytestmark = pytest.mark.usefixtures("torch_code")  # the torch row-block path


def _models(n: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(ROWS, COLS, generator=gen).bfloat16()
    tensors = [(base.float() + 0.05 * torch.randn(ROWS, COLS, generator=gen)).bfloat16()
               for _ in range(n)]
    tensors[0][3] = base[3]  # a row of τ = 0: ties at the bottom of the magnitudes
    tensors[1][:, 4] = tensors[1][:, 4].float().round(decimals=1).bfloat16()  # repeated values
    return base, tensors


def test_row_blocks_cover_every_row_once():
    blocks = row_blocks((ROWS, COLS), BLOCK)
    assert [b.stop - b.start for b in blocks] == [2] * 18 + [1]
    assert row_blocks((ROWS, COLS), ROWS * COLS) == [slice(None)]
    assert row_blocks((10_000,), 16) == [slice(None)]  # 1-D: whole
    assert row_blocks((3, 1000), 16) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # a row at least


@pytest.mark.parametrize("k", [1, 2, 500, 1072, 1073])
def test_histogram_select_equals_kthvalue(k):
    values = torch.randn(ROWS, COLS).abs()
    values[5] = 0.0
    values[7] = 0.5  # a whole row tied
    parts = lambda: (values[b] for b in row_blocks(values.shape, BLOCK))  # noqa: E731
    expected = values.reshape(-1).kthvalue(values.numel() - k + 1).values
    assert torch.equal(kth_largest(parts, k), expected)
    with pytest.raises(ValueError, match="outside"):
        kth_largest(parts, values.numel() + 1)


def test_histogram_select_separates_values_in_one_bucket():
    """Values that share their top 16 bits land in one bucket; the select inside it is exact."""
    values = 1.0 + torch.arange(100, dtype=torch.float32) * 2**-20  # one bucket
    assert len(set((values.view(torch.int32) >> 15).tolist())) == 1
    parts = lambda: iter(values.chunk(7))  # noqa: E731
    for k in (1, 37, 100):
        assert kth_largest(parts, k) == values.sort(descending=True).values[k - 1]


DETERMINISTIC = [
    ("average", {}), ("task_arithmetic", {"lambda": 0.7}), ("ties", {"density": 0.3}),
    ("ties", {"density": 0.5, "trim_rounding": "floor", "consensus": "count",
              "zero_vote": "positive", "normalize": False}),
    ("breadcrumbs", {"density": 0.8, "gamma": 0.05}), ("breadcrumbs_ties", {"density": 0.6}),
    ("passthrough", {}), ("nearswap", {"swap_distance": 0.02}),
    ("ram", {"nonzero_threshold": 0.03}),
]


@pytest.mark.parametrize(("method", "params"), DETERMINISTIC)
def test_blocked_merge_is_the_whole_merge(method, params):
    base, tensors = _models()
    tensors = tensors[:get(method).max_models or 3]
    base = None if get(method).base == "ignored" else base
    whole = merge(method, base=base, tensors=tensors, block=10**9, **params)
    blocked = merge(method, base=base, tensors=tensors, block=BLOCK, **params)
    assert torch.equal(whole, blocked)
    in_bf16 = merge(method, base=base, tensors=tensors, block=BLOCK, dtype=torch.bfloat16,
                    **params)
    assert in_bf16.dtype == torch.bfloat16 and torch.equal(in_bf16, whole.bfloat16())


def test_the_comparison_sees_a_wrong_threshold(monkeypatch):
    """The blocked TIES path really uses the streamed thresholds: halve them and it differs."""
    import moemerge.merge.blocks as blocks

    base, tensors = _models()
    whole = merge("ties", base=base, tensors=tensors, block=10**9, density=0.3)
    real = blocks.trim_thresholds
    monkeypatch.setattr(blocks, "trim_thresholds",
                        lambda *a, **k: {"thresholds": real(*a, **k)["thresholds"] / 2})
    wrong = merge("ties", base=base, tensors=tensors, block=BLOCK, density=0.3)
    assert not torch.equal(whole, wrong)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties", "della", "della_linear"])
def test_random_methods_in_blocks_give_the_whole_tensors_bytes(method):
    """Each entry's draw depends on its place in the whole tensor, so a merge in row blocks
    writes the bytes of the merge in one piece, for any block size."""
    base, tensors = _models()
    params = {"density": 0.5} | ({"epsilon": 0.1} if "della" in method else {})
    whole = merge(method, base=base, tensors=tensors, block=10**9, draws=Draws.of(3, "t"),
                  **params)
    for block in (BLOCK, COLS, 3 * COLS + 1):
        out = merge(method, base=base, tensors=tensors, block=block, draws=Draws.of(3, "t"),
                    **params)
        assert torch.equal(out.view(torch.int32), whole.view(torch.int32)), block


def test_dare_in_blocks_against_the_whole_tensors_masks():
    """DARE in blocks against a reference drawing each model's mask over the whole tensor;
    blocks that each drew from the tensor's first entry would differ."""
    base, tensors = _models()
    out = merge("dare_linear", base=base, tensors=tensors, block=BLOCK, density=0.5,
                draws=Draws.of(3, "t"), normalize=False)
    draws = Draws.of(3, "t")
    taus = [t.float() - base.float() for t in tensors]
    expected = base.float() + sum(tau * (draws.uniform(i, tau.shape) < 0.5) / 0.5
                                  for i, tau in enumerate(taus))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    restarted = torch.empty(ROWS, COLS)
    for b in row_blocks((ROWS, COLS), BLOCK):
        restarted[b] = base[b].float() + sum(dare_drop(t[b].float() - base[b].float(), 0.5,
                                                       draws, i) for i, t in enumerate(tensors))
    assert not torch.allclose(out, restarted, atol=1e-3)


def test_only_methods_that_take_the_base_as_an_argument_declare_blocks():
    """Row blocks slice the positional base; a method taking it as a keyword would get the
    whole tensor in every block."""
    assert all(spec.base != "optional" for spec in METHOD_SPECS if spec.blocks)


@pytest.mark.parametrize("method", ["dare_linear", "dare_ties", "della", "della_linear"])
def test_l1_rescale_in_blocks_scales_by_the_whole_tensors_norms(method):
    """mergekit's L1 rescale in row blocks: each model's survivors scaled by |τ|₁ / |kept|₁
    of the whole tensor. A reference drawing the same masks, then rescaling whole, gives the
    same values; scaling each block by its own norms would not."""
    from moemerge.merge.primitives import task_vectors
    from moemerge.merge.sparse import magprune

    base, tensors = _models()
    params = {"density": 0.5, "rescale": "l1"} | ({"epsilon": 0.1} if "della" in method else {})
    out = merge(method, base=base, tensors=tensors, block=BLOCK, draws=Draws.of(3, "t"),
                **params)
    draws = Draws.of(3, "t")
    taus, kept = task_vectors(base, tensors), torch.zeros(3, ROWS, COLS)
    by_block = torch.zeros(3, ROWS, COLS)
    for b in row_blocks((ROWS, COLS), BLOCK):
        at = draws.at(b.start * COLS)
        for i, tau in enumerate(taus[:, b]):
            kept[i, b] = (magprune(tau, 0.5, 0.1, at, i, "none") if "della" in method
                          else dare_drop(tau, 0.5, at, i, "none"))
            by_block[i, b] = kept[i, b] * tau.abs().sum() / kept[i, b].abs().sum()
    scale = taus.abs().sum((1, 2)) / kept.abs().sum((1, 2))
    rescaled = kept * scale[:, None, None]
    ones = torch.ones(3)
    if method.endswith("linear"):  # normalize: weights 1/3
        expected = base.float() + rescaled.sum(0) / 3
    else:
        from moemerge.merge.primitives import disjoint_mean, elect_sign
        expected = base.float() + disjoint_mean(rescaled, elect_sign(rescaled, ones), ones)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(rescaled, by_block, atol=1e-4)  # per-block norms: another result


@pytest.mark.parametrize("method", ["ties", "breadcrumbs", "breadcrumbs_ties"])
def test_sorted_cut_merges_whole_tensors(method):
    """`trim_rounding: sort` needs one sort of the whole tensor: dispatch merges it in one
    piece whatever the block size, and the memory estimate is told so."""
    base, tensors = _models()
    params = {"density": 0.5, "trim_rounding": "sort"}
    assert not get(method).runs_in_blocks(params) and get(method).runs_in_blocks({})
    whole = merge(method, base=base, tensors=tensors, block=10**9, **params)
    assert torch.equal(merge(method, base=base, tensors=tensors, block=BLOCK, **params), whole)
