"""Jagged nested tensors (torch.nested, layout=torch.jagged) as q, k and v of a plain call.

The nested operands are views of packed leaves (`torch.nested.nested_tensor_from_jagged`), so
the kernel's results and gradients compare with the per-sequence float64 references of
test_serving.py on the same packed rows: ragged lengths with 0 and 1 queries, keys without
queries, cross attention (N != M) and GQA, in SDPA's [B, H, j, D] layout and in [B, j, H, D].
"""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from attncc.errors import InputError
from tests.conftest import kernel
from tests.test_independent_references import BWD_TOL, CASES, FWD_TOL, assert_within, learnable
from tests.test_serving import (
    four_sequences,
    grads_of,
    offsets,
    packed_leaves,
    packed_lengths,
    packed_reference,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # (torch.nested's "prototype" notes)


def jagged(packed: torch.Tensor, lengths: list[int], layout: str) -> torch.Tensor:
    """A jagged view of packed rows [total, heads, D]: [B, j, heads, D], or [B, heads, j, D] ("bhnd")."""
    nested = torch.nested.nested_tensor_from_jagged(packed, offsets(lengths).long())
    return nested.transpose(1, 2) if layout == "bhnd" else nested


def packed(nested: torch.Tensor, layout: str) -> torch.Tensor:
    """The rows [total, heads, ...] of a jagged result in `layout`, by torch's own unbinding."""
    pieces = nested.unbind()  # [heads, j, ...] or [j, heads, ...] each
    return torch.cat([p.transpose(0, 1) if layout == "bhnd" else p for p in pieces])


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
@pytest.mark.parametrize("name", ["vanilla", "causal", "alibi", "document"])
def test_jagged_calls_match_each_sequence_alone_in_float64(name: str, layout: str) -> None:
    """Forward (out, lse) and backward (q, k, v and learnable inputs) of a jagged call against the
    hand-written reference on each sequence alone."""
    case = CASES[name]
    shape = case.shape
    lens_q, lens_k = packed_lengths(shape)
    q, k, v, dout = packed_leaves(shape, lens_q, lens_k)
    inputs = four_sequences(case.inputs(torch.Generator().manual_seed(1000), replace(shape, B=4)))
    q_nested = jagged(q, lens_q, layout)
    out, lse = kernel(name)(
        q_nested, jagged(k, lens_k, layout), jagged(v, lens_k, layout), return_lse=True, **case.call, **inputs
    )
    assert out.is_nested and out.shape[:3] == q_nested.shape[:3] and lse.shape == q_nested.shape[:3]
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in learnable(inputs)]
    got = grads_of(
        packed(out, layout), packed(lse, layout), [q, k, v, *(inputs[n] for n in learnable(inputs))], names, dout
    )
    ref = packed_reference(case.reference, q, k, v, inputs, names, dout, lens_q, lens_k)
    assert_within(got, ref, {n: FWD_TOL if n in ("out", "lse") else BWD_TOL for n in ref})


def test_a_jagged_result_has_the_queries_ragged_size() -> None:
    """out shares q's ragged size (so out + q works) and layout; lse is [B, H, j]."""
    q = jagged(torch.randn(12, 2, 16), [5, 0, 7], "bhnd")
    k = jagged(torch.randn(9, 2, 16), [4, 3, 2], "bhnd")
    out, lse = kernel("vanilla")(q, k, k, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert (out + q).shape == q.shape


def test_jagged_vanilla_agrees_with_sdpa_on_the_same_nested_tensors() -> None:
    """The anchor a nested-tensor user compares with: scaled_dot_product_attention on the same
    jagged q, k, v (same head count: SDPA's nested path has no GQA)."""
    lens = [33, 1, 70, 5]
    q, k, v = (jagged(torch.randn(sum(lens), 4, 24, dtype=torch.float64), lens, "bhnd") for _ in range(3))
    got = kernel("vanilla")(q.float(), k.float(), v.float())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = F.scaled_dot_product_attention(q, k, v)
    assert (packed(got, "bhnd").double() - packed(want, "bhnd")).abs().max() < 1e-5


def test_bad_jagged_operands_are_named() -> None:
    kern = kernel("vanilla")
    rows = torch.randn(12, 2, 16)
    q = jagged(rows, [5, 0, 7], "bhnd")
    with pytest.raises(
        InputError, match=r"^k: q, k and v are nested tensors together.*dense tensor of shape \(3, 2, 7, 16\)"
    ):
        kern(q, torch.randn(3, 2, 7, 16), q)
    strided = torch.nested.nested_tensor([torch.randn(2, 5, 16), torch.randn(2, 3, 16)])
    with pytest.raises(InputError, match=r"^q: nested tensors of layout torch.jagged only"):
        kern(strided, strided, strided)
    with pytest.raises(InputError, match=r"^k: ragged dim 1 \(\[B, j, H, D\]\), q's is the other"):
        kern(q, jagged(rows, [5, 0, 7], "bnhd"), q)
    with pytest.raises(InputError, match=r"^q, k, v: one batch size expected, got q B=3, k B=2, v B=3"):
        kern(q, jagged(rows, [5, 7], "bhnd"), q)
    with pytest.raises(InputError, match=r"^v: its sequences' lengths must be k's"):
        kern(q, q, jagged(rows, [6, 0, 6], "bhnd"))
    holes = torch.nested.narrow(
        torch.randn(3, 8, 2, 16), 1, torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5]), layout=torch.jagged
    )
    with pytest.raises(InputError, match=r"^q: a jagged tensor with holes"):
        kern(holes, holes, holes)
    three_dims = torch.nested.nested_tensor_from_jagged(torch.randn(12, 16), offsets([5, 0, 7]).long())
    with pytest.raises(InputError, match=r"^q: expected a jagged tensor \[B, H, j, D\].*got 3 dims"):
        kern(three_dims, three_dims, three_dims)


