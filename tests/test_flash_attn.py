"""FlashAttention's API on attncc (`attncc.integrations.flash_attn`) against float64 attention
written from FlashAttention's documented semantics (its `attention_ref`: scores scaled, soft-
capped, ALiBi -slope * |i + M - N - j| added, the local window row + M - N - left <= col <= row +
M - N + right, causal the window (left, 0)), forward, log-sum-exp and gradients, on shapes that
break naive tilings: N != M both ways (bottom-right causal, fully masked rows), GQA, odd head
dims, packed lengths 0 and 1, a KV cache with appends, shuffled pages."""

from __future__ import annotations

import math

import pytest
import torch

from attncc.errors import InputError
from attncc.integrations.flash_attn import (
    CallOptions,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    flash_program,
)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """out [B, N, H, Dv] and lse [B, H, N] in float64 of q [B, N, H, D], k, v [B, M, Hkv, *];
    rows without a key: out 0, lse -inf."""
    _, n, heads, dim = q.shape
    m, group = k.shape[1], heads // k.shape[2]
    qd = q.double().transpose(1, 2)
    kd, vd = (t.double().repeat_interleave(group, 2).transpose(1, 2) for t in (k, v))
    scores = qd @ kd.transpose(-1, -2) * (dim**-0.5 if scale is None else scale)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    row = torch.arange(n).view(-1, 1) + m - n
    col = torch.arange(m).view(1, -1)
    if alibi is not None:
        slopes = alibi.double().view(-1 if alibi.dim() == 2 else 1, heads, 1, 1)
        scores = scores - slopes * (row - col).abs()
    keep = torch.ones(n, m, dtype=torch.bool)
    left, right = window[0], 0 if causal else window[1]
    if left >= 0:
        keep &= col >= row - left
    if right >= 0:
        keep &= col <= row + right
    scores = scores.masked_fill(~keep, -torch.inf)
    lse = scores.logsumexp(-1)
    out = scores.softmax(-1).nan_to_num() @ vd
    return out.transpose(1, 2), lse


CASES = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"causal": True, "window_size": (5, -1)},
    "two-sided window": {"window_size": (4, 3)},
    "softcap and alibi": {"causal": True, "softcap": 2.0, "alibi": "H"},
    "alibi per sequence": {"alibi": "B, H", "softmax_scale": 0.3},
}


def call_args(case: dict, batch: int, heads: int) -> dict:
    args = {key: value for key, value in case.items() if key != "alibi"}
    if "alibi" in case:
        shape = (heads,) if case["alibi"] == "H" else (batch, heads)
        args["alibi_slopes"] = (
            torch.rand(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) + 0.1
        ).requires_grad_()
    return args


def reference_args(args: dict) -> dict:
    names = {"softmax_scale": "scale", "window_size": "window", "alibi_slopes": "alibi"}
    return {names.get(key, key): value for key, value in args.items()}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("n", "m"), [(37, 53), (53, 37), (1, 20)])
