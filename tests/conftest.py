"""Shared fixtures: every example compiled once per test session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import torch

import attncc

ROOT = Path(__file__).resolve().parents[1]
# A child process's PYTHONPATH: this checkout first, then the caller's (where the dependencies
# may be, as on the device machine, whose lark is a --target install named by PYTHONPATH).
ROOT_FIRST_PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
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

    def recorded(self: attncc.Kernel, entry: str, *args: object, **kwargs: object) -> tuple:
        problem = args[1].problem  # type: ignore[attr-defined]
        problems.append((problem.H, problem.Hkv, problem.N))
        return run(self, entry, *args, **kwargs)

    monkeypatch.setattr(type(kern), "_run", recorded)
    return problems


def loss_gradients(
    loss: str,
    outputs: tuple[torch.Tensor, torch.Tensor],
    reference: tuple[torch.Tensor, torch.Tensor],
    leaves: tuple[torch.Tensor, ...],
    reference_leaves: tuple[torch.Tensor, ...],
    dout: torch.Tensor,
    dlse: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The gradients w.r.t. `leaves` of a loss on (out, lse) and the float64 reference's w.r.t.
    `reference_leaves`: `loss` names the outputs taking part ("lse", "out and lse", else out)
    and "threads changed" runs the backward on one thread (torch's count restored after)."""
    if loss == "lse":
        picked, grads_in = [1], (dlse,)
    elif loss == "out and lse":
        picked, grads_in = [0, 1], (dout, dlse)
    else:
        picked, grads_in = [0], (dout,)
    threads = torch.get_num_threads()
    try:
        if "threads changed" in loss:
            torch.set_num_threads(1)
        got = torch.autograd.grad([outputs[i] for i in picked], leaves, grads_in)
    finally:
        torch.set_num_threads(threads)
    grads_out = tuple(g.double() for g in grads_in)  # (lse alone does not depend on v: dv = 0)
    want = torch.autograd.grad(
        [reference[i] for i in picked], reference_leaves, grads_out, allow_unused=True, materialize_grads=True
    )
    return got, want


def count_full_paths(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """The CPU kernels' full-path forwards and backwards from now on (`Kernel.forward_impl`,
    `backward_impl`: planned, prepared and packed for the call): "forward" grows by one per
    forward, "backward" by the kept forward launch each backward was given (`kept_by`, or None)."""
    full: dict[str, list] = {"forward": [], "backward": []}
    forward_impl, backward_impl = attncc.Kernel.forward_impl, attncc.Kernel.backward_impl

    def counted_forward(self: attncc.Kernel, *args: object, **kwargs: object) -> object:
        full["forward"].append(1)
        return forward_impl(self, *args, **kwargs)

    def counted_backward(self: attncc.Kernel, *args: object, **kwargs: object) -> object:
        full["backward"].append(kwargs.get("kept_by"))
        return backward_impl(self, *args, **kwargs)

    monkeypatch.setattr(attncc.Kernel, "forward_impl", counted_forward)
    monkeypatch.setattr(attncc.Kernel, "backward_impl", counted_backward)
    return full
