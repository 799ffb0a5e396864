"""torch.nn.functional.scaled_dot_product_attention's call on attncc
(`attncc.integrations.sdpa`) against torch's own SDPA in float64 (its math path, written apart
from attncc): no mask, causal (top-left, L < S and L > S), bool and float masks broadcast from
[L, S] and [B, 1, L, S], GQA, three- and five-dim inputs, a given scale; forward and gradients
(q, k, v and a float mask that requires grad)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attncc.errors import InputError
from attncc.integrations.sdpa import SdpaOptions, patched, scaled_dot_product_attention, sdpa_program


def operands(lead: tuple[int, ...], rows: int, cols: int, dim: int = 17, kv_heads: int | None = None):
    generator = torch.Generator().manual_seed(0)
    kv_lead = (*lead[:-1], kv_heads) if kv_heads else lead
    q = torch.randn(*lead, rows, dim, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(*kv_lead, cols, dim, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2)
    )
    return q, k, v


def check(args: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    got = scaled_dot_product_attention(q, k, v, **args)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, **args)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-11, rtol=1e-11)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=got.dtype)
    for a, b in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(("rows", "cols"), [(37, 53), (53, 37), (1, 9)])
@pytest.mark.parametrize(
    "case",
    [
        "plain",
        "causal",
        "bool [L, S]",
        "bool [B, 1, 1, S]",
        "float [B, 1, L, S]",
        "float [H, 1, S]",
        "float -inf band",
        "scale",
    ],
)
def test_sdpa_calls_match_torch(case: str, rows: int, cols: int) -> None:
    q, k, v = operands((2, 3), rows, cols)
    generator = torch.Generator().manual_seed(2)
    args: dict = {}
    leaves = [q, k, v]
    if case == "causal":
        args["is_causal"] = True
    elif case == "bool [L, S]":
        keep = torch.rand(rows, cols, generator=generator) < 0.7
        keep[:, 0] = True  # (no row without a key: torch's math path gives NaN there)
        args["attn_mask"] = keep
    elif case == "bool [B, 1, 1, S]":  # (a key padding mask: read as attn_mask[b, j])
        keep = torch.ones(2, 1, 1, cols, dtype=torch.bool)
        keep[1, :, :, cols // 2 :] = False
        args["attn_mask"] = keep
    elif case == "float -inf band":  # (0 / -inf: the -inf entries are a mask too, its empty tiles skipped)
        i, j = torch.arange(rows).view(-1, 1), torch.arange(cols).view(1, -1)
        band = torch.zeros(rows, cols, dtype=torch.float64).masked_fill((i - j).abs() > 4, -torch.inf)
        band[:, 0] = 0.0  # (every row keeps a key)
        args["attn_mask"] = band
    elif case == "float [H, 1, S]":
        bias = torch.randn(3, 1, cols, generator=generator, dtype=torch.float64, requires_grad=True)
        args["attn_mask"] = bias
        leaves.append(bias)
    elif case == "float [B, 1, L, S]":
        bias = torch.randn(2, 1, rows, cols, generator=generator, dtype=torch.float64, requires_grad=True)
        args["attn_mask"] = bias
        leaves.append(bias)
    elif case == "scale":
        args["scale"] = 0.3
    if case == "causal" and rows > cols:
        q = q[:, :, :cols].detach().requires_grad_()  # (rows past the keys see none: NaN in torch)
        leaves[0] = q
    check(args, q, k, v, leaves)


def test_a_float_mask_of_the_lowest_float_on_rows_that_see_no_key_in_float32() -> None:
    """HF-style additive masks: finfo(float32).min on every key of some rows (left padding's
    queries), where softmax is uniform over the row. The backward took P = exp(S - lse), whose
    lse had lost log l to the fill: those rows' gradients came out S = 30 times too large
    (dq 19 off, session 65); against torch's math path in float64 on the same inputs."""
    q, k, v = (t.detach().float() for t in operands((2, 3), 9, 30, dim=16))
    mask = torch.zeros(2, 1, 9, 30)
    mask[0, :, :4] = torch.finfo(torch.float32).min  # (rows 0-3 of batch 0 see no key)
    mask[1, :, :, 20:] = torch.finfo(torch.float32).min
    leaves = [t.requires_grad_() for t in (q, k, v)]
    got = scaled_dot_product_attention(*leaves, attn_mask=mask)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = F.scaled_dot_product_attention(*exact, attn_mask=mask.double())
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(
        "qkv", torch.autograd.grad(got, leaves, grad.float()), torch.autograd.grad(want, exact, grad)
    ):
        torch.testing.assert_close(a.double(), b, atol=1e-4, rtol=1e-4, msg=lambda m, name=name: f"d{name}: {m}")


