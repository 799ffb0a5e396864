"""attncc.merge_states: partial attention results over disjoint key sets, combined by their
log-sum-exp, equal attention over all the keys, forward and backward."""

from __future__ import annotations

import math

import pytest
import torch

import attncc
from attncc.errors import InputError
from tests.conftest import ROOT


def padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Eager attention where batch entry b sees its first lengths[b] keys (none: output 0)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    keep = torch.arange(k.shape[2])[None, :] < lengths[:, None]  # [B, M]
    s = s.masked_fill(~keep[:, None, None, :], -math.inf)
    return torch.softmax(s, -1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_key_chunks_merged_equal_attention_over_all_keys(dtype: torch.dtype) -> None:
    """Keys cut into three chunks (one ragged), each attended by the padding kernel with the
    lengths it holds: merged, out and every gradient (through each chunk's out and lse) match
    float64 eager attention over all keys. Batch 0 has no keys at all (its merged rows are
    0 with lse -inf), batch 1 only keys of the first chunk (the other chunks' rows are empty)."""
    kern = attncc.compile(ROOT / "examples" / "padding.attn")
    gen = torch.Generator().manual_seed(0)
    B, H, N, M, D = 3, 2, 9, 70, 24
    q = torch.randn(B, H, N, D, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(B, H, M, D, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, M, D, generator=gen, dtype=dtype, requires_grad=True)
    lengths = torch.tensor([0, 20, 61])
    outs, lses = [], []
    for start, stop in ((0, 32), (32, 64), (64, M)):
        held = (lengths - start).clamp(0, stop - start)
        out, lse = kern(q, k[:, :, start:stop], v[:, :, start:stop], lengths=held, return_lse=True)
        outs.append(out)
        lses.append(lse)
    merged, lse = attncc.merge_states(outs, lses)
    assert merged.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)

    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = padded_attention(*leaves, lengths)
    s = leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(D)
    keep = torch.arange(M)[None, :] < lengths[:, None]
    want_lse = s.masked_fill(~keep[:, None, None, :], -math.inf).logsumexp(-1)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert torch.allclose(merged.double(), want, atol=tol, rtol=0)
    assert torch.equal(lse[0], torch.full_like(lse[0], -math.inf))
    assert torch.allclose(lse[1:].double(), want_lse[1:], atol=tol, rtol=0)

    dout = torch.randn(merged.shape, generator=gen, dtype=dtype)
    dlse = torch.randn(lse.shape, generator=gen, dtype=lse.dtype)
    dlse[0] = 0  # lse = -inf there: its gradient is not defined
    got = torch.autograd.grad((merged * dout).sum() + (torch.where(lse.isinf(), 0, lse) * dlse).sum(), (q, k, v))
    total = (want * dout.double()).sum() + (torch.where(want_lse.isinf(), 0, want_lse) * dlse.double()).sum()
    expected = torch.autograd.grad(total, leaves)
    for name, g, e in zip("qkv", got, expected):
        assert torch.allclose(g.double(), e, atol=10 * tol, rtol=0), f"d{name}: {(g.double() - e).abs().max()}"


def test_merge_rules_and_gradients() -> None:
    """Empty parts weigh nothing; all-empty rows give out 0 and lse -inf with zero (not NaN)
    gradients; a NaN stays NaN; gradcheck in float64 elsewhere; a stacked tensor works as a
    sequence does."""
    out = torch.randn(3, 4, 5, dtype=torch.float64)
    lse = torch.randn(3, 4, dtype=torch.float64)
    lse[1, 0] = -math.inf  # row 0: part 1 empty
    lse[:, 1] = -math.inf  # row 1: every part empty
    out[1, 0] = 0.0
    out[:, 1] = 0.0
    merged, total = attncc.merge_states(list(out), list(lse))
    w = torch.softmax(lse[:, 0], 0)
    assert torch.allclose(merged[0], (w[:, None] * out[:, 0]).sum(0))
    assert torch.allclose(total[0], torch.logsumexp(lse[:, 0], 0))
    assert torch.equal(merged[1], torch.zeros(5, dtype=torch.float64)) and total[1] == -math.inf
    stacked = attncc.merge_states(out, lse)
    assert torch.equal(stacked[0], merged) and torch.equal(stacked[1], total)

    out_leaf, lse_leaf = out.clone().requires_grad_(), lse.clone().requires_grad_()
    m, t = attncc.merge_states(out_leaf, lse_leaf)
    (m.sum() + torch.where(t.isinf(), 0, t).sum()).backward()
    assert torch.isfinite(out_leaf.grad).all() and torch.isfinite(lse_leaf.grad).all()
    assert torch.equal(lse_leaf.grad[:, 1], torch.zeros(3, dtype=torch.float64))

    finite_out = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    finite_lse = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda o, s: attncc.merge_states(o, s), (finite_out, finite_lse))

    nan_lse = lse.clone()
    nan_lse[2, 2] = math.nan
    merged_nan, total_nan = attncc.merge_states(out, nan_lse)
    assert torch.isnan(merged_nan[2]).all() and torch.isnan(total_nan[2])
    assert not torch.isnan(merged_nan[3]).any()

    # a part far below the others (its weight underflows to 0 in float32) still carries its
    # NaN rows, as 0 * NaN and the float64 merge do; only an empty part (lse -inf) is dropped
    far_out, far_lse = torch.randn(2, 1, 4), torch.tensor([[0.0], [-200.0]])
    far_out[1] = math.nan
    assert torch.isnan(attncc.merge_states(far_out, far_lse)[0]).all()
    far_lse[1] = -math.inf
    assert torch.isfinite(attncc.merge_states(far_out, far_lse)[0]).all()
    # a part of lse +inf outweighs the finite ones: lse +inf (torch.logsumexp's), out its rows
    inf_out, inf_lse = (
        torch.randn(3, 2, 4, dtype=torch.float64),
        torch.tensor([[math.inf, 0.0], [0.0, 1.0], [2.0, 0.5]]),
    )
    inf_lse = inf_lse.double()
    merged_inf, total_inf = attncc.merge_states(inf_out, inf_lse)
    assert total_inf[0] == math.inf and torch.equal(merged_inf[0], inf_out[0, 0])
    assert torch.allclose(total_inf[1], torch.logsumexp(inf_lse[:, 1], 0))
    assert torch.allclose(merged_inf[1], (torch.softmax(inf_lse[:, 1], 0)[:, None] * inf_out[:, 1]).sum(0))
    inf_leaf = inf_out.clone().requires_grad_()
    attncc.merge_states(inf_leaf, inf_lse)[0].sum().backward()
    assert torch.isfinite(inf_leaf.grad).all() and torch.equal(
        inf_leaf.grad[:, 0, 0], torch.tensor([1.0, 0, 0]).double()
    )


