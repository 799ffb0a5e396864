"""Every example against float64 attention written by hand from the program's meaning.

The golden tests in test_golden.py compare each kernel with `kern.reference`, which interprets
the same IR the kernel is generated from: a misparsed mask or a wrong lowering would be wrong
in both and pass. Here each example's reference is ordinary torch code, written from the
program text as a user would write it (scores = q @ k^T / sqrt(D), GQA by repeat_interleave of
k and v over H // Hkv, masks by masked_fill(-inf), softmax, fully masked rows give output 0 and
lse -inf; layouts on blocks ib = i // block, jb = j // block), and never touches attncc's IR.

The shapes are chosen so that every mask, layout, clip and cap takes effect: each reference is
asserted to differ by far more than the tolerance from the nearest plain (vanilla or causal)
attention and from the same reference with its parameter off by one (window 255, stride 3,
max_distance 127, ...). Without that, a kernel ignoring its mask could pass on a shape too small
for the mask to matter.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import attncc
from attncc.runtime.check import _error
from attncc.runtime.inputs import Shape
from tests.conftest import EXAMPLES, ROOT, kernel

#: fp32 kernel vs float64 reference, per element relative to max(1, |reference|).
FWD_TOL, BWD_TOL = 2e-5, 2e-4
#: A reference must differ from each weaker variant by more than this many forward tolerances.
BITE = 100

#: Runtime inputs by name: tensors, and ints for scalar inputs.
Inputs = dict[str, torch.Tensor | int]
#: (q, k, v, runtime inputs) -> (out, lse), all in the dtype of q.
Reference = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Inputs], tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------- hand-written attention
def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[B, H, N, M] scores q @ k^T / sqrt(D); query head h reads kv head h // (H // Hkv)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])


def attend(
    s: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    rate: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax over the visible scores, then @ v: (out, lse).

    The row maximum is subtracted before exp (so float32 does not overflow at large scores); a
    row with nothing visible has lse -inf and output 0. `keep` is a dropout keep mask applied
    to the probabilities with 1 / (1 - rate) scaling; lse is the log-normaliser before dropout.
    """
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    rowmax = s.amax(-1, keepdim=True).detach()
    rowmax = torch.where(torch.isfinite(rowmax), rowmax, torch.zeros_like(rowmax))
    e = torch.exp(s - rowmax)
    total = e.sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    lse = (rowmax + torch.log(total)).squeeze(-1)
    if keep is not None:
        p = p * keep / (1.0 - rate)
    v = v.repeat_interleave(p.shape[1] // v.shape[1], dim=1)
    return p @ v, lse


def positions(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query index i as [N, 1] and key index j as [1, M] for scores s [B, H, N, M]."""
    n, m = s.shape[-2:]
    return torch.arange(n).view(-1, 1), torch.arange(m).view(1, -1)


def vanilla() -> Reference:
    def ref(q, k, v, x):
        return attend(scores(q, k), v)

    return ref


def causal(strict: bool = False) -> Reference:
    """j <= i (or j < i when strict: every row loses its diagonal, row 0 is fully masked)."""

    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        return attend(s, v, j < i if strict else j <= i)

    return ref


def causal_kv_tiled() -> Reference:
    """Causal with the GQA mapping wrong the other way round: query head h reads kv head h % Hkv."""

    def ref(q, k, v, x):
        group = q.shape[1] // k.shape[1]
        return causal()(q, k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1), x)

    return ref


def sliding_window(window: int = 256) -> Reference:
    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        return attend(s, v, (j <= i) & (i - j < window))

    return ref


def alibi(sign: float = 1.0) -> Reference:
    """s - slopes[h] * (i - j), causal (sign -1: the penalty with the wrong sign)."""

    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        s = s - sign * x["slopes"].view(1, -1, 1, 1) * (i - j).to(s.dtype)
        return attend(s, v, j <= i)

    return ref


def softcap(cap: float = 30.0) -> Reference:
    def ref(q, k, v, x):
        return attend(cap * torch.tanh(scores(q, k) / cap), v)

    return ref


def padding(inclusive: bool = False) -> Reference:
    """Keys j < lengths[b] (j <= lengths[b] when inclusive)."""

    def ref(q, k, v, x):
        s = scores(q, k)
        _, j = positions(s)
        lengths = x["lengths"].view(-1, 1, 1, 1)
        return attend(s, v, j <= lengths if inclusive else j < lengths)

    return ref


def document(within_document: bool = True, causal_too: bool = True, ordered: bool = False) -> Reference:
    """doc[b, i] == doc[b, j] and j <= i; either half can be dropped for the weaker variants
    (ordered: doc[b, i] <= doc[b, j] instead of equality, which j <= i makes the same for ids
    that increase along the sequence)."""

    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        visible = torch.ones(s.shape[-2:], dtype=torch.bool)
        if causal_too:
            visible = visible & (j <= i)
        if within_document:
            doc_i, doc_j = x["doc"][:, :, None], x["doc"][:, None, :]
            visible = visible & (doc_i <= doc_j if ordered else doc_i == doc_j).unsqueeze(1)
        return attend(s, v, visible)

    return ref


def prefix_lm(inclusive: bool = False) -> Reference:
    """j <= i or j < prefix[b] (j <= prefix[b] when inclusive)."""

    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        prefix = x["prefix"].view(-1, 1, 1, 1)
        return attend(s, v, (j <= i) | ((j <= prefix) if inclusive else (j < prefix)))

    return ref


def relative_bias(max_distance: int = 128, sign: int = 1) -> Reference:
    """s + bias[h, 128 + clip(j - i, -max_distance, max_distance)] (sign -1: i - j instead)."""

    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        index = 128 + (sign * (j - i)).clamp(-max_distance, max_distance)
        return attend(s + x["bias"][:, index].unsqueeze(0), v)

    return ref


def local_blocks(width: int | None = 2, block: int = 64, use_block_mask: bool = True) -> Reference:
    """|i // block - j // block| <= width and block_mask[h, i // 64, j // 64] (None: no local part)."""

    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        visible = torch.ones(s.shape[-2:], dtype=torch.bool)
        if width is not None:
            visible = visible & ((i // block - j // block).abs() <= width)
        if use_block_mask:
            visible = visible & x["block_mask"][:, i // 64, j // 64].unsqueeze(0)
        return attend(s, v, visible)

    return ref


def strided(stride: int = 4, block: int = 32) -> Reference:
    """Causal, and block distance d = i // block - j // block with |d| < stride or d % stride == 0."""

    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        d = i // block - j // block
        return attend(s, v, (j <= i) & ((d.abs() < stride) | (d % stride == 0)))

    return ref


def butterfly(block: int = 64, xor: bool = True) -> Reference:
    """Key block jb visible to query block ib iff ib ^ jb is 0 or a power of two
    (xor False: |ib - jb| instead of ib ^ jb)."""

    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        ib, jb = i // block, j // block
        d = ib ^ jb if xor else (ib - jb).abs()
        allowed = torch.tensor([0] + [2**t for t in range(20)])
        return attend(s, v, torch.isin(d, allowed))

    return ref


def gpt_oss(window: int | None = None, sinks: bool = True, bottom_right: bool = True) -> Reference:
    """Queries are the last N of M positions: key j is visible to query i at position
    i + M - N when j <= i + M - N and i + M - N - j < window (x["window"] unless given); the
    softmax has one more logit per row, sinks[h], with no value row (sinks False: without it;
    bottom_right False: positions aligned top-left, i and j)."""

    def ref(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        position = i + (s.shape[-1] - s.shape[-2] if bottom_right else 0)
        visible = (j <= position) & (position - j < (x["window"] if window is None else window))
        if not sinks:
            return attend(s, v, visible)
        s = s.masked_fill(~visible, -math.inf)
        sink = x["sinks"].view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        return p @ v.repeat_interleave(p.shape[1] // v.shape[1], dim=1), lse

    return ref


# ----------------------------------------------------------------------- runtime inputs
def no_inputs(gen: torch.Generator, shape: Shape) -> Inputs:
    return {}


def alibi_slopes(gen: torch.Generator, shape: Shape) -> Inputs:
    """The ALiBi slopes 2^(-8 (h + 1) / H), learnable."""
    slopes = torch.tensor([2.0 ** (-8 * (h + 1) / shape.H) for h in range(shape.H)])
    return {"slopes": slopes.requires_grad_()}


def key_lengths(gen: torch.Generator, shape: Shape) -> Inputs:
    """Batch 0 has no valid key (all its rows fully masked), batch 1 about half of them."""
    return {"lengths": torch.tensor([0, shape.M // 2 + 7])}


def document_ids(gen: torch.Generator, shape: Shape) -> Inputs:
    """Packed documents: contiguous runs of random ids in [0, 4) per batch element, the ids
    renamed 0 1 2 3 -> 3 0 2 1 so that they do not increase along the sequence (with increasing
    ids, j <= i and doc[i] <= doc[j] would imply equality and hide a mask comparing order)."""
    ids = torch.randint(0, 4, (shape.B, shape.N), generator=gen).sort(dim=-1).values
    return {"doc": torch.tensor([3, 0, 2, 1])[ids]}


def prefix_lengths(gen: torch.Generator, shape: Shape) -> Inputs:
    """Batch 0 has no prefix (plain causal), batch 1 a prefix of 170 tokens."""
    return {"prefix": torch.tensor([0, 170])}


def bias_table(gen: torch.Generator, shape: Shape) -> Inputs:
    """A learnable [H, 257] table, N(0, 0.5^2)."""
    return {"bias": (0.5 * torch.randn(shape.H, 257, generator=gen)).requires_grad_()}


def sinks_and_window(gen: torch.Generator, shape: Shape) -> Inputs:
    """Learnable sinks N(3, 2^2) (about 0.1 of a row's weight against ~128 visible keys, some
    heads far more) and a window of 128."""
    return {"sinks": (3.0 + 2.0 * torch.randn(shape.H, generator=gen)).requires_grad_(), "window": 128}


def random_block_mask(gen: torch.Generator, shape: Shape) -> Inputs:
    """block_mask [H, NB, MB] for 64 x 64 blocks, each allowed with probability 0.6."""
    return {"block_mask": torch.rand(shape.H, -(-shape.N // 64), -(-shape.M // 64), generator=gen) < 0.6}


# ----------------------------------------------------------------------- the cases
@dataclass(frozen=True)
class Case:
    """An example's test shape, hand-written reference, runtime inputs and weaker variants.

    `nearby` holds references the example's reference must differ from by > BITE x FWD_TOL on
    `shape`: the plain attention it is closest to and its own parameters off by one, so that
    the shape provably makes every part of the program take effect. q is drawn N(0, q_scale^2).
    """

    shape: Shape
    reference: Reference
    nearby: dict[str, Reference]
    inputs: Callable[[torch.Generator, Shape], Inputs] = no_inputs
    q_scale: float = 1.0
    call: dict[str, object] = field(default_factory=dict)


CASES: dict[str, Case] = {
    # cross attention (N < M), multi-query
    "vanilla": Case(Shape(2, 2, 1, 150, 333, 40), vanilla(), {"causal": causal()}),
    # N < M: keys beyond the last query are never visible
    "causal": Case(Shape(1, 2, 2, 277, 391, 80), causal(), {"vanilla": vanilla(), "j < i": causal(strict=True)}),
    "gqa": Case(
        Shape(2, 4, 2, 203, 203, 48),
        causal(),
        {"vanilla": vanilla(), "kv head h % Hkv": causal_kv_tiled(), "j < i": causal(strict=True)},
    ),
    # window 256: rows i >= 256 lose keys, and 600 > 2 x 256 leaves whole windows in the middle
    "sliding_window": Case(
        Shape(1, 2, 1, 600, 600, 40),
        sliding_window(),
        {"causal": causal(), "window 255": sliding_window(255), "window 257": sliding_window(257)},
    ),
    "alibi": Case(
        Shape(1, 4, 2, 300, 300, 48), alibi(), {"causal": causal(), "sign flipped": alibi(-1.0)}, alibi_slopes
    ),
    # scores N(0, 8^2): far outside tanh's linear range at cap 30
    "softcap": Case(
        Shape(1, 2, 2, 257, 190, 80),
        softcap(),
        {"vanilla": vanilla(), "cap 27": softcap(27.0), "cap 33": softcap(33.0)},
        q_scale=8.0,
    ),
    "padding": Case(
        Shape(2, 2, 2, 130, 300, 40),
        padding(),
        {"vanilla": vanilla(), "j <= lengths": padding(inclusive=True)},
        key_lengths,
    ),
    "document": Case(
        Shape(2, 2, 1, 300, 300, 48),
        document(),
        {"causal": causal(), "no causal part": document(causal_too=False), "ids ordered": document(ordered=True)},
        document_ids,
    ),
    "prefix_lm": Case(
        Shape(2, 2, 2, 300, 300, 40),
        prefix_lm(),
        {"causal": causal(), "vanilla": vanilla(), "j <= prefix": prefix_lm(inclusive=True)},
        prefix_lengths,
    ),
    # |j - i| reaches 399 > 128: the clip takes effect
    "relative_bias": Case(
        Shape(1, 2, 2, 400, 333, 48),
        relative_bias(),
        {"vanilla": vanilla(), "max_distance 127": relative_bias(127), "i - j": relative_bias(sign=-1)},
        bias_table,
    ),
    # 7 x 8 blocks of 64: several blocks beyond the width of 2 on both sides
    "local_blocks": Case(
        Shape(1, 2, 1, 421, 470, 40),
        local_blocks(),
        {
            "vanilla": vanilla(),
            "width 1": local_blocks(width=1),
            "width 3": local_blocks(width=3),
            "local on 32-blocks": local_blocks(block=32),
            "no block mask": local_blocks(use_block_mask=False),
            "no local layout": local_blocks(width=None),
        },
        random_block_mask,
    ),
    # 13 blocks of 32: block distances up to 12 = 3 strides, and a tail of 19
    "strided": Case(
        Shape(1, 2, 2, 403, 403, 48),
        strided(),
        {
            "causal": causal(),
            "stride 3": strided(stride=3),
            "stride 5": strided(stride=5),
            "block 16": strided(block=16),
            "block 64": strided(block=64),
        },
    ),
    # 9 blocks of 64 (xor up to 15) and a tail of 21
    "blocksparse_butterfly": Case(
        Shape(1, 2, 1, 533, 533, 40),
        butterfly(),
        {"vanilla": vanilla(), "|ib - jb|": butterfly(xor=False), "block 32": butterfly(block=32)},
    ),
    # dropout off here; test_gpt2_dropout_matches_the_kernels_keep_mask checks it on
    "gpt2": Case(Shape(2, 2, 2, 250, 250, 40), causal(), {"vanilla": vanilla()}, call={"train": False}),
    # N < M: queries at positions 133..332, each seeing 128 keys; sinks take a visible share
    "gpt_oss": Case(
        Shape(1, 4, 2, 200, 333, 40),
        gpt_oss(),
        {
            "no sinks": gpt_oss(sinks=False),
            "top-left positions": gpt_oss(bottom_right=False),
            "window 127": gpt_oss(window=127),
            "window 129": gpt_oss(window=129),
            "vanilla": vanilla(),
        },
        sinks_and_window,
    ),
}


def test_every_example_has_a_case() -> None:
    """No example escapes the hand-written comparison."""
    assert sorted(CASES) == EXAMPLES


# ----------------------------------------------------------------------- running and comparing
def draw(case: Case, seed: int = 0, q_factor: float | None = None) -> tuple[torch.Tensor, ...]:
    """fp32 leaves q, k, v (q times q_factor, default the case's q_scale) and a dout."""
    s = case.shape
    gen = torch.Generator().manual_seed(seed)
    scale = case.q_scale if q_factor is None else q_factor
    q = (torch.randn(s.B, s.H, s.N, s.D, generator=gen) * scale).requires_grad_()
    k = torch.randn(s.B, s.Hkv, s.M, s.D, generator=gen).requires_grad_()
    v = torch.randn(s.B, s.Hkv, s.M, s.Dv, generator=gen).requires_grad_()
    dout = torch.randn(s.B, s.H, s.N, s.Dv, generator=gen)
    return q, k, v, dout


def runtime_inputs(case: Case, seed: int = 0) -> Inputs:
    return case.inputs(torch.Generator().manual_seed(seed + 1000), case.shape)


def learnable(inputs: Inputs) -> list[str]:
    return [n for n, t in inputs.items() if isinstance(t, torch.Tensor) and t.requires_grad]


def results(
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    inputs: Inputs,
    dout: torch.Tensor | None,
) -> dict[str, torch.Tensor | None]:
    """out, lse and (with a dout) the gradients of out . dout w.r.t. q, k, v and learnable inputs."""
    out, lse = fn(q, k, v, inputs)
    got: dict[str, torch.Tensor | None] = {"out": out, "lse": lse}
    if dout is not None:
        names = learnable(inputs)
        grads = torch.autograd.grad(out, [q, k, v] + [inputs[n] for n in names], dout.to(out.dtype), allow_unused=True)
        got.update(zip(["dq", "dk", "dv"] + [f"d{n}" for n in names], grads))
    return got


def run_kernel(
    kern: attncc.Kernel, case: Case, q, k, v, inputs: Inputs, dout: torch.Tensor | None, **call: object
) -> dict[str, torch.Tensor | None]:
    def fn(q, k, v, x):
        return kern(q, k, v, return_lse=True, **{**case.call, **call}, **x)

    return results(fn, q, k, v, inputs, dout)


def run_reference(
    reference: Reference, q, k, v, inputs: Inputs, dout: torch.Tensor | None, dtype: torch.dtype = torch.float64
) -> dict[str, torch.Tensor | None]:
    """The hand-written reference on fresh leaves of `dtype` (float inputs converted, ints as they are)."""

    def leaf(t: torch.Tensor | int) -> torch.Tensor | int:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.detach().to(dtype).requires_grad_(t.requires_grad)
        return t

    return results(reference, leaf(q), leaf(k), leaf(v), {n: leaf(t) for n, t in inputs.items()}, dout)


def tolerance(name: str) -> float:
    return FWD_TOL if name in ("out", "lse") else BWD_TOL


def assert_within(
    got: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor | None], limits: dict[str, float]
) -> None:
    """Every gradient present, and every tensor within its limit (NaN/inf placement must match)."""
    missing = [n for n, t in got.items() if t is None]
    assert not missing, f"no gradient for {missing}"
    errors = {n: _error(got[n], ref[n]) for n in ref}
    report = ", ".join(f"{n} {errors[n]:.2e}/{limits[n]:.1e}" for n in errors)
    assert all(errors[n] <= limits[n] for n in errors), report


# ----------------------------------------------------------------------- the tests
@pytest.mark.parametrize("name", EXAMPLES)
def test_matches_hand_written_reference(name: str) -> None:
    """Forward (out, lse) and backward (dq, dk, dv, d of learnable inputs) of the example's
    fp32 kernel equal the hand-written float64 reference on a shape where its mask bites."""
    case = CASES[name]
    q, k, v, dout = draw(case)
    inputs = runtime_inputs(case)
    kern = kernel(name)
    floats = {d.name for d in kern.inputs if d.role == "tensor" and d.dtype == "float"}
    assert set(learnable(inputs)) == floats, "every float input is learnable and gets its gradient checked"
    got = run_kernel(kern, case, q, k, v, inputs, dout)
    ref = run_reference(case.reference, q, k, v, inputs, dout)
    assert set(got) == {"out", "lse", "dq", "dk", "dv"} | {f"d{n}" for n in learnable(inputs)}
    assert_within(got, ref, {n: tolerance(n) for n in ref})


@pytest.mark.parametrize("name", EXAMPLES)
def test_shape_makes_every_part_of_the_program_bite(name: str) -> None:
    """On the test's shape and inputs, the reference differs from plain vanilla/causal attention
    and from each of its parameters off by one by more than BITE x FWD_TOL: the comparison above
    would catch a kernel that ignored or misplaced any of them."""
    case = CASES[name]
    q, k, v, _ = draw(case)
    inputs = runtime_inputs(case)
    ref = run_reference(case.reference, q, k, v, inputs, None)
    assert torch.isfinite(ref["out"]).all()
    assert case.nearby
    for label, other in case.nearby.items():
        diff = (ref["out"] - run_reference(other, q, k, v, inputs, None)["out"]).abs().max().item()
        assert diff > BITE * FWD_TOL, f"{name} vs {label}: max |diff| {diff:.1e} on {case.shape}"
    if name == "padding":  # the zero-length batch element: fully masked rows, output 0, lse -inf
        assert torch.isneginf(ref["lse"][0]).all() and (ref["out"][0] == 0).all()
        assert torch.isfinite(ref["lse"][1]).all()


#: Examples run again with q scaled: large scores, where the row max must be subtracted and
#: softcap's tanh saturates.
LARGE_SCORE_EXAMPLES = ["vanilla", "causal", "softcap", "alibi", "sliding_window"]


def eager_fp32_errors(
    case: Case, q, k, v, inputs: Inputs, dout: torch.Tensor, ref: dict[str, torch.Tensor | None], orders: int = 4
) -> dict[str, float]:
    """The worst error vs `ref` of the hand-written reference run eagerly in float32, over
    `orders` orderings of the head dimension (the identity and random permutations of D in q,
    k, v and dout, undone on out, dq, dk, dv): the same attention exactly, with every dot
    product rounded in another order, so the result samples the spread of fp32 rounding
    rather than one lucky or unlucky order."""
    gen = torch.Generator().manual_seed(11)
    worst = dict.fromkeys(ref, 0.0)
    for t in range(orders):
        perm = torch.arange(case.shape.D) if t == 0 else torch.randperm(case.shape.D, generator=gen)
        undo = torch.argsort(perm)
        leaves = [x.detach()[..., perm].requires_grad_() for x in (q, k, v)]
        eager = run_reference(case.reference, *leaves, inputs, dout[..., perm], torch.float32)
        for n, value in eager.items():
            value = value[..., undo] if n in ("out", "dq", "dk", "dv") else value
            worst[n] = max(worst[n], _error(value, ref[n]))
    return worst


@pytest.mark.parametrize("factor", [30.0, 100.0])
@pytest.mark.parametrize("name", LARGE_SCORE_EXAMPLES)
def test_large_scores(name: str, factor: float) -> None:
    """q x 30 and x 100 (scores in the hundreds, softmax nearly one-hot, softcap saturated):
    forward and backward against float64, within what fp32 arithmetic can reach there.

    Why the limit is not simply FWD_TOL / BWD_TOL: an fp32 score carries an absolute rounding
    error of about u * scale * sum_d |q_d k_d| (u = 2^-24), which grows linearly with |q|, and
    softmax turns an absolute score error into a relative probability error (dp / p = ds -
    sum p ds); the backward's dS = P (dP - rowsum(P dP)) cancels in rows that are nearly
    one-hot, and dk = dS^T q is multiplied by the scaled q. So out and every gradient err in
    proportion to `factor` in any fp32 implementation (eager fp32 errs ~8e-5 on out and
    ~1e-3 on dk at x100, the kernel as much), and 2e-5 / 2e-4 cannot be met.
    The limit per tensor is the tight tolerance or twice the worst eager fp32 error over four
    orderings of the head dimension (eager_fp32_errors), whichever is larger (twice: the
    repository's rule for low precision, check.LOW_PRECISION_FUDGE). It is asserted to stay
    below factor x the tight tolerance, the linear growth above, so a broken float32 reference
    (no max subtraction: inf or NaN) cannot loosen it.
    """
    case = CASES[name]
    q, k, v, dout = draw(case, seed=7, q_factor=factor)
    inputs = runtime_inputs(case)
    got = run_kernel(kernel(name), case, q, k, v, inputs, dout)
    ref = run_reference(case.reference, q, k, v, inputs, dout)
    limits = {}
    for n, eager_error in eager_fp32_errors(case, q, k, v, inputs, dout, ref).items():
        limits[n] = max(tolerance(n), 2.0 * eager_error)
        assert limits[n] <= factor * tolerance(n), f"eager fp32 {n} error {eager_error:.1e} beyond fp32 conditioning"
    assert_within(got, ref, limits)


def test_gpt2_dropout_matches_the_kernels_keep_mask() -> None:
    """gpt2 in training: out = (softmax(causal s) * keep / 0.9) @ v with keep =
    attncc.dropout_mask(seed, 0, B, H, N, M, 0.1), forward and backward; the mask keeps ~90%,
    depends on the seed and the head, and dropout changes the output far beyond the tolerance."""
    case = CASES["gpt2"]
    s = case.shape
    seed = 1234
    keep = attncc.dropout_mask(seed, 0, s.B, s.H, s.N, s.M, 0.1)
    assert keep.shape == (s.B, s.H, s.N, s.M) and keep.dtype == torch.bool
    assert abs(keep.float().mean().item() - 0.9) < 0.005
    # the mask of (b, h, i, j) does not depend on N and M: another seed's corner must differ
    assert not torch.equal(keep[..., :64, :64], attncc.dropout_mask(seed + 1, 0, s.B, s.H, 64, 64, 0.1))
    assert not torch.equal(keep[:, 0], keep[:, 1])

    def dropped(q, k, v, x):
        s = scores(q, k)
        i, j = positions(s)
        return attend(s, v, j <= i, keep=keep, rate=0.1)

    q, k, v, dout = draw(case)
    got = run_kernel(kernel("gpt2"), case, q, k, v, {}, dout, train=True, seed=seed)
    ref = run_reference(dropped, q, k, v, {}, dout)
    assert_within(got, ref, {n: tolerance(n) for n in ref})
    undropped = run_reference(causal(), q, k, v, {}, None)
    assert (ref["out"] - undropped["out"]).abs().max().item() > BITE * FWD_TOL


#: Each example's text with one plausible mistake: (test id, example, original text, mutated text).
MUTANTS = [
    ("causal-strict", "causal", "mask j <= i", "mask j < i"),
    ("sliding_window-255", "sliding_window", "const window = 256", "const window = 255"),
    ("softcap-33", "softcap", "const cap = 30.0", "const cap = 33.0"),
    ("strided-stride3", "strided", "stride=4", "stride=3"),
    ("local_blocks-width3", "local_blocks", "width=2", "width=3"),
    ("relative_bias-127", "relative_bias", "const max_distance = 128", "const max_distance = 127"),
    ("gpt_oss-no-sink", "gpt_oss", "softmax(s, sink=sinks[h])", "softmax(s)"),
    (
        "gpt_oss-top-left",
        "gpt_oss",
        "mask j <= i + (M - N) and i + (M - N) - j < window",
        "mask j <= i and i - j < window",
    ),
]


@pytest.mark.parametrize(("name", "old", "new"), [m[1:] for m in MUTANTS], ids=[m[0] for m in MUTANTS])
def test_a_mutated_program_fails_the_comparison(name: str, old: str, new: str) -> None:
    """The example compiled from its text with one detail changed disagrees with the correct
    hand-written reference beyond the tolerance (forward only): the comparison has the power to
    catch a kernel that gets exactly that detail wrong."""
    text = Path(ROOT / "examples" / f"{name}.attn").read_text()
    assert text.count(old) == 1
    mutant = attncc.compile(text.replace(old, new))
    case = CASES[name]
    q, k, v, _ = draw(case)
    inputs = runtime_inputs(case)
    with torch.no_grad():
        got = run_kernel(mutant, case, q, k, v, inputs, None)
        ref = run_reference(case.reference, q, k, v, inputs, None)
    error = max(_error(got[n], ref[n]) for n in ref)
    assert error > FWD_TOL, f"the mutant `{new}` passes: error {error:.1e}"