def test_a_mask_is_declared_with_the_dims_it_does_not_broadcast() -> None:
    """The kernels take runtime tensors contiguous: an [L, S] mask passed as [B, H, L, S] was
    copied B x H times and its tile classes read from every copy (13.8 s for SDPA's 66 ms at
    L = S = 2048, B x H = 8); now the program declares the mask's own dims."""
    assert "input attn_mask: bool[N, M]" in sdpa_program(SdpaOptions(False, "bool", 0.0, ("N", "M")))
    text = sdpa_program(SdpaOptions(True, "float", 0.0, ("B", "M")))
    assert "input attn_bias: float[B, M]" in text and "s = s + attn_bias[b, j]" in text


def test_gqa_three_and_five_dim_inputs() -> None:
    q, k, v = operands((2, 4), 11, 13, kv_heads=2)
    check({"enable_gqa": True, "is_causal": True}, q, k, v, [q, k, v])
    q, k, v = operands((3,), 7, 9)
    check({"attn_mask": torch.tril(torch.ones(7, 9, dtype=torch.bool))}, q, k, v, [q, k, v])
    q, k, v = operands((2, 2, 3), 5, 6)
    bias = torch.randn(2, 1, 1, 5, 6, dtype=torch.float64)
    check({"attn_mask": bias}, q, k, v, [q, k, v])


def test_rows_without_a_key_give_zero_and_dropout_follows_torch_seed() -> None:
    q, k, v = operands((1, 2), 4, 6)
    keep = torch.ones(4, 6, dtype=torch.bool)
    keep[2] = False
    out = scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2])) and not out.isnan().any()
    torch.manual_seed(3)
    first = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    assert torch.equal(first, scaled_dot_product_attention(q, k, v, dropout_p=0.3))
    assert (first - scaled_dot_product_attention(q, k, v)).abs().max() > 0.05


def test_every_dropout_rate_is_applied_by_one_program() -> None:
    """Through v = identity the output is the dropped weights themselves: at each rate p the
    share of zeros is p and the kept weights are softmax / (1 - p), exactly (float64); every
    rate runs the one program with dropout (the kernels take the rate per call: each rate was
    a program and a build of its own until session 68)."""
    from attncc.integrations import sdpa

    generator = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 4, 96, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    eye = torch.eye(96, dtype=torch.float64).expand(1, 4, 96, 96)
    weights = torch.softmax(q @ k.transpose(-1, -2) / 4, dim=-1)
    made = len(sdpa._kernel._kernels)
    for rate in (0.3, 0.55, 0.1):
        dropped = scaled_dot_product_attention(q, k, eye, dropout_p=rate)
        kept = dropped != 0
        assert abs(1 - kept.double().mean().item() - rate) < 0.015, rate  # (36864 draws: sd 0.0026)
        torch.testing.assert_close(dropped[kept], weights[kept] / (1 - rate), atol=1e-15, rtol=1e-13)
    assert len(sdpa._kernel._kernels) - made <= 1
    assert "p = dropout(p, " in sdpa_program(SdpaOptions(False, None, True))


def test_patched_replaces_the_functional_call_inside_the_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Code calling `F.scaled_dot_product_attention` runs attncc's inside `patched()` only."""
    from attncc.integrations import sdpa

    made = []
    kernel = sdpa._kernel
    monkeypatch.setattr(sdpa, "_kernel", lambda *args: made.append(args) or kernel(*args))
    q, k, v = (t.detach().float() for t in operands((1, 2), 8, 8))

    def block() -> torch.Tensor:  # (a model's attention, calling through the module attribute)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    with patched():
        inside = block()
    outside = block()
    assert len(made) == 1 and F.scaled_dot_product_attention is not scaled_dot_product_attention
    torch.testing.assert_close(inside, outside, atol=2e-6, rtol=2e-6)


