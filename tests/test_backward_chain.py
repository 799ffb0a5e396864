"""The backward's chain rule through score maps, on both backends, for the programs the examples
do not cover: constant or scalar derivatives, score-dependent maps with learnable inputs, and
scalar runtime inputs in autograd."""

from __future__ import annotations

import pytest
import torch

import attncc
from attncc.errors import AttnccError, InputError
from attncc.runtime.check import check
from attncc.runtime.inputs import Shape, adapt, make_inputs
from tests.conftest import ROOT

PROGRAMS = {
    # dS0 = 2 dS: a constant derivative other than 1
    "doubled": "attention doubled\ns = q @ k.T * scale\ns = s * 2.0\np = softmax(s)\no = p @ v\noutput o\n",
    # a runtime scalar: the derivative is the scalar; autograd returns no gradient for it
    "tempered": "attention tempered\ninput temp: float\ns = q @ k.T * scale\ns = s * temp\np = softmax(s)\no = p @ v\noutput o\n",
    # dscore depends on s, and a learnable input: its gradient takes dS, not dS * dscore
    "bent": (
        "attention bent\ninput w: float[H]\ns = q @ k.T * scale\ns = s + sqrt(abs(s) + 1) + w[h] * (i - j)\n"
        "mask j <= i\np = softmax(s)\no = p @ v\noutput o\n"
    ),
    "bent_keys": (
        "attention bent_keys\ninput w: float[H, M]\ns = q @ k.T * scale\ns = s * 0.5 + sqrt(abs(s) + 1) + w[h, j]\n"
        "p = softmax(s)\np = dropout(p, 0.2)\no = p @ v\noutput o\n"
    ),
}
SHAPES = (Shape(2, 4, 2, 37, 45, 24), Shape(1, 2, 1, 1, 1, 16))


@pytest.mark.parametrize("name", PROGRAMS)
def test_cpu_chain_rule_fp32(name: str) -> None:
    kern = attncc.compile(PROGRAMS[name])
    for shape in SHAPES:
        result = check(kern, adapt(shape, kern), torch.float32)
        assert result.ok, result.describe()


@pytest.mark.parametrize("name", PROGRAMS)
def test_cpu_chain_rule_gradcheck(name: str) -> None:
    kern = attncc.compile(PROGRAMS[name])
    q, k, v, runtime = make_inputs(kern, Shape(1, 2, 1, 5, 6, 3), torch.float64, seed=2)
    names = [n for n, t in runtime.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    learnable = [runtime.pop(n).detach().double().requires_grad_() for n in names]

    def fn(q, k, v, *extra):
        return kern(q, k, v, seed=5, **runtime, **dict(zip(names, extra)))

    assert torch.autograd.gradcheck(fn, (q, k, v, *learnable), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("name", PROGRAMS)
def test_emulated_chain_rule_fp16(name: str) -> None:
    kern = attncc.compile(PROGRAMS[name], target="sm80", emulate=True)
    result = check(kern, adapt(SHAPES[0], kern), torch.float16)
    assert result.ok, result.describe()


def test_scalar_inputs_get_no_gradient_and_do_not_break_autograd() -> None:
    """The contract (README): a scalar input's derivative enters the score's chain rule, but the
    scalar itself gets no gradient. A tensor that requires grad is refused by name (its
    gradient would otherwise be dropped silently); a number or a detached tensor works, and
    q, k, v get the gradients of the program with that value, on both backends."""
    fixed = PROGRAMS["tempered"].replace("input temp: float\n", "").replace("s * temp", "s * 1.5")

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:  # fp16 results; 1.5 may be folded into the scale
        return torch.allclose(a.float(), b.float(), rtol=4e-3, atol=1e-3)

    for target, emulate in (("cpu", False), ("sm80", True)):
        kern = attncc.compile(PROGRAMS["tempered"], target=target, emulate=emulate)
        plain = attncc.compile(fixed, target=target, emulate=emulate)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 1, 16, 16, generator=gen).half().requires_grad_() for _ in range(3))
        temp = torch.tensor(1.5, requires_grad=True)
        with pytest.raises(
            InputError, match=r"temp: a scalar input .* gets no gradient, but this tensor requires grad"
        ):
            kern(q, k, v, temp=temp)
        grads = [torch.autograd.grad(kern(q, k, v, temp=t).sum(), (q, k, v)) for t in (1.5, temp.detach())]
        want = torch.autograd.grad(plain(q, k, v).sum(), (q, k, v))
        for got in grads:
            assert all(close(a, b) for a, b in zip(got, want))
        with torch.no_grad():  # no autograd: nothing is dropped, the value is used
            assert close(kern(q, k, v, temp=temp), plain(q, k, v))


def test_fp16_scores_gradient_keeps_its_range_on_the_cuda_path() -> None:
    """dS is rounded to fp16 for the dQ/dK products; the scale is folded in first, so a dS of
    1.3e5 (beyond fp16's 65504) still gives a finite dQ."""
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm80", emulate=True)
    N, M, D = 16, 2, 64
    q = torch.zeros(1, 1, N, D).half().requires_grad_()
    k = torch.zeros(1, 1, M, D)
    k[0, 0, 0, 0], k[0, 0, 1, 0] = 0.05, -0.05
    v = torch.full((1, 1, M, D), 4096.0)
    v[0, 0, 1] = -4096.0
    k, v = k.half().requires_grad_(), v.half().requires_grad_()
    (dq,) = torch.autograd.grad(kern(q, k, v), [q], torch.ones(1, 1, N, D).half())
    rq = q.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(kern.reference(rq, k.double(), v.double())[0], [rq], torch.ones(1, 1, N, D).double())
    assert torch.isfinite(dq).all()
    assert torch.allclose(dq.double(), ref, rtol=2e-3, atol=1.0)  # |dq| ~ 1638


def test_gpu_tile_overrides_beyond_the_template_are_clear_errors() -> None:
    for tiles in ((64, 128), (128, 64), (64, 256)):
        with pytest.raises(AttnccError, match=r"override on a GPU target takes Br and Bc in 16, 32, 48 or 64"):
            attncc.compile(ROOT / "examples" / "causal.attn", target="sm80", emulate=True, tiles=tiles)


def test_fp32_beyond_fp16_range_on_turing_is_an_input_error() -> None:
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm75", emulate=True)
    q = torch.randn(1, 1, 8, 16)
    v = q * 1e5
    with pytest.raises(InputError, match=r"v: holds .* beyond float16's range"):
        kern(q, q, v)
