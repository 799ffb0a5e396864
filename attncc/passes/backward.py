"""Backward derivation: the symbolic derivatives the backward kernels need."""

from __future__ import annotations

from dataclasses import dataclass, replace

from attncc.ir import expr as ex
from attncc.ir.graph import Graph, clone, fused_node, inputs


@dataclass(frozen=True)
class InputGradient:
    """d score / d tensor[index] for one read of a learnable float tensor.

    `per_tile`: the index depends only on b and h (and constants), so a kernel may sum the
    contribution over a tile and add it once.
    """

    read: ex.Read
    derivative: ex.Expr
    per_tile: bool


@dataclass(frozen=True)
class BackwardExprs:
    """dS0 = dS * dscore (chain rule through the score map), plus input gradients."""

    dscore: ex.Expr
    inputs: tuple[InputGradient, ...]
    #: Gradients through the softmax's sink (by row, computed by the runtime from O and lse:
    #: runtime/sinks.py): d sink[row] = -exp(sink - lse) * (rowsum(dO * O) - dlse), then
    #: d input[index] += d sink * derivative for each read of a float input in the sink.
    sink_inputs: tuple[InputGradient, ...] = ()
    has_sink: bool = False
    #: The operands rotated by rope ("q", "k"): the kernels' dQ and dK are those of the rotated
    #: rows, turned back by the transposed rotation R(-angle) (rotations are orthogonal).
    rotated: tuple[str, ...] = ()

    def describe(self) -> str:
        text = f"dS0 = dS * ({self.dscore})"
        for grad in self.inputs:
            text += f"; d{grad.read} += dS * ({grad.derivative})"
        if self.has_sink:
            text += "; dsink = -exp(sink - lse) * (rowsum(dO * O) - dlse)"
        for grad in self.sink_inputs:
            text += f"; d{grad.read} += dsink * ({grad.derivative})"
        for operand in self.rotated:
            text += f"; d{operand} = rope(d{operand}_rotated, -angle)"
        return text


def derive_backward(g: Graph) -> Graph:
    """Attach `BackwardExprs` to the fused node.

    With S0 = scale * q k^T and S = f(S0), softmax backward gives dS; the pass derives
    f'(S0) symbolically so that dS0 = dS * f'(S0), dq = scale * dS0 k, dk = scale * dS0^T q.
    For every read x[idx] of a float tensor input in f, it derives df/dx[idx], so the kernel
    accumulates dx[idx] += dS * df/dx[idx] (gradients of learnable biases, ALiBi slopes...).
    A softmax sink adds no term to dS (it has no value row; lse includes it, so the recomputed
    P is right); its own gradient is -exp(sink - lse) (rowsum(dO O) - dlse) per row, and the
    pass derives d sink / dx[idx] for the float inputs the sink reads. With rope, dq and dk of
    the rotated rows turn back by the rotation's transpose (the angle negated).
    Guarantees: derivatives are folded and reference only what f references.
    """
    g = clone(g)
    node, op = fused_node(g)
    declared = inputs(g)
    grads = []
    for r in ex.reads(op.score):
        if declared[r.tensor].dtype != "float":
            continue
        per_tile = all(ex.free_vars(i) <= {"b", "h", *ex.SIZE_VARS} and not ex.reads(i) for i in r.index)
        grads.append(InputGradient(r, ex.diff(op.score, r), per_tile))
    sink_grads = []
    for r in ex.reads(op.sink) if op.sink is not None else []:
        if declared[r.tensor].dtype == "float":
            sink_grads.append(InputGradient(r, ex.diff(op.sink, r), per_tile=False))
    rotated = tuple(r.operand for r in (op.q_rope, op.k_rope) if r is not None)
    exprs = BackwardExprs(ex.diff(op.score, ex.score()), tuple(grads), tuple(sink_grads), op.sink is not None, rotated)
    g.nodes[node]["op"] = replace(op, backward=exprs)
    return g
