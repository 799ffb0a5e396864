"""fp8 K and V with descale factors: the forward of a quantised KV cache.

k and v of torch.float8_e4m3fn or torch.float8_e5m2 (one of them for both) attend with q of
float32, bfloat16 or float16. The kernels widen each row of k and v to q's dtype, times its
descale factor, as they load it (include/attncc/fp8bits.h; templates/cpu `copied_rows`,
templates/cuda `load_fp8_rows`): attention is that of the dequantised operands

    k_deq = k.float() * k_descale[..., None],   v_deq = v.float() * v_descale[..., None],

rounded once to q's dtype (the CPU kernels' decoding path keeps them in fp32), and fp8 K/V
cross memory at one byte per element. A descale factor
is a number or a float tensor broadcastable to k's shape without its head dim: [B, Hkv, M] in
padded calls, [total_k, Hkv] in packed ones, [num_pages, page_size, Hkv] for a paged cache; so
a 0-d tensor is per tensor, [B, Hkv, 1] per (sequence, head) like FlashAttention 3's
[B, Hkv] (one more axis), and [B, Hkv, M] per (token, head). Forward only: the fp8 kernels have
no backward (q and learnable inputs get no gradient through them: an error says so).

fp8 products (CUDA sm89/sm90, opt-in: `kern.fp8_mma = True`): the fp8 tensor cores multiply
fp8 by fp8, so the forward rounds q (each row times the power of two that brings its largest
|q| closest to 448) and P (times 2^8) to e4m3 itself, multiplies the K and V bytes as stored,
and applies the descale factors to the fp32 scores (q's, k's) and the output (v's): the result
then differs from the dequantised operands' attention by about e4m3's precision (~3% rms of
the output on random inputs, against ~0.2% widened). A call takes them where
`EmulatedKernel.takes_fp8_products` says (v's factor one per kv head, K not rotated in the
kernel, head dim and key tiles in steps of 32); the others widen.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from attncc.errors import InputError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
#: q's dtypes an fp8 K/V call takes (the kernels widen K/V to q's dtype).
FP8_QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def library_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> str:
    """The name a kernel library is built under (codegen `split_dtype`): q's dtype, and with fp8
    K/V their dtype after a '+'."""
    name = str(q_dtype).removeprefix("torch.")
    return f"{name}+{str(kv_dtype).removeprefix('torch.')}" if kv_dtype in FP8_DTYPES else name


def check_operand_dtypes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runtime: Mapping[str, object], names: str = "q, k, v"
) -> None:
    """One dtype for q, k and v; or fp8 k and v: one fp8 dtype for both, q of a dtype they widen
    to, and no gradient asked for (of q or of a runtime tensor). `names`: the operands' names
    in the call (a paged call's "q, k_cache, v_cache")."""
    if not (is_fp8(k) or is_fp8(v)):
        if not (q.dtype == k.dtype == v.dtype):
            q_name, k_name, v_name = names.split(", ")
            raise InputError(
                f"{names} must have one dtype, got {q_name} {q.dtype}, {k_name} {k.dtype}, {v_name} {v.dtype}"
            )
        return
    learnable = [t for t in runtime.values() if isinstance(t, torch.Tensor)]
    if k.dtype != v.dtype:
        raise InputError(f"k, v: fp8 K/V take one dtype for both, got k {k.dtype} and v {v.dtype}")
    if q.dtype not in FP8_QUERY_DTYPES:
        raise InputError(f"q: with fp8 k and v, expected dtype float32, bfloat16 or float16, got {q.dtype}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, *learnable)):
        raise InputError(
            "k, v: fp8 K/V calls are forward only (the fp8 kernels have no backward), and q or a runtime "
            "tensor requires grad; run them under torch.no_grad() or detach"
        )


#: The factors' forms by the operand's layout (`descale_rows`' errors name them).
DESCALE_FORMS = {
    "padded": "per tensor [], per kv head [Hkv, 1], per sequence and kv head [B, Hkv, 1], per token [B, Hkv, M] "
    "or [B, Hkv, M, 1]",
    "packed": "per tensor [], per kv head [Hkv], per token [total_k, Hkv], [total_k, Hkv, 1] or [total_k, 1]",
    "paged": "per tensor [], per kv head [Hkv], per cache row [num_pages, page_size, Hkv], [num_pages, page_size, Hkv, "
    "1] or [num_pages, page_size, 1]",
}


def descale_rows(
    name: str, descale: object, rows: torch.Size, device: torch.device, layout: str = "padded"
) -> torch.Tensor:
    """`descale` (None: 1; a number; a float tensor broadcastable to `rows`, the operand's shape
    without its head dim) as float32 of shape (*rows, 1): the operand's shape with a head dim of
    1, so every layout's strides (packed, paged) apply to it as to the operand. A paged call's
    factors of two dims are refused: FlashAttention 3's per-sequence [B, Hkv] would broadcast
    as [page_size, Hkv], a factor per cache slot, silently (pages may be shared by sequences,
    so a sequence's factor has no place in the cache's rows)."""
    if descale is None:
        descale = 1.0
    if isinstance(descale, bool) or not isinstance(descale, (int, float, torch.Tensor)):
        raise InputError(f"{name}: expected a number or a float tensor, got {type(descale).__name__}")
    if not isinstance(descale, torch.Tensor):
        if not math.isfinite(descale):
            raise InputError(f"{name}: expected a finite number, got {descale!r}")
        return torch.full((), float(descale), dtype=torch.float32, device=device).expand(*rows, 1)
    if not descale.is_floating_point() or descale.dtype in FP8_DTYPES:
        raise InputError(f"{name}: expected a float32, bfloat16 or float16 tensor, got dtype {descale.dtype}")
    if descale.device != device:
        raise InputError(f"{name}: expected a tensor on {device} (that of q), got device {descale.device}")
    if descale.requires_grad and torch.is_grad_enabled():  # (it was detached: a learned scale got no gradient)
        raise InputError(
            f"{name}: the fp8 kernels are forward only, and this factor requires grad; detach it or run under "
            "torch.no_grad()"
        )
    given_dims = descale.dim()
    if given_dims == len(rows) + 1 and descale.shape[-1] == 1:  # (the operand's shape, head dim 1)
        descale = descale.squeeze(-1)
    try:
        shape = torch.broadcast_shapes(descale.shape, rows)
    except RuntimeError:
        shape = None
    # a padded call's factor of one or two dims ending in more than 1 would broadcast over the
    # keys: [Hkv] (packed and paged calls' per kv head) and FlashAttention 3's per-sequence
    # [B, Hkv] as a factor per token wherever M happened to equal Hkv, silently
    ambiguous = layout == "padded" and 0 < descale.dim() < 3 and descale.shape[-1] > 1
    # ... and [X, 1, 1] is per sequence against [B, Hkv, M] but per kv head against k itself
    # ([B, Hkv, M, D]): where B equals Hkv the two read the same factors differently
    per_head_or_sequence = layout == "padded" and descale.dim() == 3 and descale.shape[1:] == (1, 1)
    if per_head_or_sequence and descale.shape[0] > 1 and rows[0] == rows[1]:
        raise InputError(
            f"{name}: {list(descale.shape)} is a factor per sequence of [B, Hkv, M] and per kv head of k's "
            f"[B, Hkv, M, D], and B = Hkv = {rows[0]}: give k's dims, [B, 1, 1, 1] per sequence or [1, Hkv, 1, 1] "
            "per kv head"
        )
    # a padded call's per kv head [Hkv, 1] (or [1, Hkv, 1, 1]) is per token in a packed call
    # ([total_k, 1]) where total_k = Hkv, and per slot of every page in a paged one ([1,
    # page_size, 1]) where page_size = Hkv: taken so, silently (session 59)
    ends_in_one = descale.dim() == len(rows) and descale.shape[-1] == 1 and descale.shape[-2] > 1
    if ends_in_one and layout == "packed" and given_dims == 2 and rows[0] == rows[1]:
        raise InputError(
            f"{name}: {list(descale.shape)} is a factor per token ([total_k, 1]) of this packed call and, as padded "
            f"calls read it, per kv head ([Hkv, 1]), and total_k = Hkv = {rows[0]}: give [total_k, 1, 1] per token "
            "or [Hkv] per kv head"
        )
    if ends_in_one and layout == "paged" and descale.shape[0] == 1 and rows[1] == rows[2]:
        raise InputError(
            f"{name}: {list(descale.shape)} is a factor per slot of each page ([1, page_size, 1]) of this paged "
            f"call and, as padded calls read [1, Hkv, 1, 1], per kv head, and page_size = Hkv = {rows[1]}: give "
            "[Hkv] per kv head, or [num_pages, page_size, 1] per cache row"
        )
    if shape != rows or (layout == "paged" and descale.dim() == 2) or ambiguous:
        raise InputError(
            f"{name}: expected a shape broadcastable to {list(rows)} (the operand's without its head dim: "
            f"{DESCALE_FORMS[layout]}; FlashAttention 3's per sequence [B, Hkv] is [B, Hkv, 1] in padded calls, "
            f"has no place in a paged cache's rows), got {tuple(descale.shape)}"
        )
    # (a negative-bit view keeps its sign in a flag, which the kernels' pointer does not see)
    return descale.detach().resolve_neg().to(torch.float32).expand(rows).unsqueeze(-1)


def kv_descales(
    k: torch.Tensor, v: torch.Tensor, k_descale: object, v_descale: object, layout: str = "padded"
) -> dict[str, torch.Tensor]:
    """k's and v's descale factors as `descale_rows` gives them (`layout`: the operands', a key
    of DESCALE_FORMS), by their ABI names (`by_name`), or {} where k and v are not fp8 (then
    none may be given)."""
    if not is_fp8(k):
        for name, given in (("k_descale", k_descale), ("v_descale", v_descale)):
            if given is not None:
                raise InputError(f"{name}: descale factors go with fp8 k and v, got k of dtype {k.dtype}")
        return {}
    return by_name(
        descale_rows("k_descale", k_descale, k.shape[:-1], k.device, layout),
        descale_rows("v_descale", v_descale, v.shape[:-1], v.device, layout),
    )


def by_name(k_descale: torch.Tensor | None, v_descale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The factors as the kernels' ABI names them (the ops take them as two optional tensors)."""
    return {} if k_descale is None or v_descale is None else {"k_descale": k_descale, "v_descale": v_descale}


def dequantised(x: torch.Tensor, descale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 operand as the kernels read it (`descale` from `descale_rows`), in `dtype`; other
    operands as given."""
    if descale is None or not is_fp8(x):
        return x
    return (x.to(torch.float32) * descale).to(dtype)
