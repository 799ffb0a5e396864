"""Kernels of DSL programs made from a call's options (the FlashAttention and SDPA drop-ins)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

import attncc
from attncc.runtime.kernel import Kernel
from attncc.runtime.locks import instance_lock

Options = TypeVar("Options", bound=Hashable)


class MadeKernels(Generic[Options]):
    """The kernel of `program(options)` per options and target, compiled once per process (and
    cached on disk as every kernel is). A hit is a dict lookup without the lock: torch.compile
    traces no lock (fullgraph failed on every call before)."""

    def __init__(self, program: Callable[[Options], str]) -> None:
        self.program = program
        self._kernels: dict[tuple[Options, str], Kernel] = {}
        self._lock = instance_lock(self)

    def __call__(self, options: Options, device: torch.device) -> Kernel:
        key = (options, "cuda" if device.type == "cuda" else "cpu")
        found = self._kernels.get(key)
        if found is not None:
            return found
        with self._lock:
            if key not in self._kernels:
                self._kernels[key] = attncc.compile(self.program(options), target=key[1])
            return self._kernels[key]


def masked_softmax_output(terms: list[str], dropout: float, sink: str | None = None) -> list[str]:
    """A made program's last lines: its mask terms AND'ed, the softmax (with `sink`, a read of a
    declared input, as its sink logit), dropout at `dropout` (formatted from the validated
    float), the output."""
    lines = ["mask " + " and ".join(terms)] if terms else []
    lines.append(f"p = softmax(s, sink={sink})" if sink else "p = softmax(s)")
    if dropout > 0:
        lines.append(f"p = dropout(p, {float(dropout)!r})")
    return [*lines, "o = p @ v", "output o"]
