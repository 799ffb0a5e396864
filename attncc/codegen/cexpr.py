"""Expression trees -> C++ expressions for the generated kernels.

Only validated tokens reach the output: variable and tensor names were checked by the
frontend against the grammar's identifier pattern and the program's declarations, and are
emitted with a fixed prefix (`u_` scalars, `t_` tensors, `g_` generated grids) so they
cannot collide with C++ keywords or kernel locals; numbers are re-printed from parsed values.
"""

from __future__ import annotations

import math
import re

from attncc.ir import expr as ex

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_C_TYPES = {ex.INT: "int64_t", ex.FLOAT: "acc_t", ex.BOOL: "bool"}
_BINARY_C = {
    "add": "+",
    "sub": "-",
    "mul": "*",
    "lt": "<",
    "le": "<=",
    "gt": ">",
    "ge": ">=",
    "eq": "==",
    "ne": "!=",
    "and": "&&",
    "or": "||",
}
# Backend-neutral helpers defined in both attncc/cpu/primitives.h and attncc/cuda/primitives.cuh.
_UNARY_C = {
    "exp": "attncc::math_exp",
    "log": "attncc::math_log",
    "tanh": "attncc::math_tanh",
    "sqrt": "attncc::math_sqrt",
}


def c_name(name: str) -> str:
    """The C++ identifier of a program input (scalar `u_`, tensor `t_`, layout grid `g_`)."""
    ident = "g_" + name[2:] if name.startswith("__layout") else name
    if not _IDENT.match(ident):
        raise ValueError(f"refusing to emit non-identifier {name!r}")
    return ident


def tensor_ident(name: str) -> str:
    # user tensors always get t_ (a user name such as g_layout0 cannot meet a generated grid)
    return c_name(name) if name.startswith("__layout") else "t_" + c_name(name)


def scalar_ident(name: str) -> str:
    return "u_" + c_name(name)


def c_type(ty: str) -> str:
    return _C_TYPES[ty]


def emit(e: ex.Expr, ctx: str = "x") -> str:
    """C++ text for `e`; problem-level values are members of the context object `ctx`."""
    if isinstance(e, ex.Const):
        return _literal(e)
    if isinstance(e, ex.Var):
        if e.name in ex.INDEX_VARS or e.name == ex.SCORE_VAR:
            return e.name
        if e.name in ("N", "M"):  # the sequence's own lengths (packed calls: templates/common/variant.jinja)
            return f"seq_{e.name.lower()}({ctx}, b)"
        if e.name in ex.SIZE_VARS:
            return f"{ctx}.{e.name}"
        if e.name == "scale":
            return f"{ctx}.scale_value"
        return f"{ctx}.{scalar_ident(e.name)}"
    if isinstance(e, ex.Read):
        t = tensor_ident(e.tensor)
        offset = " + ".join(f"({emit(i, ctx)}) * {ctx}.st_{t}_{d}" for d, i in enumerate(e.index))
        value = f"{ctx}.{t}[{offset}]"
        return f"({value} != 0)" if e.ty == ex.BOOL else value
    if isinstance(e, ex.Unary):
        x = emit(e.x, ctx)
        if e.op == "neg":
            return f"int64_t(uint64_t(0) - uint64_t({x}))" if e.ty == ex.INT else f"(-{x})"
        if e.op == "not":
            return f"(!{x})"
        if e.op == "abs":
            return f"attncc::math_abs({x})" if e.ty == ex.INT else f"attncc::math_abs({_real(e.x, x)})"
        if e.op in ex.ROUNDING_OPS:  # (defined by the variant's hooks where used: templates/common/variant.jinja)
            return f"rounded_{e.op}({_real(e.x, x)})"
        return f"{_UNARY_C[e.op]}({_real(e.x, x)})"
    if isinstance(e, ex.Binary):
        a, b = emit(e.a, ctx), emit(e.b, ctx)
        if e.op == "div":
            return f"({_real(e.a, a)} / {_real(e.b, b)})"
        if e.op == "floordiv":
            return f"attncc::floordiv({a}, {b})"
        if e.op == "mod":
            return f"attncc::pymod({a}, {b})"
        if e.op in ("min", "max"):
            t = c_type(e.ty)
            if e.ty == ex.FLOAT:
                return f"attncc::{e.op}_of<{t}>({_real(e.a, a)}, {_real(e.b, b)})"
            return f"attncc::{e.op}_of<{t}>({t}({a}), {t}({b}))"
        if e.ty == ex.FLOAT and e.op in ("add", "sub", "mul"):
            return f"({_real(e.a, a)} {_BINARY_C[e.op]} {_real(e.b, b)})"
        if e.ty == ex.INT and e.op in ("add", "sub", "mul"):
            # int64 wraps, as in torch (the reference): through uint64, since signed overflow
            # is undefined in C++ and compilers fold e.g. `i * c >= 0` into `i >= 0`
            return f"int64_t(uint64_t({a}) {_BINARY_C[e.op]} uint64_t({b}))"
        return f"({a} {_BINARY_C[e.op]} {b})"
    if isinstance(e, ex.Where):
        if e.ty == ex.FLOAT:
            return f"({emit(e.cond, ctx)} ? {_real(e.a, emit(e.a, ctx))} : {_real(e.b, emit(e.b, ctx))})"
        t = c_type(e.ty)
        return f"({emit(e.cond, ctx)} ? {t}({emit(e.a, ctx)}) : {t}({emit(e.b, ctx)}))"
    raise TypeError(f"cannot emit {e!r}")


def _real(e: ex.Expr, text: str) -> str:
    """`e` (emitted as `text`) as a real operand: an integer or bool through the hooks' `to_real`
    (templates/common/variant.jinja), never a bare cast: GCC 12 folds `0.0f - float(n)` and
    `float(n) * -1.0f + 0.0f` to `-float(n)`, -0.0 where n = 0 (IEEE: +0.0), at -O0 too, and a
    mask on the sign of that zero (`1.0 / (...) > 0`) then dropped its diagonal."""
    return f"acc_t({text})" if e.ty == ex.FLOAT else f"to_real({text})"


def uses_rounding(exprs: list[ex.Expr]) -> bool:
    """Whether any of `exprs` rounds a number to an integer (the hooks then define rounded_*)."""
    return any(isinstance(n, ex.Unary) and n.op in ex.ROUNDING_OPS for e in exprs for n in ex.walk(e))


def _literal(c: ex.Const) -> str:
    if c.ty == ex.BOOL:
        return "true" if c.value else "false"
    if c.ty == ex.INT:
        return f"int64_t({int(c.value)})"
    value = float(c.value)
    # compiler builtins: the same text compiles in host C++ and in CUDA device code
    if math.isinf(value):
        return "acc_t(__builtin_huge_valf())" if value > 0 else "acc_t(-__builtin_huge_valf())"
    if math.isnan(value):
        return 'acc_t(__builtin_nanf(""))'
    return f"acc_t({value!r})"
