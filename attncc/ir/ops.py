"""Operation nodes of the IR graph.

Each op is a frozen dataclass hung on a networkx node as the attribute ``op``. Source
locations ride along (excluded from equality) so every later error can point at the DSL line
that produced the node. The unfused graph has one node per DSL statement; `fuse_attention`
replaces the chain with one `FusedAttention` node that later passes annotate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from attncc.errors import SourceLoc
from attncc.ir.expr import Expr, const, free_vars

if TYPE_CHECKING:
    from attncc.passes.backward import BackwardExprs
    from attncc.passes.cost import CostModel
    from attncc.passes.sparsity import SparsityInfo
    from attncc.passes.tiling import TilingTable


@dataclass(frozen=True)
class Op:
    """Base of graph operations."""

    loc: SourceLoc | None = field(default=None, compare=False, repr=False, kw_only=True)

    def describe(self) -> str:
        return type(self).__name__.lower()


@dataclass(frozen=True)
class Input(Op):
    """A program input. role: "q", "k", "v" (the attention operands), "tensor" or "scalar"
    (passed by the caller), or "generated" (a layout grid the runtime builds). A scalar with
    `size_of` (tensor, axis) is a free dimension name of that tensor used in an expression:
    the runtime binds it to the tensor's size there, the caller does not pass it."""

    name: str
    role: str
    dtype: str  # "float" | "int" | "bool"
    dims: tuple[str | int, ...] = ()
    size_of: tuple[str, int] | None = None

    def describe(self) -> str:
        shape = f"[{', '.join(map(str, self.dims))}]" if self.dims or self.role != "scalar" else ""
        bound = f" = {self.size_of[0]}.shape[{self.size_of[1]}]" if self.size_of else ""
        return f"input {self.name}: {self.role} {self.dtype}{shape}{bound}"


@dataclass(frozen=True)
class ScoreMatmul(Op):
    """S = scale * (q @ k.T): operands (q, k). The frontend leaves scale at 1; canonicalisation
    moves a constant factor of the first score map here."""

    scale: Expr = field(default_factory=lambda: const(1.0))

    def describe(self) -> str:
        return "matmul q @ k.T" + (f" * {self.scale}" if self.scale != const(1.0) else "")


@dataclass(frozen=True)
class ScoreMap(Op):
    """Elementwise map of the scores: the new score is `expr` with `s` the old score."""

    expr: Expr

    def describe(self) -> str:
        return f"map s -> {self.expr}"


@dataclass(frozen=True)
class Mask(Op):
    """Scores where `predicate` is false become -inf."""

    predicate: Expr

    def describe(self) -> str:
        return f"mask {self.predicate}"


@dataclass(frozen=True)
class Layout(Op):
    """A block-sparse layout: key block jb is visible to query block ib iff the layout allows.

    kind: local | strided | fixed | butterfly | blocks; block: the layout's block size in
    elements; params: the generator's integer parameters; tensor: the runtime block mask
    (kind "blocks" only).
    """

    kind: str
    block: int
    params: tuple[tuple[str, int], ...] = ()
    tensor: str | None = None

    def describe(self) -> str:
        args = [f"block={self.block}", *(f"{k}={v}" for k, v in self.params)]
        if self.tensor:
            args.insert(0, self.tensor)
        return f"layout {self.kind}({', '.join(args)})"


@dataclass(frozen=True)
class Rope(Op):
    """Rotary position embedding of q's or k's rows (RoFormer; `q = rope(q, theta=10000)`):
    the head dims first .. first + dims - 1 (dims None: to the end) rotated pairwise, pair p
    by the angle position * theta^(-2p / dims); pairs are (p, p + dims / 2) (half-split, as
    GPT-NeoX and transformers' rotate_half) or (2p, 2p + 1) (`interleaved`, as GPT-J).
    position: the row's position, over b and i (q's rows) or j (k's rows), the sizes and inputs."""

    operand: str  # "q" or "k"
    theta: float
    dims: int | None
    first: int
    interleaved: bool
    position: Expr

    def describe(self) -> str:
        span = f"dims {self.first}..{'D' if self.dims is None else self.first + self.dims}"
        style = "interleaved" if self.interleaved else "half-split"
        return f"rope {self.operand} theta={self.theta:g} {span} {style} position={self.position}"


