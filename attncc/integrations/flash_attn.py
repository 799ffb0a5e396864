"""FlashAttention's Python API (`flash_attn` 2.x) on attncc kernels.

    from attncc.integrations.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

(and the packed forms `flash_attn_qkvpacked_func`, `flash_attn_kvpacked_func`,
`flash_attn_varlen_qkvpacked_func`, `flash_attn_varlen_kvpacked_func`)

take FlashAttention's arguments and layouts (q [B, N, H, D], k, v [B, M, Hkv, D]; packed
[total, H, D] with cu_seqlens; a KV cache [B, M_max, Hkv, D] or pages [num_pages, page_size,
Hkv, D] with a block table) and run them on attncc kernels made from the call's options, one
DSL program per combination (compiled once per process and target, cached on disk):

    s = q @ k.T * scale
    s = softcap * tanh(s / softcap)                       # softcap > 0
    s = s - alibi_slopes[h] * abs(i + M - N - j)          # alibi_slopes [H] (or [b, h] for [B, H])
    mask j <= i + M - N                                   # causal: bottom-right, as FlashAttention >= 2.1
    mask i + M - N - j <= window_left                     # window_size[0] >= 0
    mask j - (i + M - N) <= window_right                  # window_size[1] >= 0 (not causal)
    p = dropout(softmax(s), dropout_p)

FlashAttention's semantics, checked against float64 references written from its documentation
(`tests/test_flash_attn.py`). Differences, by design: rows that see no key return lse -inf
(FlashAttention's kernels return +inf there), the attention probabilities of
`return_attn_probs` are None, `deterministic` and `num_splits` are accepted and ignored, and
what attncc cannot do here is an InputError naming the argument: `rotary_cos` / `rotary_sin`
(rotate q and k before the call, or write `rope(...)` in a program), `cache_leftpad`, a
`block_table` in the varlen call. Gradients flow through `flash_attn_func` and
`flash_attn_varlen_func` (q, k, v and `alibi_slopes`); `flash_attn_with_kvcache` is forward
only, as FlashAttention's.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

from attncc.errors import InputError
from attncc.integrations.made import MadeKernels, masked_softmax_output
from attncc.ir.expr import python_number
from attncc.runtime.kernel import drop_in_scale
from attncc.runtime.reference import values_unreadable


@dataclass(frozen=True)
class CallOptions:
    """What one call asks of its program."""

    causal: bool
    window_left: bool
    window_right: bool
    softcap: bool
    alibi: str | None  # the slopes' dims: "H" or "B, H"
    dropout: bool  # (its rate is the call's `dropout_p`)


def flash_program(options: CallOptions) -> str:
    """The DSL program for a call with these options (numbers formatted here from validated
    Python values; the parser checks the text like any program)."""
    lines = ["attention flash_attn"]
    if options.window_left:
        lines.append("input window_left: int")
    if options.window_right:
        lines.append("input window_right: int")
    if options.softcap:
        lines.append("input softcap: float")
    if options.alibi:
        lines.append(f"input alibi_slopes: float[{options.alibi}]")
    lines.append("s = q @ k.T * scale")
    if options.softcap:
        lines.append("s = softcap * tanh(s / softcap)")
    if options.alibi:
        slope = "alibi_slopes[h]" if options.alibi == "H" else "alibi_slopes[b, h]"
        lines.append(f"s = s - {slope} * abs(i + M - N - j)")  # (query i is key column i + M - N)
    terms = ["j <= i + M - N"] if options.causal else []
    if options.window_left:
        terms.append("i + M - N - j <= window_left")
    if options.window_right:
        terms.append("j - (i + M - N) <= window_right")
    return "\n".join(lines + masked_softmax_output(terms, options.dropout)) + "\n"


_kernel = MadeKernels(CallOptions, flash_program)


#: Window sizes at or past this many keys are unbounded (-1): no sequence is that long, and the
#: kernels' integer inputs are exact up to 2^53.
UNBOUNDED_WINDOW = 2**40


def _integer(value: object) -> int | None:
    """An int (numpy's, a 0-d integer tensor's too; not a bool), or None (a one-element tensor
    of one dim too: cache_seqlens [1] for a batch of 2 was read as every sequence's length)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        return None
    if torch.compiler.is_compiling() and isinstance(value, int):  # (traced: operator.index guarded on its value)
        return value
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _checked_window(window_size: object) -> tuple[int, int]:
    sizes = [_integer(w) for w in window_size] if isinstance(window_size, (tuple, list)) else []
    if len(sizes) != 2 or any(w is None or w < -1 for w in sizes):
        raise InputError(f"window_size: expected (left, right), two ints >= -1 (-1: unbounded), got {window_size!r}")
    return tuple(-1 if w >= UNBOUNDED_WINDOW else w for w in sizes)  # type: ignore[return-value]


def _options_and_inputs(
    q: torch.Tensor,
    batch: int,
    heads: int,
    dropout_p: object,
    causal: object,
    window_size: object,
    softcap: object,
    alibi_slopes: object,
) -> tuple[CallOptions, dict[str, object]]:
    """The call's options and the keyword arguments they take (runtime inputs, and `dropout_p`:
    the kernels take the rate at run time, so the program says only that dropout is drawn),
    checked (each error names its argument)."""
    if causal not in (True, False) or isinstance(causal, float):  # (numpy's bools and 0 / 1 too)
        raise InputError(f"causal: expected a bool, got {causal!r}")
    causal = bool(causal)
    left, right = _checked_window(window_size)
    dropout_p, softcap = python_number(dropout_p), python_number(softcap)  # (numpy's float32 too)
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0 <= dropout_p < 1:
        raise InputError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
    if (
        not isinstance(softcap, (int, float))
        or isinstance(softcap, bool)
        or not 0 <= softcap < math.inf  # (comparisons: dynamo traces no math.isfinite of a traced number)
    ):
        raise InputError(f"softcap: expected a finite number >= 0 (0: none), got {softcap!r}")
    inputs: dict[str, object] = {}
    alibi = None
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor) or tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            shape = tuple(alibi_slopes.shape) if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__
            raise InputError(
                f"alibi_slopes: expected a float tensor [H={heads}] or [B={batch}, H={heads}], got {shape}"
            )
        if not alibi_slopes.is_floating_point() or alibi_slopes.device != q.device:
            raise InputError(
                f"alibi_slopes: expected a float tensor on {q.device} (as q), got {alibi_slopes.dtype} on "
                f"{alibi_slopes.device}"
            )
        alibi = "H" if alibi_slopes.dim() == 1 else "B, H"
        inputs["alibi_slopes"] = alibi_slopes
    if left >= 0:
        inputs["window_left"] = left
    if right >= 0 and not causal:
        inputs["window_right"] = right
    if softcap > 0:
        inputs["softcap"] = float(softcap)
    if dropout_p > 0:
        inputs["dropout_p"] = float(dropout_p)
    options = CallOptions(causal, left >= 0, right >= 0 and not causal, softcap > 0, alibi, dropout_p > 0)
    return options, inputs


