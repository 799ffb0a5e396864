"""Parse DSL text into a located syntax tree.

The grammar lives in `attn.lark`. Parsing is LALR with the tree built bottom-up inside the
parser (no recursion), so pathological input (thousands of nested parentheses, megabytes of
operators, binary garbage) ends in a `DslError` with a location, never a RecursionError, a
hang or a traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from attncc.errors import DslError, SourceLoc
from attncc.runtime.locks import module_lock

#: Deepest expression nesting accepted. Hand-written programs use fewer than ten levels, but a
#: flat sum of n terms is n levels deep (generated bucket tables, polynomial biases), so the
#: limit is the lowering's bound on a composed expression, which the passes recurse through.
MAX_DEPTH = 200
OPERATOR_WORDS = ("and", "or", "not")
#: Python's and torch's spellings of operators the DSL writes as words (the parser's hint).
PYTHON_OPERATORS = {
    "&": " (the DSL writes `and`)", "|": " (the DSL writes `or`)", "~": " (the DSL writes `not`)",
    "!": " (the DSL writes `not`)", "**": " (the DSL has no power: multiply, or exp(y * log(x)))",
    "&&": " (the DSL writes `and`)", "||": " (the DSL writes `or`)",
}  # fmt: skip
#: Largest program accepted, in characters.
MAX_SOURCE_CHARS = 1_000_000


@dataclass(frozen=True)
class Ast:
    """A syntax-tree node: `kind` names the construct, `value` holds a token's text."""

    kind: str
    loc: SourceLoc
    value: str = ""
    children: tuple[Ast, ...] = field(default=())
    depth: int = 1
    first: SourceLoc | None = None  # where the construct's text begins (binary: its left operand)

    @property
    def start(self) -> SourceLoc:
        return self.first or self.loc


@cache
def _parser() -> tuple[Lark, _Builder]:
    """The LALR parser with the tree builder run inside it, so no step recurses per level."""
    builder = _Builder()
    grammar = (Path(__file__).with_name("attn.lark")).read_text()
    return Lark(grammar, parser="lalr", maybe_placeholders=False, transformer=builder), builder


_PARSE_LOCK = module_lock(__name__, "_PARSE_LOCK")


