"""Fusion of the attention chain into one kernel node."""

from __future__ import annotations

import networkx as nx

from attncc.errors import DslError
from attncc.ir import expr as ex
from attncc.ir.graph import Graph, add_op, clone, nodes_of, op_of, operands
from attncc.ir.ops import (
    Dropout,
    FusedAttention,
    Input,
    Layout,
    Mask,
    Output,
    Rope,
    ScoreMap,
    ScoreMatmul,
    Softmax,
    ValueMatmul,
)

CHAIN = "q @ k.T -> score maps -> masks/layouts -> softmax -> dropout -> @ v -> output"


def fuse_attention(g: Graph) -> Graph:
    """Replace matmul -> map -> mask* -> softmax -> dropout? -> matmul by one FusedAttention.

    Requires a canonical graph. Guarantees afterwards: the graph is exactly the inputs, one
    `FusedAttention` with operands (q, k, v) and edges from every runtime input it reads (the
    softmax's sink included), and the output. Anything that does not fit the chain is a DslError at the statement that
    breaks it.
    """
    g = clone(g)
    (out,) = nodes_of(g, Output)
    (pv,) = operands(g, out)
    pv_op = op_of(g, pv)
    if not isinstance(pv_op, ValueMatmul):
        _fail(g, pv, "the output must be `p @ v`")
    probs, v = operands(g, pv)
    dropout = 0.0
    if isinstance(op_of(g, probs), Dropout):
        dropout = op_of(g, probs).p  # type: ignore[attr-defined]
        chain = [probs]
        (probs,) = operands(g, probs)
    else:
        chain = []
    if isinstance(op_of(g, probs), Dropout):
        _fail(g, probs, "only one dropout is supported; combine the rates into one")
    if not isinstance(op_of(g, probs), Softmax):
        _fail(g, probs, "`@ v` must consume softmax probabilities (optionally after dropout)")
    chain.append(probs)
    sink = op_of(g, probs).sink  # type: ignore[attr-defined]
    (node,) = operands(g, probs)
    mask_terms: list[ex.Expr] = []
    layouts: list[Layout] = []
    score = ex.score()
    while not isinstance(op_of(g, node), ScoreMatmul):
        op = op_of(g, node)
        chain.append(node)
        if isinstance(op, Mask):
            mask_terms.insert(0, op.predicate)
        elif isinstance(op, Layout):
            layouts.insert(0, op)
        elif isinstance(op, ScoreMap):
            score = op.expr
        else:
            _fail(g, node, f"cannot fuse `{op.describe()}` into attention ({CHAIN})")
        (node,) = operands(g, node)
    matmul = op_of(g, node)
    assert isinstance(matmul, ScoreMatmul)
    chain += [node, pv, out]
    q, k = operands(g, node)
    ropes: dict[str, Rope] = {}
    for operand in (q, k):  # rope(q), rope(k): row rotations folded in as the kernel's loads
        rope = op_of(g, operand)
        if isinstance(rope, Rope):
            ropes[rope.operand] = rope
            chain.insert(-3, operand)
    q, k = (operands(g, n)[0] if isinstance(op_of(g, n), Rope) else n for n in (q, k))
    for n in chain[:-1]:
        users = list(g.successors(n))
        if len(users) != 1:
            dead = [u for u in users if u not in chain and not set(nx.descendants(g, u)) & set(chain)]
            if dead:  # (`t = s * 2` left over: "used only once" pointed at the chain's next step)
                _fail(g, dead[0], "the result of this statement is never used (the output does not depend on it)")
            _fail(g, users[-1], "each intermediate of the attention chain can be used only once")
    stray = [n for n in g.nodes if n not in chain and not isinstance(op_of(g, n), Input)]
    if stray:
        _fail(g, stray[0], f"this statement is not part of the attention chain ({CHAIN})")

    mask = None
    for term in mask_terms:
        mask = term if mask is None else ex.Binary("and", mask, term)
    fused = FusedAttention(
        scale=matmul.scale,
        score=score,
        mask=ex.fold(mask) if mask is not None else None,
        layouts=tuple(layouts),
        dropout=dropout,
        default_scale=g.graph["scale"],
        sink=sink,
        q_rope=ropes.get("q"),
        k_rope=ropes.get("k"),
        loc=matmul.loc,
    )
    reads = {u for n in chain for u, _, d in g.in_edges(n, data=True) if d["operand"] is None}
    names = {op_of(g, u).name for u in reads}  # type: ignore[attr-defined]
    g.remove_nodes_from(chain)
    node = add_op(g, fused, [q, k, v], names)
    add_op(g, Output(loc=pv_op.loc), [node])
    return g


def _fail(g: Graph, node: str, message: str) -> None:
    raise DslError(message, op_of(g, node).loc)
