"""Canonicalisation: one score map, masks after it, constants folded, scale on the matmul."""

from __future__ import annotations

from attncc.ir import expr as ex
from attncc.ir.graph import Graph, add_op, clone, nodes_of, op_of
from attncc.ir.ops import Layout, Mask, ScoreMap, ScoreMatmul


def canonicalize(g: Graph) -> Graph:
    """Rewrite the score chain into canonical order and fold constants.

    Guarantees afterwards:
    - the name `scale` stays symbolic (a call may give its value; by default it is the
      program's `scale = ...` or 1/sqrt(D), carried as `FusedAttention.default_scale`);
    - between the score matmul and the first mask/layout/softmax there is at most one
      `ScoreMap`: consecutive maps are composed, and maps written after a mask are moved
      before it (a masked score is removed whatever the map does, as in FlexAttention);
    - a constant factor of the score map (``s * c`` or ``s / c`` with c free of indices,
      inputs, N and M) is moved to `ScoreMatmul.scale`, so plain scaled attention has the identity map,
      which is then removed;
    - every expression is constant-folded.
    """
    g = clone(g)
    for matmul in nodes_of(g, ScoreMatmul):
        _canonicalize_chain(g, matmul)
    return g


def _chain(g: Graph, start: str) -> list[str]:
    """Score-valued nodes after `start`: maps, masks and layouts, in order."""
    chain, node = [], start
    while True:
        nexts = [n for n in g.successors(node) if isinstance(op_of(g, n), (ScoreMap, Mask, Layout))]
        if len(nexts) != 1 or len(list(g.successors(node))) != 1:
            return chain
        node = nexts[0]
        chain.append(node)


def _canonicalize_chain(g: Graph, matmul: str) -> None:
    chain = _chain(g, matmul)
    if not chain:
        return
    consumers = list(g.successors(chain[-1]))
    maps = [n for n in chain if isinstance(op_of(g, n), ScoreMap)]
    filters = [n for n in chain if not isinstance(op_of(g, n), ScoreMap)]
    exprs = []
    for n in maps:
        op = op_of(g, n)
        assert isinstance(op, ScoreMap)
        exprs.append(ex.fold(op.expr))
    factor, composed = _split_factor(exprs[0]) if exprs else (ex.const(1.0), ex.score())
    for e in exprs[1:]:
        composed = ex.substitute(e, {ex.score(): composed})
    composed = ex.fold(composed)
    mm = op_of(g, matmul)
    assert isinstance(mm, ScoreMatmul)
    g.nodes[matmul]["op"] = ScoreMatmul(ex.fold(ex.Binary("mul", mm.scale, factor)), loc=mm.loc)

    # Rebuild the chain: matmul -> [map] -> filters (in their order) -> consumers.
    map_loc = op_of(g, maps[0]).loc if maps else None
    filter_ops = [(op_of(g, n), {u for u, _, d in g.in_edges(n, data=True) if d["operand"] is None}) for n in filters]
    map_reads = {u for n in maps for u, _, d in g.in_edges(n, data=True) if d["operand"] is None}
    consumer_ports = [(c, g.edges[chain[-1], c]["operand"]) for c in consumers]
    g.remove_nodes_from(chain)
    last = matmul
    if composed != ex.score():
        last = add_op(g, ScoreMap(composed, loc=map_loc), [last])
        for u in map_reads:
            g.add_edge(u, last, operand=None)
    for op, filter_reads in filter_ops:
        folded = Mask(ex.fold(op.predicate), loc=op.loc) if isinstance(op, Mask) else op
        last = add_op(g, folded, [last])
        for u in filter_reads:
            g.add_edge(u, last, operand=None)
    for c, port in consumer_ports:
        g.add_edge(last, c, operand=port)


#: The sizes a factor moved to `ScoreMatmul.scale` may read: one number per launch. N and M are
#: each sequence's own in packed and paged calls, which the score map reads per sequence
#: (`s * log(M)` as the q.k factor took the longest sequence's M for every sequence: session 58).
LAUNCH_SIZES = frozenset(ex.SIZE_VARS) - {"N", "M"}


def _is_static(e: ex.Expr) -> bool:
    """True if `e` depends only on numbers, the sizes of LAUNCH_SIZES and `scale` (the same for
    every score of a launch)."""
    return not ex.reads(e) and ex.free_vars(e) <= {*LAUNCH_SIZES, "scale"}


def _split_factor(e: ex.Expr) -> tuple[ex.Expr, ex.Expr]:
    """(c, s) when e is a product/quotient chain of s and static factors (then e = c * s)."""
    if _has_score_leaf(e):
        return ex.fold(ex.substitute(e, {ex.score(): ex.const(1.0)})), ex.score()
    return ex.const(1.0), e


def _has_score_leaf(e: ex.Expr) -> bool:
    """True if e is the bare score or a pure product/quotient chain ending in it."""
    if e == ex.score():
        return True
    if isinstance(e, ex.Binary) and e.op in ("mul", "div"):
        return (_has_score_leaf(e.a) and _is_static(e.b)) or (
            e.op == "mul" and _has_score_leaf(e.b) and _is_static(e.a)
        )
    return False