def _checked_operands(names: tuple[str, ...], tensors: tuple[object, ...], dims: int, layout: str) -> None:
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"{name}: expected a {dims}-d tensor {layout}, got {shape}")


def _checked_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_layout: str, kv_layout: str, leading: int
) -> None:
    """q, k and v agree as FlashAttention's layouts say (errors in them, not in the kernels' [B, H,
    N, D]): k and v the same rows and heads, q's batch (padded) and head dim k's, its heads a
    multiple of theirs."""
    kv_rows = k.shape[:leading]
    if v.shape[: leading + 1] != k.shape[: leading + 1] or q.shape[: leading - 1] != k.shape[: leading - 1]:
        raise InputError(
            f"k, v: expected {kv_layout} with the same leading sizes, and q {q_layout} of the same batch; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1] or q.shape[-2] % max(k.shape[-2], 1):
        raise InputError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}: expected the same head dim and q's heads a multiple of k's "
            f"(rows {tuple(kv_rows)})"
        )
    if k.shape[-2] == 0:
        raise InputError(f"k: expected at least one key/value head, got {tuple(k.shape)} ({kv_layout})")


def _unpacked(name: str, packed: torch.Tensor, dim: int, count: int, layout: str) -> tuple[torch.Tensor, ...]:
    """The `count` tensors stacked along `dim` of `packed` (qkv's 3, kv's 2)."""
    if packed.shape[dim] != count:
        raise InputError(f"{name}: expected {layout} ({count} stacked at dim {dim}), got {tuple(packed.shape)}")
    return packed.unbind(dim)


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """FlashAttention's `flash_attn_func`: q [B, N, H, D], k [B, M, Hkv, D], v [B, M, Hkv, Dv]
    (H a multiple of Hkv); out [B, N, H, Dv], with `return_attn_probs` (out, softmax_lse
    [B, H, N] float32, None). Dropout applies wherever dropout_p > 0 (pass 0 to evaluate)."""
    _checked_operands(("q", "k", "v"), (q, k, v), 4, "[B, N, H, D] / [B, M, Hkv, D]")
    _checked_heads(q, k, v, "[B, N, H, D]", "[B, M, Hkv, D]", leading=2)
    options, inputs = _options_and_inputs(
        q, q.shape[0], q.shape[2], dropout_p, causal, window_size, softcap, alibi_slopes
    )
    kern = _kernel(options, q.device)
    out, lse = kern(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), return_lse=True, scale=drop_in_scale(softmax_scale, "softmax_scale", "flash_attn"), **inputs
    )  # fmt: skip
    out = out.transpose(1, 2).contiguous()
    return (out, lse, None) if return_attn_probs else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:
    """FlashAttention's `flash_attn_varlen_func`: q [total_q, H, D], k [total_k, Hkv, D],
    v [total_k, Hkv, Dv], sequence b at rows cu_seqlens[b] .. cu_seqlens[b + 1]; out
    [total_q, H, Dv], with `return_attn_probs` (out, softmax_lse [H, total_q] float32, None).
    Each sequence's causal mask is bottom-right in its own lengths. Rows past the last offset
    (a buffer padded to a fixed size, as servers keep for CUDA graphs) belong to no sequence,
    as in FlashAttention: their out is 0 and their lse -inf (FlashAttention leaves them unset)."""
    if block_table is not None:
        raise InputError(
            "block_table: a paged cache in the varlen call has no attncc mapping; use flash_attn_with_kvcache "
            "(or a kernel's .paged) for paged K/V"
        )
    _checked_operands(("q", "k", "v"), (q, k, v), 3, "[total, heads, D]")
    _checked_heads(q, k, v, "[total_q, H, D]", "[total_k, Hkv, D]", leading=1)
    if not isinstance(cu_seqlens_q, torch.Tensor) or cu_seqlens_q.dim() != 1:
        raise InputError(f"cu_seqlens_q: expected a 1-d int tensor [B + 1], got {cu_seqlens_q!r}")
    batch = cu_seqlens_q.shape[0] - 1
    options, inputs = _options_and_inputs(q, batch, q.shape[1], dropout_p, causal, window_size, softcap, alibi_slopes)
    kern = _kernel(options, q.device)
    rows_q = q.shape[0]
    scale = drop_in_scale(softmax_scale, "softmax_scale", "flash_attn")
    if values_unreadable(cu_seqlens_q) and _offsets(cu_seqlens_q) and _offsets(cu_seqlens_k):
        # traced, the last offsets cannot be read (a guard on their values: no single graph):
        # rows past them are one more sequence, attended within itself, whose rows are then
        # given out 0 and lse -inf (a padded buffer was refused under torch.compile)
        cu_q, cu_k = (
            torch.cat([cu, cu.new_full((1,), rows.shape[0])]) for cu, rows in ((cu_seqlens_q, q), (cu_seqlens_k, k))
        )
        if options.alibi == "B, H":
            inputs["alibi_slopes"] = torch.cat([alibi_slopes, alibi_slopes.new_zeros(1, alibi_slopes.shape[1])])  # type: ignore[union-attr]
        out, lse = kern.varlen(q, k, v, cu_q, cu_k, return_lse=True, scale=scale, **inputs)
        held = torch.arange(rows_q, device=q.device) < cu_seqlens_q[-1]
        out = torch.where(held[:, None, None], out, 0.0)
        lse = torch.where(held[:, None], lse, -math.inf)
        return (out, lse.t().contiguous(), None) if return_attn_probs else out
    # (rows past each last offset belong to no sequence: their keys are read by none)
    used_q, used_k = _rows_in_use("cu_seqlens_q", q, cu_seqlens_q), _rows_in_use("cu_seqlens_k", k, cu_seqlens_k)
    q, k, v = q[:used_q], k[:used_k], v[:used_k]
    out, lse = kern.varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse=True, scale=scale, **inputs
    )  # fmt: skip
    if out.shape[0] < rows_q:  # (differentiable: the rows of no sequence get no gradient)
        out = torch.cat([out, out.new_zeros(rows_q - out.shape[0], *out.shape[1:])])
        if return_attn_probs:
            lse = torch.cat([lse, lse.new_full((rows_q - lse.shape[0], *lse.shape[1:]), -math.inf)])
    return (out, lse.t().contiguous(), None) if return_attn_probs else out


