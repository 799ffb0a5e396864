"""torch.autocast for attention calls, as scaled_dot_product_attention has it.

Under `torch.autocast(device, dtype)` SDPA is a lower-precision op: its float operands run in
the autocast dtype, whatever mix of float32, float16 and bfloat16 they came in (a model whose
rotary embedding returns float32 q and k beside a bfloat16 v, as transformers' Llama does under
autocast, then attends in bfloat16). A kernel call does the same with q, k and v, then runs
with autocast off, so that none of its own torch operations (reference sums, gradients of
runtime inputs) is cast behind its back. float64 and fp8 operands stay as given, as autocast
leaves float64; runtime inputs keep their dtypes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: The operand dtypes autocast casts.
CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_dtype(
    q: object, any_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled
) -> torch.dtype | None:
    """The dtype autocast gives q, k and v here, or None where it is off for q's device (first
    asked of any device: 0.13 us, where q's device alone took 0.4 us of every call)."""
    if not any_enabled() or not isinstance(q, torch.Tensor) or not torch.is_autocast_enabled(q.device.type):
        return None
    return torch.get_autocast_dtype(q.device.type)


def cast_operands(dtype: torch.dtype, *tensors: object) -> tuple:
    """`tensors` of a castable dtype in `dtype` (differentiable: gradients flow back in theirs)."""
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in CASTABLE else t for t in tensors)
