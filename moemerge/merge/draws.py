"""Counter-based random draws for the merges that drop entries at random (DARE, DELLA).

Entry j of model i's mask for one output tensor keeps iff u(key, i, j) < p, where u is a hash
of the tensor's key (from the recipe seed and the tensor name), the model index and the
entry's flat index, as a float32 on a 2⁻²⁴ grid in [0, 1). Nothing is consumed in order, so
the bytes do not depend on how a tensor is cut into row blocks, which blocks come first, how
many threads draw, or the device: the CPU, the compiled kernel and CUDA make the same mask.
A generator stream (torch's mt19937) could only be drawn serially, block after block.

The hash, per model i with stream keys (s1, s2) = (mix(k_lo ^ mix(i)), mix(k_hi + i)):
    h = mix(mix((j mod 2³²) ^ s1) ^ (j >> 32) ^ s2),   u = (h >> 8) · 2⁻²⁴
with mix a 32-bit integer finaliser (xor-shift-multiply; its odd multipliers are below 2³¹,
so in int64 arithmetic x · m < 2⁶³ never overflows). native/draws.c computes the same.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
MULTIPLIERS = (0x21F0AAAD, 0x735A2D97)  # odd, < 2³¹ (a 32-bit finaliser's, from hash search)


def mix(x: int) -> int:
    """The 32-bit finaliser on one Python integer (the stream keys; the tests' reference)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MULTIPLIERS[0]) & MASK32
    x ^= x >> 15
    x = (x * MULTIPLIERS[1]) & MASK32
    return x ^ (x >> 15)


def _mix_(x: Tensor) -> Tensor:
    """mix on an int64 tensor of values in [0, 2³²), in place."""
    x.bitwise_xor_(x >> 16).mul_(MULTIPLIERS[0]).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15).mul_(MULTIPLIERS[1]).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 15)


@dataclass(frozen=True)
class Draws:
    """The random draws of one output tensor, from entry `offset` of its flattened shape on
    (the first entry of the row block at hand)."""

    key: int  # 64 bits
    offset: int = 0

    @classmethod
    def of(cls, seed: int, name: str) -> Draws:
        """The draws of output tensor `name` under recipe seed `seed`."""
        digest = hashlib.sha256(f"{seed}\x00{name}".encode()).digest()
        return cls(int.from_bytes(digest[:8], "little"))

    def at(self, offset: int) -> Draws:
        """These draws from `offset` entries further on (a row block's first entry)."""
        return replace(self, offset=self.offset + offset)

    def streams(self, model: int) -> tuple[int, int]:
        """Model `model`'s two 32-bit stream keys."""
        return (mix((self.key & MASK32) ^ mix(model)),
                mix(((self.key >> 32) + model) & MASK32))

    def uniform(self, model: int, shape: torch.Size | tuple[int, ...],
                device: torch.device | str = "cpu") -> Tensor:
        """Model `model`'s uniforms [*shape] float32 in [0, 1), for entries offset.. on."""
        s1, s2 = self.streams(model)
        j = torch.arange(self.offset, self.offset + math.prod(shape), dtype=torch.int64,
                         device=device)
        h = _mix_((j & MASK32) ^ s1)
        h = _mix_(h.bitwise_xor_((j >> 32) ^ s2))
        return (h >> 8).float().mul_(2.0 ** -24).reshape(shape)  # exact: 24-bit integers

    def keep(self, model: int, tau: Tensor, probs: Tensor | float) -> Tensor:
        """τ · (u < p): model `model`'s entries of `tau` (float32) kept with probability `probs`
        (one for all, or one per entry), the others 0 (τ · 0, so −0.0 and NaN as torch makes
        them). The compiled kernel where it applies, else torch: the same bytes."""
        from moemerge.merge import native  # the loader imports this layer

        p = probs if isinstance(probs, Tensor) else torch.tensor(probs, dtype=torch.float32)
        out = native.keep(self, model, tau, p)
        if out is not None:
            return out
        return tau * (self.uniform(model, tau.shape, tau.device) < p.to(tau.device))


DEFAULT = Draws(0)  # a merge called without draws: fixed, never the global random state


def draws_or_default(draws: Draws | None) -> Draws:
    """The draws given, or the fixed ones a merge called without any uses."""
    return draws if draws is not None else DEFAULT
