"""Rotary position embeddings (`q = rope(q, theta=10000)`, `k = rope(k, ...)`; RoFormer).

Pair p of the rotated head dims (first .. first + R - 1, R = the program's dims or the rest of
D) turns by the angle position * theta^(-2p / R): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
the pairs being (first + p, first + p + R/2) (half-split: GPT-NeoX, transformers' rotate_half)
or (first + 2p, first + 2p + 1) (interleaved: GPT-J, Meta's original). A row's position is the
program's expression over b and i (q's rows) or j (k's rows), the sizes and inputs (per
sequence in packed calls). `rope_tables` gives cos and sin per row from float64 angles;
`rotate` applies them (its inverse, the transposed rotation, turns by -angle).

The kernels take the tables (`Kernel.rope_buffers`) and rotate q's and k's rows as they load
them, turning dQ and dK back where they are complete (templates/cpu `rotate_row`,
templates/cuda `rotate_shared_rows` and `turn_back_rows`); `rotate_padded` rotates in torch for
the eager reference (`Kernel.reference`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from attncc.errors import InputError
from attncc.ir.ops import Rope
from attncc.runtime.reference import Value, evaluate


def rotated_dims(spec: Rope, head_dim: int) -> int:
    """R: how many head dims `spec` rotates at this head dim (InputError beyond it)."""
    dims = head_dim - spec.first if spec.dims is None else spec.dims
    if dims <= 0 or dims % 2 or spec.first + dims > head_dim:
        raise InputError(
            f"{spec.operand}: rope({spec.operand}) rotates head dims {spec.first}..{spec.first + dims - 1}, which "
            f"head dim D={head_dim} {'does not hold' if dims > 0 else 'leaves empty'}"
            + (" (an odd count: the dims pair up)" if dims > 0 and dims % 2 and spec.first + dims <= head_dim else "")
        )
    return dims


def rope_tables(
    spec: Rope,
    rows: Mapping[str, Value],
    sizes: Mapping[str, Value],
    scalars: Mapping[str, Value],
    tensors: Mapping[str, torch.Tensor],
    head_dim: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [*rows, R / 2] at each row's position: `rows` maps b and i (q) or j (k) to
    index tensors that broadcast to the rows' shape (sizes likewise)."""
    dims = rotated_dims(spec, head_dim)
    position = evaluate(spec.position, {**rows, **sizes, **scalars}, tensors).to(torch.float64)
    device = position.device
    frequency = spec.theta ** (-torch.arange(0, dims, 2, dtype=torch.float64, device=device) / dims)
    angle = position.unsqueeze(-1) * frequency
    return torch.cos(angle).to(dtype), torch.sin(angle).to(dtype)


def rotate(x: torch.Tensor, spec: Rope, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] with its rotated dims turned by the tables (broadcast to [..., R / 2])."""
    half = cos.shape[-1]
    first, last = spec.first, spec.first + 2 * half
    part = x[..., first:last]
    if spec.interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
    else:
        x1, x2 = part[..., :half], part[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    turned = torch.stack([y1, y2], dim=-1).flatten(-2) if spec.interleaved else torch.cat([y1, y2], dim=-1)
    return torch.cat([x[..., :first], turned, x[..., last:]], dim=-1)


def rotate_padded(
    spec: Rope,
    x: torch.Tensor,
    sizes: Mapping[str, Value],
    scalars: Mapping[str, Value],
    tensors: Mapping[str, torch.Tensor],
) -> torch.Tensor:
    """q [B, H, N, D] or k [B, Hkv, M, D] of a padded call (sizes may give each sequence's M
    as [B, 1, 1]), rotated at its rows' positions, in fp32 (fp64 for fp64 x) rounded once to
    x's dtype; differentiable."""
    B, _, count, _ = x.shape
    rows = {
        "b": torch.arange(B, device=x.device).view(-1, 1, 1),
        "i" if spec.operand == "q" else "j": torch.arange(count, device=x.device).view(1, 1, -1),
    }
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    cos, sin = rope_tables(spec, rows, sizes, scalars, tensors, x.shape[-1], dtype)
    return rotate(x.to(dtype), spec, cos, sin).to(x.dtype)
