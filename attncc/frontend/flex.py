"""FlexAttention's score and mask functions traced into DSL programs.

PyTorch's FlexAttention describes a variant by two Python functions written in torch
operations: `score_mod(score, b, h, q_idx, kv_idx)` returns the modified score and
`mask_mod(b, h, q_idx, kv_idx)` whether a score is kept. `flex_program` calls them once on
symbolic values (`Traced`: each holds the DSL text of what it computes) and writes the program
they describe, e.g. for a soft-capped causal variant

    attention flex_softcap_causal
    s = q @ k.T * scale
    s = (tanh((s / 30.0)) * 30.0)
    mask (i >= j)
    p = softmax(s)
    o = p @ v
    output o

Tensors the functions read (an ALiBi slope table, document ids, a bias) become runtime inputs,
named after the variable that holds them where it can be found (`input slopes: float[8]`), and
are passed to every call with their current values, so a learnable bias gets its gradient.
The text then goes through the parser like any other program: nothing of the functions reaches
the generated code except as the parser's validated tokens (names are checked here too).

What the DSL cannot say is a `FlexTraceError` naming the function and the line: Python control
flow on a traced value (`if score > 0`, `and`, `or`: use torch.where, &, |), operations outside
the DSL's (`torch.sin`), bitwise integer operations, tensors used whole instead of read at an
index.
"""

from __future__ import annotations

import itertools
import math
import re
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attncc.errors import FlexTraceError
from attncc.frontend.lower import CALL_ARGUMENTS, CALL_KEYWORDS, MATH_FUNCTIONS, RESERVED
from attncc.frontend.parser import MAX_SOURCE_CHARS
from attncc.ir.expr import python_number

#: Flex's index arguments and the DSL names they are: the sequence, the query head, the query
#: and key positions.
FLEX_INDICES = {"b": "b", "h": "h", "q_idx": "i", "kv_idx": "j"}
#: Names a captured tensor cannot take (the program's own, statements, functions, operators).
TAKEN_NAMES = RESERVED | CALL_KEYWORDS | set().union(*CALL_ARGUMENTS.values()) | set(MATH_FUNCTIONS) | {
    "s", "p", "o", "attention", "input", "const", "mask", "layout", "output", "and", "or", "not",
    "rope", "float", "int", "bool",
}  # fmt: skip
DSL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: The dims of a captured tensor's declaration are named `NAME_sizeK` (`_Captures.declarations`).
DIMENSION_NAME = re.compile(r"_size\d+\Z")
#: The largest integer exponent `x ** n` expands into products.
MAX_POWER = 16
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: Integer dtypes narrower than the DSL's int64 whose conversions wrap (bits, signed). int32 is
#: taken as int64 (Flex's indices are int32 already; a wrap there would cost every score a `%`).
_NARROW_INTS = {torch.uint8: (8, False), torch.int8: (8, True), torch.int16: (16, True)}


@dataclass
class _Captures:
    """The tensors the traced functions read, in the order first read, with their DSL names."""

    known_names: dict[int, str]  # id(tensor) -> the variable holding it, where one was found
    names: dict[int, str] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def name_of(self, tensor: torch.Tensor) -> str:
        if id(tensor) in self.names:
            return self.names[id(tensor)]
        if tensor.is_complex() or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise FlexTraceError(
                f"a captured tensor of dtype {tensor.dtype}: the DSL reads float, int and bool tensors"
            )
        name = self.known_names.get(id(tensor), "")
        # (`NAME_sizeK` names the dims of the tensors' declarations: a tensor `bias_size0` beside
        # `bias` made a program the compiler refuses, session 67's review)
        taken = not DSL_NAME.match(name) or name in TAKEN_NAMES or name.startswith("__") or name in self.tensors
        if taken or DIMENSION_NAME.search(name):
            name = next(
                f"captured{n}" for n in itertools.count(len(self.tensors)) if f"captured{n}" not in self.tensors
            )
        self.names[id(tensor)] = name
        self.tensors[name] = tensor
        return name

    def declarations(self) -> list[str]:
        lines = []
        for name, t in self.tensors.items():
            kind = "bool" if t.dtype == torch.bool else "float" if t.is_floating_point() else "int"
            # (sizes bound at each call: a new length, a document-id tensor [B, N] at another N,
            # is the same program and kernel, and reads are checked against the call's shapes)
            dims = ", ".join(f"{name}_size{axis}" for axis in range(t.dim())) if t.dim() else "1"
            lines.append(f"input {name}: {kind}[{dims}]")
        return lines

    def values(self) -> dict[str, torch.Tensor]:
        """The runtime inputs of a call: each captured tensor (a 0-d one as [1])."""
        return {name: t.reshape(1) if t.dim() == 0 else t for name, t in self.tensors.items()}


def _closure_names(fn: Callable[..., Any]) -> dict[int, str]:
    """id -> name of the tensors `fn` can see by name: its closure cells and the globals it
    names (so `bias[h, q_idx, kv_idx]` declares `input bias`)."""
    found: dict[int, str] = {}
    code = getattr(fn, "__code__", None)
    if code is None:
        return found
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # (an empty cell)
            continue
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), name)
    for name in code.co_names:
        value = getattr(fn, "__globals__", {}).get(name)
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), name)
    return found


