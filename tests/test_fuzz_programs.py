"""Differential fuzzing of the DSL against an evaluator written here from the README.

A seeded generator writes random programs: integer arithmetic on b, h, i, j, sizes and small
constants (floor division and modulo with negative operands and divisors), comparisons,
`and or not`, `where min max abs`, `floor ceil trunc round` of integers times powers of two, let-bound and `const` names, runtime inputs, masks (some of
which leave rows with no visible key) and float score maps of `s` (`tanh exp log sqrt abs min
max where`, learnable per-head inputs, `-inf`), a learnable table whose length is a free
dimension name (`input wide: float[H, W]`, W read in its index) and new scores that do not read
the old (both from a generator of their own, so the other programs stay as they were). Texts use the fewest parentheses the grammar's
precedence allows, so they test the parser as much as the semantics.

The oracle is this file's own tokenizer and precedence-climbing parser, evaluating the
expression text over the [B, H, N, M] index grid in float64 / int64 with Python's meaning of
`//` and `%` (README: "integer `//` and `%` as in Python"), then softmax attention by hand.
Nothing from attncc's frontend, IR, passes or reference is used for it.

- `test_oracle_agrees_with_python` checks the oracle itself against Python's `eval` of the
  same expression text (Python has the DSL's precedence; the generator never chains
  comparisons), point by point.
- `test_programs_match_the_reference` compares a few hundred programs with attncc's float64
  reference (`kern.reference`) and checks the kernels' tile classes against the oracle's mask.
- `test_kernel_matches_the_oracle` builds ten of them as CPU kernels (optimised) and compares forward
  and backward (q, k, v and learnable inputs) at shapes whose rows cross several key tiles;
  `test_kernel_programs_reach_their_features` checks those ten are not trivial.
  `test_debug_built_kernel_matches_the_oracle` does the same for eighty more, built -O0
  (ATTNCC_DEBUG_BUILD: the code's meaning, five times faster to build).
- `test_emulated_cuda_kernel_matches_the_oracle` runs twenty programs' CUDA kernels (sm80,
  fp16) on the host emulator, with split-KV and the deterministic backward in some of them.
- `test_two_reads_of_one_learnable_input` keeps a bug the fuzzer found fixed (the other one, an
  infinite literal CUDA could not compile, is in test_edge_programs.py).

A failure prints the program, its seed and `generate_program(seed, profile)` to rebuild it;
`ATTNCC_FUZZ_SEED` moves every seed (the default run is the same every time).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pytest
import torch

import attncc
from attncc.ir import expr as ex
from attncc.runtime.build import DEBUG_BUILD_ENV

BASE_SEED = int(os.environ.get("ATTNCC_FUZZ_SEED", "20250611"))
REFERENCE_PROGRAMS = 300
KERNEL_PROGRAMS = 10  # built optimised (OPTIMIZED_FLAGS)
DEBUG_KERNEL_PROGRAMS = 80  # built -O0 (ATTNCC_DEBUG_BUILD)
EMULATOR_PROGRAMS = 20
KERNEL_SEED_OFFSET = 1_000_000
EMULATOR_SEED_OFFSET = 10_000  # kernel_case index of the first emulator program


@dataclass(frozen=True)
class Limits:
    """Largest error per element relative to max(1, |oracle|), per output."""

    out: float
    lse: float
    qkv_grads: float
    input_grads: float  # learnable runtime inputs: sums of N x M terms per entry

    def of(self, name: str) -> float:
        """The limit for "out", "lse", "dq", "dk", "dv" or "d<input>"."""
        if name in ("out", "lse"):
            return getattr(self, name)
        return self.qkv_grads if name in ("dq", "dk", "dv") else self.input_grads


#: fp32 kernels against the float64 oracle.
KERNEL_LIMITS = Limits(out=2e-5, lse=2e-5, qkv_grads=2e-4, input_grads=2e-4)
#: fp16 emulated CUDA kernels against the oracle on the same fp16 inputs: about 3x the largest
#: errors of 24 programs (out 6.1e-4, lse 3e-7 (fp32), dq/dk/dv 2.1e-3, learnable 9.4e-3).
EMULATOR_LIMITS = Limits(out=2e-3, lse=1e-5, qkv_grads=8e-3, input_grads=3e-2)
#: attncc's float64 reference against the float64 oracle (only rounding order differs).
REFERENCE_TOL = 1e-9

# ============================================================================ the oracle
# Precedence (attn.lark): or < and < not < comparison (does not chain) < + - < * / // % @
# < unary + - < postfix (call, index, .T).
BINARY_BP = {
    "or": 1, "and": 2,
    "<": 4, "<=": 4, ">": 4, ">=": 4, "==": 4, "!=": 4,
    "+": 5, "-": 5,
    "*": 6, "/": 6, "//": 6, "%": 6, "@": 6,
}  # fmt: skip
COMPARISONS = ("<", "<=", ">", ">=", "==", "!=")
NOT_BP = 3  # `not` takes a comparison (or another `not`), not an `and`/`or`
PREFIX_BP = 7  # unary minus binds tighter than any binary operator: -a * b is (-a) * b
KEYWORDS = ("and", "or", "not")
TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:[eE][+-]?[0-9]+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>//|<=|>=|==|!=|[-+*/%<>()\[\],.@]))"
)
FUNCTIONS = {"abs": 1, "exp": 1, "log": 1, "tanh": 1, "sqrt": 1, "min": 2, "max": 2, "where": 3}
#: A number rounded to an int (README: `round` half to even, as torch.round); the generator
#: rounds integers times a power of two, exact in float32 as in float64, so ties really occur.
ROUNDINGS = {"floor": torch.floor, "ceil": torch.ceil, "trunc": torch.trunc, "round": torch.round}
FUNCTIONS.update({name: 1 for name in ROUNDINGS})


class OracleError(Exception):
    """The oracle cannot read a program (a generator or oracle bug, never attncc's)."""


@dataclass
class Val:
    """A value over the index grid: kind int (int64), float (float64), bool, or one of the
    operands of the score product (q, k, kT) or a declared tensor input."""

    kind: str
    t: object
    dtype: str = ""  # declared element type of a tensor input


def tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise OracleError(f"cannot tokenize {text[pos:]!r}")
        pos = m.end()
        kind = m.lastgroup
        value = m.group(kind)
        if kind == "name" and value in KEYWORDS:
            kind = "op"
        tokens.append((kind, value))
    return tokens


def floor_divmod(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Python's a // b and a % b for int64 tensors, from truncating division: where the
    remainder is non-zero and its sign differs from the divisor's, the quotient rounds down
    one more and the remainder moves by one divisor (so it takes the divisor's sign)."""
    a, b = torch.broadcast_tensors(a, b)
    q = torch.div(a, b, rounding_mode="trunc")
    r = a - q * b
    fix = (r != 0) & ((r < 0) != (b < 0))
    return q - fix.long(), torch.where(fix, r + b, r)


class Parser:
    """Precedence climbing over one expression's tokens, evaluating as it parses."""

    def __init__(self, text: str, env: Mapping[str, Val], stats: Counter) -> None:
        self.tokens = tokenize(text)
        self.pos = 0
        self.env = env
        self.stats = stats

    def peek(self) -> str | None:
        return self.tokens[self.pos][1] if self.pos < len(self.tokens) else None

    def take(self) -> tuple[str, str]:
        if self.pos >= len(self.tokens):
            raise OracleError("unexpected end of expression")
        self.pos += 1
        return self.tokens[self.pos - 1]

    def expect(self, value: str) -> None:
        if self.take()[1] != value:
            raise OracleError(f"expected {value!r}")

    def parse_all(self) -> Val:
        value = self.expr(0)
        if self.pos != len(self.tokens):
            raise OracleError(f"trailing tokens {self.tokens[self.pos :]}")
        return value

    def expr(self, min_bp: int) -> Val:
        kind, tok = self.take()
        if kind == "op" and tok == "not":
            lhs = logical_not(self.expr(NOT_BP))
        elif kind == "op" and tok in ("-", "+"):
            operand = self.expr(PREFIX_BP)
            lhs = negate(operand) if tok == "-" else operand
        elif kind == "op" and tok == "(":
            lhs = self.expr(0)
            self.expect(")")
        elif kind == "num":
            is_int = re.fullmatch(r"[0-9]+", tok) is not None
            lhs = (
                Val("int", torch.tensor(int(tok)))
                if is_int
                else Val("float", torch.tensor(float(tok), dtype=torch.float64))
            )
        elif kind == "name":
            lhs = self.call(tok) if self.peek() == "(" else self.name(tok)
        else:
            raise OracleError(f"unexpected {tok!r}")
        lhs = self.postfix(lhs)
        while True:
            op = self.peek()
            bp = BINARY_BP.get(op) if op is not None else None
            if bp is None or bp < min_bp:
                return lhs
            self.take()
            rhs = self.expr(bp + 1)  # left-associative
            if op in COMPARISONS and self.peek() in COMPARISONS:
                raise OracleError("comparisons do not chain")
            lhs = binary(op, lhs, rhs, self.stats)

    def postfix(self, value: Val) -> Val:
        while self.peek() in ("[", "."):
            if self.take()[1] == ".":
                attr = self.take()[1]
                if value.kind != "k" or attr != "T":
                    raise OracleError("only k.T has an attribute")
                value = Val("kT", value.t)
                continue
            index = [self.expr(0)]
            while self.peek() == ",":
                self.take()
                index.append(self.expr(0))
            self.expect("]")
            value = read(value, index)
        return value

    def call(self, fn: str) -> Val:
        self.expect("(")
        args = [self.expr(0)]
        while self.peek() == ",":
            self.take()
            args.append(self.expr(0))
        self.expect(")")
        if FUNCTIONS.get(fn) != len(args):
            raise OracleError(f"bad call {fn} with {len(args)} arguments")
        return call(fn, args)

    def name(self, name: str) -> Val:
        if name == "inf":
            return Val("float", torch.tensor(math.inf, dtype=torch.float64))
        if name not in self.env:
            raise OracleError(f"unknown name {name}")
        return self.env[name]


def _float(v: Val) -> torch.Tensor:
    if v.kind not in ("int", "float"):
        raise OracleError(f"expected a number, got {v.kind}")
    return v.t.double()  # type: ignore[union-attr]


def _int(v: Val) -> torch.Tensor:
    if v.kind != "int":
        raise OracleError(f"expected an integer, got {v.kind}")
    return v.t  # type: ignore[return-value]


def _bool(v: Val) -> torch.Tensor:
    if v.kind != "bool":
        raise OracleError(f"expected a condition, got {v.kind}")
    return v.t  # type: ignore[return-value]


def negate(v: Val) -> Val:
    if v.kind == "int":
        return Val("int", -_int(v))
    return Val("float", -_float(v))


def logical_not(v: Val) -> Val:
    return Val("bool", ~_bool(v))


def binary(op: str, a: Val, b: Val, stats: Counter) -> Val:
    if op == "@":
        if a.kind != "q" or b.kind != "kT":
            raise OracleError("@ only forms q @ k.T here")
        return Val("float", a.t @ b.t.transpose(-1, -2))  # type: ignore[union-attr]
    if op in ("and", "or"):
        x, y = _bool(a), _bool(b)
        return Val("bool", x & y if op == "and" else x | y)
    if op in ("//", "%"):
        x, y = _int(a), _int(b)
        if bool((y == 0).any()):
            raise OracleError("integer division by zero")
        name = "floordiv" if op == "//" else "mod"
        stats[f"{name}_neg_lhs"] += int(bool((x < 0).any()))
        stats[f"{name}_neg_rhs"] += int(bool((y < 0).any()))
        q, r = floor_divmod(x, y)
        return Val("int", q if op == "//" else r)
    if op == "/":
        return Val("float", _float(a) / _float(b))
    both_int = a.kind == "int" and b.kind == "int"
    x, y = (_int(a), _int(b)) if both_int else (_float(a), _float(b))
    if op in COMPARISONS:
        fn = {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne}[op]
        return Val("bool", fn(x, y))
    result = {"+": torch.add, "-": torch.sub, "*": torch.mul}[op](x, y)
    return Val("int" if both_int else "float", result)


def call(fn: str, args: list[Val]) -> Val:
    if fn == "where":
        c, a, b = args
        if a.kind == b.kind == "bool":
            return Val("bool", torch.where(_bool(c), _bool(a), _bool(b)))
        if a.kind == b.kind == "int":
            return Val("int", torch.where(_bool(c), _int(a), _int(b)))
        return Val("float", torch.where(_bool(c), _float(a), _float(b)))
    if fn in ("min", "max"):
        a, b = args
        pick = torch.minimum if fn == "min" else torch.maximum
        if a.kind == b.kind == "int":
            return Val("int", pick(_int(a), _int(b)))
        return Val("float", pick(_float(a), _float(b)))
    (x,) = args
    if fn in ROUNDINGS:
        return x if x.kind == "int" else Val("int", ROUNDINGS[fn](_float(x)).long())
    if fn == "abs":
        return Val(x.kind, _int(x).abs()) if x.kind == "int" else Val("float", _float(x).abs())
    return Val("float", {"exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sqrt": torch.sqrt}[fn](_float(x)))


def read(tensor: Val, index: list[Val]) -> Val:
    if tensor.kind != "tensor":
        raise OracleError("only tensor inputs can be indexed")
    t: torch.Tensor = tensor.t  # type: ignore[assignment]
    if len(index) != t.dim():
        raise OracleError("wrong number of indices")
    idx = [_int(i) for i in index]
    for d, i in enumerate(idx):
        if bool((i < 0).any()) or bool((i >= t.shape[d]).any()):
            raise OracleError(f"index {d} out of range")
    value = t[tuple(torch.broadcast_tensors(*idx))]
    if tensor.dtype == "bool":
        return Val("bool", value != 0)
    if tensor.dtype == "int":
        return Val("int", value.long())
    return Val("float", value.double())


def grid_env(B: int, H: int, Hkv: int, N: int, M: int, D: int) -> dict[str, Val]:
    """b, h, i, j as broadcastable int64 grids over [B, H, N, M]; the sizes as int64 scalars."""
    env = {
        "b": Val("int", torch.arange(B).view(-1, 1, 1, 1)),
        "h": Val("int", torch.arange(H).view(1, -1, 1, 1)),
        "i": Val("int", torch.arange(N).view(1, 1, -1, 1)),
        "j": Val("int", torch.arange(M).view(1, 1, 1, -1)),
    }
    env.update({n: Val("int", torch.tensor(x)) for n, x in zip(("B", "H", "Hkv", "N", "M", "D"), (B, H, Hkv, N, M, D))})
    return env


def evaluate(text: str, env: Mapping[str, Val], stats: Counter | None = None) -> Val:
    """The value of one expression text (the oracle's entry point for expressions)."""
    return Parser(text, env, stats if stats is not None else Counter()).parse_all()


@dataclass
class OracleResult:
    out: torch.Tensor
    lse: torch.Tensor
    visible: torch.Tensor  # the conjunction of the `mask` statements, [B, H, N, M]
    stats: Counter


def oracle_attention(
    text: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    runtime: Mapping[str, object],
    call_scale: float | None = None,
) -> OracleResult:
    """Run a program by its documented meaning in float64: statements in order (score maps
    rewrite `s`, masks are collected and applied after all of them), then softmax over the
    keys (a row with no visible key: output 0, log-sum-exp -inf) and p @ v. GQA: query head h
    reads kv head h // (H / Hkv)."""
    B, H, N, D = q.shape
    Hkv, M = k.shape[1], k.shape[2]
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(H // Hkv, dim=1)
    v = v.repeat_interleave(H // Hkv, dim=1)
    env = grid_env(B, H, Hkv, N, M, D)
    env["q"], env["k"] = Val("q", q), Val("k", k)
    stats: Counter = Counter()
    lines = [re.sub(r"#.*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    # `scale` names one value everywhere: the call's, else the program's `scale = ...`, else 1/sqrt(D)
    scale = 1.0 / math.sqrt(D)
    for line in lines:
        m = re.fullmatch(r"scale\s*=\s*(.+)", line)
        if m:
            scale = float(_float(evaluate(m.group(1), env, stats)))
    if call_scale is not None:
        scale = call_scale
    env["scale"] = Val("float", torch.tensor(scale, dtype=torch.float64))
    scores: torch.Tensor | None = None
    masks: list[torch.Tensor] = []
    tail = []
    for line in lines:
        if re.fullmatch(r"attention\s+\w+", line) or re.fullmatch(r"scale\s*=.*", line):
            continue
        if m := re.fullmatch(r"input\s+(\w+)\s*:\s*(\w+)\s*(\[.*\])?", line):
            name, dtype, dims = m.groups()
            value = runtime[name]
            if dims:
                env[name] = Val("tensor", value, dtype)
                for axis, dim in enumerate(d.strip() for d in dims[1:-1].split(",")):
                    if dim.isidentifier() and dim not in env:  # (a free name: the size the call's tensor has)
                        env[dim] = Val("int", torch.tensor(value.shape[axis]))
            else:
                kind = {"float": "float", "int": "int", "bool": "bool"}[dtype]
                env[name] = Val(
                    kind,
                    torch.tensor(value, dtype={"float": torch.float64, "int": torch.int64, "bool": torch.bool}[dtype]),
                )
        elif m := re.fullmatch(r"const\s+(\w+)\s*=\s*(.+)", line):
            env[m.group(1)] = evaluate(m.group(2), env, stats)
        elif m := re.fullmatch(r"mask\s+(.+)", line):
            masks.append(_bool(evaluate(m.group(1), env, stats)))
        elif line in ("p = softmax(s)", "o = p @ v", "output o"):
            tail.append(line)
        elif m := re.fullmatch(r"(\w+)\s*=\s*(.+)", line):
            name, value = m.group(1), evaluate(m.group(2), env, stats)
            if name == "s":
                scores = _float(value).expand(B, H, N, M)
                env["s"] = Val("float", scores)
            else:
                env[name] = value
        else:
            raise OracleError(f"cannot read statement {line!r}")
    if scores is None or tail != ["p = softmax(s)", "o = p @ v", "output o"]:
        raise OracleError("program lacks the attention chain")
    visible = torch.ones(B, H, N, M, dtype=torch.bool)
    for pred in masks:
        visible = visible & pred.expand(B, H, N, M)
    s = scores.masked_fill(~visible, -math.inf)
    top = s.detach().amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e = torch.exp(s - top)
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    lse = (top + torch.log(total)).squeeze(-1)
    stats["dead_rows"] += int(bool((total == 0).any()))
    stats["partly_dead"] += int(bool((total == 0).any() and (total > 0).any()))
    return OracleResult(p @ v, lse, visible, stats)


# ============================================================================ the generator
P_OR, P_AND, P_NOT, P_CMP, P_ADD, P_MUL, P_UNARY, P_ATOM = range(1, 9)
OP_PREC = {"or": P_OR, "and": P_AND, "+": P_ADD, "-": P_ADD, "*": P_MUL, "/": P_MUL, "//": P_MUL, "%": P_MUL}
OP_PREC.update(dict.fromkeys(COMPARISONS, P_CMP))


@dataclass(frozen=True)
class E:
    """Generated expression text and the precedence level of its outermost operator."""

    text: str
    prec: int = P_ATOM


#: runtime inputs a program may use: name -> declaration
INPUTS = {
    "w": "input w: float[H]",
    "tab": "input tab: float[H, 9]",
    "lens": "input lens: int[B]",
    "n0": "input n0: int",
    "alpha": "input alpha: float",
    "keep": "input keep: bool[M]",
    "flag": "input flag: bool",
    "wide": "input wide: float[H, W]",  # (W: a free dimension name, read in expressions as wide's size)
}
LEARNABLE = ("w", "tab")
#: drawn by a generator of their own (`extras`), so the programs the other inputs make stay the same
EXTRA_INPUTS = ("wide",)
#: let-bound names, several starting with a keyword (the lexer must not split them)
LET_NAMES = ("d", "order", "andy", "notch", "orbit", "info", "x_1", "jj", "hb", "delta", "e2", "nota")
FLOAT_LITERALS = ("0.1", "0.05", "0.25", ".5", "1.5", "2.5", "0.75", "1e-1", "5e-2", "2.", "0.5E0", "1.25")


@dataclass
class Program:
    text: str
    seed: int
    profile: str
    inputs: tuple[str, ...]


class Gen:
    """Typed random expressions (int, bool, bounded float, score) rendered with the fewest
    parentheses the precedence needs (and a few redundant ones)."""

    def __init__(self, rng: random.Random, available: set[str]) -> None:
        self.rng = rng
        self.available = available
        self.int_names: list[str] = []
        self.bool_names: list[str] = []
        self.float_names: list[str] = []
        self.int_consts: dict[str, int] = {}
        self.float_consts: list[str] = []

    # -- rendering
    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def paren(self, e: E) -> str:
        return f"({e.text})"

    def binop(self, op: str, a: E, b: E) -> E:
        p = OP_PREC[op]
        ta = self.paren(a) if a.prec < p or (p == P_CMP and a.prec == P_CMP) or self.chance(0.08) else a.text
        tb = self.paren(b) if b.prec <= p or self.chance(0.08) else b.text
        tight = op in ("+", "-", "*", "/", "//", "%") and self.chance(0.2)
        sep = "" if tight else " "
        return E(f"{ta}{sep}{op}{sep}{tb}", p)

    def neg(self, x: E) -> E:
        if x.prec < P_UNARY:
            return E(f"-({x.text})", P_UNARY)
        return E(f"- {x.text}" if x.text.startswith("-") else f"-{x.text}", P_UNARY)

    def plus(self, x: E) -> E:
        return E(f"+({x.text})" if x.prec < P_UNARY else f"+{x.text}", P_UNARY)

    def not_(self, x: E) -> E:
        return E(f"not ({x.text})" if x.prec < P_NOT else f"not {x.text}", P_NOT)

    def fn(self, name: str, *args: E) -> E:
        return E(f"{name}({', '.join(a.text for a in args)})")

    def lit(self, lo: int = -9, hi: int = 9, nonzero: bool = False) -> E:
        value = self.rng.randint(lo, hi)
        while nonzero and value == 0:
            value = self.rng.randint(lo, hi)
        return E(str(value)) if value >= 0 else self.neg(E(str(-value)))

    def flit(self) -> E:
        return E(self.rng.choice(FLOAT_LITERALS))

    def pick(self, weighted: list[tuple[float, Callable[[], E]]]) -> E:
        options = [(w, f) for w, f in weighted if w > 0]
        return self.rng.choices([f for _, f in options], [w for w, _ in options])[0]()

    # -- integers
    def int_leaf(self) -> E:
        r = self.rng
        return self.pick(
            [
                (3, lambda: E("i")),
                (3, lambda: E("j")),
                (1, lambda: E("h")),
                (0.7, lambda: E("b")),
                (2, lambda: self.lit()),
                (0.8, lambda: E(r.choice(("N", "M", "H", "B", "D", "Hkv")))),
                (2 if self.int_names else 0, lambda: E(r.choice(self.int_names))),
                (1 if self.int_consts else 0, lambda: E(r.choice(list(self.int_consts)))),
                (0.7 if "n0" in self.available else 0, lambda: E("n0")),
            ]
        )

    def gen_int(self, d: int) -> E:
        if d <= 0 or self.chance(0.2):
            return self.int_leaf()
        r = self.rng
        return self.pick(
            [
                (3, lambda: self.binop("-", self.gen_int(d - 1), self.gen_int(d - 1))),
                (1.5, lambda: self.binop("+", self.gen_int(d - 1), self.gen_int(d - 1))),
                (1, lambda: self.binop("*", self.gen_int(d - 1), self.lit(-4, 4))),
                (0.6, lambda: self.binop("*", self.lit(-4, 4), self.gen_int(d - 1))),
                (3, lambda: self.binop("//", self.dividend(d - 1), self.divisor(d - 1))),
                (3, lambda: self.binop("%", self.dividend(d - 1), self.divisor(d - 1))),
                (0.8, lambda: self.neg(self.gen_int(d - 1))),
                (0.2, lambda: self.plus(self.gen_int(d - 1))),
                (0.8, lambda: self.fn("abs", self.gen_int(d - 1))),
                (1, lambda: self.fn(r.choice(("min", "max")), self.gen_int(d - 1), self.gen_int(d - 1))),
                (0.8, lambda: self.fn("where", self.gen_bool(d - 1), self.gen_int(d - 1), self.gen_int(d - 1))),
                (0.6 if "lens" in self.available else 0, lambda: E("lens[b]")),
                (
                    0.8,
                    lambda: self.fn(
                        r.choice(tuple(ROUNDINGS)),
                        self.binop("*", self.gen_int(d - 1), E(r.choice(("0.5", "0.25", "-1.5", "0.125")))),
                    ),
                ),
            ]
        )

    def dividend(self, d: int) -> E:
        """Left operands of // and %: mostly differences, so often negative."""
        r = self.rng
        return self.pick(
            [
                (2, lambda: self.binop("-", E(r.choice("ijhb")), E(r.choice("ij")))),
                (1, lambda: self.binop("-", E("i"), self.binop("*", self.lit(2, 5), E("j")))),
                (1, lambda: self.binop("-", self.gen_int(d), self.lit(0, 30))),
                (2, lambda: self.gen_int(d)),
            ]
        )

    def divisor(self, d: int) -> E:
        """A divisor that cannot be 0 (and that interval arithmetic proves cannot be 0)."""
        r = self.rng
        nonzero = [n for n, v in self.int_consts.items() if v != 0]
        return self.pick(
            [
                (6, lambda: self.lit(-9, 9, nonzero=True)),
                (1.5 if nonzero else 0, lambda: E(r.choice(nonzero))),
                (1, lambda: self.binop("+", E("1"), self.binop("%", self.gen_int(d), self.lit(2, 7)))),
                (
                    0.7,
                    lambda: self.neg(
                        self.binop("+", E("1"), self.binop("%", self.fn("abs", self.gen_int(d)), self.lit(2, 7)))
                    ),
                ),
                (
                    1,
                    lambda: self.binop(
                        *r.choice(
                            (("-", E("j"), E("M")), ("-", E("i"), E("N")), ("+", E("i"), E("1")), ("-", E("N"), E("i")))
                        )
                    ),
                ),
                (0.6, lambda: self.fn("max", self.gen_int(d), self.lit(1, 6))),
                (0.6, lambda: self.fn("min", self.gen_int(d), self.lit(-6, -1))),
            ]
        )

    # -- conditions
    def compare(self, a: E, b: E) -> E:
        return self.binop(self.rng.choice(COMPARISONS), a, b)

    def row_killer(self) -> E:
        """Predicates that leave some query rows without any visible key."""
        r = self.rng
        return self.pick(
            [
                (1, lambda: self.binop("<=", E("j"), self.binop("-", E("i"), self.lit(1, 9)))),
                (1, lambda: self.binop("!=", self.binop("%", E("i"), self.lit(2, 6)), self.lit(0, 1))),
                (
                    1,
                    lambda: self.binop(
                        "!=",
                        self.binop("//", self.binop("-", E("i"), self.lit(3, 12)), self.lit(2, 5)),
                        self.lit(-2, -1),
                    ),
                ),
                (
                    0.6,
                    lambda: self.binop(
                        r.choice(("<", "<=")),
                        self.binop("%", self.binop("-", E("j"), E("i")), self.lit(3, 6)),
                        self.lit(1, 2),
                    ),
                ),
                (1 if "lens" in self.available else 0, lambda: self.binop("<", E("j"), E("lens[b]"))),
            ]
        )

    def gen_bool(self, d: int) -> E:
        r = self.rng
        if d <= 0:
            return self.compare(self.int_leaf(), self.int_leaf())
        return self.pick(
            [
                (5, lambda: self.compare(self.gen_int(d - 1), self.gen_int(d - 1))),
                (
                    0.6,
                    lambda: self.compare(
                        self.binop("*", self.gen_int(d - 1), E(r.choice(("0.5", "1.5", "0.25")))), self.gen_int(d - 1)
                    ),
                ),
                (
                    0.6,
                    lambda: self.compare(
                        self.binop("/", self.gen_int(d - 1), self.lit(1, 5)), E(r.choice(("1.5", "2.5", "-0.5", "3")))
                    ),
                ),
                (2, lambda: self.binop("and", self.gen_bool(d - 1), self.gen_bool(d - 1))),
                (2, lambda: self.binop("or", self.gen_bool(d - 1), self.gen_bool(d - 1))),
                (1.5, lambda: self.not_(self.gen_bool(d - 1))),
                (0.4, lambda: self.fn("where", self.gen_bool(d - 1), self.gen_bool(d - 1), self.gen_bool(d - 1))),
                (1.5 if self.bool_names else 0, lambda: E(r.choice(self.bool_names))),
                (0.5 if "keep" in self.available else 0, lambda: E("keep[j]")),
                (0.5 if "flag" in self.available else 0, lambda: E("flag")),
                (0.8, self.row_killer),
            ]
        )

    # -- bounded floats of the indices (|value| stays small: scores stay well conditioned)
    def gen_fidx(self, d: int) -> E:
        r = self.rng
        x = lambda: self.gen_int(max(d - 1, 0))  # noqa: E731
        mod = lambda: self.binop("%", self.dividend(max(d - 1, 0)), self.lit(2, 9))  # noqa: E731
        return self.pick(
            [
                (2, lambda: self.binop("*", self.flit(), mod())),
                (2, lambda: self.binop("*", mod(), E(r.choice(("0.1", "0.05", "0.2"))))),
                (1, lambda: self.binop("/", mod(), self.lit(2, 9))),
                (1, lambda: self.binop("/", self.binop("//", self.dividend(0), self.divisor(0)), E("37.0"))),
                (1, lambda: self.fn("tanh", self.binop("/", x(), E("8.0")))),
                (1, lambda: self.fn("tanh", self.binop("*", E("0.1"), x()))),
                (1, lambda: self.fn("exp", self.binop("*", self.neg(E("0.1")), self.fn("abs", x())))),
                (
                    0.8,
                    lambda: self.fn(
                        "log", self.binop("+", E("1"), self.binop("%", self.fn("abs", x()), self.lit(2, 7)))
                    ),
                ),
                (0.8, lambda: self.fn("sqrt", self.binop("%", self.fn("abs", x()), self.lit(2, 9)))),
                (
                    0.8,
                    lambda: self.binop(
                        "*", E("0.05"), self.fn("min", self.fn("max", x(), self.lit(-9, -1)), self.lit(1, 9))
                    ),
                ),
                (
                    0.8,
                    lambda: self.binop(
                        "-",
                        E(r.choice(("0.25", "1"))),
                        self.binop("*", self.fn("abs", self.binop("-", E("i"), E("j"))), E("0.01")),
                    ),
                ),
                (
                    1 if d > 0 else 0,
                    lambda: self.fn("where", self.gen_bool(d - 1), self.gen_fidx(d - 1), self.gen_fidx(d - 1)),
                ),
                (0.6 if d > 0 else 0, lambda: self.binop(r.choice("+-"), self.gen_fidx(d - 1), self.gen_fidx(d - 1))),
                (0.6, lambda: self.binop("*", E("scale"), mod())),
                (0.6, lambda: self.fn("where", self.gen_bool(max(d - 1, 0)), self.lit(-2, 2), self.flit())),
                (0.6, lambda: self.binop("*", E("0.1"), self.fn(r.choice(("min", "max")), mod(), self.flit()))),
                (0.8 if self.float_names else 0, lambda: E(r.choice(self.float_names))),
                (0.6 if self.float_consts else 0, lambda: self.binop("*", E(r.choice(self.float_consts)), E("0.1"))),
                (3 if "alpha" in self.available else 0, lambda: self.binop("*", E("alpha"), mod())),
                (
                    0.5 if "n0" in self.available else 0,
                    lambda: self.binop(
                        "*", E("0.1"), self.binop("%", self.binop("-", E("j"), E("n0")), self.lit(2, 6))
                    ),
                ),
            ]
        )

    def learnable(self, d: int) -> E:
        r = self.rng
        choices: list[tuple[float, Callable[[], E]]] = []
        if "w" in self.available:
            head = lambda: E(r.choice(("w[h]", "w[H - 1 - h]", "w[(h + 1) % H]", "w[h // 2]")))  # noqa: E731
            choices += [(2, lambda: self.binop("*", head(), self.gen_fidx(d))), (1, head)]
        if "tab" in self.available:
            choices += [
                (1, lambda: E("tab[h, (j - i) % 9]")),
                (1, lambda: E("tab[h, 4 + max(-4, min(4, j - i))]")),
                (1, lambda: E(f"tab[{r.choice(('h', '0', 'H - 1'))}, abs({self.dividend(0).text}) % 9]")),
            ]
        return self.pick(choices) if choices else self.gen_fidx(d)

    # -- score maps
    def gen_score(self, d: int, inner: E) -> E:
        """A float expression of the score `inner` that keeps scores finite and moderate."""
        r = self.rng
        if d > 1 and self.chance(0.35):
            inner = self.gen_score(d - 1, inner)
        cap = lambda: E(r.choice(("5.0", "8.0", "30.0", *self.float_consts)))  # noqa: E731
        has_learnable = any(n in self.available for n in LEARNABLE)
        return self.pick(
            [
                (3, lambda: self.binop(r.choice("+-"), inner, self.gen_fidx(d))),
                (1, lambda: self.binop("+", self.gen_fidx(d), inner)),
                (
                    1,
                    lambda: self.binop(
                        "*",
                        inner,
                        E(r.choice(("0.5", "2", "1.5", "0.75"))) if r.random() < 0.8 else E("scale * 4", P_MUL),
                    ),
                ),
                (0.6, lambda: self.binop("/", inner, E(r.choice(("2", "1.5", "4.0"))))),
                (0.5, lambda: self.binop("*", E(r.choice(("0.5", "2"))), inner)),
                (
                    1,
                    lambda: self.binop(
                        "*",
                        inner,
                        self.binop(
                            "+", E("1"), self.binop("*", E("0.1"), self.binop("%", self.dividend(0), self.lit(2, 6)))
                        ),
                    ),
                ),
                (1.5, lambda: (lambda c: self.binop("*", c, self.fn("tanh", self.binop("/", inner, c))))(cap())),
                (1, lambda: self.fn("where", self.gen_bool(d), inner, self.neg(inner))),
                (
                    1,
                    lambda: self.fn(
                        "where", self.gen_bool(d), inner, self.binop(r.choice("*-"), inner, E(r.choice(("0.5", "1.5"))))
                    ),
                ),
                (
                    1,
                    lambda: self.binop(
                        "-", inner, self.binop("*", self.fn("abs", self.binop("-", E("i"), E("j"))), E("0.05"))
                    ),
                ),
                (0.7, lambda: self.fn("min", inner, E(r.choice(("2.5", "1", "0.5"))))),
                (0.7, lambda: self.fn("max", inner, self.neg(E(r.choice(("1.5", "1", "0.25")))))),
                (0.5, lambda: self.fn("max", inner, self.binop("*", inner, E("0.2")))),
                (0.5, lambda: self.fn("min", inner, self.gen_fidx(0))),
                (0.5, lambda: self.fn("abs", inner)),
                (
                    0.6,
                    lambda: self.fn(
                        "where",
                        self.binop(">", inner, E("1")),
                        inner,
                        self.binop("+", self.binop("*", E("0.5"), inner), E("0.5")),
                    ),
                ),
                (
                    0.4,
                    lambda: self.fn("where", self.binop("<", inner, E("0")), self.binop("*", E("0.1"), inner), inner),
                ),
                (0.6, lambda: self.fn("exp", self.binop("/", inner, E("4")))),
                (0.6, lambda: self.fn("log", self.binop("+", E("1"), self.fn("exp", inner)))),
                (0.5, lambda: self.fn("sqrt", self.binop("+", self.binop("*", inner, inner), E("1")))),
                (0.5, lambda: self.binop("+", self.binop("*", inner, E("0.5")), self.binop("*", E("0.25"), inner))),
                (3 if has_learnable else 0, lambda: self.binop("+", inner, self.learnable(d))),
            ]
        )

    def const_expr(self) -> E:
        r = self.rng
        a = self.lit(-20, 20)
        return self.pick(
            [
                (2, lambda: self.binop("//", a, self.lit(-7, 7, nonzero=True))),
                (2, lambda: self.binop("%", a, self.lit(-7, 7, nonzero=True))),
                (1, lambda: self.binop("-", self.binop("*", self.lit(-3, 3), self.lit(-5, 5)), a)),
                (1, lambda: self.neg(self.binop("//", a, self.lit(-5, 5, nonzero=True)))),
                (
                    1 if self.int_consts else 0,
                    lambda: self.binop(r.choice("+-*"), E(r.choice(list(self.int_consts))), self.lit(1, 3)),
                ),
            ]
        )


def generate_program(seed: int, profile: str = "reference", recipe: frozenset[str] = frozenset()) -> Program:
    """A random program. `profile` "kernel" keeps it a little smaller; `recipe` forces
    features: "dead_rows" (a mask leaving rows without keys), "learnable" (w or tab in a score
    map), "neg_inf" (a score map sending scores to -inf), "call_scale"."""
    rng = random.Random(seed)
    kernel = profile == "kernel"
    available = {n for n in INPUTS if n not in EXTRA_INPUTS and rng.random() < (0.3 if n in LEARNABLE else 0.15)}
    if "learnable" in recipe:
        available.add(rng.choice(LEARNABLE))
    if "dead_rows" in recipe and rng.random() < 0.5:
        available.add("lens")
    g = Gen(rng, available)
    depth = 2 if kernel else 3
    head: list[str] = []
    for n in range(rng.choice((0, 0, 1, 2))):
        name = f"K{n}"
        e = g.const_expr()
        value = eval(e.text, {"__builtins__": {}}, dict(g.int_consts))  # Python's meaning
        head.append(f"const {name} = {e.text}")
        g.int_consts[name] = value
    if rng.random() < 0.25:
        head.append(f"const CAP = {rng.choice(('2.5 * 2', '12.0', '1e1', '4 + 0.5'))}")
        g.float_consts.append("CAP")
    if rng.random() < 0.15:
        head.append(f"scale = {rng.choice(('1 / sqrt(D)', '0.5 / sqrt(D)', '1 / D', '2.0 / sqrt(D * 4)', '0.3'))}")
    body: list[str] = []

    def let(kind: str) -> None:
        pool = {"int": g.int_names, "bool": g.bool_names, "float": g.float_names}[kind]
        taken = set(g.int_names + g.bool_names + g.float_names)
        if pool and rng.random() < 0.4:  # rebind: the old value is used on the right, later uses see the new
            name = rng.choice(pool)
        else:
            free = [n for n in LET_NAMES if n not in taken]
            if not free:
                return
            name = rng.choice(free)
        value = {
            "int": lambda: g.gen_int(depth),
            "bool": lambda: g.gen_bool(depth),
            "float": lambda: g.gen_fidx(depth - 1),
        }[kind]()
        body.append(f"{name} = {value.text}")
        if name not in pool:
            pool.append(name)

    for _ in range(rng.choice((0, 0, 1))):
        let(rng.choice(("int", "bool")))
    products = ("s = q @ k.T * scale",) * 6 + (
        "s = (q @ k.T) * scale",
        "s = q @ k.T * scale / 2",
        "s = q @ k.T / 4",
        "s = q @ k.T * 0.25 * (scale * 4)",
    )
    # (a call's scale= is an error for a program that reads no name `scale`)
    body.append(rng.choice([p for p in products if "scale" in p] if "call_scale" in recipe else products))
    maps = masks = 0
    weights = (0.6, 0.4, 0.3, 2, 2) if kernel else (1.2, 0.8, 0.6, 2, 2)
    for _ in range(rng.randint(2, 5) if kernel else rng.randint(1, 6)):
        what = rng.choices(("let_int", "let_bool", "let_float", "map", "mask"), weights)[0]
        if what.startswith("let"):
            let(what[4:])
        elif what == "map" and maps < 3:
            body.append(f"s = {g.gen_score(depth, E('s')).text}")
            maps += 1
        elif what == "mask":
            body.append(f"mask {g.gen_bool(depth).text}")
            masks += 1
    if "learnable" in recipe:
        body.append(f"s = {g.binop('+', E('s'), g.learnable(depth)).text}")
        maps += 1
    if "dead_rows" in recipe:
        body.append(f"mask {g.row_killer().text}")
        masks += 1
    if maps == 0:
        body.append(f"s = {g.gen_score(depth, E('s')).text}")
    if "neg_inf" in recipe or (not kernel and rng.random() < 0.1):
        minus_inf = g.neg(E("inf"))
        cond = g.gen_bool(1)
        args = (cond, E("s"), minus_inf) if rng.random() < 0.5 else (cond, minus_inf, E("s"))
        body.append(f"s = {g.fn('where', *args).text}")
    if rng.random() < 0.15:  # a comment and a blank line the parser must skip
        body.insert(rng.randrange(len(body) + 1), "# a comment: mask i < j and s = -s\n")
    if rng.random() < 0.1:  # comments after statements
        at = rng.randrange(len(body))
        body[at] += "  # or not s"
    if rng.random() < 0.1:  # indented lines
        body = [("  " if rng.random() < 0.5 else "\t") + line for line in body]
    extras(random.Random(seed * 7919 + 17), body, depth)
    used = tuple(n for n in INPUTS if any(re.search(rf"\b{n}\b", line) for line in head + body))
    text = "\n".join(
        [f"attention fuzz{seed}", *(INPUTS[n] for n in used), *head, *body, "p = softmax(s)", "o = p @ v", "output o"]
    )
    newline = "\r\n" if rng.random() < 0.05 else "\n"
    return Program((text + "\n").replace("\n", newline), seed, profile, used)


def extras(rng: random.Random, body: list[str], depth: int) -> None:
    """Features drawn from a generator of their own: a table whose length is a free dimension
    name (`wide[h, min(max(j - i + W // 2, 0), W - 1)]`, W bound from the call's tensor), and
    new scores that do not read the old (right after the product: the maps after it build on
    them, and q and k get zero gradients)."""
    product = next(n for n, line in enumerate(body) if "@ k.T" in line)
    if rng.random() < 0.15:
        index = rng.choice(("min(max(j - i + W // 2, 0), W - 1)", "(j - i) % W", "abs(i * 3 - j) % W", "min(i, W - 1)"))
        body.append(f"s = s {rng.choice('+-')} wide[{rng.choice(('h', 'H - 1 - h', '0'))}, {index}]")
    if rng.random() < 0.06:
        body.insert(product + 1, f"s = {Gen(rng, set()).gen_fidx(max(depth - 1, 1)).text}")


# ============================================================================ inputs and comparison
def runtime_inputs(
    prog: Program, B: int, H: int, M: int, gen: torch.Generator, dtype: torch.dtype, requires_grad: bool
) -> dict[str, object]:
    values: dict[str, object] = {}
    for name in prog.inputs:
        if name == "w":
            values[name] = (
                (torch.randn(H, generator=gen, dtype=torch.float64) * 0.5).to(dtype).requires_grad_(requires_grad)
            )
        elif name == "wide":  # (its length, W in the program, differs from call to call)
            width = int(torch.randint(1, 13, (1,), generator=gen))
            values[name] = (
                (torch.randn(H, width, generator=gen, dtype=torch.float64) * 0.5)
                .to(dtype)
                .requires_grad_(requires_grad)
            )
        elif name == "tab":
            values[name] = (
                (torch.randn(H, 9, generator=gen, dtype=torch.float64) * 0.5).to(dtype).requires_grad_(requires_grad)
            )
        elif name == "lens":
            lens = torch.randint(0, M + 1, (B,), generator=gen)
            lens[0] = 0 if B > 1 else max(1, M // 2)  # batch 0 has no keys: its rows are fully masked
            values[name] = lens
        elif name == "n0":
            values[name] = int(torch.randint(-3, 6, (1,), generator=gen))
        elif name == "alpha":
            values[name] = float(torch.rand(1, generator=gen)) - 0.5
        elif name == "keep":
            values[name] = torch.rand(M, generator=gen) < 0.7
        elif name == "flag":
            values[name] = bool(torch.rand(1, generator=gen) < 0.5)
    return values


def relative_error(got: torch.Tensor | None, ref: torch.Tensor | None) -> tuple[float, str]:
    """max |got - ref| / max(1, |ref|) and where it is; NaN or infinities in different places,
    a missing tensor or a shape mismatch are an infinite error."""
    if got is not None and ref is None:  # (an operand the program does not read: its gradient is 0)
        ref = torch.zeros_like(got)
    if got is None or ref is None:
        return math.inf, "missing gradient"
    got, ref = got.detach().double(), ref.detach().double()
    if got.shape != ref.shape:
        return math.inf, f"shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    nan_mismatch = torch.isnan(got) != torch.isnan(ref)
    inf_mismatch = (torch.isinf(got) | torch.isinf(ref)) & (got != ref) & ~torch.isnan(got) & ~torch.isnan(ref)
    bad = nan_mismatch | inf_mismatch
    if bool(bad.any()):
        at = tuple(int(x) for x in bad.nonzero()[0])
        return math.inf, f"non-finite mismatch at {at}: got {float(got[at])}, expected {float(ref[at])}"
    finite = torch.isfinite(ref)
    err = torch.where(finite, (got - ref).abs() / ref.abs().clamp_min(1.0), torch.zeros_like(ref))
    if err.numel() == 0:
        return 0.0, ""
    at = tuple(int(x) for x in (err == err.max()).nonzero()[0])
    return float(err.max()), f"worst at {at}: got {float(got[at])!r}, expected {float(ref[at])!r}"


def describe(prog: Program, extra: str) -> str:
    return (
        f"{extra}\n--- program (seed {prog.seed}, profile {prog.profile!r}; rebuild with "
        f"tests.test_fuzz_programs.generate_program({prog.seed}, {prog.profile!r}, ...)) ---\n{prog.text}"
    )


# ============================================================================ tests
def _python_point_env(b: int, h: int, i: int, j: int, sizes: dict[str, int]) -> dict[str, object]:
    return {
        "__builtins__": {},
        "b": b, "h": h, "i": i, "j": j, **sizes, "inf": math.inf,
        "where": lambda c, x, y: x if c else y, "min": min, "max": max, "abs": abs,
        "exp": math.exp, "log": math.log, "tanh": math.tanh, "sqrt": math.sqrt, "scale": 0.25,
        "floor": math.floor, "ceil": math.ceil, "trunc": math.trunc, "round": round,  # (round: half to even)
    }  # fmt: skip


def test_oracle_agrees_with_python() -> None:
    """The oracle is right: for 240 generated integer, condition and float expressions (negative
    operands of // and %, unparenthesised mixes of every precedence level), its tensor value at
    every point of a small grid equals Python's `eval` of the same text, whose precedence and
    integer semantics the README promises. Also pins a few hand-written cases."""
    sizes = {"B": 2, "H": 3, "Hkv": 3, "N": 7, "M": 9, "D": 16}
    env = grid_env(**sizes)
    env["scale"] = Val("float", torch.tensor(0.25, dtype=torch.float64))
    fixed = {
        "(i - j) // 3": lambda i, j: (i - j) // 3,
        "(j - i) % 5": lambda i, j: (j - i) % 5,
        "(i - 2*j) // -4": lambda i, j: (i - 2 * j) // -4,
        "(i - j) % -3": lambda i, j: (i - j) % -3,
        "-i // 2": lambda i, j: (-i) // 2,
        "i - j - 1 // 2 * 3": lambda i, j: i - j - 0,
        "j < i or i < 2 and j > 4": lambda i, j: (j < i) or ((i < 2) and (j > 4)),
        "not j < i and i == 3": lambda i, j: (not (j < i)) and i == 3,
    }
    for text, expected in fixed.items():
        value = evaluate(text, env).t.expand(2, 3, 7, 9)  # type: ignore[union-attr]
        for i in range(7):
            for j in range(9):
                assert value[0, 0, i, j].item() == expected(i, j), text
    exprs_checked = 0
    for n in range(240):
        rng = random.Random(BASE_SEED * 7 + n)
        g = Gen(rng, set())
        e = [g.gen_int, g.gen_bool, g.gen_fidx][n % 3](3)
        value = evaluate(e.text, env)
        grid = value.t.expand(2, 3, 7, 9)  # type: ignore[union-attr]
        code = compile(e.text, "<dsl>", "eval")
        for b in range(2):
            for h in range(3):
                for i in range(7):
                    for j in range(9):
                        want = eval(code, _python_point_env(b, h, i, j, sizes))
                        got = grid[b, h, i, j].item()
                        if value.kind == "float":
                            ok = math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12) or got == want
                        else:
                            ok = got == want and isinstance(got, bool) == isinstance(want, bool)
                        assert ok, f"{e.text!r} at b={b} h={h} i={i} j={j}: oracle {got!r}, Python {want!r}"
        exprs_checked += 1
    assert exprs_checked == 240


def reference_case(n: int) -> tuple[Program, dict[str, int], tuple[int, int], float | None]:
    seed = BASE_SEED + n
    rng = random.Random(seed * 31 + 5)
    prog = generate_program(seed, "reference")
    H = rng.choice((1, 2, 4))
    shape = {
        "B": rng.choice((1, 2)),
        "H": H,
        "Hkv": rng.choice([d for d in (1, 2, 4) if H % d == 0]),
        "N": rng.choice((1, 2, 5, 17, 33, 40, 64, 77)),
        "M": rng.choice((1, 3, 16, 31, 40, 65, 90)),
        "D": rng.choice((4, 8, 16)),
    }
    tiles = (rng.choice((4, 8, 12, 16)), 32)
    call_scale = 0.3 if rng.random() < 0.08 else None
    return prog, shape, tiles, call_scale


def test_programs_match_the_reference() -> None:
    """For 300 random programs at random small shapes (N, M from 1 to 90, GQA and MQA), attncc's
    float64 reference gives the oracle's out and lse (so parsing, precedence, typing, constant
    folding, composition and canonicalisation agree with the README's meaning), and the tile
    classes the kernels would use are sound for the oracle's mask (no visible score in an
    `empty` tile, no masked one in a `full` tile). Also checks that the generator reached
    what it is for: // and % of negative numbers and by negative divisors, rows with no
    visible key, and every operator and function of the DSL."""
    failures: list[str] = []
    coverage: Counter = Counter()
    tokens_seen: Counter = Counter()
    tile_kinds: Counter = Counter()
    for n in range(REFERENCE_PROGRAMS):
        prog, shape, tiles, call_scale = reference_case(n)
        gen = torch.Generator().manual_seed(prog.seed)
        B, H, Hkv, N, M, D = (shape[x] for x in ("B", "H", "Hkv", "N", "M", "D"))
        q = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64)
        k = torch.randn(B, Hkv, M, D, generator=gen, dtype=torch.float64)
        v = torch.randn(B, Hkv, M, D, generator=gen, dtype=torch.float64)
        runtime = runtime_inputs(prog, B, H, M, gen, torch.float64, requires_grad=False)
        try:
            kern = attncc.compile(prog.text, tiles=tiles)
            scale_kw = {"scale": call_scale} if call_scale is not None else {}
            ref_out, ref_lse = kern.reference(q, k, v, **scale_kw, **runtime)
            classes = kern.tile_classes(q, k, **runtime)
        except Exception as exc:  # a generated program is legal: any error is a finding
            failures.append(describe(prog, f"attncc raised {type(exc).__name__}: {exc}"))
            continue
        mine = oracle_attention(prog.text, q, k, v, runtime, call_scale)
        coverage.update(event for event, count in mine.stats.items() if count)
        tokens_seen.update(set(re.findall(r"//|<=|>=|==|!=|[-+*/%<>@]|[A-Za-z_]\w*", re.sub(r"#.*", "", prog.text))))
        for name, got, ref in (("out", ref_out, mine.out), ("lse", ref_lse, mine.lse)):
            err, where = relative_error(got, ref)
            if not err <= REFERENCE_TOL:
                failures.append(
                    describe(
                        prog,
                        f"reference {name} differs from the oracle by {err:.3g} ({where}); shape {shape}, scale {call_scale}",
                    )
                )
        # tile classes vs the oracle's mask
        Br, Bc = tiles
        ti, tj = -(-N // Br), -(-M // Bc)
        vis = mine.visible
        any_vis = torch.zeros(B, H, ti * Br, tj * Bc, dtype=torch.bool)
        all_vis = torch.ones(B, H, ti * Br, tj * Bc, dtype=torch.bool)
        any_vis[:, :, :N, :M] = vis
        all_vis[:, :, :N, :M] = vis
        any_t = any_vis.view(B, H, ti, Br, tj, Bc).any(5).any(3)
        all_t = all_vis.view(B, H, ti, Br, tj, Bc).all(5).all(3)
        cls = classes.expand(B, H, ti, tj)
        tile_kinds.update({0: "empty", 1: "partial", 2: "full"}[int(c)] for c in cls.unique())
        wrong_empty = (cls == 0) & any_t
        wrong_full = (cls == 2) & ~all_t
        if bool(wrong_empty.any() | wrong_full.any()):
            at = tuple(int(x) for x in (wrong_empty | wrong_full).nonzero()[0])
            failures.append(
                describe(
                    prog,
                    f"tile {at} (Br={Br}, Bc={Bc}) classified {int(cls[at])} but the mask disagrees; shape {shape}",
                )
            )
    assert not failures, f"{len(failures)} of {REFERENCE_PROGRAMS} programs disagree; first ones:\n\n" + "\n\n".join(
        failures[:3]
    )
    for what in ("floordiv_neg_lhs", "mod_neg_lhs", "floordiv_neg_rhs", "mod_neg_rhs", "dead_rows", "partly_dead"):
        assert coverage[what] >= 10, f"the generator reached {what} in only {coverage[what]} programs"
    missing = {*BINARY_BP, "not", *FUNCTIONS, "inf", "const", "scale"} - set(tokens_seen)
    assert not missing, f"never generated: {sorted(missing)}"
    assert len(set(INPUTS) & set(tokens_seen)) >= 5, f"runtime inputs used: {set(INPUTS) & set(tokens_seen)}"
    assert set(tile_kinds) == {"empty", "partial", "full"}, tile_kinds


KERNEL_SHAPES = (
    # B, H, Hkv, N, M, D, tiles: every row crosses >= 3 key tiles; N, M not multiples of 64
    (2, 4, 2, 150, 150, 16, (16, 32)),
    (2, 4, 4, 130, 150, 32, (32, 32)),
    (1, 4, 1, 150, 150, 16, (16, 32)),
    (2, 2, 2, 150, 97, 24, (12, 32)),
)
KERNEL_RECIPES = (
    frozenset({"dead_rows", "learnable"}),
    frozenset({"learnable"}),
    frozenset({"dead_rows", "neg_inf"}),
    frozenset(),
    frozenset({"learnable", "call_scale"}),
    frozenset({"dead_rows"}),
)


@functools.cache
def kernel_case(n: int) -> tuple[Program, tuple, frozenset[str]]:
    """The n-th kernel program, its shape and recipe: the first generated program (seeds
    n * 100 + attempt) whose rows are mostly alive and whose keys are not mostly masked, so
    that a kernel build is not spent on a program that computes little."""
    recipe = KERNEL_RECIPES[n % len(KERNEL_RECIPES)]
    shape = KERNEL_SHAPES[n % len(KERNEL_SHAPES)]
    B, H, Hkv, N, M, D, _ = shape
    for attempt in range(100):
        prog = generate_program(BASE_SEED + KERNEL_SEED_OFFSET + n * 100 + attempt, "kernel", recipe)
        gen = torch.Generator().manual_seed(prog.seed)
        q = torch.randn(B, H, N, D, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(B, Hkv, M, D, generator=gen, dtype=torch.float64) for _ in range(2))
        mine = oracle_attention(prog.text, q, k, v, runtime_inputs(prog, B, H, M, gen, torch.float64, False))
        alive = torch.isfinite(mine.lse).double().mean().item()
        dense = mine.visible.double().mean().item()
        if alive >= 0.5 and dense >= 0.2 and (alive < 1.0 or "dead_rows" not in recipe):
            return prog, shape, recipe
    raise AssertionError(f"no kernel program {n} with enough visible scores in 100 attempts")


def compare_with_oracle(
    kern: attncc.Kernel,
    prog: Program,
    shape: tuple,
    recipe: frozenset[str],
    dtype: torch.dtype,
    limits: Limits,
) -> list[str]:
    """Run `kern` forward and backward on the case's inputs in `dtype` (q, k, v and learnable
    inputs requiring grad) and compare out, lse and every gradient with the oracle's float64
    evaluation of the same (rounded) values; then a second call with other values of the
    non-learnable runtime inputs. Returns the problems found."""
    B, H, Hkv, N, M, D, _ = shape
    gen = torch.Generator().manual_seed(prog.seed)
    q = torch.randn(B, H, N, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, M, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, M, D, generator=gen).to(dtype).requires_grad_()
    runtime = runtime_inputs(prog, B, H, M, gen, torch.float32, requires_grad=True)
    call_scale = 0.2 if "call_scale" in recipe else None
    scale_kw = {"scale": call_scale} if call_scale is not None else {}
    out, lse = kern(q, k, v, return_lse=True, **scale_kw, **runtime)
    learn = [name for name, t in runtime.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [q, k, v] + [runtime[name] for name in learn]
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    grads = torch.autograd.grad(out, wrt, dout, allow_unused=True)

    leaves = [t.detach().double().requires_grad_() for t in wrt]
    runtime64 = dict(runtime)
    runtime64.update(zip(learn, leaves[3:]))
    mine = oracle_attention(prog.text, leaves[0], leaves[1], leaves[2], runtime64, call_scale)
    expected = torch.autograd.grad(mine.out, leaves, dout.double(), allow_unused=True)
    names = ["out", "lse", "dq", "dk", "dv"] + [f"d{name}" for name in learn]
    problems = []
    for name, got, ref in zip(names, [out, lse, *grads], [mine.out, mine.lse, *expected]):
        err, where = relative_error(got, ref)
        limit = limits.of(name)
        if not err <= limit:
            problems.append(f"{name}: error {err:.3g} > {limit:g} ({where})")
    # a second call at the same shape with other values of the non-learnable inputs (the
    # kernel caches per-shape call preparation; tile classes depend on e.g. `lens`)
    if set(prog.inputs) - set(LEARNABLE):
        other = runtime_inputs(prog, B, H, M, torch.Generator().manual_seed(prog.seed + 1), torch.float32, False)
        again = {name: (runtime[name] if name in LEARNABLE else other[name]) for name in runtime}
        with torch.no_grad():
            out2, lse2 = kern(q, k, v, return_lse=True, **scale_kw, **again)
            mine2 = oracle_attention(prog.text, q.double(), k.double(), v.double(), again, call_scale)
        for name, got, ref in (("out", out2, mine2.out), ("lse", lse2, mine2.lse)):
            err, where = relative_error(got, ref)
            if not err <= limits.of(name):
                problems.append(f"{name} (2nd call): error {err:.3g} > {limits.of(name):g} ({where}); inputs {again}")
    return problems


def compare_decoding_with_oracle(kern: attncc.Kernel, prog: Program, shape: tuple, recipe: frozenset[str]) -> list[str]:
    """Inference calls of 1 and 3 queries (decoding steps: one query tile, the decoding forward)
    over the case's keys, fp32, each twice (the call keeping its launch, then one repeating it).
    Out and lse against the oracle; returns the problems found."""
    B, H, Hkv, _, M, D, _ = shape
    problems = []
    for queries in (1, 3):
        gen = torch.Generator().manual_seed(prog.seed + queries)
        q = torch.randn(B, H, queries, D, generator=gen)
        k, v = (torch.randn(B, Hkv, M, D, generator=gen) for _ in range(2))
        runtime = runtime_inputs(prog, B, H, M, gen, torch.float32, requires_grad=False)
        scale_kw = {"scale": 0.2} if "call_scale" in recipe else {}
        mine = oracle_attention(prog.text, q.double(), k.double(), v.double(), runtime, scale_kw.get("scale"))
        with torch.no_grad():
            for call in ("first", "repeated"):
                out, lse = kern(q, k, v, return_lse=True, **scale_kw, **runtime)
                for name, got, ref in (("out", out, mine.out), ("lse", lse, mine.lse)):
                    err, where = relative_error(got, ref)
                    if not err <= KERNEL_LIMITS.of(name):
                        problems.append(f"{name} ({call} call of {queries} queries): error {err:.3g} ({where})")
    return problems


def check_cpu_kernel_program(n: int) -> None:
    """The n-th kernel program built as an fp32 CPU kernel (the n-th of the auto, two-pass and
    fused backward), forward and backward within KERNEL_LIMITS of the oracle."""
    prog, shape, recipe = kernel_case(n)
    kern = attncc.compile(prog.text, tiles=shape[-1])
    kern.backward = ("auto", "two-pass", "fused")[n % 3]
    problems = compare_with_oracle(kern, prog, shape, recipe, torch.float32, KERNEL_LIMITS)
    problems += compare_decoding_with_oracle(kern, prog, shape, recipe)
    context = f"shape {shape[:-1]} (B H Hkv N M D), tiles {shape[-1]}, backward {kern.backward}"
    assert not problems, describe(prog, "kernel differs from the oracle: " + "; ".join(problems) + f"\n{context}")


@pytest.mark.parametrize("n", range(KERNEL_PROGRAMS))
def test_kernel_matches_the_oracle(n: int) -> None:
    """A generated program built as a CPU kernel (fp32, tiles small enough that every row
    visits at least 3 key tiles, N and M not multiples of the tiles, GQA/MQA, the fused and
    the two-pass backward) gives the oracle's out and lse within 2e-5 and its dq, dk, dv and
    learnable-input gradients within 2e-4 (relative to max(1, |oracle|)); every input that
    requires grad gets a gradient. The oracle differentiates its own float64 evaluation. A
    second call with other values of the non-learnable runtime inputs matches too."""
    check_cpu_kernel_program(n)


@pytest.mark.parametrize("n", range(KERNEL_PROGRAMS, KERNEL_PROGRAMS + DEBUG_KERNEL_PROGRAMS))
def test_debug_built_kernel_matches_the_oracle(n: int, monkeypatch) -> None:
    """As test_kernel_matches_the_oracle, for many more programs: built unoptimised
    (ATTNCC_DEBUG_BUILD, ~5x faster to build), which changes how fast the generated code runs,
    not what it computes (the optimised builds above and every golden test cover the optimised code)."""
    monkeypatch.setenv(DEBUG_BUILD_ENV, "1")
    check_cpu_kernel_program(n)


EMULATOR_SHAPES = (
    # B, H, Hkv, N, M, D, GPU tiles (Br, Bc in 16..64): rows cross >= 3 key tiles, ragged tails
    (2, 4, 2, 70, 75, 16, (16, 16)),
    (1, 4, 1, 40, 97, 32, (32, 16)),
    (2, 2, 2, 50, 61, 48, (16, 16)),
)


@functools.cache
def emulator_case(n: int) -> tuple[Program, tuple, frozenset[str]]:
    """The n-th emulator program: as kernel_case, at EMULATOR_SHAPES."""
    prog, _, recipe = kernel_case(EMULATOR_SEED_OFFSET + n)
    return prog, EMULATOR_SHAPES[n % len(EMULATOR_SHAPES)], recipe


@pytest.mark.parametrize("n", range(EMULATOR_PROGRAMS))
def test_emulated_cuda_kernel_matches_the_oracle(n: int) -> None:
    """A generated program's CUDA kernels (sm80, fp16 tensor cores) on the host emulator give
    the oracle's results within EMULATOR_LIMITS, the oracle evaluating the fp16-rounded inputs
    in float64 (the kernel rounds P and dS to fp16 for its products). Every third program forces split-KV (3 partials merged), every
    second one runs the deterministic backward (dQ kernel, exact learnable-input sums)."""
    prog, shape, recipe = emulator_case(n)
    kern = attncc.compile(prog.text, target="sm80", emulate=True, tiles=shape[-1])
    kern.kv_splits = 3 if n % 3 == 0 else None
    kern.deterministic = n % 2 == 1
    problems = compare_with_oracle(kern, prog, shape, recipe, torch.float16, EMULATOR_LIMITS)
    context = (
        f"shape {shape[:-1]} (B H Hkv N M D), tiles {shape[-1]}, kv_splits {kern.kv_splits}, "
        f"deterministic {kern.deterministic}"
    )
    assert not problems, describe(
        prog, "emulated kernel differs from the oracle: " + "; ".join(problems) + f"\n{context}"
    )


def test_kernel_programs_reach_their_features() -> None:
    """The kernel programs are not trivial: several leave rows without keys, several have
    learnable inputs, and in most // or % see negative left operands."""
    dead = learnable = negative = 0
    for n in range(KERNEL_PROGRAMS):
        prog, (B, H, Hkv, N, M, D, _), _ = kernel_case(n)
        gen = torch.Generator().manual_seed(prog.seed)
        q, k, v = (
            torch.randn(B, H, N, D, generator=gen),
            torch.randn(B, Hkv, M, D, generator=gen),
            torch.randn(B, Hkv, M, D, generator=gen),
        )
        runtime = runtime_inputs(prog, B, H, M, gen, torch.float64, requires_grad=False)
        stats = oracle_attention(prog.text, q, k, v, runtime).stats
        dead += bool(stats["dead_rows"])
        negative += bool(stats["floordiv_neg_lhs"] or stats["mod_neg_lhs"])
        learnable += any(name in LEARNABLE for name in prog.inputs)
    assert dead >= 4 and learnable >= 5 and negative >= 6, (dead, learnable, negative)


#: The smallest program found to break a kernel (see the test below).
TWO_READS = """attention two_reads
input w: float[2]
s = q @ k.T * scale
s = s + w[0] * (j % 2) + w[1] * (j % 3)
p = softmax(s)
o = p @ v
output o
"""
_TWO_READS_CHILD = """
import json, sys, torch, attncc
torch.set_num_threads(2)
kern = attncc.compile(sys.argv[1], tiles=(4, 32))
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 1, 64, 16, generator=gen, requires_grad=True) for _ in range(3))
dout = torch.randn(1, 1, 64, 16, generator=gen)
w = torch.tensor([0.5, -0.25], requires_grad=True)
out = kern(q, k, v, w=w)
print(json.dumps(torch.autograd.grad(out, [w], dout)[0].tolist()))
"""


def test_two_reads_of_one_learnable_input() -> None:
    """A float input read at two indices (`w[0] * (j % 2) + w[1] * (j % 3)`, B = H = 1,
    N = M = 64, tiles 4 x 32, two threads) gets the oracle's gradient. Found by this fuzzer:
    each thread's gradient pointer was moved to its slice once per read, so thread 1 wrote
    past the buffer (dw = [-6.14, -6.48] instead of [-0.379, -1.331], or glibc aborted). Run
    in a child process, so a regression cannot take the test session down with it."""
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_READS_CHILD, TWO_READS], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"the kernel's process died ({proc.returncode}): {proc.stderr[-400:]}"
    got = torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1]), dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=gen) for _ in range(3))
    dout = torch.randn(1, 1, 64, 16, generator=gen)
    w = torch.tensor([0.5, -0.25], dtype=torch.float64, requires_grad=True)
    prog = Program(TWO_READS, 0, "minimal", ("w",))
    mine = oracle_attention(prog.text, q, k, v, {"w": w})
    expected = torch.autograd.grad(mine.out, [w], dout.double())[0]
    err, where = relative_error(got, expected)
    assert err <= KERNEL_LIMITS.input_grads, describe(
        prog, f"dw: kernel {got.tolist()}, oracle {expected.tolist()} ({where})"
    )


PACKED_PROGRAMS = 6  # of the kernel programs (CPU, debug-built) and of the emulator programs


def uses_batch_as_value(kern: attncc.Kernel) -> bool:
    """Whether the program's result depends on b or B other than through `B` axes of inputs."""
    dims = {d.name: d.dims for d in kern.inputs if d.role == "tensor"}

    def uses_batch(e: ex.Expr) -> bool:
        if isinstance(e, ex.Var):
            return e.name in ("b", "B")
        if isinstance(e, ex.Read):
            axes = dims.get(e.tensor, ())
            return any(
                not (isinstance(i, ex.Var) and i.name == "b" and axis < len(axes) and axes[axis] == "B")
                and uses_batch(i)
                for axis, i in enumerate(e.index)
            )
        return any(uses_batch(c) for c in e.children())

    exprs = [kern.op.score, kern.op.mask, kern.op.scale, kern.op.default_scale]
    return any(e is not None and uses_batch(e) for e in exprs)


def sequence_cuts(kern: attncc.Kernel, b: int, n: int, m: int) -> list[tuple[slice, ...]]:
    """Per runtime tensor: the index that cuts it to sequence b of n queries and m keys (axis B
    to its element, N and M to its lengths)."""
    cuts = {"B": slice(b, b + 1), "N": slice(0, n), "M": slice(0, m)}
    return [
        tuple(cuts.get(dim, slice(None)) if isinstance(dim, str) else slice(None) for dim in d.dims)
        for d in kern.inputs
        if d.role == "tensor"
    ]


def check_packed_program(kern: attncc.Kernel, prog: Program, shape: tuple, dtype: torch.dtype, limits: Limits) -> None:
    """A packed (varlen) batch of ragged sequences (lengths 1, 0 and ragged tails among them)
    against the same kernel's padded call on each sequence as a batch of one (runtime inputs
    cut to the sequence: axis B to its element, N and M to its lengths), forward and backward.
    A program that uses b or B as a value runs on sequences of equal lengths against the
    padded call of the whole batch instead (there b and B mean the same in both)."""
    _, H, Hkv, N, M, D, _ = shape
    B = 4  # sequences: the case's full lengths, 1 query, keys without queries, a ragged one
    gen = torch.Generator().manual_seed(prog.seed + 7)
    whole_batch = uses_batch_as_value(kern)
    if whole_batch:
        lens_q, lens_k = [N] * B, [M] * B
    else:
        lens_q = [N, 1, 0, int(torch.randint(1, N + 1, (1,), generator=gen))]
        lens_k = [
            M,
            int(torch.randint(1, M + 1, (1,), generator=gen)),
            3,
            int(torch.randint(1, M + 1, (1,), generator=gen)),
        ]
    q = torch.randn(sum(lens_q), H, D, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(sum(lens_k), Hkv, D, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    runtime = runtime_inputs(prog, B, H, M, gen, torch.float32, requires_grad=True)
    learn = [name for name, t in runtime.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [q, k, v] + [runtime[name] for name in learn]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) for lens in (lens_q, lens_k))
    out, lse = kern.varlen(q, k, v, cu_q, cu_k, max_seqlen_q=N, max_seqlen_k=M, return_lse=True, **runtime)
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    got = [out, lse, *torch.autograd.grad(out, wrt, dout, allow_unused=True)]

    def as_bhnd(rows: torch.Tensor, count: int) -> torch.Tensor:  # [count * n, heads, ...] -> [count, heads, n, ...]
        return rows.unflatten(0, (count, -1)).transpose(1, 2)

    if whole_batch:
        ref_out, ref_lse = kern(as_bhnd(q, B), as_bhnd(k, B), as_bhnd(v, B), return_lse=True, **runtime)
        ref_out, ref_lse = ref_out.transpose(1, 2).flatten(0, 1), ref_lse.transpose(1, 2).flatten(0, 1)
    else:
        outs, lses = [], []
        for b, (n, m) in enumerate(zip(lens_q, lens_k)):
            if n == 0:
                continue
            rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            cuts = iter(sequence_cuts(kern, b, n, m))
            cut = {name: t[next(cuts)] if isinstance(t, torch.Tensor) else t for name, t in runtime.items()}
            o, s = kern(as_bhnd(q[rows], 1), as_bhnd(k[keys], 1), as_bhnd(v[keys], 1), return_lse=True, **cut)
            outs.append(o[0].transpose(0, 1))
            lses.append(s[0].transpose(0, 1))
        ref_out, ref_lse = torch.cat(outs), torch.cat(lses)
    expected = [ref_out, ref_lse, *torch.autograd.grad(ref_out, wrt, dout, allow_unused=True)]
    names = ["out", "lse", "dq", "dk", "dv"] + [f"d{name}" for name in learn]
    problems = []
    for name, a, e in zip(names, got, expected):
        err, where = relative_error(a, None if e is None else e.double())
        if not err <= limits.of(name):
            problems.append(f"{name}: error {err:.3g} > {limits.of(name):g} ({where})")
    context = f"shape {shape[:-1]} (B H Hkv N M D), lengths q {lens_q} k {lens_k}, whole batch {whole_batch}"
    assert not problems, describe(
        prog, "packed call differs from the padded calls: " + "; ".join(problems) + f"\n{context}"
    )


@pytest.mark.parametrize("n", range(PACKED_PROGRAMS))
def test_packed_batches_match_the_padded_calls(n: int, monkeypatch) -> None:
    """Generated programs (CPU kernels, debug-built) on packed batches: each sequence's rows,
    lse and gradients as the same kernel's padded call on that sequence alone."""
    monkeypatch.setenv(DEBUG_BUILD_ENV, "1")
    prog, shape, _ = kernel_case(KERNEL_PROGRAMS + n)
    kern = attncc.compile(prog.text, tiles=shape[-1])
    check_packed_program(kern, prog, shape, torch.float32, KERNEL_LIMITS)


@pytest.mark.parametrize("n", range(PACKED_PROGRAMS))
def test_emulated_packed_batches_match_the_padded_calls(n: int) -> None:
    """As test_packed_batches_match_the_padded_calls, for the CUDA kernels on the emulator
    (fp16 inputs; both sides run the same tensor-core kernels)."""
    prog, shape, _ = emulator_case(n)
    kern = attncc.compile(prog.text, target="sm80", emulate=True, tiles=shape[-1])
    check_packed_program(kern, prog, shape, torch.float16, EMULATOR_LIMITS)
