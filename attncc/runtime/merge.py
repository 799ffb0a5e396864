"""Merging partial attention results by their log-sum-exp.

Attention over a key set K split into disjoint parts K_1 .. K_S is exactly recovered from each
part's output O_s and log-sum-exp L_s:

    L = log sum_s exp(L_s),    O = sum_s exp(L_s - L) O_s

which is how split-KV decoding (the CUDA kernels' `combine_splits`), cascade / shared-prefix
attention and context parallelism combine their pieces. A part with no visible key has
L_s = -inf and O_s = 0 (what every attncc kernel returns for such a row) and weighs 0, whatever
its O_s holds (NaN from another producer); a row
with no visible key in any part gets L = -inf and O = 0.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from attncc.errors import InputError


def _stacked(parts: torch.Tensor | Sequence[torch.Tensor], name: str) -> torch.Tensor:
    if isinstance(parts, torch.Tensor) and parts.dim() > 0 and parts.shape[0] > 0:
        return parts
    if isinstance(parts, Iterable) and not isinstance(parts, torch.Tensor | Sequence):  # (a generator: read once)
        parts = list(parts)
    if not isinstance(parts, torch.Tensor | Sequence):
        raise InputError(f"{name}: expected a sequence of tensors or one stacked tensor, got {type(parts).__name__}")
    if isinstance(parts, torch.Tensor) or not parts:
        raise InputError(f"{name}: expected at least one partial result, got none")
    if not all(isinstance(t, torch.Tensor) for t in parts):
        raise InputError(f"{name}: expected tensors, got {[type(t).__name__ for t in parts]}")
    shapes = {tuple(t.shape) for t in parts}
    if len(shapes) != 1:
        raise InputError(f"{name}: the partial results differ in shape: {sorted(shapes)}")
    return torch.stack(list(parts))


def merge_states(
    outs: torch.Tensor | Sequence[torch.Tensor], lses: torch.Tensor | Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine S partial attention results over disjoint key sets into one.

    outs: S tensors [..., D] (a sequence, or one tensor [S, ..., D]); lses: S tensors [...]
    (the matching log-sum-exp, e.g. `kern(q, k_s, v_s, return_lse=True)[1]`). Returns
    (out [..., D] in the dtype of outs, lse [...] in float32, or float64 where either is).
    Differentiable in outs and lses; rows whose parts are all empty get zero gradients, not NaN.
    A program with a softmax sink counts the sink in every part's lse: merging such parts counts
    it S times. Compute the parts with the program without its sink and merge the sink once, as
    one more part: out 0, lse the sink's logit (what `context_parallel` does after its ring).
    """
    out_stack, lse_stack = _stacked(outs, "outs"), _stacked(lses, "lses")
    if lse_stack.shape[0] != out_stack.shape[0]:
        raise InputError(f"lses: expected one per partial result, {out_stack.shape[0]}, got {lse_stack.shape[0]}")
    if out_stack.dim() < 2 or lse_stack.shape != out_stack.shape[:-1]:
        raise InputError(
            f"lses: expected shape {tuple(out_stack.shape[:-1])} (outs' shape without the head dim), "
            f"got {tuple(lse_stack.shape)}"
        )
    if out_stack.device != lse_stack.device:
        raise InputError(f"lses: expected device {out_stack.device} (as outs), got {lse_stack.device}")
    if not all(t.is_floating_point() and t.element_size() > 1 for t in (out_stack, lse_stack)):
        raise InputError(
            f"outs, lses: expected float64, float32, bfloat16 or float16 tensors, got {out_stack.dtype} and "
            f"{lse_stack.dtype}"
        )
    acc = torch.promote_types(torch.float32, torch.promote_types(lse_stack.dtype, out_stack.dtype))
    lse_parts = lse_stack.to(acc)
    top = lse_parts.amax(dim=0)
    # all parts empty (top = -inf): shift by 0 so exp(-inf - 0) = 0 instead of exp(NaN); a
    # part of lse +inf (torch's logsumexp of a +inf score) outweighs every finite one: L = +inf,
    # O the mean of such parts' rows (exp(inf - inf) would be NaN)
    infinite = top == torch.inf
    shift = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    exponents = torch.where(infinite, 0, lse_parts - shift)  # (finite there: no NaN gradient through exp)
    weights = torch.where(infinite, (lse_parts == torch.inf).to(acc), torch.exp(exponents))
    total = weights.sum(dim=0)
    empty = total == 0
    safe_total = torch.where(empty, torch.ones_like(total), total)
    lse = torch.where(empty, torch.full_like(total, -torch.inf), shift + torch.log(safe_total))
    lse = torch.where(infinite, top, lse)
    # an empty part (lse -inf) adds nothing, whatever its rows hold (NaN from another producer);
    # one whose weight merely underflows keeps its rows' NaN (0 * NaN)
    parts = torch.where((lse_parts == -torch.inf).unsqueeze(-1), 0, out_stack.to(acc))
    out = ((weights / safe_total).unsqueeze(-1) * parts).sum(dim=0)
    return out.to(out_stack.dtype), lse
