"""The mutant table: mistakes a kernel could make must fail the golden check.

Each row plants one mistake in an example, either in its program text (a window dropped, a
comparison off by one, a cap removed: what a parser, fusion or codegen bug would do) or in
what the "kernel" returns (a missing gradient, a NaN, an error in small gradient entries).
The mutant kernel is stood in for by the mutant program's own float64 reference, rounded to
the inputs' dtype: the most accurate implementation of the wrong program. `check()` then runs
its error and limit code against the correct program without building anything, on the
configurations the golden tests run (test_golden.GOLDEN_CONFIGS); one of them must fail.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import attncc
from attncc.runtime.check import check
from attncc.runtime.inputs import adapt
from tests.conftest import ROOT, kernel
from tests.test_golden import GOLDEN_CONFIGS


class ReferenceAsKernel:
    """A stand-in kernel computing `mutant`'s float64 reference, out rounded to the inputs'
    dtype and lse in fp32 as kernels return them; everything else is `correct`'s (the inputs
    it declares, its reference). `inputs` may alter the runtime inputs it uses, `output` its out."""

    def __init__(
        self,
        correct: attncc.Kernel,
        mutant: attncc.Kernel,
        inputs: Callable[[dict], dict] | None = None,
        output: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.correct, self.mutant, self.inputs_planted, self.output_planted = correct, mutant, inputs, output

    def __getattr__(self, name: str) -> object:
        return getattr(self.correct, name)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool, seed: int, **runtime: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inputs_planted is not None:
            runtime = self.inputs_planted(dict(runtime))
        out, lse = self.mutant.reference(q, k, v, seed=seed, **runtime)
        out = out.to(q.dtype)
        if self.output_planted is not None:
            out = self.output_planted(out)
        return out, lse.float()


def mutated(name: str, old: str, new: str) -> attncc.Kernel:
    text = (ROOT / "examples" / f"{name}.attn").read_text()
    assert old in text, f"{name}: `{old}` not in the program"
    return attncc.compile(text.replace(old, new, 1))


class _SmallGradientsOff(torch.autograd.Function):
    """Identity whose backward is 5% off on the gradient entries below 0.05 in size."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return torch.where(grad.abs() < 0.05, grad * 1.05, grad)


def _detached(name: str) -> Callable[[dict], dict]:
    return lambda runtime: {**runtime, name: runtime[name].detach()}


def _small_gradients_off(name: str) -> Callable[[dict], dict]:
    return lambda runtime: {**runtime, name: _SmallGradientsOff.apply(runtime[name])}


#: (example, program text, its replacement, dtype of the configurations that must catch it)
PROGRAM_MUTANTS = [
    ("sliding_window", "mask j <= i and i - j < window", "mask j <= i", torch.float32),
    ("sliding_window", "mask j <= i and i - j < window", "mask j <= i", torch.bfloat16),
    ("sliding_window", "i - j < window", "i - j <= window", torch.float32),
    ("strided", "layout strided(block=32, stride=4)", "", torch.float32),
    ("strided", "layout strided(block=32, stride=4)", "", torch.bfloat16),
    ("strided", "stride=4", "stride=5", torch.float32),
    ("local_blocks", "layout local(block=64, width=2)", "", torch.float32),
    ("local_blocks", "width=2", "width=3", torch.float32),
    ("softcap", "s = cap * tanh(s / cap)", "", torch.float32),
    ("softcap", "s = cap * tanh(s / cap)", "", torch.bfloat16),
    ("softcap", "s = cap * tanh(s / cap)", "", torch.float16),
    ("padding", "j < lengths[b]", "j <= lengths[b]", torch.float32),
    ("padding", "j < lengths[b]", "j <= lengths[b]", torch.bfloat16),
    ("causal", "mask j <= i", "mask j < i", torch.bfloat16),
    ("prefix_lm", "j < prefix[b]", "j <= prefix[b]", torch.float32),
    ("document", "doc[b, i] == doc[b, j] and ", "", torch.bfloat16),
    ("alibi", "s - slopes[h]", "s + slopes[h]", torch.bfloat16),
    ("relative_bias", "min(max_distance, j - i)", "min(max_distance - 1, j - i)", torch.float32),
    ("blocksparse_butterfly", "block=64", "block=32", torch.float32),
    ("gpt2", "dropout(p, 0.1)", "dropout(p, 0.12)", torch.float32),
    ("vanilla", "q @ k.T * scale", "q @ k.T * scale * 1.01", torch.float32),
    ("vanilla", "q @ k.T * scale", "q @ k.T * scale * 1.01", torch.bfloat16),
]

#: (example, what the stand-in kernel does wrong, dtype)
KERNEL_MUTANTS = [
    ("alibi", "no gradient for slopes", _detached("slopes"), torch.float32),
    ("relative_bias", "no gradient for bias", _detached("bias"), torch.bfloat16),
    ("relative_bias", "small bias gradients 5% off", _small_gradients_off("bias"), torch.float32),
]


def assert_caught(stand_in: ReferenceAsKernel, dtype: torch.dtype, what: str) -> None:
    """Some golden configuration of `dtype` fails the stand-in (forward alone is tried first: it
    is cheaper), and the same check passes the unmutated program's stand-in, so it is the
    planted mistake that is caught."""
    correct = ReferenceAsKernel(stand_in.correct, stand_in.correct)
    for backward in (False, True):
        for shape, config_dtype, q_scale in GOLDEN_CONFIGS:
            if config_dtype != dtype:
                continue
            shape = adapt(shape, stand_in.correct)
            if not check(stand_in, shape, dtype, backward=backward, q_scale=q_scale).ok:  # type: ignore[arg-type]
                yardstick = check(correct, shape, dtype, backward=backward, q_scale=q_scale)  # type: ignore[arg-type]
                assert yardstick.ok, f"the unmutated stand-in fails too: {yardstick.describe()}"
                return
    raise AssertionError(f"{what}: passes every {dtype} golden configuration")


@pytest.mark.parametrize("name, old, new, dtype", PROGRAM_MUTANTS, ids=lambda x: str(x).replace(" ", ""))
def test_program_mutant_is_caught(name: str, old: str, new: str, dtype: torch.dtype) -> None:
    assert_caught(ReferenceAsKernel(kernel(name), mutated(name, old, new)), dtype, f"{name} with `{old}` -> `{new}`")


@pytest.mark.parametrize("name, what, planted, dtype", KERNEL_MUTANTS, ids=lambda x: str(x).replace(" ", "_"))
def test_kernel_mutant_is_caught(name: str, what: str, planted: Callable, dtype: torch.dtype) -> None:
    assert_caught(ReferenceAsKernel(kernel(name), kernel(name), planted), dtype, f"{name}, {what}")


def test_nan_where_the_reference_is_finite_is_caught() -> None:
    def nan_in_out(out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out.view(-1)[3] = float("nan")
        return out

    stand_in = ReferenceAsKernel(kernel("vanilla"), kernel("vanilla"), output=nan_in_out)
    shape, dtype, _ = GOLDEN_CONFIGS[1]
    result = check(stand_in, shape, dtype)  # type: ignore[arg-type]
    assert not result.ok and result.errors["out"] == float("inf"), result.describe()
