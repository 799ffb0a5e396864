"""The compiler pipeline: one function lists every pass in order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from attncc.frontend.lower import parse_program
from attncc.ir.graph import Graph, clone, fused_node, print_graph, verify
from attncc.passes.backward import derive_backward
from attncc.passes.canonicalize import canonicalize
from attncc.passes.cost import cost
from attncc.passes.fuse import fuse_attention
from attncc.passes.positions import fold_query_heads, globalize_positions
from attncc.passes.sparsity import analyse_sparsity
from attncc.passes.tiling import TilingTable, tile
from attncc.targets import Target


@dataclass(frozen=True)
class Stage:
    """The IR after one pass, for `attncc explain`."""

    name: str
    graph: Graph

    def text(self) -> str:
        return f"// after {self.name}\n{print_graph(self.graph)}"


def run_pipeline(
    source: str, path: str, target: Target, tiles: tuple[int, int] | None = None, warp_rows: int | None = None
) -> list[Stage]:
    """parse -> build graph -> verify -> canonicalize -> fuse -> sparsity -> backward -> tile -> cost.

    Each pass is a pure function Graph -> Graph and the verifier runs after every one, so a
    broken invariant is reported at the pass that broke it. Code generation, build and load
    follow in `attncc.compile` (codegen/, runtime/).
    """
    stages = [Stage("parse", verify(parse_program(source, path), "parse"))]

    def step(name: str, fn) -> None:  # noqa: ANN001 - a pass
        stages.append(Stage(name, verify(fn(stages[-1].graph), name)))

    step("canonicalize", canonicalize)  # one score map, masks after it, scale on the matmul
    step("fuse_attention", fuse_attention)  # needs the canonical chain
    step("analyse_sparsity", analyse_sparsity)  # folds layouts into the mask predicate
    step("derive_backward", derive_backward)  # differentiates the final score expression
    step("tile", lambda g: tile(g, target, tiles, warp_rows))  # Br, Bc per head dim from the target
    step("cost", cost)  # IO model of the fused node and the unfused chain
    return stages


#: Rewrites of where a kernel's rows are (passes/positions.py), by the name `with_rows` takes.
ROW_REWRITES = {"globalize_positions": globalize_positions, "fold_query_heads": fold_query_heads}


def with_rows(stages: list[Stage], rewrite: str) -> list[Stage]:
    """`stages` (a `run_pipeline` result) again from sparsity analysis on, with the row
    rewrite `rewrite` after it: `globalize_positions` (a chunk pair of a longer sequence,
    context parallelism) or `fold_query_heads` (a GQA group's query heads as one head's rows).
    The tiling is the original's: it depends on the target and the head dims, not on which
    program rows a kernel row is. Rewrites compose: a globalized kernel's folded variant keeps
    its global positions."""
    names = [stage.name for stage in stages]
    kept = stages[: max(i for i, name in enumerate(names) if name == "analyse_sparsity" or name in ROW_REWRITES) + 1]
    tiling = fused_node(stages[names.index("tile")].graph)[1].tiling

    for name, fn in (
        (rewrite, ROW_REWRITES[rewrite]),
        ("derive_backward", derive_backward),
        ("tile", lambda g: _with_tiling(g, tiling)),
        ("cost", cost),
    ):
        kept.append(Stage(name, verify(fn(kept[-1].graph), name)))
    return kept


def with_tiles(stages: list[Stage], retile: Callable[[TilingTable], TilingTable]) -> list[Stage]:
    """`stages` with the tile pass's table through `retile` (the GPU forward tiles of calls of
    few query rows: `TilingTable.for_short_queries`, `for_key_split_warps`) and costed again."""
    names = [stage.name for stage in stages]
    at = names.index("tile")
    tiling = fused_node(stages[at].graph)[1].tiling
    assert tiling is not None
    kept = stages[:at]
    for name, fn in (("tile", lambda g: _with_tiling(g, retile(tiling))), ("cost", cost)):
        kept.append(Stage(name, verify(fn(kept[-1].graph), name)))
    return kept


def _with_tiling(g: Graph, tiling: object) -> Graph:
    g = clone(g)
    node, op = fused_node(g)
    g.nodes[node]["op"] = replace(op, tiling=tiling)
    return g
