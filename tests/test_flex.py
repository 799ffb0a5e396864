"""FlexAttention's score and mask functions on attncc (`attncc.integrations.flex`).

The references call the same Python functions at every (b, h, q_idx, kv_idx) under torch.vmap
in float64, as Flex's own eager path evaluates them, so they do not go through the tracer under
test; one case is also checked against torch's
`flex_attention` itself."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import attncc
from attncc.errors import FlexTraceError, InputError
from attncc.frontend.flex import flex_program
from attncc.integrations import flex as flex_integration
from attncc.integrations.flex import flex_attention

B, H, HKV, N, M, D = 2, 4, 2, 37, 53, 17
GEN = torch.Generator().manual_seed(3)
SLOPES = torch.rand(H, generator=GEN, dtype=torch.float64)
BIAS = torch.randn(H, N, M, generator=GEN, dtype=torch.float64) * 0.5
TEMPERATURE = torch.tensor(0.7, dtype=torch.float64)
DOC = torch.randint(0, 3, (B, 64), generator=GEN).sort(-1).values
LENGTHS = torch.tensor([0, 41])  # the first sequence has no keys: every row fully masked
T5_TABLE = torch.randn(32, H, generator=GEN, dtype=torch.float64)
KINKS = torch.tensor([0.0, 0.5, -0.5, 0.0, 2.0, -1.0], dtype=torch.float64)  # (zeros: a bias's usual start)
LEARNED = {"slopes": SLOPES, "bias": BIAS, "temperature": TEMPERATURE, "t5_table": T5_TABLE, "kinks": KINKS}


def softcap(score, b, h, q_idx, kv_idx):
    return torch.tanh(score / 2.5) * 2.5


def alibi(score, b, h, q_idx, kv_idx):
    return score - slopes[h] * (q_idx - kv_idx).abs()


def geometric_alibi(score, b, h, q_idx, kv_idx):
    return score + torch.exp2(-((h + 1) * 8.0 / H)) * (kv_idx - q_idx)


def relative_bias(score, b, h, q_idx, kv_idx):
    return score + bias[h][q_idx, kv_idx]


def reversed_temperature(score, b, h, q_idx, kv_idx):
    # (a 0-d tensor and constants on the left: Tensor.__sub__, Traced.__rtruediv__, __rsub__, __rpow__)
    return temperature - score * temperature + 1.0 / (2.0 + (q_idx - kv_idx).abs()) - 2.0 ** (-(h + 1.0))


def integer_idioms(score, b, h, q_idx, kv_idx):
    # (C's remainder and division toward zero, method spellings, float powers, torch.max of two)
    distance = q_idx.sub(kv_idx)
    bias = torch.fmod(distance, 5) * 0.1 + torch.div(distance, 4, rounding_mode="trunc").to(score.dtype).mul(0.05)
    return torch.max(score, torch.full_like(score, -0.5)) + bias + torch.sign(score) * score**2.0 * 0.01


def clamped_distance(score, b, h, q_idx, kv_idx):
    return torch.where(q_idx % 3 == 0, score, torch.clamp(score, min=-0.5, max=0.5)) + (q_idx - kv_idx) // 4 * 0.01


def t5_bucket(relative_position, num_buckets=32, max_distance=128):
    # transformers' T5Attention._relative_position_bucket (bidirectional), verbatim: a float
    # log truncated to an integer by .to(torch.long), a torch.where between its two branches
    relative_buckets = 0
    num_buckets //= 2
    relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
    relative_position = torch.abs(relative_position)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


def t5_bias(score, b, h, q_idx, kv_idx):
    return score + t5_table[t5_bucket(kv_idx - q_idx, max_distance=24), h]


def bias_alone(score, b, h, q_idx, kv_idx):
    # (new scores that do not read the old: q and k get no gradient)
    return bias[h][q_idx, kv_idx] * 2.0


def bottom_right_causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx + (M - N)


def document_causal(b, h, q_idx, kv_idx):
    return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx) | (kv_idx == 0)


def key_padding(b, h, q_idx, kv_idx):
    return kv_idx < lengths[b]


def window_or_not_sink(b, h, q_idx, kv_idx):
    return ~((q_idx - kv_idx).abs() > 6) ^ (kv_idx == 1)


def first_key(b, h, q_idx, kv_idx):
    return kv_idx == 0


def torch_spellings(score, b, h, q_idx, kv_idx):
    # torch.pow of a constant base, add's alpha, F.relu's inplace flag, masked_fill (refused until session 63)
    slope = torch.pow(2.0, -(h + 1) * 0.5)
    shifted = torch.sub(torch.add(score, (q_idx - kv_idx).abs(), alpha=-0.1), slope, alpha=2)
    return torch.nn.functional.relu(shifted + 1.0, inplace=False).masked_fill(q_idx == kv_idx, 0.25)


def exact_powers(b, h, q_idx, kv_idx):
    # torch.pow of an int base is exact (exp(x log 2) gave 7.999999999999998 for 2 ** 3); add of
    # two bools with alpha=1 stays bool (or), as torch's (the review of session 63)
    return torch.add((q_idx - kv_idx).abs() != torch.pow(2, h + 1), q_idx == kv_idx, alpha=1)


def bool_arithmetic(score, b, h, q_idx, kv_idx):
    # two bools' sum and product, minimum and maximum are bool in torch (or, and): 1 + 1 made 2
    return score + ((q_idx >= kv_idx) + (kv_idx == 0)) * 1.5 + torch.minimum(q_idx % 2 == 0, kv_idx % 3 == 0) * 0.25


def bool_products(b, h, q_idx, kv_idx):
    return torch.maximum((q_idx >= kv_idx) * (kv_idx % 2 == 0), kv_idx == 1)


def kinked(score, b, h, q_idx, kv_idx):
    # relu and clamp at their kinks take torch's gradients there (relu 0, clamp's bound 1, a
    # bound above the other: none), not max's and min's halves (session 66's review: a bias
    # clamped at 0 from zeros got half its gradient); narrow int conversions wrap as torch's
    x = kinks[kv_idx % 6]
    clamped = torch.clamp(x, min=0.0, max=0.5) + x.clamp_max(0.0) + torch.clamp(x, min=1.0, max=-1.0) * 0.25
    wrapped = (q_idx - kv_idx).to(torch.uint8) * 0.01 + (kv_idx * 20).to(torch.int8) * 0.001
    # (`.to(score)` takes the score's dtype: two bools converted so add as numbers, not `or`)
    counted = ((q_idx >= kv_idx).to(score) + (kv_idx % 2 == 0).to(score)) * 0.5
    return score + torch.relu(x) - torch.nn.functional.relu(-x) * 0.5 + clamped + wrapped + counted


slopes, bias, temperature, doc, lengths, t5_table, kinks = SLOPES, BIAS, TEMPERATURE, DOC, LENGTHS, T5_TABLE, KINKS
flex = pytest.importorskip("torch.nn.attention.flex_attention")
# torch's combinators (b.new_ones((), dtype=torch.bool) & ...) and its no-op mask
COMPOSED = flex.or_masks(flex.and_masks(document_causal, key_padding), first_key)

VARIANTS = [
    (softcap, None),
    (alibi, bottom_right_causal),
    (geometric_alibi, document_causal),
    (relative_bias, key_padding),
    (reversed_temperature, window_or_not_sink),
    (clamped_distance, None),
    (None, document_causal),
    (alibi, COMPOSED),
    (softcap, flex.noop_mask),
    (integer_idioms, None),
    (t5_bias, key_padding),
    (bias_alone, bottom_right_causal),
    (bool_arithmetic, bool_products),
    (torch_spellings, exact_powers),
    (kinked, None),
]


def over_every_score(fn, leading: int):
    """fn evaluated at every (b, h, q_idx, kv_idx), each a 0-d tensor as Flex hands them over
    (torch.vmap over the four indices, the score's too where `leading` is 1)."""
    for axis in reversed(range(4)):
        fn = torch.vmap(fn, in_dims=(0,) * leading + tuple(0 if d == axis else None for d in range(4)))
    return fn


def reference(q, k, v, score_mod, mask_mod, scale=None):
    """float64 attention with the functions evaluated at every score."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    indices = [torch.arange(n) for n in s.shape]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # (float constants times integer indices: float64, as attncc's)
    try:
        if score_mod is not None:
            s = over_every_score(score_mod, 1)(s, *indices)
        if mask_mod is not None:
            s = s.masked_fill(~over_every_score(mask_mod, 0)(*indices), -math.inf)
    finally:
        torch.set_default_dtype(default)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]).nan_to_num(0.0) @ v, lse


def loss(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    return (out * weights).sum() + lse.masked_fill(torch.isinf(lse), 0).sin().sum()


def leaves(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(11)
    return tuple(
        torch.randn(*shape, generator=gen, dtype=dtype).requires_grad_()
        for shape in ((B, H, N, D), (B, HKV, M, D), (B, HKV, M, D))
    )


@pytest.mark.parametrize("score_mod, mask_mod", VARIANTS, ids=lambda f: getattr(f, "__name__", "none"))
def test_flex_functions_run_as_torch_evaluates_them(score_mod, mask_mod, monkeypatch) -> None:
    """Forward, lse and gradients of q, k, v and of every float tensor the functions read,
    at GQA 4/2, N = 37 against M = 53 keys, an odd head dim and fully masked rows."""
    for name, t in LEARNED.items():
        monkeypatch.setitem(globals(), name, t.clone().requires_grad_())
    q, k, v = leaves(torch.float64)
    out, lse = flex_attention(q, k, v, score_mod, mask_mod=mask_mod, enable_gqa=True, return_lse=True)
    read = [globals()[name] for name in LEARNED]
    got = torch.autograd.grad(loss(out, lse), (q, k, v, *read), allow_unused=True)
    want_out, want_lse = reference(q, k, v, score_mod, mask_mod)
    want = torch.autograd.grad(loss(want_out, want_lse), (q, k, v, *read), allow_unused=True)
    assert torch.allclose(out, want_out, atol=1e-12)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    assert torch.allclose(lse.masked_fill(torch.isinf(lse), 0), want_lse.masked_fill(torch.isinf(want_lse), 0))
    for g, w in zip(got, want):
        if w is None:  # (q and k of scores that ignore them: zeros, or none)
            assert g is None or not g.any()
        else:
            assert g is not None and torch.allclose(g, w, atol=1e-10)
    if mask_mod is key_padding:
        assert (out[0] == 0).all() and torch.isneginf(lse[0]).all()
    if mask_mod is flex.noop_mask:
        assert "\nmask " not in flex_program(score_mod, mask_mod).source


def test_the_same_call_as_torch_flex_attention_with_a_block_mask() -> None:
    """fp32, a BlockMask from create_block_mask, scale given: torch's own flex_attention (its
    eager path) and attncc's agree."""
    q, k, v = (t.detach().float() for t in leaves(torch.float32))
    q = q[:, :, :, :16].contiguous()
    k, v = (t[:, :, :37, :16].contiguous() for t in (k, v))
    mask = flex.create_block_mask(document_causal, B, None, 37, 37, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's eager path warns that it is not compiled)
        want, want_lse = flex.flex_attention(
            q, k, v, softcap, block_mask=mask, scale=0.3, enable_gqa=True, return_lse=True
        )
    out, lse = flex_attention(q, k, v, softcap, block_mask=mask, scale=0.3, enable_gqa=True, return_lse=True)
    assert torch.allclose(out, want, atol=2e-6)
    assert torch.allclose(lse, want_lse, atol=2e-6)
    again, aux = flex_attention(
        q, k, v, softcap, block_mask=mask, scale=0.3, enable_gqa=True, return_aux=flex.AuxRequest(lse=True)
    )
    assert torch.equal(again, out) and torch.equal(aux.lse, lse)
    with pytest.raises(InputError, match="max_scores is not kept"):
        flex_attention(q, k, v, softcap, block_mask=mask, enable_gqa=True, return_aux=flex.AuxRequest(max_scores=True))
    # torch refuses both (ValueError, as InputError is); return_lse was dropped, silently
    with pytest.raises(ValueError, match="return_lse and return_aux: give one"):
        flex_attention(
            q, k, v, block_mask=mask, enable_gqa=True, return_lse=True, return_aux=flex.AuxRequest(lse=False)
        )


def test_a_given_scale_reaches_every_return_form() -> None:
    """scale= (0.0 too: every key alike, as torch's Flex takes it; 0.0 is no "not given") is
    the call's whatever it returns: out alone, with return_lse, with return_aux of the lse or of
    nothing; against float64 torch."""
    q, k, v = (t.detach() for t in leaves(torch.float64))
    for scale in (0.3, 0.0):
        want, want_lse = reference(q, k, v, softcap, None, scale=scale)
        out = flex_attention(q, k, v, softcap, scale=scale, enable_gqa=True)
        with_lse, lse = flex_attention(q, k, v, softcap, scale=scale, enable_gqa=True, return_lse=True)
        with_aux, aux = flex_attention(
            q, k, v, softcap, scale=scale, enable_gqa=True, return_aux=flex.AuxRequest(lse=True)
        )
        bare, nothing = flex_attention(
            q, k, v, softcap, scale=scale, enable_gqa=True, return_aux=flex.AuxRequest(lse=False)
        )
        assert nothing.lse is None
        for got in (out, with_lse, with_aux, bare):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=str(scale))
        for got in (lse, aux.lse):
            torch.testing.assert_close(got, want_lse, atol=1e-12, rtol=0, msg=str(scale))


