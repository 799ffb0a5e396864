"""v with a head dim of its own (Dv != D; DeepSeek's unabsorbed MLA prefill: q, k [.., 192], v
[.., 128]): q [B, H, N, D], k [B, Hkv, M, D], v [B, Hkv, M, Dv], out [B, H, N, Dv].

Every example, forward and backward, against the hand-written float64 references of
test_independent_references.py (which take the head dims from the tensors: scores scaled by
1/sqrt(D) of q, p @ v of any width), with Dv below and above D; the CUDA kernels on the
emulator (both head dims compile-time constants); packed and paged calls; bad shapes.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import attncc
from attncc.errors import InputError
from attncc.runtime.check import _error, check
from attncc.runtime.inputs import Shape, adapt
from attncc.runtime.nvcc import compile_cuda
from tests.conftest import EXAMPLES, ROOT, kernel
from tests.test_cuda import HAVE_NVCC
from tests.test_independent_references import (
    CASES,
    FWD_TOL,
    Case,
    Inputs,
    assert_within,
    draw,
    learnable,
    run_kernel,
    run_reference,
    tolerance,
)
from tests.test_serving import (
    BOTTOM_RIGHT_CAUSAL,
    four_sequences,
    grads_of,
    offsets,
    packed_leaves,
    packed_lengths,
    packed_reference,
)

#: v's head dim from the case's D: narrower (not a multiple of 16 or of the case's D) and wider.
VALUE_DIMS = {"narrower": lambda d: 24, "wider": lambda d: d + 40}


@pytest.mark.parametrize("width", VALUE_DIMS)
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_with_its_own_value_head_dim(name: str, width: str) -> None:
    """Forward (out [.., Dv], lse) and backward (dq, dk [.., D], dv [.., Dv], learnable inputs)."""
    case = CASES[name]
    case = replace(case, shape=replace(case.shape, Dv=VALUE_DIMS[width](case.shape.D)))
    q, k, v, dout = draw(case)
    inputs = runtime_inputs_of(case)
    got = run_kernel(kernel(name), case, q, k, v, inputs, dout)
    assert got["out"].shape == (*q.shape[:3], case.shape.Dv)
    assert got["dv"].shape == v.shape and got["dk"].shape == k.shape
    ref = run_reference(case.reference, q, k, v, inputs, dout)
    assert_within(got, ref, {n: tolerance(n) for n in ref})


def runtime_inputs_of(case: Case) -> Inputs:
    return case.inputs(torch.Generator().manual_seed(1000), case.shape)


#: Odd head dims on both sides of each other, dims that round to one kernel width (60 and 64:
#: not the library of equal dims, whose kernels read one bound for both), decoding (split-KV
#: on the GPU kernels) and the 192/128 of MLA prefill.
EMULATED_SHAPES = (
    Shape(2, 4, 2, 77, 130, 48, Dv=24),
    Shape(1, 2, 1, 40, 33, 24, Dv=72),
    Shape(1, 2, 1, 20, 45, 64, Dv=60),
    Shape(1, 2, 2, 3, 300, 192, Dv=128),
    Shape(1, 2, 1, 50, 70, 64, Dv=256),
)


@pytest.mark.parametrize(("target", "dtype"), [("sm80", torch.bfloat16), ("sm75", torch.float16)])
@pytest.mark.parametrize("name", ["alibi", "gpt2", "document"])
def test_cuda_kernels_on_the_emulator(name: str, target: str, dtype: torch.dtype) -> None:
    """The CUDA forward, backward (atomic dQ) and deterministic backward (dQ kernel, exact
    learnable-input sums) with kHeadDim != kValueDim, and split-KV's merge of Dv-wide partials,
    against float64 eager within the dtype's eager error."""
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target=target, emulate=True)
    for shape in EMULATED_SHAPES:
        for deterministic in (False, True):
            kern.deterministic = deterministic
            kern.kv_splits = None if deterministic else 3
            result = check(kern, adapt(shape, kern), dtype)
            assert result.ok, f"deterministic={deterministic}: {result.describe()}"


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_mla_prefill_kernels_compile_without_spills(arch: str) -> None:
    """nvcc's ptxas for D = 192, Dv = 128 (a score map with a learnable input: the heaviest
    forward): every kernel within the register file, no spills, no stack."""
    kern = attncc.compile(ROOT / "examples" / "alibi.attn", target=arch, emulate=True)
    report = compile_cuda(kern.cuda_source("bfloat16", 192, 128), arch)
    assert report.spill_stores == 0 and report.spill_loads == 0 and report.stack_bytes == 0, report.describe()