#: What torch's arithmetic of two bool tensors is: `+` or, `*` and, `-` refused (None)
BOOL_ARITHMETIC: dict[str, str | None] = {"+": "|", "*": "&", "-": None}


def too_large(detail: str) -> str:
    """The error of functions traced into a program past the compiler's size (`detail`: whose)."""
    # (the DSL's expressions are trees: a traced value used twice is written twice, so a chain
    # of steps each reusing the last, `x = torch.where(c, x - d, x)`, doubles it at every step)
    return (
        f"the functions traced into a program too large for the compiler ({detail}): each use of a value "
        "repeats all of its computation, so steps that reuse the previous value twice double it; reuse "
        "intermediate values less (`x = x - torch.where(c, d, 0)` instead of `x = torch.where(c, x - d, x)`)"
    )


class Traced:
    """A symbolic value of a score or mask function: the DSL text of what it computes and its
    kind (`int`, `float` or `bool`, as torch would type it)."""

    __slots__ = ("captures", "kind", "text")
    __hash__ = object.__hash__

    def __init__(self, text: str, kind: str, captures: _Captures) -> None:
        if len(text) > MAX_SOURCE_CHARS:  # (before it doubles again: a chain of such steps ran out of memory)
            raise FlexTraceError(too_large(f"a traced value of {len(text)} characters, limit {MAX_SOURCE_CHARS}"))
        self.text, self.kind, self.captures = text, kind, captures

    def __repr__(self) -> str:
        return f"Traced({self.text!r}, {self.kind})"

    # -- operands --------------------------------------------------------------------------
    def _operand(self, x: object) -> Traced:
        return _operand(x, self.captures)

    def _number(self) -> Traced:
        """self as an int or float operand (a bool as 1 / 0, as torch promotes it)."""
        if self.kind == "bool":
            return Traced(f"where({self.text}, 1, 0)", "int", self.captures)
        return self

    # -- arithmetic ------------------------------------------------------------------------
    def _arith(self, other: object, op: str, reverse: bool = False) -> Traced:
        if self.kind == "bool" and self._operand(other).kind == "bool" and op in BOOL_ARITHMETIC:
            # (torch keeps two bools' sum and product bool: `or` and `and`, where 1 + 1 made 2,
            # 0.74 off torch's flex_attention; their difference it refuses)
            if BOOL_ARITHMETIC[op] is None:
                raise FlexTraceError(f"`{op}` of two bool values (torch refuses it too; use ^ or ~)")
            return self._logic(other, BOOL_ARITHMETIC[op])
        a, b = self._number(), self._operand(other)._number()
        if reverse:
            a, b = b, a
        if op in ("//", "%") and "float" in (a.kind, b.kind):
            raise FlexTraceError(f"`{op}` of a float value: the DSL's `//` and `%` are integer operations")
        kind = "float" if op == "/" or "float" in (a.kind, b.kind) else "int"
        return Traced(f"({a.text} {op} {b.text})", kind, self.captures)

    def __add__(self, o: object) -> Traced:
        return self._arith(o, "+")

    def __radd__(self, o: object) -> Traced:
        return self._arith(o, "+", True)

    def __sub__(self, o: object) -> Traced:
        return self._arith(o, "-")

    def __rsub__(self, o: object) -> Traced:
        return self._arith(o, "-", True)

    def __mul__(self, o: object) -> Traced:
        return self._arith(o, "*")

    def __rmul__(self, o: object) -> Traced:
        return self._arith(o, "*", True)

    def __truediv__(self, o: object) -> Traced:
        return self._arith(o, "/")

    def __rtruediv__(self, o: object) -> Traced:
        return self._arith(o, "/", True)

    def __floordiv__(self, o: object) -> Traced:
        return self._arith(o, "//")

    def __rfloordiv__(self, o: object) -> Traced:
        return self._arith(o, "//", True)

    def __mod__(self, o: object) -> Traced:
        return self._arith(o, "%")

    def __rmod__(self, o: object) -> Traced:
        return self._arith(o, "%", True)

    def __pow__(self, o: object) -> Traced:
        o = python_number(o)
        if isinstance(o, float) and o == 0.5:
            return self.sqrt()
        if isinstance(o, float) and o.is_integer():  # (`score ** 2.0`: a float result)
            return self._as_float().__pow__(int(o))
        if isinstance(o, bool) or not isinstance(o, int) or not 0 <= o <= MAX_POWER:
            raise FlexTraceError(
                f"`x ** {o!r}`: the DSL has no power; integer exponents 0..{MAX_POWER} and 0.5 are expanded"
            )
        if o == 0:
            return self._operand(1.0 if self.kind == "float" else 1)
        base = self._number()
        return Traced("(" + " * ".join([base.text] * o) + ")", base.kind, self.captures)

    def __rpow__(self, o: object) -> Traced:
        base = python_number(o)
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 0:
            raise FlexTraceError(f"`{o!r} ** x`: only a positive constant base is expanded (as exp(x * log(base)))")
        power = self._unary_float("exp", scale=math.log(base))
        if isinstance(base, int) and self.kind != "float":  # (torch's int power is exact: 2 ** 3 was 7.999999999999998)
            return Traced(f"round({power.text})", "int", self.captures)
        return power

    def __neg__(self) -> Traced:
        if self.kind == "bool":
            raise FlexTraceError("negation of a bool value (torch refuses it too; use ~ for not)")
        return Traced(f"(-{self.text})", self.kind, self.captures)

    def __pos__(self) -> Traced:
        return self

    def __abs__(self) -> Traced:
        return self.abs()

    # -- comparisons and logic -------------------------------------------------------------
    def _compare(self, other: object, op: str) -> Traced:
        a, b = self, self._operand(other)
        if a.kind == b.kind == "bool" and op in ("==", "!="):  # (the DSL compares numbers only)
            return _equal_conditions(a, b) if op == "==" else _equal_conditions(a, b).__invert__()
        if "bool" in (a.kind, b.kind):
            a, b = a._number(), b._number()
        return Traced(f"({a.text} {op} {b.text})", "bool", self.captures)

    def __lt__(self, o: object) -> Traced:
        return self._compare(o, "<")

    def __le__(self, o: object) -> Traced:
        return self._compare(o, "<=")

    def __gt__(self, o: object) -> Traced:
        return self._compare(o, ">")

    def __ge__(self, o: object) -> Traced:
        return self._compare(o, ">=")

    def __eq__(self, o: object) -> Traced:  # type: ignore[override]
        return self._compare(o, "==")

    def __ne__(self, o: object) -> Traced:  # type: ignore[override]
        return self._compare(o, "!=")

    def _logic(self, other: object, op: str) -> Traced:
        b = self._operand(other)
        if self.kind != "bool" or b.kind != "bool":
            raise FlexTraceError(
                f"`{op}` of {self.kind} and {b.kind} values: only bool values combine (bitwise integers are not in the DSL)"
            )
        if op == "^":
            return _equal_conditions(self, b).__invert__()
        word = {"&": "and", "|": "or"}[op]
        return Traced(f"({self.text} {word} {b.text})", "bool", self.captures)

    def __and__(self, o: object) -> Traced:
        return self._logic(o, "&")

    __rand__ = __and__

    def __or__(self, o: object) -> Traced:
        return self._logic(o, "|")

    __ror__ = __or__

    def __xor__(self, o: object) -> Traced:
        return self._logic(o, "^")

    __rxor__ = __xor__

    def __invert__(self) -> Traced:
        if self.kind != "bool":
            raise FlexTraceError(f"`~` of a {self.kind} value: bitwise integer operations are not in the DSL")
        return Traced(f"(not {self.text})", "bool", self.captures)

    def __bool__(self) -> bool:
        raise FlexTraceError(
            "Python control flow on a traced value (`if`, `and`, `or`, `not`, `bool()`, Python's `min` / `max`): "
            "the function runs once on symbols; use torch.where(c, a, b), &, |, ~, torch.minimum / maximum"
        )

    def __index__(self) -> int:
        raise FlexTraceError(
            "a traced value used as a Python int (range, list index, int()): index tensors with it instead"
        )

    __int__ = __index__

    def __float__(self) -> float:
        raise FlexTraceError("a traced value used as a Python float (float(), math.*): use torch functions on it")

    def __getitem__(self, index: object) -> Traced:
        raise FlexTraceError("indexing a traced value: index the captured tensors with b, h, q_idx, kv_idx instead")

    def __iter__(self) -> Any:
        raise FlexTraceError("iterating over a traced value")

    # -- what torch.Tensor's attributes say of a 0-d index or score (Flex's and_masks, noop_mask)
    @property
    def dtype(self) -> torch.dtype:
        return {"int": torch.int32, "float": torch.float32, "bool": torch.bool}[self.kind]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    shape = torch.Size([])
    ndim = 0

    def dim(self) -> int:
        return 0

    def _new(self, value: float, size: object, dtype: object) -> Traced:
        if tuple(size) not in ((), (1,)):  # type: ignore[call-overload]
            raise FlexTraceError(f"a new tensor of size {size!r} in a score or mask function: only scalars")
        kind = (
            self.kind
            if dtype is None
            else {torch.bool: "bool"}.get(dtype, "float" if dtype in _FLOAT_DTYPES else "int")
        )  # type: ignore[call-overload]
        constant: object = bool(value) if kind == "bool" else float(value) if kind == "float" else int(value)
        return _operand(constant, self.captures)

    def new_ones(self, size: object = (), dtype: object = None, **kwargs: object) -> Traced:
        return self._new(1, size, dtype)

    def new_zeros(self, size: object = (), dtype: object = None, **kwargs: object) -> Traced:
        return self._new(0, size, dtype)

    def new_full(self, size: object, fill_value: float, dtype: object = None, **kwargs: object) -> Traced:
        return self._new(fill_value, size, dtype)

    # -- functions -------------------------------------------------------------------------
    def _unary_float(self, fn: str, scale: float = 1.0) -> Traced:
        x = self._number()
        arg = x.text if scale == 1.0 else f"({x.text} * {_float_text(scale)})"
        return Traced(f"{fn}({arg})", "float", self.captures)

    def abs(self) -> Traced:
        x = self._number()
        return Traced(f"abs({x.text})", x.kind, self.captures)

    def exp(self) -> Traced:
        return self._unary_float("exp")

    def exp2(self) -> Traced:
        return self._unary_float("exp", scale=math.log(2.0))

    def log(self) -> Traced:
        return self._unary_float("log")

    def log2(self) -> Traced:
        return Traced(f"({self._unary_float('log').text} * {_float_text(1 / math.log(2.0))})", "float", self.captures)

    def tanh(self) -> Traced:
        return self._unary_float("tanh")

    def sqrt(self) -> Traced:
        return self._unary_float("sqrt")

    def rsqrt(self) -> Traced:
        return Traced(f"(1.0 / {self._unary_float('sqrt').text})", "float", self.captures)

    def sigmoid(self) -> Traced:
        return Traced(f"(1.0 / (1.0 + {self.__neg__()._unary_float('exp').text}))", "float", self.captures)

    def _rounded(self, fn: str) -> Traced:
        """torch.floor / ceil / trunc / round: an integral value of x's kind. The DSL's rounding
        gives an int (saturated at int64's range, 0 for NaN); torch's of a float is a float, x
        itself where |x| >= 2^62 (a float that large is an integer), inf or NaN."""
        x = self._number()
        if x.kind == "int":
            return x
        return _where(
            x.abs() < float(2**62), Traced(f"({fn}({x.text}) * 1.0)", "float", self.captures), x, self.captures
        )

    def floor(self) -> Traced:
        return self._rounded("floor")

    def ceil(self) -> Traced:
        return self._rounded("ceil")

    def trunc(self) -> Traced:
        return self._rounded("trunc")

    fix = trunc

    def round(self, decimals: int = 0) -> Traced:
        if decimals:
            raise FlexTraceError(f"torch.round(decimals={decimals}): round to an integer, or scale first")
        return self._rounded("round")

    def _extreme(self, other: object, fn: str) -> Traced:
        if self.kind == "bool" and self._operand(other).kind == "bool":  # (bool in torch: or / and)
            return self._logic(other, "|" if fn == "max" else "&")
        a, b = self._number(), self._operand(other)._number()
        kind = "float" if "float" in (a.kind, b.kind) else "int"
        return Traced(f"{fn}({a.text}, {b.text})", kind, self.captures)

    def minimum(self, other: object) -> Traced:
        return self._extreme(other, "min")

    def maximum(self, other: object) -> Traced:
        return self._extreme(other, "max")

    def clamp(self, min: object = None, max: object = None) -> Traced:
        """torch.clamp: min below min, max above max (max where min > max), NaN kept. With
        constant bounds the gradient passes to x where min <= x <= max, a tie included, as
        torch's does (max() and min() halve a tie's, torch.maximum's rule: a bias clamped at 0
        from a zero start got half its gradient, session 66's review). A traced bound keeps the
        max() / min() form (torch's rules for tensor bounds, a NaN bound's NaN among them, take
        each operand several times, and every use of a value repeats its text)."""
        low, high = (python_number(bound) for bound in (min, max))
        constant = all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in (low, high) if b is not None)
        if self.kind == "bool" or not constant:
            out = self
            if low is not None:
                out = out._extreme(low, "max")
            return out if high is None else out._extreme(high, "min")
        x = self._number()
        if low is not None and high is not None and low > high:  # (every value is max, NaN kept: no gradient)
            kind = x if isinstance(low, int) and isinstance(high, int) else x._as_float()
            return _where(x != x, x, high, self.captures)._kind_of(kind)
        inside = x if high is None else _where(x > high, high, x, self.captures)
        return inside if low is None else _where(x < low, low, inside, self.captures)

    clip = clamp

    def clamp_min(self, min: object) -> Traced:
        return self.clamp(min=min)

    def clamp_max(self, max: object) -> Traced:
        return self.clamp(max=max)

    def where(self, condition: object, other: object) -> Traced:
        """Tensor.where(condition, other): self where condition holds, else other."""
        return _where(condition, self, other, self.captures)

    def logical_and(self, other: object) -> Traced:
        return self._logic(other, "&")

    def logical_or(self, other: object) -> Traced:
        return self._logic(other, "|")

    def logical_xor(self, other: object) -> Traced:
        return self._logic(other, "^")

    def logical_not(self) -> Traced:
        return self.__invert__()

    def float(self) -> Traced:
        return self._as_float()

    double = float

    def half(self) -> Traced:
        return self.to(torch.float16)

    def bfloat16(self) -> Traced:
        return self.to(torch.bfloat16)

    def _as_float(self) -> Traced:
        x = self._number()
        return x if x.kind == "float" else Traced(f"({x.text} * 1.0)", "float", self.captures)

    def to(self, *args: object, **kwargs: object) -> Traced:
        # (a dtype, or a tensor or traced value whose dtype it takes: `.to(score)`, `.to(other)`)
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        if dtype is None:
            dtype = next((a.dtype for a in args if isinstance(a, (torch.Tensor, Traced))), None)
        if dtype is None:
            return self  # (a device move: nothing to trace)
        if dtype in (torch.float16, torch.bfloat16):  # (it was traced as no conversion: unrounded)
            raise FlexTraceError(
                f"a conversion to {dtype}: rounding to a narrower float is not traced; the scores are fp32 "
                "(float64 for float64 inputs), drop the conversion"
            )
        if dtype in _FLOAT_DTYPES:
            return self._as_float()
        if dtype == torch.bool:
            return self if self.kind == "bool" else self._compare(0, "!=")
        if self.kind == "float":  # (toward zero, as torch converts: saturated and NaN 0, expr.ROUNDING_OPS)
            value = Traced(f"trunc({self.text})", "int", self.captures)
        else:
            value = self._number()
        if dtype in _NARROW_INTS:  # (wrapped as torch's do: `.to(torch.uint8)` of -1 is 255)
            bits, signed = _NARROW_INTS[dtype]
            span = 1 << bits
            return (value + span // 2) % span - span // 2 if signed else value % span
        return value

    def long(self) -> Traced:
        return self.to(torch.int64)

    def int(self) -> Traced:
        return self.to(torch.int32)

    def bool(self) -> Traced:
        return self.to(torch.bool)

    def item(self) -> Traced:
        raise FlexTraceError("`.item()` of a traced value (Flex refuses it too): use the value as a tensor")

    def div(self, other: object, rounding_mode: str | None = None) -> Traced:
        """torch.div: true division, or integer division rounded down (`//`) or toward zero."""
        if rounding_mode is None:
            return self.__truediv__(other)
        if rounding_mode == "floor":
            return self.__floordiv__(other)
        if rounding_mode != "trunc":
            raise FlexTraceError(f"torch.div(rounding_mode={rounding_mode!r})")
        floor, rest = self.__floordiv__(other), self.fmod(other)
        # (toward zero: the floor quotient plus one where the remainder's signs part them)
        parted = (rest != 0) & ((self < 0) ^ (self._operand(other) < 0))
        return _where(parted, floor + 1, floor, self.captures)

    def fmod(self, other: object) -> Traced:
        """C's remainder (the sign of the dividend), where `%` has the divisor's."""
        if "float" in (self._number().kind, self._operand(other)._number().kind):
            raise FlexTraceError("torch.fmod of a float value: the DSL's remainder is an integer operation")
        remainder, divisor = self.__mod__(other), self._operand(other)
        parted = (remainder != 0) & ((self < 0) ^ (divisor < 0))
        return _where(parted, remainder - divisor, remainder, self.captures)

    def square(self) -> Traced:
        return self.__mul__(self)

    def sign(self) -> Traced:
        x = self._number()
        zero = 0.0 if x.kind == "float" else 0
        return _where(x > zero, 1, _where(x < zero, -1, 0, self.captures), self.captures)._kind_of(x)

    def relu(self) -> Traced:
        """torch.relu: x where x > 0, else 0 (NaN kept), with torch's gradient: 0 at x = 0 (a
        bias started at zero got none of its gradient through max(x, 0)'s halves there)."""
        x = self._number()
        if x.kind != "float":
            return x._extreme(0, "max")
        return _where(x <= 0.0, 0.0, x, self.captures)  # (NaN fails the test: kept)

    def softplus(self, beta: float = 1.0, threshold: float = 20.0) -> Traced:
        """torch's softplus: log(1 + exp(beta x)) / beta, x itself where beta x > threshold."""
        scaled = self.__mul__(float(beta))
        return _where(scaled > float(threshold), self, (scaled.exp() + 1.0).log() / float(beta), self.captures)

    def log1p(self) -> Traced:
        return (self._number() + 1.0).log()

    def _kind_of(self, like: Traced) -> Traced:
        return self._as_float() if like.kind == "float" else self

    def masked_fill(self, mask: object, value: object) -> Traced:
        """x.masked_fill(mask, value): value where mask holds, x elsewhere, in x's kind."""
        filled = self._operand(value)
        if filled.kind != self.kind and not (self.kind == "float" and filled.kind == "int"):
            raise FlexTraceError(f"masked_fill of {_a(self.kind)} value with {_a(filled.kind)} one: convert one first")
        return _where(mask, filled._kind_of(self), self, self.captures)

    def type_as(self, other: object) -> Traced:
        return self._kind_of(_operand(other, self.captures))

    # -- torch functions on traced values ----------------------------------------------------
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        operands = [x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, (tuple, list)) else (a,))]
        captures = next(x.captures for x in operands if isinstance(x, Traced))
        if name == "__getitem__":
            return _read(args[0], args[1], captures)
        if name == "where":
            if len(args) == 3 or "input" in kwargs or "other" in kwargs:
                condition = kwargs.get("condition", args[0])
                a = kwargs.get("input", args[1] if len(args) > 1 else None)
                b = kwargs.get("other", args[2] if len(args) > 2 else None)
                return _where(condition, a, b, captures)
            raise FlexTraceError("torch.where with one argument (nonzero indices) is not a score or mask expression")
        if name in ("max", "min", "amax", "amin") and len(args) == 2 and not kwargs:  # (torch.max(a, b))
            if name in ("amax", "amin") or not isinstance(args[1], (Traced, torch.Tensor, _Partial)):
                raise FlexTraceError(
                    f"torch.{name}(x, {args[1]!r}) reduces over a dim (torch's flex_attention refuses it): use "
                    f"torch.{name[-3:]}imum(x, y) of two values, or torch.clamp"
                )
            return _operand(args[0], captures)._extreme(args[1], name[-3:])
        if name in ("zeros_like", "ones_like", "full_like"):  # (a constant of x's kind: its shape is ())
            fill = {"zeros_like": 0, "ones_like": 1}.get(
                name, kwargs.get("fill_value", args[1] if len(args) > 1 else 0)
            )
            return _operand(args[0], captures)._new(fill, (), kwargs.get("dtype"))  # type: ignore[arg-type]
        if name in ("add", "sub", "subtract") and "alpha" in kwargs:  # (torch.add(s, x, alpha=a): s + a * x)
            first, other = (
                _operand(x, captures) for x in (args[0], kwargs.get("other", args[1] if len(args) > 1 else None))
            )
            alpha = python_number(kwargs["alpha"])
            if alpha == 1:  # (two bools stay bool: `or`)
                return getattr(first, _TORCH_METHODS[name])(other)
            if first.kind == other.kind == "bool":
                raise FlexTraceError(f"torch.{name} of two bool values with alpha={alpha!r}: torch refuses it too")
            return getattr(first, _TORCH_METHODS[name])(other * alpha)
        if name == "pow" and not isinstance(python_number(args[0]), Traced):  # (torch.pow(2.0, x): 2.0 ** x)
            return _operand(kwargs.get("exponent", args[1] if len(args) > 1 else None), captures).__rpow__(args[0])
        if name == "relu" and "inplace" in kwargs:  # (F.relu's flag)
            if kwargs["inplace"]:  # (its operand changed, read again after: the change lost)
                raise FlexTraceError(
                    "F.relu(x, inplace=True): traced values are not changed in place; use x = F.relu(x)"
                )
            kwargs = {k: v for k, v in kwargs.items() if k != "inplace"}
        method = _TORCH_METHODS.get(name)
        if method is None:
            raise FlexTraceError(
                f"torch operation `{name}` has no DSL form; the traced functions may use arithmetic, comparisons, "
                f"&, |, ~, torch.where, abs, exp, exp2, log, log2, log1p, tanh, sqrt, rsqrt, sigmoid, relu, "
                f"softplus, square, sign, minimum, maximum, clamp, fmod, floor, ceil, trunc, round, conversions and reads "
                f"of captured tensors"
            )
        first, *rest = args
        return getattr(_operand(first, captures), method)(*rest, **kwargs)