def test_jagged_calls_compile_to_one_graph() -> None:
    """torch.compile(fullgraph=True) of a jagged call gives the eager call's result and gradients."""
    kern = kernel("causal")
    rows = torch.randn(12, 2, 16, requires_grad=True)
    compiled = torch.compile(lambda a, b, c: kern(a, b, c), fullgraph=True)
    results = []
    for call in (compiled, kern):
        q = jagged(rows, [5, 0, 7], "bhnd")
        out = packed(call(q, q, q), "bhnd")
        results.append((out, *torch.autograd.grad(out.square().sum(), [rows])))
    for got, want in zip(*results):
        assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()


def test_a_compiled_call_takes_k_and_v_made_apart_and_checks_their_offsets_as_it_runs() -> None:
    """k and v built apart (equal offsets, not one tensor) under torch.compile(fullgraph=True):
    the offsets' comparison was a data-dependent read dynamo refused; it runs in the graph now,
    and offsets that differ fail when the graph runs (session 68's review)."""
    kern = kernel("causal")
    rows = [torch.randn(12, 2, 16) for _ in range(3)]
    q, k, v = (jagged(r, [5, 0, 7], "bhnd") for r in rows)
    compiled = torch.compile(lambda a, b, c: kern(a, b, c), fullgraph=True)
    assert torch.equal(packed(compiled(q, k, v), "bhnd"), packed(kern(q, k, v), "bhnd"))
    with pytest.raises(RuntimeError, match="v: its sequences' lengths must be k's"):
        compiled(q, k, jagged(rows[2], [6, 0, 6], "bhnd"))


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_a_jagged_view_with_rows_outside_its_sequences(layout: str) -> None:
    """A jagged tensor whose offsets start past row 0 and end before its last row (torch makes
    and takes one) was refused by the packed call's checks under an argument of its own
    ("cu_seqlens_q: expected a first entry 0"; session 64's review): the sequences' rows are
    attended, the others get out 0 and lse -inf, gradients flow to the sequences' rows alone."""
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(20, 4, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    bounds = torch.tensor([4, 7, 8, 14])
    nested = torch.nested.nested_tensor_from_jagged(values, bounds)
    nested = nested.transpose(1, 2) if layout == "bhnd" else nested
    out, lse = kernel("causal")(nested, nested, nested, return_lse=True)
    if layout == "bhnd":
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    rows, row_lse = out.values(), lse.values()
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        x = values[start:end].transpose(0, 1)
        s = (x @ x.transpose(-1, -2) / 4.0).masked_fill(torch.ones(end - start, end - start).triu(1).bool(), -math.inf)
        torch.testing.assert_close(rows[start:end], (torch.softmax(s, -1) @ x).transpose(0, 1))
        torch.testing.assert_close(row_lse[start:end], torch.logsumexp(s, -1).transpose(0, 1))
    outside = torch.cat([torch.arange(4), torch.arange(14, 20)])
    assert not rows[outside].any() and bool(row_lse[outside].isneginf().all())
    (grad,) = torch.autograd.grad(rows.pow(2).sum(), values)
    assert not grad[outside].any() and bool(grad[4:14].abs().sum() > 0)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd"])
def test_queries_and_keys_whose_views_start_at_different_rows(layout: str) -> None:
    """q's jagged view starts at row 4 of its values, k's and v's at row 1 of theirs (cross
    attention: each operand its own offsets, rows outside the sequences on both sides): every
    sequence attends its own keys, as SDPA on the rows alone in float64."""
    gen = torch.Generator().manual_seed(5)
    q_rows = torch.randn(20, 2, 16, generator=gen, dtype=torch.float64)
    k_rows, v_rows = (torch.randn(15, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    q_bounds, k_bounds = torch.tensor([4, 7, 8, 14]), torch.tensor([1, 6, 13, 14])
    q, k, v = (
        torch.nested.nested_tensor_from_jagged(rows, bounds)
        for rows, bounds in ((q_rows, q_bounds), (k_rows, k_bounds), (v_rows, k_bounds))
    )
    if layout == "bhnd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out, lse = kernel("vanilla")(q, k, v, return_lse=True)
    if layout == "bhnd":
        out, lse = out.transpose(1, 2), lse.transpose(1, 2)
    rows, row_lse = out.values(), lse.values()
    for (q0, q1), (k0, k1) in zip(
        zip(q_bounds[:-1].tolist(), q_bounds[1:].tolist()), zip(k_bounds[:-1].tolist(), k_bounds[1:].tolist())
    ):
        x, y, z = q_rows[q0:q1].transpose(0, 1), k_rows[k0:k1].transpose(0, 1), v_rows[k0:k1].transpose(0, 1)
        s = x @ y.transpose(-1, -2) / math.sqrt(16)
        torch.testing.assert_close(rows[q0:q1], (torch.softmax(s, -1) @ z).transpose(0, 1), atol=1e-12, rtol=0)
        torch.testing.assert_close(row_lse[q0:q1], torch.logsumexp(s, -1).transpose(0, 1), atol=1e-12, rtol=0)
    outside = torch.cat([torch.arange(4), torch.arange(14, 20)])
    assert not rows[outside].any() and bool(row_lse[outside].isneginf().all())
