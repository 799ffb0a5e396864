"""Attention sinks (`p = softmax(s, sink=...)`) against float64 attention written by hand.

The reference appends the sink as one more logit column with no value row and takes torch's
softmax over it (GPT-OSS's formulation); it never touches attncc's IR or runtime. Each test
runs a kernel on the CPU and, where it says so, the generated CUDA kernels on the emulator.
"""

from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.errors import DslError
from attncc.runtime.check import _error
from tests.conftest import ROOT, kernel

FWD_TOL, BWD_TOL = 2e-5, 2e-4

#: Sinks from a [B, H] tensor, a scalar input and the row: every part of the expression counts.
ROW_SINK = """
attention row_sink
input bias: float[B, H]
input tau: float
s = q @ k.T * scale
mask j <= i + (M - N)
p = softmax(s, sink=bias[b, h] * tau - 0.05 * i + log(M))
o = p @ v
output o
"""


def hand_written(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax([q k^T / sqrt(D) masked, sink]) without the sink's column, @ v; (out, lse)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~visible, -math.inf)
    logits = torch.cat([s, sink.expand(*s.shape[:-1]).unsqueeze(-1)], dim=-1)
    p = torch.softmax(logits, dim=-1)[..., :-1]
    return p @ v, torch.logsumexp(logits, dim=-1)


def bottom_right(n: int, m: int, window: int | None = None) -> torch.Tensor:
    i, j = torch.arange(n).view(-1, 1) + (m - n), torch.arange(m).view(1, -1)
    return (j <= i) & (i - j < window) if window is not None else j <= i


def leaves(B: int, H: int, Hkv: int, N: int, M: int, D: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, N, D, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, Hkv, M, D, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, Hkv, M, D, generator=gen).to(dtype).requires_grad_()
    dout = torch.randn(B, H, N, D, generator=gen)
    dlse = torch.randn(B, H, N, generator=gen)
    return q, k, v, dout, dlse


def results(out, lse, leaves_, dout, dlse) -> dict[str, torch.Tensor]:
    """out, lse and the gradients of out . dout + lse . dlse (the lse gradient reaches the sink)."""
    loss = (out * dout.to(out.dtype)).sum() + (lse * dlse.to(lse.dtype)).sum()
    grads = torch.autograd.grad(loss, leaves_)
    return {"out": out, "lse": lse, **{f"d{n}": g for n, g in zip(("q", "k", "v", "sinks", "bias"), grads)}}


def f64(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().double().requires_grad_() for t in tensors]


def assert_close(got: dict, ref: dict, fwd: float = FWD_TOL, bwd: float = BWD_TOL) -> None:
    errors = {n: _error(got[n], ref[n]) for n in ref}
    limits = {n: fwd if n in ("out", "lse") else bwd for n in ref}
    assert all(errors[n] <= limits[n] for n in ref), {n: f"{e:.1e}" for n, e in errors.items()}


@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1, 1, 1, 16), (2, 4, 2, 77, 130, 48), (1, 3, 1, 129, 65, 80), (1, 6, 2, 3, 300, 64)],
    ids=lambda s: "B={} H={} Hkv={} N={} M={} D={}".format(*s),
)
def test_gpt_oss_forward_and_backward(shape: tuple[int, ...]) -> None:
    """The example (bottom-right sliding window 40 with sinks), fp32, on shapes that break naive
    tilings (N = 1, tails, GQA, decoding rows); gradients of q, k, v and the sinks through out
    and lse."""
    _, H, _, N, M, _ = shape
    q, k, v, dout, dlse = leaves(*shape)
    sinks = (2.0 + torch.randn(H, generator=torch.Generator().manual_seed(1))).requires_grad_()
    out, lse = kernel("gpt_oss")(q, k, v, sinks=sinks, window=40, return_lse=True)
    got = results(out, lse, [q, k, v, sinks], dout, dlse)
    q64, k64, v64, s64 = f64(q, k, v, sinks)
    ref = results(
        *hand_written(q64, k64, v64, s64.view(1, -1, 1), bottom_right(N, M, 40)), [q64, k64, v64, s64], dout, dlse
    )
    assert_close(got, ref)
    plain = hand_written(q64, k64, v64, torch.tensor(-math.inf), bottom_right(N, M, 40))[0]
    assert _error(plain, ref["out"]) > 100 * FWD_TOL  # the sinks take effect on this shape


