"""Packed (varlen) and paged-KV calls.

A program speaks of b (the sequence), h, i, j (positions inside the sequence) and N, M (that
sequence's query and key lengths). A packed batch (FlashAttention's varlen layout: q
[total_q, H, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv], sequence b at rows cu_seqlens[b] .. cu_seqlens[b + 1])
is one launch on every backend: the kernels take the offsets (ABI q_starts, k_starts), N and M in
the program are each sequence's own, tiles never straddle two sequences (the tile classes are
per sequence, tiles past a sequence's end empty) and no work is spent on padding that is not
there. So a mask written once serves padded, packed and paged calls, and b, B are the sequence's
index and the number of sequences.

Runtime tensors keep their padded shapes: an axis declared `B` counts sequences, an axis declared
`N` or `M` holds the longest sequence (varlen: max_seqlen_q, max_seqlen_k; paged: N of q and the
block table's capacity). A paged call reads the cache in place, through the block table, in one
launch (b is each sequence's index, B their number, as in packed calls).

Dropout counters are per sequence: sequence b keeps exactly
`attncc.dropout_mask(seed, b, 1, H, N_b, M_b, p)[0]` (the counters' fourth word is b).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from attncc.errors import InputError
from attncc.ir.expr import python_number
from attncc.runtime.fp8 import check_operand_dtypes, kv_descales
from attncc.runtime.reference import values_unreadable
from attncc.runtime.sinks import padded_rows

if TYPE_CHECKING:
    from attncc.runtime.kernel import KeptLaunch, Kernel, PackedSequences, PagedKeys

_INT_DTYPES = (torch.int32, torch.int64)
#: Plans of calls given their offsets (`offsets_plan`) kept per kernel: the last batches'.
VARLEN_PLANS_KEPT = 8


@dataclass(frozen=True)
class CallOptions:
    """What every sequence's call shares."""

    scalars: list[float]
    scale: float | None
    dropout: float
    seed: int