def test_patched_blocks_overlapping_across_threads_restore_torch_s_function() -> None:
    """Two threads' blocks, the first closed before the second: torch's function is back when
    the last closes (it stayed attncc's for the rest of the process)."""
    import threading

    torch_sdpa = F.scaled_dot_product_attention
    first_open, second_open, first_closed = (threading.Event() for _ in range(3))

    def first() -> None:
        with patched():
            first_open.set()
            second_open.wait(30)
        first_closed.set()

    def second() -> None:
        first_open.wait(30)
        with patched():
            second_open.set()
            first_closed.wait(30)
            assert F.scaled_dot_product_attention is scaled_dot_product_attention  # (still open here)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert first_closed.is_set() and F.scaled_dot_product_attention is torch_sdpa


def test_bad_calls_name_the_argument() -> None:
    q, k, v = (t.detach() for t in operands((1, 2), 4, 6))
    with pytest.raises(InputError, match=r"attn_mask: given with is_causal=True"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 6, dtype=torch.bool), is_causal=True)
    with pytest.raises(InputError, match=r"attn_mask: expected a shape broadcastable to \(1, 2, 4, 6\)"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(InputError, match="attn_mask: expected a bool or float tensor"):
        scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 6, dtype=torch.int64))
    with pytest.raises(InputError, match="pass enable_gqa=True"):  # (one key head broadcasts, two do not)
        scaled_dot_product_attention(q.repeat(1, 2, 1, 1), k, v)
    # (no advice to pass enable_gqa to a call that did, nor a ZeroDivisionError for key heads of 0)
    with pytest.raises(InputError, match=r"got query \(1, 6\), key \(1, 2\), value \(1, 4\)$"):
        scaled_dot_product_attention(q.repeat(1, 3, 1, 1), k, v.repeat(1, 2, 1, 1), enable_gqa=True)
    with pytest.raises(InputError, match="with enable_gqa the query heads are groups of the key heads"):
        scaled_dot_product_attention(q[:, :1], k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), enable_gqa=True)
    with pytest.raises(InputError, match=r"key \(1, 0\), value \(1, 0\)$"):
        scaled_dot_product_attention(q, k[:, :0], v[:, :0])
    with pytest.raises(InputError, match="dropout_p: expected a number in"):
        scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(InputError, match=r"query: expected a dense tensor \[\.\.\., rows, E\] of 2 dims or more"):
        scaled_dot_product_attention(q[0, 0, 0], k, v)
    # a scale the kernels cannot take was the default 1/sqrt(E), silently (a learnable one without its gradient)
    with pytest.raises(InputError, match="scale: this tensor requires grad"):
        scaled_dot_product_attention(q, k, v, scale=torch.tensor(0.05, requires_grad=True))
    for scale, shown in (
        (torch.tensor([0.05, 0.3]), "a torch.float32 tensor of shape \\(2,\\)"),
        (0.05j, "0.05j"),
        ("0.1", "'0.1'"),
    ):
        with pytest.raises(InputError, match=f"scale: expected a real number .*, got {shown}"):
            scaled_dot_product_attention(q, k, v, scale=scale)
    with pytest.raises(
        InputError, match=r"dropout_p: expected a number in \[0, 1\], got tensor\(0.1000, requires_grad=True\)"
    ):
        scaled_dot_product_attention(q, k, v, dropout_p=torch.tensor(0.1, requires_grad=True))


