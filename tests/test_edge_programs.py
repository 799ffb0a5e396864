"""Programs and inputs at the edges of the language: names that could alias compiler names,
integers near int64's limits, divisors that can be 0, bool inputs given as ints, NaN in mask
inputs, file names in generated text, programs too large to compose. Each either runs and
matches float64 eager code written by hand, or fails with a clear error."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import attncc
from attncc.errors import DslError, InputError
from tests.conftest import ROOT

TAIL = "p = softmax(s)\no = p @ v\noutput o\n"


def program(body: str, name: str = "edge") -> str:
    return f"attention {name}\n{body}" + TAIL


def qkv(N: int = 40, M: int = 40, D: int = 16, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, 2, n, D, generator=gen, dtype=torch.float64) for n in (N, M, M))


def masked_attention(q, k, v, keep: torch.Tensor) -> torch.Tensor:
    """float64 eager attention keeping scores where `keep` ([N, M] or broadcastable) holds."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0)
    return p @ v


def test_an_input_named_like_the_score_is_an_error() -> None:
    with pytest.raises(DslError, match="cannot be named `s`"):
        attncc.compile("attention a\ninput s: float\nsc = q @ k.T * scale\np = softmax(sc)\no = p @ v\noutput o\n")


def test_compiler_names_cannot_be_declared_and_user_names_cannot_meet_them() -> None:
    with pytest.raises(DslError, match="names starting with `__` are reserved"):
        attncc.compile(program("input __layout0: bool[N, M]\ns = q @ k.T * scale\n"))
    kern = attncc.compile(
        program(
            "input g_layout0: bool[N, M]\ns = q @ k.T * scale\nmask g_layout0[i, j]\nlayout local(block=16, width=1)\n"
        )
    )
    q, k, v = qkv()
    keep = torch.rand(40, 40, generator=torch.Generator().manual_seed(1)) > 0.3
    out = kern(q, k, v, g_layout0=keep)
    tiles = (torch.arange(40)[:, None] // 16 - torch.arange(40)[None, :] // 16).abs() <= 1
    assert torch.allclose(out, masked_attention(q, k, v, keep & tiles), atol=1e-12)


def test_integers_beyond_int64_are_errors() -> None:
    with pytest.raises(DslError, match="out of range"):
        attncc.compile(program("s = q @ k.T * scale\nmask i < 18446744073709551616 + j\n"))
    with pytest.raises(DslError, match="positive integer constant"):
        attncc.compile(program("s = q @ k.T * scale\nlayout local(block=9999999999999, width=1)\n"))
    kern = attncc.compile(program("input n: int\ns = q @ k.T * scale\nmask j < n and j <= i\n"))
    with pytest.raises(InputError, match=r"n: .* beyond 2\^53"):
        kern(*qkv(), n=10**30)


def test_index_arithmetic_that_can_overflow_is_not_trusted() -> None:
    kern = attncc.compile(
        program(
            "input t: float[1]\ns = q @ k.T * scale\n"
            "s = s + t[((i + 9223372036854775807) - 9223372036854775807) * 100000000]\n"
        )
    )
    with pytest.raises(InputError, match=r"t\[.*ranges over \[-inf, inf\]"):
        kern(*qkv(), t=torch.tensor([0.5]))
    # a mask whose int64 product wraps: evaluated per score, as the reference does (int64)
    wrap = attncc.compile(program("s = q @ k.T * scale\nmask i * 4611686018427387904 >= 0\n"))
    q, k, v = qkv()
    out, ref = wrap(q, k, v), wrap.reference(q, k, v)[0]
    assert torch.allclose(out, ref, atol=1e-12)
    keep = (torch.arange(40) * 4611686018427387904 >= 0)[:, None].expand(40, 40)  # int64 wraps for odd i
    assert torch.allclose(out, masked_attention(q, k, v, keep), atol=1e-12)


def test_integer_division_by_a_divisor_that_can_be_zero_is_an_input_error() -> None:
    kern = attncc.compile(program("input n: int\ns = q @ k.T * scale\ns = s + i // n\n"))
    with pytest.raises(InputError, match="the divisor `n` can be 0"):
        kern(*qkv(), n=0)
    # a where around it is no guard (torch evaluates both its sides): the error says how to write one
    guarded = attncc.compile(program("input n: int\ns = q @ k.T * scale\ns = s + where(n > 0, i // n, 0)\n"))
    with pytest.raises(InputError, match=r"does not guard it.*`max\(n, 1\)`"):
        guarded(*qkv(), n=0)
    written = attncc.compile(program("input n: int\ns = q @ k.T * scale\ns = s + where(n > 0, i // max(n, 1), 0)\n"))
    q, k, v = qkv()
    assert torch.allclose(written(q, k, v, n=0), torch.softmax(q @ k.transpose(-1, -2) / 4, -1) @ v, atol=1e-12)
    masked = attncc.compile(program("input w: int[B]\ns = q @ k.T * scale\nmask j % w[b] == 0 and j <= i\n"))
    with pytest.raises(InputError, match="can be 0"):
        masked(*qkv(), w=torch.tensor([0]))
    q, k, v = qkv()
    out = masked(q, k, v, w=torch.tensor([3]))
    keep = (torch.arange(40)[None, :] % 3 == 0) & (torch.arange(40)[None, :] <= torch.arange(40)[:, None])
    assert torch.allclose(out, masked_attention(q, k, v, keep), atol=1e-12)
    # a table of both signs spans an interval holding 0 but has no 0 entry: Python's floor
    # division by each (it was refused as "can be 0"); a 0 among the entries read still is
    signed = attncc.compile(program("input m: int[N]\ns = q @ k.T * scale\ns = s + 7 // m[i]\n"))
    m = torch.tensor([-2, 2, -3, 5] * 10)
    bias = torch.tensor([7 // int(x) for x in m], dtype=torch.float64)[:, None]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(16) + bias
    assert torch.allclose(signed(q, k, v, m=m), torch.softmax(s, -1) @ v, atol=1e-12)
    with pytest.raises(InputError, match="the divisor `m\\[i\\]` can be 0"):
        signed(q, k, v, m=torch.cat([m[:39], torch.tensor([0])]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_nan_row_s_bias_gradient_stays_in_its_row(dtype: torch.dtype) -> None:
    """A query row whose lse is NaN has P = NaN at every column of its key tiles, past the
    keys too: the CPU backward wrote their bias gradients into the next row of the table, and
    from the last row past its end (heap corruption: `double free or corruption`, review of
    session 63). Only the NaN row's gradient is NaN, as torch's; the others are torch's."""
    kern = attncc.compile(program("input bias: float[N, M]\ns = q @ k.T * scale + bias[i, j]\n", "biased"))
    N, M = 3, 50  # (M a tile's part: the tile's columns past the keys)
    for row in (1, 2):
        q, k, v = (t.to(dtype) for t in qkv(N, M))
        q[0, 0, row, 0] = float("nan")
        bias = torch.randn(N, M, dtype=dtype, requires_grad=True)
        kern(q, k, v, bias=bias).sum().backward()
        want = bias.detach().double().requires_grad_()
        (torch.softmax(q.double() @ k.double().transpose(-1, -2) / 4 + want, -1) @ v.double()).sum().backward()
        others = [r for r in range(N) if r != row]
        assert torch.isnan(bias.grad[row]).all() and not torch.isnan(bias.grad[others]).any()
        assert torch.allclose(bias.grad[others].double(), want.grad[others], atol=1e-5)


@pytest.mark.parametrize("value", [-1, 256, 3])
def test_bool_inputs_given_as_integers_mean_nonzero(value: int) -> None:
    kern = attncc.compile(program("input keep: bool[M]\ns = q @ k.T * scale\nmask keep[j]\n"))
    q, k, v = qkv(M=90)
    keep = torch.zeros(90, dtype=torch.int64)
    keep[::2] = value
    out = kern(q, k, v, keep=keep)
    assert torch.allclose(out, masked_attention(q, k, v, (keep != 0)[None, :].expand(40, 90)), atol=1e-12)


def test_nan_in_a_mask_input_proves_nothing() -> None:
    kern = attncc.compile(program("input x: float[B]\ns = q @ k.T * scale\nmask not (x[b] > j)\n"))
    q, k, v = qkv()
    out = kern(q, k, v, x=torch.tensor([math.nan]))  # NaN > j is false: every score kept
    assert torch.allclose(out, masked_attention(q, k, v, torch.ones(40, 40, dtype=torch.bool)), atol=1e-12)


def test_file_names_cannot_inject_lines_into_generated_code(tmp_path: Path) -> None:
    """Generated code does not depend on where the program came from: a file (whatever its
    name) and the same text give one source, so one cached or prebuilt library."""
    path = tmp_path / "a\r#error INJECTED\r.attn"
    path.write_text(program("s = q @ k.T * scale\n"))
    kern = attncc.compile(str(path))
    assert "#error" not in kern.source("float32") and "\r" not in kern.source("float32")
    assert kern.source("float32") == attncc.compile(program("s = q @ k.T * scale\n")).source("float32")
    q, k, v = qkv()
    assert torch.allclose(kern(q, k, v), masked_attention(q, k, v, torch.ones(40, 40, dtype=torch.bool)))


def test_programs_too_large_to_compose_are_dsl_errors() -> None:
    with pytest.raises(DslError, match="expression too large once the statements before it are substituted"):
        attncc.compile(program("s = q @ k.T * scale\n" + "s = s * 0.999 + 0.001\n" * 1500))
    with pytest.raises(DslError, match="at most 20000 terms"):
        attncc.compile(program("s = q @ k.T * scale\na = i\n" + "a = a + a\n" * 70 + "mask a > j\n"))
    deep = attncc.compile(program("input w: float[H]\ns = q @ k.T * scale\n" + "s = tanh(s) * w[h] + 0.001\n" * 45))
    q, k, v = (t.requires_grad_() for t in qkv())
    deep(q, k, v, w=torch.rand(2, dtype=torch.float64)).sum().backward()  # composes, differentiates, builds
    assert torch.isfinite(q.grad).all()


def test_a_flat_sum_of_many_terms_is_one_expression_not_a_nesting_error() -> None:
    """A sum of n terms parses n levels deep: a bias written as 150 bucket terms (as a
    generated T5 bucket table would be) compiles and matches, forward and backward."""
    weights = [((t * 37) % 11 - 5) * 0.01 for t in range(150)]
    bias = " + ".join(f"{w} * where(abs(i - j) == {t}, 1.0, 0.0)" for t, w in enumerate(weights))
    kern = attncc.compile(program(f"s = q @ k.T * scale\ns = s + ({bias})\n"))
    q, k, v = (t.requires_grad_() for t in qkv(40, 170))
    distance = (torch.arange(40)[:, None] - torch.arange(170)[None, :]).abs()
    table = torch.tensor(weights + [0.0] * 200, dtype=torch.float64)
    s = q @ k.transpose(-1, -2) / math.sqrt(16) + table[distance]
    expected = torch.softmax(s, -1) @ v
    out = kern(q, k, v)
    assert torch.allclose(out, expected, atol=1e-12)
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(expected.pow(2).sum(), (q, k, v))):
        assert torch.allclose(got, want, atol=1e-11)


def test_a_call_scale_sets_the_name_scale_everywhere() -> None:
    """`kern(..., scale=x)` gives the name `scale` the value x: the q.k factor (with any
    constant the program multiplies it by) and every score expression and mask using it."""
    q, k, v = qkv(30, 30)
    n = torch.arange(30)

    def manual(factor: float, penalty: float, keep: torch.Tensor | None = None) -> torch.Tensor:
        s = (q @ k.transpose(-1, -2)) * factor - penalty * (n[:, None] - n[None, :]).abs()
        if keep is not None:
            s = s.masked_fill(~keep, -math.inf)
        return torch.softmax(s, -1) @ v

    alibi_like = attncc.compile(program("s = q @ k.T * scale\ns = s - scale * abs(i - j)\n"))
    assert torch.allclose(alibi_like(q, k, v, scale=0.5), manual(0.5, 0.5), atol=1e-12)
    assert torch.allclose(alibi_like(q, k, v), manual(0.25, 0.25), atol=1e-12)  # 1/sqrt(16)
    doubled = attncc.compile(program("s = q @ k.T * scale * 2\n"))
    assert torch.allclose(doubled(q, k, v, scale=0.5), manual(1.0, 0.0), atol=1e-12)
    masked = attncc.compile(program("scale = 1 / D\ns = q @ k.T * scale\nmask j <= i + scale * 64\n"))
    keep = n[None, :] <= n[:, None] + 0.5 * 64
    assert torch.allclose(masked(q, k, v, scale=0.5), manual(0.5, 0.0, keep), atol=1e-12)
    assert torch.allclose(masked(q, k, v), manual(1 / 16, 0.0, n[None, :] <= n[:, None] + 4), atol=1e-12)
    emulated = attncc.compile(program("s = q @ k.T * scale\ns = s - scale * abs(i - j)\n"), target="sm80", emulate=True)
    out = emulated(q.half(), k.half(), v.half(), scale=0.5)
    assert (out.double() - manual(0.5, 0.5)).abs().max() < 1e-2


def test_infinite_literals_in_a_score_map_on_the_cpu_and_the_cuda_emulator() -> None:
    """`-inf` in a score map (a mask written as a score) compiles for the host and for CUDA
    device code: the literal was once emitted as a host-only constant, which broke every CUDA
    build of such a program (found by tests/test_fuzz_programs.py's emulator programs)."""
    text = program("s = q @ k.T * scale\ns = where(j > i, -inf, s)\n")
    q, k, v = qkv(N=37, M=37)
    n = torch.arange(37)
    want = masked_attention(q, k, v, n[None, :] <= n[:, None])
    assert torch.allclose(attncc.compile(text)(q, k, v), want, atol=1e-12)
    emulated = attncc.compile(text, target="sm80", emulate=True)
    assert (emulated(q.half(), k.half(), v.half()).double() - want).abs().max() < 1e-2


FILLED_ROWS = "s = q @ k.T * scale\ns = where(j <= i - 2, s, {fill})\n"  # rows 0 and 1: all fills
BIASED = "input bias: float[B, H, N, M]\ns = q @ k.T * scale\ns = s + bias[b, h, i, j]\n"


def filled_reference(q, k, v, fill: float, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 eager attention of FILLED_ROWS (bias None) or of BIASED: out and lse."""
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    i, j = torch.arange(s.shape[-2]).view(-1, 1), torch.arange(s.shape[-1]).view(1, -1)
    s = s + bias if bias is not None else torch.where(j <= i - 2, s, torch.tensor(fill, dtype=s.dtype))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_huge_finite_scores_are_softmaxed_exactly(dtype: torch.dtype) -> None:
    """Rows whose scores are all huge finite fills (-1e30, float32's lowest, -1e12: a uniform
    average, as eager attention gives, where the one-FMA exponent made them NaN or 0 with lse
    -inf), a bias of +1e10 on one key (that key's value) and the scale 1e10 (each row's best
    key): forward against float64, and the gradients of q and k."""
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    q, k, v = (t.to(dtype) for t in qkv(N=8, M=20))
    exact = [t.double() for t in (q, k, v)]
    for fill in (-1e30, torch.finfo(torch.float32).min, -1e12):
        kern = attncc.compile(program(FILLED_ROWS.format(fill=f"{fill:.8e}"), "filled"))
        leaves = [t.clone().requires_grad_() for t in (q, k)]
        out, lse = kern(*leaves, v, return_lse=True)
        want, want_lse = filled_reference(*exact, fill)
        assert (out.double() - want).abs().max() < tolerance, fill
        assert ((lse.double() - want_lse).abs() / want_lse.abs().clamp_min(1)).max() < 1e-5, fill
        grads = torch.autograd.grad(out.double().sum(), leaves)
        ref_leaves = [t.clone().requires_grad_() for t in exact[:2]]
        ref = torch.autograd.grad(filled_reference(*ref_leaves, exact[2], fill)[0].sum(), ref_leaves)
        for got, expected in zip(grads, ref):
            assert (got.double() - expected).abs().max() < 10 * tolerance, fill
    biased = attncc.compile(program(BIASED, "biased"))
    for row, col, value in ((3, slice(None), torch.finfo(torch.float32).min), (3, 7, 1e10)):
        bias = torch.zeros(1, 2, 8, 20, dtype=torch.float64)
        bias[0, :, row, col] = value
        out = biased(q, k, v, bias=bias.float())  # (float32: its lowest is -inf in bfloat16)
        assert (out.double() - filled_reference(*exact, 0.0, bias)[0]).abs().max() < tolerance, value
    # (whole key tiles: bf16 products fold the scale into the exponent there)
    q, k, v = (t.to(dtype) for t in qkv(N=64, M=256))
    out = attncc.compile("examples/vanilla.attn")(q, k, v, scale=1e10)
    best = (q.double() @ k.double().transpose(-1, -2)).argmax(-1)  # [1, 2, N]
    assert torch.equal(out.double(), torch.gather(v.double(), 2, best.unsqueeze(-1).expand(-1, -1, -1, 16)))


def test_the_float64_reference_softmaxes_rows_of_huge_equal_scores() -> None:
    """`Kernel.reference` (what `attncc check` compares with) took P = exp(s - lse), and lse = m +
    log l loses log l beside an m of 1e30: keys tied at 1e30 or rows of -1e30 fills each got
    P = 1, the sum of their values rather than the mean (3.8 off; session 61's review). Forward
    and the gradients of q and k against float64 eager attention."""
    biased = attncc.compile(program(BIASED, "biased"))
    q, k, v = (t.requires_grad_() for t in qkv(N=8, M=20))
    bias = torch.zeros(1, 2, 8, 20, dtype=torch.float64)
    bias[0, :, 2, :] = -1e30  # a row of equal huge fills
    bias[0, :, 5, :3] = 1e30  # three keys tied far above the rest
    out, lse = biased.reference(q, k, v, bias=bias)
    want, want_lse = filled_reference(q, k, v, 0.0, bias)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, want_lse)
    torch.testing.assert_close(out[0, :, 5], v[0, :, :3].mean(1))
    for got, expected in zip(torch.autograd.grad(out.sum(), (q, k)), torch.autograd.grad(want.sum(), (q, k))):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)


def exactly_scored(N: int, M: int, H: int, Hkv: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q in {-1, 0, 1} and k in steps of 1/2 within [-1, 1] at D = 16: scale q.k is a multiple of
    1/8 under 4 in magnitude, so a fill of -2^20 added to it is exact in fp32 (and bf16 holds q
    and k): the kernels and float64 see the same scores. v and the output's gradient random."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randint(-1, 2, (1, H, N, 16), generator=gen).double()
    k = torch.randint(-2, 3, (1, Hkv, M, 16), generator=gen).double() / 2
    v = torch.randn(1, Hkv, M, 16, generator=gen, dtype=torch.float64)
    grad = torch.randn(1, H, N, 16, generator=gen, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), grad


@pytest.mark.parametrize("backward", ["fused", "two-pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_whose_every_score_carries_a_huge_fill_get_their_gradients(dtype: torch.dtype, backward: str) -> None:
    """The backward recomputes P = exp(S - lse), and lse = m + log l rounded to fp32 loses log l
    beside an m of -2^20 (up to 1/16 of it: P 6% off) or of float32's lowest (all of it: P summed
    to the row's key count, 45, not 1), so every gradient from such rows was off by that factor
    (a float `attn_mask` of finfo.min on a row that sees no key: dQ 19 off, session 65). The
    delta pass recovers the lse residual of those rows. Rows 2 (-2^20 on every key: exact
    scores) and 5 (float32's lowest: a uniform row) of every head, GQA 4/2, N and M off the
    tiles; out and the gradients of q, k, v and the bias against float64 eager attention (on
    every CPU level: tests/test_cpu_isa.py)."""
    check_huge_fill_gradients(dtype, backward)


def check_huge_fill_gradients(dtype: torch.dtype, backward: str) -> None:
    N, M, H = 37, 45, 4
    q, k, v, grad = exactly_scored(N, M, H, 2, dtype)
    bias = torch.zeros(1, H, N, M, dtype=torch.float64)
    bias[0, :, 2, :] = -(2.0**20)
    bias[0, :, 5, :] = torch.finfo(torch.float32).min
    bias[0, :, 9, :7] = -(2.0**20)  # (a row partly filled: its max is an ordinary score)
    kern = attncc.compile(program(BIASED, "biased"))
    kern.backward = backward
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [bias.float().requires_grad_()]
    out = kern(*leaves[:3], bias=leaves[3])
    got = torch.autograd.grad(out, leaves, grad.to(out.dtype))
    exact = [t.detach().double().requires_grad_() for t in leaves]
    s = exact[0] @ exact[1].repeat_interleave(2, 1).transpose(-1, -2) / 4 + exact[3]
    want = torch.softmax(s, -1) @ exact[2].repeat_interleave(2, 1)
    expected = torch.autograd.grad(want, exact, grad)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (out.double() - want).abs().max() < tolerance
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), got, expected):
        assert (a.double() - b).abs().max() < 10 * tolerance, name


FILLED_SINK = BIASED + "input sinks: float[H]\n"


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_a_sink_beside_rows_of_huge_fills_gets_its_share_in_the_gradients(layout: str) -> None:
    """A sink logit joins the lse residual's sum (P of the keys sums to 1 less the sink's share)
    and its own gradient takes the residual out: rows 2 and 5 carry -2^20 on every key and the
    sinks are -2^20 + 0.5 and -2^20 - 1.5 (exact in fp32); elsewhere the sink weighs nothing.
    Gradients of q, k, v, the bias and the sinks against float64, padded and packed calls."""
    N, M, H = 21, 30, 2
    q, k, v, grad = exactly_scored(N, M, H, H, torch.float32)
    bias = torch.zeros(1, H, N, M, dtype=torch.float64)
    bias[0, :, 2, :] = bias[0, :, 5, :] = -(2.0**20)
    sinks = torch.tensor([-(2.0**20) + 0.5, -(2.0**20) - 1.5], dtype=torch.float64)
    kern = attncc.compile(program(FILLED_SINK, "filled_sink").replace("softmax(s)", "softmax(s, sink=sinks[h])"))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + [
        bias.float().requires_grad_(),
        sinks.float().requires_grad_(),
    ]
    if layout == "padded":
        out = kern(*leaves[:3], bias=leaves[3], sinks=leaves[4])
    else:  # one sequence, [rows, heads, D]
        rows = [t[0].transpose(0, 1) for t in leaves[:3]]
        cu_q, cu_k = torch.tensor([0, N]), torch.tensor([0, M])
        out = kern.varlen(*rows, cu_q, cu_k, bias=leaves[3], sinks=leaves[4]).transpose(0, 1).unsqueeze(0)
    got = torch.autograd.grad(out, leaves, grad.float())
    exact = [t.detach().double().requires_grad_() for t in leaves]
    s = exact[0] @ exact[1].transpose(-1, -2) / 4 + exact[3]
    logits = torch.cat([s, exact[4].view(1, H, 1, 1).expand(1, H, N, 1)], -1)
    want = torch.softmax(logits, -1)[..., :-1] @ exact[2]
    expected = torch.autograd.grad(want, exact, grad)
    assert (out.double() - want).abs().max() < 1e-5
    for name, a, b in zip(("dq", "dk", "dv", "dbias", "dsinks"), got, expected):
        assert (a.double() - b).abs().max() < 1e-4, name


def test_a_program_with_a_very_long_name_builds_and_runs() -> None:
    """Its library's directory name is cut (the key tells libraries apart), where it exceeded
    the file system's 255 bytes."""
    long = "a" * 300
    q, k, v = qkv(N=5, M=7)
    out = attncc.compile(program("s = q @ k.T * scale\n", long))(q, k, v)
    assert torch.allclose(out, masked_attention(q, k, v, torch.ones(5, 7, dtype=torch.bool)))


def test_scalars_beyond_float_range_and_unknown_backward_settings_are_clear_errors() -> None:
    """A float scalar of 2^1030 raised OverflowError from float(); `kern.backward` with a typo ran
    the two-pass backward silently."""
    kern = attncc.compile(program("input t: float\ninput n: int\ns = q @ k.T * scale * t\nmask j < n + i\n", "ranged"))
    q, k, v = (t.float() for t in qkv(N=4, M=4))
    for t, n, message in (
        (2**1030, 3, "t: expected a finite float scalar"),
        (0.5, 2**1030, "n: expected an int scalar"),
    ):
        with pytest.raises(InputError, match=message):
            kern(q, k, v, t=t, n=n)
    kern.backward = "fast"
    with pytest.raises(attncc.AttnccError, match="backward: expected 'auto', 'fused' or 'two-pass', got 'fast'"):
        kern(q.requires_grad_(), k, v, t=0.5, n=3).sum().backward()


@pytest.mark.parametrize(
    ("args", "message"),
    [((1, 0, 1, 1, -4, 4, 0.1), "N: expected an int >= 0"), ((1, 0, 1, 1, 4, 4, 1.5), "p: expected a dropout rate"),
     ((-1, 0, 1, 1, 4, 4, 0.1), "seed: expected an int >= 0")],
)  # fmt: skip
def test_dropout_mask_arguments_are_checked(args: tuple, message: str) -> None:
    with pytest.raises(InputError, match=message):
        attncc.dropout_mask(*args)


def test_a_call_scale_for_a_program_that_reads_no_scale_is_an_error() -> None:
    """`scale=` sets the name `scale`; where no expression reads it (`s = q @ k.T`, a literal
    factor) it changed nothing, silently, where an SDPA user expects it applied."""
    q, k, v = (t.float() for t in qkv(N=5, M=8))
    packed = [t[0].transpose(0, 1) for t in (q, k, v)]  # [rows, 2, 16]: one sequence
    cu_q, cu_k = torch.tensor([0, 5]), torch.tensor([0, 8])
    cache = [t.transpose(1, 2).reshape(2, 4, 2, 16) for t in (k, v)]  # two pages of 4 keys
    paged_q, table, held = q[:, :, :1].transpose(1, 2), torch.tensor([[0, 1]]), torch.tensor([8])
    for body in ("s = q @ k.T\n", "s = q @ k.T * 0.5\n"):
        kern = attncc.compile(program(body, "unscaled"))
        error = r"^scale: program unscaled does not use the name `scale`"
        with pytest.raises(InputError, match=error):
            kern(q, k, v, scale=0.3)
        with pytest.raises(InputError, match=error):
            kern.varlen(*packed, cu_q, cu_k, scale=0.3)
        with pytest.raises(InputError, match=error):
            kern.paged(paged_q, *cache, table, held, scale=0.3)
        assert torch.equal(kern(q, k, v), kern(q, k, v, scale=None))  # (none given: fine)
    scaled = attncc.compile(program("s = q @ k.T * scale * 2\n", "scaled"))
    assert torch.allclose(scaled(q, k, v, scale=0.15), attncc.compile("examples/vanilla.attn")(q, k, v, scale=0.3))


def test_integer_ids_that_float64_cannot_tell_apart_are_not_trusted() -> None:
    """Document ids 2^53 and 2^53 + 1 (one float64 value): the tile classes called both
    documents' tiles FULL and each attended the other (all rows off by up to 0.5)."""
    n = 256
    q, k, v = qkv(n, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for base in (2**53, 2**63 - 2):
        doc = torch.full((1, n), base, dtype=torch.int64)
        doc[:, 128:] += 1
        keep = (doc[0][:, None] == doc[0][None, :]) & causal
        out = attncc.compile(ROOT / "examples" / "document.attn")(q, k, v, doc=doc)
        assert torch.allclose(out, masked_attention(q, k, v, keep), atol=1e-12)


def test_float32_overflow_and_underflow_are_tile_classes_of_their_own() -> None:
    """`exp(i) > exp(j)` is false where float32's exp is inf on both sides (i, j >= 89), true in
    float64; `exp(j - i) > 0` is false where float32's exp is 0 (i - j from ~88 to ~104, as
    denormals are flushed or not). Tiles the float64 classes called FULL kept those keys, so a
    row's answer depended on where tile boundaries fell (172 and 212 of 300 rows wrong)."""
    n = 300
    q, k, v = (t.float() for t in qkv(n, n))
    i, j = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    overflow = attncc.compile(program("s = q @ k.T * scale\nmask exp(i * 1.0) > exp(j * 1.0)\n", "overflow"))
    keep = torch.exp(i.float()) > torch.exp(j.float())
    assert torch.allclose(overflow(q, k, v), masked_attention(q, k, v, keep), atol=2e-6)
    underflow = attncc.compile(program("s = q @ k.T * scale\nmask j <= i and exp((j - i) * 1.0) > 0.0\n", "underflow"))
    out = underflow(q, k, v)
    bands = [masked_attention(q, k, v, (j <= i) & (i - j <= width)) for width in range(86, 105)]
    assert any(torch.allclose(out, band, atol=2e-6) for band in bands)  # (one band for every row)


def test_old_mac_line_ends_and_dimensions_beyond_int64() -> None:
    text = "attention cr\rs = q @ k.T * scale\rmask j <= i\r" + TAIL.replace("\n", "\r")
    q, k, v = qkv(9, 9)
    assert torch.allclose(attncc.compile(text)(q, k, v), masked_attention(q, k, v, torch.ones(9, 9).tril().bool()))
    with pytest.raises(DslError, match=r":2:16: .*dimension `99999999999999999999` is out of range"):
        attncc.compile("attention big\ninput t: float[99999999999999999999]\ns = q @ k.T * scale\n" + TAIL)


def test_integers_compared_with_floats_are_converted_as_the_kernels_convert_them() -> None:
    """The kernels compare an int with a float in float32, where 2^24 + 1 is 2^24: `off >
    16777216.0` is false at off = 2^24 + 1 there (the tile classes, exact in float64, said
    true for every tile: all keys kept where only key 0 is)."""
    q, k, v = (t.float() for t in qkv(40, 40))
    kern = attncc.compile(program("input off: int\ns = q @ k.T * scale\nmask off > 16777216.0 or j == 0\n", "mixed"))
    keep = torch.zeros(40, 40, dtype=torch.bool)
    keep[:, 0] = True
    assert torch.allclose(kern(q, k, v, off=2**24 + 1), masked_attention(q, k, v, keep), atol=2e-6)
    assert torch.allclose(kern(q, k, v, off=2**24 + 2), masked_attention(q, k, v, torch.ones_like(keep)), atol=2e-6)


def test_a_nan_through_min_and_max_is_decided_by_the_kernel() -> None:
    """`max(min(0.0, x[j]), 0.0) >= 0.0` holds for every number and not for NaN (the kernels'
    min_of(0.0, NaN) is NaN): the tile classes called tiles with a NaN key FULL, keeping it."""
    q, k, v = (t.float() for t in qkv(40, 40))
    x = torch.randn(40)
    x[[3, 17, 39]] = math.nan
    kern = attncc.compile(
        program("input x: float[M]\ns = q @ k.T * scale\nmask max(min(0.0, x[j]), 0.0) >= 0.0\n", "nan")
    )
    keep = ~torch.isnan(x).view(1, 40).expand(40, 40)
    assert torch.allclose(kern(q, k, v, x=x), masked_attention(q, k, v, keep), atol=2e-6)


def test_ordered_comparisons_with_a_nan_are_false_whatever_the_tiles() -> None:
    """`y[j] <= inf` is false for a NaN y (the tile classes called it always true: FULL tiles
    kept NaN keys at 16 x 32 tiles, PARTIAL ones at 64 x 64 dropped them)."""
    q, k, v = (t.float() for t in qkv(64, 64))
    y = torch.randn(64)
    y[::5] = math.nan
    text = program("input y: float[M]\ns = q @ k.T * scale\nmask y[j] <= inf and inf >= y[j] and j <= i\n", "nan_le")
    keep = ~torch.isnan(y).view(1, 64) & torch.ones(64, 64, dtype=torch.bool).tril()
    for tiles in ((16, 32), (64, 64)):
        assert torch.allclose(
            attncc.compile(text, tiles=tiles)(q, k, v, y=y), masked_attention(q, k, v, keep), atol=2e-6
        )


def test_folded_integer_constants_wrap_as_the_kernels_do() -> None:
    """`9223372036854775807 * 16` is -16 in int64 (the kernels' literal); folded to a Python
    integer, the tile classes called `x[i] <= it` always true for x = 0."""
    q, k, v = (t.float() for t in qkv(64, 64))
    text = program("input x: int[N]\ns = q @ k.T * scale\nmask x[i] <= 9223372036854775807 * 16 and j <= i\n", "wrap")
    for tiles in ((16, 32), (64, 64)):
        out = attncc.compile(text, tiles=tiles)(q, k, v, x=torch.zeros(64, dtype=torch.int64))
        assert (out == 0).all()


def test_reads_in_sinks_and_rotary_positions_are_checked() -> None:
    """`sinks[h - 1]` and `pos[i - 1]` read index -1 (torch on the host read the last entry)."""
    q, k, v = qkv(8, 8)
    sink = attncc.compile(
        "attention sink_read\ninput sinks: float[H]\ns = q @ k.T * scale\np = softmax(s, sink=sinks[h - 1])\no = p @ v\noutput o\n"
    )
    with pytest.raises(InputError, match=r"sinks\[h - 1\]: index 0 \(h - 1\) ranges over \[-1, 0\]"):
        sink(q, k, v, sinks=torch.zeros(2))
    rope = attncc.compile(
        "attention rope_read\ninput pos: int[N]\nq = rope(q, position=pos[i - 1])\ns = q @ k.T * scale\n" + TAIL
    )
    with pytest.raises(InputError, match=r"pos\[i - 1\]: index 0 \(i - 1\) ranges over \[-1, 6\]"):
        rope(q, k, v, pos=torch.arange(8))


def test_a_scalar_of_minus_zero_is_not_a_repeat_of_zero() -> None:
    """-0.0 == 0.0 as floats: a call with sf = -0.0 after one with 0.0 repeated its kept launch
    and tile classes (1 / sf is +inf there: every key visible instead of causal)."""
    q, k, v = (t.float() for t in qkv(40, 40))
    kern = attncc.compile(program("input sf: float\ns = q @ k.T * scale\nmask 1.0 / sf > 0.0 or j <= i\n", "negzero"))
    kern(q, k, v, sf=0.0)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    assert torch.allclose(kern(q, k, v, sf=-0.0), masked_attention(q, k, v, causal), atol=2e-6)


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_a_scale_of_minus_zero_is_not_a_plan_of_zero(target: str) -> None:
    """The same for the call's `scale=`: the plans (kept by sizes, dtype and scale) took -0.0
    for 0.0, and the kernel its value from them (session 58: 1.4 off, every key visible)."""
    q, k, v = (t.float() for t in qkv(40, 40))
    # (q.k times 0.25: 1/sqrt(D) at D=16, as masked_attention scales)
    kern = attncc.compile(
        program("s = q @ k.T * 0.25\nmask 1.0 / scale > 0.0 or j <= i\n", "negscale"), target=target, emulate=True
    )
    kern(q, k, v, scale=0.0)
    causal = torch.ones(40, 40, dtype=torch.bool).tril()
    tol = 2e-6 if target == "cpu" else 3e-2  # (the emulated sm80 kernels multiply in bf16)
    assert torch.allclose(kern(q, k, v, scale=-0.0), masked_attention(q, k, v, causal), atol=tol)


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_new_scores_that_do_not_read_the_old_ones(target: str) -> None:
    """`s = 2.0 * bias[h, i, j]` (a Flex score_mod returning a bias alone) replaces the scores:
    it was an error at softmax; q and k get zero gradients, v and the bias theirs."""
    body = "input bias: float[H, N, M]\ns = q @ k.T * scale\ns = 2.0 * bias[h, i, j] - 0.1 * (i - j)\nmask j <= i + 3\n"
    kern = (
        attncc.compile(program(body)) if target == "cpu" else attncc.compile(program(body), target=target, emulate=True)
    )
    q, k, v = (t.requires_grad_() for t in qkv(N=9, M=11))
    bias = torch.randn(2, 9, 11, generator=torch.Generator().manual_seed(1), dtype=torch.float64, requires_grad=True)
    dtype, tol = (torch.float32, 1e-5) if target == "cpu" else (torch.bfloat16, 3e-2)
    low = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, bias)]
    out = kern(*low[:3], bias=low[3])
    i, j = torch.arange(9).view(-1, 1), torch.arange(11).view(1, -1)
    scores = (2.0 * bias - 0.1 * (i - j)).masked_fill(~(j <= i + 3), -math.inf).expand(1, 2, 9, 11)
    want = torch.softmax(scores, -1) @ v
    assert (out.double() - want).abs().max().item() < tol
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    dq, dk, dv, dbias = torch.autograd.grad(out, low, dout.to(dtype))
    assert not dq.any() and not dk.any()
    want_dv, want_dbias = torch.autograd.grad(want, (v, bias), dout)
    assert (dv.double() - want_dv).abs().max().item() < tol * 4
    assert (dbias.double() - want_dbias).abs().max().item() < tol * 4


def test_check_compares_the_gradients_of_unread_operands_with_zero() -> None:
    """`attncc check` of new scores that ignore q and k: their reference gradients were none,
    an error of inf within a limit of inf (any dq passed); they are zeros."""
    from attncc.runtime.check import check
    from attncc.runtime.inputs import Shape

    kern = attncc.compile(program("input bias: float[H, N, M]\ns = q @ k.T * scale\ns = bias[h, i, j]\n"))
    result = check(kern, Shape(1, 2, 1, 20, 20, 16), torch.float32)
    assert result.ok and result.errors["dq"] == 0 and result.errors["dk"] == 0
    assert math.isfinite(result.limits["dq"]) and math.isfinite(result.limits["dk"])


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_masks_of_narrow_ints_bool_scalars_and_scalars_given_as_tensors(target: str) -> None:
    """Session 57's review: int tensors of uint8 / int8 / int32 in a mask wrapped in their own
    dtype where decoding steps were classified by position (whole tiles empty that the kernels
    showed: 1.6 off), uint16 crashed there, a bool scalar as a `where` condition crashed, a
    bf16 strided tensor the host reads crashed, and a scalar given as a 0-d tensor repeated the
    launch kept for another value (2.7 off). Each against float64 torch code."""

    def compiled(body: str) -> attncc.Kernel:
        if target == "cpu":
            return attncc.compile(program(body))
        return attncc.compile(program(body), target=target, emulate=True)

    dtype, tol = (torch.float32, 1e-5) if target == "cpu" else (torch.bfloat16, 2e-2)
    q, k, v = qkv(N=8, M=8)
    low = [t.to(dtype) for t in (q, k, v)]
    i, j = torch.arange(8).view(-1, 1), torch.arange(8).view(1, -1)

    def agrees(out: torch.Tensor, keep: torch.Tensor) -> None:
        torch.testing.assert_close(
            out.double(), masked_attention(*(t.to(dtype).double() for t in (q, k, v)), keep), atol=tol, rtol=tol
        )

    for values, mask, keep in (
        (torch.tensor([0], dtype=torch.uint8), "j >= x[b] - 1", j >= -1),
        (torch.tensor([100], dtype=torch.int8), "j <= x[b] * 2", j <= 200),
        (torch.tensor([50000], dtype=torch.int32), "x[b] * x[b] > j", j < 50000**2),
        (torch.tensor([3], dtype=torch.uint16), "j >= x[b]", j >= 3),
    ):
        kern = compiled(f"input x: int[B]\ns = q @ k.T * scale\nmask {mask}\n")
        agrees(kern(*low, x=values), keep.expand(8, 8))
    chosen = compiled("input causal: bool\ns = q @ k.T * scale\nmask where(causal, j <= i, j >= i)\n")
    for causal in (True, False):
        agrees(chosen(*low, causal=causal), (j <= i) if causal else (j >= i))
    thresholds = torch.linspace(-1, 1, 16).bfloat16()[::2]  # (a strided view of a dtype numpy lacks)
    kern = compiled("input thr: float[M]\ns = q @ k.T * scale\nmask thr[j] > 0.0\n")
    agrees(kern(*low, thr=thresholds), (thresholds.double() > 0).view(1, 8).expand(8, 8))
    window = compiled("input w: int\ns = q @ k.T * scale\nmask j <= i and i - j < w\n")
    for w in (torch.tensor(2), torch.tensor(6), 6, torch.tensor(2)):
        agrees(window(*low, w=w), (j <= i) & (i - j < int(w)))


def test_passed_read_checks_are_kept_by_all_they_depend_on() -> None:
    """A passed read check is kept by the sizes, scalars, tensor shapes and index tensors' values
    its reads depend on (session 57: a decoding step's M grows, reads indexed by b do not
    depend on it): a read by j checks again for another M, a read through an index tensor for
    its other values, a read shifted by a scalar for its other values, and a failed check
    fails again."""
    q, k, v = (t.float() for t in qkv(6, 12))
    by_key = attncc.compile(program("input bias: float[L]\ns = q @ k.T * scale + bias[j]\n", "read_j"))
    bias = torch.zeros(10)
    for keys in (10, 11, 10, 11):
        if keys > 10:
            with pytest.raises(InputError, match=r"bias\[j\]: index 0 \(j\) ranges over \[0, 10\]"):
                by_key(q, k[:, :, :keys], v[:, :, :keys], bias=bias)
        else:
            by_key(q, k[:, :, :keys], v[:, :, :keys], bias=bias)
    through = attncc.compile(
        program("input idx: int[B]\ninput table: float[T]\ns = q @ k.T * scale + table[idx[b]]\n", "read_idx")
    )
    for at in (3, 7, 3, 7):
        if at > 4:
            with pytest.raises(InputError, match=r"table\[idx\[b\]\]: index 0"):
                through(q, k, v, idx=torch.tensor([at]), table=torch.zeros(5))
        else:
            through(q, k, v, idx=torch.tensor([at]), table=torch.zeros(5))
    shifted = attncc.compile(
        program("input off: int\ninput bias: float[L]\ns = q @ k.T * scale + bias[j + off]\n", "sh")
    )
    for off in (0, 2, 0, 2):
        if off:
            with pytest.raises(InputError, match=r"bias\[j \+ off\]: index 0 \(j \+ off\) ranges over \[2, 13\]"):
                shifted(q, k, v, off=off, bias=torch.zeros(12))
        else:
            shifted(q, k, v, off=off, bias=torch.zeros(12))


def test_packed_reads_through_tensors_and_wide_unsigned_index_tensors() -> None:
    """Session 57's review: a packed call whose read through an index tensor reaches past its
    tensor for one sequence raised a RuntimeError from the error's own code (bounds shaped
    [1, 1, 1, sequences]); an index tensor of uint16 crashed the read checks (torch reduces no
    uint16). Now the first names sequence b=1, the second runs as int64 does."""
    shifted = attncc.compile(
        program("input off: int[B]\ninput bias: float[L]\ns = q @ k.T * scale + bias[j + off[b]]\n")
    )
    q, k, v = (torch.randn(12, 1, 16, generator=torch.Generator().manual_seed(n)) for n in range(3))
    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    shifted.varlen(q, k, v, cu, cu, off=torch.tensor([0, 0]), bias=torch.zeros(8))
    with pytest.raises(InputError, match=r"bias\[j \+ off\[b\]\]: index 0 .* ranges over \[1, 8\] for sequence b=1"):
        shifted.varlen(q, k, v, cu, cu, off=torch.tensor([0, 1]), bias=torch.zeros(8))
    table = attncc.compile(
        program("input idx: int[T]\ninput bias: float[L]\ns = q @ k.T * scale + bias[idx[j % T]]\n", "u16")
    )
    q, k, v = (t.float() for t in qkv(8, 8))
    idx, bias = torch.tensor([0, 1, 2, 3]), torch.randn(4, generator=torch.Generator().manual_seed(3))
    want = table(q, k, v, idx=idx, bias=bias)
    assert torch.equal(table(q, k, v, idx=idx.to(torch.uint16), bias=bias), want)
    with pytest.raises(InputError, match=r"bias\[idx\[j % T\]\]: index 0"):
        table(q, k, v, idx=torch.tensor([0, 1, 2, 9], dtype=torch.uint16), bias=bias)


def per_sequence_calls(kern: attncc.Kernel, q, k, v, cu: torch.Tensor, **options: object) -> torch.Tensor:
    """A packed batch's out [total, H, D] from one padded call per sequence."""
    outs = []
    for b in range(len(cu) - 1):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        outs.append(kern(*(t[rows].transpose(0, 1)[None] for t in (q, k, v)), **options)[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_a_score_factor_reading_n_and_m_is_each_sequences_in_a_packed_call(target: str) -> None:
    """`s = q @ k.T * (log(M + 1) / sqrt(N))`: N and M are each sequence's own in a packed
    call; the factor was moved into the launch's one q.k multiplier, at the longest sequence's
    sizes (0.016 off for the shorter sequence, session 58)."""
    kern = attncc.compile(
        program("s = q @ k.T * (log(M + 1.0) / sqrt(N))\n", "lengths_factor"), target=target, emulate=True
    )
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 16, generator=gen) * 3 for _ in range(3))
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    tol = 1e-5 if target == "cpu" else 3e-2
    assert torch.allclose(kern.varlen(q, k, v, cu, cu), per_sequence_calls(kern, q, k, v, cu), atol=tol)


def test_a_default_scale_reading_sequence_sizes_is_refused_in_packed_and_paged_calls() -> None:
    """`scale = 1 / sqrt(N)`: one scale per launch, which a packed batch's sequences (their own
    N and M) or a paged cache's (its own M) cannot share: a clear error unless scale= is given
    (the longest sequence's was taken for all, 0.33 off, session 58)."""
    kern = attncc.compile(program("scale = 1 / sqrt(N + M)\ns = q @ k.T * scale\n", "lengths_scale"))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 3, 12], dtype=torch.int32)
    with pytest.raises(
        InputError, match=r"`scale = 1(\.0)? / sqrt\(N \+ M\)` reads N and M, each sequence's own in a packed"
    ):
        kern.varlen(q, k, v, cu, cu)
    assert torch.allclose(kern.varlen(q, k, v, cu, cu, scale=0.3), per_sequence_calls(kern, q, k, v, cu, scale=0.3))
    cache = torch.randn(4, 16, 2, 16, generator=gen)
    table, lengths = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 30], dtype=torch.int32)
    with pytest.raises(InputError, match=r"reads M, each sequence's own in a paged call"):
        kern.paged(q[:2, None], cache, cache, table, lengths)
    kern.paged(q[:2, None], cache, cache, table, lengths, scale=0.3)


@pytest.mark.parametrize("default", ["scale = 1 / sqrt(N)", "scale = 4.0 / H", "s_factor"])
def test_folded_gqa_decoding_takes_the_calls_scale(default: str) -> None:
    """The emulated GQA decoding call folds a group's query heads into rows ([B, Hkv, G N, D]):
    a default scale or q.k factor reading N or H was evaluated at the folded sizes (0.6-1.2
    off, session 58's review)."""
    body = "s = q @ k.T * (4.0 / H)\n" if default == "s_factor" else f"{default}\ns = q @ k.T * scale\n"
    kern = attncc.compile(program(body, "fold_scale"), target="sm80", emulate=True)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 2, 32, generator=gen) * 3
    k, v = (torch.randn(1, 2, 20, 32, generator=gen) * s for s in (3, 1))
    expected, _ = kern.reference(q.double(), k.double(), v.double())
    assert (kern(q, k, v).double() - expected).abs().max() < 0.15  # (bf16 products of scores ~40)


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_min_and_max_give_nan_from_either_operand(target: str) -> None:
    """`min(s, 0.5)` and `max(-0.5, s)` gave a NaN score's row finite (the kernels' min_of(a, b)
    was `a < b ? a : b`: b where a is NaN), and constant folding took Python's min(4.5, NaN),
    4.5, where a runtime NaN gave NaN: NaN from either operand everywhere now, as
    torch.minimum / maximum and eager attention give."""
    q, k, v = (t.float() for t in qkv(9, 11))
    q[0, 1, 4, 3] = math.nan
    nan, t = torch.tensor(math.nan, dtype=torch.float64), torch.tensor([math.nan, 1.0])
    cases = {  # the line after `s = q @ k.T * scale`: the same on float64 scores
        "s = min(s, 0.5)": lambda s: torch.minimum(s, torch.tensor(0.5)),
        "s = min(0.5, s)": lambda s: torch.minimum(torch.tensor(0.5), s),
        "s = max(s, -0.5)": lambda s: torch.maximum(s, torch.tensor(-0.5)),
        "s = max(-0.5, s)": lambda s: torch.maximum(torch.tensor(-0.5), s),
        "s = s + min(4.5, inf - inf)": lambda s: s + torch.minimum(torch.tensor(4.5), nan),  # (folded)
        "s = s + min(4.5, t[0])": lambda s: s + torch.minimum(torch.tensor(4.5), nan),  # (t[0] NaN)
    }
    tol = 2e-6 if target == "cpu" else 3e-2  # (the emulated sm80 kernels multiply in bf16)
    for line, score in cases.items():
        body = f"input t: float[2]\ns = q @ k.T * scale\n{line}\n"
        out = attncc.compile(program(body), target=target, emulate=True)(q, k, v, t=t).double()
        want = torch.softmax(score(q.double() @ k.double().transpose(-1, -2) / 4.0), -1) @ v.double()
        assert want.isnan().any(), line
        assert torch.equal(out.isnan(), want.isnan()), f"{line}: NaN rows {out.isnan().any(-1)}"
        assert torch.allclose(out.nan_to_num(), want.nan_to_num(), atol=tol), line


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_abs_of_the_smallest_int64_wraps_as_in_torch(target: str) -> None:
    """abs(-2^63) is -2^63 in torch (and in folding); the kernels' `x < 0 ? -x : x` overflowed
    (undefined), and GCC folded `abs(x) > 0` to `x != 0`: the diagonal of the mask below was
    kept (a uniform row where torch masks it). The mask is `i != j or j == 0`, written so that
    i - j - 2^63 reaches -2^63 on the diagonal."""
    mask = "mask abs(i - j - 9223372036854775807 - 1) > 0 or j == 0\n"
    kern = attncc.compile(program(f"s = q @ k.T * scale\n{mask}"), target=target, emulate=True)
    q, k, v = qkv(9, 9)
    i, j = torch.arange(9).view(-1, 1), torch.arange(9).view(1, -1)
    want = masked_attention(q, k, v, (i != j) | (j == 0))
    tol = 1e-5 if target == "cpu" else 3e-2
    assert torch.allclose(kern(q.float(), k.float(), v.float()).double(), want, atol=tol)
    assert torch.allclose(kern.reference(q, k, v)[0], want, atol=1e-12)


