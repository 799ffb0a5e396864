"""Tile classification against brute force: sound always, exact where interval reasoning is."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

import attncc
from attncc.errors import InputError
from attncc.ir import expr as ex
from attncc.ir.graph import fused_node
from attncc.ir.ops import Layout
from attncc.passes import sparsity
from attncc.passes.sparsity import (
    EMPTY,
    FULL,
    PARTIAL,
    Problem,
    SparsityInfo,
    classify_tiles,
    host_read_tensors,
    layout_grid,
)
from attncc.runtime.reference import evaluate, index_env
from tests.conftest import ROOT


@pytest.fixture(autouse=True, params=["by_position", "intervals"])
def classifier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here twice: small problems classified by position (a decoding step's path)
    and every problem by intervals (CLASSES_BY_POSITION_MAX and _ONE_ROW_MAX 0), so both stay
    covered."""
    if request.param == "intervals":
        monkeypatch.setattr(sparsity, "CLASSES_BY_POSITION_MAX", 0)
        monkeypatch.setattr(sparsity, "CLASSES_BY_POSITION_ONE_ROW_MAX", 0)
    return request.param


def brute_classes(pred: ex.Expr, problem: Problem, tensors: dict, scalars: dict, br: int, bc: int) -> torch.Tensor:
    """Per-tile (any visible, all visible) from the N x M predicate: the definition."""
    env = dict(index_env(problem.B, problem.H, problem.N, problem.M, torch.device("cpu")))
    env.update(B=problem.B, H=problem.H, Hkv=problem.Hkv, N=problem.N, M=problem.M, D=problem.D, **scalars)
    vis = evaluate(pred, env, tensors).expand(problem.B, problem.H, problem.N, problem.M)
    ti, tj = -(-problem.N // br), -(-problem.M // bc)
    out = torch.empty(problem.B, problem.H, ti, tj, dtype=torch.uint8)
    for a in range(ti):
        for c in range(tj):
            tile = vis[:, :, a * br : (a + 1) * br, c * bc : (c + 1) * bc].reshape(problem.B, problem.H, -1)
            out[:, :, a, c] = torch.where(~tile.any(-1), EMPTY, torch.where(tile.all(-1), FULL, PARTIAL)).to(
                torch.uint8
            )
    return out


def info_for(pred: ex.Expr) -> SparsityInfo:
    used = ex.free_vars(pred) | {v for r in ex.reads(pred) for i in r.index for v in ex.free_vars(i)}
    return SparsityInfo(pred, (), "b" in used, "h" in used, tuple(sorted({r.tensor for r in ex.reads(pred)})))


VI, VJ, B_, H_ = ex.var("i"), ex.var("j"), ex.var("b"), ex.var("h")


def c(v: int) -> ex.Expr:
    return ex.const(v)


def bin_(op: str, a: ex.Expr, b: ex.Expr) -> ex.Expr:
    return ex.Binary(op, a, b)


def random_int_expr(rng: random.Random, depth: int) -> ex.Expr:
    if depth == 0 or rng.random() < 0.3:
        return rng.choice(
            [
                VI,
                VJ,
                VI,
                VJ,
                B_,
                H_,
                c(rng.randint(-40, 120)),
                ex.Read("lengths", (B_,), ex.INT),
                ex.Read("doc", (B_, VI), ex.INT),
                ex.Read("doc", (B_, VJ), ex.INT),
            ]
        )
    kind = rng.choice(["add", "sub", "mul_c", "floordiv", "mod", "min", "max", "abs"])
    a = random_int_expr(rng, depth - 1)
    if kind == "mul_c":
        return bin_("mul", a, c(rng.randint(-3, 3)))
    if kind in ("floordiv", "mod"):
        return bin_(kind, a, c(rng.randint(1, 70)))
    if kind == "abs":
        return ex.Unary("abs", a)
    return bin_(kind, a, random_int_expr(rng, depth - 1))


def random_predicate(rng: random.Random, depth: int) -> ex.Expr:
    if depth == 0 or rng.random() < 0.4:
        op = rng.choice(["lt", "le", "gt", "ge", "eq", "ne"])
        return bin_(op, random_int_expr(rng, 2), random_int_expr(rng, 2))
    kind = rng.choice(["and", "or", "not"])
    if kind == "not":
        return ex.Unary("not", random_predicate(rng, depth - 1))
    return bin_(kind, random_predicate(rng, depth - 1), random_predicate(rng, depth - 1))


def runtime_tensors(problem: Problem, gen: torch.Generator) -> dict:
    return {
        "lengths": torch.randint(0, problem.M + 1, (problem.B,), generator=gen),
        "doc": torch.randint(0, 5, (problem.B, max(problem.N, problem.M)), generator=gen).sort(-1).values,
    }


@pytest.mark.parametrize("seed", range(6))
def test_random_predicates_are_classified_soundly(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(40):
        problem = Problem(2, 2, 2, rng.randint(1, 150), rng.randint(1, 150), 64)
        br, bc = rng.choice([(4, 32), (16, 32), (64, 128), (8, 64)])
        pred = random_predicate(rng, 2)
        tensors = runtime_tensors(problem, gen)
        tensors["doc"] = tensors["doc"][:, : max(problem.N, problem.M)]
        got = classify_tiles(info_for(pred), problem, {}, tensors, br, bc).expand(problem.B, problem.H, -1, -1)
        want = brute_classes(pred, problem, tensors, {}, br, bc)
        # sound: "empty" tiles have no visible element, "full" tiles no masked element
        assert not ((got == EMPTY) & (want != EMPTY)).any(), str(pred)
        assert not ((got == FULL) & (want != FULL)).any(), str(pred)


@pytest.mark.parametrize("seed", range(3))
def test_small_problems_are_classified_exactly_by_position(seed: int, classifier: str) -> None:
    """Problems of at most CLASSES_BY_POSITION_MAX positions (decoding steps, short chunks) are
    classified by the mask's value at each position: the brute-force classes, whatever the
    predicate (int scalars as ints: `j < i + w` with w an input), tails included; the
    intervals' classes are sound and never finer."""
    rng = random.Random(100 + seed)
    gen = torch.Generator().manual_seed(100 + seed)
    window = bin_("lt", bin_("sub", VI, VJ), ex.Var("w", ex.INT))
    for _ in range(30):
        problem = Problem(2, 2, 2, rng.randint(1, 40), rng.randint(1, 300), 64)
        br, bc = rng.choice([(4, 32), (16, 32), (64, 128), (8, 64), (12, 40)])
        pred = random_predicate(rng, 2)
        pred = bin_("and", pred, window) if rng.random() < 0.3 else pred
        tensors = runtime_tensors(problem, gen)
        scalars = {"w": float(rng.randint(0, 50))}
        info = info_for(pred)
        got = classify_tiles(info, problem, scalars, tensors, br, bc).expand(problem.B, problem.H, -1, -1)
        want = brute_classes(pred, problem, tensors, {"w": int(scalars["w"])}, br, bc)
        if classifier == "by_position":
            assert torch.equal(got, want), str(pred)
        else:
            assert not ((got == EMPTY) & (want != EMPTY)).any() and not ((got == FULL) & (want != FULL)).any()


def test_float_predicates_and_large_problems_are_classified_by_intervals(
    monkeypatch: pytest.MonkeyPatch, classifier: str
) -> None:
    """A predicate that computes with floats keeps tiles partial where the kernels' own
    rounding decides (`x * 0.1 < 1.0` at x = 10 is 1.0000000000000002 in float64, 1.0 in
    float32); problems above CLASSES_BY_POSITION_MAX (65536) are classified by intervals, those of
    one query tile above CLASSES_BY_POSITION_ONE_ROW_MAX."""
    evaluated: list[int] = []
    monkeypatch.setattr(sparsity, "evaluate", lambda *args, **kw: evaluated.append(1) or evaluate(*args, **kw))
    tenth = ex.Binary("lt", ex.Binary("mul", ex.Var("j", ex.INT), ex.const(0.1)), ex.const(1.0))
    classify_tiles(info_for(tenth), Problem(1, 1, 1, 1, 64, 64), {}, {}, 1, 32)
    causal = bin_("le", VJ, VI)
    classify_tiles(info_for(causal), Problem(1, 1, 1, 256, 257, 64), {}, {}, 64, 128)
    assert evaluated == []
    classify_tiles(info_for(causal), Problem(1, 1, 1, 256, 256, 64), {}, {}, 64, 128)
    assert evaluated == ([1] if classifier == "by_position" else [])
    # one query tile (a decoding step's rows): by position up to CLASSES_BY_POSITION_ONE_ROW_MAX
    # (2^19) positions, exactly; intervals above
    padding = bin_("and", causal, bin_("ge", VJ, ex.Read("starts", (B_,), ex.INT)))
    starts = {"starts": torch.tensor([5000, 0])}
    step = Problem(2, 3, 1, 4, 1 << 16, 64)
    got = classify_tiles(info_for(padding), step, {}, starts, 16, 96)
    assert evaluated == ([1, 1] if classifier == "by_position" else [])
    want = brute_classes(padding, step, starts, {}, 16, 96)
    assert torch.equal(got.expand_as(want), want)
    classify_tiles(info_for(padding), replace(step, M=(1 << 16) + 1), {}, starts, 16, 96)
    assert evaluated == ([1, 1] if classifier == "by_position" else [])


AFFINE = [
    bin_("le", VJ, VI),  # causal
    bin_("lt", bin_("sub", VI, VJ), c(37)),  # window
    bin_("ge", bin_("add", VJ, c(5)), bin_("mul", VI, c(2))),
    bin_("lt", VJ, ex.Read("lengths", (B_,), ex.INT)),  # key padding
    bin_("gt", bin_("sub", bin_("mul", VJ, c(3)), VI), bin_("mul", H_, c(20))),
]


@pytest.mark.parametrize("pred", AFFINE, ids=str)
def test_single_comparisons_are_classified_exactly(pred: ex.Expr) -> None:
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    for _ in range(25):
        problem = Problem(3, 2, 1, rng.randint(1, 300), rng.randint(1, 300), 64)
        br, bc = rng.choice([(4, 32), (64, 128), (12, 96)])
        tensors = runtime_tensors(problem, gen)
        got = classify_tiles(info_for(pred), problem, {}, tensors, br, bc).expand(problem.B, problem.H, -1, -1)
        assert torch.equal(got, brute_classes(pred, problem, tensors, {}, br, bc)), str(pred)


@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "padding"])
def test_the_readme_masks_are_classified_exactly(name: str) -> None:
    """README: classification is exact for the causal, window, prefix and padding masks (every
    tile the mask leaves empty is skipped, every full tile skips the predicate), at the tiles
    the kernel plans and at tiles that do not divide N, M or the window."""
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn")
    pred = kern.op.sparsity.predicate
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    for trial in range(12):
        problem = Problem(3, 2, 1, rng.randint(1, 700), rng.randint(1, 700), 64)
        tensors = {d.name: torch.randint(0, problem.M + 1, (3,), generator=gen) for d in kern.inputs}
        br, bc = (64, 128) if trial % 2 else rng.choice([(4, 32), (12, 96), (48, 40)])
        got = classify_tiles(kern.op.sparsity, problem, {}, tensors, br, bc).expand(problem.B, problem.H, -1, -1)
        assert torch.equal(got, brute_classes(pred, problem, tensors, {}, br, bc)), (name, problem, br, bc)


