"""`torch.nn.functional.scaled_dot_product_attention` on attncc kernels.

    from attncc.integrations.sdpa import scaled_dot_product_attention, patched
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, scale=None, enable_gqa=True)
    with patched():          # F.scaled_dot_product_attention is attncc's inside the block
        logits = model(ids)

take SDPA's arguments and run one DSL program per combination of options (compiled once per
process and target, cached on disk):

    s = q @ k.T * scale
    s = s + attn_bias[b, h, i, j]        # a float attn_mask (added)
    mask attn_mask[b, h, i, j]           # a bool attn_mask (True: takes part)
    mask j <= i                          # is_causal: top-left, as SDPA's tril(ones(L, S))
    p = dropout(softmax(s), dropout_p)   # applied whenever dropout_p > 0, as SDPA does (one
                                         # program for every rate: the kernels take it per call)

q [..., L, E], k [..., S, E], v [..., S, Ev]: the leading dims are (batch..., heads) (three-dim
inputs have one head), the same for q, k and v but the heads with `enable_gqa`; a mask
broadcastable to [..., L, S] is read through a stride-0 view (never copied to full size), and
a float mask that requires grad gets its gradient; rows that see no key give 0, as torch's
(2.13). With enable_gqa, k and v may have head counts of their own (each divides q's), as in
torch. Differences from torch, by design: what is not SDPA's (nested tensors: call the
kernel, which takes them) and a scale of inf or NaN (torch's NaN rows) are InputErrors
naming the argument.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from attncc.errors import InputError
from attncc.integrations.made import MadeKernels, masked_softmax_output
from attncc.runtime.kernel import drop_in_scale
from attncc.runtime.locks import module_lock


@dataclass(frozen=True)
class SdpaOptions:
    """What one call asks of its program."""

    causal: bool
    mask: str | None  # "bool" or "float"
    dropout: bool  # (its rate is the call's)
    mask_dims: tuple[str, ...] = ()  # the mask's dims among B, H, N, M that do not broadcast


#: A mask's dims in [B, H, L, S] order and the index each is read at.
MASK_DIMS = {"B": "b", "H": "h", "N": "i", "M": "j"}


def sdpa_program(options: SdpaOptions) -> str:
    """The DSL program for a call with these options (numbers formatted from validated values);
    the mask declared with its own dims (an [L, S] mask `attn_mask[i, j]`, a key padding mask
    [B, 1, 1, S] `attn_mask[b, j]`), so the kernels read and classify it as it is."""
    lines = ["attention sdpa"]
    name = {"bool": "attn_mask", "float": "attn_bias"}.get(options.mask or "")
    read = f"{name}[{', '.join(MASK_DIMS[d] for d in options.mask_dims)}]"
    if name:
        lines.append(f"input {name}: {options.mask}[{', '.join(options.mask_dims)}]")
    lines.append("s = q @ k.T * scale")
    if options.mask == "float":
        lines.append(f"s = s + {read}")
    # (a float mask's -inf entries as a mask too: tiles all -inf are skipped, not computed to 0;
    # NaN entries are not -inf: NaN rows, as torch gives, where `> -inf` dropped their keys)
    terms = [read if options.mask == "bool" else f"{read} != -inf"] if name else []
    terms += ["j <= i"] if options.causal else []
    return "\n".join(lines + masked_softmax_output(terms, options.dropout)) + "\n"


_kernel = MadeKernels(SdpaOptions, sdpa_program)


def _number(value: object) -> float | None:
    """A Python, numpy or 0-d torch number (not a bool, nor a tensor that requires grad) as a
    float, else None."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 and not value.requires_grad and not value.is_complex() else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return None


