"""Shared fixtures: every example compiled once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import torch

import attncc

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.attn"))


@cache
def kernel(name: str) -> attncc.Kernel:
    return attncc.compile(ROOT / "examples" / f"{name}.attn")


@pytest.fixture(params=EXAMPLES)
def example(request: pytest.FixtureRequest) -> attncc.Kernel:
    return kernel(request.param)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch (and so the CPU kernels) on 2 threads for the test: a CPU decoding task takes as
    many kv heads of a sequence as leave every thread a task (templates/cpu forward_decode), so
    tests of several kv heads per task must not depend on the machine's core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def recorded_problems(kern: attncc.Kernel, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """(H, Hkv, N) of every launch of `kern`'s class (emulated kernels: `_run`), as the kernel
    ran it: a GQA group folded into one head's rows shows as (Hkv, Hkv, G N)."""
    problems: list[tuple[int, int, int]] = []
    run = type(kern)._run

    def recorded(self: attncc.Kernel, entry: str, *args: object, **kwargs: object) -> None:
        problem = args[1].problem  # type: ignore[attr-defined]
        problems.append((problem.H, problem.Hkv, problem.N))
        run(self, entry, *args, **kwargs)

    monkeypatch.setattr(type(kern), "_run", recorded)
    return problems
