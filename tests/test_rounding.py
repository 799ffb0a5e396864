"""The DSL's floor, ceil, trunc and round: numbers rounded to integers, in score maps, masks and
table indices, on the CPU and the CUDA emulator, forward and backward.

References are torch code written from the programs' meaning (torch.floor and friends in
float64; `round` is half to even, as torch.round). Operands are chosen so that every rounded
value is exact in float32, bf16 and float64 alike (integer q and k, a power-of-two scale,
positions times 0.5 or 1.375), so a kernel and its reference round the same number and a
half-way value such as 2.5 really occurs: a kernel rounding half away from zero, or flooring
where it should truncate, fails here.
"""

from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.errors import DslError, InputError

#: Rounded scores, a window around a rounded (half to even) position, a table read at a floored
#: position: all four rounding functions, in the score map, the mask and an index.
QUANTISED = """
attention quantised
input w: float[H, 9]
s = q @ k.T * 0.125
s = s + w[h, min(max(floor(j * 0.5 - i * 1.375), -4), 4) + 4] + ceil(s * 0.25) * 0.5 + trunc(s - 1.0) * 0.25 + round(s * 2.0) * 0.125
mask abs(j - round(i * 0.5)) <= 3
p = softmax(s)
o = p @ v
output o
"""


def quantised_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """QUANTISED in float64 torch: GQA by repeat_interleave, fully masked rows 0."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n, m = q.shape[2], k.shape[2]
    i = torch.arange(n, dtype=torch.float64).view(n, 1)
    j = torch.arange(m, dtype=torch.float64).view(1, m)
    s = q @ k.transpose(-1, -2) * 0.125
    column = (torch.floor(j * 0.5 - i * 1.375).clamp(-4, 4) + 4).long()
    s = s + w[:, column] + torch.ceil(s * 0.25) * 0.5 + torch.trunc(s - 1.0) * 0.25 + torch.round(s * 2.0) * 0.125
    s = s.masked_fill((j - torch.round(i * 0.5)).abs() > 3, -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


def integer_operands(shape: tuple[int, int, int, int, int, int], dtype: torch.dtype, seed: int = 0):
    """q, k with entries in {-3..3} (their scores are exact in every dtype), v and w random."""
    B, H, Hkv, N, M, D = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-3, 4, (B, H, N, D), generator=gen).to(dtype)
    k = torch.randint(-3, 4, (B, Hkv, M, D), generator=gen).to(dtype)
    v = torch.randn(B, Hkv, M, D, generator=gen).to(dtype)
    w = torch.randn(H, 9, generator=gen, dtype=torch.float64)
    return q, k, v, w


def check_quantised(kern: attncc.Kernel, shape, dtype: torch.dtype, tol: float) -> None:
    q, k, v, w = integer_operands(shape, dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    w_leaf = w.to(torch.float32 if dtype != torch.float64 else dtype).requires_grad_()
    out = kern(*leaves, w=w_leaf)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    w_ref = w_leaf.detach().double().requires_grad_()
    ref = quantised_reference(*ref_leaves, w_ref)
    weight = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (out.double() * weight).sum().backward()
    (ref * weight).sum().backward()
    assert (out.double() - ref).abs().max() <= tol
    for got, want in zip((*leaves, w_leaf), (*ref_leaves, w_ref)):
        assert (got.grad.double() - want.grad).abs().max() <= tol * max(1.0, want.grad.abs().max().item())


SHAPES = [(2, 4, 2, 37, 53, 17), (1, 2, 2, 1, 19, 16), (2, 2, 1, 70, 9, 48)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5), (torch.bfloat16, 6e-2)])
def test_rounding_in_scores_masks_and_indices_on_the_cpu(shape, dtype: torch.dtype, tol: float) -> None:
    """GQA, N = 1, tails, M = 9 (rows past the window fully masked), odd head dims."""
    check_quantised(attncc.compile(QUANTISED), shape, dtype, tol)


def test_rounding_on_the_cuda_emulator() -> None:
    check_quantised(attncc.compile(QUANTISED, target="sm80", emulate=True), SHAPES[0], torch.bfloat16, 6e-2)


def test_the_reference_bites() -> None:
    """The shapes make each rounding matter: half away from zero (round), floor for trunc, and
    the plain positions each change the reference by far more than the tolerances above."""
    q, k, v, w = (t.double() for t in integer_operands(SHAPES[0], torch.float64))
    want = quantised_reference(q, k, v, w)
    real_round = torch.round
    try:
        torch.round = lambda x: torch.floor(x + 0.5)  # (half away from zero for the positive halves here)
        assert (quantised_reference(q, k, v, w) - want).abs().max() > 0.1
    finally:
        torch.round = real_round
    real_trunc = torch.trunc
    try:
        torch.trunc = torch.floor
        assert (quantised_reference(q, k, v, w) - want).abs().max() > 0.05
    finally:
        torch.trunc = real_trunc


def t5_bucket(relative_position: torch.Tensor, num_buckets: int = 32, max_distance: int = 128) -> torch.Tensor:
    """transformers' T5Attention._relative_position_bucket (bidirectional), as it computes it."""
    num_buckets //= 2
    buckets = (relative_position > 0).to(torch.long) * num_buckets
    n = torch.abs(relative_position)
    max_exact = num_buckets // 2
    large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(n < max_exact, n, large)


