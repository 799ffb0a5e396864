"""The eager reference: the fused IR node interpreted with torch ops in float64.

It materialises the N x M score matrix, so it is only for tests and `attncc check`; being
derived from the same IR node as the kernels, the two cannot drift. Autograd through it
gives the reference gradients for q, k, v and learnable inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch._subclasses.fake_tensor import FakeTensor

from attncc.errors import InputError
from attncc.ir import expr as ex
from attncc.ir.ops import FusedAttention
from attncc.runtime.philox import dropout_mask

Value = torch.Tensor | float | int | bool

_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or,
}  # fmt: skip
_UNARY = {"exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sqrt": torch.sqrt}
_ROUNDING = {"floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round}


def values_unreadable(t: torch.Tensor) -> bool:
    """Whether a tensor's values cannot be read on the host: torch.compile traces the call, or
    it is a fake tensor (FakeTensorMode's shape propagation) or a meta tensor (shapes alone).
    Only the ops read values then (their fake implementations, for meta tensors)."""
    return torch.compiler.is_compiling() or isinstance(t, FakeTensor) or t.is_meta


def _saturated_int64(rounded: torch.Tensor) -> torch.Tensor:
    """Integral float64 values as int64 the way expr.ROUNDING_OPS define it: saturated, NaN 0."""
    limit = 2.0**63
    inside = rounded.nan_to_num(0.0).clamp(-limit, limit - 1024.0).long()  # (2^63 - 1024: float64's last below 2^63)
    top = torch.full_like(inside, torch.iinfo(torch.int64).max)
    return torch.where(rounded >= limit, top, inside)


def _t(x: Value) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    dtype = torch.bool if isinstance(x, bool) else torch.int64 if isinstance(x, int) else torch.float64
    # (a 0-d host tensor, which broadcasts with tensors on any device; on torch's default device
    # a meta one made a constant sink or scale meta: the op ran its fake, unwritten, session 67)
    return torch.tensor(x, dtype=dtype, device="cpu")


def evaluate(
    e: ex.Expr, env: Mapping[str, Value], tensors: Mapping[str, torch.Tensor], *, checked: bool = False
) -> torch.Tensor:
    """Evaluate `e` elementwise with torch broadcasting (ints int64, floats float64).
    `checked`: the caller has proven every read in range and every integer divisor nonzero
    (passes/sparsity.py check_reads_and_divisors), so their checks here are skipped (~20 us of
    a decoding step's tile classes)."""

    def sub(x: ex.Expr) -> torch.Tensor:
        return evaluate(x, env, tensors, checked=checked)

    if isinstance(e, ex.Const):
        return _t(e.value)
    if isinstance(e, ex.Var):
        return _t(env[e.name])
    if isinstance(e, ex.Read):
        index = tuple(sub(i).long() for i in e.index)
        t = tensors[e.tensor]
        # (torch reads t[-1] as the last: a clear error instead; traced, fake and device calls meet
        # the op's own check of the same reads, passes/sparsity.py check_reads_and_divisors)
        for d, i in enumerate(() if values_unreadable(t) or checked else index):
            if i.device.type == "cpu" and i.numel() and (int(i.min()) < 0 or int(i.max()) >= t.shape[d]):
                raise InputError(
                    f"{ex.render(e)}: index {d} ({ex.render(e.index[d])}) ranges over [{int(i.min())}, "
                    f"{int(i.max())}], but {e.tensor} has size {t.shape[d]} in dimension {d}"
                )
        return t[index] != 0 if e.ty == ex.BOOL and t.dtype != torch.bool else t[index]
    if isinstance(e, ex.Unary):
        x = sub(e.x)
        if e.op == "neg":
            return -x
        if e.op == "not":
            return torch.logical_not(x)
        if e.op == "abs":
            return x.abs()
        if e.op in ex.ROUNDING_OPS:
            return _saturated_int64(_ROUNDING[e.op](x.double()))
        return _UNARY[e.op](x.double())
    if isinstance(e, ex.Binary):
        a, b = sub(e.a), sub(e.b)
        if e.op == "div":
            return a.double() / b.double()
        if e.op in ("floordiv", "mod"):
            a, b = _t(a), _t(b)
            if not b.is_floating_point():
                # An integer // or % by 0 has no value: torch raised a bare "ZeroDivisionError"
                # RuntimeError from a sink's or a scale's (host values). As the kernels' check
                # (passes/sparsity.py check_reads_and_divisors, which a device call meets before
                # its kernels run: no synchronisation here), at every position, whatever `where`
                # surrounds it: the vectorised kernels compute both branches.
                if (
                    not checked
                    and b.device.type == "cpu"
                    and not torch.compiler.is_compiling()
                    and bool((b == 0).any())
                ):
                    raise InputError(f"`{ex.render(e)}`: the divisor `{ex.render(e.b)}` is 0 at these sizes and inputs")
                b = torch.where(b == 0, 1, b)  # (a device's: refused by that check, not torch's garbage)
            return torch.div(a, b, rounding_mode="floor") if e.op == "floordiv" else torch.remainder(a, b)
        if e.op == "min":
            return torch.minimum(*torch.broadcast_tensors(*_promote(a, b)))
        if e.op == "max":
            return torch.maximum(*torch.broadcast_tensors(*_promote(a, b)))
        return _BINARY[e.op](a, b)
    if isinstance(e, ex.Where):
        c = sub(e.cond)
        a, b = _promote(sub(e.a), sub(e.b))
        return torch.where(c, a, b)
    raise TypeError(e)


def _promote(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = torch.promote_types(a.dtype, b.dtype)
    return a.to(dtype), b.to(dtype)


def index_env(B: int, H: int, N: int, M: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "b": torch.arange(B, device=device).view(-1, 1, 1, 1),
        "h": torch.arange(H, device=device).view(1, -1, 1, 1),
        "i": torch.arange(N, device=device).view(1, 1, -1, 1),
        "j": torch.arange(M, device=device).view(1, 1, 1, -1),
    }


def reference_attention(
    op: FusedAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_value: float,
    scalars: Mapping[str, float | int | bool],
    tensors: Mapping[str, torch.Tensor],
    seed: int = 0,
    offset: int = 0,
    dropout: float | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse), differentiable w.r.t. q, k, v and float tensors in `tensors`; `scale_value`
    is the value of the program's name `scale`.

    Computed in float64 by default; `dtype` = bfloat16/float16 gives the eager low-precision
    result that tests use as the yardstick for low-precision kernels' error.
    """
    B, H, N, D = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    if H != Hkv:
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    tensors = {n: (t.double() if t.is_floating_point() else t) for n, t in tensors.items()}
    env: dict[str, Value] = dict(index_env(B, H, N, M, q.device))
    env.update(B=B, H=H, Hkv=Hkv, N=N, M=M, D=D, scale=scale_value)
    env.update(scalars)
    env["s"] = evaluate(op.scale, env, tensors) * (q @ k.transpose(-1, -2))
    s = evaluate(op.score, env, tensors).to(dtype).expand(B, H, N, M)
    if op.mask is not None:
        visible = evaluate(op.mask, env, tensors).expand(B, H, N, M)
        s = s.masked_fill(~visible, -math.inf)
    logits = s
    if op.sink is not None:  # one more logit per row, with no value row
        logits = torch.cat([s, evaluate(op.sink, env, tensors).to(dtype).expand(B, H, N, 1)], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    # P by the row's max, not exp(s - lse): lse = m + log l cannot hold log l beside an |m| of
    # 1e30, and rows of equal huge scores gave each key P = 1 (their sum, not their mean).
    # (P does not depend on m: detached, it adds no gradient.)
    # (no keys, M = 0 and no sink: every row dead, as the kernels give it; amax refuses it)
    top = (
        logits.amax(dim=-1, keepdim=True).detach()
        if logits.shape[-1]
        else logits.new_full((*logits.shape[:-1], 1), -math.inf)
    )
    dead = torch.isneginf(top)
    weights = torch.exp(logits - torch.where(dead, 0.0, top))
    p = (weights / weights.sum(dim=-1, keepdim=True))[..., :M].masked_fill(dead, 0.0)
    p = p.to(dtype)
    rate = op.dropout if dropout is None else dropout
    if rate > 0:
        keep = dropout_mask(seed, offset, B, H, N, M, rate).to(q.device)
        p = p * keep / (1.0 - rate)
    return p @ v, lse
