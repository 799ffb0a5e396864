"""Shared fixtures: every example compiled once per test session."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

import attncc

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.attn"))


@cache
def kernel(name: str) -> attncc.Kernel:
    return attncc.compile(ROOT / "examples" / f"{name}.attn")


@pytest.fixture(params=EXAMPLES)
def example(request: pytest.FixtureRequest) -> attncc.Kernel:
    return kernel(request.param)
