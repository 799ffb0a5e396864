"""Sparsity analysis: classify every (Br x Bc) tile as empty, partial or full.

The static pass (`analyse_sparsity`) folds masks and block-sparse layouts into one predicate
and records what the classification depends on. The classification itself needs the problem
sizes (and, for masks over runtime tensors, their values), so `classify_tiles` runs at call
time: it evaluates the predicate once per tile over *intervals* (the tile's range of i and j,
the batch index b and head h as points, ranges of tensor values from range-min/max queries),
never per element, and never materialises N x M. Interval reasoning is sound (a tile called
empty has no visible element, a tile called full has no masked element) and exact for a
single comparison of expressions that are monotone in i and j, such as causal, window, prefix
and padding masks; tiles it cannot decide are partial and get the per-element predicate.

Layouts become reads of a block grid: layout kind L with block size s contributes the
conjunct ``__layoutK[i // s, j // s]`` where the grid is generated at call time (size
ceil(N/s) x ceil(M/s)), so kernels and reference treat layouts like any other mask input.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch.nn.functional import pad

from attncc.errors import InputError
from attncc.ir import expr as ex
from attncc.ir.graph import Graph, add_op, clone, fused_node, input_node, inputs
from attncc.ir.ops import Input, Layout
from attncc.runtime.locks import module_lock
from attncc.runtime.reference import evaluate

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class SparsityInfo:
    """What tile classification needs: the combined predicate and its dependencies."""

    predicate: ex.Expr | None
    layout_grids: tuple[tuple[str, Layout], ...]
    varies_with_batch: bool
    varies_with_head: bool
    runtime_inputs: tuple[str, ...]
    #: The sizes the layout grids span: the call's N and M, or the scalars naming the whole
    #: sequence's lengths where positions are global (passes/positions.py).
    grid_sizes: tuple[str, str] = ("N", "M")

    def describe(self) -> str:
        if self.predicate is None:
            return "dense: every tile full"
        dims = [d for d, on in (("b", self.varies_with_batch), ("h", self.varies_with_head)) if on]
        per = f"per {', '.join(dims)} and tile" if dims else "per tile"
        needs = f"; reads {', '.join(self.runtime_inputs)} at call time" if self.runtime_inputs else ""
        return f"predicate {self.predicate}: classified {per}{needs}"


def analyse_sparsity(g: Graph) -> Graph:
    """Attach `SparsityInfo` to the fused node.

    Guarantees afterwards: `FusedAttention.mask` is the whole visibility predicate (masks and
    layouts), so kernels evaluate one expression on partial tiles, and `sparsity` says which
    of b, h and which runtime inputs the tile classes depend on.
    """
    g = clone(g)
    node, op = fused_node(g)
    terms: list[ex.Expr] = [op.mask] if op.mask is not None else []
    grids: list[tuple[str, Layout]] = []
    declared = inputs(g)
    for k, layout in enumerate(op.layouts):
        terms.append(_layout_term(k, layout, declared, grids))
    for name, layout in grids:
        add_op(
            g, Input(name, "generated", "bool", (f"ceil(N/{layout.block})", f"ceil(M/{layout.block})"), loc=layout.loc)
        )
        g.add_edge(input_node(g, name), node, operand=None)
    predicate = None
    for term in terms:
        predicate = term if predicate is None else ex.Binary("and", predicate, term)
    predicate = ex.fold(predicate) if predicate is not None else None
    if predicate is not None and isinstance(predicate, ex.Const):
        predicate = None if predicate.value else predicate
    names = (
        sorted({r.tensor for r in ex.reads(predicate)} | (ex.free_vars(predicate) & set(declared)))
        if predicate is not None
        else []
    )
    used = ex.free_vars(predicate) if predicate is not None else set()
    info = SparsityInfo(
        predicate=predicate,
        layout_grids=tuple(grids),
        varies_with_batch="b" in used or any(_read_varies(r, "b") for r in _reads(predicate)),
        varies_with_head="h" in used or any(_read_varies(r, "h") for r in _reads(predicate)),
        runtime_inputs=tuple(n for n in names if not n.startswith("__layout")),
    )
    g.nodes[node]["op"] = replace(op, mask=predicate, sparsity=info)
    return g


def _reads(e: ex.Expr | None) -> list[ex.Read]:
    return ex.reads(e) if e is not None else []


def _read_varies(r: ex.Read, var: str) -> bool:
    return any(var in ex.free_vars(i) for i in r.index)


def _layout_term(k: int, layout: Layout, declared: Mapping, grids: list[tuple[str, Layout]]) -> ex.Expr:
    s = ex.const(layout.block)
    ib, jb = ex.Binary("floordiv", ex.var("i"), s), ex.Binary("floordiv", ex.var("j"), s)
    if layout.kind == "blocks":
        assert layout.tensor is not None
        decl = declared[layout.tensor]
        # the leading dims by their declared names (the frontend admits B, H and Hkv, once each)
        kv_head = ex.Binary("floordiv", ex.var("h"), ex.Binary("floordiv", ex.var("H"), ex.var("Hkv")))
        index = {"B": ex.var("b"), "H": ex.var("h"), "Hkv": kv_head}
        lead = tuple(index[str(dim)] for dim in decl.dims[:-2])
        read = ex.Read(layout.tensor, (*lead, ib, jb), ex.BOOL if decl.dtype == "bool" else ex.INT)
        return read if read.ty == ex.BOOL else ex.Binary("ne", read, ex.const(0))
    name = f"__layout{k}"
    grids.append((name, layout))
    return ex.Read(name, (ib, jb), ex.BOOL)


def layout_grid(layout: Layout, n: int, m: int) -> torch.Tensor:
    """The [ceil(n/block), ceil(m/block)] bool grid of a generated layout."""
    nb, mb = -(-n // layout.block), -(-m // layout.block)
    ib = torch.arange(nb, device="cpu").view(-1, 1)
    jb = torch.arange(mb, device="cpu").view(1, -1)
    p = dict(layout.params)
    dist = ib - jb
    if layout.kind == "local":
        return dist.abs() <= p["width"]
    if layout.kind == "strided":
        return (dist.abs() < p["stride"]) | (torch.remainder(dist, p["stride"]) == 0)
    if layout.kind == "fixed":
        stride, summary = p["stride"], p["summary"]
        return (ib // stride == jb // stride) | (torch.remainder(jb, stride) >= stride - summary)
    if layout.kind == "butterfly":
        x = ib ^ jb
        return (x & (x - 1)) == 0  # 0 or a power of two
    raise ValueError(f"layout {layout.kind} has no generator")


# ----------------------------------------------------------------------------- intervals
@dataclass
class Interval:
    """Per-tile lower and upper bounds (float64 tensors, broadcastable to [B, H, Ti, Tj])."""

    lo: torch.Tensor
    hi: torch.Tensor


@dataclass
class Truth:
    """Per-tile: can the predicate be true somewhere / false somewhere in the tile."""

    may_true: torch.Tensor
    may_false: torch.Tensor


Abstract = Interval | Truth


def _float64(x: torch.Tensor | float) -> torch.Tensor:
    """x as a float64 tensor; a number on the host, whatever torch's default dtype and device
    (a bf16 default rounded bounds from 257 on, a meta one had no values: session 67)."""
    return (
        x.to(torch.float64)
        if isinstance(x, torch.Tensor)
        else torch.tensor(float(x), dtype=torch.float64, device="cpu")
    )


def _point(x: torch.Tensor | float) -> Interval:
    t = _float64(x)
    return Interval(t, t)


#: Bounds are float64: exact for integers up to 2^53. Beyond, int64 arithmetic in the kernel may
#: wrap where float64 would not, so such an interval proves nothing.
EXACT_INT_BOUND = 2.0**53


#: Integer operations that wrap in the kernels' int64 (x + y, INT64_MIN // -1, -INT64_MIN, ...).
WRAPPING_OPS = ("add", "sub", "mul", "floordiv", "neg", "abs")


def _int64_safe(v: Interval, wraps: bool) -> Interval:
    """`v` for an int64 expression. A bound past the exact range (>=: an int64 of 2^53 + 1 read
    into float64 is 2^53, so 2^53 itself is no exact bound) is no bound: for an operation that
    wraps, the whole interval is unbounded wherever one is past it; for the others (reads,
    rounding, min, max, where) each such bound gives way alone, so `min(max(floor(x), 0), 7)`
    is [0, 7] for any float x."""
    lo_out, hi_out = v.lo.abs() >= EXACT_INT_BOUND, v.hi.abs() >= EXACT_INT_BOUND
    if not bool((lo_out | hi_out).any()):
        return v
    if wraps:
        wild = lo_out | hi_out
        return Interval(torch.where(wild, -math.inf, v.lo), torch.where(wild, math.inf, v.hi))
    near = EXACT_INT_BOUND - 1  # (a large bound's exact value is beyond this one, on its side)
    return Interval(
        torch.where(lo_out, torch.where(v.lo > 0, near, -math.inf), v.lo),
        torch.where(hi_out, torch.where(v.hi < 0, -near, math.inf), v.hi),
    )


def _as_truth(v: Abstract) -> Truth:
    if isinstance(v, Truth):
        return v
    return Truth((v.lo != 0) | (v.hi != 0), (v.lo <= 0) & (v.hi >= 0))


def _as_interval(v: Abstract) -> Interval:
    if isinstance(v, Interval):
        return v
    return Interval((~v.may_false).double(), v.may_true.double())


def _clean(lo: torch.Tensor, hi: torch.Tensor) -> Interval:
    bad = torch.isnan(lo) | torch.isnan(hi)
    inf = _float64(math.inf)
    return Interval(torch.where(bad, -inf, lo), torch.where(bad, inf, hi))


def _nan_kept(value: Abstract, *operands: Abstract) -> Abstract:
    """`value` unbounded wherever an operand is: a float that may be NaN has the interval
    [-inf, inf] (`_clean`), and the float functions whose range is bounded (exp, tanh, abs) and
    min and max (NaN from either operand in the kernels: `min_of`, `max_of`) would
    give it finite bounds that a NaN lies outside (floor(NaN) is 0: an index `floor(max(min(4.5,
    x), 3.5)) - 3` was proven in [0, 1] and read t[-3])."""
    assert isinstance(value, Interval)
    wild = torch.zeros((), dtype=torch.bool, device="cpu")
    for x in operands:
        wild = wild | _may_be_nan(_as_interval(x))
    if not bool(wild.any()):
        return value
    return Interval(torch.where(wild, -math.inf, value.lo), torch.where(wild, math.inf, value.hi))


def _mul(a: Interval, b: Interval) -> Interval:
    prods = torch.stack(torch.broadcast_tensors(a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi))
    return _clean(prods.amin(0), prods.amax(0))


def _div(a: Interval, b: Interval, floor: bool) -> Interval:
    spans_zero = (b.lo <= 0) & (b.hi >= 0)
    safe_lo = torch.where(spans_zero, torch.ones_like(b.lo), b.lo)
    safe_hi = torch.where(spans_zero, torch.ones_like(b.hi), b.hi)
    quots = torch.stack(torch.broadcast_tensors(a.lo / safe_lo, a.lo / safe_hi, a.hi / safe_lo, a.hi / safe_hi))
    lo, hi = quots.amin(0), quots.amax(0)
    if floor:
        lo, hi = torch.floor(lo), torch.floor(hi)
    inf = _float64(math.inf)
    return _clean(torch.where(spans_zero, -inf, lo), torch.where(spans_zero, inf, hi))


def _mod(a: Interval, b: Interval) -> Interval:
    """Python modulo; exact when b is a positive constant and a stays within one period; within
    [0, b - 1] for any positive b, [b + 1, 0] for any negative one (the divisor's sign)."""
    const_pos = (b.lo == b.hi) & (b.lo > 0)
    c = torch.where(const_pos, b.lo, torch.ones_like(b.lo))
    same_period = torch.floor(a.lo / c) == torch.floor(a.hi / c)
    finite = torch.isfinite(a.lo) & torch.isfinite(a.hi)
    exact = const_pos & same_period & finite
    lo = torch.where(exact, torch.remainder(torch.nan_to_num(a.lo), c), torch.zeros_like(c))
    hi = torch.where(exact, torch.remainder(torch.nan_to_num(a.hi), c), c - 1)
    inf = _float64(math.inf)
    bound = torch.maximum(b.lo.abs(), b.hi.abs())
    bound = torch.where(torch.isfinite(bound), bound, inf)
    positive, negative = b.lo > 0, b.hi < 0
    return Interval(
        torch.where(const_pos, lo, torch.where(positive, 0.0, torch.where(negative, b.lo + 1, -bound))),
        torch.where(const_pos, hi, torch.where(positive, b.hi - 1, torch.where(negative, 0.0, bound))),
    )


#: Relative margin of a float value's interval: the kernels evaluate float masks in the
#: accumulator's precision (float32 for fp32, bf16 and fp16 operands), a few ulps (2^-23) from
#: this float64 evaluation per operation.
FLOAT_MARGIN = 2.0**-16


#: float32's largest finite value and smallest normal one, less / more FLOAT_MARGIN: beyond, a
#: float32 result may be inf (exp(89)), below, 0 (exp(-90): the CPU kernels flush denormals).
FLOAT32_FINITE = float(torch.finfo(torch.float32).max) * (1 - FLOAT_MARGIN)
FLOAT32_NORMAL = float(torch.finfo(torch.float32).tiny) * (1 + FLOAT_MARGIN)


def _float32_rounded(x: Interval) -> Interval:
    """A float expression's interval widened by FLOAT_MARGIN of its magnitude, so a comparison
    that float32 may decide otherwise than float64 (`i * 0.1 <= 4.8` at i = 48: true in float32,
    false in float64) classes its tile PARTIAL and the kernel's own per-score test decides, as it
    does inside every partial tile (a tile EMPTY here dropped a row that float32 keeps); and
    reaching inf past float32's range and 0 below its normal numbers (`exp(j - i) > 0.0` held in
    float64 where float32's exp is 0: FULL tiles kept keys the kernel's test drops)."""
    x = _clean(x.lo - x.lo.abs() * FLOAT_MARGIN, x.hi + x.hi.abs() * FLOAT_MARGIN)
    lo = torch.where(x.lo < -FLOAT32_FINITE, -math.inf, x.lo)
    hi = torch.where(x.hi > FLOAT32_FINITE, math.inf, x.hi)
    lo = torch.where((lo > 0) & (lo < FLOAT32_NORMAL), 0.0, lo)
    hi = torch.where((hi < 0) & (hi > -FLOAT32_NORMAL), 0.0, hi)
    return Interval(lo, hi)


def _float32_exact(e: ex.Expr) -> bool:
    """A float literal that float32 holds exactly (2.0, 0.5, 1.375; not 0.1): the kernels'
    value is the literal's, so it needs no margin (a margin would keep `floor(x)` of an x known
    to be >= 2.0 from bounding it by 2)."""
    if not isinstance(e, ex.Const):
        return False
    value = float(e.value)
    if value != 0 and abs(value) < torch.finfo(torch.float32).tiny:  # (a denormal: the CPU kernels read it as 0)
        return False
    return math.isinf(value) or float(torch.tensor(value, dtype=torch.float32, device="cpu")) == value


def _may_be_nan(x: Interval) -> torch.Tensor:
    """Where `x` may be NaN: a float that may be NaN has the interval [-inf, inf] (`_clean`,
    `_nan_kept`)."""
    return torch.isneginf(x.lo) & torch.isposinf(x.hi)


def _compare(op: str, a: Interval, b: Interval) -> Truth:
    if op in ("lt", "le"):
        truth = Truth(a.lo < b.hi, a.hi >= b.lo) if op == "lt" else Truth(a.lo <= b.hi, a.hi > b.lo)
        # (an ordered comparison with NaN is false: `x <= inf` is not always true)
        return Truth(truth.may_true, truth.may_false | _may_be_nan(a) | _may_be_nan(b))
    if op == "gt":
        return _compare("lt", b, a)
    if op == "ge":
        return _compare("le", b, a)
    overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
    all_equal = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    if op == "eq":
        return Truth(overlap, ~all_equal)
    return Truth(~all_equal, overlap)  # ne


#: Nondecreasing functions: an interval's image is that of its ends. (The rounding ops saturate
#: at int64's range beyond it, and _int64_safe makes such bounds unbounded.)
_MONOTONE = {
    "exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sqrt": torch.sqrt,
    "floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round,
}  # fmt: skip


#: `where` branches narrowed inside one another at most: a branch is evaluated afresh with its
#: narrowed operands (what it shares with the other branch, twice), so nesting is bounded to
#: keep a program's evaluation linear in its size; deeper branches keep their operands' intervals.
MAX_NARROWED_BRANCHES = 3


class IntervalEvaluator:
    """Abstract interpretation of an expression over per-tile intervals."""

    def __init__(self, env: Mapping[str, Interval], read, narrowed: int = 0) -> None:  # noqa: ANN001 - callable
        self.env = env
        self.read = read
        self.memo: dict[ex.Expr, Abstract] = {}
        self.narrowed = narrowed  # the `where` branches this evaluator is inside (`_branch`)

    def __call__(self, e: ex.Expr) -> Abstract:
        if e not in self.memo:
            value = self._eval(e)
            if e.ty == ex.INT and isinstance(value, Interval):
                wraps = isinstance(e, (ex.Binary, ex.Unary)) and e.op in WRAPPING_OPS
                value = _int64_safe(value, wraps)
            if e.ty == ex.FLOAT and isinstance(value, Interval) and not _float32_exact(e):
                value = _float32_rounded(value)
            self.memo[e] = value
        return self.memo[e]

    def _eval(self, e: ex.Expr) -> Abstract:
        if isinstance(e, ex.Const):
            return (
                _point(float(e.value))
                if e.ty != ex.BOOL
                else Truth(torch.tensor(bool(e.value), device="cpu"), torch.tensor(not e.value, device="cpu"))
            )
        if isinstance(e, ex.Var):
            value = self.env[e.name]
            return _as_truth(value) if e.ty == ex.BOOL else value
        if isinstance(e, ex.Read):
            value = self.read(e, [_as_interval(self(i)) for i in e.index])
            return _as_truth(value) if e.ty == ex.BOOL else value
        if isinstance(e, ex.Unary):
            value = self._unary(e.op, self(e.x))
            return _nan_kept(value, self(e.x)) if e.x.ty == ex.FLOAT and e.ty == ex.FLOAT else value
        if isinstance(e, ex.Binary):
            a, b = self(e.a), self(e.b)
            if {e.a.ty, e.b.ty} == {ex.INT, ex.FLOAT}:  # (the kernels convert the int to float32 first:
                # 2^24 + 1 is 2^24 there, so `i > 16777216.0` is false at i = 2^24 + 1)
                a, b = (_float32_rounded(_as_interval(v)) if x.ty == ex.INT else v for v, x in ((a, e.a), (b, e.b)))
            value = self._binary(e.op, a, b)
            return _nan_kept(value, a, b) if e.op in ("min", "max") and e.ty == ex.FLOAT else value
        if isinstance(e, ex.Where):
            c = _as_truth(self(e.cond))
            only_a, only_b = c.may_true & ~c.may_false, c.may_false & ~c.may_true
            a, b = self._branch(e.cond, True, e.a), self._branch(e.cond, False, e.b)
            if e.ty == ex.BOOL:
                ta, tb = _as_truth(a), _as_truth(b)
                return Truth(
                    (c.may_true & ta.may_true) | (c.may_false & tb.may_true),
                    (c.may_true & ta.may_false) | (c.may_false & tb.may_false),
                )
            ia, ib = _as_interval(a), _as_interval(b)
            lo = torch.where(only_a, ia.lo, torch.where(only_b, ib.lo, torch.minimum(ia.lo, ib.lo)))
            hi = torch.where(only_a, ia.hi, torch.where(only_b, ib.hi, torch.maximum(ia.hi, ib.hi)))
            return Interval(lo, hi)
        raise TypeError(e)

    def _branch(self, cond: ex.Expr, truth: bool, branch: ex.Expr) -> Abstract:
        """A `where` branch's value where `cond` is `truth`: the comparisons it implies narrow
        their operands' intervals inside the branch (T5's buckets, `where(n < 8, n, 8 +
        trunc(log(n / 8) ...))`, index a table only because n >= 8 in the second branch)."""
        facts: dict[ex.Expr, Interval] = {}
        if self.narrowed < MAX_NARROWED_BRANCHES:
            self._implied(cond, truth, facts)
        if not facts:
            return self(branch)
        inside = IntervalEvaluator(self.env, self.read, self.narrowed + 1)
        inside.memo.update(facts)
        return inside(branch)

    def _implied(self, cond: ex.Expr, truth: bool, facts: dict[ex.Expr, Interval]) -> None:
        """Add to `facts` the operand intervals that `cond == truth` implies. Sound for the
        kernel's evaluation: a float comparison is false for NaN, so a float operand is narrowed
        only where its comparison holds (a NaN takes the false branch of `x < c`)."""
        if isinstance(cond, ex.Unary) and cond.op == "not":
            self._implied(cond.x, not truth, facts)
            return
        if not isinstance(cond, ex.Binary):
            return
        if cond.op in ("and", "or"):
            if (cond.op == "and") == truth:  # (both sides hold: `a and b` true, `a or b` false)
                self._implied(cond.a, truth, facts)
                self._implied(cond.b, truth, facts)
            return
        if cond.op not in ex.COMPARE_OPS:
            return
        op, a, b = cond.op, cond.a, cond.b
        if a.ty != b.ty:  # (the kernels compare an int with a float in float32, where the int is rounded)
            return
        integers = a.ty == ex.INT
        if not truth:
            if not integers:
                return
            op = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}[op]
        if op in ("gt", "ge"):
            op, a, b = {"gt": "lt", "ge": "le"}[op], b, a
        if op == "ne":
            return
        ia, ib = _as_interval(self(a)), _as_interval(self(b))
        if not integers:  # (the branch's copy of a float may be computed apart from the condition's,
            # one FMA contracted and one not: float bounds keep FLOAT_MARGIN)
            ia, ib = _float32_rounded(ia), _float32_rounded(ib)
        step = 1.0 if op == "lt" and integers else 0.0  # (a float a < b narrows to a <= b)
        if op == "eq":
            both = Interval(torch.maximum(ia.lo, ib.lo), torch.minimum(ia.hi, ib.hi))
            narrowed = {a: both, b: both}
        else:  # a <= b - step
            narrowed = {
                a: Interval(ia.lo, torch.minimum(ia.hi, ib.hi - step)),
                b: Interval(torch.maximum(ib.lo, ia.lo + step), ib.hi),
            }
        for node, iv in narrowed.items():
            if isinstance(node, ex.Const):
                continue
            if node in facts:
                iv = Interval(torch.maximum(facts[node].lo, iv.lo), torch.minimum(facts[node].hi, iv.hi))
            facts[node] = iv

    def _unary(self, op: str, v: Abstract) -> Abstract:
        if op == "not":
            t = _as_truth(v)
            return Truth(t.may_false, t.may_true)
        x = _as_interval(v)
        if op == "neg":
            return Interval(-x.hi, -x.lo)
        if op == "abs":
            lo = torch.where(x.lo >= 0, x.lo, torch.where(x.hi <= 0, -x.hi, torch.zeros_like(x.lo)))
            return Interval(lo, torch.maximum(x.lo.abs(), x.hi.abs()))
        fn = _MONOTONE[op]
        return _clean(fn(x.lo), fn(x.hi))

    def _binary(self, op: str, va: Abstract, vb: Abstract) -> Abstract:
        if op in ("and", "or"):
            a, b = _as_truth(va), _as_truth(vb)
            if op == "and":
                return Truth(a.may_true & b.may_true, a.may_false | b.may_false)
            return Truth(a.may_true | b.may_true, a.may_false & b.may_false)
        a, b = _as_interval(va), _as_interval(vb)
        if op in ex.COMPARE_OPS:
            return _compare(op, a, b)
        if op == "add":
            return _clean(a.lo + b.lo, a.hi + b.hi)
        if op == "sub":
            return _clean(a.lo - b.hi, a.hi - b.lo)
        if op == "mul":
            return _mul(a, b)
        if op in ("div", "floordiv"):
            return _div(a, b, floor=op == "floordiv")
        if op == "mod":
            return _mod(a, b)
        if op == "min":
            return Interval(torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi))
        return Interval(torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi))  # max