def test_merge_errors_name_the_argument() -> None:
    out = torch.randn(2, 4, 5)
    with pytest.raises(InputError, match=r"lses: expected shape \(2, 4\) .* got \(2, 5\)"):
        attncc.merge_states(out, torch.randn(2, 5))
    with pytest.raises(InputError, match=r"outs: the partial results differ in shape"):
        attncc.merge_states([out[0], out[0, :3]], [torch.randn(4), torch.randn(3)])
    with pytest.raises(InputError, match=r"outs: expected at least one partial result"):
        attncc.merge_states([], [])
    with pytest.raises(InputError, match=r"outs, lses: expected float64, float32, bfloat16 or float16 tensors"):
        attncc.merge_states(out.long(), torch.randn(2, 4))
    with pytest.raises(InputError, match=r"got torch.float8_e4m3fn and torch.float32"):
        attncc.merge_states(out.to(torch.float8_e4m3fn), torch.randn(2, 4))
    with pytest.raises(InputError, match=r"lses: expected one per partial result, 2, got 1"):
        attncc.merge_states([out[0], out[1]], [torch.randn(4)])


def test_a_part_that_weighs_nothing_adds_nothing_even_nan() -> None:
    """A part whose row has lse -inf (no visible key) weighs nothing, whatever its output row
    holds: NaN from another producer (FlashAttention's empty rows, say) left the merge NaN."""
    out, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    out[1, 1], lse[1, 1] = torch.nan, -torch.inf
    merged, total = attncc.merge_states(out, lse)
    assert torch.equal(merged[1], out[0, 1]) and total[1] == lse[0, 1]
    assert not merged.isnan().any()


def test_bf16_parts_merge_in_float32() -> None:
    """bf16 outs and lses (a bf16 producer's) merge in float32 and give an lse in float32, as
    documented: within bf16's own rounding of the inputs (a review's mutant merged in bf16:
    lse 0.49 off at lse ~200)."""
    gen = torch.Generator().manual_seed(0)
    outs = torch.randn(8, 4, 64, generator=gen).bfloat16()
    lses = (torch.randn(8, 4, generator=gen) * 3 + 200).bfloat16()
    out, lse = attncc.merge_states(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want = (torch.softmax(lses.double(), 0).unsqueeze(-1) * outs.double()).sum(0)
    assert (lse.double() - torch.logsumexp(lses.double(), 0)).abs().max() < 1e-4
    assert (out.double() - want).abs().max() < 2e-2


def test_an_empty_stack_of_parts_is_a_clear_error() -> None:
    with pytest.raises(InputError, match="outs: expected at least one partial result, got none"):
        attncc.merge_states(torch.zeros(0, 2, 3), torch.zeros(0, 2))
