"""Kernels of DSL programs made from a call's options (the FlashAttention and SDPA drop-ins)."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Generic, TypeVar

import torch
from torch.fx.experimental.symbolic_shapes import guard_scalar

import attncc
from attncc.runtime.kernel import Kernel
from attncc.runtime.locks import instance_lock

Options = TypeVar("Options", bound=Hashable)


# every MadeKernels, by its index: what torch.compile's trace-time compile (`_made`) is given
_MADE: list[MadeKernels] = []


class MadeKernels(Generic[Options]):
    """The kernel of `program(options)` per options and target, compiled once per process (and
    cached on disk as every kernel is). An eager hit is a dict lookup without the lock. While
    torch.compile traces a call, dynamo runs the lookup, and the compile of an option set not
    made yet, itself, untraced (`_made`): a new option set needs no eager call first (dynamo
    traces no lock: fullgraph failed on every call before session 53, on every new option set
    before session 56)."""

    def __init__(self, options_type: type[Options], program: Callable[[Options], str | Path]) -> None:
        self.program = program
        self._options_type = options_type
        self._fields = tuple(field.name for field in dataclasses.fields(options_type))  # type: ignore[arg-type]
        self._kernels: dict[tuple[Options, str], Kernel] = {}
        self._lock = instance_lock(self)
        self._index = len(_MADE)
        _MADE.append(self)

    def __call__(self, options: Options, device: torch.device) -> Kernel:
        target = "cuda" if device.type == "cuda" else "cpu"
        if torch.compiler.is_compiling():
            # (made or found by `_made` whatever the table holds, so that a trace dynamo restarts
            # takes the same path; read back as an attribute of its own: dynamo reads the table
            # once per trace, and a second new option set was missing from it; the options as
            # their fields: dynamo passes no dataclass to an untraced function)
            fields = tuple(_concrete(getattr(options, name)) for name in self._fields)
            return getattr(_SLOTS, _made(self._index, fields, target))
        found = self._kernels.get((options, target))
        return found if found is not None else self._make((options, target))

    def _make(self, key: tuple[Options, str]) -> Kernel:
        with self._lock:
            if key not in self._kernels:
                self._kernels[key] = attncc.compile(self.program(key[0]), target=key[1])
            return self._kernels[key]


def _concrete(value: object) -> object:
    """A traced number as the number it holds (a guard on its value: with dynamic=True dynamo
    traces every float and hands none to an untraced function);
    anything else as it is."""
    if isinstance(value, bool | int | float | torch.SymBool | torch.SymInt | torch.SymFloat):
        return guard_scalar(value)
    return value


# the kernels `_made` made, each an attribute (a new attribute is read as it is by dynamo)
_SLOTS = types.SimpleNamespace()


def _made(index: int, fields: tuple, target: str) -> str:
    """The name in `_SLOTS` of the kernel of the options with these fields, made where it is
    new (a constant to dynamo: called while tracing, not traced)."""
    made = _MADE[index]
    kern = made._make((made._options_type(*fields), target))
    slot = f"kernel_{kern.key}_{target}"
    setattr(_SLOTS, slot, kern)
    return slot


# What torch.compiler.assume_constant_result(_made) does (torch 2.13), without its import of
# torch._dynamo (1.3 s at `import attncc.integrations.sdpa`); tests/test_torch_integration.py
# checks the decorator still sets this marker.
_made._dynamo_marked_constant = True  # type: ignore[attr-defined]


#: The rate a made program with dropout is written with. Its calls give theirs (`dropout_p`: the
#: kernels take the rate at run time), so one program serves every rate, where each rate was a
#: program of its own (a build per rate of an annealed dropout) until session 68.
WRITTEN_RATE = 0.5


def masked_softmax_output(terms: list[str], dropout: bool, sink: str | None = None) -> list[str]:
    """A made program's last lines: its mask terms AND'ed, the softmax (with `sink`, a read of a
    declared input, as its sink logit), dropout where `dropout` (at `WRITTEN_RATE`), the output."""
    lines = ["mask " + " and ".join(terms)] if terms else []
    lines.append(f"p = softmax(s, sink={sink})" if sink else "p = softmax(s)")
    if dropout:
        lines.append(f"p = dropout(p, {WRITTEN_RATE!r})")
    return [*lines, "o = p @ v", "output o"]