@dataclass(frozen=True)
class Softmax(Op):
    """Row softmax over the key axis. `sink`: a logit per query row (over b, h, i, the sizes,
    `scale` and inputs) that joins the denominator and has no value row (attention sinks)."""

    sink: Expr | None = None

    def describe(self) -> str:
        return "softmax" + (f" sink={self.sink}" if self.sink is not None else "")


@dataclass(frozen=True)
class Dropout(Op):
    """Zero each probability with probability p, scale survivors by 1/(1-p)."""

    p: float

    def describe(self) -> str:
        return f"dropout p={self.p}"


@dataclass(frozen=True)
class ValueMatmul(Op):
    """O = P @ v: operands (P, v)."""

    def describe(self) -> str:
        return "matmul p @ v"


@dataclass(frozen=True)
class Output(Op):
    """The program's result."""


@dataclass(frozen=True)
class FusedAttention(Op):
    """The whole chain scores -> map -> mask -> softmax -> dropout -> @ v as one kernel.

    scale: expression (over the sizes, constants and the name `scale`) multiplying q.k;
    default_scale: the value of the name `scale` unless a call gives one (the program's
    `scale = ...` or 1/sqrt(D)); score: the score expression over `s` (the scaled product)
    and `scale`; mask: the predicate (masks and layouts together, after sparsity analysis) or
    None; layouts: block-sparse layouts; sink: the softmax's sink logit per query row or None;
    position0: the global positions of the call's first query and key row where the program's
    positions are global (passes/positions.py: context-parallel chunks; dropout counts from them),
    else None (0).
    Later passes fill the analysis fields; the verifier checks each is present once its pass ran.
    """

    scale: Expr
    score: Expr
    mask: Expr | None
    layouts: tuple[Layout, ...]
    dropout: float
    default_scale: Expr
    sparsity: SparsityInfo | None = None
    backward: BackwardExprs | None = None
    tiling: TilingTable | None = None
    cost: CostModel | None = None
    sink: Expr | None = None
    q_rope: Rope | None = None
    k_rope: Rope | None = None
    position0: tuple[Expr, Expr] | None = None

    @property
    def per_score_expressions(self) -> list[Expr]:
        """What the runtime evaluates over the problem's positions: the score map, the mask, the
        sink (per row) and the rotary positions (per row of q or k); their reads and divisors
        are checked before a call runs (passes/sparsity.py check_reads_and_divisors)."""
        positions = [r.position for r in (self.q_rope, self.k_rope) if r is not None]
        return [e for e in (self.score, self.mask, self.sink, *positions) if e is not None]

    @property
    def reads_scale(self) -> bool:
        """Whether an expression reads the name `scale` (what a call's `scale=` sets): the q.k
        factor, the score map, the mask, the sink or a rotary position."""
        return any("scale" in free_vars(e) for e in (self.scale, *self.per_score_expressions))

    def describe(self) -> str:
        parts = [f"scale={self.scale}", f"score={self.score}"]
        if self.reads_scale:
            parts.append(f"where scale={self.default_scale} by default")
        if self.mask is not None:
            parts.append(f"mask={self.mask}")
        parts.extend(layout.describe() for layout in self.layouts)
        if self.sink is not None:
            parts.append(f"sink={self.sink}")
        parts.extend(r.describe() for r in (self.q_rope, self.k_rope) if r is not None)

        if self.dropout:
            parts.append(f"dropout={self.dropout}")
        if self.position0 is not None:
            parts.append(f"positions from ({self.position0[0]}, {self.position0[1]})")
        return "fused_attention " + ", ".join(parts)
