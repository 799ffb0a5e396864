"""Where a kernel's rows are in the program: global positions of a chunk of a longer sequence
(context parallelism), and a GQA group's query heads folded into one head's rows (decoding).

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
    return _rewrite_rows(
        g,
        "globalize_positions",
        global_mapping(),
        POSITION_SCALARS,
        (GLOBAL_N, GLOBAL_M),
        position0=(ex.var(QUERY_POSITION0), ex.var(KEY_POSITION0)),
    )


FOLD_ROWS = "__fold_rows"
FOLD_GROUP = "__fold_group"
#: The scalars a folded kernel takes, in the order they are declared.
FOLD_SCALARS = (FOLD_ROWS, FOLD_GROUP)


def fold_query_heads(g: Graph) -> Graph:
    """The fused node for queries [B, Hkv, G * N, D]: a GQA group's G query heads as the rows
    of its key/value head, so that the kernels read each K/V tile once per group, not once per
    query head, and a decoding step (N = 1) fills G rows of a query tile instead of one.

    Row r of kernel head h is query r % N of program head h * G + r // N: the program's i, h,
    N and H become `i % __fold_rows`, `h * __fold_group + i // __fold_rows`, `__fold_rows` and
    `H * __fold_group` (two int scalars the caller passes: N and G). Runs where
    `globalize_positions` does; the same guarantees for i, h, N and H. Dropout's counters are
    not rewritten (`position0` stays): callers fold only calls without dropout.
    """
    rows, group = ex.var(FOLD_ROWS), ex.var(FOLD_GROUP)
    mapping: dict[ex.Expr, ex.Expr] = {
        ex.var("i"): ex.Binary("mod", ex.var("i"), rows),
        ex.var("h"): ex.Binary("add", ex.Binary("mul", ex.var("h"), group), ex.Binary("floordiv", ex.var("i"), rows)),
        ex.var("N"): rows,
        ex.var("H"): ex.Binary("mul", ex.var("H"), group),
    }
    return _rewrite_rows(g, "fold_query_heads", mapping, FOLD_SCALARS, (FOLD_ROWS, "M"))


def _rewrite_rows(
    g: Graph,
    name: str,
    mapping: dict[ex.Expr, ex.Expr],
    scalars: tuple[str, ...],
    grid_sizes: tuple[str, str],
    **changes: object,
) -> Graph:
    """The fused node with `mapping` substituted (simultaneously) in every expression the
    kernels evaluate per score or row (score, mask and sparsity predicate, sink, rope
    positions), the int scalars `scalars` declared as inputs of the graph, the layout grids
    spanning `grid_sizes`, and `changes` to the op."""
    g = clone(g)
    node, op = fused_node(g)
    assert op.sparsity is not None and op.backward is None, f"{name} runs between sparsity and backward"

    def rewrite(e: ex.Expr | None) -> ex.Expr | None:
        return None if e is None else ex.substitute(e, mapping)

    for scalar in scalars:
        add_op(g, Input(scalar, "scalar", "int"))
        g.add_edge(input_node(g, scalar), node, operand=None)
    predicate = rewrite(op.sparsity.predicate)
    free = ex.free_vars(predicate) if predicate is not None else set()
    sparsity = replace(
        op.sparsity,
        predicate=predicate,
        runtime_inputs=tuple(sorted(set(op.sparsity.runtime_inputs) | (free & set(scalars)))),
        varies_with_head=op.sparsity.varies_with_head and "h" in free,
        grid_sizes=grid_sizes,
    )
    ropes = {
        field: replace(r, position=rewrite(r.position)) for field in ("q_rope", "k_rope") if (r := getattr(op, field))
    }
    g.nodes[node]["op"] = replace(
        op, score=rewrite(op.score), mask=rewrite(op.mask), sink=rewrite(op.sink), sparsity=sparsity, **ropes, **changes
    )
    return g
