"""Golden tests on a real GPU (run wherever torch sees one; skipped on CPU-only machines)."""

from __future__ import annotations

import pytest
import torch

import attncc
from attncc.runtime.check import check
from attncc.runtime.inputs import Shape, adapt
from tests.conftest import EXAMPLES, ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_forward_backward_match_fp64(name: str, dtype: torch.dtype) -> None:
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="cuda")
    for shape in (Shape(2, 4, 2, 77, 130, 64), Shape(1, 2, 1, 257, 300, 128), Shape(1, 1, 1, 1, 1, 256)):
        result = check(kern, adapt(shape, kern), dtype, device="cuda")
        assert result.ok, result.describe()


def test_gpu_dropout_bits_equal_the_cpu_mask() -> None:
    kern = attncc.compile(ROOT / "examples" / "gpt2.attn", target="cuda")
    N = 64
    q, k = torch.randn(1, 2, N, 64, device="cuda").half(), torch.randn(1, 2, N, 64, device="cuda").half()
    v = torch.eye(N, 64, device="cuda").expand(1, 2, N, 64).contiguous().half()
    keep = attncc.dropout_mask(77, 0, 1, 2, N, N, 0.1)
    probs = kern(q, k, v, seed=77).cpu()
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert torch.equal(probs[..., causal] != 0, keep[..., causal])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernel_runs_on_the_device_of_its_inputs() -> None:
    kern = attncc.compile(ROOT / "examples" / "alibi.attn", target="cuda")
    q = torch.randn(1, 2, 40, 64, device="cuda:1", dtype=torch.float16, requires_grad=True)
    slopes = torch.rand(2, device="cuda:1")
    with torch.cuda.device(0):  # the current device is another one
        out = kern(q, q, q, slopes=slopes)
        out.sum().backward()
    expected, _ = kern.reference(q.detach().cpu(), q.detach().cpu(), q.detach().cpu(), slopes=slopes.cpu())
    assert out.device == q.grad.device == torch.device("cuda:1")
    assert torch.allclose(out.cpu().double(), expected, atol=2e-2)
    with pytest.raises(
        attncc.InputError, match=r"slopes: expected a tensor on cuda:1 \(that of q\), got device cuda:0"
    ):
        kern(q, q, q, slopes=slopes.to("cuda:0"))


def test_gpu_deterministic_mode_gives_the_same_bits_every_run() -> None:
    """dq by its own kernel and learnable-input gradients as exact fixed-point sums: repeated
    runs give identical bits (the float atomics of the default mode need not)."""
    kern = attncc.compile(ROOT / "examples" / "relative_bias.attn", target="cuda")
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bias = torch.randn(4, 257, device="cuda", requires_grad=True)
    kern.deterministic = True
    try:
        runs = []
        for _ in range(3):
            out = kern(q, k, v, bias=bias)
            runs.append(torch.autograd.grad(out, [q, k, v, bias], torch.ones_like(out)))
        result = check(kern, Shape(1, 2, 1, 100, 120, 64), torch.bfloat16, device="cuda")  # and still exact
    finally:
        kern.deterministic = False
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    assert result.ok, result.describe()