def _heads_alike(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, enable_gqa: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """key and value with one head count, the kernels' kv heads: with enable_gqa torch repeats
    each to the query's heads on its own, so a key and a value of different head counts that
    both divide the query's are repeated (each head in place) to their least common multiple,
    which maps query head h to the heads torch gives it. Anything else unchanged."""
    if not enable_gqa or min(t.dim() for t in (query, key, value)) < 3:
        return key, value
    heads, key_heads, value_heads = query.shape[-3], key.shape[-3], value.shape[-3]
    if key_heads == value_heads or 0 in (key_heads, value_heads) or heads % key_heads or heads % value_heads:
        return key, value
    common = math.lcm(key_heads, value_heads)
    return key.repeat_interleave(common // key_heads, -3), value.repeat_interleave(common // value_heads, -3)


def _as_four_dims(name: str, t: torch.Tensor) -> torch.Tensor:
    """`t` [..., rows, E] as [batch, heads, rows, E] (a view: the batch dims flattened; two-
    and three-dim inputs have one batch element and one head)."""
    if t.dim() < 4:
        return t.reshape(*(1,) * (4 - t.dim()), *t.shape)
    return t.reshape(-1, *t.shape[-3:]) if t.dim() > 4 else t


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention's call on attncc kernels (module
    docstring): out [..., L, Ev] in q's leading dims."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.is_nested:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) and not t.is_nested else type(t).__name__
            raise InputError(f"{name}: expected a dense tensor [..., rows, E] of 2 dims or more, got {shape}")
    key, value = _heads_alike(query, key, value, enable_gqa)
    # q, k and v broadcast over each other's leading dims as SDPA's products do (stride 0: no
    # copy). The heads, dim -3, of a k and v alike are the kernels' GQA groups where they differ
    # from q's (with enable_gqa, or one head: torch broadcasts it), not broadcast copies.
    grouped = (
        min(t.dim() for t in (query, key, value)) >= 3
        and key.shape[-3] == value.shape[-3] != query.shape[-3]
        and (enable_gqa or key.shape[-3] == 1)
    )
    kept = 3 if grouped else 2
    try:
        if not query.shape[:-kept] == key.shape[:-kept] == value.shape[:-kept]:  # (~20 us: not on every call)
            lead = torch.broadcast_shapes(*(t.shape[:-kept] for t in (query, key, value)))
            query, key, value = (t.expand(*lead, *t.shape[-kept:]) for t in (query, key, value))
    except RuntimeError:
        groups = (
            not enable_gqa
            and min(key.dim(), query.dim()) >= 3
            and key.shape[-3] > 0
            and query.shape[-3] % key.shape[-3] == 0
        )
        raise InputError(
            f"query, key, value: expected leading dims that broadcast, got query {tuple(query.shape[:-2])}, key "
            f"{tuple(key.shape[:-2])}, value {tuple(value.shape[:-2])}"
            + ("; pass enable_gqa=True where the query heads are groups of the key heads" if groups else "")
        ) from None
    q, k, v = (_as_four_dims(name, t) for name, t in (("query", query), ("key", key), ("value", value)))
    if k.shape[:2] != v.shape[:2] or q.shape[0] != k.shape[0] or key.shape[:-3] != value.shape[:-3]:
        raise InputError(
            f"key, value: expected the leading dims of query {tuple(query.shape[:-2])} (heads may differ with "
            f"enable_gqa), got key {tuple(key.shape[:-2])}, value {tuple(value.shape[:-2])}"
        )
    if (q.shape[1] == 0 or v.shape[3] == 0) and len({(t.dtype, t.device) for t in (q, k, v)}) == 1:
        # no heads, or v's head dim 0 (q's too or not: Dv = 0 was refused until session 67): an
        # empty output, as SDPA's, in the graph (its gradients zeros; a bare new_zeros had none,
        # and backward failed)
        return (query.sum() + key.sum() + value.sum()).mul(0).expand(*query.shape[:-1], value.shape[-1])
    # (a key and value of one head broadcast over the query heads, enable_gqa or not, as in torch)
    if q.shape[3] == 0:
        # q and k of head dim 0: every score 0 (+ the mask), as torch's: one zero column each,
        # the scale then 1/sqrt(1) as any other (q and k keep their empty gradients)
        q, k = F.pad(q, (0, 1)), F.pad(k, (0, 1))
    if q.shape[1] != k.shape[1] and k.shape[1] != 1 and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        raise InputError(
            f"key: {k.shape[1]} heads for query's {q.shape[1]}: "
            + (
                "with enable_gqa the query heads are groups of the key heads, a multiple of them"
                if enable_gqa
                else "pass enable_gqa=True where the query heads are groups of the key heads (a multiple)"
            )
        )
    if not isinstance(is_causal, bool):
        raise InputError(f"is_causal: expected a bool, got {is_causal!r}")
    given_dropout, dropout_p = dropout_p, _number(dropout_p)
    # (while torch.compile traces, the kernel's call_scale takes a scale as given, symbolic
    # after a recompile for a new value: math.isfinite here failed on it)
    scale = drop_in_scale(scale, "scale", "scaled_dot_product_attention")
    if dropout_p is None or not 0 <= dropout_p <= 1:
        raise InputError(f"dropout_p: expected a number in [0, 1], got {given_dropout!r}")
    inputs: dict[str, torch.Tensor] = {}
    kind = None
    if attn_mask is not None:
        if is_causal:
            raise InputError("attn_mask: given with is_causal=True (SDPA takes one or the other)")
        batch, heads, rows, cols = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        full = (*query.shape[:-1], key.shape[-2])
        if not isinstance(attn_mask, torch.Tensor) or attn_mask.is_floating_point() == (attn_mask.dtype == torch.bool):
            raise InputError(
                f"attn_mask: expected a bool or float tensor, got {getattr(attn_mask, 'dtype', attn_mask)!r}"
            )
        try:
            broadcast = attn_mask.expand(full)
        except RuntimeError:
            raise InputError(
                f"attn_mask: expected a shape broadcastable to {full} (query's without E, key's rows), got "
                f"{tuple(attn_mask.shape)}"
            ) from None
        kind = "bool" if attn_mask.dtype == torch.bool else "float"
        view = broadcast.reshape(batch, heads, rows, cols) if broadcast.dim() != 4 else broadcast
        # its dims that do not broadcast (stride 0) nor have one element: the kernels take
        # their tensors contiguous, an [L, S] mask as [B, H, L, S] was B x H copies. An exported
        # program takes masks of any strides (torch.export does not guard on them: one exported
        # with an expanded mask read mask[0, 0] of every later one), so there by sizes alone.
        by_strides = not torch.compiler.is_exporting()
        mask_dims = tuple(
            d
            for d, size, stride in zip(MASK_DIMS, view.shape, view.stride())
            if size == 0 or (size > 1 and (stride or not by_strides))
        )
        mask_dims = mask_dims or ("M",)
        inputs["attn_mask" if kind == "bool" else "attn_bias"] = view[
            tuple(slice(None) if d in mask_dims else 0 for d in MASK_DIMS)
        ]
    drawn = 0 < dropout_p < 1
    kern = _kernel(SdpaOptions(is_causal, kind, drawn, mask_dims if kind else ()), q.device)
    out = kern(q, k, v, scale=scale, dropout_p=float(dropout_p) if drawn else None, **inputs)
    if dropout_p == 1:  # every weight dropped: the attention times 0, as torch's (NaN where its rows are)
        out = out * 0
    return out.reshape(*query.shape[:-1], v.shape[-1])


#: Open `patched()` blocks (any thread) and torch's function they replaced.
_PATCHING: dict[str, Any] = {"open": 0, "torch": None}
_PATCH_LOCK = module_lock(__name__, "_PATCH_LOCK")


@contextmanager
def patched() -> Iterator[None]:
    """`torch.nn.functional.scaled_dot_product_attention` is attncc's inside the block (code
    that calls it through the module attribute, as `F.scaled_dot_product_attention(...)`; a name
    imported before, `from torch.nn.functional import scaled_dot_product_attention`, keeps
    torch's). The attribute is the process's: while any thread's block is open, every thread
    calls attncc's, and torch's is back when the last block closes (blocks that overlap across
    threads left attncc's in place when they closed out of order)."""
    functional = torch.nn.functional
    with _PATCH_LOCK:
        if _PATCHING["open"] == 0:
            _PATCHING["torch"] = functional.scaled_dot_product_attention
            functional.scaled_dot_product_attention = scaled_dot_product_attention
        _PATCHING["open"] += 1
    try:
        yield
    finally:
        with _PATCH_LOCK:
            _PATCHING["open"] -= 1
            if _PATCHING["open"] == 0:
                functional.scaled_dot_product_attention = _PATCHING["torch"]