def test_sink_over_batch_head_row_and_scalars() -> None:
    """sink = bias[b, h] * tau - 0.05 i + log(M): gradients for bias (and none lost for tau's
    product), against the same expression written in torch."""
    B, H, Hkv, N, M, D = 2, 4, 4, 50, 90, 32
    q, k, v, dout, dlse = leaves(B, H, Hkv, N, M, D, seed=2)
    bias = (torch.randn(B, H, generator=torch.Generator().manual_seed(3)) + 3).requires_grad_()
    kern = attncc.compile(ROW_SINK)
    out, lse = kern(q, k, v, bias=bias, tau=1.5, return_lse=True)
    got = results(out, lse, [q, k, v, bias], dout, dlse)
    got["dbias"] = got.pop("dsinks")
    q64, k64, v64, b64 = f64(q, k, v, bias)
    sink = b64.view(B, H, 1) * 1.5 - 0.05 * torch.arange(N).view(1, 1, -1) + math.log(M)
    ref = results(*hand_written(q64, k64, v64, sink, bottom_right(N, M)), [q64, k64, v64, b64], dout, dlse)
    ref["dbias"] = ref.pop("dsinks")
    assert_close(got, ref)


def test_fully_masked_rows_give_the_sink_all_the_weight() -> None:
    """window 0 masks every key: out 0, lse = sink, and d sinks[h] = sum of dlse over its rows."""
    B, H, N, M = 2, 3, 9, 20
    q, k, v, dout, dlse = leaves(B, H, 1, N, M, 16, seed=4)
    sinks = torch.tensor([0.5, -2.0, 7.0], requires_grad=True)
    out, lse = kernel("gpt_oss")(q, k, v, sinks=sinks, window=0, return_lse=True)
    assert (out == 0).all()
    torch.testing.assert_close(lse, sinks.detach().view(1, -1, 1).expand(B, H, N))
    dq, dsinks = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), [q, sinks])
    assert (dq == 0).all()
    torch.testing.assert_close(dsinks, dlse.sum(dim=(0, 2)))


def test_a_minus_infinity_sink_on_rows_that_see_no_key_has_no_gradient() -> None:
    """window 0 and a -inf sink: the row's lse is -inf, its weights none, so its sink's gradient
    is 0 (exp(-inf - -inf) gave NaN where the shift was taken unguarded: a review's mutant)."""
    q, k, v, _, _ = leaves(1, 2, 1, 5, 8, 16, seed=10)
    sinks = torch.tensor([-math.inf, 1.0], requires_grad=True)
    out, lse = kernel("gpt_oss")(q, k, v, sinks=sinks, window=0, return_lse=True)
    assert (out == 0).all() and lse[0, 0].isneginf().all()
    (dsinks,) = torch.autograd.grad(out.sum() + lse.nan_to_num(0, 0, 0).sum(), [sinks])
    torch.testing.assert_close(dsinks, torch.tensor([0.0, 5.0]))


#: A sink of the sequence's own sizes: packed and paged calls must give each sequence its N and M
SIZES_SINK = """
attention sizes_sink
s = q @ k.T * scale
mask j <= i + (M - N)
p = softmax(s, sink=0.3 * N - 0.2 * M + 1.0)
o = p @ v
output o
"""