def test_flash_attn_func_forward_lse_and_gradients(case: str, n: int, m: int) -> None:
    generator = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, dim = 2, 4, 2, 17
    q = torch.randn(batch, n, heads, dim, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(batch, m, kv_heads, dim, generator=generator, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    args = call_args(CASES[case], batch, heads)
    out, lse, probs = flash_attn_func(q, k, v, return_attn_probs=True, **args)
    want, want_lse = reference(q, k, v, **reference_args(args))
    assert probs is None and out.shape == (batch, n, heads, dim) and out.is_contiguous()
    torch.testing.assert_close(out, want, atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(lse, want_lse, atol=1e-11, rtol=1e-11)
    leaves = [q, k, v] + ([args["alibi_slopes"]] if "alibi_slopes" in args else [])
    grad = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad)
    expected = torch.autograd.grad(want, leaves, grad)
    for name, a, b in zip(("q", "k", "v", "alibi_slopes"), got, expected):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize("case", ["causal", "two-sided window", "softcap and alibi", "alibi per sequence"])
def test_flash_attn_varlen_func_is_each_sequence_alone(case: str) -> None:
    """Packed sequences of 3 / 0 / 1 / 20 queries against 5 / 4 / 0 / 20 keys: each sequence's
    rows equal the padded call on that sequence alone (its own N and M: bottom-right causal)."""
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 4, 2, 16
    lengths_q, lengths_k = [3, 0, 1, 20], [5, 4, 0, 20]
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (lengths_q, lengths_k)
    )
    q = torch.randn(sum(lengths_q), heads, dim, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(sum(lengths_k), kv_heads, dim, generator=generator, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    args = call_args(CASES[case], len(lengths_q), heads)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20, return_attn_probs=True, **args)
    assert lse.shape == (heads, sum(lengths_q))
    wants, want_lses = [], []
    for b in range(len(lengths_q)):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        alibi = reference_args(args).get("alibi")
        alibi = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
        want, want_lse = reference(
            q[None, rows], k[None, cols], v[None, cols], **{**reference_args(args), "alibi": alibi}
        )  # fmt: skip
        wants.append(want[0])
        want_lses.append(want_lse[0])
    want, want_lse = torch.cat(wants), torch.cat(want_lses, 1)
    torch.testing.assert_close(out, want, atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(lse, want_lse, atol=1e-11, rtol=1e-11)
    leaves = [q, k, v] + ([args["alibi_slopes"]] if "alibi_slopes" in args else [])
    got = torch.autograd.grad(out.sum(), leaves)
    expected = torch.autograd.grad(want.sum(), leaves)
    for name, a, b in zip(("q", "k", "v", "alibi_slopes"), got, expected):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=name)


def test_varlen_rows_past_the_last_offset_belong_to_no_sequence() -> None:
    """Buffers padded past cu_seqlens' last offsets (servers keep a fixed size for CUDA graphs;
    FlashAttention leaves those rows alone) were refused; their out is 0, their lse -inf and
    they get no gradient, the sequences' rows are those of the exact buffers. A 0-d tensor
    max_seqlen is its value (it was refused, "expected an int >= ..., got tensor(9)")."""
    generator = torch.Generator().manual_seed(2)
    cu_q, cu_k = torch.tensor([0, 4, 13], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    q = torch.randn(13 + 3, 4, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(9 + 2, 2, 16, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, lse, _ = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, torch.tensor(9), torch.tensor(6), causal=True, return_attn_probs=True
    )  # fmt: skip
    assert out.shape == (16, 4, 16) and lse.shape == (4, 16)
    for b in range(2):
        rows, cols = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want, want_lse = reference(q[None, rows], k[None, cols], v[None, cols], causal=True)
        torch.testing.assert_close(out[rows], want[0], atol=1e-11, rtol=1e-11)
        torch.testing.assert_close(lse[:, rows], want_lse[0], atol=1e-11, rtol=1e-11)
    assert torch.equal(out[13:], torch.zeros(3, 4, 16, dtype=torch.float64)) and bool(lse[:, 13:].isneginf().all())
    dq, dk, dv = torch.autograd.grad(out.sum(), [q, k, v])
    assert not dq[13:].any() and not dk[9:].any() and not dv[9:].any() and dq[:13].abs().sum() > 0


@pytest.mark.parametrize("paged", [False, True])
def test_flash_attn_with_kvcache_appends_and_attends(paged: bool) -> None:
    """Two new tokens per sequence appended into a cache holding 5 / 0 / 17 tokens (rows of the
    contiguous cache picked by cache_batch_idx, or shuffled pages of 8), then two queries per
    sequence attend causally over what is held: the cache holds the new rows afterwards, and
    out and lse equal float64 attention over each sequence's keys."""
    generator = torch.Generator().manual_seed(2)
    batch, heads, kv_heads, dim, capacity, new = 3, 4, 2, 16, 24, 2
    held = torch.tensor([5, 0, 17], dtype=torch.int32)
    q = torch.randn(batch, new, heads, dim, generator=generator, dtype=torch.float64)
    k_new, v_new = (torch.randn(batch, new, kv_heads, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    if paged:
        pages = torch.randperm(batch * capacity // 8, generator=generator)
        table = pages.view(batch, capacity // 8).to(torch.int32)
        k_cache, v_cache = (
            torch.randn(len(pages), 8, kv_heads, dim, generator=generator, dtype=torch.float64) for _ in range(2)
        )
        rows_of = lambda cache, b: cache[table[b].long()].reshape(-1, kv_heads, dim)  # noqa: E731
        placement = {"block_table": table}
    else:
        order = torch.tensor([2, 0, 1])
        k_cache, v_cache = (
            torch.randn(batch, capacity, kv_heads, dim, generator=generator, dtype=torch.float64) for _ in range(2)
        )
        rows_of = lambda cache, b: cache[order[b]]  # noqa: E731
        placement = {"cache_batch_idx": order}
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=held, causal=True, return_softmax_lse=True, **placement
    )  # fmt: skip
    for b in range(batch):
        keys = int(held[b]) + new
        torch.testing.assert_close(rows_of(k_cache, b)[int(held[b]) : keys], k_new[b])
        want, want_lse = reference(
            q[b : b + 1], rows_of(k_cache, b)[None, :keys], rows_of(v_cache, b)[None, :keys], causal=True
        )  # fmt: skip
        torch.testing.assert_close(out[b], want[0], atol=1e-11, rtol=1e-11)
        torch.testing.assert_close(lse[b], want_lse[0], atol=1e-11, rtol=1e-11)


def test_decoding_against_a_full_cache_with_a_window_and_softcap() -> None:
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 8, 32, generator=generator)
    k_cache, v_cache = (torch.randn(2, 40, 2, 32, generator=generator) for _ in range(2))
    out = flash_attn_with_kvcache(q, k_cache, v_cache, causal=True, window_size=(7, 0), softcap=3.0, cache_seqlens=33)
    want, _ = reference(q, k_cache[:, :33], v_cache[:, :33], causal=True, window=(7, 0), softcap=3.0)
    torch.testing.assert_close(out, want.float(), atol=2e-6, rtol=2e-6)
    whole = flash_attn_with_kvcache(q, k_cache, v_cache)
    torch.testing.assert_close(whole, reference(q, k_cache, v_cache)[0].float(), atol=2e-6, rtol=2e-6)


def test_packed_operand_forms_are_the_unpacked_calls_with_gradients_into_the_pack() -> None:
    generator = torch.Generator().manual_seed(6)
    qkv = torch.randn(2, 9, 3, 4, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.unbind(2)
    want = reference(q, k, v, causal=True)[0]
    torch.testing.assert_close(out, want, atol=1e-11, rtol=1e-11)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), qkv)[0], torch.autograd.grad(want.sum(), qkv)[0])
    kv = torch.randn(2, 11, 2, 2, 16, generator=generator, dtype=torch.float64)
    torch.testing.assert_close(
        flash_attn_kvpacked_func(q, kv, window_size=(3, 2)), reference(q, *kv.unbind(2), window=(3, 2))[0]
    )
    offsets = torch.tensor([0, 4, 9], dtype=torch.int32)
    flat = qkv.detach()[0]
    packed = flash_attn_varlen_qkvpacked_func(flat, offsets, 5, causal=True)
    for b in range(2):
        rows = slice(offsets[b], offsets[b + 1])
        torch.testing.assert_close(packed[rows], reference(*(flat[None, rows, n] for n in range(3)), causal=True)[0][0])
    kv_packed = flash_attn_varlen_kvpacked_func(flat[:, 0], flat[:, 1:], offsets, offsets, causal=True)
    torch.testing.assert_close(kv_packed, packed)


def test_dropout_is_the_made_programs_under_torch_seed() -> None:
    """dropout_p > 0 runs the program with `dropout(p, dropout_p)` (golden-tested with its keep
    mask elsewhere), its bits from torch's generator: the same seed, the same output."""
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 32, 2, 16, generator=generator) for _ in range(3))
    torch.manual_seed(7)
    first = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(7)
    again = flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    assert torch.equal(first, again)
    assert (first - flash_attn_func(q, k, v, causal=True)).abs().max() > 0.05
    text = flash_program(CallOptions(True, False, False, False, None, True))
    assert "p = dropout(p, " in text and "mask j <= i + M - N" in text
    # each call's rate, through v = identity (the output is the dropped weights): zeros at the
    # rate, the kept weights softmax / (1 - p); one program for every rate (the call's dropout_p)
    q, k = (torch.randn(1, 96, 4, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    eye = torch.eye(96, dtype=torch.float64).view(1, 96, 1, 96).expand(1, 96, 4, 96)
    scores = torch.einsum("bnhd,bmhd->bhnm", q, k) / 4
    weights = torch.softmax(scores.masked_fill(torch.ones(96, 96, dtype=torch.bool).triu(1), -math.inf), -1)
    for rate in (0.3, 0.55):
        dropped = flash_attn_func(q, k, eye, dropout_p=rate, causal=True).transpose(1, 2)
        kept, visible = dropped != 0, weights != 0
        assert abs(1 - kept.sum().item() / visible.sum().item() - rate) < 0.02, rate  # (18624 draws)
        torch.testing.assert_close(dropped[kept], weights[kept] / (1 - rate), atol=1e-15, rtol=1e-13)


def test_bad_calls_name_the_argument() -> None:
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(InputError, match=r"window_size: expected \(left, right\), two ints >= -1"):
        flash_attn_func(q, q, q, window_size=(3,))
    with pytest.raises(InputError, match="softcap: expected a finite number >= 0"):
        flash_attn_func(q, q, q, softcap=-1.0)
    with pytest.raises(InputError, match="dropout_p: expected a number in"):
        flash_attn_func(q, q, q, dropout_p=1.0)
    with pytest.raises(InputError, match=r"alibi_slopes: expected a float tensor \[H=2\] or \[B=1, H=2\], got \(3,\)"):
        flash_attn_func(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(InputError, match=r"q: expected a 4-d tensor \[B, N, H, D\]"):
        flash_attn_func(q[0], q, q)
    with pytest.raises(InputError, match="block_table: a paged cache in the varlen call has no attncc mapping"):
        flash_attn_varlen_func(
            q[0], q[0], q[0], torch.tensor([0, 4]), torch.tensor([0, 4]), block_table=torch.zeros(1, 1)
        )
    with pytest.raises(InputError, match="rotary_cos: has no attncc mapping here"):
        flash_attn_with_kvcache(q, q, q, rotary_cos=torch.ones(4, 8))
    with pytest.raises(InputError, match="cache_seqlens: needed to append k and v"):
        flash_attn_with_kvcache(q, q, q, q[:, :1], q[:, :1])
    with pytest.raises(InputError, match=r"^k, v: give both new keys and values to append, or neither$"):
        flash_attn_with_kvcache(q, q, q, q[:, :1], None, cache_seqlens=1)  # (named the paged call's k_new, v_new)
    cache = torch.randn(3, 24, 2, 16)
    with pytest.raises(InputError, match=r"cache_batch_idx: rows \[0, 7\] of a cache of 3 sequences"):
        flash_attn_with_kvcache(
            q.expand(2, -1, -1, -1), cache, cache, cache_seqlens=4, cache_batch_idx=torch.tensor([0, 7])
        )
    with pytest.raises(
        InputError, match=r"cache_seqlens: a sequence holds 24 keys \+ 1 appended, beyond the cache's 24"
    ):
        flash_attn_with_kvcache(q[:, :1], cache, cache, q[:, :1, :1], q[:, :1, :1], cache_seqlens=torch.tensor([24]))
    with pytest.raises(InputError, match=r"k, v: expected \[B, M, Hkv, D\] with the same leading sizes"):
        flash_attn_func(q, q, q[:, :3])
    # (a one-element tensor was every sequence's length: FlashAttention takes an int or [B])
    # (a contiguous cache's lengths are told in its terms: they spoke of the one-page-per-sequence
    # block_table made for the paged call, which the caller never passed; session 64's review)
    with pytest.raises(
        InputError, match=r"cache_seqlens: expected an int tensor \[B=2\] \(q's batch\) or an int, got shape \(1,\)"
    ):
        flash_attn_with_kvcache(q.expand(2, -1, -1, -1), cache[:2], cache[:2], cache_seqlens=torch.tensor([5]))
    with pytest.raises(InputError, match=r"^cache_seqlens: a sequence holds -1 keys, expected 0 or more$"):
        flash_attn_with_kvcache(q.expand(2, -1, -1, -1), cache[:2], cache[:2], cache_seqlens=torch.tensor([-1, 2]))
    # (a softmax_scale tensor requiring grad was told to declare a DSL input: the scale's own name and API now)
    learnable = torch.tensor(0.3, requires_grad=True)
    for call in (
        lambda: flash_attn_func(q, q, q, softmax_scale=learnable),
        lambda: flash_attn_varlen_func(
            q[0], q[0], q[0], torch.tensor([0, 4]), torch.tensor([0, 4]), softmax_scale=learnable
        ),
    ):  # (flash_attn_with_kvcache is forward only, as FlashAttention's: it takes the value)
        with pytest.raises(InputError, match=r"^softmax_scale: this tensor requires grad, but flash_attn takes"):
            call()
    with pytest.raises(InputError, match=r"^softmax_scale: expected a finite number, got nan"):
        flash_attn_func(q, q, q, softmax_scale=math.nan)
    with pytest.raises(InputError, match="cache_batch_idx: goes with a contiguous cache"):
        flash_attn_with_kvcache(
            q, q, q, block_table=torch.zeros(1, 1, dtype=torch.int32), cache_batch_idx=torch.zeros(1)
        )
    # (session 66's review: a bare ValueError from unbind; an index on another device named as
    # block_table, which the caller never passed; the kernels' [B, H, M, D] shape in the head
    # count's error; "must equal" where fewer rows than q's are a padded buffer, accepted)
    for call, message in (
        (lambda: flash_attn_qkvpacked_func(torch.randn(2, 5, 2, 4, 8)), r"qkv: expected \[B, N, 3, H, D\] \(3 stacked"),
        (lambda: flash_attn_kvpacked_func(q, torch.randn(1, 5, 3, 2, 16)), r"kv: expected \[B, M, 2, Hkv, D\] \(2 stacked"),
        (lambda: flash_attn_varlen_qkvpacked_func(torch.randn(4, 2, 2, 16), torch.tensor([0, 4])), r"qkv: expected \[total, 3"),
        (lambda: flash_attn_varlen_kvpacked_func(q[0], torch.randn(4, 3, 2, 16), torch.tensor([0, 4]), torch.tensor([0, 4])), r"kv: expected \[total_k, 2"),
        (lambda: flash_attn_with_kvcache(q[:, :1], cache[:1], cache[:1], cache_seqlens=3, cache_batch_idx=torch.zeros(1, dtype=torch.int64, device="meta")), r"^cache_batch_idx: expected device cpu \(that of q\), got meta$"),
        (lambda: flash_attn_func(q, q[:, :, :0], q[:, :, :0]), r"^k: expected at least one key/value head, got \(1, 4, 0, 16\) \(\[B, M, Hkv, D\]\)$"),
        (lambda: flash_attn_with_kvcache(q, cache[:, :, :0], cache[:, :, :0], cache_seqlens=3), r"^k_cache: expected at least one key/value head, got \(3, 24, 0, 16\)"),
        (lambda: flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 5]), torch.tensor([0, 4])), r"^cu_seqlens_q: the last offset 5 is beyond q's 4 rows \(expected at most them\)$"),
        (lambda: flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 4]), torch.tensor([0, 6])), r"^cu_seqlens_k: the last offset 6 is beyond k's 4 rows"),
    ):  # fmt: skip
        with pytest.raises(InputError, match=message):
            call()


