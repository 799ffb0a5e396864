"""Errors that attncc reports to users.

Every error a user can cause derives from `AttnccError`; the CLI prints it without a traceback.
DSL errors carry a source location and render as ``file:line:col: error: message`` followed by
the offending line and a caret, like a C compiler.
"""

from __future__ import annotations

from dataclasses import dataclass


class AttnccError(Exception):
    """Base class of every user-facing attncc error."""


@dataclass(frozen=True)
class SourceLoc:
    """A position in a DSL program (1-based line and column)."""

    path: str
    line: int
    column: int
    source_line: str = ""  # the line's text, or the part of a long line around the column
    shown_from: int = 0  # where source_line starts in the line (0-based; > 0: a long line's part)

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.column}"


class DslError(AttnccError):
    """A mistake in a DSL program, reported at its source location."""

    def __init__(self, message: str, loc: SourceLoc | None) -> None:
        self.message = message
        self.loc = loc
        super().__init__(self.render())

    def render(self) -> str:
        if self.loc is None:
            return f"error: {self.message}"
        text = f"{self.loc}: error: {self.message}"
        if self.loc.source_line:
            shown, before = self.loc.source_line, max(self.loc.column - 1 - self.loc.shown_from, 0)
            # (the caret's indent keeps the line's tabs, so it lines up wherever tabs stop)
            indent = "".join(c if c == "\t" else " " for c in shown[:before]) + " " * (before - len(shown))
            if self.loc.shown_from:
                shown, indent = "..." + shown, "   " + indent
            text += f"\n  {shown}\n  {indent}^"
        return text


class FlexTraceError(AttnccError):
    """A FlexAttention score or mask function computes something the DSL cannot say
    (frontend/flex.py); names the function and the line."""


class InputError(AttnccError, ValueError):
    """A tensor or runtime input given to a compiled kernel does not match the program."""


class BuildError(AttnccError):
    """The C++ compiler or ninja failed on generated code."""


class IRVerificationError(AttnccError):
    """An IR invariant is broken; names the offending node (a compiler bug, not a user error)."""
