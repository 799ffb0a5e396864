"""Jagged nested tensors (`torch.nested`, layout=torch.jagged) as a kernel's q, k and v.

`kern(q, k, v)` takes them as scaled_dot_product_attention does, [B, H, j, D] (the ragged
dim third), or [B, j, H, D]: each sequence attends within itself, as one packed call
(`Kernel.varlen`) on the tensors' values and offsets, so nothing is padded and autograd flows
through the values. The program sees b as the sequence and N, M as its own lengths, as in a
packed call; runtime tensors keep padded shapes (B sequences, N and M the longest).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from attncc.errors import InputError
from attncc.runtime.reference import values_unreadable

if TYPE_CHECKING:
    from attncc.runtime.kernel import Kernel

#: Where the ragged dim of a [B, H, j, D] (SDPA's) or [B, j, H, D] operand is.
RAGGED_DIMS = {2: "bhnd", 1: "bnhd"}


def any_nested(q: object, k: object, v: object) -> bool:
    """Whether any of q, k, v is a nested tensor (asked of every call: 0.2 us)."""
    try:
        return q.is_nested or k.is_nested or v.is_nested  # type: ignore[union-attr]
    except AttributeError:  # (not tensors: the call's checks say so)
        return any(isinstance(t, torch.Tensor) and t.is_nested for t in (q, k, v))


def jagged_parts(name: str, t: object) -> tuple[torch.Tensor, torch.Tensor, str]:
    """values [total, heads, D] (a view: gradients flow back), offsets [B + 1] and the layout
    of a jagged nested operand; a clear error for any other."""
    if not isinstance(t, torch.Tensor) or not t.is_nested:
        got = f"a dense tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputError(f"{name}: q, k and v are nested tensors together or not at all; got {got}")
    if t.layout != torch.jagged:
        raise InputError(
            f"{name}: nested tensors of layout torch.jagged only (torch.nested.nested_tensor(..., layout=torch.jagged)), got {t.layout}"
        )
    if t.dim() != 4 or t._ragged_idx not in RAGGED_DIMS:  # type: ignore[attr-defined]
        raise InputError(
            f"{name}: expected a jagged tensor [B, H, j, D] (ragged dim 2, as scaled_dot_product_attention takes) "
            f"or [B, j, H, D] (ragged dim 1), got {t.dim()} dims, ragged dim {t._ragged_idx}"  # type: ignore[attr-defined]
        )
    if t.lengths() is not None:
        raise InputError(
            f"{name}: a jagged tensor with holes (lengths() set, e.g. from narrow) is not packed; pass .contiguous()"
        )
    values = t.values()  # [total, heads, D], or [heads, total, D] for ragged dim 2
    layout = RAGGED_DIMS[t._ragged_idx]  # type: ignore[attr-defined]
    return (values.transpose(0, 1) if layout == "bhnd" else values), t.offsets(), layout


def nested_attention(
    kern: Kernel,
    q: object,
    k: object,
    v: object,
    return_lse: bool,
    options: dict[str, object],
    runtime: dict[str, object],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`kern(q, k, v, **options, **runtime)` on jagged nested q, k, v: out a jagged tensor with
    q's offsets and layout, Dv wide (and lse [B, H, j] or [B, j, H], float32; float64 for
    float64 inputs)."""
    q_values, q_offsets, layout = jagged_parts("q", q)
    k_values, k_offsets, k_layout = jagged_parts("k", k)
    v_values, v_offsets, v_layout = jagged_parts("v", v)
    for name, other in (("k", k_layout), ("v", v_layout)):
        if other != layout:
            raise InputError(
                f"{name}: ragged dim {'2 ([B, H, j, D])' if other == 'bhnd' else '1 ([B, j, H, D])'}, q's is the other"
            )
    batch = {"q": q_offsets.numel() - 1, "k": k_offsets.numel() - 1, "v": v_offsets.numel() - 1}
    if len(set(batch.values())) != 1:
        raise InputError(f"q, k, v: one batch size expected, got {', '.join(f'{n} B={b}' for n, b in batch.items())}")
    if v_offsets is not k_offsets:
        differ = "v: its sequences' lengths must be k's (offsets differ)"
        if values_unreadable(v_offsets) or values_unreadable(k_offsets):
            # traced (k and v made apart): checked as the graph runs, where a read here is a
            # data-dependent guard that fullgraph refused
            torch._assert_async(torch.eq(v_offsets, k_offsets.to(v_offsets.device)).all(), differ)
        elif not torch.equal(v_offsets, k_offsets.to(v_offsets.device)):
            raise InputError(differ)
    # A jagged view may hold rows before its first sequence and after its last (offsets [4, 7,
    # 14] of 20 rows: torch makes and accepts one; the varlen call's offsets must run from 0 to
    # its rows, an error naming cu_seqlens_q before): the call takes the sequences' rows, and
    # out and lse get the others back (0 and -inf) so that they keep q's offsets.
    rows, out_offsets, kept = q_values.shape[0], q_offsets, None
    if not values_unreadable(q_offsets):
        q0, q1, k0, k1 = torch.cat([q_offsets[[0, -1]], k_offsets[[0, -1]].to(q_offsets.device)]).tolist()  # (one read)
        if (q0, q1, k0, k1) != (0, rows, 0, k_values.shape[0]):
            kept = (q0, q1)
            q_values, q_offsets = q_values[q0:q1], q_offsets - q0
            k_values, v_values, k_offsets = k_values[k0:k1], v_values[k0:k1], k_offsets - k0
    out, lse = kern.varlen(q_values, k_values, v_values, q_offsets, k_offsets, return_lse=True, **options, **runtime)  # type: ignore[arg-type]
    if kept is not None:
        before, after = kept[0], rows - kept[1]
        out = torch.cat([out.new_zeros(before, *out.shape[1:]), out, out.new_zeros(after, *out.shape[1:])])
        lse = torch.cat(
            [lse.new_full((before, *lse.shape[1:]), -math.inf), lse, lse.new_full((after, *lse.shape[1:]), -math.inf)]
        )
    # (the same offsets tensor: out's ragged size is q's, so out + q and the like work)
    out = torch.nested.nested_tensor_from_jagged(out, out_offsets)
    lse = torch.nested.nested_tensor_from_jagged(lse, out_offsets)
    if layout == "bhnd":
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if return_lse else out