def test_a_sinks_or_scales_zero_divisor_and_a_non_finite_program_scale_are_clear_errors() -> None:
    """An integer // or % by 0 in a sink or in the program's scale raised torch's bare
    RuntimeError("ZeroDivisionError") from the reference evaluator (a score map's was an
    InputError already); a program scale that is inf or NaN at the call's sizes gave every
    output NaN where `scale=inf` is refused."""
    q, k, v = (t.float() for t in qkv(5, 6, 8))
    sink = program("s = q @ k.T * scale\n", "sink_div").replace("softmax(s)", "softmax(s, sink=1 // (i - 2) * 1.0)")
    with pytest.raises(InputError, match=r"`1 // \(i - 2\)`: the divisor `i - 2` is 0"):
        attncc.compile(sink)(q, k, v)
    with pytest.raises(InputError, match=r"`N % \(M - 6\)`: the divisor `M - 6` is 0"):
        attncc.compile(program("scale = 1.0 * (N % (M - 6))\ns = q @ k.T * scale\n", "scale_mod"))(q, k, v)
    kern = attncc.compile(program("scale = 1.0 / (M - 6)\ns = q @ k.T * scale\n", "scale_inf"))
    with pytest.raises(
        InputError, match=r"the program's `scale = 1(\.0)? / \(M - 6\)` is inf at M=6: expected a finite"
    ):
        kern(q, k, v)
    q7, k7, v7 = (t.float() for t in qkv(5, 7, 8))  # (M = 7: scale 1, plain attention)
    want = torch.softmax(q7.double() @ k7.double().transpose(-1, -2), -1) @ v7.double()
    assert torch.allclose(kern(q7, k7, v7).double(), want, atol=1e-5)


def test_a_plan_given_a_tensor_as_its_scale_is_a_clear_error() -> None:
    """`Kernel.plan(q, k, scale)` (the benchmarks' and `attncc explain`'s entry) given v as its
    scale raised a ValueError from math.isfinite deep in the scale's evaluation; a one-element
    tensor is its value, as a call's scale= is."""
    q, k, v = (t.float() for t in qkv(5, 6, 8))
    kern = attncc.compile(program("s = q @ k.T * scale\n", "plan_scale"))
    with pytest.raises(InputError, match=r"scale: expected a real number .* got a torch\.float32 tensor of shape"):
        kern.plan(q, k, v)
    with pytest.raises(InputError, match="scale: expected a real number"):
        kern.plan(q, k, True)  # type: ignore[arg-type]
    assert kern.plan(q, k, torch.tensor(0.5)).scale == kern.plan(q, k, 0.5).scale == 0.5


@pytest.mark.parametrize("init", [(0.0, 0.0), (0.3, -0.2), (-0.3, 0.2)], ids=["ties", "a_above", "b_above"])
def test_gradients_at_ties_and_at_abs_zero_follow_torch(init: tuple[float, float]) -> None:
    """`max(a, b)` at a tie gave a all the gradient and abs'(0) was 1, where torch.maximum /
    minimum give half to each and abs' is the sign (0 at 0): a learnable input starting at 0
    (session 60's review: dw [-1.65, 0] where torch gives [-0.17, -0.17]); away from ties both
    agree. The reference: torch's autograd on float64 scores."""
    body = (
        "input w: float[2]\ns = q @ k.T * scale\n"
        "s = s * (1.0 + abs(w[0])) + max(w[0], w[1]) * (i - j) / 8.0 + min(w[1], w[0]) * (i + j) / 16.0\n"
    )
    kern = attncc.compile(program(body, "ties"))
    q, k, v = qkv(8, 8)
    w = torch.tensor(init, dtype=torch.float64, requires_grad=True)
    kern(q, k, v, w=w).sum().backward()
    want = torch.tensor(init, dtype=torch.float64, requires_grad=True)
    i, j = torch.arange(8.0).view(-1, 1), torch.arange(8.0).view(1, -1)
    scores = q @ k.transpose(-1, -2) / 4.0 * (1 + want[0].abs())
    scores = scores + torch.maximum(want[0], want[1]) * (i - j) / 8 + torch.minimum(want[1], want[0]) * (i + j) / 16
    (torch.softmax(scores, -1) @ v).sum().backward()
    assert torch.allclose(w.grad, want.grad, atol=1e-6), (w.grad, want.grad)


def test_adding_a_zero_keeps_the_sign_that_ieee_gives() -> None:
    """`x + 0` was folded to `x`, but -0.0 + 0 is +0.0: a where on `1 / (x + 0)` read -inf where
    the program says +inf (0.70 off; session 64's review). A zero is dropped from a float sum
    only where it is -0.0, from a difference only where it is +0.0."""
    text = program("s = q @ k.T * scale\ns = where(1.0 / (min(s, -1.0) * 0.0 + 0) > 0, s, s * 3.0)\n")
    q, k, v = qkv(N=9, M=13)
    want = masked_attention(q, k, v, torch.ones(9, 13, dtype=torch.bool))  # (1 / +0.0 > 0 everywhere)
    assert (attncc.compile(text)(q, k, v) - want).abs().max() < 1e-12
    emulated = attncc.compile(text, target="sm80", emulate=True)
    assert (emulated(q.half(), k.half(), v.half()).double() - want).abs().max() < 1e-2
    from attncc.ir import expr as ex

    x = ex.score()
    assert ex.fold(ex.Binary("add", x, ex.const(0.0))) != x and ex.fold(ex.Binary("sub", x, ex.const(-0.0))) != x
    assert ex.fold(ex.Binary("add", x, ex.const(-0.0))) == x and ex.fold(ex.Binary("sub", x, ex.const(0.0))) == x
    i = ex.var("i")
    assert ex.fold(ex.Binary("add", i, ex.const(0))) == i  # (integers have one zero)


