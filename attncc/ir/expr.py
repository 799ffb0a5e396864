"""Scalar expression trees: the language of score modifications and mask predicates.

An expression is evaluated once per score element. Its free variables are the score `s`
(the scaled product q.k), the indices `b`, `h`, `i` (query), `j` (key), the problem sizes
`B`, `H`, `Hkv`, `N`, `M`, `D`, the scale, and the program's scalar inputs; it may read the
program's tensor inputs by index. Nodes are frozen dataclasses, so equal trees hash equal and
can be shared freely between graphs.

Every node carries its type: "int" (64-bit), "float" (the accumulator type of the kernel) or
"bool". Types are computed by the constructors below, which are the only way passes build
nodes, so a tree is well-typed by construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

INT, FLOAT, BOOL = "int", "float", "bool"

#: Variables bound per score element and per problem; everything else is a program input.
INDEX_VARS = ("b", "h", "i", "j")
SIZE_VARS = ("B", "H", "Hkv", "N", "M", "D")
SCORE_VAR = "s"

#: Rounding a number to an integer (`floor`, `ceil`, `trunc` toward zero, `round` half to even):
#: the result is an int, saturated at int64's range, 0 for NaN (as Rust's float-to-int casts), so
#: every value, inf and NaN included, has one answer in the kernels, the reference and folding.
ROUNDING_OPS = ("floor", "ceil", "trunc", "round")
UNARY_OPS = ("neg", "not", "abs", "exp", "log", "tanh", "sqrt", *ROUNDING_OPS)
ARITH_OPS = ("add", "sub", "mul", "div", "floordiv", "mod", "min", "max")
COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
LOGIC_OPS = ("and", "or")
BINARY_OPS = ARITH_OPS + COMPARE_OPS + LOGIC_OPS

SYMBOLS = {
    "add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
    "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=",
    "and": "and", "or": "or",
}  # fmt: skip


@dataclass(frozen=True)
class Expr:
    """Base of all expression nodes."""

    @property
    def ty(self) -> str:
        raise NotImplementedError

    def children(self) -> tuple[Expr, ...]:
        return ()

    def __str__(self) -> str:
        return render(self)


@dataclass(frozen=True)
class Const(Expr):
    value: float | int | bool
    type_: str

    @property
    def ty(self) -> str:
        return self.type_


@dataclass(frozen=True)
class Var(Expr):
    name: str
    type_: str

    @property
    def ty(self) -> str:
        return self.type_


@dataclass(frozen=True)
class Read(Expr):
    """`tensor[index...]`: an element of a runtime tensor input."""

    tensor: str
    index: tuple[Expr, ...]
    type_: str

    @property
    def ty(self) -> str:
        return self.type_

    def children(self) -> tuple[Expr, ...]:
        return self.index


@dataclass(frozen=True)
class Unary(Expr):
    op: str
    x: Expr

    @property
    def ty(self) -> str:
        if self.op == "not":
            return BOOL
        if self.op in ("neg", "abs"):
            return self.x.ty
        return INT if self.op in ROUNDING_OPS else FLOAT

    def children(self) -> tuple[Expr, ...]:
        return (self.x,)


@dataclass(frozen=True)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr

    @property
    def ty(self) -> str:
        if self.op in COMPARE_OPS or self.op in LOGIC_OPS:
            return BOOL
        if self.op == "div":
            return FLOAT
        return INT if self.a.ty == INT and self.b.ty == INT else FLOAT

    def children(self) -> tuple[Expr, ...]:
        return (self.a, self.b)


@dataclass(frozen=True)
class Where(Expr):
    cond: Expr
    a: Expr
    b: Expr

    @property
    def ty(self) -> str:
        if self.a.ty == self.b.ty:
            return self.a.ty
        return FLOAT

    def children(self) -> tuple[Expr, ...]:
        return (self.cond, self.a, self.b)


# ----------------------------------------------------------------------------- constructors
def const(value: float | int | bool) -> Const:
    if isinstance(value, bool):
        return Const(value, BOOL)
    if isinstance(value, int):
        return Const(value, INT)
    return Const(float(value), FLOAT)


def var(name: str, type_: str = INT) -> Var:
    return Var(name, type_)


def score() -> Var:
    return Var(SCORE_VAR, FLOAT)


def walk(e: Expr) -> Iterator[Expr]:
    """Every node of the tree, parents before children."""
    stack = [e]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children()))


def free_vars(e: Expr) -> set[str]:
    return {n.name for n in walk(e) if isinstance(n, Var)}


def reads(e: Expr) -> list[Read]:
    """The distinct tensor reads in `e`, in first-occurrence order."""
    seen: dict[Read, None] = {}
    for n in walk(e):
        if isinstance(n, Read):
            seen.setdefault(n, None)
    return list(seen)


def depth(e: Expr) -> int:
    return 1 + max((depth(c) for c in e.children()), default=0)


def rebuild(e: Expr, kids: tuple[Expr, ...]) -> Expr:
    """`e` with its children replaced by `kids` (same node kind and attributes)."""
    if isinstance(e, Read):
        return Read(e.tensor, kids, e.type_)
    if isinstance(e, Unary):
        return Unary(e.op, kids[0])
    if isinstance(e, Binary):
        return Binary(e.op, kids[0], kids[1])
    if isinstance(e, Where):
        return Where(kids[0], kids[1], kids[2])
    return e


def substitute(e: Expr, mapping: dict[Expr, Expr]) -> Expr:
    """Replace every subtree equal to a key of `mapping` by its value."""
    if e in mapping:
        return mapping[e]
    kids = e.children()
    if not kids:
        return e
    return rebuild(e, tuple(substitute(k, mapping) for k in kids))


# ----------------------------------------------------------------------------- folding
_PY_BINARY: dict[str, Callable[[float, float], float | bool]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b,
    "floordiv": lambda a, b: a // b,
    "mod": lambda a, b: a % b,
    # NaN from either operand, as the kernels and torch.minimum (Python's min(4.5, NaN) is 4.5)
    "min": lambda a, b: a if a != a else b if b != b else min(a, b),
    "max": lambda a, b: a if a != a else b if b != b else max(a, b),
    "lt": lambda a, b: a < b,
    "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b,
    "ne": lambda a, b: a != b,
    "and": lambda a, b: bool(a) and bool(b),
    "or": lambda a, b: bool(a) or bool(b),
}
_PY_UNARY: dict[str, Callable[[float], float | bool]] = {
    "neg": lambda x: -x,
    "not": lambda x: not x,
    "abs": abs,
    "exp": math.exp,
    "log": math.log,
    "tanh": math.tanh,
    "sqrt": math.sqrt,
    **{op: lambda x, op=op: saturated_int(_PY_ROUNDING[op](x) if math.isfinite(x) else x) for op in ROUNDING_OPS},
}


_INT64_LIMIT = 2**63
_PY_ROUNDING: dict[str, Callable[[float], float]] = {
    "floor": math.floor,
    "ceil": math.ceil,
    "trunc": math.trunc,
    "round": round,  # (half to even, as torch.round and the kernels' rint)
}


def saturated_int(rounded: float) -> int:
    """An integral float (or +-inf, NaN) as ROUNDING_OPS define it: int64's range, NaN 0."""
    if math.isnan(rounded):
        return 0
    if rounded >= _INT64_LIMIT:
        return _INT64_LIMIT - 1
    return int(max(rounded, -_INT64_LIMIT))