def test_a_sink_of_n_and_m_takes_each_sequences_sizes_in_packed_and_paged_calls() -> None:
    """The sink `0.3 N - 0.2 M + 1`: in a packed batch each sequence's N and M (a review's
    mutant took N from the key offsets: 0.36 off), in a paged call M counts the appended keys
    (0.034 off without them), and a paged batch where no sequence has a key gives lse = the
    sink (it gave -inf); against the hand-written float64 reference."""
    kern = attncc.compile(SIZES_SINK)
    gen = torch.Generator().manual_seed(11)
    H, D, lens = 2, 16, [(3, 7), (5, 5), (1, 2)]
    q, k, v = (torch.randn(sum(n[side] for n in lens), H, D, generator=gen) for side in (0, 1, 1))
    cq, ck = (torch.tensor([0, *torch.tensor([n[side] for n in lens]).cumsum(0).tolist()]) for side in (0, 1))
    out, lse = kern.varlen(q, k, v, cq, ck, return_lse=True)
    for b, (n, m) in enumerate(lens):
        rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        parts = (t.transpose(0, 1).unsqueeze(0).double() for t in (q[rows], k[keys], v[keys]))
        want, want_lse = hand_written(
            *parts, torch.tensor(0.3 * n - 0.2 * m + 1.0, dtype=torch.float64), bottom_right(n, m)
        )
        assert _error(out[rows].transpose(0, 1).unsqueeze(0), want) <= FWD_TOL, b
        assert _error(lse[rows].transpose(0, 1).unsqueeze(0), want_lse) <= FWD_TOL, b
    k_cache, v_cache = (torch.randn(4, 4, H, D, generator=gen) for _ in range(2))
    table, held = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    q, k_new, v_new = (torch.randn(1, 2, H, D, generator=gen) for _ in range(3))
    keys = [torch.cat([c[2], c[0]])[:6] for c in (k_cache, v_cache)]  # (before the call appends)
    out, lse = kern.paged(q, k_cache, v_cache, table, held, k_new=k_new, v_new=v_new, return_lse=True)
    full = [torch.cat([kept, new[0]]).transpose(0, 1).unsqueeze(0).double() for kept, new in zip(keys, (k_new, v_new))]
    sink = torch.tensor(0.3 * 2 - 0.2 * 8 + 1.0, dtype=torch.float64)
    want, want_lse = hand_written(q.transpose(1, 2).double(), *full, sink, bottom_right(2, 8))
    assert _error(out.transpose(1, 2), want) <= FWD_TOL and _error(lse.transpose(1, 2), want_lse) <= FWD_TOL
    out, lse = kern.paged(
        q, k_cache, v_cache, torch.tensor([[0]], dtype=torch.int32), torch.tensor([0]), return_lse=True
    )
    assert (out == 0).all() and torch.allclose(lse, torch.full_like(lse, 0.3 * 2 + 1.0))


def test_minus_infinity_sinks_are_plain_softmax() -> None:
    """A head whose sink is -inf gets exactly the program without a sink (and finite gradients)."""
    q, k, v, dout, _ = leaves(1, 4, 2, 70, 70, 32, seed=5)
    sinks = torch.tensor([-math.inf, 1.0, -math.inf, 2.0], requires_grad=True)
    out = kernel("gpt_oss")(q, k, v, sinks=sinks, window=30)
    plain = attncc.compile((ROOT / "examples" / "gpt_oss.attn").read_text().replace(", sink=sinks[h]", ""))
    want = plain(q, k, v, sinks=sinks, window=30)
    torch.testing.assert_close(out[:, ::2], want[:, ::2], rtol=0, atol=0)
    assert (out[:, 1::2] - want[:, 1::2]).abs().max() > 1e-3
    grads = torch.autograd.grad((out * dout).sum(), [q, sinks])
    assert all(torch.isfinite(g).all() for g in grads) and (grads[1][::2] == 0).all()


@pytest.mark.parametrize("emulate", [False, True], ids=["cpu", "cuda-emulated"])
def test_bf16_within_eager_bf16_error(emulate: bool) -> None:
    """bf16 kernels (the CPU's best tile products; the CUDA kernels for sm80 on the emulator)
    stay within 3x of eager bf16 attention's own error (and 1e-2) from float64, forward and
    backward."""
    shape = (1, 4, 2, 70, 150, 64)
    q, k, v, dout, dlse = leaves(*shape, dtype=torch.bfloat16, seed=6)
    sinks = (2.0 + torch.randn(4, generator=torch.Generator().manual_seed(7))).requires_grad_()
    path = ROOT / "examples" / "gpt_oss.attn"
    kern = attncc.compile(path, target="sm80", emulate=True) if emulate else kernel("gpt_oss")
    out, lse = kern(q, k, v, sinks=sinks, window=50, return_lse=True)
    got = results(out, lse, [q, k, v, sinks], dout, dlse)
    visible = bottom_right(70, 150, 50)
    q64, k64, v64, s64 = f64(q, k, v, sinks)
    ref = results(*hand_written(q64, k64, v64, s64.view(1, -1, 1), visible), [q64, k64, v64, s64], dout, dlse)
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    sb = sinks.detach().requires_grad_()
    eager = results(*hand_written(qb, kb, vb, sb.view(1, -1, 1).bfloat16(), visible), [qb, kb, vb, sb], dout, dlse)
    for name in ref:
        limit = max(3 * _error(eager[name], ref[name]), 1e-2)
        assert _error(got[name], ref[name]) <= limit, (name, _error(got[name], ref[name]), limit)