@pytest.mark.parametrize("zero", ["(i - j) * -1.0 + 0", "0.0 - (i - j)", "-(i - j) + 0.0"])
def test_a_zero_from_negated_positions_keeps_its_ieee_sign(zero: str) -> None:
    """GCC 12 folds `0.0f - float(n)` and `float(n) * -1.0f + 0.0f` to `-float(n)`, -0.0 for n = 0
    where IEEE gives +0.0 (at -O0 too): a mask on `1.0 / (...) > 0` dropped the diagonal on the
    CPU and the emulator (session 64's review). Positions reach real arithmetic through a call
    (`to_real`), which GCC does not fold so. The reference: torch's own IEEE arithmetic."""
    text = program(f"s = q @ k.T * scale\nmask 1.0 / ({zero}) > 0\n")
    q, k, v = qkv(N=9, M=13)
    i, j = torch.arange(9.0).view(-1, 1), torch.arange(13.0).view(1, -1)
    keep = 1.0 / (0.0 - (i - j)) > 0
    assert keep.diagonal().all() and not keep.tril(-1).any()  # (torch's -0.0 rules, checked)
    want = masked_attention(q, k, v, keep)
    assert (attncc.compile(text)(q, k, v) - want).abs().max() < 1e-12
    emulated = attncc.compile(text, target="sm80", emulate=True)
    assert (emulated(q.half(), k.half(), v.half()).double() - want).abs().max() < 1e-2