def test_a_block_mask_made_for_other_batch_or_heads_is_a_clear_error() -> None:
    """A BlockMask of create_block_mask(B=2, H=2) given a call of 3 sequences or 4 heads: the
    argument and both sizes named (a broadcast RuntimeError from inside until session 58)."""
    mask = flex.create_block_mask(
        lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + b, 2, 2, 37, 53, device="cpu", BLOCK_SIZE=16
    )
    gen = torch.Generator().manual_seed(0)
    for batch, heads, what in ((3, 2, "B=2 .* the call has B=3"), (2, 4, "H=2 .* the call has H=4")):
        q, k, v = (torch.randn(batch, heads, n, 16, generator=gen) for n in (37, 53, 53))
        with pytest.raises(InputError, match=f"block_mask: made for {what}"):
            flex_attention(q, k, v, block_mask=mask)
    q, k, v = (torch.randn(2, 2, n, 16, generator=gen) for n in (37, 53, 53))
    keep = torch.arange(37).view(1, 1, -1, 1) >= torch.arange(53).view(1, 1, 1, -1) + torch.arange(2).view(-1, 1, 1, 1)
    s = (q @ k.transpose(-1, -2) / 4.0).masked_fill(~keep, -math.inf)
    assert torch.allclose(flex_attention(q, k, v, block_mask=mask), torch.softmax(s, -1).nan_to_num(0.0) @ v, atol=2e-6)