class _Builder(Transformer):
    """Builds `Ast` nodes while LALR reduces; tracks and limits nesting depth."""

    src: _Source  # set for each parse, under _PARSE_LOCK

    def _leaf(self, kind: str, tok: Token) -> Ast:
        return Ast(kind, self.src.loc(tok.line, tok.column), str(tok))

    def _node(self, kind: str, loc: SourceLoc, kids: list[Ast], value: str = "", first: SourceLoc | None = None) -> Ast:
        depth = 1 + max((k.depth for k in kids), default=0)
        if depth > MAX_DEPTH:
            raise DslError(
                f"expression nested too deeply (more than {MAX_DEPTH} levels; a chain of operators such as a sum of "
                f"more than {MAX_DEPTH} terms is one level per operator: group it in parentheses)",
                loc,
            )
        return Ast(kind, loc, value, tuple(kids), depth, first)

    def _as_ast(self, item: Ast | Token, kind: str = "ident") -> Ast:
        return item if isinstance(item, Ast) else self._leaf(kind, item)

    # statements -------------------------------------------------------------------------
    def start(self, items: list[Ast]) -> Ast:
        return Ast("program", items[0].loc if items else self.src.loc(1, 1), "", tuple(items))

    def header(self, items: list[Token]) -> Ast:
        return self._leaf("header", items[0])

    def _declared(self, item: Ast | Token) -> Ast:
        """A name a statement declares or assigns; the lexer takes the operators `and`, `or`,
        `not` as names there, but a name so declared could never be read (`not[h]`)."""
        name = self._as_ast(item)
        if name.value in OPERATOR_WORDS:
            raise DslError(f"`{name.value}` is an operator, not a name", name.loc)
        return name

    def input_decl(self, items: list[Token | Ast]) -> Ast:
        name, dtype = self._declared(items[0]), self._as_ast(items[1])
        kids = [name, dtype] + ([items[2]] if len(items) > 2 else [])  # type: ignore[list-item]
        return self._node("input", name.loc, kids)

    def shape(self, items: list[Token]) -> Ast:
        dims = [self._declared(self._leaf("dim", t)) for t in items]
        return self._node("shape", dims[0].loc, dims)

    def const_decl(self, items: list[Token | Ast]) -> Ast:
        name = self._declared(items[0])
        return self._node("const", name.loc, [name, items[1]])  # type: ignore[list-item]

    def assign(self, items: list[Token | Ast]) -> Ast:
        name = self._declared(items[0])
        return self._node("assign", name.loc, [name, items[1]])  # type: ignore[list-item]

    def mask_stmt(self, items: list[Ast]) -> Ast:
        return self._node("mask", items[0].start, items)

    def layout_stmt(self, items: list[Token | Ast]) -> Ast:
        name = self._as_ast(items[0])
        args = [self._as_ast(a) for a in items[1:]]
        return self._node("layout", name.loc, [name, *args])

    def output_stmt(self, items: list[Token]) -> Ast:
        return self._leaf("output", items[0])

    def keyword(self, items: list[Token | Ast]) -> Ast:
        name = self._as_ast(items[0])
        return self._node("keyword", name.loc, [items[1]], str(name.value))  # type: ignore[list-item]

    # expressions ------------------------------------------------------------------------
    def binary(self, items: list[Ast | Token]) -> Ast:
        left, op, right = items
        assert isinstance(op, Token) and isinstance(left, Ast) and isinstance(right, Ast)
        return self._node("binary", self.src.loc(op.line, op.column), [left, right], str(op), left.start)

    def unary(self, items: list[Ast | Token]) -> Ast:
        op, operand = items
        assert isinstance(op, Token) and isinstance(operand, Ast)
        return self._node("unary", self.src.loc(op.line, op.column), [operand], str(op))

    def index(self, items: list[Ast]) -> Ast:
        return self._node("index", items[0].loc, items)

    def attribute(self, items: list[Ast | Token]) -> Ast:
        base, attr = items
        assert isinstance(base, Ast) and isinstance(attr, Token)
        return self._node("attribute", base.loc, [base], str(attr))

    def call(self, items: list[Ast | Token]) -> Ast:
        fn = items[0]
        assert isinstance(fn, Token)
        args = [a for a in items[1:] if isinstance(a, Ast)]
        return self._node("call", self.src.loc(fn.line, fn.column), args, str(fn))

    def number(self, items: list[Token]) -> Ast:
        return self._leaf("number", items[0])

    def name(self, items: list[Token]) -> Ast:
        return self._leaf("name", items[0])


#: Characters of a source line an error shows (a window around the column in longer lines).
SHOWN_CHARS = 200


class _Source:
    def __init__(self, text: str, path: str) -> None:
        self.text = text
        self.path = path
        # (lines as lark counts them, at "\n" alone: splitlines also splits at form feeds and
        # U+2028, which put the quoted line and caret a line off)
        self.lines = [line.removesuffix("\r") for line in text.split("\n")]
        if len(self.lines) > 1 and not self.lines[-1]:
            self.lines.pop()

    def end(self) -> SourceLoc:
        """Just past the last line's text."""
        return self.loc(len(self.lines), len(self.lines[-1]) + 1)

    def loc(self, line: int, column: int) -> SourceLoc:
        src = self.lines[line - 1] if 0 < line <= len(self.lines) else ""
        # (at most SHOWN_CHARS of the line, the column among them: a caret past a line cut at
        # 200 characters pointed at nothing)
        start = 0 if len(src) <= SHOWN_CHARS or column <= SHOWN_CHARS // 2 else column - 1 - SHOWN_CHARS // 2
        return SourceLoc(self.path, line, column, src[start : start + SHOWN_CHARS], start)


