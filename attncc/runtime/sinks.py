"""Attention sinks: `p = softmax(s, sink=expr)`, a logit per query row that joins the softmax's
denominator and has no value row (StreamingLLM, GPT-OSS).

The runtime evaluates the sink expression at every query row (`sink_logits`, differentiable
w.r.t. the inputs it reads) and hands the rows to the op. The CPU forward merges each row's
sink as it writes the row (templates/cpu: m' = max(m, sink), l' = l e^(m - m') + e^(sink - m'));
the CUDA kernels (and their emulator) merge it on the host: with L the kernel's log-sum-exp and
O its output, the sink softmax is exactly the kernel's result merged (`merge_states`, as for
split-KV) with a partial state of output 0 and log-sum-exp `sink`:

    lse' = log(exp(L) + exp(sink)),   O' = O exp(L - lse') = O sigmoid(L - sink).

The backward kernels take P = exp(S - lse') as the sink softmax's, and delta = rowsum(dO' O')
- dlse' as always; the CPU backward also reads the sink logits, for the lse residual of rows
whose lse' lost log l beside a huge row max (templates/cpu `lse_residuals`), and returns the
residuals after the inputs' gradients. The sink's own gradient is `sink_gradient`: its
probability is exp(sink - lse') (less the residual) and its value row 0, so d sink =
-exp(sink - lse') delta, and autograd carries it into the inputs the expression reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from attncc.ir import expr as ex
from attncc.runtime.reference import Value, evaluate


def sink_logits(
    sink: ex.Expr,
    rows: Mapping[str, Value],
    sizes: Mapping[str, Value],
    scale_value: Value,
    scalars: Mapping[str, Value],
    tensors: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
) -> torch.Tensor:
    """The sink expression at every query row: `rows` maps b, h, i to index tensors that
    broadcast to the rows' shape (sizes likewise, per sequence in packed and paged calls);
    differentiable w.r.t. the float tensors it reads."""
    env: dict[str, Value] = {**rows, **sizes, **scalars, "scale": scale_value}
    return evaluate(sink, env, tensors).to(dtype)


def sink_gradient(
    sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """d loss / d sink per row, from the sink softmax's lse and the backward's
    delta = rowsum(dO O) - dlse (`kernel.delta_rows`): the sink's probability is exp(sink - lse)
    and its "value" 0, so d sink = -exp(sink - lse) delta; 0 where the sink is -inf. `residual`:
    the CPU backward's lse residual per row (what lse lost of log l beside a huge row max),
    taken out after the difference, which is exact where sink and lse are close."""
    shift = sink - lse if residual is None else (sink - lse) - residual
    weight = torch.where(torch.isneginf(sink), 0.0, torch.exp(shift))
    return -(weight * delta)


def padded_rows(B: int, H: int, N: int, device: torch.device) -> dict[str, torch.Tensor]:
    """b, h, i of a padded call's rows [B, H, N]."""
    return {
        "b": torch.arange(B, device=device).view(-1, 1, 1),
        "h": torch.arange(H, device=device).view(1, -1, 1),
        "i": torch.arange(N, device=device).view(1, 1, -1),
    }