def _offsets(cu_seqlens: object) -> bool:
    """Whether `cu_seqlens` is a 1-d int tensor of one offset or more (else the varlen call
    names what it is)."""
    if not (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.numel()):
        return False
    return not (cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool)


def _rows_in_use(name: str, rows: torch.Tensor, cu_seqlens: object) -> int:
    """How many of `rows` [total, heads, D] the sequences hold: cu_seqlens' last offset, at
    most their count (rows past it belong to no sequence), else all (the varlen call checks the
    offsets: anything else goes to it as given, and is named there)."""
    if not _offsets(cu_seqlens):
        return rows.shape[0]
    last = int(cu_seqlens[-1])  # type: ignore[index]  # (read once for k and v alike: a synchronisation on a GPU)
    if last > rows.shape[0]:
        what = "q" if name == "cu_seqlens_q" else "k"
        raise InputError(
            f"{name}: the last offset {last} is beyond {what}'s {rows.shape[0]} rows (expected at most them)"
        )
    return last if 0 <= last else rows.shape[0]


def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's `flash_attn_with_kvcache` (forward only): q [B, N, H, D] against a cache
    k_cache [B_cache, M_max, Hkv, D] (rows of sequence b at cache_batch_idx[b], default b) or,
    with block_table [B, max_pages], pages [num_pages, page_size, Hkv, D]; cache_seqlens (an int
    or int [B]; default: the whole cache) keys held per sequence. New k, v [B, N_new, Hkv, D],
    if given, are written into the cache at cache_seqlens first (in place) and attended. Returns
    out [B, N, H, Dv] (and softmax_lse [B, H, N] with return_softmax_lse)."""
    for name, given in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_leftpad", cache_leftpad)):
        if given is not None:
            what = (
                "rotate q and k before the call, or write `q = rope(q, ...)` / `k = rope(k, ...)` in a program"
                if name != "cache_leftpad"
                else "left padding inside the cache"
            )
            raise InputError(f"{name}: has no attncc mapping here ({what})")
    _checked_operands(("q", "k_cache", "v_cache"), (q, k_cache, v_cache), 4, "[B, N, H, D] / cache rows")
    if k_cache.shape[2] == 0:
        raise InputError(
            f"k_cache: expected at least one key/value head, got {tuple(k_cache.shape)} ([B_cache, M_max, Hkv, D], "
            "or pages [num_pages, page_size, Hkv, D])"
        )
    batch = q.shape[0]
    contiguous = block_table is None
    if block_table is None:
        # a contiguous cache is pages of M_max rows, sequence b's one page at cache_batch_idx[b]
        if cache_batch_idx is None:
            rows = torch.arange(batch, device=k_cache.device)
        elif (
            not isinstance(cache_batch_idx, torch.Tensor)
            or tuple(cache_batch_idx.shape) != (batch,)
            or cache_batch_idx.is_floating_point()
            or cache_batch_idx.dtype == torch.bool
        ):
            raise InputError(f"cache_batch_idx: expected an int tensor [B={batch}], got {cache_batch_idx!r}")
        elif cache_batch_idx.device != q.device:
            raise InputError(f"cache_batch_idx: expected device {q.device} (that of q), got {cache_batch_idx.device}")
        else:
            rows = cache_batch_idx
        # (traced: the paged op checks the rows as block-table entries when it runs; a read here
        # was a data-dependent guard, no single graph under torch.compile nor an export)
        if batch and not values_unreadable(rows) and not 0 <= int(rows.min()) <= int(rows.max()) < k_cache.shape[0]:
            raise InputError(
                f"cache_batch_idx: rows {rows.tolist()} of a cache of {k_cache.shape[0]} sequences [B_cache, M_max, "
                f"Hkv, D]" + ("" if cache_batch_idx is not None else f": {batch} queries' sequences for it")
            )
        block_table = rows.view(batch, 1).to(torch.int32)
    elif cache_batch_idx is not None:
        raise InputError("cache_batch_idx: goes with a contiguous cache, not with block_table")
    if (k is None) != (v is None):  # (the paged call's error would name its k_new, v_new)
        raise InputError("k, v: give both new keys and values to append, or neither")
    if cache_seqlens is None:  # (the whole cache: every page of the table full)
        if k is not None:
            raise InputError("cache_seqlens: needed to append k and v (they are written at cache_seqlens[b])")
        cache_seqlens = block_table.shape[1] * k_cache.shape[1]
    if _integer(cache_seqlens) is not None:
        cache_seqlens = torch.full((batch,), _integer(cache_seqlens), dtype=torch.int32, device=k_cache.device)
    # (a contiguous cache's lengths checked in its own terms: the paged call's errors would speak
    # of the one-page-per-sequence block_table made above, which the caller never passed)
    if contiguous and isinstance(cache_seqlens, torch.Tensor) and tuple(cache_seqlens.shape) != (batch,):
        raise InputError(
            f"cache_seqlens: expected an int tensor [B={batch}] (q's batch) or an int, got shape "
            f"{tuple(cache_seqlens.shape)}"
        )
    if contiguous and isinstance(cache_seqlens, torch.Tensor) and batch and not values_unreadable(cache_seqlens):
        appended = 0 if k is None else k.shape[1]
        least, held = (int(x) for x in torch.aminmax(cache_seqlens))  # (one reduction)
        if least < 0:
            raise InputError(f"cache_seqlens: a sequence holds {least} keys, expected 0 or more")
        if held + appended > k_cache.shape[1]:
            raise InputError(
                f"cache_seqlens: a sequence holds {held} keys{f' + {appended} appended' if appended else ''}, beyond the "
                f"cache's {k_cache.shape[1]} rows per sequence (k_cache [B_cache, M_max, Hkv, D])"
            )
    options, inputs = _options_and_inputs(q, batch, q.shape[2], 0.0, causal, window_size, softcap, alibi_slopes)
    kern = _kernel(options, q.device)
    with torch.no_grad():  # (forward only, as FlashAttention's: no graph, whatever requires grad)
        out, lse = kern.paged(
            q, k_cache, v_cache, block_table, cache_seqlens, k_new=k, v_new=v, return_lse=True, scale=drop_in_scale(softmax_scale, "softmax_scale", "flash_attn"),
            **inputs,
        )  # fmt: skip
    return (out, lse.transpose(1, 2)) if return_softmax_lse else out


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False, return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:  # fmt: skip
    """`flash_attn_func` of qkv [B, N, 3, H, D] (q, k and v stacked; gradients flow back into it)."""
    _checked_operands(("qkv",), (qkv,), 5, "[B, N, 3, H, D]")
    q, k, v = _unpacked("qkv", qkv, 2, 3, "[B, N, 3, H, D]")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor, kv: torch.Tensor, dropout_p: float = 0.0, softmax_scale: float | None = None,
    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False, return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:  # fmt: skip
    """`flash_attn_func` of q [B, N, H, D] and kv [B, M, 2, Hkv, D]."""
    _checked_operands(("kv",), (kv,), 5, "[B, M, 2, Hkv, D]")
    k, v = _unpacked("kv", kv, 2, 2, "[B, M, 2, Hkv, D]")
    return flash_attn_func(
        q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    )  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None = None, dropout_p: float = 0.0,
    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:  # fmt: skip
    """`flash_attn_varlen_func` of qkv [total, 3, H, D], one cu_seqlens for queries and keys."""
    _checked_operands(("qkv",), (qkv,), 4, "[total, 3, H, D]")
    q, k, v = _unpacked("qkv", qkv, 1, 3, "[total, 3, H, D]")
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal, window_size,
        softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor, kv: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, dropout_p: float = 0.0,
    softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
    return_attn_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, None]:  # fmt: skip
    """`flash_attn_varlen_func` of q [total_q, H, D] and kv [total_k, 2, Hkv, D]."""
    _checked_operands(("kv",), (kv,), 4, "[total_k, 2, Hkv, D]")
    k, v = _unpacked("kv", kv, 1, 2, "[total_k, 2, Hkv, D]")
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip
