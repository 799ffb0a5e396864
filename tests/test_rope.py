"""Rotary position embeddings in the DSL (`q = rope(q, theta=10000)`), against float64 code
written here from the papers' formulas: half-split pairs as transformers' `rotate_half`
(x cos + rotate_half(x) sin with the angles repeated), interleaved pairs as complex
multiplication (Meta's original `view_as_complex` form); partial rotary dims, bottom-right
query positions, per-sequence offsets from an input; padded, packed and paged calls; the CUDA
kernels on the emulator; DSL mistakes.
"""

from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.errors import DslError, InputError
from attncc.runtime.check import _error
from attncc.runtime.nvcc import compile_cuda
from tests.test_cuda import HAVE_NVCC
from tests.test_independent_references import BWD_TOL, FWD_TOL

ROPE_PROGRAM = """attention rope_{name}
input start: int[B]
q = rope(q, {q_args})
k = rope(k, {k_args})
s = q @ k.T * scale
mask j <= i + (M - N)
p = softmax(s)
o = p @ v
output o
"""


def program(name: str, q_args: str, k_args: str) -> str:
    return ROPE_PROGRAM.format(name=name, q_args=q_args, k_args=k_args)


def angles(positions: torch.Tensor, dims: int, theta: float) -> torch.Tensor:
    """[..., dims / 2] angles position * theta^(-2p / dims)."""
    inv = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64) / dims)
    return positions.double().unsqueeze(-1) * inv