def python_number(value: object) -> object:
    """numpy's scalars (np.int64(4), np.float32(0.5), np.True_, 0-d arrays) as the Python
    numbers they hold, for a constant or a name's value; anything else as given."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return value.item()  # type: ignore[attr-defined]
    return value


def _typed_const(value: float | int | bool, ty: str) -> Const:
    if ty == BOOL:
        return Const(bool(value), BOOL)
    if ty == INT:  # (wrapped to int64, as the kernels compute: 2^63 - 1 + 1 is -2^63)
        return Const((int(value) + _INT64_LIMIT) % (2 * _INT64_LIMIT) - _INT64_LIMIT, INT)
    return Const(float(value), FLOAT)


def fold(e: Expr) -> Expr:
    """Constant-fold `e` and apply algebraic identities that are exact in floating point.

    Guarantees: no operator node has only constant operands (unless folding would raise, e.g.
    a division by zero, which is left for run time), `x + 0`, `x * 1`, `x - 0`, `x / 1`,
    `--x`, `where(true, a, b)`, `c and true`, `c or false` are simplified.
    """
    kids = tuple(fold(k) for k in e.children())
    if kids:
        e = rebuild(e, kids)
    if isinstance(e, Unary):
        if isinstance(e.x, Const):
            try:
                return _typed_const(_PY_UNARY[e.op](e.x.value), e.ty)
            except (ValueError, OverflowError):
                return e
        if e.op == "neg" and isinstance(e.x, Unary) and e.x.op == "neg":
            return e.x.x
        return e
    if isinstance(e, Binary):
        a, b = e.a, e.b
        if isinstance(a, Const) and isinstance(b, Const):
            try:
                return _typed_const(_PY_BINARY[e.op](a.value, b.value), e.ty)
            except (ZeroDivisionError, ValueError, OverflowError):
                return e
        return _identities(e)
    if isinstance(e, Where) and isinstance(e.cond, Const):
        chosen = e.a if e.cond.value else e.b
        if chosen.ty != e.ty:  # keep the promoted type of the where
            return Binary("mul", chosen, const(1.0))
        return chosen
    return e


def _is_const(e: Expr, value: float) -> bool:
    return isinstance(e, Const) and e.type_ != BOOL and e.value == value


def _identities(e: Binary) -> Expr:
    a, b, op = e.a, e.b, e.op

    def same_type(x: Expr) -> Expr | None:
        return x if x.ty == e.ty else None

    # (x + 0.0 is +0.0 where x is -0.0, and x - (-0.0) too: a float zero is added only where its
    # sign is negative and subtracted only where positive; a where on 1 / x saw the other sign,
    # session 64's review. Integers have one zero.)
    if op == "add":
        if _is_const(b, 0) and (e.ty != FLOAT or math.copysign(1.0, b.value) < 0):  # type: ignore[attr-defined]
            return same_type(a) or e
        if _is_const(a, 0) and (e.ty != FLOAT or math.copysign(1.0, a.value) < 0):  # type: ignore[attr-defined]
            return same_type(b) or e
    if op == "sub" and _is_const(b, 0) and (e.ty != FLOAT or math.copysign(1.0, b.value) > 0):  # type: ignore[attr-defined]
        return same_type(a) or e
    if op == "mul":
        if _is_const(b, 1):
            return same_type(a) or e
        if _is_const(a, 1):
            return same_type(b) or e
    if op == "div" and _is_const(b, 1) and a.ty == FLOAT:
        return a
    if op == "and":
        if isinstance(a, Const):
            return b if a.value else a
        if isinstance(b, Const):
            return a if b.value else b
    if op == "or":
        if isinstance(a, Const):
            return a if a.value else b
        if isinstance(b, Const):
            return b if b.value else a
    return e


# ----------------------------------------------------------------------------- differentiation
def diff(e: Expr, wrt: Expr) -> Expr:
    """The symbolic derivative d e / d wrt, where `wrt` is a float Var or Read leaf.

    Comparisons, floor division and modulo are piecewise constant, so their derivative is 0;
    `where` takes the derivative of the branch it selects, `min` and `max` of the operand they
    select and half of each at a tie, `abs` the sign (0 at 0): torch's conventions, which the
    reference's autograd and Flex's score_mod follow (session 60: a tie gave one operand all of
    it, abs'(0) was 1, so a learnable input starting at 0 got other gradients).
    """
    return fold(_diff(e, wrt))


def _add(a: Expr, b: Expr) -> Expr:
    if _is_const(a, 0):
        return b
    return a if _is_const(b, 0) else Binary("add", a, b)


def _sub(a: Expr, b: Expr) -> Expr:
    if _is_const(b, 0):
        return a
    return Unary("neg", b) if _is_const(a, 0) else Binary("sub", a, b)


def _mul(a: Expr, b: Expr) -> Expr:
    """Product in a derivative: a zero factor annihilates (derivatives are finite here)."""
    if _is_const(a, 0) or _is_const(b, 0):
        return const(0.0)
    if _is_const(a, 1) and b.ty == FLOAT:
        return b
    return a if _is_const(b, 1) and a.ty == FLOAT else Binary("mul", a, b)


def _diff(e: Expr, wrt: Expr) -> Expr:
    zero, one = const(0.0), const(1.0)
    if e == wrt:
        return one
    if e.ty != FLOAT or not any(n == wrt for n in walk(e)):
        return zero
    if isinstance(e, Unary):
        dx = _diff(e.x, wrt)
        rules = {
            "neg": lambda: _sub(zero, dx),
            "abs": lambda: _mul(
                Where(Binary("lt", e.x, zero), const(-1.0), Where(Binary("gt", e.x, zero), one, zero)), dx
            ),
            "exp": lambda: _mul(e, dx),
            "log": lambda: Binary("div", dx, e.x),
            "tanh": lambda: _mul(Binary("sub", one, Binary("mul", e, e)), dx),
            "sqrt": lambda: Binary("div", dx, Binary("mul", const(2.0), e)),
        }
        return rules[e.op]()
    if isinstance(e, Binary):
        a, b = e.a, e.b
        da, db = _diff(a, wrt), _diff(b, wrt)
        if e.op == "add":
            return _add(da, db)
        if e.op == "sub":
            return _sub(da, db)
        if e.op == "mul":
            return _add(_mul(da, b), _mul(a, db))
        if e.op == "div":
            if _is_const(db, 0):
                return Binary("div", da, b)
            return Binary("div", _sub(_mul(da, b), _mul(a, db)), Binary("mul", b, b))
        if e.op in ("min", "max"):
            first, second = (a, b) if e.op == "min" else (b, a)  # (min picks a where a < b, max where b < a)
            tie = _mul(_add(da, db), const(0.5))
            return Where(Binary("lt", first, second), da, Where(Binary("lt", second, first), db, tie))
        return zero  # floordiv, mod: piecewise constant
    if isinstance(e, Where):
        return Where(e.cond, _diff(e.a, wrt), _diff(e.b, wrt))
    return zero


# ----------------------------------------------------------------------------- printing
_PRECEDENCE = {
    "or": 1, "and": 2, "lt": 4, "le": 4, "gt": 4, "ge": 4, "eq": 4, "ne": 4,
    "add": 5, "sub": 5, "mul": 6, "div": 6, "floordiv": 6, "mod": 6,
}  # fmt: skip


def render(e: Expr) -> str:
    """DSL-like text of `e`, with the parentheses precedence needs."""
    return _render(e, 0)


def _render(e: Expr, outer: int) -> str:
    if isinstance(e, Const):
        if e.type_ == FLOAT and math.isinf(float(e.value)):
            return "inf" if float(e.value) > 0 else "-inf"
        return repr(e.value).lower() if e.type_ == BOOL else repr(e.value)
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Read):
        return f"{e.tensor}[{', '.join(_render(i, 0) for i in e.index)}]"
    if isinstance(e, Unary):
        if e.op == "neg":
            return f"-{_render(e.x, 7)}"
        if e.op == "not":
            text = f"not {_render(e.x, 3)}"
            return f"({text})" if outer > 3 else text
        return f"{e.op}({_render(e.x, 0)})"
    if isinstance(e, Binary):
        if e.op in ("min", "max"):
            return f"{e.op}({_render(e.a, 0)}, {_render(e.b, 0)})"
        prec = _PRECEDENCE[e.op]
        text = f"{_render(e.a, prec)} {SYMBOLS[e.op]} {_render(e.b, prec + 1)}"
        return f"({text})" if prec < outer else text
    if isinstance(e, Where):
        return f"where({_render(e.cond, 0)}, {_render(e.a, 0)}, {_render(e.b, 0)})"
    raise TypeError(f"not an expression node: {e!r}")