#: torch functions and Tensor methods (by name) and the Traced method that does each.
_TORCH_METHODS = {
    **{n: n for n in ("abs", "exp", "exp2", "log", "log2", "tanh", "sqrt", "rsqrt", "sigmoid", "minimum", "maximum")},
    **{n: n for n in ("clamp", "clip", "clamp_min", "clamp_max", "logical_and", "logical_or", "logical_xor")},
    **{n: n for n in ("logical_not", "float", "double", "half", "bfloat16", "to", "type_as", "long", "int")},
    **{n: n for n in ("bool", "square", "sign", "relu", "softplus", "log1p", "fmod", "item")},
    "masked_fill": "masked_fill",
    **{n: n for n in ("floor", "ceil", "trunc", "fix", "round")},
    "add": "__add__", "__add__": "__add__", "__radd__": "__radd__",
    "sub": "__sub__", "subtract": "__sub__", "__sub__": "__sub__", "__rsub__": "__rsub__", "rsub": "__rsub__",
    "mul": "__mul__", "multiply": "__mul__", "__mul__": "__mul__", "__rmul__": "__rmul__",
    "div": "div", "divide": "div", "true_divide": "__truediv__", "__truediv__": "__truediv__",
    "__rtruediv__": "__rtruediv__", "__rdiv__": "__rtruediv__", "__div__": "__truediv__",
    "floor_divide": "__floordiv__", "__floordiv__": "__floordiv__", "__rfloordiv__": "__rfloordiv__",
    "remainder": "__mod__", "__mod__": "__mod__", "__rmod__": "__rmod__",
    "pow": "__pow__", "__pow__": "__pow__", "__rpow__": "__rpow__",
    "neg": "__neg__", "negative": "__neg__", "__neg__": "__neg__", "__abs__": "abs", "absolute": "abs",
    "eq": "__eq__", "__eq__": "__eq__", "ne": "__ne__", "not_equal": "__ne__", "__ne__": "__ne__",
    "lt": "__lt__", "less": "__lt__", "__lt__": "__lt__", "le": "__le__", "less_equal": "__le__", "__le__": "__le__",
    "gt": "__gt__", "greater": "__gt__", "__gt__": "__gt__", "ge": "__ge__", "greater_equal": "__ge__",
    "__ge__": "__ge__",
    "__and__": "__and__", "__rand__": "__and__", "bitwise_and": "__and__",
    "__or__": "__or__", "__ror__": "__or__", "bitwise_or": "__or__",
    "__xor__": "__xor__", "__rxor__": "__xor__", "bitwise_xor": "__xor__",
    "__invert__": "__invert__", "bitwise_not": "__invert__",
}  # fmt: skip


