"""The bridged projectors' least squares from row blocks equals a direct solve on the whole
matrices, for any block size."""

import pytest
import torch

from moemerge.merge.least_squares import padded_average_fit


@pytest.mark.parametrize("rows", [7, 64, 10_000])
def test_row_blocks_equal_the_direct_solve(rows):
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(300, 48, generator=gen), torch.randn(300, 32, generator=gen).bfloat16()]
    own = torch.randn(300, 32, generator=gen)
    weights = [2.0, 1.0]
    padded = torch.zeros(300, 48, dtype=torch.float64)
    for w, s in zip(weights, sources, strict=True):
        padded[:, : s.shape[1]] += w / 3.0 * s.double()
    direct = torch.linalg.lstsq(padded, own.double()).solution
    fitted = padded_average_fit(sources, weights, own, 48, rows=rows)
    torch.testing.assert_close(fitted, direct, rtol=0, atol=1e-10)
    # the fit is the least-squares optimum: any other map does worse
    other = fitted + 1e-3 * torch.randn(fitted.shape, generator=gen, dtype=torch.float64)
    assert (padded @ fitted - own.double()).norm() < (padded @ other - own.double()).norm()