def test_a_block_masks_lists_are_the_blocks_attended(monkeypatch) -> None:
    """As compiled Flex runs a BlockMask: keys in its listed blocks only, mask_mod in the partial
    blocks, not in the full ones (the lists were ignored: every causal key was attended, 2.45
    off compiled Flex; block lists with no mask_mod were an error). Per-head lists, GQA."""
    q, k, v = leaves(torch.float64)
    partial = torch.zeros(B, H, 3, 4, dtype=torch.bool)  # query blocks of 16 rows, key blocks of 16
    full = torch.zeros(B, H, 3, 4, dtype=torch.bool)
    partial[:, :, 0, 0] = partial[:, :, 1, 1] = partial[:, :, 2, 2] = True  # the diagonal: causal inside
    full[:, 1::2, 1, 0] = full[:, 1::2, 2, 3] = True  # odd heads: one more block each, whole
    full[1, :, 2, 1] = True  # the second sequence: one more

    def lists(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = dense.sum(-1).to(torch.int32)
        return counts, dense.to(torch.int32).argsort(dim=-1, descending=True, stable=True).to(torch.int32)

    block_mask = flex.BlockMask.from_kv_blocks(
        *lists(partial),
        *lists(full),
        BLOCK_SIZE=16,
        mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        seq_lengths=(N, M),
    )
    rows, cols = torch.arange(N).view(-1, 1), torch.arange(M).view(1, -1)
    keep = (partial[:, :, rows // 16, cols // 16] & (rows >= cols)) | full[:, :, rows // 16, cols // 16]
    groups = H // HKV
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) / math.sqrt(D)
    want = torch.softmax(scores.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0) @ v.repeat_interleave(groups, 1)
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    assert torch.allclose(out, want, atol=1e-12)
    got = torch.autograd.grad(out.square().sum(), (q, k, v))
    for g, w in zip(got, torch.autograd.grad(want.square().sum(), (q, k, v))):
        assert torch.allclose(g, w, atol=1e-10)


@pytest.mark.parametrize("lists", ["diagonal_full", "every_block", "rectangular"])
def test_full_blocks_the_mask_does_not_fill_are_attended_whole(lists: str) -> None:
    """A BlockMask whose full blocks are not full under its mask_mod (causal), so its lists are
    no consequence of the mask: keys of a full block are all attended, those of a partial block
    where the mask keeps them, none elsewhere, as compiled Flex runs it. The diagonal blocks full
    and the others below partial; every block listed (the diagonal full); BLOCK_SIZE (16, 8)
    with per-sequence and per-head lists. Against float64 torch."""
    q, k, v = (t.detach() for t in leaves(torch.float64))
    rows, cols = (16, 8) if lists == "rectangular" else (16, 16)
    query_blocks, key_blocks = -(-N // rows), -(-M // cols)
    below = torch.arange(query_blocks).view(-1, 1) > torch.arange(key_blocks).view(1, -1)
    diagonal = torch.arange(query_blocks).view(-1, 1) == torch.arange(key_blocks).view(1, -1)
    if lists == "rectangular":
        gen = torch.Generator().manual_seed(6)
        chance = torch.rand(B, H, query_blocks, key_blocks, generator=gen)
        partial, full = chance < 0.4, chance > 0.7
    else:
        partial = (below | ~diagonal) if lists == "every_block" else below
        partial, full = partial.expand(B, H, -1, -1), diagonal.expand(B, H, -1, -1)

    def block_lists(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = dense.sum(-1).to(torch.int32)
        return counts, dense.to(torch.int32).argsort(dim=-1, descending=True, stable=True).to(torch.int32)

    block_mask = flex.BlockMask.from_kv_blocks(
        *block_lists(partial),
        *block_lists(full),
        BLOCK_SIZE=(rows, cols),
        mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
        seq_lengths=(N, M),
    )
    i, j = torch.arange(N).view(-1, 1), torch.arange(M).view(1, -1)
    keep = (partial[:, :, i // rows, j // cols] & (i >= j)) | full[:, :, i // rows, j // cols]
    want = reference(q, k, v, None, lambda b, h, q_idx, kv_idx: keep[b, h, q_idx, kv_idx])[0]
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-12, rtol=0)


def test_an_exported_call_reads_the_block_lists_it_is_given() -> None:
    """torch.export of a call with a BlockMask: the lists' values cannot be read while it traces
    (a GuardOnDataDependentSymNode inside attncc until session 62), so the exported program
    reads them when it runs: lists other than the example's give their own attention."""

    class Listed(torch.nn.Module):
        def forward(
            self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, counts: torch.Tensor, indices: torch.Tensor
        ) -> torch.Tensor:
            mask = flex.BlockMask.from_kv_blocks(
                counts, indices, BLOCK_SIZE=16, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, seq_lengths=(N, M)
            )
            return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)

    q, k, v = (t.detach() for t in leaves(torch.float64))
    query_blocks, key_blocks = -(-N // 16), -(-M // 16)

    def lists(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = dense.sum(-1).to(torch.int32)
        return counts, dense.to(torch.int32).argsort(dim=-1, descending=True, stable=True).to(torch.int32)

    every = torch.ones(B, H, query_blocks, key_blocks, dtype=torch.bool)
    exported = torch.export.export(Listed(), (q, k, v, *lists(every))).module()
    diagonal = torch.zeros_like(every)
    for block in range(query_blocks):
        diagonal[:, :, block, block] = True
    diagonal[1, 1::2, 2, 0] = True  # the second sequence's odd heads: one more block
    rows, cols = torch.arange(N).view(-1, 1), torch.arange(M).view(1, -1)
    groups = H // HKV
    for dense in (every, diagonal):
        keep = dense[:, :, rows // 16, cols // 16] & (rows >= cols)
        scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) / math.sqrt(D)
        want = torch.softmax(scores.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0) @ v.repeat_interleave(groups, 1)
        torch.testing.assert_close(exported(q, k, v, *lists(dense)), want, atol=1e-12, rtol=1e-12)


def test_lists_proven_to_be_the_mask_are_not_read_and_the_proof_follows_values(monkeypatch) -> None:
    """create_block_mask's lists are its mask function's: proven so (no reads of the lists in
    the kernel), the proof kept by value; document ids rewritten in place through numpy (no
    version bump) are another proof, and lists that no longer follow from them are read."""
    ids = torch.tensor([[0] * 20 + [1] * 17, [0] * 20 + [1] * 17])
    monkeypatch.setitem(globals(), "doc", ids)
    monkeypatch.setattr(flex_integration, "_PROVEN", {})

    def same_document(b, h, q_idx, kv_idx):
        return doc[b, q_idx] == doc[b, kv_idx]

    q, k, v = (t.detach() for t in leaves(torch.float64))
    k, v = k[:, :, :37], v[:, :, :37]
    block_mask = flex.create_block_mask(same_document, B, None, N, 37, device="cpu", BLOCK_SIZE=8)
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    assert torch.allclose(out, reference(q, k, v, None, same_document)[0], atol=1e-12)
    assert len(flex_integration._PROVEN) == 1  # (proven: the kernel of the mask alone)
    ids.numpy()[1, 20:] = 0  # (one document in the second sequence: keys the old lists leave out)
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    rows, cols = torch.arange(N).view(-1, 1), torch.arange(37).view(1, -1)
    listed = block_mask.to_dense().bool()[:, :, rows // 8, cols // 8]
    want = reference(
        q, k, v, None, lambda b, h, q_idx, kv_idx: listed[b, 0, q_idx, kv_idx] & same_document(b, h, q_idx, kv_idx)
    )[0]
    assert torch.allclose(out, want, atol=1e-12)
    assert not torch.allclose(out, reference(q, k, v, None, same_document)[0], atol=1e-3)


def test_the_program_names_what_the_functions_read_and_is_compiled_once(monkeypatch) -> None:
    program = flex_program(relative_bias, document_causal)
    assert "input bias: float[bias_size0, bias_size1, bias_size2]" in program.source
    assert "input doc: int[doc_size0, doc_size1]" in program.source
    assert "s = (s + bias[h, i, j])" in program.source
    assert "mask (((doc[b, i] == doc[b, j]) and (i >= j)) or (j == 0))" in program.source
    assert set(program.inputs) == {"bias", "doc"} and program.inputs["bias"] is BIAS
    q, k, v = (t.detach() for t in leaves(torch.float64))
    first = flex_attention(q, k, v, relative_bias, mask_mod=document_causal, enable_gqa=True)
    kernels = dict(flex_integration._KERNELS._kernels)
    monkeypatch.setitem(globals(), "bias", BIAS * 3)  # the same shape: the same program, new values
    again = flex_attention(q, k, v, relative_bias, mask_mod=document_causal, enable_gqa=True)
    assert flex_integration._KERNELS._kernels == kernels and not torch.allclose(first, again)
    assert torch.allclose(again, reference(q, k, v, relative_bias, document_causal)[0], atol=1e-12)
    # another shape (document ids of a longer batch): the same program and kernel, sizes bound per call
    monkeypatch.setitem(globals(), "doc", torch.randint(0, 3, (2, 80), generator=GEN).sort(-1).values)
    longer = flex_attention(q, k, v, relative_bias, mask_mod=document_causal, enable_gqa=True)
    assert flex_integration._KERNELS._kernels == kernels
    assert torch.allclose(longer, reference(q, k, v, relative_bias, document_causal)[0], atol=1e-12)


def test_captured_names_that_could_meet_the_programs_become_placeholders() -> None:
    s = torch.ones(3)
    mask = torch.zeros(2)
    program = flex_program(lambda score, b, h, i, j: score * s[h] + mask[b], name="shadowing")
    assert "input captured0: float[captured0_size0]" in program.source
    assert "input captured1: float[captured1_size0]" in program.source
    assert program.source.startswith("attention shadowing\n")
    seed = torch.tensor([0.5, -0.25])  # (a call's keyword argument: no input takes its name)
    program = flex_program(lambda score, b, h, i, j: score + seed[h])
    assert "input captured0: float[captured0_size0]" in program.source
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    s = q @ q.transpose(-1, -2) / math.sqrt(8) + seed.double().view(1, 2, 1, 1)
    torch.testing.assert_close(flex_attention(q, q, q, lambda score, b, h, i, j: score + seed[h]), s.softmax(-1) @ q)
    # a tensor named like another's dimension (`bias_size0` beside `bias`): a program the compiler
    # refused (session 67's review), and a placeholder taken by a tensor of that name
    bias, bias_size0, captured0 = torch.randn(2, 5), torch.randn(5), torch.randn(5)
    program = flex_program(lambda score, b, h, i, j: score + bias[h, j] + bias_size0[j] + captured0[i])
    assert "input bias: float[bias_size0, bias_size1]" in program.source
    assert "input captured1: float[captured1_size0]" in program.source  # (bias_size0's)
    assert "input captured0: float[captured0_size0]" in program.source
    got = flex_attention(q, q, q, lambda score, b, h, i, j: score + bias[h, j] + bias_size0[j] + captured0[i])
    extra = bias.double().view(1, 2, 1, 5) + bias_size0.double().view(1, 1, 1, 5) + captured0.double().view(1, 1, 5, 1)
    torch.testing.assert_close(got, (q @ q.transpose(-1, -2) / math.sqrt(8) + extra).softmax(-1) @ q)


@pytest.mark.parametrize(
    "score_mod, message",
    [
        (lambda score, b, h, i, j: score if score > 0 else -score, "Python control flow on a traced value"),
        (lambda score, b, h, i, j: torch.sin(score), "torch operation `sin` has no DSL form"),
        (lambda score, b, h, i, j: score + BIAS, "captured tensor of shape (4, 37, 53) used whole"),
        (lambda score, b, h, i, j: score + BIAS[h, i, 0:4], "indexed by slice"),
        (lambda score, b, h, i, j: score // 2, "`//` of a float value"),
        (lambda score, b, h, i, j: score + (i & j), "only bool values combine"),
        (lambda score, b, h, i, j: score**2.5, "the DSL has no power"),
        (lambda score, b, h, i, j: i > j, "score_mod returned a bool value"),
        (lambda score, b, h, i, j: score + ((i > j) - (j > 0)), "`-` of two bool values"),
        (lambda score, b, h, i, j: torch.nn.functional.relu(score, inplace=True), "not changed in place"),
        (lambda score, b, h, i, j: score + torch.add(i > j, j > 0, alpha=2), "two bool values with alpha=2"),
        # (session 66's review: a partial read compared by identity, a silent all-masked row; an
        # unrounded half; torch.max's dim taken for a value; a missing return named nothing)
        (lambda score, b, h, i, j: score + (DOC[i] == DOC[j]) * 1.0, "read with 1 of its 2 indices, used as a value"),
        (lambda score, b, h, i, j: score.half(), "rounding to a narrower float is not traced"),
        (lambda score, b, h, i, j: torch.max(score, 0), "reduces over a dim"),
        (lambda score, b, h, i, j: torch.fmod(score, 0.5), "torch.fmod of a float value"),
        (lambda score, b, h, i, j: None, "returned None (no `return`?): expected the new score"),
        (lambda score, b, h, i, j: (score, score), "returned a tuple"),
        (lambda score, b, h, i, j: BIAS[h], "returned a captured tensor of shape (4, 37, 53) read with 1 of its 3"),
        (lambda score, b, h, i, j: torch.where(i > j, BIAS[h], score), "read with 1 of its 3 indices, used as a value"),
        (lambda score, b, h, i, j: score + BIAS[h].abs(), "read with 1 of its 3 indices, used as a value"),
    ],
)
def test_what_the_dsl_cannot_say_is_an_error_at_the_functions_line(score_mod, message: str) -> None:
    with pytest.raises(FlexTraceError, match=r"score_mod|returned") as info:
        flex_program(score_mod)
    # (after the quoted line of the function, which holds the expected message too)
    text = str(info.value)
    assert message in (text.split("`): ", 1)[1] if "`): " in text else text)
    if "returned" not in message:
        assert f"{__file__}:" in str(info.value) and "lambda score" in str(info.value)


def test_a_traced_program_too_large_says_why() -> None:
    """Each step reusing the last value twice doubles the traced text (the DSL's expressions
    are trees): the compiler's size limit was a bare DslError at the generated program's line,
    naming nothing the user wrote (review of session 63)."""

    def piecewise(score, b, h, q_idx, kv_idx):
        distance, bias = (q_idx - kv_idx).abs(), torch.zeros_like(score)
        for knot in range(0, 24, 2):
            bias = torch.where(distance > knot, bias - 0.1 * (distance - knot), bias)
        return score + bias

    q = torch.randn(1, 1, 8, 8)
    with pytest.raises(FlexTraceError, match=r"too large for the compiler .* reuse intermediate values less"):
        flex_attention(q, q, q, piecewise)


def test_relu_keeps_nan_and_deep_nesting_is_a_trace_error() -> None:
    """relu(NaN) is NaN in torch (its `where` form must not make it 0), and an expression nested
    past the parser's limit is the tracer's error, not a DslError at the generated text's column."""
    q = torch.randn(1, 1, 4, 8, dtype=torch.float64)
    nan_bias = torch.tensor([0.0, math.nan, 1.0, -1.0], dtype=torch.float64)
    out = flex_attention(q, q, q, lambda score, b, h, i, j: score + torch.relu(nan_bias[j]))
    assert out.isnan().all()
    # (and a clamp whose min is above its max: max everywhere, NaN where the input is NaN)
    out = flex_attention(q, q, q, lambda score, b, h, i, j: score + torch.clamp(nan_bias[j], min=1.0, max=-1.0))
    assert out.isnan().all()

    def deep(score, b, h, q_idx, kv_idx):
        for _ in range(250):
            score = torch.tanh(score)
        return score

    with pytest.raises(FlexTraceError, match="nested too deeply for the compiler"):
        flex_attention(q, q, q, deep)

    def chained(score, b, h, q_idx, kv_idx):  # (relu writes its operand twice: 2^40 copies)
        x = score
        for _ in range(40):
            x = torch.relu(x - 0.1)
        return x

    # (stopped as the text passes the compiler's limit: an earlier form's chain of 12 took 20 GB)
    with pytest.raises(FlexTraceError, match=r"score_mod `chained` .* too large for the compiler \(a traced value of"):
        flex_attention(q, q, q, chained)


def test_call_errors_name_the_argument() -> None:
    q, k, v = (t.detach() for t in leaves(torch.float64))
    with pytest.raises(InputError, match="pass enable_gqa=True"):
        flex_attention(q, k, v)
    with pytest.raises(InputError, match=r"^scale: this tensor requires grad, but flex_attention takes scale"):
        flex_attention(q, k, v, scale=torch.tensor(0.3, requires_grad=True), enable_gqa=True)
    mask = flex.create_block_mask(document_causal, B, None, 40, 53, device="cpu")
    with pytest.raises(
        InputError, match=r"block_mask: made for \(Q_LEN, KV_LEN\) = \(40, 53\), called with query length 37"
    ):
        flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    blocks = flex.BlockMask.from_kv_blocks(
        torch.ones(1, 1, 3, dtype=torch.int32),
        torch.zeros(1, 1, 3, 4, dtype=torch.int32),
        BLOCK_SIZE=16,
        seq_lengths=(N, M),
    )  # each query block sees key block 0 only
    for size, message in (
        (0, r"BLOCK_SIZE must be a positive int or two, got \(0, 0\)"),
        (8.0, "BLOCK_SIZE must be a positive int or two, got 8.0"),
    ):
        bad = flex.BlockMask.from_kv_blocks(
            torch.ones(1, 1, 5, dtype=torch.int32), torch.zeros(1, 1, 5, 5, dtype=torch.int32), BLOCK_SIZE=size,
            seq_lengths=(N, M), compute_q_blocks=False,
        )  # fmt: skip
        with pytest.raises(InputError, match=f"block_mask: {message}"):
            flex_attention(q, k, v, block_mask=bad, enable_gqa=True)
    flat = flex.BlockMask.from_kv_blocks(
        torch.ones(1, 3, dtype=torch.int32), torch.zeros(1, 3, 4, dtype=torch.int32), BLOCK_SIZE=16,
        seq_lengths=(N, M), compute_q_blocks=False,
    )  # fmt: skip
    with pytest.raises(InputError, match=r"block_mask: kv_num_blocks \[B, H, query blocks\] and kv_indices"):
        flex_attention(q, k, v, block_mask=flat, enable_gqa=True)
    first_block = reference(q, k, v, None, lambda b, h, q_idx, kv_idx: kv_idx < 16)[0]
    assert torch.allclose(flex_attention(q, k, v, block_mask=blocks, enable_gqa=True), first_block, atol=1e-12)
    with pytest.raises(FlexTraceError, match="mask_mod returned an int value"):
        flex_attention(q, k, v, mask_mod=lambda b, h, i, j: i - j, enable_gqa=True)
    assert isinstance(FlexTraceError("x"), attncc.AttnccError)


def test_under_torch_compile() -> None:
    """The tracing runs eagerly under torch.compile (a graph break; dynamo failed inside on a
    closure's tensor reads); fullgraph takes the program's kernel itself."""
    torch._dynamo.reset()
    learned = BIAS.clone().requires_grad_()

    def biased(score, b, h, q_idx, kv_idx):
        return score + learned[h, q_idx, kv_idx]

    def with_bias(q):
        return flex_attention(q, q, q, biased, mask_mod=key_padding)[:, :, :, :3]

    q = torch.randn(B, H, N, D, dtype=torch.float64, requires_grad=True)
    want, got = with_bias(q), torch.compile(with_bias)(q)
    assert torch.equal(got, want)
    grads = torch.autograd.grad(got.square().sum(), (q, learned))
    for g, w in zip(grads, torch.autograd.grad(want.square().sum(), (q, learned))):
        assert torch.equal(g, w)
    program = flex_program(biased, key_padding)
    kern = attncc.compile(program.source)
    whole = torch.compile(lambda q: kern(q, q, q, **program.inputs)[:, :, :, :3], fullgraph=True)
    assert torch.equal(whole(q), want)


def test_traced_operations_a_mutation_sweep_found_untested() -> None:
    """Score and mask functions whose traced forms a review's planted mistakes changed unseen:
    sign at 0, a negative constant index into a captured tensor, == of two bools, log2,
    softplus where beta < 1 moves the threshold, where() between two masks; against the same
    expressions evaluated by torch in float64."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    table = torch.randn(3, 8, generator=gen, dtype=torch.float64) * 3
    i, j = torch.arange(8, dtype=torch.float64)[:, None], torch.arange(8, dtype=torch.float64)[None]
    scores = q @ k.transpose(-1, -2) / 4
    softplus = torch.nn.functional.softplus
    cases = [
        (lambda s, b, h, qi, ki: s + torch.sign(qi - ki) * 2.0, torch.sign(i - j) * 2.0),
        (lambda s, b, h, qi, ki: s + table[-1, ki], table[-1][None].expand(8, 8)),
        (
            lambda s, b, h, qi, ki: torch.where((qi < 4) == (ki < 4), s, s - 5.0),
            torch.where((i < 4) == (j < 4), 0.0, -5.0),
        ),
        (lambda s, b, h, qi, ki: s + torch.log2(ki + 1.0), torch.log2(j + 1.0).expand(8, 8)),
        (
            lambda s, b, h, qi, ki: s + softplus((qi - ki) * 0.5, beta=0.5, threshold=1.0),
            softplus((i - j) * 0.5, beta=0.5, threshold=1.0),
        ),
    ]
    for number, (score_mod, extra) in enumerate(cases):
        want = torch.softmax(scores + extra, -1) @ v
        torch.testing.assert_close(
            flex_attention(q, k, v, score_mod=score_mod), want, atol=1e-12, rtol=0, msg=str(number)
        )

    def chosen(b, h, q_idx, kv_idx):  # (a where between two masks)
        return torch.where(q_idx < 4, kv_idx <= q_idx, kv_idx >= q_idx)

    block_mask = flex.create_block_mask(chosen, None, None, 8, 8, device="cpu")
    keep = torch.where(i < 4, j <= i, j >= i)
    want = torch.softmax(scores.masked_fill(~keep, -math.inf), -1) @ v
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=block_mask), want, atol=1e-12, rtol=0)