def rotate_half_style(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb: x cos + rotate_half(x) sin, angles repeated."""
    emb = torch.cat([angle, angle], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def complex_style(x: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Meta's original: adjacent pairs as complex numbers times e^(i angle)."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)).flatten(-2)


def reference(q, k, v, start, *, theta, dims, first, interleaved, q_offset_by_start):
    """Bottom-right causal attention of q [B, H, N, D] over k, v after rope on dims first ..
    first + dims - 1; q's positions i + (M - N) (+ start[b] when q_offset_by_start), k's j + start[b]."""
    _, H, N, D = q.shape
    M = k.shape[2]
    style = complex_style if interleaved else rotate_half_style
    q_pos = torch.arange(N).view(1, -1) + (M - N) + (start.view(-1, 1) if q_offset_by_start else 0)
    k_pos = torch.arange(M).view(1, -1) + start.view(-1, 1)

    def turned(x, pos):
        part = style(x[..., first : first + dims], angles(pos, dims, theta).unsqueeze(1))
        return torch.cat([x[..., :first], part, x[..., first + dims :]], dim=-1)

    qr, kr = turned(q, q_pos), turned(k, k_pos)
    kr, vr = (t.repeat_interleave(H // k.shape[1], dim=1) for t in (kr, v))
    s = qr @ kr.transpose(-1, -2) / math.sqrt(D)
    visible = torch.arange(M).view(1, -1) <= torch.arange(N).view(-1, 1) + (M - N)
    s = s.masked_fill(~visible, -math.inf)
    return torch.softmax(s, -1) @ vr, torch.logsumexp(s, -1)


#: (label, q's arguments, k's arguments, reference options): half-split and interleaved, whole
#: and partial rotary dims, large theta, q's positions with and without the per-sequence start.
CASES = [
    ("half", "theta=10000, position=i + (M - N) + start[b]", "theta=10000, position=j + start[b]",
     dict(theta=10000.0, dims=40, first=0, interleaved=False, q_offset_by_start=True)),
    ("interleaved", "theta=500000, interleaved=1, position=i + (M - N) + start[b]",
     "theta=500000, interleaved=1, position=j + start[b]",
     dict(theta=500000.0, dims=40, first=0, interleaved=True, q_offset_by_start=True)),
    ("partial", "theta=1000, dims=16, first=8, position=i + (M - N)", "theta=1000, dims=16, first=8, position=j + start[b]",
     dict(theta=1000.0, dims=16, first=8, interleaved=False, q_offset_by_start=False)),
]  # fmt: skip


def leaves(B=2, H=4, Hkv=2, N=37, M=70, D=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=gen).requires_grad_()
    k = torch.randn(B, Hkv, M, D, generator=gen).requires_grad_()
    v = torch.randn(B, Hkv, M, D, generator=gen).requires_grad_()
    return q, k, v, torch.randn(B, H, N, D, generator=gen)


@pytest.mark.parametrize(("label", "q_args", "k_args", "options"), CASES, ids=[c[0] for c in CASES])
def test_forward_and_backward_against_the_formulas(label, q_args, k_args, options) -> None:
    kern = attncc.compile(program(label, q_args, k_args))
    q, k, v, dout = leaves()
    start = torch.tensor([3, 1000])
    out, lse = kern(q, k, v, return_lse=True, start=start)
    got = [out, lse, *torch.autograd.grad(out, (q, k, v), dout)]
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*exact, start, **options)
    want = [ref_out, ref_lse, *torch.autograd.grad(ref_out, exact, dout.double())]
    for name, g, w, tol in zip(("out", "lse", "dq", "dk", "dv"), got, want, (FWD_TOL, FWD_TOL, *[BWD_TOL] * 3)):
        assert _error(g, w) <= tol, f"{name}: {_error(g, w):.2e}"
    # `Kernel.reference` (what `attncc check` compares with) rotates as the formulas do too (a
    # review's mutants of runtime/rope.py's halves, sign and pairing passed every test)
    with torch.no_grad():
        ref_out, ref_lse = kern.reference(q, k, v, start=start)
    assert _error(ref_out, want[0]) <= FWD_TOL and _error(ref_lse, want[1]) <= FWD_TOL
    # the rotation takes effect: without it (theta huge: every angle ~0) the result differs
    plain = attncc.compile(program(label + "_flat", "theta=1e300, position=i", "theta=1e300, position=j"))
    assert (plain(q, k, v, start=start) - out).abs().max() > 100 * FWD_TOL


@pytest.mark.parametrize(
    ("dtype", "backward", "N"),
    [
        (torch.float32, "fused", 37),
        (torch.float32, "two-pass", 3),
        (torch.bfloat16, "auto", 37),
        (torch.bfloat16, "auto", 1),
    ],
)
def test_cpu_kernels_rotate_as_they_load(dtype, backward, N, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU kernels rotate q's and k's rows as they load them (no rotation in torch: the
    host's is made to fail here) and turn dQ and dK back as they store them: both backward
    schedules, decoding rows (N = 1, 3: K read row by row), bf16 on this machine's level."""
    from attncc.runtime import rope

    def no_host_rotation(*args: object) -> None:
        raise AssertionError("q or k was rotated in torch")

    monkeypatch.setattr(rope, "rotate", no_host_rotation)
    label, q_args, k_args, options = CASES[1]
    kern = attncc.compile(program(label, q_args, k_args))
    kern.backward = backward
    exact = dtype == torch.float32
    check_against_reference(
        kern, options, dtype, (FWD_TOL, BWD_TOL, FWD_TOL) if exact else (2e-2, 5e-2, 1e-2), N=N, M=300
    )


def check_against_reference(kern, options, dtype, limits, **shape) -> None:
    """out, dq, dk, dv (within limits[0], [1]) and lse (limits[2]) of `kern` in `dtype` against
    the float64 formulas on `leaves(**shape)` with starts 3 and 1000."""
    q, k, v, dout = leaves(**shape)
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    start = torch.tensor([3, 1000])
    out, lse = kern(q, k, v, return_lse=True, start=start)
    got = [out, *torch.autograd.grad(out, (q, k, v), dout.to(dtype))]
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference(*exact, start, **options)
    want = [ref_out, *torch.autograd.grad(ref_out, exact, dout.to(dtype).double())]
    assert _error(lse, ref_lse) <= limits[2]
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _error(g, w) <= (limits[0] if name == "out" else limits[1]), f"{name}: {_error(g, w):.2e}"


def test_gradcheck_through_the_rotation() -> None:
    kern = attncc.compile(
        program("tiny", "theta=10000, interleaved=1, position=i + start[b]", "theta=10000, interleaved=1")
    )
    q, k, v = (torch.randn(1, 2, n, 6, dtype=torch.float64, requires_grad=True) for n in (3, 5, 5))
    start = torch.tensor([2])
    assert torch.autograd.gradcheck(lambda q, k, v: kern(q, k, v, start=start), (q, k, v))


@pytest.mark.parametrize(
    ("target", "dtype", "deterministic", "case"),
    [
        ("sm80", torch.bfloat16, False, 0),
        ("sm80", torch.bfloat16, True, 1),
        ("sm75", torch.float16, False, 1),
        ("sm75", torch.float16, True, 0),
    ],
)
def test_cuda_kernels_rotate_in_shared_memory(
    target, dtype, deterministic, case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CUDA kernels (on the emulator) rotate the Q and K tiles in shared memory once they
    land, in the forward and in both backward kernels, and turn dK, the dQ kernel's rows and
    the atomics' fp32 dQ back (no rotation in torch: the host's is made to fail here)."""
    from attncc.runtime import rope

    def no_host_rotation(*args: object) -> None:
        raise AssertionError("q or k was rotated in torch")

    monkeypatch.setattr(rope, "rotate", no_host_rotation)
    label, q_args, k_args, options = CASES[case]
    kern = attncc.compile(program(label, q_args, k_args), target=target, emulate=True)
    kern.deterministic = deterministic
    check_against_reference(kern, options, dtype, (5e-2, 5e-2, 1e-2))


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
@pytest.mark.parametrize("arch", ["sm80", "sm90"])
def test_rope_kernels_compile_without_spills(arch: str) -> None:
    """ptxas of the rope kernels (both operands rotated, bottom-right causal, an int input in
    the positions) at d = 64 and 128: no spills, no stack."""
    label, q_args, k_args, _ = CASES[0]
    kern = attncc.compile(program(label, q_args, k_args), target=arch, emulate=True)
    for head_dim in (64, 128):
        report = compile_cuda(kern.cuda_source("bfloat16", head_dim), arch)
        assert report.spill_stores == 0 and report.spill_loads == 0 and report.stack_bytes == 0, report.describe()


@pytest.mark.parametrize("backend", ["cpu", "sm80"])
def test_varlen_rotates_each_sequence_from_its_own_positions(backend: str) -> None:
    """Packed sequences (lengths 37, 1, 0, 20 queries): each is its padded call's result."""
    label, q_args, k_args, _ = CASES[1]
    kern = (
        attncc.compile(program(label, q_args, k_args))
        if backend == "cpu"
        else attncc.compile(program(label, q_args, k_args), target=backend, emulate=True)
    )
    lens_q, lens_k = [37, 1, 0, 20], [70, 1, 3, 20]
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(sum(lens_q), 4, 40, generator=gen).requires_grad_()
    k, v = (torch.randn(sum(lens_k), 2, 40, generator=gen).requires_grad_() for _ in range(2))
    start = torch.tensor([5, 9, 2, 7])
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) for lens in (lens_q, lens_k))
    # (the emulated kernels run bf16 tensor cores: a packed and a padded call may round apart)
    fwd_tol, bwd_tol = (FWD_TOL, BWD_TOL) if backend == "cpu" else (2e-2, 5e-2)
    out = kern.varlen(q, k, v, cu_q, cu_k, start=start)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    for b, n in enumerate(lens_q):
        if n == 0:
            continue
        rows = [
            t[c[b] : c[b + 1]].transpose(0, 1).unsqueeze(0).detach().requires_grad_()
            for t, c in ((q, cu_q), (k, cu_k), (v, cu_k))
        ]
        want = kern(*rows, start=start[b : b + 1])
        assert _error(out[cu_q[b] : cu_q[b + 1]].transpose(0, 1), want[0]) <= fwd_tol, b
        grads = torch.autograd.grad(want.sum(), rows)
        for got, c, w in zip((dq, dk, dv), (cu_q, cu_k, cu_k), grads):
            assert _error(got[c[b] : c[b + 1]].transpose(0, 1), w[0]) <= bwd_tol, b