def _method_spellings() -> None:
    """Tensor-method spellings of the torch functions (`q_idx.ge(kv_idx)`, `score.mul(0.5)`),
    called on a Traced value directly rather than through __torch_function__."""
    for name, method in _TORCH_METHODS.items():
        if not name.startswith("__") and not hasattr(Traced, name):
            setattr(Traced, name, lambda self, *args, _method=method, **kwargs: getattr(self, _method)(*args, **kwargs))


_method_spellings()


def _a(kind: str) -> str:
    return "an int" if kind == "int" else f"a {kind}"


def _float_text(value: float) -> str:
    if math.isnan(value):
        raise FlexTraceError("a NaN constant in a score or mask function")
    if math.isinf(value):
        return "inf" if value > 0 else "(-inf)"
    text = repr(float(value))
    return f"({text})" if text.startswith("-") else text


def _operand(x: object, captures: _Captures) -> Traced:
    """Any operand of a traced operation as a Traced value: constants inline, a captured
    one-element tensor as a read of its only element."""
    x = python_number(x)
    if isinstance(x, Traced):
        return x
    if isinstance(x, bool):
        return Traced("(0 == 0)" if x else "(0 != 0)", "bool", captures)
    if isinstance(x, int):
        return Traced(f"({x})" if x < 0 else str(x), "int", captures)
    if isinstance(x, float):
        return Traced(_float_text(x), "float", captures)
    if isinstance(x, _Partial):
        raise FlexTraceError(x.incomplete())
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise FlexTraceError(
                f"a captured tensor of shape {tuple(x.shape)} used whole: read one element of it, "
                "indexed by b, h, q_idx, kv_idx (e.g. bias[h, q_idx, kv_idx])"
            )
        # (its only element: a 0-d tensor is declared and passed as [1])
        return _read_element(captures.name_of(x), x, ", ".join(["0"] * max(x.dim(), 1)), captures)
    raise FlexTraceError(f"an operand of type {type(x).__name__} in a score or mask function")