def test_flash_attn_varlen_func_under_torch_compile_fullgraph() -> None:
    """The trim of rows past the last offset reads the offset's value: while dynamo traces, the
    rows past the last offsets are one more sequence whose rows get out 0 and lse -inf (until
    session 62 the op refused a padded buffer under torch.compile: "the last offset 10 must equal
    q's rows, 13"). Padded q and k, alibi per sequence, lse and gradients as the eager call's."""
    generator = torch.Generator().manual_seed(9)
    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    q = torch.randn(13, 4, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(11, 2, 16, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2))
    slopes = (torch.rand(2, 4, generator=generator, dtype=torch.float64) + 0.1).requires_grad_()

    def call(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, slopes: torch.Tensor
    ) -> tuple:
        return flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, 6, 6, causal=True, alibi_slopes=slopes, return_attn_probs=True
        )

    compiled = torch.compile(call, fullgraph=True, backend="eager")
    results = [f(q, k, v, cu_q, cu_k, slopes)[:2] for f in (call, compiled)]
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert not results[1][0][10:].any() and bool(results[1][1][:, 10:].isneginf().all())
    grads = [torch.autograd.grad(out.sum() + lse[:, :10].sum(), [q, k, v, slopes]) for out, lse in results]
    for got, want in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_flash_attn_with_kvcache_decodes_in_one_graph() -> None:
    """A decoding loop under torch.compile(fullgraph=True): a contiguous cache's checks read
    cache_batch_idx and cache_seqlens on the host (a data-dependent guard: fullgraph failed, and
    torch.export), and an int cache_seqlens of a paged cache was specialised, a graph per step
    (the 9th a hard failure). One graph past the first recompile now; outputs and the cache
    appended in place as the eager calls'."""
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 1, 4, 16, generator=generator)
    caches = [torch.randn(2, 16, 2, 16, generator=generator) for _ in range(2)]
    pages = [torch.randn(8, 4, 2, 16, generator=generator) for _ in range(2)]
    table = torch.randperm(8, generator=generator).view(2, 4).int()

    def contiguous(
        q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        return flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lengths, causal=True)

    def paged(
        q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor, length: int
    ) -> torch.Tensor:
        return flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=length, block_table=table, causal=True)

    for step, cache, length in ((contiguous, caches, lambda t: torch.tensor([3, 7]) + t), (paged, pages, int)):
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        compiled = torch.compile(step, fullgraph=True, backend="eager")
        ours, eager = [t.clone() for t in cache], [t.clone() for t in cache]
        for t in range(9):
            new = [torch.randn(2, 1, 2, 16, generator=generator) for _ in range(2)]
            got = compiled(q, *ours, *new, length(t))
            torch.testing.assert_close(got, step(q, *eager, *new, length(t)), atol=1e-6, rtol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(ours, eager))
        assert counters["stats"]["unique_graphs"] <= 2, step.__name__