#: T5's encoder attention (unscaled scores, a learned bias per head and log-spaced bucket).
T5 = """
attention t5_encoder
input bias: float[32, H]
s = q @ k.T
s = s + bias[where(j > i, 16, 0) + where(abs(j - i) < 8, abs(j - i), min(8 + trunc(log(abs(j - i) / 8.0) / log(16.0) * 8.0), 15)), h]
p = softmax(s)
o = p @ v
output o
"""


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("n, m", [(129, 300), (1, 200), (300, 40)])
def test_t5_buckets_as_transformers_computes_them(dtype: torch.dtype, tol: float, n: int, m: int) -> None:
    """Every bucket 0..31 that can occur does at 129 x 300 (distances past max_distance included); the bias
    table's gradient too. (The index is in range only because the analysis narrows `abs(j - i)`
    to >= 8 in the second branch of the `where`: log(0) there is -inf.)"""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, rows, 16, generator=gen, dtype=dtype) for rows in (n, m, m))
    bias = torch.randn(32, 4, generator=gen, dtype=dtype, requires_grad=True)
    out = attncc.compile(T5)(q, k, v, bias=bias)
    bucket = t5_bucket(torch.arange(m)[None, :] - torch.arange(n)[:, None])
    bias64 = bias.detach().double().requires_grad_()
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) + bias64[bucket].permute(2, 0, 1), -1) @ v.double()
    assert (out.double() - ref).abs().max() <= tol
    out.sum().backward()
    ref.sum().backward()
    assert (bias.grad.double() - bias64.grad).abs().max() <= tol * 10
    if (n, m) == (129, 300):
        assert set(bucket.unique().tolist()) == set(range(32)) - {16}  # (16: j > i at distance 0)


def program(body: str) -> str:
    return f"attention t\ninput tbl: float[4]\ninput f: float[N]\ns = q @ k.T\n{body}\np = softmax(s)\no = p @ v\noutput o\n"