def _read_element(name: str, tensor: torch.Tensor, index_text: str, captures: _Captures) -> Traced:
    kind = "bool" if tensor.dtype == torch.bool else "float" if tensor.is_floating_point() else "int"
    return Traced(f"{name}[{index_text}]", kind, captures)


class _Partial:
    """A captured tensor indexed by fewer indices than it has dims (`bias[h][q_idx]`); used as a
    value it is an error (`doc[q_idx] == doc[kv_idx]` of a [B, N] `doc` compared two such objects
    by identity: a mask of False, every row masked, silently; torch raises)."""

    def __init__(self, tensor: torch.Tensor, indices: tuple[object, ...], captures: _Captures) -> None:
        self.tensor, self.indices, self.captures = tensor, indices, captures

    def __getitem__(self, index: object) -> Traced | _Partial:
        more = index if isinstance(index, tuple) else (index,)
        return _read(self.tensor, self.indices + more, self.captures)

    def incomplete(self) -> str:
        return (
            f"a captured tensor of shape {tuple(self.tensor.shape)} read with {len(self.indices)} of its "
            f"{self.tensor.dim()} indices, used as a value: index every dim (e.g. doc[b, q_idx])"
        )

    def _as_value(self, *_: object) -> Any:
        raise FlexTraceError(self.incomplete())

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = _as_value  # type: ignore[assignment]
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _as_value
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __abs__ = _as_value
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __invert__ = _as_value
    __hash__ = None  # type: ignore[assignment]

    def __getattr__(self, name: str) -> Any:  # (`bias[h].abs()`: a method of a value)
        if name.startswith("__"):
            raise AttributeError(name)
        raise FlexTraceError(self.incomplete())

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        partial = next(
            x
            for a in (*args, *(kwargs or {}).values())
            for x in (a if isinstance(a, (tuple, list)) else (a,))
            if isinstance(x, _Partial)
        )
        raise FlexTraceError(partial.incomplete())


