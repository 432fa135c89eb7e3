"""The bridged projectors' least-squares fit at a real vocabulary: time and peak memory.

    python benchmarks/bench_lstsq.py [--vocab 151936] [--width 4096] [--own 4096] [--experts 2]

Random bf16 embeddings of the given shape (as read from a checkpoint); times
`merge.least_squares.padded_average_fit` (float64 normal equations from row blocks) and
reports the process's peak RSS above the inputs. Results: benchmarks/results/lstsq.md.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from stamp import commit_text, provenance

from moemerge.merge.least_squares import padded_average_fit

RESULTS = Path(__file__).resolve().parent / "results"


def status_mib(key: str) -> float:
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--width", type=int, default=4096, help="the shared (widest) width")
    parser.add_argument("--own", type=int, default=4096, help="the expert's own width")
    parser.add_argument("--experts", type=int, default=2)
    opts = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(opts.vocab, opts.width, generator=gen).bfloat16()
               for _ in range(opts.experts)]
    own = torch.randn(opts.vocab, opts.own, generator=gen).bfloat16()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the fit's own peak
    before = status_mib("VmRSS")
    t0 = time.perf_counter()
    solution = padded_average_fit(sources, None, own, opts.width)
    seconds = time.perf_counter() - t0
    peak = status_mib("VmHWM")
    inputs = sum(t.numel() * 2 for t in (*sources, own)) / 2**20
    stamp = provenance()
    made = (f"{commit_text(stamp)}, {stamp['date'][:10]}, torch {stamp['torch']}, "
            f"{stamp['machine']} × {stamp['cpus']} CPUs")
    line = (f"| {opts.vocab} × {opts.width} ({opts.experts} sources), own width {opts.own} | "
            f"{seconds:.1f} | {max(0.0, peak - before):.0f} | {inputs:.0f} | "
            f"{tuple(solution.shape)} | {made} |")
    print(line)
    RESULTS.mkdir(exist_ok=True)
    file = RESULTS / "lstsq.md"
    if not file.is_file():
        file.write_text(
            "# Bridged least-squares projector fit at real vocabulary sizes\n\n"
            "`python benchmarks/bench_lstsq.py` (random bf16 inputs in memory; float64 normal "
            "equations from blocks of 8192 rows). Peak: the process's peak RSS above the "
            "inputs, MiB. Each row is appended by one run, with its provenance "
            "(benchmarks/stamp.py) in the last column.\n\n"
            "| inputs | seconds | peak above inputs MiB | inputs MiB | solution | made with |\n"
            "|---|---|---|---|---|---|\n")
    file.write_text(file.read_text() + line + "\n")


if __name__ == "__main__":
    main()