def test_where_branches_narrow_what_their_condition_decides() -> None:
    """An integer comparison narrows both branches (`i < 4` bounds i by 3 in the first, and by
    4 from below in the second); a float comparison narrows only the branch where it holds, as
    a NaN takes the false branch (`floor(NaN)` is 0: the refused read below would be tbl[-2]
    where f = 2.5)."""
    q, k, v = (torch.randn(1, 1, 9, 8) for _ in range(3))
    tbl = torch.tensor([0.5, -1.0, 2.0, 0.25])
    f = torch.linspace(1.0, 100.0, 9)
    i, j = torch.arange(9).view(9, 1), torch.arange(9).view(1, 9)
    s = q @ k.transpose(-1, -2)

    kern = attncc.compile(program("s = s + tbl[where(i < 4, i, 3)] + tbl[where(j >= 4, 3, j)]"))
    want = torch.softmax(s + tbl[i.clamp(max=3)] + tbl[j.clamp(max=3)], -1) @ v
    assert torch.allclose(kern(q, k, v, tbl=tbl, f=f), want, atol=1e-5)
    with pytest.raises(InputError, match=r"tbl\[where\(i < 5, i, 3\)\]: index 0 .* ranges over \[0, 4\]"):
        attncc.compile(program("s = s + tbl[where(i < 5, i, 3)]"))(q, k, v, tbl=tbl, f=f)

    logs = attncc.compile(program("s = s + tbl[where(log(f[i]) >= 2.5, min(floor(log(f[i])) - 2, 3), 0)]"))
    index = torch.where(f.log() >= 2.5, (f.log().floor() - 2).clamp(max=3), torch.zeros(9)).long()
    assert torch.allclose(logs(q, k, v, tbl=tbl, f=f), torch.softmax(s + tbl[index].view(9, 1), -1) @ v, atol=1e-5)
    with pytest.raises(InputError, match="ranges over"):
        # (min(3.5, NaN) is NaN in the kernels: attncc::min_of(a, b) is `a < b ? a : b`)
        attncc.compile(program("s = s + tbl[where(log(f[i] - 3.0) < 2.0, 0, floor(min(3.5, log(f[i] - 3.0))) - 2)]"))(
            q, k, v, tbl=tbl, f=torch.full((9,), 2.5)
        )


#: inf, NaN and values past int64's range: saturated, NaN 0 (attncc/ir/expr.py ROUNDING_OPS).
EDGES = """
attention rounding_edges
s = q @ k.T
s = s + min(max(floor(log(s)), -3), 3) * 0.5 + where(ceil(s * 1e30) > 0, 0.25, 0.0) + trunc(-s * 1e38 * 1e38) * 1e-20 + round(s * 0.0 + 2.5)
p = softmax(s)
o = p @ v
output o
"""


def saturated(x: torch.Tensor) -> torch.Tensor:
    """An integral float64 tensor as the DSL's rounding gives it back: NaN 0, int64's range."""
    return x.nan_to_num(0.0).clamp(-(2.0**63), 2.0**63)