def _read(tensor: object, index: object, captures: _Captures) -> Traced | _Partial:
    """`tensor[index]` for a captured tensor and integer (traced or constant) indices."""
    if not isinstance(tensor, torch.Tensor):
        raise FlexTraceError("indexing a traced value: index the captured tensors with b, h, q_idx, kv_idx instead")
    indices = index if isinstance(index, tuple) else (index,)
    if len(indices) > tensor.dim():
        raise FlexTraceError(f"a captured tensor of shape {tuple(tensor.shape)} indexed by {len(indices)} indices")
    texts = []
    for axis, item in enumerate(indices):
        item = python_number(item)
        if isinstance(item, int) and not isinstance(item, bool):
            size = tensor.shape[axis]
            if not -size <= item < size:
                raise FlexTraceError(
                    f"index {item} is out of range for dimension {axis} of size {size} of a captured tensor"
                )
            texts.append(str(item % size))
            continue
        if not isinstance(item, Traced) or item.kind != "int":
            what = f"a {item.kind} value" if isinstance(item, Traced) else type(item).__name__
            raise FlexTraceError(
                f"a captured tensor indexed by {what} (dimension {axis}): indices are integers (b, h, q_idx, "
                "kv_idx and integer arithmetic on them); slices, masks and None are not reads of one element"
            )
        texts.append(item.text)
    if len(indices) < tensor.dim():
        return _Partial(tensor, indices, captures)
    return _read_element(captures.name_of(tensor), tensor, ", ".join(texts), captures)


