"""Parity with mergekit on tiny tensors, for the methods mergekit 0.1.5 added last (nuslerp,
nearswap, arcee_fusion, ram, ramplus_tl): their edge cases (rows, columns, 3-D tensors, zero
and parallel vectors, one to three models, thresholds) beside mergekit_parity.py's whole-model
builds. Prints the max |Δ| per method; writes nothing.

Runs in the venv holding mergekit, with moemerge on the path (moemerge's own venv has no
mergekit, and needs none):

    PYTHONPATH=. /tmp/mk/bin/python benchmarks/mergekit_parity_tensors.py
"""

from __future__ import annotations

import torch
from mergekit.merge_methods.api import merge_tensors

from moemerge.merge.dispatch import merge

SHAPES = [(7, 5), (16,), (3, 4, 6), (64, 48)]


def theirs(tensors, method, params, base_index=None):
    return merge_tensors(tensors, method, parameters=params, base_index=base_index,
                         dtype=torch.float32).float()


def cases(base, models, sparse):
    """(method, ours, mergekit's) on one shape: base, noisy models, sparse-noise models."""
    for flatten in (True, False):
        for row_wise in (False, True):
            for w in ((1.0, 1.0), (0.3, 0.9)):
                p = {"nuslerp_flatten": flatten, "nuslerp_row_wise": row_wise}
                mk = {**p, "weight": list(w)}
                yield ("nuslerp", merge("nuslerp", base=base, tensors=models[:2], weights=w, **p),
                       theirs([base, *models[:2]], "nuslerp", mk, 0))
                yield ("nuslerp", merge("nuslerp", base=None, tensors=models[:2], weights=w, **p),
                       theirs(models[:2], "nuslerp", mk))
    for t in (0.0, 0.01, 0.05, 1.0):
        yield ("nearswap", merge("nearswap", base=base, tensors=models[:1], swap_distance=t),
               theirs([base, models[0]], "nearswap", {"t": t}, 0))
    yield ("arcee_fusion", merge("arcee_fusion", base=base, tensors=models[:1]),
           theirs([base, models[0]], "arcee_fusion", {}, 0))
    for n in (1, 2, 3):
        for eps in (1e-5, 0.02):
            yield ("ram", merge("ram", base=base, tensors=sparse[:n], nonzero_threshold=eps),
                   theirs([base, *sparse[:n]], "ram", {"epsilon": eps}, 0))
            for r, a in ((0.1, 0.2), (0.5, 1.0)):
                yield ("ramplus_tl", merge("ramplus_tl", base=base, tensors=sparse[:n], r=r,
                                           alpha=a, nonzero_threshold=eps),
                       theirs([base, *sparse[:n]], "ramplus_tl",
                              {"epsilon": eps, "r": r, "alpha": a}, 0))


def edge_cases():
    zero, v = torch.zeros(4, 3), torch.randn(4, 3)
    yield "nuslerp", merge("nuslerp", base=None, tensors=[zero, v]), theirs(
        [zero, v], "nuslerp", {"weight": [1, 1]})
    yield "nuslerp", merge("nuslerp", base=None, tensors=[v, 2 * v]), theirs(
        [v, 2 * v], "nuslerp", {"weight": [1, 1]})
    yield "ram", merge("ram", base=v, tensors=[v, v]), theirs([v, v, v], "ram", {}, 0)
    yield "ramplus_tl", merge("ramplus_tl", base=v, tensors=[v, v + 1]), theirs(
        [v, v, v + 1], "ramplus_tl", {}, 0)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    worst: dict[str, list[float]] = {}
    for shape in SHAPES:
        base = torch.randn(shape)
        models = [base + 0.05 * torch.randn(shape) for _ in range(3)]
        sparse = [base + (torch.rand(shape) < 0.5) * 0.05 * torch.randn(shape) for _ in range(3)]
        for method, ours, mk in cases(base, models, sparse):
            worst.setdefault(method, []).append((ours - mk).abs().max().item())
    for method, ours, mk in edge_cases():
        worst[method].append((ours - mk).abs().max().item())
    print("| method | cases | max \\|Δ\\| |\n|---|---:|---:|")
    for method, deltas in worst.items():
        print(f"| {method} | {len(deltas)} | {max(deltas):.3g} |")


if __name__ == "__main__":
    main()