def test_tiles_are_classified_in_bands_of_rows_as_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Classes by intervals are made in bands of tile rows (the temporaries of N = M = 1M were
    ~4 GB at once): bands of 5 tiles give the classes of one band, packed sequences too, and a
    problem past TILE_CLASSES_MAX is an InputError before any allocation (`attncc explain` at
    N = M = 1e11 was killed for memory)."""
    kern = attncc.compile(ROOT / "examples" / "padding.attn")
    gen = torch.Generator().manual_seed(5)
    problem = Problem(3, 2, 1, 700, 650, 64)
    tensors = {d.name: torch.randint(0, problem.M + 1, (3,), generator=gen) for d in kern.inputs}
    lengths = (torch.tensor([700, 0, 333]), torch.tensor([650, 17, 1]))
    whole = [classify_tiles(kern.op.sparsity, problem, {}, tensors, 12, 40, given) for given in (None, lengths)]
    monkeypatch.setattr(sparsity, "CLASSIFIED_TILES_PER_BAND", 5)
    for given, want in zip((None, lengths), whole):
        assert torch.equal(classify_tiles(kern.op.sparsity, problem, {}, tensors, 12, 40, given), want)
    huge = Problem(1, 1, 1, 10**11, 10**11, 64)
    with pytest.raises(InputError, match="tiles of 64 x 128 to classify, more than attncc maps"):
        classify_tiles(kern.op.sparsity, huge, {}, {d.name: torch.tensor([5]) for d in kern.inputs}, 64, 128)


def test_document_mask_is_sound_and_skips_most_empty_tiles() -> None:
    """A document mask is not a single comparison: classification is sound (never empty or full
    where the mask says otherwise) and finds most empty tiles, as the README promises."""
    pred = bin_(
        "and", bin_("eq", ex.Read("doc", (B_, VI), ex.INT), ex.Read("doc", (B_, VJ), ex.INT)), bin_("le", VJ, VI)
    )
    gen = torch.Generator().manual_seed(3)
    problem = Problem(2, 1, 1, 512, 512, 64)
    doc = torch.randint(0, 6, (2, 512), generator=gen).sort(-1).values
    got = classify_tiles(info_for(pred), problem, {}, {"doc": doc}, 64, 64).expand(2, 1, -1, -1)
    want = brute_classes(pred, problem, {"doc": doc}, {}, 64, 64)
    assert not ((got == EMPTY) & (want != EMPTY)).any() and not ((got == FULL) & (want != FULL)).any()
    # most of the document mask is skippable, and the analysis finds every empty tile whose
    # documents differ entirely or that lie above the diagonal
    assert (got == EMPTY).sum() >= (want == EMPTY).sum() * 0.9


@pytest.mark.parametrize(
    "kind,params",
    [
        ("local", (("width", 2),)),
        ("strided", (("stride", 3),)),
        ("fixed", (("stride", 4), ("summary", 1))),
        ("butterfly", ()),
    ],
)
def test_layouts_are_classified_exactly_when_tiles_align(kind: str, params: tuple) -> None:
    layout = Layout(kind, 32, params)
    for n, m in ((512, 512), (300, 200), (1, 33)):
        grid = layout_grid(layout, n, m)
        pred = ex.Read("__layout0", (bin_("floordiv", VI, c(32)), bin_("floordiv", VJ, c(32))), ex.BOOL)
        problem = Problem(1, 1, 1, n, m, 64)
        got = classify_tiles(info_for(pred), problem, {}, {"__layout0": grid}, 32, 32)
        want = brute_classes(pred, problem, {"__layout0": grid}, {}, 32, 32)
        assert torch.equal(got, want)
        got64 = classify_tiles(info_for(pred), problem, {}, {"__layout0": grid}, 64, 64)  # tiles span 2x2 blocks
        want64 = brute_classes(pred, problem, {"__layout0": grid}, {}, 64, 64)
        assert torch.equal(got64, want64)


def test_butterfly_grid_is_the_flat_butterfly() -> None:
    grid = layout_grid(Layout("butterfly", 16, ()), 16 * 8, 16 * 8)
    for r in range(8):
        for col in range(8):
            x = r ^ col
            assert bool(grid[r, col]) == (x == 0 or (x & (x - 1)) == 0)
    assert grid.float().mean() < 0.6  # sparse: 1 + log2(8) blocks per row of 8


def test_classification_never_materialises_n_by_m() -> None:
    """At N = M = 65536 the N x M bool mask would be 4 GiB; classification stays small."""
    pred = bin_("and", bin_("le", VJ, VI), bin_("lt", bin_("sub", VI, VJ), c(1024)))
    problem = Problem(1, 1, 1, 65536, 65536, 64)
    got = classify_tiles(info_for(pred), problem, {}, {}, 64, 128)
    assert got.shape == (1, 1, 1024, 512)
    visible_fraction = (got != EMPTY).float().mean().item()
    assert visible_fraction < 0.03


def test_host_read_tensors_are_the_ones_whose_values_decide_classes_or_checks() -> None:
    """What a GPU call must copy to the host: tensors in the mask, inside an index, or in an
    integer divisor; a tensor only read for its value into the score stays on the device."""
    program = """attention nested