@pytest.mark.parametrize(("backend", "name"), [("cpu", "alibi"), ("sm80-emulated", "document")])
def test_varlen_with_its_own_value_head_dim(backend: str, name: str) -> None:
    """A packed batch of ragged sequences (0 and 1 queries included), v and out 56 wide, q and
    k 40: forward, lse and every gradient against the float64 reference per sequence (for the
    bf16 tensor cores, inputs that bf16 holds exactly)."""
    case = CASES[name]
    shape = replace(case.shape, D=40, Dv=56)
    lens_q, lens_k = packed_lengths(shape)
    q, k, v, dout = packed_leaves(shape, lens_q, lens_k)
    if backend != "cpu":
        q, k, v = (t.detach().bfloat16().float().requires_grad_() for t in (q, k, v))
        dout = dout.bfloat16().float()
    inputs = four_sequences(case.inputs(torch.Generator().manual_seed(1000), replace(shape, B=4)))
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in learnable(inputs)]
    kern = (
        kernel(name) if backend == "cpu" else attncc.compile(ROOT / "examples" / f"{name}.attn", "sm80", emulate=True)
    )
    out, lse = kern.varlen(q, k, v, offsets(lens_q), offsets(lens_k), return_lse=True, **inputs)
    assert out.shape == (sum(lens_q), shape.H, 56)
    got = grads_of(out, lse, [q, k, v, *(inputs[n] for n in learnable(inputs))], names, dout)
    ref = packed_reference(case.reference, q, k, v, inputs, names, dout, lens_q, lens_k)
    if backend == "cpu":
        # a learnable input's gradient sums every score of its heads: alibi's per-head slope
        # gradients here are -205, 435, 1.6 and -1037, each with ~4e-4 of fp32 rounding (the
        # summands are of the large heads' size), so the head whose sum cancels to 1.6 gets 5x
        # the relative limit of dq, dk, dv
        limits = {n: tolerance(n) * (5 if n in names[3:] else 1) for n in ref}
    else:  # bf16 tensor cores (P and dS rounded to bf16): within a few bf16 steps
        limits = {n: 2e-5 if n == "lse" else 3e-2 for n in ref}
    assert_within(got, ref, limits)


@pytest.mark.parametrize(("backend", "page_size", "queries"), [("cpu", 16, 1), ("cpu", 32, 5), ("sm80-emulated", 5, 3)])
def test_paged_cache_with_its_own_value_head_dim(backend: str, page_size: int, queries: int) -> None:
    """Decoding and chunked prefill over a paged cache whose V pages are narrower than its K
    pages (D = 72, Dv = 40), pages shuffled, new k/v appended in place, GQA 6/2, bottom-right
    causal: out [B, N, H, Dv] against float64 code per sequence."""
    gen = torch.Generator().manual_seed(5)
    B, H, Hkv, D, Dv, held = 3, 6, 2, 72, 40, [130, 0, 47]
    pages_per_seq = -(-(max(held) + queries) // page_size)
    num_pages = B * pages_per_seq + 2
    k_cache = torch.randn(num_pages, page_size, Hkv, D, generator=gen)
    v_cache = torch.randn(num_pages, page_size, Hkv, Dv, generator=gen)
    table = torch.randperm(num_pages, generator=gen)[: B * pages_per_seq].view(B, pages_per_seq).int()
    q = torch.randn(B, queries, H, D, generator=gen)
    k_new, v_new = torch.randn(B, queries, Hkv, D, generator=gen), torch.randn(B, queries, Hkv, Dv, generator=gen)
    before = k_cache.clone(), v_cache.clone()
    kern = (
        attncc.compile(BOTTOM_RIGHT_CAUSAL)
        if backend == "cpu"
        else attncc.compile(BOTTOM_RIGHT_CAUSAL, target="sm80", emulate=True)
    )
    tol = FWD_TOL if backend == "cpu" else 2e-2
    if backend != "cpu":
        q, k_new, v_new = (t.bfloat16() for t in (q, k_new, v_new))
        k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
        before = k_cache.clone(), v_cache.clone()
    out, lse = kern.paged(q, k_cache, v_cache, table, torch.tensor(held), k_new=k_new, v_new=v_new, return_lse=True)
    assert out.shape == (B, queries, H, Dv)
    for b in range(B):
        m = held[b] + queries
        cached = [c[table[b].long()].flatten(0, 1)[: held[b]] for c in before]
        k, v = (torch.cat([c, new[b]]).transpose(0, 1).double() for c, new in zip(cached, (k_new, v_new)))
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        s = q[b].transpose(0, 1).double() @ k.transpose(1, 2) / math.sqrt(D)
        visible = torch.arange(m).view(1, -1) <= torch.arange(queries).view(-1, 1) + (m - queries)
        s = s.masked_fill(~visible, -math.inf)
        assert _error(out[b].transpose(0, 1), torch.softmax(s, -1) @ v) <= tol, b
        assert _error(lse[b].transpose(0, 1), torch.logsumexp(s, -1)) <= FWD_TOL, b
        written = table[b].long()[(held[b] + torch.arange(queries)) // page_size]
        assert torch.equal(v_cache[written, (held[b] + torch.arange(queries)) % page_size], v_new[b])


def test_under_torch_compile_fullgraph() -> None:
    """The op's fake implementation gives out v's head dim, so a compiled graph takes the call."""
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 4, 33, 48, generator=gen).requires_grad_() for _ in range(2))
    v = torch.randn(1, 4, 33, 16, generator=gen).requires_grad_()
    kern = kernel("causal")
    compiled = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True)
    out = compiled(q, k, v)
    eager = kern(q, k, v)
    assert out.shape == (1, 4, 33, 16)
    torch.testing.assert_close(out, eager)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