# ----------------------------------------------------------------------------- range queries
def _range_extreme(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, largest: bool) -> torch.Tensor:
    """min (or max) of x[g..., lo:hi+1, rest...] per grid point g, by a sparse table.

    x: [g0, g1, g2, g3, L, *rest] (grid axes may be 1); lo, hi: integer tensors broadcastable
    to the grid [G0, G1, G2, G3]. Returns [G0, G1, G2, G3, *rest]. Cost O(|x| log L); O(|x|)
    where every range is one point (a read at b or h) or the ranges are aligned blocks of one
    size (a read at i or j over the tiles: a dense [N, M] mask's classes, 13.8 s -> 0.1 s at
    N = M = 2048, B x H = 8, session 54).
    """
    length = x.shape[4]
    lo = lo.clamp(0, length - 1)
    hi = torch.maximum(hi.clamp(0, length - 1), lo)
    grid = torch.broadcast_shapes(x.shape[:4], lo.shape)
    idx = [
        torch.arange(s, device="cpu").view([-1 if a == d else 1 for a in range(4)])
        if x.shape[d] > 1
        else torch.zeros(1, dtype=torch.long, device="cpu").view(1, 1, 1, 1)
        for d, s in enumerate(grid)
    ]
    if bool((lo == hi).all()):
        return x[(*idx, lo)]
    size = int((hi - lo).max()) + 1
    if bool(((lo % size) == 0).all() and (hi == (lo + size - 1).clamp(max=length - 1)).all()):
        blocks = -(-length // size)
        if blocks * size > length:  # (the last block's missing rows: neutral for the reduction)
            limits = torch.finfo(x.dtype) if x.is_floating_point() else torch.iinfo(x.dtype)
            tail = x.new_full(
                (*x.shape[:4], blocks * size - length, *x.shape[5:]), limits.min if largest else limits.max
            )
            x = torch.cat([x, tail], 4)
        shaped = x.reshape(*x.shape[:4], blocks, size, *x.shape[5:])
        reduced = shaped.amax(5) if largest else shaped.amin(5)
        return reduced[(*idx, lo // size)]
    levels = [x]
    span = 1
    while span * 2 <= length:
        prev = levels[-1]
        shifted = prev.narrow(4, span, prev.shape[4] - span)
        merged = (
            torch.maximum(prev.narrow(4, 0, shifted.shape[4]), shifted)
            if largest
            else torch.minimum(prev.narrow(4, 0, shifted.shape[4]), shifted)
        )
        levels.append(merged)
        span *= 2
    table = torch.stack([torch.nn.functional.pad(t, [0, 0] * (t.dim() - 5) + [0, length - t.shape[4]]) for t in levels])
    count = hi - lo + 1
    level = torch.floor(torch.log2(count.double())).long().clamp(max=len(levels) - 1)
    first = table[(level, *idx, lo)]
    second = table[(level, *idx, hi - (1 << level) + 1)]
    return torch.maximum(first, second) if largest else torch.minimum(first, second)


def _read_tensor_interval(t: torch.Tensor, index: list[Interval]) -> Interval:
    """Bounds of t over the index box given per grid point. A dim of stride 0 (an expanded
    tensor: an [N, M] mask read as [B, H, N, M]) is read as one row: its values are that row's."""
    t = t[tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None) for stride, size in zip(t.stride(), t.shape))]
    # (bool and int tensors reduced as they are, in float64 after: a dense mask's 16 M bools
    # were 128 MB of float64 before)
    # (uint16-64 as the kernels read them, int64: torch reduces none of them)
    wide_unsigned = t.dtype in (torch.uint16, torch.uint32, torch.uint64)
    x = (
        t.view(torch.uint8)
        if t.dtype == torch.bool
        else t.double()
        if t.is_floating_point()
        else t.long()
        if wide_unsigned
        else t
    ).reshape((1, 1, 1, 1, *t.shape))
    lo_x, hi_x = (
        (x.nan_to_num(-math.inf, math.inf, -math.inf), x.nan_to_num(math.inf, math.inf, -math.inf))
        if t.is_floating_point()
        else (x, x)
    )  # NaN: anything
    for iv in index:
        lo_i, hi_i = iv.lo.long(), iv.hi.long()
        if lo_i.dim() < 4:
            lo_i = lo_i.reshape((1,) * (4 - lo_i.dim()) + tuple(lo_i.shape))
            hi_i = hi_i.reshape((1,) * (4 - hi_i.dim()) + tuple(hi_i.shape))
        lo_x = _range_extreme(lo_x, lo_i, hi_i, largest=False)
        hi_x = _range_extreme(hi_x, lo_i, hi_i, largest=True)
    return Interval(lo_x.double(), hi_x.double())


# ----------------------------------------------------------------------------- call time
@dataclass(frozen=True)
class Problem:
    """Sizes of one call."""

    B: int
    H: int
    Hkv: int
    N: int
    M: int
    D: int  # q's and k's head dim
    Dv: int = -1  # v's (and out's) head dim; D when not given

    def __post_init__(self) -> None:
        if self.Dv == -1:
            object.__setattr__(self, "Dv", self.D)

    def __str__(self) -> str:
        value_dim = f" Dv={self.Dv}" if self.Dv != self.D else ""
        return f"B={self.B} H={self.H} Hkv={self.Hkv} N={self.N} M={self.M} D={self.D}{value_dim}"

    def size_env(self) -> dict[str, Interval]:
        return {name: _point(float(getattr(self, name))) for name in ex.SIZE_VARS}


def runtime_tensors(
    info: SparsityInfo,
    problem: Problem,
    tensors: Mapping[str, torch.Tensor],
    scalars: Mapping[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """The call's tensors plus the generated layout grids (spanning `info.grid_sizes`: the
    problem's N and M, or the scalars of that name)."""
    out = dict(tensors)
    sizes = {"N": problem.N, "M": problem.M, **(scalars or {})}
    n, m = (int(sizes[name]) for name in info.grid_sizes)
    for name, layout in info.layout_grids:
        out[name] = layout_grid(layout, n, m)
    return out


#: Problems of at most this many positions (B or 1, H or 1, N, M: a decoding step's) take their
#: tile classes from the mask's value at every position (`_classes_by_position`) rather than from
#: intervals over each tile: exact, and faster there, where a decoding step classifies anew for
#: every token (M grows): 43 against 670 us for the transformers integration's key ranges at
#: B=4 M=264 (Zen 4), most of a new step's host time.
CLASSES_BY_POSITION_MAX = 1 << 16
#: The same for problems of one query tile (a decoding step's, GQA's group folded into its rows
#: included), whose positions are counted without padding rows to whole tiles: by position up to
#: this many, where the intervals' ~100 small tensor ops cost more (B=8 M=4096 with 32/8 heads
#: folded, 131K positions: 241 against 721 us; at 1M positions 936 against 726 us; Zen 4, one
#: thread). Above CLASSES_BY_POSITION_MAX with several query tiles, the intervals win: 2.6 ms
#: against 1.1 ms at N = M = 512.
CLASSES_BY_POSITION_ONE_ROW_MAX = 1 << 19
#: Tiles classified at once by intervals (`classify_tiles`): their temporaries' size
CLASSIFIED_TILES_PER_BAND = 1 << 20
#: The most tile classes one call's plan holds (a byte each)
TILE_CLASSES_MAX = 1 << 32


@functools.lru_cache(maxsize=256)
def _predicate_types(predicate: ex.Expr) -> tuple[bool, dict[str, str]]:
    """Whether `predicate` computes with floats, and the type of each name it reads (walked
    once per predicate, not per call)."""
    nodes = list(ex.walk(predicate))
    return any(node.ty == ex.FLOAT for node in nodes), {n.name: n.ty for n in nodes if isinstance(n, ex.Var)}


@functools.lru_cache(maxsize=64)
def _position_axis(size: int, dim: int) -> torch.Tensor:
    """0 .. size-1 along dimension `dim` of four (b, h, i, j), read only: kept, since a
    decoding step's classes take the same B, H and N at every token."""
    shape = [1, 1, 1, 1]
    shape[dim] = size
    return torch.arange(size, device="cpu").view(shape)


def _classes_by_position(
    predicate: ex.Expr,
    problem: Problem,
    scalars: Mapping[str, float],
    tensors: Mapping[str, torch.Tensor],
    shape: tuple[int, int, int, int],
    block_rows: int,
    block_cols: int,
) -> torch.Tensor | None:
    """Tile classes [shape] from `predicate` evaluated at every position of a padded problem
    by the eager reference's evaluator (the program's meaning): EMPTY where no position is
    visible, FULL where all are. None where the problem has more than CLASSES_BY_POSITION_MAX
    positions (CLASSES_BY_POSITION_ONE_ROW_MAX in one query tile) or the predicate computes
    with floats (the kernels round those in their own precision: an interval keeps such a tile
    partial, so that they decide each position). The caller has checked the predicate's reads
    and divisors (`check_reads_and_divisors`)."""
    B, H, ti, tj = shape
    N, M = problem.N, problem.M
    computes_floats, kinds = _predicate_types(predicate)
    most = CLASSES_BY_POSITION_ONE_ROW_MAX if ti == 1 else CLASSES_BY_POSITION_MAX
    if B * H * N * M > most or computes_floats:
        return None
    as_type = {ex.INT: int, ex.BOOL: bool, ex.FLOAT: float}
    env: dict[str, object] = {name: int(getattr(problem, name)) for name in ex.SIZE_VARS}
    env.update({name: as_type[kinds.get(name, ex.FLOAT)](value) for name, value in scalars.items()})
    # int tensors as the kernels read them, int64 (uint8 / int8 / int32 values wrapped in their
    # own dtype's arithmetic, and torch has none for uint16-64: review of session 57)
    tensors = {
        name: t if t.is_floating_point() or t.dtype == torch.bool else t.to(torch.int64) for name, t in tensors.items()
    }
    env.update(b=_position_axis(B, 0), h=_position_axis(H, 1), i=_position_axis(N, 2), j=_position_axis(M, 3))
    visible = evaluate(predicate, env, tensors, checked=True).expand(B, H, N, M)  # type: ignore[arg-type]
    # visible positions per tile: summed over each tile's rows (one query tile: a decoding
    # step's row as it is, where padding it to Br took 3.3 ms at B=8 M=4096 Br=64), then over
    # its columns, padded to whole tiles. Few operations: a decoding step classifies anew for
    # every token, at 2-5 us of host time each (26 of them took 179 us at B=4 M=401 on Zen 4)
    if ti == 1:
        counts = visible.sum(2, keepdim=True, dtype=torch.int32)
    else:
        counts = pad(visible.to(torch.int32), (0, 0, 0, ti * block_rows - N)).view(B, H, ti, block_rows, M).sum(3)
    counts = pad(counts, (0, tj * block_cols - M)).view(B, H, ti, tj, block_cols).sum(4)
    rows = [min(block_rows, N - first) for first in range(0, N, block_rows)]  # each tile's
    cols = [min(block_cols, M - first) for first in range(0, M, block_cols)]
    positions = torch.tensor([[r * c for c in cols] for r in rows], device="cpu")
    # EMPTY 0 where no position is visible, PARTIAL 1 where some are, FULL 2 where all are
    return (counts > 0).to(torch.uint8) + (counts == positions)


def classify_tiles(
    info: SparsityInfo,
    problem: Problem,
    scalars: Mapping[str, float],
    tensors: Mapping[str, torch.Tensor],
    block_rows: int,
    block_cols: int,
    lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """uint8 [B or 1, H or 1, ceil(N/Br), ceil(M/Bc)] of EMPTY / PARTIAL / FULL. With `lengths`
    (a packed batch: int64 [B] query and key counts, N and M the longest), the sizes N and M are
    each sequence's own, the classes [B, H or 1, ...], and tiles past a sequence's end EMPTY."""
    ti, tj = -(-problem.N // block_rows), -(-problem.M // block_cols)
    per_batch = info.varies_with_batch or lengths is not None
    shape = (problem.B if per_batch else 1, problem.H if info.varies_with_head else 1, ti, tj)
    if math.prod(shape) > TILE_CLASSES_MAX:  # (before any allocation: the process was killed for memory)
        raise InputError(
            f"{problem}: {' x '.join(map(str, shape))} tiles of {block_rows} x {block_cols} to classify, more than "
            f"attncc maps ({TILE_CLASSES_MAX}); split the sequence (context parallelism) or the batch"
        )
    if info.predicate is None and lengths is None:
        return torch.full((1, 1, ti, tj), FULL, dtype=torch.uint8, device="cpu").expand(shape).contiguous()
    if 0 in shape:  # (an empty batch or no heads: no tile, and no row of the tensors to read)
        return torch.empty(shape, dtype=torch.uint8, device="cpu")
    if lengths is None:
        exact = _classes_by_position(info.predicate, problem, scalars, tensors, shape, block_rows, block_cols)  # type: ignore[arg-type]
        if exact is not None:
            return exact
    # (in bands of tile rows: the intervals' temporaries are float64 [rows, Tj] each, ~4 GB at
    # once for N = M = 1M with 64 x 64 tiles; a band's take CLASSIFIED_TILES_PER_BAND)
    band = max(1, CLASSIFIED_TILES_PER_BAND // (tj * shape[0] * shape[1]))
    bands = [
        _interval_classes(info, problem, scalars, tensors, shape, block_rows, block_cols, lengths, first, min(first + band, ti))
        for first in range(0, ti, band)
    ]  # fmt: skip
    return bands[0] if len(bands) == 1 else torch.cat(bands, 2)


def _interval_classes(
    info: SparsityInfo,
    problem: Problem,
    scalars: Mapping[str, float],
    tensors: Mapping[str, torch.Tensor],
    shape: tuple[int, int, int, int],
    block_rows: int,
    block_cols: int,
    lengths: tuple[torch.Tensor, torch.Tensor] | None,
    first_row: int,
    end_row: int,
) -> torch.Tensor:
    """`classify_tiles`' classes of tile rows first_row .. end_row - 1, from the predicate's
    intervals over each tile."""
    tj = shape[3]
    shape = (shape[0], shape[1], end_row - first_row, tj)
    rows = torch.arange(first_row, end_row, dtype=torch.float64, device="cpu").view(1, 1, -1, 1) * block_rows
    cols = torch.arange(tj, dtype=torch.float64, device="cpu").view(1, 1, 1, -1) * block_cols
    last_row, last_col = float(problem.N - 1), float(problem.M - 1)
    if lengths is not None:
        n, m = (t.to(torch.float64).view(-1, 1, 1, 1) for t in lengths)
        last_row, last_col = n - 1, m - 1
    if info.predicate is None:
        cls = torch.full((1, 1, end_row - first_row, tj), FULL, dtype=torch.uint8, device="cpu")
    else:
        env = problem.size_env()
        if lengths is not None:
            env["N"], env["M"] = _point(n), _point(m)
        env.update({name: _point(float(v)) for name, v in scalars.items()})
        env["b"] = _point(torch.arange(shape[0], dtype=torch.float64, device="cpu").view(-1, 1, 1, 1))
        env["h"] = _point(torch.arange(shape[1], dtype=torch.float64, device="cpu").view(1, -1, 1, 1))
        # (float64 bounds: under a bf16 default dtype the last row or key was rounded and visible
        # tiles were classified empty, session 67's review)
        env["i"] = Interval(rows, torch.minimum(rows + block_rows - 1, _float64(last_row)))
        env["j"] = Interval(cols, torch.minimum(cols + block_cols - 1, _float64(last_col)))
        truth = _as_truth(IntervalEvaluator(env, _reader(tensors))(info.predicate))
        cls = torch.where(~truth.may_true, EMPTY, torch.where(~truth.may_false, FULL, PARTIAL)).to(torch.uint8)
    cls = cls.expand(shape)
    if lengths is not None:
        cls = torch.where((rows > last_row) | (cols > last_col), EMPTY, cls).to(torch.uint8)
    return cls.contiguous()


def partial_fraction(classes: torch.Tensor) -> float:
    """Of the visible (non-empty) tiles, the fraction that is partial (the mask evaluated)."""
    _, partial, full = torch.bincount(classes.reshape(-1), minlength=3).tolist()
    return partial / (partial + full) if partial + full else 0.0


def visible_keys(classes: torch.Tensor, block_cols: int, m: int) -> int:
    """The most keys one query tile sees: its non-empty key tiles times Bc, at most M."""
    if classes.numel() == 0:
        return 0
    return min(m, int(torch.count_nonzero(classes, -1).max()) * block_cols)  # (EMPTY is 0)


def _reader(tensors: Mapping[str, torch.Tensor]):  # noqa: ANN202
    def read(r: ex.Read, index: list[Interval]) -> Interval:
        return _read_tensor_interval(tensors[r.tensor], index)

    return read


def host_read_tensors(predicate: ex.Expr | None, score: ex.Expr) -> frozenset[str]:
    """The runtime tensors whose *values* the call-time host work reads: those in the
    visibility predicate (tile classes) and those inside a read's index or an integer divisor
    (`check_reads_and_divisors`). Of any other tensor (ALiBi slopes, a bias table) only the
    shape matters on the host, so a GPU call need not copy it there."""
    exprs = [score] + ([predicate] if predicate is not None else [])
    names = {r.tensor for r in ex.reads(predicate)} if predicate is not None else set()
    for e in exprs:
        for node in ex.walk(e):
            if isinstance(node, ex.Read):
                names.update(r.tensor for index in node.index for r in ex.reads(index))
            elif _is_int_division(node):
                names.update(r.tensor for r in ex.reads(node.b))  # type: ignore[attr-defined]
    return frozenset(names)


def _is_int_division(node: ex.Expr) -> bool:
    """An integer `//` or `%`: its divisor must not be 0 (`check_reads_and_divisors`)."""
    return isinstance(node, ex.Binary) and node.op in ("floordiv", "mod") and node.ty == ex.INT


@functools.lru_cache(maxsize=256)
def _checked_nodes(exprs: tuple[ex.Expr, ...]) -> tuple[tuple[ex.Binary, ...], tuple[ex.Read, ...]]:
    """The integer divisions and the tensor reads of `exprs` (walked once per expressions, not
    per call)."""
    divisions = tuple(node for e in exprs for node in ex.walk(e) if _is_int_division(node))
    return divisions, tuple(r for e in exprs for r in ex.reads(e))  # type: ignore[return-value]


#: Read checks passed, by all they depend on (`_read_check_key`), the last READ_CHECKS_KEPT: a
#: decoding step's M grows with every token, but reads indexed by b alone (the transformers
#: integration's key ranges) do not depend on it; their intervals took ~100 us per new step.
_READ_CHECKS: dict[tuple, None] = {}
READ_CHECKS_KEPT = 256
READ_CHECK_VALUES_MAX = 4096  # values of a table a check's key keeps as they are (beyond: a digest)
_READ_CHECKS_LOCK = module_lock(__name__, "_READ_CHECKS_LOCK")


@functools.lru_cache(maxsize=256)
def _read_check_inputs(exprs: tuple[ex.Expr, ...]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """What `check_reads_and_divisors` of `exprs` reads: the names free in the read indices and
    integer divisors (b, h, i, j stand for their ranges, B .. D and scalars for their values),
    the tensors read (their shapes bound the indices) and those read inside an index or a
    divisor (their values)."""
    divisions, reads = _checked_nodes(exprs)
    checked = [index for r in reads for index in r.index] + [node.b for node in divisions]
    names = sorted(set().union(*(ex.free_vars(e) for e in checked)))
    valued = sorted({r.tensor for e in checked for r in ex.reads(e)})
    return tuple(names), tuple(sorted({r.tensor for r in reads})), tuple(valued)


def _read_check_key(
    exprs: tuple[ex.Expr, ...], problem: Problem, scalars: Mapping[str, float], tensors: Mapping[str, torch.Tensor]
) -> tuple | None:
    """All a padded problem's read checks depend on (`_read_check_inputs`), or None where a
    tensor whose values they read is not on the CPU."""
    names, shaped, valued = _read_check_inputs(exprs)
    ranges = {"b": problem.B, "h": problem.H, "i": problem.N, "j": problem.M}
    values = []
    for name in names:
        value = ranges.get(name, getattr(problem, name, None) if name in ex.SIZE_VARS else scalars.get(name))
        values.append((name, value, math.copysign(1.0, value) if isinstance(value, float) else None))
    if any(tensors[name].device.type != "cpu" for name in valued):
        return None
    contents = tuple(_table_key(tensors[name]) for name in valued)
    return (exprs, tuple(values), tuple(tuple(tensors[name].shape) for name in shaped), contents)


def _table_key(t: torch.Tensor) -> tuple:
    """`values_key`, or past READ_CHECK_VALUES_MAX values a digest of them: READ_CHECKS_KEPT keys
    held a copy of a 1 MiB bucket table each (256 MiB), and checking such a table on every call
    instead took 2-8x the host time of a digest."""
    if t.numel() <= READ_CHECK_VALUES_MAX:
        return values_key(t)
    dtype, shape, data = values_key(t)
    return (dtype, shape, hashlib.blake2b(data, digest_size=32).digest())


def values_key(t: torch.Tensor) -> tuple:
    """A CPU tensor's values as a key: dtype, shape and bytes (-0.0 is not 0.0 there: a miss,
    never a wrong hit), copied from its memory (~1 us; the 4096 values of a decoding step's
    mask were ~60 us as a tuple of Python numbers); a negative-bit view by its values. (Not
    through numpy, which attncc does not require: without it every call whose host reads a
    runtime tensor raised "Numpy is not available" until session 58.)"""
    # (a plain contiguous CPU tensor as it is: a decoding call's key ranges are keyed on every call)
    if not (type(t) is torch.Tensor and t.device.type == "cpu" and not t.is_neg() and t.is_contiguous()):
        t = t.detach().resolve_neg()
        t = (t if t.device.type == "cpu" else t.cpu()).contiguous()
        if type(t) is not torch.Tensor:  # (a subclass's memory may not be where data_ptr says: its bytes as numbers)
            return (t.dtype, tuple(t.shape), bytes(t.reshape(-1).view(torch.uint8).tolist()))
    size = t.numel() * t.element_size()
    return (t.dtype, tuple(t.shape), ctypes.string_at(t.data_ptr(), size) if size else b"")


def check_reads_and_divisors(
    predicate_and_score: list[ex.Expr],
    problem: Problem,
    scalars: Mapping[str, float],
    tensors: Mapping[str, torch.Tensor],
    lengths: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Raise InputError if any tensor read can index outside its tensor for these sizes, or an
    integer division's divisor can be 0.

    Bounds come from the same interval evaluation over the whole problem (b in [0, B), ...),
    so a read proven in range needs no check inside the kernel. With `lengths` (a packed batch,
    as in `classify_tiles`) over each sequence that has queries and keys, at its own N and M.
    """
    exprs = tuple(predicate_and_score)
    divisors, reads = _checked_nodes(exprs)
    if not divisors and not reads:  # nothing to bound (and no intervals to build: ~0.15 ms per packed call)
        return
    key = _read_check_key(exprs, problem, scalars, tensors) if lengths is None else None
    if key is not None and key in _READ_CHECKS:
        return
    _check_reads_and_divisors(divisors, reads, problem, scalars, tensors, lengths)
    if key is not None:
        with _READ_CHECKS_LOCK:
            if len(_READ_CHECKS) >= READ_CHECKS_KEPT:
                _READ_CHECKS.pop(next(iter(_READ_CHECKS)))  # the oldest key
            _READ_CHECKS[key] = None


def _nonzero_read(divisor: ex.Expr, evaluator: IntervalEvaluator, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether `divisor` is a table read none of whose entries in reach (the box its index
    intervals span) is 0: a table of both signs, [-2, 2], spans an interval holding 0 and was
    refused, though no entry divides by it."""
    if not isinstance(divisor, ex.Read):
        return False
    table = tensors[divisor.tensor]
    box = []
    for dim, index in enumerate(divisor.index):
        reach = _as_interval(evaluator(index))
        lo, hi = max(math.floor(float(reach.lo.min())), 0), min(math.ceil(float(reach.hi.max())), table.shape[dim] - 1)
        box.append(slice(lo, hi + 1))
    return not bool((table[tuple(box)] == 0).any())


def _check_reads_and_divisors(
    divisors: tuple[ex.Binary, ...],
    reads: tuple[ex.Read, ...],
    problem: Problem,
    scalars: Mapping[str, float],
    tensors: Mapping[str, torch.Tensor],
    lengths: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """`check_reads_and_divisors` by intervals, every time."""
    env = problem.size_env()
    env.update({name: _point(float(v)) for name, v in scalars.items()})
    for name, size in (("b", problem.B), ("h", problem.H), ("i", problem.N), ("j", problem.M)):
        env[name] = Interval(_float64(0.0), _float64(size - 1))
    if lengths is not None:
        live = ((lengths[0] > 0) & (lengths[1] > 0)).nonzero().flatten()
        if live.numel() == 0:
            return
        n, m = (t[live].to(torch.float64) for t in lengths)
        env["N"], env["M"], env["b"] = _point(n), _point(m), _point(live.to(torch.float64))
        env["i"], env["j"] = Interval(torch.zeros_like(n), n - 1), Interval(torch.zeros_like(m), m - 1)
    env["s"] = Interval(_float64(-math.inf), _float64(math.inf))
    env["scale"] = env["s"]
    reader = _reader(tensors)
    evaluator = IntervalEvaluator(env, reader)
    for node in divisors:  # an integer // or % by 0 has no value (Python raises)
        divisor = _as_interval(evaluator(node.b))
        if bool(((divisor.lo <= 0) & (divisor.hi >= 0)).any()) and not _nonzero_read(node.b, evaluator, tensors):
            raise InputError(
                f"`{ex.render(node)}`: the divisor `{ex.render(node.b)}` can be 0 for N={problem.N}, "
                f"M={problem.M}, B={problem.B}, H={problem.H} and these inputs (a `where` around the division "
                f"does not guard it: the reference and the tile classes evaluate both its sides, in torch; write a "
                f"divisor that cannot be 0, such as `max({ex.render(node.b)}, 1)`)"
            )
    for r in reads:
        t = tensors[r.tensor]
        for dim, index in enumerate(r.index):
            iv = _as_interval(evaluator(index))
            lo, hi = float(iv.lo.min()), float(iv.hi.max())
            if lo < 0 or hi > t.shape[dim] - 1:
                shown = r.tensor if not r.tensor.startswith("__layout") else "a layout grid"
                sizes = f"N={problem.N}, M={problem.M}, B={problem.B}, H={problem.H}"
                if lengths is not None:  # (a packed batch: the first sequence whose sizes reach past it)
                    # (per sequence, the last dim: an index reading a tensor has grid-shaped bounds,
                    # [1, 1, 1, sequences], which expanding to [sequences] failed on)
                    lo_b, hi_b = (torch.broadcast_tensors(x, n)[0].reshape(-1, n.numel()) for x in (iv.lo, iv.hi))
                    lo_b, hi_b = lo_b.amin(0), hi_b.amax(0)
                    outside = ((lo_b < 0) | (hi_b > t.shape[dim] - 1)).nonzero()
                    k = int(outside[0, 0]) if outside.numel() else 0
                    lo, hi = float(lo_b[k]), float(hi_b[k])
                    sizes = f"sequence b={int(live[k])} of N={int(n[k])}, M={int(m[k])} (H={problem.H})"
                raise InputError(
                    f"{shown}[{', '.join(map(str, r.index))}]: index {dim} ({index}) ranges over "
                    f"[{lo:.0f}, {hi:.0f}] for {sizes}, but {shown} has size {t.shape[dim]} in dimension {dim} "
                    "(a read is checked at every position of the problem, whatever masks or `where` conditions "
                    "surround it: the kernels compute score maps before they mask, and a learnable input's "
                    "gradient at every read; clamp the index, e.g. with min and max)"
                )