def test_flash_attn_func_under_torch_compile_fullgraph() -> None:
    """A made kernel is looked up without the lock on a hit (dynamo refused the lock's context
    manager: fullgraph failed for every call)."""
    generator = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 16, 2, 16, generator=generator) for _ in range(3))
    want = flash_attn_func(q, k, v, causal=True, softcap=2.0)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True, softcap=2.0), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), want, atol=1e-6, rtol=1e-6)
    # dynamic sizes: the softcap's check was math.isfinite, which dynamo refused of a traced number
    torch._dynamo.reset()
    dynamic = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, causal=True), fullgraph=True, dynamic=True)
    for rows in (16, 9):
        x = q[:, :rows]
        torch.testing.assert_close(dynamic(x, x, x), flash_attn_func(x, x, x, causal=True), atol=1e-6, rtol=1e-6)


def test_numpy_numbers_are_numbers() -> None:
    """np.float32 for dropout_p and softcap was refused (np.float64, a float subclass, was taken)."""
    import numpy as np

    generator = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 12, 2, 16, generator=generator) for _ in range(3))
    want = flash_attn_func(q, k, v, causal=True, softcap=30.0, dropout_p=0.0)
    got = flash_attn_func(q, k, v, causal=True, softcap=np.float32(30.0), dropout_p=np.float32(0.0))
    assert torch.equal(got, want)