@pytest.mark.parametrize(
    ("v_shape", "message"),
    [
        ((2, 2, 30, 0), "v: head dim Dv=0 must be in [1, 576] on target cpu"),
        ((2, 2, 30, 577), "v: head dim Dv=577 must be in [1, 576] on target cpu"),
        ((2, 2, 31, 16), "v: expected shape [2, 2, 30, Dv] (that of k but the head dim), got (2, 2, 31, 16)"),
        ((2, 1, 30, 16), "v: expected shape [2, 2, 30, Dv] (that of k but the head dim), got (2, 1, 30, 16)"),
    ],
)
def test_bad_value_shapes_are_named(v_shape: tuple[int, ...], message: str) -> None:
    q, k = torch.randn(2, 4, 20, 32), torch.randn(2, 2, 30, 32)
    with pytest.raises(InputError) as error:
        kernel("vanilla")(q, k, torch.randn(v_shape))
    assert str(error.value) == message


def test_bad_paged_value_shapes_are_named() -> None:
    q, k_cache = torch.randn(2, 1, 4, 32), torch.randn(6, 16, 2, 32)
    table, lengths = torch.arange(6).view(2, 3).int(), torch.tensor([20, 7])
    kern = attncc.compile(BOTTOM_RIGHT_CAUSAL)
    with pytest.raises(InputError, match=r"v_cache: expected shape \[6, 16, 2, Dv\]"):
        kern.paged(q, k_cache, torch.randn(6, 16, 1, 24), table, lengths)
    v_cache = torch.randn(6, 16, 2, 24)
    with pytest.raises(InputError, match=r"Hkv=2, Dv=24\], got \(2, 1, 2, 32\) and \(2, 1, 2, 32\)"):
        kern.paged(q, k_cache, v_cache, table, lengths, k_new=torch.randn(2, 1, 2, 32), v_new=torch.randn(2, 1, 2, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N", [1, 3, 37])
def test_absorbed_mla_head_dims_on_the_cpu(N: int, dtype: torch.dtype) -> None:
    """DeepSeek's absorbed multi-head latent attention: q and k 576 wide (512 latent + 64
    rotary), v the 512-wide latent, one kv head for 16 query heads; decoding (N = 1, 3: rows
    read one by one) and a bottom-right causal chunk, forward and backward, against float64."""
    gen = torch.Generator().manual_seed(9)
    B, H, M, D, Dv = 2, 16, 300, 576, 512
    q = (torch.randn(B, H, N, D, generator=gen) * 0.5).to(dtype).requires_grad_()
    k = torch.randn(B, 1, M, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, 1, M, Dv, generator=gen).to(dtype).requires_grad_()
    dout = torch.randn(B, H, N, Dv, generator=gen).to(dtype)
    out, lse = attncc.compile(BOTTOM_RIGHT_CAUSAL)(q, k, v, return_lse=True)
    got = [out, lse, *torch.autograd.grad(out, (q, k, v), dout)]
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = exact[0] @ exact[1].transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(torch.arange(M).view(1, -1) > torch.arange(N).view(-1, 1) + (M - N), -math.inf)
    ref = torch.softmax(s, -1) @ exact[2]
    want = [ref, torch.logsumexp(s, -1), *torch.autograd.grad(ref, exact, dout.double())]
    limits = (FWD_TOL, FWD_TOL, 2e-4, 2e-4, 2e-4) if dtype == torch.float32 else (2e-2, 2e-4, 5e-2, 5e-2, 5e-2)
    for name, g, w, limit in zip(("out", "lse", "dq", "dk", "dv"), got, want, limits):
        assert _error(g, w) <= limit, f"{name}: {_error(g, w):.2e}"


def test_head_dims_beyond_the_cuda_kernels_are_named() -> None:
    """The CUDA kernels take head dims up to 256: 576 is refused naming the target."""
    kern = attncc.compile(ROOT / "examples" / "causal.attn", target="sm80", emulate=True)
    q, k, v = torch.randn(1, 2, 1, 576), torch.randn(1, 1, 9, 576), torch.randn(1, 1, 9, 512)
    with pytest.raises(InputError, match=r"q: head dim D=576 must be in \[1, 256\] on target sm80"):
        kern(q, k, v)