def test_packed_batch_with_sinks_matches_each_sequence() -> None:
    """varlen: the sink of row r of sequence b is sinks[h] at i = r - cu_seqlens_q[b] (the
    ROW_SINK program, whose sink uses b, i and M), lengths 0, 1 and ragged; forward and backward."""
    lens_q, lens_k = [31, 1, 0, 12], [40, 1, 3, 77]
    H, D = 2, 24
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(sum(lens_q), H, D, generator=gen).requires_grad_()
    k = torch.randn(sum(lens_k), H, D, generator=gen).requires_grad_()
    v = torch.randn(sum(lens_k), H, D, generator=gen).requires_grad_()
    bias = (torch.randn(4, H, generator=gen) + 2).requires_grad_()
    cq, ck = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()]) for n in (lens_q, lens_k))
    out, lse = attncc.compile(ROW_SINK).varlen(q, k, v, cq, ck, return_lse=True, bias=bias, tau=0.7)
    dout, dlse = torch.randn(out.shape, generator=gen), torch.randn(lse.shape, generator=gen)
    got = results(out, lse, [q, k, v, bias], dout, dlse)
    q64, k64, v64, b64 = f64(q, k, v, bias)
    outs, lses = [], []
    for b, (n, m) in enumerate(zip(lens_q, lens_k)):
        if n == 0:
            continue
        qb, kb, vb = (
            t.transpose(0, 1).unsqueeze(0)
            for t in (q64[cq[b] : cq[b + 1]], k64[ck[b] : ck[b + 1]], v64[ck[b] : ck[b + 1]])
        )
        sink = b64[b].view(1, H, 1) * 0.7 - 0.05 * torch.arange(n).view(1, 1, -1) + math.log(m)
        o, lse_b = hand_written(qb, kb, vb, sink, bottom_right(n, m))
        outs.append(o[0].transpose(0, 1))
        lses.append(lse_b[0].transpose(0, 1))
    ref = results(torch.cat(outs), torch.cat(lses), [q64, k64, v64, b64], dout, dlse)
    got["dbias"], ref["dbias"] = got.pop("dsinks"), ref.pop("dsinks")
    assert_close(got, ref)