@pytest.mark.parametrize("backend", ["cpu", "sm80"])
def test_paged_decoding_rotates_the_queries_at_their_positions(backend: str) -> None:
    """The cache holds keys rotated when they were written (as transformers caches them); the
    program rotates q alone, at positions cache_seqlens + appended - N + i."""
    text = (
        "attention rope_q\nq = rope(q, theta=10000, position=i + (M - N))\ns = q @ k.T * scale\n"
        "mask j <= i + (M - N)\np = softmax(s)\no = p @ v\noutput o\n"
    )
    kern = attncc.compile(text) if backend == "cpu" else attncc.compile(text, target=backend, emulate=True)
    tol = FWD_TOL if backend == "cpu" else 2e-2
    gen = torch.Generator().manual_seed(6)
    B, H, Hkv, D, page, held = 2, 4, 2, 32, 16, [40, 9]
    k_cache, v_cache = (torch.randn(8, page, Hkv, D, generator=gen) for _ in range(2))
    table = torch.randperm(8, generator=gen)[:6].view(B, 3).int()
    q = torch.randn(B, 1, H, D, generator=gen)
    with torch.no_grad():
        out = kern.paged(q, k_cache, v_cache, table, torch.tensor(held))
    for b in range(B):
        k = k_cache[table[b].long()].flatten(0, 1)[: held[b]].transpose(0, 1).double()
        v = v_cache[table[b].long()].flatten(0, 1)[: held[b]].transpose(0, 1).double()
        qb = rotate_half_style(q[b].transpose(0, 1).double(), angles(torch.tensor([held[b] - 1]), D, 10000.0))
        s = qb @ k.repeat_interleave(2, 0).transpose(1, 2) / math.sqrt(D)
        want = torch.softmax(s, -1) @ v.repeat_interleave(2, 0)
        assert _error(out[b].transpose(0, 1), want) <= tol, b
    with pytest.raises(InputError, match="paged calls read the cache's keys as they were written"):
        attncc.compile(program("k_too", "theta=10000", "theta=10000")).paged(
            q, k_cache, v_cache, table, torch.tensor(held), start=torch.tensor([0, 0])
        )


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_kernels_tables_live_on_the_operands_device(case: int) -> None:
    """The tables are kernel operands: on an H200 (session 23) they were built on the CPU, so a
    position reading start[b] on the GPU stopped, and one reading none would have handed a GPU
    kernel host pointers. The meta device stands in for a GPU here."""
    label, q_args, k_args, _ = CASES[case]
    kern = attncc.compile(program(label, q_args, k_args))
    q, k = torch.empty(2, 4, 5, 40, device="meta"), torch.empty(2, 2, 9, 40, device="meta")
    tables, _ = kern.rope_buffers(q, k, [torch.zeros(2, dtype=torch.int64, device="meta")], [])
    assert sorted(tables) == ["k_cos", "k_sin", "q_cos", "q_sin"]
    assert all(table.device == q.device for table in tables.values())