def test_small_dsl_mistakes_are_told_where_and_why() -> None:
    """A constant divisor of 0 in `//` or `%` is a DslError at its place (it was refused at every
    call, with advice about a `where` the program did not have); a float scalar of inf is told
    to be finite; a long flat sum is told how to fit the nesting limit; local's width may be 0
    (the block diagonal; it was refused); an emulated kernel's `source` asks for a head dim."""
    for divisor in ("% 0", "// (3 - 3)"):
        with pytest.raises(DslError, match=rf":3:17: error: `{divisor.split()[0]}` by a divisor that is always 0"):
            attncc.compile(program(f"s = q @ k.T * scale\ns = s + (i - j) {divisor}\n"))
    kern = attncc.compile(program("input a: float\ns = q @ k.T * scale\ns = s + min(a, 0.5 * j)\n"))
    q, k, v = qkv(N=5, M=5)
    with pytest.raises(InputError, match=r"^a: expected a finite float scalar, got inf$"):
        kern(q, k, v, a=math.inf)
    flag = attncc.compile(program("input f: bool\ns = q @ k.T * scale\ns = where(f, s, s * 2.0)\n"))
    with pytest.raises(InputError, match=r"^f: expected a bool scalar, got 0.5$"):
        flag(q, k, v, f=0.5)
    with pytest.raises(DslError, match=r"a sum of more than 200 terms is one level per operator: group it"):
        attncc.compile(program("s = q @ k.T * scale\ns = s" + " + 1" * 201 + "\n"))
    diagonal = attncc.compile(program("s = q @ k.T * scale\nlayout local(block=16, width=0)\n"))
    q, k, v = qkv(N=50, M=50)
    blocks = torch.arange(50) // 16
    assert (diagonal(q, k, v) - masked_attention(q, k, v, blocks[:, None] == blocks[None, :])).abs().max() < 1e-12
    emulated = attncc.compile(program("s = q @ k.T * scale\n"), target="sm80", emulate=True)
    with pytest.raises(InputError, match=r"made per head dim: source\('bfloat16', head_dim=64\)"):
        emulated.source("bfloat16")
    assert emulated.source("bfloat16", head_dim=64) == emulated.cuda_source("bfloat16", 64)