def test_what_sdpa_takes_beyond_the_plain_call() -> None:
    """numpy and 0-d tensor numbers for scale and dropout_p, k and v broadcast over q's batch,
    two-dim inputs, and empty sizes (a mask's dim of 0, no heads): as torch's SDPA does (the
    review found each refused, or an IndexError)."""
    import numpy as np

    q, k, v = operands((2, 3), 5, 6)
    check({"scale": np.float32(0.5)}, q, k, v, [q, k, v])
    assert torch.equal(
        scaled_dot_product_attention(q, k, v, scale=np.array(0.3)), scaled_dot_product_attention(q, k, v, scale=0.3)
    )
    check({"scale": torch.tensor(0.25, dtype=torch.float64)}, q, k, v, [q, k, v])
    check({"is_causal": True}, q, k[:1], v[:1], [q, k, v])  # (k, v with batch 1)
    check({}, q[0, 0], k[0, 0], v[0, 0], [q, k, v])  # (two dims: [L, E])
    empty = q[:0]
    assert scaled_dot_product_attention(empty, k[:0], v[:0], attn_mask=torch.ones(5, 6, dtype=torch.bool)).shape == (
        0,
        3,
        5,
        17,
    )
    # no heads, head dims of 0: empty outputs in the graph, zero gradients, as torch's (session
    # 65's review: backward failed on an output without a graph, head dims of 0 were refused)
    for sizes in ((slice(None), slice(0, 0)), (Ellipsis, slice(0, 0)), None):
        # (None: v's head dim alone 0, refused until session 67)
        leaves = [
            t.detach().requires_grad_() for t in ((q[sizes], k[sizes], v[sizes]) if sizes else (q, k, v[..., :0]))
        ]
        out = scaled_dot_product_attention(*leaves)
        want = torch.nn.functional.scaled_dot_product_attention(*(t.detach() for t in leaves))
        assert out.shape == want.shape and out.requires_grad
        out.sum().backward()
        assert all(t.grad is not None and t.grad.shape == t.shape and not t.grad.any() for t in leaves)
    no_keys = scaled_dot_product_attention(q, k[:, :, :0], v[:, :, :0], attn_mask=torch.ones(5, 0, dtype=torch.bool))
    assert no_keys.shape == (2, 3, 5, 17) and not no_keys.any()


def test_what_torch_takes_at_the_edges_of_sdpas_arguments() -> None:
    """dropout_p = 1 (zeros, zero gradients), q and k of head dim 0 under a v of more (every
    score 0, the mask's alone: means of v), and with enable_gqa a key and value of different
    head counts (torch repeats each to the query's heads): as torch's SDPA, where they were
    InputErrors until session 68."""
    q, k, v = operands((2, 6), 5, 7, dim=9)
    bias = torch.randn(5, 7, generator=torch.Generator().manual_seed(3), dtype=torch.float64, requires_grad=True)
    out = scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=1.0)
    assert out.shape == (2, 6, 5, 9) and not out.any()
    assert all(not g.any() for g in torch.autograd.grad(out.sum(), [q, k, v, bias]))
    # (an additive -inf mask, and fp16 operands whose sums overflow: zeros still, not NaN, as
    # torch's; a first version made the zeros from the operands' sums times 0)
    causal = torch.zeros(5, 7, dtype=torch.float64).masked_fill(torch.ones(5, 7, dtype=torch.bool).triu(3), -math.inf)
    assert not scaled_dot_product_attention(q, k, v, attn_mask=causal, dropout_p=1.0).isnan().any()
    wide = [(t.detach() + 2).half().repeat(1, 1, 800, 1).requires_grad_() for t in (q, k, v)]
    out = scaled_dot_product_attention(*wide, dropout_p=1.0)
    assert torch.equal(out, F.scaled_dot_product_attention(*(t.detach() for t in wide), dropout_p=1.0))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in torch.autograd.grad(out.sum(), wide))
    flat = [t[..., :0].detach().requires_grad_() for t in (q, k)]
    check({}, *flat, v, [*flat, v])
    check({"is_causal": True}, *flat, v, [*flat, v])
    check({"attn_mask": bias, "scale": 0.7}, *flat, v, [*flat, v, bias])
    for key_heads, value_heads in ((2, 3), (3, 1), (6, 2)):
        grouped = [t[:, :heads].detach().requires_grad_() for t, heads in ((k, key_heads), (v, value_heads))]
        check({"enable_gqa": True}, q, *grouped, [q, *grouped])
        check({"enable_gqa": True, "is_causal": True}, q, *grouped, [q, *grouped])