def _equal_conditions(a: Traced, b: Traced) -> Traced:
    return Traced(f"(({a.text} and {b.text}) or ((not {a.text}) and (not {b.text})))", "bool", a.captures)


def _where(condition: object, a: object, b: object, captures: _Captures) -> Traced:
    cond = _operand(condition, captures)
    if cond.kind != "bool":
        cond = cond._compare(0, "!=")
    x, y = _operand(a, captures), _operand(b, captures)
    if x.kind == "bool" and y.kind == "bool":
        return Traced(f"(({cond.text} and {x.text}) or ((not {cond.text}) and {y.text}))", "bool", captures)
    x, y = x._number(), y._number()
    kind = "float" if "float" in (x.kind, y.kind) else "int"
    return Traced(f"where({cond.text}, {x.text}, {y.text})", kind, captures)


def _user_frame(error: BaseException, fn: Callable[..., Any]) -> str:
    """`file:line` of the innermost frame of the traced function's own code in error's traceback."""
    here = Path(__file__).resolve().parent.parent
    place = ""
    for frame in traceback.extract_tb(error.__traceback__):
        path = Path(frame.filename).resolve()
        if here not in path.parents and "torch" not in path.parts:
            place = f"{frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`"
    return place or _defined_at(fn)


def _defined_at(fn: Callable[..., Any]) -> str:
    """`file:line` where `fn` is defined ("" where it has no code: a builtin, a callable object)."""
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code is not None else ""


