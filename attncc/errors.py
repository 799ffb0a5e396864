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
    source_line: str = ""

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
            caret = " " * (max(self.loc.column, 1) - 1) + "^"
            text += f"\n  {self.loc.source_line}\n  {caret}"
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