def test_nan_in_a_float_mask_gives_nan_rows_as_torch() -> None:
    """A NaN entry of a float attn_mask makes its row NaN in torch; the program's `> -inf` mask
    term dropped the key instead (finite numbers; 0 for an all-NaN row: session 58's review)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 32, generator=gen, dtype=torch.float64) for n in (150, 300, 300))
    mask = torch.zeros(2, 1, 150, 300, dtype=torch.float64)
    mask[..., 200:] = float("-inf")  # (whole tiles of -inf stay skipped)
    mask[1, 0, 7, 250], mask[0, 0, 100, 3], mask[0, 0, 9, :] = float("nan"), float("nan"), float("nan")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert want.isnan().any() and torch.equal(out.isnan(), want.isnan())
    assert torch.allclose(out.nan_to_num(), want.nan_to_num(), atol=1e-12)


def test_a_compiled_call_takes_a_new_scale_and_one_key_head_broadcasts() -> None:
    """Under torch.compile(fullgraph=True) a second scale recompiles with the scale symbolic,
    where `math.isfinite` failed on it ("Unsupported torch.* op returned non-Tensor"); a key
    and value of one head broadcast over the query's heads without enable_gqa, as torch's
    batch dims do (session 60's review: both were errors where torch runs)."""
    q, k, v = operands((2, 3), 9, 11)

    @torch.compile(backend="eager", fullgraph=True)
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        return scaled_dot_product_attention(q, k, v, scale=scale)

    for scale in (0.3, 0.5, 0.7):
        with torch.no_grad():
            want = F.scaled_dot_product_attention(q, k, v, scale=scale)
            torch.testing.assert_close(attend(q, k, v, scale), want, atol=1e-11, rtol=1e-11)
    with pytest.raises(InputError, match="scale: expected a finite number, got inf"):  # (not the program's)
        attend(q, k, v, math.inf)
    one_head = [t[:, :1].detach().requires_grad_() for t in (k, v)]
    check({}, q, *one_head, [q, *one_head])
    check({"is_causal": True, "enable_gqa": True}, q, *one_head, [q, *one_head])


@pytest.mark.parametrize(
    ("q_lead", "k_lead", "v_lead"),
    [
        ((2, 4), (2, 1), (2, 4)),  # k of one head, v of four
        ((2, 4), (2, 4), (2, 1)),
        ((1, 4), (2, 4), (2, 4)),  # q of one batch element
        ((2, 1), (2, 4), (2, 4)),  # q of one head
        ((4,), (2, 4), (2, 4)),  # q of three dims
        ((3, 1, 2), (1, 2, 2), (3, 2, 1)),  # five dims, each broadcasting somewhere
    ],
)
def test_query_key_and_value_broadcast_over_each_others_leading_dims(q_lead, k_lead, v_lead) -> None:
    """torch's SDPA broadcasts the leading dims of q, k and v over each other (its products do);
    the drop-in broadcast k and v over q's batch dims only and refused the rest (session 60's
    known-left list: k of one head beside v of H heads)."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(*q_lead, 7, 9, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(*lead, 11, 9, generator=generator, dtype=torch.float64, requires_grad=True)
        for lead in (k_lead, v_lead)
    )
    check({}, q, k, v, [q, k, v])
    check({"is_causal": True}, q, k, v, [q, k, v])


def test_an_exported_call_reads_every_mask_it_is_given_whatever_the_example_s_strides() -> None:
    """torch.export guards on no strides: exported with an [L, S] mask expanded over B and H
    (stride 0 there), the program read mask[0, 0] of every later mask until session 62 (2.0
    off torch's SDPA for a per-head mask of the same shape); under export the mask's dims are
    chosen by its sizes."""

    class Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return scaled_dot_product_attention(q, k, v, attn_mask=mask)

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    shared = torch.rand(16, 16, generator=generator) > 0.5
    shared[:, 0] = True
    exported = torch.export.export(Attention(), (q, k, v, shared.expand(2, 2, 16, 16))).module()
    per_head = torch.rand(2, 2, 16, 16, generator=generator) > 0.5
    per_head[..., 0] = True
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=per_head)
    torch.testing.assert_close(exported(q, k, v, per_head), want, atol=1e-11, rtol=1e-11)
