"""Global positions: the program's i, j, N and M of a chunk of a longer sequence.

Context parallelism (runtime/distributed.py) splits one sequence into chunks and runs a kernel
per (query chunk, key chunk) pair. The program speaks of the whole sequence: `mask j <= i`
compares global positions, `N` and `M` are the whole sequence's lengths, rope turns row i by
its global position, a document mask reads `doc[b, i]` of the whole sequence, and dropout
counts its Philox counters from global positions. `globalize_positions` rewrites the fused
node so that a kernel call over a chunk pair means exactly that: i becomes
`i + __query_position0`, j becomes `j + __key_position0`, N and M become `__global_N` and
`__global_M`, four int scalars the caller passes. Everything downstream follows from the
expressions: the tile classes and read checks (interval evaluation with the scalars' values),
the derived backward, rope's and the sink's rows, and the kernels' hooks.
"""

from __future__ import annotations

from dataclasses import replace

from attncc.ir import expr as ex
from attncc.ir.graph import Graph, add_op, clone, fused_node, input_node
from attncc.ir.ops import Input

QUERY_POSITION0 = "__query_position0"
KEY_POSITION0 = "__key_position0"
GLOBAL_N = "__global_N"
GLOBAL_M = "__global_M"
#: The scalars a globalized kernel takes, in the order they are declared.
POSITION_SCALARS = (QUERY_POSITION0, KEY_POSITION0, GLOBAL_N, GLOBAL_M)
#: The program's sizes that mean the whole sequence's (the scalars giving them): inputs declared
#: with an N or M dim have the whole sequence's size there (Kernel.validate).
GLOBAL_SIZES = {"N": GLOBAL_N, "M": GLOBAL_M}


def global_mapping() -> dict[ex.Expr, ex.Expr]:
    """The substitution of the chunk's local index and size variables by global ones."""
    return {
        ex.var("i"): ex.Binary("add", ex.var("i"), ex.var(QUERY_POSITION0)),
        ex.var("j"): ex.Binary("add", ex.var("j"), ex.var(KEY_POSITION0)),
        **{ex.var(size): ex.var(name) for size, name in GLOBAL_SIZES.items()},
    }


def globalize_positions(g: Graph) -> Graph:
    """Make the fused node's positions and lengths global (module docstring).

    Runs after `analyse_sparsity` (whose predicate then includes the layouts' grid reads, which
    become reads at global block indices of grids of the global size) and before
    `derive_backward`. Guarantees: no expression of the fused node that the kernels evaluate
    per score or row (score, mask and sparsity predicate, sink, rope positions) has a free i,
    j, N or M outside the position terms (the scale expressions, over the sizes, are evaluated
    by the caller at the global sizes); the four scalars are declared inputs of the graph;
    `position0` holds the query and key offsets (dropout counters).
    """
    g = clone(g)
    node, op = fused_node(g)
    assert op.sparsity is not None and op.backward is None, "globalize_positions runs between sparsity and backward"
    mapping = global_mapping()

    def rewrite(e: ex.Expr | None) -> ex.Expr | None:
        return None if e is None else ex.substitute(e, mapping)

    for name in POSITION_SCALARS:
        add_op(g, Input(name, "scalar", "int"))
        g.add_edge(input_node(g, name), node, operand=None)
    sparsity = op.sparsity
    predicate = rewrite(sparsity.predicate)
    used = {n for n in POSITION_SCALARS if predicate is not None and n in ex.free_vars(predicate)}
    sparsity = replace(
        sparsity,
        predicate=predicate,
        runtime_inputs=tuple(sorted(set(sparsity.runtime_inputs) | used)),
        grid_sizes=(GLOBAL_N, GLOBAL_M),
    )
    ropes = {
        field: replace(r, position=rewrite(r.position)) for field in ("q_rope", "k_rope") if (r := getattr(op, field))
    }
    g.nodes[node]["op"] = replace(
        op,
        score=rewrite(op.score),
        mask=rewrite(op.mask),
        sink=rewrite(op.sink),
        sparsity=sparsity,
        position0=(ex.var(QUERY_POSITION0), ex.var(KEY_POSITION0)),
        **ropes,
    )
    return g
