"""Semantic analysis: a located syntax tree -> the unfused IR graph.

This is the check-only front door: every user mistake that can be caught from the text alone
(unknown names, wrong arity, type errors, masks that read the scores, malformed layouts) is a
`DslError` with the statement's location here, before any pass runs. Only validated tokens
survive into the IR: names are looked up in the declared tables and numbers are parsed, so no
user text reaches generated code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from attncc.errors import DslError, SourceLoc
from attncc.frontend.parser import MAX_DEPTH, Ast, parse
from attncc.ir import expr as ex
from attncc.ir.graph import Graph, add_op, new_graph, op_of
from attncc.ir.ops import Dropout, Input, Layout, Mask, Output, Rope, ScoreMap, ScoreMatmul, Softmax, ValueMatmul

DTYPES = ("float", "int", "bool")
MATH_FUNCTIONS = {
    "abs": 1, "exp": 1, "log": 1, "tanh": 1, "sqrt": 1, "min": 2, "max": 2, "where": 3,
    **{op: 1 for op in ex.ROUNDING_OPS},
}  # fmt: skip
LAYOUTS: dict[str, tuple[str, ...]] = {
    # generator -> its integer parameters besides `block` (see passes/sparsity.py for meaning)
    "local": ("width",),
    "strided": ("stride",),
    "fixed": ("stride", "summary"),
    "butterfly": (),
    "blocks": (),
}
INT64_MAX = 2**63 - 1
#: Layout parameters (block sizes, widths, strides) are tile counts and sizes: int32 is plenty.
LAYOUT_PARAMETER_MAX = 2**31 - 1
# Score maps, masks and named expressions compose into one tree per kind; the passes that fold
# and differentiate it recurse, so its depth stays well inside Python's recursion limit.
COMPOSED_MAX_DEPTH = MAX_DEPTH
COMPOSED_MAX_SIZE = 20_000
MAX_LAYOUTS = 16
RESERVED = set(ex.INDEX_VARS + ex.SIZE_VARS) | {"q", "k", "v", "scale", "inf", "softmax", "dropout"}
#: The keyword arguments of every kernel's call (`kern(...)`, and `kern.reference`'s `dtype`, which
#: `attncc check` passes), beside which runtime inputs are passed by name: an input of one of these
#: names could never be given (a "missing runtime input" error, or the call's argument read as it)
CALL_KEYWORDS = frozenset({"return_lse", "train", "seed", "dropout_p", "k_descale", "v_descale", "dtype", "self"})
#: The further keyword arguments of the packed, paged and context-parallel calls: an input of such
#: a name is a program's own choice (`input group: int`), refused by that call alone (`Kernel.
#: check_inputs_named_apart`), where a refusal here broke programs that never make it
CALL_ARGUMENTS = {
    "varlen": frozenset({"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "plan"}),
    "paged": frozenset({"k_cache", "v_cache", "block_table", "cache_seqlens", "plan", "k_new", "v_new", "layout"}),
    "context_parallel": frozenset({"kern", "group", "layout"}),
}


@dataclass(frozen=True)
class TensorRef:
    """A tensor-valued name: `kind` is q, k, kT, v, scores, probs or out."""

    node: str
    kind: str


@dataclass(frozen=True)
class ScoreExpr:
    """An elementwise expression over the scores produced by `node` (the score is Var s)."""

    node: str
    expr: ex.Expr


Value = TensorRef | ScoreExpr | ex.Expr


@dataclass
class _Context:
    g: Graph
    path: str
    names: dict[str, Value] = field(default_factory=dict)
    scale: ex.Expr | None = None
    scale_set_at: SourceLoc | None = None
    scale_read_at: SourceLoc | None = None  # (the first statement reading the name `scale`)
    output: str | None = None
    fixed: dict[str, str] = field(default_factory=dict)  # names no statement may assign: what each is
    # what the passes will compose, kept to bound its size: the score map ending at each score
    # node (in terms of the matmul's scores) and the conjunction of the masks so far
    composed_scores: dict[str, ex.Expr] = field(default_factory=dict)
    composed_mask: ex.Expr | None = None
    dim_names: dict[str, SourceLoc] = field(default_factory=dict)  # names in inputs' shapes: where first
    layouts: int = 0


def lower(tree: Ast, path: str) -> Graph:
    """Build the unfused graph for a parsed program."""
    header = tree.children[0]
    ctx = _Context(new_graph(header.value, path), path)
    for role in ("q", "k", "v"):
        node = add_op(ctx.g, Input(role, role, "float", _QKV_DIMS[role]))
        ctx.names[role] = TensorRef(node, role)
    for stmt in tree.children[1:]:
        if ctx.output is not None and stmt.kind != "output":  # (it failed as a reused intermediate)
            raise DslError("`output` is the last statement: nothing after it reaches the result", stmt.loc)
        _STATEMENTS[stmt.kind](ctx, stmt)
    if ctx.output is None:
        last = tree.children[-1]
        raise DslError("program has no `output` statement (e.g. `output o` after `o = p @ v`)", last.loc)
    scale = ctx.scale if ctx.scale is not None else default_scale()
    ctx.g.graph["scale"] = scale
    return ctx.g


def parse_program(text: str, path: str = "<string>") -> Graph:
    """DSL text -> unfused, unverified IR graph (DslError on any mistake)."""
    return lower(parse(text, path), path)


_QKV_DIMS: dict[str, tuple[str, ...]] = {
    "q": ("B", "H", "N", "D"),
    "k": ("B", "Hkv", "M", "D"),
    "v": ("B", "Hkv", "M", "D"),
}


def default_scale() -> ex.Expr:
    return ex.Binary("div", ex.const(1.0), ex.Unary("sqrt", ex.var("D")))


# ----------------------------------------------------------------------------- statements
def _input(ctx: _Context, stmt: Ast) -> None:
    name, dtype = stmt.children[0], stmt.children[1]
    _check_new_name(ctx, name)
    if name.value == ex.SCORE_VAR:  # inside score expressions `s` is the score itself
        raise DslError(f"an input cannot be named `{ex.SCORE_VAR}`: score expressions use it for the score", name.loc)
    if name.value in CALL_KEYWORDS:
        raise DslError(
            f"an input cannot be named `{name.value}`: the kernels' calls take an argument of that name, beside which "
            "inputs are passed by their names",
            name.loc,
        )
    if dtype.value not in DTYPES:
        raise DslError(f"unknown input type `{dtype.value}`; expected one of {', '.join(DTYPES)}", dtype.loc)
    dims: tuple[str | int, ...] = ()
    role = "scalar"
    if len(stmt.children) > 2:
        role = "tensor"
        dims = tuple(_dim(ctx, d) for d in stmt.children[2].children)
    if name.value in ctx.dim_names and (role == "tensor" or dtype.value != "int"):
        raise DslError(
            f"`{name.value}` names a dimension before this (line {ctx.dim_names[name.value].line}), which an int "
            f"input alone can give: {DIMENSIONS_ARE}",
            name.loc,
        )
    node = add_op(ctx.g, Input(name.value, role, dtype.value, dims, loc=name.loc))
    ctx.fixed[name.value] = "an input"
    ctx.names[name.value] = (
        TensorRef(node, "tensor") if role == "tensor" else ex.var(name.value, _scalar_type(dtype.value))
    )


def _dim(ctx: _Context, d: Ast) -> str | int:
    """A declared dimension: a size, a name bound by the call (a size name, an int input's
    value, a tensor's size), or an int `const` declared before it, which is its value (a name
    free in the shape but 3 in the expressions took a table of any length, silently)."""
    known = ctx.names.get(d.value)
    if ctx.fixed.get(d.value) == "a constant" and isinstance(known, ex.Const):
        if known.ty != ex.INT or int(known.value) < 1:
            raise DslError(f"dimension `{d.value}` is a constant {known.value!r}, not a positive int", d.loc)
        return int(known.value)
    if d.value.isidentifier():
        # (a built-in, a float or bool input or a tensor named as a dimension took any size while
        # expressions read the name as what it is: `float[i]`, `float[scale]`, session 67's review)
        if (d.value in RESERVED and d.value not in ex.SIZE_VARS) or d.value == ex.SCORE_VAR:
            raise DslError(f"`{d.value}` is a built-in name, not a dimension: {DIMENSIONS_ARE}", d.loc)
        if known is not None and ctx.fixed.get(d.value) is None:  # (assigned before: expressions read the value)
            raise DslError(f"`{d.value}` is assigned before this, not a dimension: {DIMENSIONS_ARE}", d.loc)
        if ctx.fixed.get(d.value) == "an input" and not (isinstance(known, ex.Var) and known.ty == ex.INT):
            what = "a tensor" if isinstance(known, TensorRef) else f"a {known.ty} input"  # type: ignore[union-attr]
            raise DslError(f"`{d.value}` is {what}, not a dimension: {DIMENSIONS_ARE}", d.loc)
        ctx.dim_names.setdefault(d.value, d.loc)
    if d.value.isdigit():
        size = _int_literal(d.value)
        if size < 1:
            raise DslError("a dimension must be at least 1", d.loc)
        if size > INT64_MAX:
            raise DslError(f"dimension `{_shown(d.value)}` is out of range (at most {INT64_MAX})", d.loc)
        return size
    if not d.value.isidentifier():
        raise DslError(f"a dimension is a name or a positive integer, not `{d.value}`", d.loc)
    return d.value


#: What an input's dimension may be (`_dim`).
DIMENSIONS_ARE = (
    "a dimension is a size (B H Hkv N M D), a positive int, an int const or input, or a name the call binds"
)


def _scalar_type(dtype: str) -> str:
    return {"float": ex.FLOAT, "int": ex.INT, "bool": ex.BOOL}[dtype]


def _const(ctx: _Context, stmt: Ast) -> None:
    name, value_ast = stmt.children
    _check_new_name(ctx, name)
    if name.value in ctx.dim_names:  # (the dimension stayed free: any size was taken)
        raise DslError(
            f"`{name.value}` names a dimension before this (line {ctx.dim_names[name.value].line}): declare the "
            "constant before the inputs whose shape it gives",
            name.loc,
        )
    value = _scalar(ctx, value_ast, "a constant")
    folded = ex.fold(value)
    if not isinstance(folded, ex.Const):
        raise DslError("a `const` must be computable from numbers alone", value_ast.start)
    ctx.names[name.value] = folded
    ctx.fixed[name.value] = "a constant"


def _assign(ctx: _Context, stmt: Ast) -> None:
    name, value_ast = stmt.children
    if name.value == "scale":
        # (the scale is one number for the whole program, so it is set once, before any use:
        # a second `scale =`, or one after `s = q @ k.T * scale`, took effect everywhere)
        if ctx.scale_set_at is not None:
            raise DslError(f"the scale is set once (first at line {ctx.scale_set_at.line})", name.loc)
        if ctx.scale_read_at is not None:
            raise DslError(
                f"`scale = ...` after a statement that reads scale (line {ctx.scale_read_at.line}): set it first",
                name.loc,
            )
        ctx.scale_set_at = name.loc
        value = _scalar(ctx, value_ast, "the scale")
        if ex.free_vars(value) - set(ex.SIZE_VARS) or ex.reads(value):
            raise DslError("the scale may depend only on numbers and the sizes B, H, Hkv, N, M, D", value_ast.start)
        ctx.scale = ex.fold(value)
        if not ex.free_vars(ctx.scale) and not (
            isinstance(ctx.scale, ex.Const) and math.isfinite(float(ctx.scale.value))
        ):  # (numbers alone that fold to inf or NaN, or do not fold: an integer // or % by 0)
            raise DslError("the scale must be a finite number (it multiplies every score)", value_ast.start)
        return
    if name.value in ("q", "k") and value_ast.kind == "call" and value_ast.value == "rope":
        _rope(ctx, name, value_ast)
        return
    if name.value in RESERVED:
        raise DslError(f"`{name.value}` is reserved or an input and cannot be assigned", name.loc)
    if name.value in ctx.fixed:  # (a scalar input's call value was ignored after `a = 3.0`)
        raise DslError(f"`{name.value}` is {ctx.fixed[name.value]} and cannot be assigned", name.loc)
    if name.value in ctx.dim_names:  # (expressions read the value, the shape any size)
        raise DslError(
            f"`{name.value}` names a dimension (line {ctx.dim_names[name.value].line}) and cannot be assigned",
            name.loc,
        )
    value = _lower_expr(ctx, value_ast)
    current = ctx.names.get(name.value)
    if isinstance(value, ex.Expr) and isinstance(current, TensorRef) and current.kind == "scores":
        # (new scores that ignore the old ones, as a Flex score_mod returning a bias alone: the
        # scores' name stays the scores', a map of them that does not read s)
        value = ScoreExpr(current.node, value)
    if isinstance(value, ScoreExpr):
        value = _materialise(ctx, value, value_ast.loc)
    elif isinstance(value, ex.Expr):
        _check_composed_size(value, value_ast.loc)
    ctx.names[name.value] = value


def _mask(ctx: _Context, stmt: Ast) -> None:
    pred_ast = stmt.children[0]
    pred = _lower_expr(ctx, pred_ast)
    if isinstance(pred, ScoreExpr):
        raise DslError(
            "a mask cannot depend on the scores `s`; use a score expression such as `s = where(cond, s, -inf)`",
            pred_ast.start,
        )
    if isinstance(pred, TensorRef):
        raise DslError("a mask is a predicate over b, h, i, j and inputs, not a tensor", pred_ast.start)
    if pred.ty != ex.BOOL:
        raise DslError(f"a mask must be a condition (true keeps the score), got a {pred.ty} expression", pred_ast.start)
    ctx.composed_mask = pred if ctx.composed_mask is None else ex.Binary("and", ctx.composed_mask, pred)
    _check_composed_size(ctx.composed_mask, stmt.loc)
    _apply_to_scores(ctx, Mask(ex.fold(pred), loc=stmt.loc), stmt.loc, _reads(ctx, pred))


def _layout(ctx: _Context, stmt: Ast) -> None:
    name, *args = stmt.children
    ctx.layouts += 1
    if ctx.layouts > MAX_LAYOUTS:  # (the sparsity pass ANDs them into one predicate: 330 overflowed the stack)
        raise DslError(f"at most {MAX_LAYOUTS} `layout` statements in a program", stmt.loc)
    if name.value not in LAYOUTS:
        raise DslError(f"unknown layout `{name.value}`; expected one of {', '.join(LAYOUTS)}", name.loc)
    positional = [a for a in args if a.kind != "keyword"]
    keywords: dict[str, Ast] = {}
    for a in args:
        if a.kind == "keyword":
            if a.value in keywords:  # (the last one won, silently)
                raise DslError(f"`{name.value}`: keyword argument `{a.value}` given twice", a.loc)
            keywords[a.value] = a
    tensor = None
    if name.value == "blocks":
        if len(positional) != 1 or positional[0].kind != "name":
            raise DslError("`blocks(mask, block=...)` takes the block-mask input as its first argument", name.loc)
        tensor = positional[0].value
        ref = ctx.names.get(tensor)
        if not (isinstance(ref, TensorRef) and ref.kind == "tensor"):
            raise DslError(f"`{tensor}` is not a declared tensor input", positional[0].loc)
        decl = ctx.g.nodes[ref.node]["op"]
        lead = [str(dim) for dim in decl.dims[:-2]]
        if (
            decl.dtype == "float"
            or len(decl.dims) < 2
            or not set(lead) <= {"B", "H", "Hkv"}
            or len(set(lead)) < len(lead)
        ):
            raise DslError(
                f"`{tensor}` must be a bool or int tensor [NB, MB] with leading dims among B, H or Hkv, each once "
                f"([B, H, NB, MB], [Hkv, NB, MB], ...); declared {decl.dtype}[{', '.join(map(str, decl.dims))}]",
                positional[0].loc,
            )
        if {"H", "Hkv"} <= set(lead):
            raise DslError(
                f"`{tensor}`: a block mask is per query head (H) or per kv head (Hkv), not both", positional[0].loc
            )
    elif positional:
        raise DslError(f"`{name.value}` takes keyword arguments only", positional[0].loc)
    allowed = ("block", *LAYOUTS[name.value])
    for key, arg in keywords.items():
        if key not in allowed:
            raise DslError(f"`{name.value}` has no parameter `{key}`; expected {', '.join(allowed)}", arg.loc)
    values: dict[str, int] = {}
    for key in allowed:
        if key not in keywords:
            raise DslError(f"`{name.value}` needs the parameter `{key}=`", name.loc)
        # (local's width may be 0: |ib - jb| <= 0, the block diagonal)
        values[key] = _positive_int(ctx, keywords[key].children[0], key, least=0 if key == "width" else 1)
    if name.value == "fixed" and values["summary"] > values["stride"]:
        raise DslError(
            f"`fixed`: summary={values['summary']} is more than stride={values['stride']} (the last `summary` "
            "blocks of each stride are its summary)",
            keywords["summary"].loc,
        )
    params = tuple((k, values[k]) for k in LAYOUTS[name.value])
    reads = {tensor} if tensor else set()
    _apply_to_scores(ctx, Layout(name.value, values["block"], params, tensor, loc=stmt.loc), stmt.loc, reads)


def _output(ctx: _Context, stmt: Ast) -> None:
    value = ctx.names.get(stmt.value)
    if not (isinstance(value, TensorRef) and value.kind == "out"):
        raise DslError(f"`output` takes the result of `p @ v`; `{stmt.value}` is not one", stmt.loc)
    if ctx.output is not None:
        raise DslError("a program has exactly one `output`", stmt.loc)
    ctx.output = add_op(ctx.g, Output(loc=stmt.loc), [value.node])


_STATEMENTS = {
    "input": _input, "const": _const, "assign": _assign, "mask": _mask, "layout": _layout,
    "output": _output,
}  # fmt: skip


def _check_new_name(ctx: _Context, name: Ast) -> None:
    if name.value in RESERVED:
        raise DslError(f"`{name.value}` is a built-in name", name.loc)
    if name.value.startswith("__"):
        raise DslError(f"`{name.value}`: names starting with `__` are reserved for the compiler", name.loc)
    if name.value in ctx.names:
        raise DslError(f"`{name.value}` is already defined", name.loc)


def _check_composed_size(e: ex.Expr, loc: SourceLoc, extra_depth: int = 0) -> int:
    """The depth of `e` as later passes see it (statements compose), or a DslError when it, or
    its size as a tree, exceeds what the compiler's recursive passes take. Shared subtrees
    count once per use (`a = a + a` doubles), computed here in linear time."""
    depth_of: dict[int, int] = {}
    size_of: dict[int, int] = {}
    stack: list[tuple[ex.Expr, bool]] = [(e, False)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in depth_of:
            continue
        kids = node.children()
        if not expanded and kids:
            stack.append((node, True))
            stack.extend((k, False) for k in kids if id(k) not in depth_of)
            continue
        depth_of[id(node)] = 1 + max((depth_of[id(k)] for k in kids), default=0)
        size_of[id(node)] = min(1 + sum(size_of[id(k)] for k in kids), COMPOSED_MAX_SIZE + 1)
    depth = depth_of[id(e)] + extra_depth
    if depth > COMPOSED_MAX_DEPTH or size_of[id(e)] > COMPOSED_MAX_SIZE:
        raise DslError(
            f"expression too large once the statements before it are substituted (depth {depth}, at most "
            f"{COMPOSED_MAX_DEPTH}; at most {COMPOSED_MAX_SIZE} terms): combine the steps",
            loc,
        )
    return depth


def _positive_int(ctx: _Context, a: Ast, what: str, least: int = 1) -> int:
    value = ex.fold(_scalar(ctx, a, what))
    if not (isinstance(value, ex.Const) and value.ty == ex.INT and least <= int(value.value) <= LAYOUT_PARAMETER_MAX):
        kind = "positive" if least == 1 else "non-negative"
        raise DslError(f"`{what}` must be a {kind} integer constant (at most {LAYOUT_PARAMETER_MAX})", a.start)
    return int(value.value)


def _apply_to_scores(ctx: _Context, op: Mask | Layout, loc: SourceLoc, reads: set[str]) -> None:
    """Insert `op` after the newest score tensor and rebind every name that referred to it."""
    scores = [v for v in ctx.names.values() if isinstance(v, TensorRef) and v.kind == "scores"]
    if not scores:
        raise DslError("no scores to mask yet: write `s = q @ k.T * scale` first", loc)
    # newest by the graph's order (nodes in the order the statements made them): by the names'
    # order, `t = s * 2; s = t + 1; mask ...` masked t, whose name came last (`s` kept its place)
    made = {node: n for n, node in enumerate(ctx.g.nodes)}
    target = max(scores, key=lambda ref: made[ref.node])
    node = add_op(ctx.g, op, [target.node], reads)
    if target.node in ctx.composed_scores:  # masks and layouts pass the scores through
        ctx.composed_scores[node] = ctx.composed_scores[target.node]
    for n, v in ctx.names.items():
        if v == target:
            ctx.names[n] = TensorRef(node, "scores")


def _materialise(ctx: _Context, value: ScoreExpr, loc: SourceLoc) -> TensorRef:
    if value.expr == ex.score():
        return TensorRef(value.node, "scores")
    if value.expr.ty != ex.FLOAT and value.expr.ty != ex.INT:
        raise DslError(f"a score expression must be numeric, got a {value.expr.ty} expression", loc)
    composed = value.expr
    if value.node in ctx.composed_scores:
        composed = ex.substitute(value.expr, {ex.score(): ctx.composed_scores[value.node]})
    _check_composed_size(composed, loc)
    node = add_op(ctx.g, ScoreMap(ex.fold(value.expr), loc=loc), [value.node], _reads(ctx, value.expr))
    ctx.composed_scores[node] = composed
    return TensorRef(node, "scores")


def _reads(ctx: _Context, e: ex.Expr) -> set[str]:
    """Runtime inputs `e` depends on (tensors read and scalar inputs used)."""
    names = {r.tensor for r in ex.reads(e)}
    declared = {n for n, v in ctx.names.items() if isinstance(v, ex.Var)}
    return names | (ex.free_vars(e) & declared)


# ----------------------------------------------------------------------------- expressions
def _scalar(ctx: _Context, a: Ast, what: str) -> ex.Expr:
    value = _lower_expr(ctx, a)
    if not isinstance(value, ex.Expr):
        raise DslError(f"{what} must be a number, not a tensor", a.start)
    return value


def _lower_expr(ctx: _Context, a: Ast) -> Value:
    handler = _EXPRESSIONS.get(a.kind)
    if handler is None:
        raise DslError(f"unexpected {a.kind} here", a.loc)
    return handler(ctx, a)


def _int_literal(text: str) -> int:
    """A decimal literal's value, INT64_MAX + 1 for any longer than int64's 19 digits (Python's
    int() refuses more than 4300 digits: a ValueError from deep inside)."""
    digits = text.lstrip("0")
    return INT64_MAX + 1 if len(digits) > len(str(INT64_MAX)) else int(digits or "0")


def _shown(text: str) -> str:
    """A literal as an error quotes it: at most 40 characters."""
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _number(ctx: _Context, a: Ast) -> Value:
    text = a.value
    if text.isdigit():
        value = _int_literal(text)
        if value > INT64_MAX:
            raise DslError(f"integer `{_shown(text)}` is out of range (integers are int64: at most {INT64_MAX})", a.loc)
        return ex.const(value)
    value = float(text)
    if not math.isfinite(value):
        raise DslError(f"number `{_shown(text)}` is out of range", a.loc)
    return ex.const(value)


def _name(ctx: _Context, a: Ast) -> Value:
    n = a.value
    if n in ctx.names:
        value = ctx.names[n]
        return ScoreExpr(value.node, ex.score()) if isinstance(value, TensorRef) and value.kind == "scores" else value
    if n in ex.INDEX_VARS or n in ex.SIZE_VARS:
        return ex.var(n)
    if n == "scale":
        ctx.scale_read_at = ctx.scale_read_at or a.loc
        return ex.var("scale", ex.FLOAT)
    if n == "inf":
        return ex.const(math.inf)
    size_of = _free_dimension(ctx, n)
    if size_of is not None:  # (a free dimension name: an int the runtime binds from the tensor's shape)
        add_op(ctx.g, Input(n, "scalar", "int", size_of=size_of, loc=a.loc))
        ctx.names[n] = ex.var(n, ex.INT)
        return ctx.names[n]
    known = sorted(set(ctx.names) | set(ex.INDEX_VARS) | set(ex.SIZE_VARS) | {"scale", "inf"})
    raise DslError(f"unknown name `{n}`; known names are {', '.join(known)}", a.loc)


def _free_dimension(ctx: _Context, name: str) -> tuple[str, int] | None:
    """(tensor, axis) of the first declared tensor input with a free dimension `name` (not one
    of the compiler's `__` names)."""
    if name.startswith("__"):
        return None
    for value in ctx.names.values():
        if isinstance(value, TensorRef) and value.kind == "tensor":
            decl = op_of(ctx.g, value.node)
            assert isinstance(decl, Input)
            if name in decl.dims:
                return decl.name, decl.dims.index(name)
    return None


def _attribute(ctx: _Context, a: Ast) -> Value:
    base = _lower_expr(ctx, a.children[0])
    if a.value == "T" and isinstance(base, TensorRef) and base.kind == "k":
        return TensorRef(base.node, "kT")
    raise DslError(f"unknown attribute `.{a.value}` (only `k.T` is supported)", a.loc)


def _index(ctx: _Context, a: Ast) -> Value:
    base_ast, *index_asts = a.children
    base = _lower_expr(ctx, base_ast)
    if not (isinstance(base, TensorRef) and base.kind == "tensor"):
        raise DslError("only declared tensor inputs can be indexed", base_ast.loc)
    decl = ctx.g.nodes[base.node]["op"]
    if len(index_asts) != len(decl.dims):
        raise DslError(f"`{decl.name}` has {len(decl.dims)} dimensions but is indexed with {len(index_asts)}", a.loc)
    index = []
    for axis, i_ast in enumerate(index_asts):
        i = _lower_expr(ctx, i_ast)
        if isinstance(i, (TensorRef, ScoreExpr)) or i.ty != ex.INT:
            raise DslError("an index must be an integer expression over b, h, i, j and integer inputs", i_ast.start)
        folded = ex.fold(i)
        # (a read is checked at every position of every call, whatever `where` surrounds it: a
        # constant index out of range failed every call, told at the call, session 67's review)
        size = decl.dims[axis]
        if isinstance(folded, ex.Const) and not 0 <= int(folded.value) < (size if isinstance(size, int) else INT64_MAX):
            within = f"[0, {size - 1}]" if isinstance(size, int) else "0 and above"
            raise DslError(
                f"index {int(folded.value)} of `{decl.name}` is out of range: dimension {axis} takes {within}",
                i_ast.start,
            )
        index.append(folded)
    return ex.Read(decl.name, tuple(index), _scalar_type(decl.dtype))


_UNARY = {"-": "neg", "not": "not"}
_BINARY = {
    "+": "add", "-": "sub", "*": "mul", "/": "div", "//": "floordiv", "%": "mod",
    "<": "lt", "<=": "le", ">": "gt", ">=": "ge", "==": "eq", "!=": "ne", "and": "and", "or": "or",
}  # fmt: skip


def _unary(ctx: _Context, a: Ast) -> Value:
    operand = _lower_expr(ctx, a.children[0])
    if a.value == "+":
        return operand
    return _elementwise(ctx, a, _UNARY[a.value], [operand])


def _binary(ctx: _Context, a: Ast) -> Value:
    left, right = (_lower_expr(ctx, c) for c in a.children)
    if a.value == "@":
        return _matmul(ctx, a, left, right)
    return _elementwise(ctx, a, _BINARY[a.value], [left, right])


def _matmul(ctx: _Context, a: Ast, left: Value, right: Value) -> Value:
    if isinstance(left, TensorRef) and left.kind == "q" and isinstance(right, TensorRef) and right.kind == "kT":
        return ScoreExpr(add_op(ctx.g, ScoreMatmul(loc=a.loc), [left.node, right.node]), ex.score())
    if isinstance(left, TensorRef) and left.kind == "probs" and isinstance(right, TensorRef) and right.kind == "v":
        return TensorRef(add_op(ctx.g, ValueMatmul(loc=a.loc), [left.node, right.node]), "out")
    raise DslError("`@` computes the scores `q @ k.T` or the output `p @ v` (p from softmax)", a.loc)


def _call(ctx: _Context, a: Ast) -> Value:
    fn = a.value
    if fn == "rope":  # (a statement of its own: elsewhere it read as an unknown function, or a wrong keyword)
        raise DslError(
            "`rope` rotates q or k as a statement of its own: `q = rope(q, ...)` or `k = rope(k, ...)`", a.loc
        )
    keywords = [c for c in a.children if c.kind == "keyword"]
    allowed = ("sink",) if fn == "softmax" else ()
    for n, kw in enumerate(keywords):
        if any(other.value == kw.value for other in keywords[:n]):
            raise DslError(f"`{fn}`: keyword argument `{kw.value}` given twice", kw.loc)
        if kw.value not in allowed:
            expected = f"; expected {', '.join(allowed)}" if allowed else ""
            raise DslError(f"`{fn}` has no keyword argument `{kw.value}`{expected}", kw.loc)
    args = [_lower_expr(ctx, c) for c in a.children if c.kind != "keyword"]
    if fn == "softmax":
        _arity(a, args, 1)
        scores = args[0]
        if isinstance(scores, ScoreExpr):
            scores = _materialise(ctx, scores, a.children[0].loc)
        if not (isinstance(scores, TensorRef) and scores.kind == "scores"):
            raise DslError("softmax takes the scores (from `q @ k.T`)", a.children[0].loc)
        sink, reads = None, set()
        if keywords:
            sink = _sink(ctx, keywords[0].children[0])
            reads = _reads(ctx, sink)
        return TensorRef(add_op(ctx.g, Softmax(sink, loc=a.loc), [scores.node], reads), "probs")
    if fn == "dropout":
        _arity(a, args, 2)
        probs, rate = args
        if not (isinstance(probs, TensorRef) and probs.kind == "probs"):
            raise DslError("dropout takes the probabilities (from `softmax`)", a.children[0].loc)
        p = ex.fold(rate) if isinstance(rate, ex.Expr) else None
        if not (isinstance(p, ex.Const) and p.ty in (ex.FLOAT, ex.INT) and 0 <= float(p.value) < 1):
            raise DslError("the dropout rate must be a constant in [0, 1)", a.children[1].start)
        return TensorRef(add_op(ctx.g, Dropout(float(p.value), loc=a.loc), [probs.node]), "probs")
    if fn in MATH_FUNCTIONS:
        _arity(a, args, MATH_FUNCTIONS[fn])
        op = {"where": "where"}.get(fn, fn)
        return _elementwise(ctx, a, op, args)
    known = ", ".join(["softmax", "dropout", *MATH_FUNCTIONS])
    raise DslError(f"unknown function `{fn}`; known functions are {known}", a.loc)


def _sink(ctx: _Context, a: Ast) -> ex.Expr:
    """The softmax's sink logit: a number per query row, so over b, h, i, the sizes, `scale`
    and inputs, never j or the scores."""
    value = _lower_expr(ctx, a)
    if isinstance(value, ScoreExpr):
        raise DslError("a sink cannot depend on the scores `s`: it is one logit per query row", a.start)
    if isinstance(value, TensorRef):
        raise DslError("a sink is a number per query row (e.g. `sinks[h]`), not a tensor", a.start)
    if value.ty not in (ex.INT, ex.FLOAT):
        raise DslError(f"a sink must be a number, got a {value.ty} expression", a.start)
    if "j" in ex.free_vars(value):
        raise DslError("a sink is one logit per query row: it may use b, h and i, not the key index j", a.start)
    _check_composed_size(value, a.loc)
    return ex.fold(value)


#: rope's keyword arguments: constant numbers, and the position expression.
ROPE_KEYWORDS = ("theta", "dims", "first", "interleaved", "position")
ROPE_DEFAULT_THETA = 10000.0


def _rope(ctx: _Context, name: Ast, call: Ast) -> None:
    """`q = rope(q, theta=10000, dims=64, first=0, interleaved=0, position=i)` (and for k, its
    rows' position j by default): the operand's rows rotated before `q @ k.T`."""
    operand = name.value
    args = [c for c in call.children if c.kind != "keyword"]
    keywords = {}
    for kw in (c for c in call.children if c.kind == "keyword"):
        if kw.value not in ROPE_KEYWORDS:
            raise DslError(f"`rope` has no keyword argument `{kw.value}`; expected {', '.join(ROPE_KEYWORDS)}", kw.loc)
        if kw.value in keywords:
            raise DslError(f"`rope`: keyword argument `{kw.value}` given twice", kw.loc)
        keywords[kw.value] = kw.children[0]
    if len(args) != 1 or not (args[0].kind == "name" and args[0].value == operand):
        raise DslError(
            f"`{operand} = rope({operand}, ...)` rotates {operand} itself: one positional argument, `{operand}`",
            call.loc,
        )
    current = ctx.names[operand]
    assert isinstance(current, TensorRef)
    if not isinstance(ctx.g.nodes[current.node]["op"], Input):
        raise DslError(f"`{operand}` is rotated once: a second rope of it", call.loc)
    if any(isinstance(v, TensorRef) and v.kind == "scores" for v in ctx.names.values()):
        raise DslError(f"rope({operand}) must come before the scores `q @ k.T` that read it", call.loc)

    def constant(key: str, default: float | None, kind: str) -> float | None:
        if key not in keywords:
            return default
        value = ex.fold(_scalar(ctx, keywords[key], f"rope's {key}"))
        ok = isinstance(value, ex.Const) and (kind == "float" or value.ty == ex.INT)
        if not ok:
            raise DslError(
                f"rope's {key} must be a constant {'number' if kind == 'float' else 'integer'}", keywords[key].start
            )
        return float(value.value)  # type: ignore[union-attr]

    theta = constant("theta", ROPE_DEFAULT_THETA, "float")
    if not (theta and 1.0 < theta < math.inf):  # (NaN and inf: every output NaN)
        raise DslError("rope's theta must be a finite number above 1 (10000 in most models)", keywords["theta"].start)
    dims = constant("dims", None, "int")
    if dims is not None and (dims <= 0 or dims % 2):
        raise DslError("rope's dims must be a positive even number of head dims", keywords["dims"].start)
    first = constant("first", 0, "int")
    if first < 0:  # type: ignore[operator]
        raise DslError("rope's first rotated head dim must be 0 or more", keywords["first"].start)
    interleaved = constant("interleaved", 0, "int")
    if interleaved not in (0, 1):
        raise DslError(
            "rope's interleaved is 0 (pairs p, p + dims/2) or 1 (pairs 2p, 2p + 1)", keywords["interleaved"].start
        )
    row = "i" if operand == "q" else "j"
    position = ex.var(row)
    if "position" in keywords:
        value = _lower_expr(ctx, keywords["position"])
        if isinstance(value, (TensorRef, ScoreExpr)) or value.ty not in (ex.INT, ex.FLOAT):
            raise DslError(f"rope's position is a number per row of {operand}", keywords["position"].start)
        other = {"h", "j" if operand == "q" else "i", "scale"} & ex.free_vars(value)
        if other:
            raise DslError(
                f"rope's position of {operand}'s rows may use b, {row}, the sizes and inputs, not {', '.join(sorted(other))}",
                keywords["position"].start,
            )
        floats = sorted({r.tensor for r in ex.reads(value) if r.ty == ex.FLOAT})
        if floats:
            raise DslError(
                f"rope's position reads the float input `{floats[0]}`: positions take no gradient; "
                "declare it int (or read it as a scalar)",
                keywords["position"].start,
            )
        _check_composed_size(value, keywords["position"].loc)
        position = ex.fold(value)
    spec = Rope(
        operand, theta, None if dims is None else int(dims), int(first), bool(interleaved), position, loc=call.loc
    )  # type: ignore[arg-type]
    ctx.names[operand] = TensorRef(add_op(ctx.g, spec, [current.node], _reads(ctx, position)), operand)


def _arity(a: Ast, args: list[Value], n: int) -> None:
    if len(args) != n:
        raise DslError(f"`{a.value}` takes {n} argument{'s' if n != 1 else ''}, got {len(args)}", a.loc)


def _elementwise(ctx: _Context, a: Ast, op: str, args: list[Value]) -> Value:
    """Combine scalar and score operands; the result is a ScoreExpr if any operand is one."""
    nodes = {v.node for v in args if isinstance(v, ScoreExpr)}
    if any(isinstance(v, TensorRef) for v in args):
        raise DslError(f"`{a.value or op}` applies to scores and numbers, not to this tensor", a.loc)
    if len(nodes) > 1:
        raise DslError("an expression may combine only one score tensor (elementwise over s)", a.loc)
    exprs = [v.expr if isinstance(v, ScoreExpr) else v for v in args]
    result = _typed(a, op, exprs)
    return ScoreExpr(nodes.pop(), result) if nodes else result


def _typed(a: Ast, op: str, args: list[ex.Expr]) -> ex.Expr:
    """Build one node, checking operand types so type errors point at the operator."""
    tys = [x.ty for x in args]
    numeric = (ex.INT, ex.FLOAT)
    if op == "not":
        if tys[0] != ex.BOOL:
            raise DslError("`not` needs a condition", a.loc)
        return ex.Unary("not", args[0])
    if op in ("and", "or"):
        if tys != [ex.BOOL, ex.BOOL]:
            raise DslError(f"`{op}` needs conditions on both sides", a.loc)
        return ex.Binary(op, *args)
    if op == "where":
        if tys[0] != ex.BOOL or tys[1] not in (*numeric, ex.BOOL) or (tys[2] != tys[1] and ex.BOOL in tys[1:]):
            raise DslError("`where(cond, a, b)` needs a condition and two values of the same kind", a.loc)
        return ex.Where(*args)
    if any(t not in numeric for t in tys):
        raise DslError(f"`{a.value}` needs numbers, got a condition", a.loc)
    if op in ("floordiv", "mod") and tys != [ex.INT, ex.INT]:
        what = "integer division" if op == "floordiv" else "the integer remainder"
        raise DslError(f"`{a.value}` is {what}; both sides must be integers", a.loc)
    if op in ("floordiv", "mod") and ex.fold(args[1]) == ex.const(0):  # (refused at every call, far from here)
        raise DslError(f"`{a.value}` by a divisor that is always 0", a.loc)
    if op in ex.ROUNDING_OPS and tys[0] == ex.INT:
        return args[0]  # (an integer is its own floor, ceil, trunc and round)
    if op in ex.UNARY_OPS:
        return ex.Unary(op, args[0])
    return ex.Binary(op, *args)


_EXPRESSIONS = {
    "number": _number, "name": _name, "attribute": _attribute, "index": _index,
    "unary": _unary, "binary": _binary, "call": _call,
}  # fmt: skip
