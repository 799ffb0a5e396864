"""The IR graph: a networkx DiGraph of immutable ops, its verifier and its printer.

Nodes are named ``%0, %1, ...``; each carries ``op`` (an `Op`). A data edge u -> v carries
``operand=k`` (u is v's k-th operand); an edge from a runtime input to an op whose expression
reads it carries ``operand=None``. Graph attributes: ``name`` (the variant) and ``path``.
Passes never mutate a graph they are given: they copy it (`clone`) and replace ops.
"""

from __future__ import annotations

import networkx as nx

from attncc.errors import IRVerificationError
from attncc.ir import expr as ex
from attncc.ir.ops import (
    Dropout,
    FusedAttention,
    Input,
    Layout,
    Mask,
    Op,
    Output,
    Rope,
    ScoreMap,
    ScoreMatmul,
    Softmax,
    ValueMatmul,
)

Graph = nx.DiGraph

#: Number of data operands of each op kind.
ARITY: dict[type[Op], int] = {
    Input: 0, ScoreMatmul: 2, ScoreMap: 1, Mask: 1, Layout: 1, Softmax: 1, Dropout: 1,
    ValueMatmul: 2, Output: 1, FusedAttention: 3, Rope: 1,
}  # fmt: skip


def new_graph(name: str, path: str) -> Graph:
    g = nx.DiGraph()
    g.graph.update(name=name, path=path, next_id=0)
    return g


def add_op(g: Graph, op: Op, operands: list[str] = (), reads: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    """Add `op` with its data operands and runtime-input dependencies; returns its node id."""
    node = f"%{g.graph['next_id']}"
    g.graph["next_id"] += 1
    g.add_node(node, op=op)
    for k, src in enumerate(operands):
        g.add_edge(src, node, operand=k)
    for name in sorted(reads):
        g.add_edge(input_node(g, name), node, operand=None)
    return node


def clone(g: Graph) -> Graph:
    """A copy safe to rewrite (ops are immutable, so a shallow copy suffices)."""
    return g.copy()


def op_of(g: Graph, node: str) -> Op:
    return g.nodes[node]["op"]


def operands(g: Graph, node: str) -> list[str]:
    """Data operands of `node` in order."""
    ins = [(d["operand"], u) for u, _, d in g.in_edges(node, data=True) if d["operand"] is not None]
    return [u for _, u in sorted(ins)]


def inputs(g: Graph) -> dict[str, Input]:
    """Program inputs by name."""
    return {op.name: op for _, op in g.nodes(data="op") if isinstance(op, Input)}


def input_node(g: Graph, name: str) -> str:
    for node, op in g.nodes(data="op"):
        if isinstance(op, Input) and op.name == name:
            return node
    raise KeyError(name)


def runtime_inputs(g: Graph) -> list[Input]:
    """Inputs the caller passes by keyword, in declaration order."""
    return [op for op in inputs(g).values() if op.role in ("tensor", "scalar")]


def nodes_of(g: Graph, kind: type[Op]) -> list[str]:
    return [n for n in nx.topological_sort(g) if isinstance(op_of(g, n), kind)]


def fused_node(g: Graph) -> tuple[str, FusedAttention]:
    (node,) = nodes_of(g, FusedAttention)
    op = op_of(g, node)
    assert isinstance(op, FusedAttention)
    return node, op


# ----------------------------------------------------------------------------- verifier
def verify(g: Graph, after: str = "") -> Graph:
    """Check the graph's invariants; raise IRVerificationError naming the broken node."""

    def fail(node: str, message: str) -> None:
        where = f" after pass {after}" if after else ""
        raise IRVerificationError(f"IR invalid{where}: node {node} ({describe(g, node)}): {message}")

    if not nx.is_directed_acyclic_graph(g):
        raise IRVerificationError(f"IR invalid after {after}: the graph has a cycle")
    known = inputs(g)
    outputs = nodes_of(g, Output)
    if len(outputs) != 1:
        raise IRVerificationError(f"IR invalid after {after}: expected one output, found {len(outputs)}")
    for node in g.nodes:
        op = op_of(g, node)
        if not isinstance(op, Op):
            fail(node, "attribute `op` is not an Op")
        want = ARITY[type(op)]
        got = operands(g, node)
        if len(got) != want:
            fail(node, f"expected {want} operands, found {len(got)}")
        for expr_name, e, ty in _expressions(op):
            problem = check_expr(e, known, ty)
            if problem:
                fail(node, f"{expr_name}: {problem}")
        if isinstance(op, Layout) and op.tensor is not None and op.tensor not in known:
            fail(node, f"layout reads unknown tensor {op.tensor}")
        if isinstance(op, FusedAttention):
            order = ("sparsity", "backward", "tiling", "cost")
            filled = [getattr(op, f) is not None for f in order]
            if filled != sorted(filled, reverse=True):
                fail(node, f"analysis fields filled out of order: {dict(zip(order, filled))}")
            roles = [op_of(g, u) for u in got]
            if [getattr(r, "role", None) for r in roles] != ["q", "k", "v"]:
                fail(node, "operands must be the inputs q, k, v")
    return g


def _expressions(op: Op) -> list[tuple[str, ex.Expr, str]]:
    if isinstance(op, ScoreMap):
        return [("score expression", op.expr, ex.FLOAT)]
    if isinstance(op, Mask):
        return [("mask predicate", op.predicate, ex.BOOL)]
    if isinstance(op, Rope):
        return [(f"rope({op.operand}) position", op.position, ex.FLOAT)]
    if isinstance(op, FusedAttention):
        found = [("scale", op.scale, ex.FLOAT), ("score expression", op.score, ex.FLOAT)]
        if op.mask is not None:
            found.append(("mask predicate", op.mask, ex.BOOL))
        found += [(f"rope({r.operand}) position", r.position, ex.FLOAT) for r in (op.q_rope, op.k_rope) if r]
        return found
    return []


def check_expr(e: ex.Expr, known: dict[str, Input], want: str) -> str | None:
    """Why `e` is not a well-formed expression of type `want` over `known` inputs, or None."""
    if e.ty != want and not (want == ex.FLOAT and e.ty == ex.INT):
        return f"has type {e.ty}, expected {want}"
    for n in ex.walk(e):
        if isinstance(n, ex.Var):
            builtin = n.name in ex.INDEX_VARS + ex.SIZE_VARS + (ex.SCORE_VAR, "scale")
            declared = n.name in known and known[n.name].role == "scalar"
            if not (builtin or declared):
                return f"unknown variable {n.name}"
        if isinstance(n, ex.Read):
            decl = known.get(n.tensor)
            if decl is None or decl.role not in ("tensor", "generated"):
                return f"reads unknown tensor {n.tensor}"
            if len(n.index) != len(decl.dims):
                return f"{n.tensor} has {len(decl.dims)} dimensions, indexed with {len(n.index)}"
            if any(i.ty != ex.INT for i in n.index):
                return f"index of {n.tensor} is not an integer"
    return None


# ----------------------------------------------------------------------------- printer
def describe(g: Graph, node: str) -> str:
    return op_of(g, node).describe()


def print_graph(g: Graph) -> str:
    """One line per node in topological order: ``%3 = mask j <= i (%2)  # file:line``."""
    lines = [f"graph {g.graph['name']} {{"]
    for node in nx.topological_sort(g):
        op = op_of(g, node)
        args = operands(g, node)
        text = f"  {node} = {op.describe()}"
        if args:
            text += f" ({', '.join(args)})"
        lines.append(text)
    lines.append("}")
    return "\n".join(lines)