def _traced_call(role: str, fn: Callable[..., Any], args: tuple[object, ...]) -> object:
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        return fn(*args)
    except FlexTraceError as error:
        raise FlexTraceError(f"{role} `{name}` ({_user_frame(error, fn)}): {error}") from None
    except Exception as error:  # (torch refusing a Traced operand, a TypeError in the function)
        raise FlexTraceError(
            f"{role} `{name}` ({_user_frame(error, fn)}) failed on traced values: {type(error).__name__}: {error}"
        ) from None


def _returned(role: str, fn: Callable[..., Any], args: tuple[object, ...], captures: _Captures) -> Traced:
    """What `fn` returns on traced arguments, as one traced value; else an error naming the
    function and what it returned (a missing `return`, a tuple, a partial read)."""
    value = python_number(_traced_call(role, fn, args))  # (numpy's scalars as Python's)
    if isinstance(value, (Traced, bool, int, float, torch.Tensor)):
        return _operand(value, captures)
    name = getattr(fn, "__name__", type(fn).__name__)
    place = _defined_at(fn) or name
    what = (
        "None (no `return`?)" if value is None else value.incomplete() if isinstance(value, _Partial) else
        f"a {type(value).__name__}"
    )  # fmt: skip
    expected = "the new score" if role == "score_mod" else "whether the score is kept (a bool value)"
    raise FlexTraceError(f"{role} `{name}` ({place}) returned {what}: expected {expected}")


@dataclass(frozen=True)
class FlexProgram:
    """A traced variant: the DSL program and the tensors its runtime inputs name."""

    source: str
    inputs: dict[str, torch.Tensor]


def flex_program(
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    name: str | None = None,
) -> FlexProgram:
    """The DSL program of FlexAttention's `score_mod(score, b, h, q_idx, kv_idx)` and
    `mask_mod(b, h, q_idx, kv_idx)` (either may be None), with the tensors they read.

    Traced once on symbols; the same functions give the same text while the tensors they read
    keep their shapes, so the kernel built for it is reused (`attncc.compile` caches by text)."""
    known: dict[int, str] = {}
    for fn in (mask_mod, score_mod):
        if fn is not None:
            known.update(_closure_names(fn))
    captures = _Captures(known)
    indices = [Traced(dsl, "int", captures) for dsl in FLEX_INDICES.values()]
    score_text = mask_text = None
    if score_mod is not None:
        score = _returned("score_mod", score_mod, (Traced("s", "float", captures), *indices), captures)
        if score.kind == "bool":
            raise FlexTraceError("score_mod returned a bool value: it returns the new score (a mask is mask_mod's)")
        score_text = None if score.text == "s" else score.text
    if mask_mod is not None:
        keep = _returned("mask_mod", mask_mod, tuple(indices), captures)
        if keep.kind != "bool":
            raise FlexTraceError(f"mask_mod returned {_a(keep.kind)} value: it returns whether a score is kept")
        mask_text = None if keep.text == "(0 == 0)" else keep.text
    lines = [f"attention {_program_name(name, score_mod, mask_mod)}", *captures.declarations(), "s = q @ k.T * scale"]
    if score_text is not None:
        lines.append(f"s = {score_text}")
    if mask_text is not None:
        lines.append(f"mask {mask_text}")
    lines += ["p = softmax(s)", "o = p @ v", "output o"]
    return FlexProgram("\n".join(lines) + "\n", captures.values())


def _program_name(name: str | None, *fns: Callable[..., Any] | None) -> str:
    if name is not None:
        if not DSL_NAME.match(name):
            raise FlexTraceError(f"name: expected an identifier ([A-Za-z_][A-Za-z0-9_]*), got {name!r}")
        return name
    parts = [getattr(fn, "__name__", "") for fn in fns if fn is not None]
    words = [re.sub(r"[^A-Za-z0-9_]", "", p) for p in parts]
    return "_".join(["flex", *(w for w in words if w)])[:80]