def edges_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s = q @ k.transpose(-1, -2)
    s = (
        s
        + saturated(torch.floor(torch.log(s))).clamp(-3, 3) * 0.5
        + torch.where(saturated(torch.ceil(s * 1e30)) > 0, 0.25, 0.0)
        + saturated(torch.trunc(-s * 1e38 * 1e38)) * 1e-20
        + 2.0
    )
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_rounding_of_inf_nan_and_huge_values(target: str) -> None:
    """log of a negative score (NaN), of a zero score (-inf), products past float range: the
    kernels' answers are the rule's, in float32 as in float64 and on the emulator."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, rows, 4, generator=gen) for rows in (9, 11, 11))
    k[0, 0, 3] = 0.0  # (zero scores: log 0 = -inf)
    dtypes = (torch.float32, torch.float64) if target == "cpu" else (torch.float16,)
    kern = attncc.compile(EDGES) if target == "cpu" else attncc.compile(EDGES, target=target, emulate=True)
    for dtype in dtypes:
        q_, k_, v_ = (t.to(dtype) for t in (q, k, v))
        want = edges_reference(q_.double(), k_.double(), v_.double())
        assert (kern(q_, k_, v_).double() - want).abs().max() <= (1e-12 if dtype == torch.float64 else 1e-3)


def test_folding_follows_the_same_rule() -> None:
    from attncc.ir import expr as ex

    def folded(op: str, x: float) -> object:
        return ex.fold(ex.Unary(op, ex.const(x))).value  # type: ignore[attr-defined]

    assert [folded("round", x) for x in (0.5, 1.5, 2.5, -2.5)] == [0, 2, 2, -2]
    assert [folded(op, -2.5) for op in ("floor", "ceil", "trunc")] == [-3, -2, -2]
    assert folded("floor", math.inf) == 2**63 - 1 and folded("ceil", -1e300) == -(2**63)
    assert folded("trunc", math.nan) == 0


@pytest.mark.parametrize(
    "body, message",
    [
        ("s = s + floor(i < j)", "`floor` needs numbers"),
        ("s = s + round(s, 2)", "`round` takes 1 argument"),
    ],
)
def test_rounding_errors_point_at_the_call(body: str, message: str) -> None:
    with pytest.raises(DslError, match=message) as info:
        attncc.compile(program(body))
    assert ":5:9:" in str(info.value)


def test_a_nan_rounded_inside_a_clamp_is_no_proof_of_range() -> None:
    """min and max keep a NaN (the kernels' min_of(4.5, NaN) is NaN), and floor(NaN) is 0: an
    index clamped before rounding is refused where the float may be NaN (it was proven in
    [0, 1] and read t[-3]); clamped after rounding it is in range, NaN included."""
    q, k, v = (torch.randn(1, 1, 2, 8) for _ in range(3))
    k, v = torch.randn(1, 1, 8, 8), torch.randn(1, 1, 8, 8)
    x = torch.tensor([3.7, 4.2, 0.0, 9.0, -2.0, math.nan, 4.0, 3.5])
    t = torch.tensor([10.0, 20.0])
    before = "input x: float[M]\ninput t: float[2]\ns = q @ k.T\ns = s + t[floor(max(min(4.5, x[j]), 3.5)) - 3]\n"
    with pytest.raises(InputError, match="ranges over"):
        attncc.compile(f"attention nan_before\n{before}p = softmax(s)\no = p @ v\noutput o\n")(q, k, v, x=x, t=t)
    after = "input x: float[M]\ninput t: float[2]\ns = q @ k.T\ns = s + t[min(max(floor(x[j]), 3), 4) - 3]\n"
    out = attncc.compile(f"attention nan_after\n{after}p = softmax(s)\no = p @ v\noutput o\n")(q, k, v, x=x, t=t)
    index = torch.floor(x).nan_to_num(0.0).clamp(3, 4).long() - 3
    assert torch.allclose(out, torch.softmax(q @ k.transpose(-1, -2) + t[index], -1) @ v, atol=1e-5)


def test_where_narrowing_leaves_int_float_comparisons_alone() -> None:
    """`j + c <= 2^30` with c = 2^30 holds in float32 for j up to 64 (2^30 + 64 rounds to 2^30):
    the branch's index `j + c - 2^30` is not [0, 0] (it read t[1..64])."""
    q, k, v = torch.randn(1, 1, 2, 8), torch.randn(1, 1, 80, 8), torch.randn(1, 1, 80, 8)
    body = "input t: float[1]\nconst c = 1073741824\ns = q @ k.T\ns = s + t[where(j + c <= 1073741824.0, j + c - 1073741824, 0)]\n"
    with pytest.raises(InputError, match=r"ranges over \[0, 79\]"):
        attncc.compile(f"attention mixed_narrow\n{body}p = softmax(s)\no = p @ v\noutput o\n")(q, k, v, t=torch.ones(1))


def test_flex_rounding_of_floats_is_torch_s() -> None:
    """torch.floor of a float score keeps NaN and inf as torch does (the DSL's floor gives 0 and
    int64's limits)."""
    from attncc.integrations.flex import flex_attention

    q, k, v = (torch.randn(1, 1, 3, 8, dtype=torch.float64) for _ in range(3))
    q[0, 0, 1, 0] = math.nan

    def quarter_steps(score, b, h, q_idx, kv_idx):
        return torch.floor(score * 4) / 4 + torch.round(score * 0) * torch.ceil(score * 1e300)

    out = flex_attention(q, k, v, score_mod=quarter_steps)
    s = q @ k.transpose(-1, -2) / math.sqrt(8)
    want = torch.softmax(torch.floor(s * 4) / 4 + torch.round(s * 0) * torch.ceil(s * 1e300), -1) @ v
    assert torch.isnan(out[0, 0, 1]).all() and torch.allclose(out[0, 0, [0, 2]], want[0, 0, [0, 2]], atol=1e-12)