# ---------------------------------------------------------------------- checks
def _tensor(name: str, t: object, dims: int, layout: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != dims:
        raise InputError(f"{name}: expected {dims} dimensions {layout}, got shape {tuple(t.shape)}")
    return t


def _host_ints(name: str, t: object, dims: int, layout: str, device: torch.device) -> torch.Tensor:
    """An int32/int64 tensor on q's device, read on the host (one copy from a GPU)."""
    t = _tensor(name, t, dims, layout)
    if t.dtype not in _INT_DTYPES:
        raise InputError(f"{name}: expected dtype int32 or int64, got {t.dtype}")
    if t.device != device:
        raise InputError(f"{name}: expected device {device} (that of q), got {t.device}")
    return t.detach().to("cpu", torch.int64)


def _cumulative(name: str, cu: torch.Tensor, total: int, rows: str) -> list[int]:
    values = cu.tolist()
    if not values or values[0] != 0:
        raise InputError(f"{name}: expected a first entry 0, got {values[:1] or 'an empty tensor'}")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise InputError(
                f"{name}: expected non-decreasing offsets, got {name}[{b}]={values[b]} > {name}[{b + 1}]={values[b + 1]}"
            )
    if values[-1] != total:
        raise InputError(f"{name}: the last offset {values[-1]} must equal the {rows} rows, {total}")
    return values


def _longest(name: str, given: object, longest: int) -> int:
    if given is None:
        return longest
    given = python_number(given)  # (numpy's integers; a 0-d integer tensor as its value, below)
    if isinstance(given, torch.Tensor) and given.dim() == 0 and not (given.is_floating_point() or given.is_complex()):
        given = int(given) if given.dtype != torch.bool else given
    if isinstance(given, bool) or not isinstance(given, int) or given < longest:
        raise InputError(f"{name}: expected an int >= the longest sequence, {longest}; got {given!r}")
    return given


def _check_operands(q: torch.Tensor, kv: tuple[tuple[str, torch.Tensor], ...], runtime: Mapping[str, object]) -> None:
    """The key-side operands (k and v, or a cache's) on q's device, of q's dtype or fp8
    (`check_operand_dtypes`)."""
    for name, t in kv:
        if t.device != q.device:
            raise InputError(f"{name}: expected device {q.device} (that of q), got {t.device}")
    check_operand_dtypes(q, kv[0][1], kv[1][1], runtime, ", ".join(("q", kv[0][0], kv[1][0])))


def _proxy(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` with like's dtype and device and no storage to speak of (for validation:
    its one element is never read, so not written either; on a GPU a zero fill is a launch)."""
    return like.new_empty(1).as_strided(shape, (0,) * len(shape))


def _validate_runtime(
    kern: Kernel, q: torch.Tensor, sizes: tuple[int, int, int, int, int, int], runtime: Mapping[str, object]
) -> None:
    """The padded call's checks on the runtime inputs, at the batch's padded sizes."""
    B, H, Hkv, N, M, D = sizes
    kern.validate(_proxy(q, (B, H, N, D)), _proxy(q, (B, Hkv, M, D)), _proxy(q, (B, Hkv, M, D)), runtime)


# ---------------------------------------------------------------------- packed (varlen)
def _checked_offsets(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    device: torch.device,
    totals: tuple[int, int] | None,
) -> tuple[PackedSequences, int, int]:
    """The packed sequences of these offsets on `device`, read on the host and checked (their
    last entries against `totals`, q's and k's rows, where given), and the call's N and M."""
    return _checked_host_offsets(
        _read_offsets(cu_seqlens_q, cu_seqlens_k, device), max_seqlen_q, max_seqlen_k, device, totals
    )


def _read_offsets(
    cu_seqlens_q: object, cu_seqlens_k: object, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets on the host (int64), their types, dims, dtypes and device checked."""
    return (
        _host_ints("cu_seqlens_q", cu_seqlens_q, 1, "[B + 1]", device),
        _host_ints("cu_seqlens_k", cu_seqlens_k, 1, "[B + 1]", device),
    )


def _checked_host_offsets(
    offsets: tuple[torch.Tensor, torch.Tensor],
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    device: torch.device,
    totals: tuple[int, int] | None,
) -> tuple[PackedSequences, int, int]:
    """`_checked_offsets` of offsets already read (`_read_offsets`)."""
    from attncc.runtime.kernel import PackedSequences

    cq, ck = offsets
    if cq.numel() != ck.numel():
        raise InputError(f"cu_seqlens_k: expected {cq.numel()} offsets (as cu_seqlens_q: B + 1), got {ck.numel()}")
    total_q, total_k = (
        totals if totals is not None else (int(cq[-1]) if cq.numel() else 0, int(ck[-1]) if ck.numel() else 0)
    )
    starts_q = _cumulative("cu_seqlens_q", cq, total_q, "q's")
    starts_k = _cumulative("cu_seqlens_k", ck, total_k, "k's")
    packed = PackedSequences.of(starts_q, starts_k, device)
    return (
        packed,
        _longest("max_seqlen_q", max_seqlen_q, packed.longest[0]),
        _longest("max_seqlen_k", max_seqlen_k, packed.longest[1]),
    )


@dataclass(frozen=True, eq=False)
class VarlenPlan:
    """A packed batch's offsets, read and checked on the host once for all the calls that share
    them (FlashInfer's plan/run for ragged batches: every layer of a model on one batch, forward
    and backward): a call given `plan=` reads no offset on the host (on a GPU: no
    synchronisation per layer, the host runs ahead of the kernels), and each kernel prepares its
    tile classes for the batch once. Made by `attncc.plan_varlen`; valid while the offsets it was
    made from hold."""

    cu_seqlens_q: torch.Tensor  # the caller's (what the op reads where torch.compile traces the call)
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    packed: PackedSequences  # the checked sequences, offsets on the device
    device: torch.device


def plan_varlen(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> VarlenPlan:
    """The `VarlenPlan` of a packed batch's offsets (int32/int64 [B + 1] each, on the device of
    the calls' q): the checks of `Kernel.varlen` on them, once (the calls check their q and k
    rows against the offsets' last entries, and their runtime inputs)."""
    cu_seqlens_q = _tensor("cu_seqlens_q", cu_seqlens_q, 1, "[B + 1]")
    packed, n_max, m_max = _checked_offsets(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, cu_seqlens_q.device, None
    )
    return VarlenPlan(cu_seqlens_q, cu_seqlens_k, n_max, m_max, replace(packed, prepared={}), cu_seqlens_q.device)


def offsets_plan(
    memo: OrderedDict[tuple, VarlenPlan],
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: object,
    cu_seqlens_k: object,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
) -> VarlenPlan:
    """The plan of a call given its offsets (`Kernel.varlen` without `plan=`), from `memo` (a
    kernel's, the last VARLEN_PLANS_KEPT offsets it was given) where a call gave the same
    offset values, the same longest lengths and q's and k's rows: the offsets are read on the
    host (their checks on a call's own offsets, as unplanned calls always did), and a new
    batch is checked against q's and k's rows. The calls of a model's layers on one batch then
    share a plan, and its kept launches (`Kernel._remember_repeat`), as if given `plan=`. The
    plan holds copies of the offsets (the caller may reuse its tensors for another batch)."""
    q = _tensor("q", q, 3, "[total_q, H, D]")
    k = _tensor("k", k, 3, "[total_k, Hkv, D]")
    offsets = _read_offsets(cu_seqlens_q, cu_seqlens_k, q.device)
    # (a plan made under torch.inference_mode holds inference tensors, which a training call's
    # autograd cannot save: its calls alone take it, session 67's review)
    key = (
        q.device, tuple(offsets[0].tolist()), tuple(offsets[1].tolist()), max_seqlen_q, max_seqlen_k,
        q.shape[0], k.shape[0], torch.is_inference_mode_enabled(),
    )  # fmt: skip
    plan = memo.get(key)
    if plan is not None:
        memo.move_to_end(key)  # (the least recently used is dropped first)
    else:
        packed, n_max, m_max = _checked_host_offsets(
            offsets, max_seqlen_q, max_seqlen_k, q.device, (q.shape[0], k.shape[0])
        )
        copies = (cu_seqlens_q.clone(), cu_seqlens_k.clone())  # type: ignore[union-attr]
        plan = VarlenPlan(*copies, n_max, m_max, replace(packed, prepared={}), q.device)
        if len(memo) >= VARLEN_PLANS_KEPT:
            memo.popitem(last=False)  # the oldest
        memo[key] = plan
    return plan


def planned_sequences(
    kern: Kernel, plan: VarlenPlan, q: torch.Tensor, k: torch.Tensor, runtime: Mapping[str, object]
) -> PackedSequences:
    """A planned call's sequences, the call checked against its plan (device, q's and k's rows)
    and its runtime inputs at the batch's padded sizes."""
    if not isinstance(plan, VarlenPlan):
        raise InputError(f"plan: expected an attncc.VarlenPlan (attncc.plan_varlen), got {type(plan).__name__}")
    if q.device != plan.device:
        raise InputError(f"q: expected device {plan.device} (the plan's offsets'), got {q.device}")
    total_q, total_k = plan.packed.total_rows
    for name, t, total in (("q", q, total_q), ("k", k, total_k)):
        if t.shape[0] != total:
            raise InputError(
                f"{name}: the plan's offsets cover {total} rows, got {t.shape[0]} (shape {tuple(t.shape)})"
            )
    sizes = (plan.packed.batch, q.shape[1], k.shape[1], plan.max_seqlen_q, plan.max_seqlen_k, q.shape[2])
    _validate_runtime(kern, q, sizes, runtime)
    return plan.packed


def varlen_forward(
    kern: Kernel,
    packed: PackedSequences,
    options: CallOptions,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor | None,
    tensors: list[torch.Tensor],
    descale: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out, lse of a packed batch in one launch; rows of sequences with no key are 0 and -inf
    (or the sink alone). `descale`: fp8 k's and v's factors [total_k, Hkv, 1] (runtime/fp8.py)."""
    return kern.forward_impl(
        q, k, v, tensors, options.scalars, options.scale, options.dropout, options.seed,
        sink=sink, packed=packed, descale=descale,
    )  # fmt: skip


def varlen_backward(
    kern: Kernel,
    packed: PackedSequences,
    options: CallOptions,
    saved: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    tensors: list[torch.Tensor],
    grad_inputs: list[bool],
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """dq, dk, dv and the learnable inputs' gradients (empty where not wanted; with `sink`, the
    rows' lse residuals after them) of a packed batch in one backward, from the forward's saved (q, k, v, out, lse) and its sink logits `sink`, if
    any; the sink's gradient is the caller's (`sinks.sink_gradient`)."""
    q, k, v, out, lse = saved
    return kern.backward_impl(
        q, k, v, out, lse, dout, dlse, tensors, options.scalars, options.scale, options.dropout, options.seed,
        grad_inputs, packed=packed, sink=sink,
    )  # fmt: skip


def varlen_sink_rows(
    kern: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    scale: float | None,
    runtime: Mapping[str, object],
) -> torch.Tensor:
    """The program's sink at every packed row [total_q, H] (row r of sequence b is its query
    i = r - cu_seqlens_q[b]), differentiable w.r.t. the inputs it reads; tensor operations only,
    so torch.compile traces it without reading the offsets."""
    from attncc.runtime.kernel import acc_dtype

    rows, lengths = packed_index(cu_seqlens_q, cu_seqlens_q, cu_seqlens_k, q.shape[0], "i")
    rows["h"] = torch.arange(q.shape[1], device=q.device).view(1, -1)
    sizes = {"B": cu_seqlens_q.shape[0] - 1, "H": q.shape[1], "Hkv": k.shape[1], "D": q.shape[2], **lengths}
    return kern.sink_rows(rows, sizes, scale, runtime, acc_dtype(q.dtype)).expand(q.shape[:2]).contiguous()


def packed_index(
    cu_rows: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, total: int, row: str
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """b and the in-sequence index `row` (i or j) of each of `total` packed rows at offsets
    `cu_rows` ([total, 1] each), and N and M of each row's sequence; tensor operations only,
    so torch.compile traces them without reading the offsets."""
    starts, cq, ck = cu_rows.to(torch.int64), cu_q.to(torch.int64), cu_k.to(torch.int64)
    position = torch.arange(total, device=starts.device)
    # b with starts[b] <= r < starts[b + 1]; clamped so that offsets the op will refuse (a last
    # offset short of the total) index no further than the last sequence while rows are evaluated
    sequence = torch.searchsorted(starts[1:], position, right=True).clamp_max(max(starts.shape[0] - 2, 0))
    rows = {"b": sequence.view(-1, 1), row: (position - starts[sequence]).view(-1, 1)}
    lengths = {"N": (cq[1:] - cq[:-1])[sequence].view(-1, 1), "M": (ck[1:] - ck[:-1])[sequence].view(-1, 1)}
    return rows, lengths


def _check_unambiguous_descales(
    k_descale: object, v_descale: object, cu_seqlens_k: torch.Tensor, total_k: int, traced: bool
) -> None:
    """A packed call's factor [total_k, Hkv] is one per token; where total_k is also the number
    of sequences B it has FlashAttention 3's per-sequence shape [B, Hkv] too, and the two differ
    unless every sequence has one key (read from the offsets; refused while traced)."""
    if not any(isinstance(given, torch.Tensor) and given.dim() == 2 for given in (k_descale, v_descale)):
        return  # (first: traced, comparing total_k with B added a shape guard to every packed call)
    sequences = cu_seqlens_k.numel() - 1
    if sequences != total_k or sequences < 2:
        return
    for name, given in (("k_descale", k_descale), ("v_descale", v_descale)):
        if not isinstance(given, torch.Tensor) or given.dim() != 2 or given.shape[0] != total_k:
            continue
        if traced or not bool((cu_seqlens_k.diff() == 1).all()):
            raise InputError(
                f"{name}: {list(given.shape)} is a factor per token ([total_k, Hkv], total_k = {total_k}) and has "
                f"FlashAttention 3's per-sequence shape [B, Hkv] (B = {sequences}) as well, which differ for these "
                f"sequence lengths; give factors per token as [total_k, Hkv, 1] (k's shape, head dim 1), "
                f"per-sequence ones that way too: `{name}[torch.repeat_interleave(torch.arange(B), "
                "cu_seqlens_k.diff())].unsqueeze(-1)`"
            )


def varlen_attention(
    kern: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    *,
    return_lse: bool,
    scale: float | None,
    train: bool,
    seed: int | None,
    runtime: Mapping[str, object],
    dropout_p: float | None = None,
    k_descale: object = None,
    v_descale: object = None,
    plan: VarlenPlan | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`Kernel.varlen`: attention of a packed batch, forward and backward, through the op
    `attncc::varlen_attention` (so torch.compile(fullgraph=True) takes it whole), or, in eager
    calls, its implementation directly; the offsets from `plan` (checked once) or given."""
    from attncc.runtime.kernel import (
        _eager_autograd,
        _EagerVarlen,
        _plain_call,
        seed_tensor,
    )

    q = _tensor("q", q, 3, "[total_q, H, D]")
    k = _tensor("k", k, 3, "[total_k, Hkv, D]")
    v = _tensor("v", v, 3, "[total_k, Hkv, Dv]")
    if k.shape[2] != q.shape[2]:  # (the kernels read k's rows q's head dim wide)
        raise InputError(f"k: expected head dim {q.shape[2]} (from q), got shape {tuple(k.shape)}")
    if v.shape[:2] != k.shape[:2]:
        raise InputError(
            f"v: expected shape [{k.shape[0]}, {k.shape[1]}, Dv] (that of k but the head dim), got {tuple(v.shape)}"
        )
    _check_operands(q, (("k", k), ("v", v)), runtime)
    kern.check_input_names(runtime)
    traced = values_unreadable(q)  # the offsets' values: only the op reads them then
    packed = None
    if plan is not None:
        if cu_seqlens_q is not None or cu_seqlens_k is not None or max_seqlen_q is not None or max_seqlen_k is not None:
            raise InputError("plan: give the offsets either as plan= or as cu_seqlens_q, cu_seqlens_k, not both")
        if not traced:
            packed = planned_sequences(kern, plan, q, k, runtime)
        cu_seqlens_q, cu_seqlens_k = plan.cu_seqlens_q, plan.cu_seqlens_k
        max_seqlen_q, max_seqlen_k = plan.max_seqlen_q, plan.max_seqlen_k
    elif cu_seqlens_q is None or cu_seqlens_k is None:
        raise InputError(
            "cu_seqlens_q, cu_seqlens_k: a packed call needs both offsets (or plan=attncc.plan_varlen(...))"
        )
    # (untraced, a call given its offsets comes with the kernel's plan of them: `Kernel.varlen`)
    scale = kern.call_scale(scale)
    dropout = kern.call_dropout(train, dropout_p)
    tensors: list[torch.Tensor] = [runtime[d.name] for d in kern.inputs if d.role == "tensor"]  # type: ignore[misc]
    scalars = [float(runtime[d.name]) for d in kern.inputs if d.role == "scalar"]  # type: ignore[arg-type]
    descale = kv_descales(k, v, k_descale, v_descale, "packed")
    _check_unambiguous_descales(k_descale, v_descale, cu_seqlens_k, k.shape[0], traced)
    seed_value = seed_tensor(seed, dropout)
    sink = None
    if kern.op.sink is not None:
        sink = varlen_sink_rows(kern, q, k, cu_seqlens_q, cu_seqlens_k, scale, runtime)
    # eager calls skip torch.library's dispatch and the op's second read of the offsets, as
    # padded calls do (`Kernel.__call__`); traced, transformed or watched calls see the op
    if packed is not None and _plain_call(q, k, v, *tensors, *([sink] if sink is not None else [])):
        options = CallOptions(scalars, scale, dropout, int(seed_value.item()))
        out, lse = varlen_forward(kern, packed, options, q, k, v, sink, tensors, descale)
    elif packed is not None and sink is None and not descale and _eager_autograd(q, k, v, *tensors):
        out, lse = _EagerVarlen.apply(
            kern.call_key, packed, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            scalars, scale, dropout, seed_value, None, *tensors,
        )  # fmt: skip
    else:
        out, lse = torch.ops.attncc.varlen_attention(
            kern.call_key, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            tensors, scalars, scale, dropout, seed_value, sink, descale.get("k_descale"), descale.get("v_descale"),
        )  # fmt: skip
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------- paged KV cache
def _checked_totals(
    table: torch.Tensor, lengths: torch.Tensor, appended: int, num_pages: int, page_size: int
) -> list[int]:
    """Each sequence's key count after the append, from the host copies of a block table and
    the cache lengths, checked: lengths within the table's pages, the pages they use within the
    cache (all sequences at once: a fixed number of tensor operations at any batch size)."""
    capacity = table.shape[1] * page_size
    totals = lengths + appended
    beyond = ((lengths < 0) | (totals > capacity)).nonzero()
    if beyond.numel():
        b = int(beyond[0, 0])
        raise InputError(
            f"cache_seqlens: sequence {b} holds {int(lengths[b])} keys{f' + {appended} appended' if appended else ''}, "
            f"beyond 0..{capacity} (block_table's {table.shape[1]} pages of {page_size})"
        )
    used = torch.arange(table.shape[1], device=table.device).view(1, -1) < (totals + page_size - 1).div(
        page_size, rounding_mode="floor"
    ).view(-1, 1)
    bad = (used & ((table < 0) | (table >= num_pages))).nonzero()
    if bad.numel():
        b, page = int(bad[0, 0]), int(bad[0, 1])
        raise InputError(
            f"block_table[{b}, {page}]: page {int(table[b, page])} is outside the cache's {num_pages} pages"
        )
    return totals.tolist()


def paged_totals(
    kern: Kernel,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    appended: int,
    runtime: Mapping[str, object],
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The block table and cache lengths on the host and each sequence's key count after the
    append, checked (lengths within the table, pages within the cache, the runtime inputs at the
    padded sizes); q is [B, H, N, D]. Data-dependent: the op's implementation runs it, and
    `paged_attention` before it where nothing is traced."""
    B, H, N, D = q.shape
    num_pages, page_size, Hkv, _ = k_cache.shape
    table = _host_ints("block_table", block_table, 2, "[B, max_pages]", q.device)
    lengths = _host_ints("cache_seqlens", cache_seqlens, 1, "[B]", q.device)
    if table.shape[0] != B or lengths.shape[0] != B:
        raise InputError(
            f"block_table, cache_seqlens: expected {B} sequences (q's batch), got {table.shape[0]} and {lengths.shape[0]}"
        )
    totals = _checked_totals(table, lengths, appended, num_pages, page_size)
    _validate_runtime(kern, q, (B, H, Hkv, N, table.shape[1] * page_size, D), runtime)
    return table, lengths, totals


@dataclass(frozen=True, eq=False)
class PagedPlan:
    """A paged batch's block table and cache lengths, read and checked on the host once for all
    the calls that share them (FlashInfer's plan/run: every layer of one decoding step): a
    call given `plan=` reads no tensor value on the host (on a GPU: no synchronisation, the
    host runs ahead of the kernels), and each kernel prepares its tile classes for the plan
    once. Made by `attncc.plan_paged`; valid while the table and lengths it was made from
    hold (a later step, with longer sequences, needs a new plan)."""

    num_pages: int
    page_size: int
    appended: int  # keys appended by each call (k_new's N_new)
    table: torch.Tensor  # int64 [B, max_pages], host
    lengths: torch.Tensor  # int64 [B] keys held before the append, host
    totals: tuple[int, ...]  # keys per sequence after the append
    device: torch.device  # the cache's
    keys: PagedKeys  # the table on the device, key counts and offsets, the kernels' prepared calls
    lengths_on_device: torch.Tensor  # int64 [B]
    append_rows: AppendRows | None
    key: str  # the op `attncc::paged_attention` finds the plan by it (`_PAGED_PLANS`)

    @property
    def batch(self) -> int:
        return self.table.shape[0]


def plan_paged(
    k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, new_tokens: int = 0
) -> PagedPlan:
    """The `PagedPlan` of a block table [B, max_pages] and cache lengths [B] over `k_cache`
    [num_pages, page_size, Hkv, D] (its shape and device; any cache of that shape can be
    given to the calls), for calls that append `new_tokens` keys per sequence (k_new's N_new)
    or none. The checks of `Kernel.paged`, once."""
    from attncc.runtime.kernel import PagedKeys

    k_cache = _tensor("k_cache", k_cache, 4, "[num_pages, page_size, Hkv, D]")
    num_pages, page_size = k_cache.shape[:2]
    if page_size == 0:
        raise InputError(f"k_cache: expected pages of at least one row, got shape {tuple(k_cache.shape)}")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 0:
        raise InputError(f"new_tokens: expected an int >= 0, got {new_tokens!r}")
    # copies, always (the caller may reuse its tensors for the next step's table): a CPU int64
    # table was the caller's own, so a page id written after the plan was read unchecked
    table = _host_ints("block_table", block_table, 2, "[B, max_pages]", k_cache.device).clone()
    lengths = _host_ints("cache_seqlens", cache_seqlens, 1, "[B]", k_cache.device).clone()
    if table.shape[0] != lengths.shape[0]:
        raise InputError(
            f"block_table, cache_seqlens: expected one sequence count, got {table.shape[0]} and {lengths.shape[0]}"
        )
    totals = _checked_totals(table, lengths, new_tokens, num_pages, page_size)
    device = k_cache.device
    append_rows = AppendRows.of(table, lengths, new_tokens, page_size, device) if new_tokens else None
    keys = PagedKeys.of(table, page_size, totals, device, prepared={})
    plan = PagedPlan(
        num_pages, page_size, new_tokens, table, lengths, tuple(totals), device, keys, lengths.to(device),
        append_rows, f"plan#{next(_PLAN_KEYS)}",
    )  # fmt: skip
    _PAGED_PLANS[plan.key] = plan
    return plan


#: Plans by key while their callers hold them.
_PAGED_PLANS: weakref.WeakValueDictionary[str, PagedPlan] = weakref.WeakValueDictionary()
_PLAN_KEYS = itertools.count()


def planned(key: str) -> PagedPlan | None:
    """The plan the op `attncc::paged_attention` was given by key ("" for none)."""
    return _PAGED_PLANS[key] if key else None


@dataclass(frozen=True)
class AppendRows:
    """Where a paged call's appended keys go, on the cache's device: pages and slots [B,
    appended] (torch's indexed writes: `append_to_caches`) and the same as cache rows
    page * page_size + slot, int64 [B * appended] in k_new's order (the CUDA library's
    `append_new_keys`)."""

    pages: torch.Tensor
    slots: torch.Tensor
    rows: torch.Tensor

    @staticmethod
    def of(
        table: torch.Tensor, lengths: torch.Tensor, appended: int, page_size: int, device: torch.device
    ) -> AppendRows:
        """Where keys cache_seqlens[b] .. + appended go."""
        positions = lengths.view(-1, 1) + torch.arange(appended, device=lengths.device).view(1, -1)
        pages, slots = table.gather(1, positions // page_size), positions % page_size
        return AppendRows(pages.to(device), slots.to(device), (pages * page_size + slots).view(-1).to(device))


#: A paged call's appended keys: where they go, k_new and v_new [B, appended, Hkv, D].
Appends = tuple[AppendRows, torch.Tensor, torch.Tensor]


def append_to_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, appends: Appends) -> None:
    """k_new and v_new written in place into the caches [num_pages, page_size, Hkv, D] by torch
    (the CUDA kernels write them in their library: `Kernel.appends_in_library`)."""
    where, k_new, v_new = appends
    k_cache[where.pages, where.slots] = k_new
    v_cache[where.pages, where.slots] = v_new


def paged_forward(
    kern: Kernel,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    options: CallOptions,
    tensors: list[torch.Tensor],
    sink: torch.Tensor | None,
    descale: Mapping[str, torch.Tensor] | None = None,
    plan: PagedPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out, lse [B, H, N, ...] of q [B, H, N, D] over the paged cache, k_new and v_new appended
    into it first (in place, as flash_attn_with_kvcache: rows cache_seqlens[b] .. + N_new).
    `descale`: an fp8 cache's factors [num_pages, page_size, Hkv, 1] (runtime/fp8.py). With
    `plan` (checked by `paged_attention` against this call), its table and lengths in place of
    block_table and cache_seqlens: nothing is read back from the device."""
    from attncc.runtime.kernel import PagedKeys, acc_dtype

    B, H, N, D = q.shape
    page_size = k_cache.shape[1]
    appended = 0 if k_new is None else k_new.shape[1]
    runtime = kern.runtime_values(tensors, options.scalars)
    if plan is None:
        table, lengths, totals = paged_totals(kern, q, k_cache, block_table, cache_seqlens, appended, runtime)
    else:
        table, lengths, totals = plan.table, plan.lengths, list(plan.totals)
        _validate_runtime(kern, q, (B, H, k_cache.shape[2], N, table.shape[1] * page_size, D), runtime)
    appends = None
    if appended:
        where = AppendRows.of(table, lengths, appended, page_size, k_cache.device) if plan is None else plan.append_rows
        appends = (where, k_new, v_new)
    if max(totals, default=0) > 0:  # (so with every append)
        # one launch reads every sequence's keys through the block table, each sequence to its
        # own key count (k_starts), the call's M the longest; the kernel appends first
        paged = PagedKeys.of(table, page_size, totals, q.device) if plan is None else plan.keys
        return kern.forward_impl(
            q, k_cache, v_cache, tensors, options.scalars, options.scale, 0.0, 0, sink=sink, descale=descale,
            paged=paged, appends=appends,
        )  # fmt: skip
    out = q.new_zeros((B, H, N, v_cache.shape[3]))  # no sequence has a key
    lse = torch.full((B, H, N), -math.inf, dtype=acc_dtype(q.dtype), device=q.device)
    if sink is not None:
        lse = torch.where(torch.isneginf(sink), lse, sink)  # the sink alone
    return out, lse


def _check_plan(
    plan: object, block_table: object, cache_seqlens: object, k_cache: torch.Tensor, batch: int, appended: int
) -> None:
    """A plan given to a paged call: made for this cache's shape and device, this batch and
    this many appended keys (by shapes alone: no value is read)."""
    if not isinstance(plan, PagedPlan):
        raise InputError(f"plan: expected an attncc.PagedPlan (attncc.plan_paged), got {type(plan).__name__}")
    if block_table is not None or cache_seqlens is not None:
        raise InputError("block_table, cache_seqlens: a call given a plan takes its table and lengths; give neither")
    made_for = (plan.num_pages, plan.page_size, plan.batch, plan.appended, plan.device)
    given = (k_cache.shape[0], k_cache.shape[1], batch, appended, k_cache.device)
    if made_for != given:
        raise InputError(
            "plan: made for (num_pages, page_size, batch, new_tokens, device) = "
            f"({', '.join(map(str, made_for))}), this call has ({', '.join(map(str, given))})"
        )


def planned_call_key(
    kern: Kernel,
    plan: object,
    q: object,
    k_cache: object,
    v_cache: object,
    block_table: object,
    cache_seqlens: object,
    k_new: object,
    v_new: object,
    layout: str,
    scale: object,
    runtime: Mapping[str, object],
    k_descale: object,
    v_descale: object,
) -> tuple | None:
    """What decides the checks of a call given a plan: the kernel, the operands' sizes, strides,
    dtypes and devices, the layout, the scale and the scalar inputs' values (the plan, whose
    memo holds the `CheckedPagedCall`, is the rest). None where a call takes the full path: no
    plan, a table or lengths beside it, runtime tensors, fp8 factors, anything but plain tensors
    (autograd, tracing, modes, torch.func transforms)."""
    from attncc.runtime.kernel import _is_compiling, _plain_untransformed

    if not isinstance(plan, PagedPlan) or block_table is not None or cache_seqlens is not None:
        return None  # (what is wrong with them: the full path says)
    if k_descale is not None or v_descale is not None or not all(type(x) in (int, float) for x in runtime.values()):
        return None
    operands = (q, k_cache, v_cache) if k_new is None and v_new is None else (q, k_cache, v_cache, k_new, v_new)
    if not all(type(t) is torch.Tensor for t in operands) or not (scale is None or type(scale) in (int, float)):
        return None
    if _is_compiling() or not _plain_untransformed(*operands):  # type: ignore[arg-type]
        return None
    described = tuple((t.shape, t.stride(), t.dtype, t.device) for t in operands)  # type: ignore[union-attr]
    return ("checked paged call", kern.call_key, layout, scale, tuple(runtime.items()), described)


@dataclass(frozen=True)
class CheckedPagedCall:
    """A call given a plan that passed every check, kept in the plan's memo under its
    `planned_call_key`: a call repeating it (the next layer of a decoding step) appends k_new
    and v_new and launches the forward the kernel kept for the plan (`Kernel.kept_launch`),
    with no check, plan lookup or packing (bench/bench_host.py)."""

    scale: float | None  # as checked
    scalars: list[float]
    #: the launch found for this call's key and the kernel's `launch_settings` then: a call
    #: under the same settings takes it without the kernel's lookup (the plan's memo keeps it)
    found: list[tuple[tuple, KeptLaunch]] = field(default_factory=list, compare=False)

    def __call__(
        self,
        kern: Kernel,
        plan: PagedPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_new: torch.Tensor | None,
        v_new: torch.Tensor | None,
        layout: str,
        return_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
        """The call's result, or None where the kernel kept no launch (the full path runs)."""
        launch = self.launch(kern, plan, q, k_cache, v_cache, layout)
        if launch is None:
            return None
        q_bhnd = q.transpose(1, 2) if layout == "bnhd" else q
        if plan.append_rows is None:
            out, lse = launch(q_bhnd, k_cache, v_cache)
        elif kern.appends_in_library:  # (rows as the library reads them: contiguous)
            out, lse = launch(q_bhnd, k_cache, v_cache, k_new.contiguous(), v_new.contiguous())  # type: ignore[union-attr]
        else:
            append_to_caches(k_cache, v_cache, (plan.append_rows, k_new, v_new))  # type: ignore[arg-type]
            out, lse = launch(q_bhnd, k_cache, v_cache)
        return _in_layout(out, lse, layout, return_lse)

    def launch(
        self, kern: Kernel, plan: PagedPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str
    ) -> KeptLaunch | None:
        """The forward launch `kern` kept in the plan's memo for this call's operands, if any."""
        settings = kern.launch_settings()
        if self.found and self.found[0][0] == settings:
            return self.found[0][1]
        q_bhnd = q.transpose(1, 2) if layout == "bnhd" else q
        launch = kern.kept_launch(q_bhnd, k_cache, v_cache, self.scalars, self.scale, plan.keys)
        if launch is not None:
            self.found[:] = [(settings, launch)]
        return launch


def paged_attention(
    kern: Kernel,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    *,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    layout: str,
    return_lse: bool,
    scale: float | None,
    runtime: Mapping[str, object],
    k_descale: object = None,
    v_descale: object = None,
    plan: PagedPlan | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`Kernel.paged`: attention of new queries over a paged KV cache (forward only), through
    the op `attncc::paged_attention` (so torch.compile(fullgraph=True) takes it whole); with
    `plan` (`plan_paged`), its checked table and lengths instead of block_table and
    cache_seqlens."""
    from attncc.runtime.kernel import _plain_call, acc_dtype

    if layout not in ("bnhd", "bhnd"):
        raise InputError(f"layout: expected 'bnhd' (q [B, N, H, D]) or 'bhnd' (q [B, H, N, D]), got {layout!r}")
    q = _tensor("q", q, 4, "[B, N, H, D]" if layout == "bnhd" else "[B, H, N, D]")
    q_bhnd = q.transpose(1, 2) if layout == "bnhd" else q
    B, H, N, D = q_bhnd.shape
    k_cache = _tensor("k_cache", k_cache, 4, "[num_pages, page_size, Hkv, D]")
    v_cache = _tensor("v_cache", v_cache, 4, "[num_pages, page_size, Hkv, Dv]")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise InputError(
            f"v_cache: expected shape [{', '.join(map(str, k_cache.shape[:3]))}, Dv] (that of k_cache but the head "
            f"dim), got {tuple(v_cache.shape)}"
        )
    _, page_size, Hkv, Dk = k_cache.shape
    Dv = v_cache.shape[3]
    if Dk != D:
        raise InputError(f"k_cache: expected head dim {D} (from q), got shape {tuple(k_cache.shape)}")
    _check_operands(q, (("k_cache", k_cache), ("v_cache", v_cache)), runtime)
    if page_size == 0:
        raise InputError(f"k_cache: expected pages of at least one row, got shape {tuple(k_cache.shape)}")
    appended = 0
    if (k_new is None) != (v_new is None):
        raise InputError("k_new, v_new: give both or neither")
    if k_new is not None:
        k_new = _tensor("k_new", k_new, 4, "[B, N_new, Hkv, D]")
        v_new = _tensor("v_new", v_new, 4, "[B, N_new, Hkv, Dv]")
        if k_new.shape[0] != B or tuple(k_new.shape[2:]) != (Hkv, D) or v_new.shape != (*k_new.shape[:3], Dv):
            raise InputError(
                f"k_new, v_new: expected [B={B}, N_new, Hkv={Hkv}, D={D}] and [B={B}, N_new, Hkv={Hkv}, Dv={Dv}], "
                f"got {tuple(k_new.shape)} and {tuple(v_new.shape)}"
            )
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if t.dtype != k_cache.dtype or t.device != q.device:
                raise InputError(
                    f"{name}: expected {k_cache.dtype} (as the cache) on {q.device}, got {t.dtype} on {t.device}"
                )
        appended = k_new.shape[1]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if k_new is not None and any(stride == 0 and size > 1 for size, stride in zip(cache.shape, cache.stride())):
            raise InputError(
                f"{name}: an expanded view (a stride of 0: strides {tuple(cache.stride())}) cannot take appended "
                "keys, its rows share memory; pass a cache of its own (.contiguous())"
            )
        if not torch.compiler.is_compiling() and cache.is_neg():  # (dynamo cannot trace is_neg)
            raise InputError(
                f"{name}: a negative-bit view (x.conj().imag, torch._neg_view) would be read and written in "
                "place as its stored values; pass a cache without the flag (.resolve_neg() copies it)"
            )
    operands = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache), *runtime.items()]
    # (a runtime tensor too: a sink requiring grad failed in torch's backward, "no autograd formula")
    tracked = [name for name, t in operands if isinstance(t, torch.Tensor) and t.requires_grad]
    if tracked and torch.is_grad_enabled():
        raise InputError(
            f"{', '.join(tracked)}: paged calls are forward only (inference), and this requires grad; run them "
            f"under torch.no_grad() or detach {tracked[0]}"
        )
    kern.check_input_names(runtime)
    if plan is not None:
        _check_plan(plan, block_table, cache_seqlens, k_cache, B, appended)
        block_table, cache_seqlens = plan.keys.table, plan.lengths_on_device
    elif block_table is None or cache_seqlens is None:
        raise InputError("block_table, cache_seqlens: give both, or a plan (attncc.plan_paged)")
    tensors: list[torch.Tensor] = [runtime[d.name] for d in kern.inputs if d.role == "tensor"]  # type: ignore[misc]
    # Without autograd, tracing or modes to see the op, its implementation runs directly (torch's
    # dispatch of an op that mutates its inputs costs ~100 us of host time per call), checking
    # the table before it appends; else the table is checked here first, where nothing is traced.
    plain = _plain_call(q, k_cache, v_cache, block_table, cache_seqlens, *tensors)
    if not values_unreadable(q):  # the table's values: only the op reads them otherwise
        if plan is None and not plain:
            paged_totals(kern, q_bhnd, k_cache, block_table, cache_seqlens, appended, runtime)
    scale = kern.call_scale(scale)
    scalars = [float(runtime[d.name]) for d in kern.inputs if d.role == "scalar"]  # type: ignore[arg-type]
    if kern.op.k_rope is not None:
        raise InputError(
            f"{kern.name}: paged calls read the cache's keys as they were written; rotate them before caching "
            "(as transformers does) and keep rope for q alone in the program"
        )
    sink = None
    if kern.op.sink is not None:  # [B, H, N]; M is each sequence's key count after the append
        with torch.no_grad():
            row_sizes: dict[str, int | torch.Tensor] = {"B": B, "H": H, "Hkv": Hkv, "N": N, "D": D}
            row_sizes["M"] = (cache_seqlens.to(torch.int64) + appended).view(-1, 1, 1)
            sink = kern.sink_rows(padded_rows(B, H, N, q.device), row_sizes, scale, runtime, acc_dtype(q.dtype))
            sink = sink.expand(B, H, N).contiguous()
    descale = kv_descales(k_cache, v_cache, k_descale, v_descale, "paged")
    if plain:
        out, lse = paged_forward(
            kern, q_bhnd, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new,
            CallOptions(scalars, scale, 0.0, 0), tensors, sink, descale, plan,
        )  # fmt: skip
    else:
        out, lse = torch.ops.attncc.paged_attention(
            kern.call_key, q_bhnd, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new,
            tensors, scalars, scale, sink, descale.get("k_descale"), descale.get("v_descale"),
            # (traced: the plan's table and lengths as tensors, the op reading them as an
            # unplanned call's; its key, a new constant per step, recompiled every step)
            "" if plan is None or torch.compiler.is_compiling() else plan.key,
        )  # fmt: skip
    return _in_layout(out, lse, layout, return_lse)


def _in_layout(
    out: torch.Tensor, lse: torch.Tensor, layout: str, return_lse: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A paged call's result: out and lse [B, H, N, ...] in the call's layout, lse if asked."""
    if layout == "bnhd":
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    return (out, lse) if return_lse else out
