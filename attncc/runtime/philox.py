"""Philox4x32-10 in torch: the reference for the kernels' dropout bits.

The counter of score (b, h, i, j) is (j // 4, i, b * H + h, offset) with key (seed low 32,
seed high 32); output word j % 4 below floor((1 - p) * 2^32) keeps the element. The CPU
kernels (include/attncc/cpu/primitives.h) and future GPU kernels use the same counters, so a
mask depends only on (seed, offset, b, h, i, j), never on tiling or thread schedule.
"""

from __future__ import annotations

import torch

from attncc.errors import InputError

_MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57
_W0, _W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product a * b, exactly, in int64 arithmetic."""
    b_lo, b_hi = b & 0xFFFF, b >> 16
    p_lo, p_hi = a * b_lo, a * b_hi  # each < 2^48
    mid = p_lo + ((p_hi & 0xFFFF) << 16)
    return (p_hi >> 16) + (mid >> 32), mid & _MASK32


def philox4x32_10(counter: tuple[torch.Tensor, ...], key: tuple[int, int]) -> tuple[torch.Tensor, ...]:
    """Philox4x32 with 10 rounds on int64 tensors holding uint32 values (broadcasting)."""
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & _MASK32 for c in counter)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo(_M0, c0)
        hi1, lo1 = _mulhilo(_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def keep_threshold(p: float) -> int:
    return min(int((1.0 - p) * 4294967296.0), _MASK32)


def dropout_mask(seed: int, offset: int, B: int, H: int, N: int, M: int, p: float) -> torch.Tensor:
    """The [B, H, N, M] keep mask (True = kept) that attncc kernels apply for dropout p (a CPU
    tensor)."""
    for name, value in (("seed", seed), ("offset", offset), ("B", B), ("H", H), ("N", N), ("M", M)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"{name}: expected an int >= 0, got {value!r}")
    if seed >= 2**63:  # (a call's seed is an int64: kern(seed=) refuses these too)
        raise InputError(f"seed: expected an int in [0, 2^63), got {seed!r}")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise InputError(f"p: expected a dropout rate in [0, 1), got {p!r}")
    # (on the host, whatever torch's default device: a meta mask has no bits)
    b = torch.arange(B, device="cpu").view(-1, 1, 1, 1)
    h = torch.arange(H, device="cpu").view(1, -1, 1, 1)
    i = torch.arange(N, device="cpu").view(1, 1, -1, 1)
    j = torch.arange(M, device="cpu").view(1, 1, 1, -1)
    counter = torch.tensor(offset, device="cpu")
    words = philox4x32_10((j >> 2, i, b * H + h, counter), (seed & _MASK32, (seed >> 32) & _MASK32))
    word = torch.zeros(torch.broadcast_shapes(b.shape, h.shape, i.shape, j.shape), dtype=torch.int64, device="cpu")
    lane = (j & 3).expand_as(word)
    for w in range(4):
        word = torch.where(lane == w, words[w].expand_as(word), word)
    return word < keep_threshold(p)