@pytest.mark.parametrize("queries", [1, 5])
def test_paged_decoding_with_sinks(queries: int) -> None:
    """gpt_oss over a paged cache (pages of 16 in shuffled order, lengths ending inside a page):
    decoding and a chunk of 5 queries, window 64, against the hand-written reference."""
    gen = torch.Generator().manual_seed(9)
    B, H, Hkv, D, held, page = 3, 4, 2, 32, [100, 7, 64], 16
    pages_per_seq = -(-max(held) // page)
    table = torch.randperm(B * pages_per_seq + 2, generator=gen)[: B * pages_per_seq].view(B, -1).int()
    k_cache, v_cache = (torch.randn(B * pages_per_seq + 2, page, Hkv, D, generator=gen) for _ in range(2))
    q = torch.randn(B, queries, H, D, generator=gen)
    sinks = torch.randn(H, generator=gen) + 2
    lengths = [max(n, queries) for n in held]
    out, lse = kernel("gpt_oss").paged(
        q, k_cache, v_cache, table, torch.tensor(lengths), return_lse=True, sinks=sinks, window=64
    )
    for b in range(B):
        keys = [
            c[table[b].long()].flatten(0, 1)[: lengths[b]].transpose(0, 1).unsqueeze(0).double()
            for c in (k_cache, v_cache)
        ]
        ref_out, ref_lse = hand_written(
            q[b : b + 1].transpose(1, 2).double(),
            *keys,
            sinks.double().view(1, -1, 1),
            bottom_right(queries, lengths[b], 64),
        )
        assert _error(out[b : b + 1].transpose(1, 2), ref_out) <= FWD_TOL, b
        assert _error(lse[b : b + 1].transpose(1, 2), ref_lse) <= FWD_TOL, b


def test_gradcheck_float64() -> None:
    """Finite differences agree with the derived backward, the sinks included."""
    q, k, v, _, _ = leaves(1, 2, 1, 6, 9, 8, dtype=torch.float64, seed=10)
    sinks = torch.tensor([0.3, 1.2], dtype=torch.float64, requires_grad=True)
    kern = kernel("gpt_oss")
    assert torch.autograd.gradcheck(
        lambda q, k, v, s: kern(q, k, v, sinks=s, window=4, return_lse=True), (q, k, v, sinks)
    )


@pytest.mark.parametrize(
    ("sink", "message", "column"),
    [
        ("sinks[h] + j", "not the key index j", 21),
        ("s", "cannot depend on the scores", 21),
        ("j <= i", "must be a number", 21),
    ],
)
def test_sink_mistakes_point_at_the_expression(sink: str, message: str, column: int) -> None:
    source = f"attention t\ninput sinks: float[H]\ns = q @ k.T\np = softmax(s, sink={sink})\no = p @ v\noutput o\n"
    with pytest.raises(DslError) as info:
        attncc.lower(source)
    err = info.value
    assert message in err.message and err.loc is not None
    assert (err.loc.line, err.loc.column) == (4, column), err.render()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("softmax(s, sinks=1.0)", "`softmax` has no keyword argument `sinks`; expected sink"),
        ("softmax(s, sink=1.0, sink=2.0)", "given twice"),
        ("softmax(tanh(s, sink=1.0))", "`tanh` has no keyword argument `sink`"),
    ],
)
def test_sink_keyword_mistakes(call: str, message: str) -> None:
    with pytest.raises(DslError) as info:
        attncc.lower(f"attention t\ns = q @ k.T\np = {call}\no = p @ v\noutput o\n")
    assert message in info.value.message and info.value.loc is not None and info.value.loc.line == 3


def test_explain_shows_the_sinks_derived_backward(capsys: pytest.CaptureFixture[str]) -> None:
    from attncc.cli import main

    assert main(["explain", str(ROOT / "examples" / "gpt_oss.attn")]) == 0
    text = capsys.readouterr().out
    assert "sink=sinks[h]" in text
    assert "dsink = -exp(sink - lse) * (rowsum(dO * O) - dlse); dsinks[h] += dsink * (1.0)" in text


#: A sink that reads `scale`: a call's scale= is the sink's scale too
SCALE_SINK = """
attention scale_sink
input sinks: float[H]
s = q @ k.T * scale
p = softmax(s, sink=sinks[h] * scale)
o = p @ v
output o
"""


def test_a_sink_that_reads_the_scale_takes_the_calls_scale() -> None:
    """`sink = sinks[h] * scale` with scale= given and without (the program's 1/sqrt(D)):
    the scores and the sink take the same scale, against softmax over [q k^T, sink] in float64."""
    B, H, Hkv, N, M, D = 2, 2, 1, 9, 13, 16
    q, k, v, _, _ = leaves(B, H, Hkv, N, M, D, seed=6)
    sinks = torch.tensor([6.0, -2.0])
    kern = attncc.compile(SCALE_SINK)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    k64, v64 = k64.repeat_interleave(H // Hkv, 1), v64.repeat_interleave(H // Hkv, 1)
    for scale in (None, 0.7):
        value = 1 / math.sqrt(D) if scale is None else scale
        out, lse = kern(q, k, v, sinks=sinks, scale=scale, return_lse=True)
        s = q64 @ k64.transpose(-1, -2) * value
        sink = (sinks.double() * value).view(1, H, 1, 1).expand(B, H, N, 1)
        logits = torch.cat([s, sink], -1)
        want = torch.softmax(logits, -1)[..., :-1] @ v64
        assert _error(out, want) <= FWD_TOL and _error(lse, torch.logsumexp(logits, -1)) <= FWD_TOL, scale