def test_a_zero_window_a_paged_table_without_lengths_and_compiled_rows_past_the_offsets() -> None:
    """window_size=(0, 0): each query sees its own key alone (out = v), where `left > 0` for
    `>= 0` made it an error; a paged cache without cache_seqlens is every page of the table
    full (one page's rows taken for the whole: 1.26 off); a compiled non-causal packed call
    zeroes the rows past the last offset (`<=` there left one: 1.86 off); each against float64
    written here."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(flash_attn_func(q, k, v, window_size=(0, 0)), v, atol=1e-12, rtol=0)

    k_cache, v_cache = (torch.randn(6, 4, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    table = torch.tensor([[3, 1, 5]], dtype=torch.int32)
    query = torch.randn(1, 1, 2, 16, generator=gen, dtype=torch.float64)
    keys, values = (c[table[0].long()].flatten(0, 1) for c in (k_cache, v_cache))  # [12, 2, 16]
    weights = torch.softmax(torch.einsum("hd,mhd->hm", query[0, 0], keys) / 4, -1)
    want = torch.einsum("hm,mhd->hd", weights, values)
    got = flash_attn_with_kvcache(query, k_cache, v_cache, block_table=table)
    torch.testing.assert_close(got[0, 0], want, atol=1e-12, rtol=0)

    cu_q, cu_k = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 6, 9], dtype=torch.int32)
    q = torch.randn(13, 4, 16, generator=gen, dtype=torch.float64)  # rows 10-12: no sequence's
    k, v = (torch.randn(11, 2, 16, generator=gen, dtype=torch.float64) for _ in range(2))

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, causal=False)

    compiled = torch.compile(call, fullgraph=True, backend="eager")(q, k, v, cu_q, cu_k)
    want = torch.zeros(13, 4, 16, dtype=torch.float64)
    for b in range(2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        kb, vb = (t[keys].repeat_interleave(2, 1) for t in (k, v))
        weights = torch.softmax(torch.einsum("nhd,mhd->hnm", q[rows], kb) / 4, -1)
        want[rows] = torch.einsum("hnm,mhd->nhd", weights, vb)
    torch.testing.assert_close(compiled, want, atol=1e-12, rtol=0)