def test_rotated_dims_beyond_the_head_dim_are_named() -> None:
    kern = attncc.compile(program("wide", "dims=48", "dims=48"))
    q, k, v, _ = leaves()
    with pytest.raises(InputError, match=r"q: rope\(q\) rotates head dims 0\.\.47, which head dim D=40 does not hold"):
        kern(q, k, v, start=torch.tensor([0, 0]))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("v = rope(v, theta=10000)", "`v` is reserved or an input and cannot be assigned"),
        ("q = rope(k, theta=10000)", "`q = rope(q, ...)` rotates q itself"),
        ("q = rope(q, theta=0.5)", "rope's theta must be a finite number above 1"),
        ("q = rope(q, dims=7)", "rope's dims must be a positive even number"),
        ("q = rope(q, interleaved=2)", "rope's interleaved is 0"),
        ("q = rope(q, position=j)", "rope's position of q's rows may use b, i, the sizes and inputs, not j"),
        (
            "k = rope(k, position=j * scale)",
            "rope's position of k's rows may use b, j, the sizes and inputs, not scale",
        ),
        ("q = rope(q, base=10)", "`rope` has no keyword argument `base`"),
        ("q = rope(q, theta=start[b])", "rope's theta must be a constant number"),
        ("q = rope(q, position=i + shift[b])", "rope's position reads the float input `shift`"),
        # (a rope elsewhere read as an unknown function, or "no keyword argument `theta`": session 67)
        ("r = rope(q, theta=10000)", "`rope` rotates q or k as a statement of its own: `q = rope(q, ...)`"),
        ("t = 2 * rope(k)", "`rope` rotates q or k as a statement of its own"),
    ],
)
def test_dsl_mistakes_point_at_the_call(line: str, message: str) -> None:
    text = f"attention bad\ninput start: int[B]\ninput shift: float[B]\n{line}\ns = q @ k.T * scale\np = softmax(s)\no = p @ v\noutput o\n"
    with pytest.raises(DslError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")) as error:
        attncc.compile(text)
    assert ":4:" in str(error.value)  # file:line:column of the statement


def test_rope_twice_or_after_the_scores_is_an_error() -> None:
    twice = "attention bad\nq = rope(q)\nq = rope(q)\ns = q @ k.T\np = softmax(s)\no = p @ v\noutput o\n"
    with pytest.raises(DslError, match="rotated once"):
        attncc.compile(twice)
    late = "attention bad\ns = q @ k.T\nq = rope(q)\np = softmax(s)\no = p @ v\noutput o\n"
    with pytest.raises(DslError, match="must come before the scores"):
        attncc.compile(late)


def test_explain_shows_the_rotation() -> None:
    stages = attncc.lower(program("shown", "theta=10000, position=i + (M - N)", "theta=10000, interleaved=1"))
    text = stages[-1].graph.nodes
    described = " ".join(d["op"].describe() for _, d in text(data=True))
    assert "rope q theta=10000 dims 0..D half-split position=i + (M - N)" in described
    assert "rope k theta=10000 dims 0..D interleaved position=j" in described