input idx: int[B, N]
input bias: float[H, M]
input stride: int[B]
input lengths: int[B]
s = q @ k.T * scale + bias[h, idx[b, i]] + i // stride[b]
mask j < lengths[b]
p = softmax(s)
o = p @ v
output o
"""
    op = fused_node(attncc.lower(program, "cpu")[-1].graph)[1]
    assert host_read_tensors(op.mask, op.score) == {"idx", "stride", "lengths"}
    alibi = fused_node(attncc.lower(ROOT / "examples" / "alibi.attn", "cpu")[-1].graph)[1]
    assert host_read_tensors(alibi.mask, alibi.score) == frozenset()


def _program(name: str, inputs: str, score: str, mask: str = "", layout: str = "") -> attncc.Kernel:
    lines = [f"attention {name}", *inputs.splitlines(), f"s = q @ k.T * scale{score}"]
    lines += [f"mask {mask}"] * bool(mask) + [f"layout {layout}"] * bool(layout)
    return attncc.compile("\n".join([*lines, "p = softmax(s)", "o = p @ v", "output o", ""]))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, bias: float | torch.Tensor = 0):
    """float64 attention of q [B, H, N, D] over k, v [B, Hkv, M, D] (GQA heads repeated) where
    `keep` [B, H, N, M] holds; fully masked rows 0."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + bias
    return (scores.masked_fill(~keep, -torch.inf).softmax(-1).nan_to_num() @ v).to(q.dtype)


