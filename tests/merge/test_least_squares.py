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


def test_the_fit_is_the_same_bytes_in_every_process():
    """A bridged build's bytes do not depend on the run: LAPACK's default gelsy differed by
    ~1e-15 between processes (in about one run of three), gelsd does not."""
    import subprocess
    import sys

    script = ("import hashlib, torch\n"
              "from moemerge.merge.least_squares import padded_average_fit\n"
              "g = torch.Generator().manual_seed(0)\n"
              "s = [torch.randn(300, 32, generator=g), torch.randn(300, 24, generator=g)]\n"
              "x = padded_average_fit(s, None, torch.randn(300, 24, generator=g), 32)\n"
              "print(hashlib.sha256(x.numpy().tobytes()).hexdigest())\n")
    runs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True).stdout for _ in range(4)}
    assert len(runs) == 1, runs