def decode_source(data: bytes, path: str) -> str:
    """UTF-8 text of a program file, or a DslError naming the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise DslError(
            f"not a text file: byte 0x{data[exc.start]:02x} is not valid UTF-8",
            SourceLoc(path, line, column),
        ) from None


def parse(text: str, path: str = "<string>") -> Ast:
    """Parse a program; raises DslError (with file:line:col and a caret) on any bad input."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # (Windows and old Mac line ends)
    text = text.removeprefix("\ufeff")  # (a byte-order mark some Windows editors write)
    src = _Source(text, path)
    if len(text) > MAX_SOURCE_CHARS:
        raise DslError(f"program too large ({len(text)} characters, limit {MAX_SOURCE_CHARS})", src.loc(1, 1))
    if not re.sub(r"#[^\n]*", "", text).strip():
        raise DslError("empty program: expected `attention NAME` on the first line", src.loc(1, 1))
    _check_bracket_depth(src)
    try:
        lark, builder = _parser()
        with _PARSE_LOCK:
            builder.src = src
            result = lark.parse(text)
    except UnexpectedCharacters as exc:
        char = text[exc.pos_in_stream] if exc.pos_in_stream < len(text) else ""
        shown = repr(char) if char.isprintable() else f"character U+{ord(char):04X}" if char else "end"
        hint = PYTHON_OPERATORS.get(text[exc.pos_in_stream : exc.pos_in_stream + 2].strip(), "")
        hint = hint or PYTHON_OPERATORS.get(char, "")
        raise DslError(f"unexpected {shown}{hint}", src.loc(exc.line, exc.column)) from None
    except UnexpectedToken as exc:
        tok = exc.token
        what = "end of line" if tok.type == "_NL" else "end of file" if tok.type == "$END" else f"`{tok}`"
        chained = tok.type == "CMP" and "CMP" not in exc.expected  # (`0 <= i - j < 4`)
        power = str(tok) == "*" and text[max(tok.start_pos - 1, 0)] == "*"  # (`x ** 2`)
        hint = " (comparisons do not chain: write `a <= b and b < c`)" if chained else _expected(exc.expected)
        hint = PYTHON_OPERATORS["**"] if power else hint
        at = src.end() if tok.type == "$END" else src.loc(tok.line, tok.column)  # (lark puts $END at the last token)
        raise DslError(f"unexpected {what}{hint}", at) from None
    except UnexpectedEOF as exc:
        raise DslError(f"unexpected end of file{_expected(exc.expected)}", src.end()) from None
    except UnexpectedInput as exc:  # any other lark error still has a position
        raise DslError("syntax error", src.loc(getattr(exc, "line", 1), getattr(exc, "column", 1))) from None
    except DslError:
        raise
    except Exception as exc:  # lark wraps callback errors in VisitError
        inner = getattr(exc, "orig_exc", None)
        if isinstance(inner, DslError):
            raise inner from None
        raise
    assert isinstance(result, Ast)
    return result


_TOKEN_NAMES = {
    "NAME": "a name", "NUMBER": "a number", "LPAR": "`(`", "RPAR": "`)`", "LSQB": "`[`",
    "RSQB": "`]`", "COMMA": "`,`", "EQUAL": "`=`", "COLON": "`:`", "_NL": "end of line",
    "ADD": "`+`/`-`", "MUL": "an operator", "CMP": "a comparison", "DOT": "`.`", "$END": "end of file",
}  # fmt: skip


def _expected(expected: set[str] | frozenset[str]) -> str:
    names = sorted({_TOKEN_NAMES.get(t, t.lower()) for t in expected if not t.startswith("__")})
    if not names or len(names) > 6:
        return ""
    return "; expected " + ", ".join(names)


def _check_bracket_depth(src: _Source) -> None:
    """Reject absurd nesting before the parser sees it (bounded work, clean error)."""
    level = 0
    line, column = 1, 0
    in_comment = False  # (brackets in comments are text: 201 `(` there refused the program)
    for ch in src.text:
        column += 1
        if ch == "\n":
            line, column, in_comment = line + 1, 0, False
        elif in_comment or ch == "#":
            in_comment = True
        elif ch in "([":
            level += 1
            if level > MAX_DEPTH:
                raise DslError(f"brackets nested too deeply (more than {MAX_DEPTH} levels)", src.loc(line, column))
        elif ch in ")]":
            level = max(level - 1, 0)