@pytest.mark.parametrize("dims", ["B, NB, MB", "H, B, NB, MB", "Hkv, NB, MB", "B, Hkv, NB, MB"])
def test_a_block_masks_leading_dims_are_read_by_their_declared_names(dims: str) -> None:
    """`layout blocks(bm)` read bm as [H, NB, MB] or [B, H, NB, MB] by its rank alone: a
    per-sequence [B, NB, MB] mask gave every sequence sequence 0's blocks (error 0.8), [H, B, ...]
    swapped b and h, and a per-kv-head mask under GQA was an out-of-range error on h."""
    B, H, Hkv, N, block = 2, 4, 2, 12, 4
    kern = _program("blocks_by_name", f"input bm: bool[{dims}]", "", layout="blocks(bm, block=4)")
    generator = torch.Generator().manual_seed(0)
    names = [d.strip() for d in dims.split(",")][:-2]
    sizes = {"B": B, "H": H, "Hkv": Hkv}
    bm = torch.rand(*(sizes[n] for n in names), N // block, N // block, generator=generator) < 0.5
    q = torch.randn(B, H, N, 16, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, N, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    # the mask per (b, h) from the names: b for B, h for H, h's kv head for Hkv
    index = {"B": torch.arange(B).view(B, 1), "H": torch.arange(H).view(1, H), "Hkv": torch.arange(H).view(1, H) // 2}
    per_head = bm[tuple(index[n] for n in names)] if names else bm.expand(B, H, -1, -1)
    keep = per_head.expand(B, H, -1, -1).repeat_interleave(block, -2).repeat_interleave(block, -1)
    assert not (torch.equal(keep, keep[:1].expand_as(keep)) and torch.equal(keep, keep[:, :1].expand_as(keep)))
    torch.testing.assert_close(kern(q, k, v, bm=bm), _attention(q, k, v, keep), atol=1e-12, rtol=1e-12)


def test_block_masks_with_other_leading_dims_are_dsl_errors() -> None:
    with pytest.raises(attncc.DslError, match=r"leading dims among B, H or Hkv, each once.*declared bool\[N, NB, MB\]"):
        _program("bad_lead", "input bm: bool[N, NB, MB]", "", layout="blocks(bm, block=4)")
    with pytest.raises(attncc.DslError, match=r"each once.*declared bool\[B, B, NB, MB\]"):
        _program("bad_lead", "input bm: bool[B, B, NB, MB]", "", layout="blocks(bm, block=4)")
    with pytest.raises(attncc.DslError, match=r"per query head \(H\) or per kv head \(Hkv\), not both"):
        _program("bad_lead", "input bm: bool[H, Hkv, NB, MB]", "", layout="blocks(bm, block=4)")
    with pytest.raises(attncc.DslError, match=r"`fixed`: summary=5 is more than stride=2"):
        _program("bad_fixed", "", "", layout="fixed(block=4, stride=2, summary=5)")


@pytest.mark.parametrize("bound", [4.8, 5.6])
def test_float_mask_ties_are_decided_by_the_kernels_own_precision(bound: float) -> None:
    """`mask i * 0.1 <= bound` at a tie: float32 keeps row 48 (48 * 0.1f <= 4.8f), float64 does
    not (4.800000000000001). The tile classes, evaluated in float64, made the tile of rows 48..63
    EMPTY at 4.8 (row 48 dropped) while at 5.6 the tie fell inside a partial tile, where the
    kernel's float32 test decided: the same tie two ways by where tiles fall. Now float values
    are widened so such tiles are partial and the kernel's precision decides every row."""
    kern = _program("float_tie", "", "", mask=f"i * 0.1 <= {bound}")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, 16, generator=generator) for _ in range(3))
    _, lse = kern(q, k, v, return_lse=True)
    rows = torch.arange(64, dtype=torch.float32) * torch.tensor(0.1, dtype=torch.float32)
    assert torch.equal(lse[0, 0].isfinite(), rows <= torch.tensor(bound, dtype=torch.float32))


def test_a_remainder_by_a_positive_variable_stays_within_it() -> None:
    """`tbl[i % (j + 1)]` reads 0..j: the bounds check took i % (j + 1) as [-50, 50] and refused
    the program."""
    kern = _program("mod_read", "input tbl: float[60]", " + tbl[i % (j + 1)]")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 40, 16, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 50, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    tbl = torch.randn(60, generator=generator, dtype=torch.float64)
    i, j = torch.arange(40).view(-1, 1), torch.arange(50).view(1, -1)
    keep = torch.ones(1, 2, 40, 50, dtype=torch.bool)
    torch.testing.assert_close(
        kern(q, k, v, tbl=tbl), _attention(q, k, v, keep, tbl[i % (j + 1)]), atol=1e-12, rtol=1e-12
    )


PACKED = [
    bin_("le", VJ, bin_("add", VI, bin_("sub", ex.var("M"), ex.var("N")))),  # bottom-right causal
    bin_("le", bin_("sub", VI, VJ), c(20)),  # window: true for keys past a sequence's end
    bin_("ge", VJ, VI),
]


@pytest.mark.parametrize("pred", PACKED, ids=str)
def test_packed_sequences_are_classified_at_their_own_lengths_exactly(pred: ex.Expr) -> None:
    """With `lengths` (a packed batch) each sequence's tiles are classified at its own N and M,
    and tiles past its last query or key are EMPTY: the classes of each sequence alone, padded
    to the longest (a sequence whose last key or query begins a tile, lengths of 0 and 1 and
    N != M, where `M - N` is the sequence's own)."""
    n = torch.tensor([65, 40, 0, 1, 64, 130])
    m = torch.tensor([33, 97, 9, 1, 128, 70])
    problem = Problem(6, 2, 1, int(n.max()), int(m.max()), 64)
    for br, bc in ((16, 32), (64, 32), (8, 64)):
        got = classify_tiles(info_for(pred), problem, {}, {}, br, bc, (n, m)).expand(6, 2, -1, -1)
        ti, tj = -(-problem.N // br), -(-problem.M // bc)
        want = torch.full((6, 2, ti, tj), EMPTY, dtype=torch.uint8)
        for b, (rows, cols) in enumerate(zip(n.tolist(), m.tolist())):
            alone = Problem(1, 2, 1, rows, cols, 64)
            if rows and cols:
                classes = brute_classes(pred, alone, {}, {}, br, bc)[0]
                want[b, :, : classes.shape[1], : classes.shape[2]] = classes
        assert torch.equal(got, want), (str(pred), br, bc)
