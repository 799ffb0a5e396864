"""Pass tests in the style of lit: a small program, the pass, the expected IR text."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from attncc.errors import AttnccError, IRVerificationError
from attncc.frontend.lower import parse_program
from attncc.ir import expr as ex
from attncc.ir.graph import fused_node, print_graph, verify
from attncc.passes import run_pipeline
from attncc.passes.backward import derive_backward
from attncc.passes.canonicalize import canonicalize
from attncc.passes.fuse import fuse_attention
from attncc.passes.sparsity import analyse_sparsity
from attncc.passes.tiling import (
    CPU_MAX_HEAD_DIM,
    GPU_MAX_HEAD_DIM,
    SPLIT_EFFICIENCY,
    choose_kv_splits,
    gpu_registers,
    paper_blocks,
    tile,
)
from attncc.targets import GPUS, Target, cpu, get_target


def program(body: str) -> str:
    return "attention t\n" + body + "\np = softmax(s)\no = p @ v\noutput o\n"


def body_lines(text: str) -> list[str]:
    """The graph printout without the header, the q/k/v inputs and the closing brace."""
    return [line.strip() for line in text.splitlines()[4:-1]]


SOFTCAP_ALIBI = program(
    "input slopes: float[H]\ns = q @ k.T * scale\nmask j <= i\ns = 30.0 * tanh(s / 30.0)\ns = s - slopes[h] * (i - j)"
)


def test_canonicalize_composes_maps_moves_masks_and_folds_the_scale() -> None:
    g = verify(canonicalize(parse_program(SOFTCAP_ALIBI, "t.attn")))
    assert body_lines(print_graph(g)) == [
        "%3 = input slopes: tensor float[H]",
        "%4 = matmul q @ k.T * scale (%0, %1)",  # the name stays: a call may set its value
        "%12 = map s -> 30.0 * tanh(s / 30.0) - slopes[h] * (i - j) (%4)",
        "%13 = mask j <= i (%12)",
        "%9 = softmax (%13)",
        "%10 = matmul p @ v (%9, %2)",
        "%11 = output (%10)",
    ]


def test_canonicalize_drops_identity_map_and_uses_program_scale() -> None:
    g = canonicalize(parse_program(program("scale = 0.125\ns = q @ k.T * scale * 2"), "t.attn"))
    lines = body_lines(print_graph(g))
    assert lines[0] == "%3 = matmul q @ k.T * scale * 2 (%0, %1)"
    assert not any("map" in line for line in lines)
    fused = fused_node(fuse_attention(g))[1]
    assert str(fused.default_scale) == "0.125" and "where scale=0.125 by default" in fused.describe()


def test_constant_folding() -> None:
    g = canonicalize(
        parse_program(program("const w = 2 * 64\ns = q @ k.T\ns = s + (1 + 2) * 0.5\nmask i - j < w + 0"), "t.attn")
    )
    lines = body_lines(print_graph(g))
    assert "map s -> s + 1.5" in lines[1]
    assert "mask i - j < 128" in lines[2]


def test_fuse_makes_one_node() -> None:
    g = verify(fuse_attention(canonicalize(parse_program(SOFTCAP_ALIBI, "t.attn"))))
    lines = body_lines(print_graph(g))
    assert lines == [
        "%3 = input slopes: tensor float[H]",
        "%14 = fused_attention scale=scale, score=30.0 * tanh(s / 30.0) - slopes[h] * (i - j), where scale=1.0 / sqrt(D) "
        "by default, mask=j <= i (%0, %1, %2)",
        "%15 = output (%14)",
    ]
    assert sorted(g.predecessors("%14")) == ["%0", "%1", "%2", "%3"]


def test_sparsity_folds_layouts_into_the_predicate() -> None:
    src = program(
        "input bm: bool[NB, MB]\ns = q @ k.T * scale\nmask j <= i\nlayout butterfly(block=32)\nlayout blocks(bm, block=64)"
    )
    g = verify(analyse_sparsity(fuse_attention(canonicalize(parse_program(src, "t.attn")))))
    _, op = fused_node(g)
    assert str(op.mask) == "j <= i and __layout0[i // 32, j // 32] and bm[i // 64, j // 64]"
    assert op.sparsity.runtime_inputs == ("bm",)
    assert not op.sparsity.varies_with_batch and not op.sparsity.varies_with_head
    assert "input __layout0: generated bool[ceil(N/32), ceil(M/32)]" in print_graph(g)


def test_backward_derives_score_and_input_gradients() -> None:
    g = derive_backward(analyse_sparsity(fuse_attention(canonicalize(parse_program(SOFTCAP_ALIBI, "t.attn")))))
    _, op = fused_node(g)
    assert str(op.backward.dscore) == "30.0 * ((1.0 - tanh(s / 30.0) * tanh(s / 30.0)) * 0.03333333333333333)"
    (grad,) = op.backward.inputs
    assert str(grad.read) == "slopes[h]" and grad.per_tile
    assert str(grad.derivative) == "-(1.0 * (i - j))"


def test_symbolic_derivatives_match_finite_differences() -> None:
    s = ex.score()
    cases = [
        ex.Unary("exp", ex.Binary("mul", s, ex.const(0.5))),
        ex.Binary("div", s, ex.Binary("add", ex.Unary("abs", s), ex.const(1.0))),
        ex.Binary("max", s, ex.Binary("mul", s, s)),
        ex.Where(
            ex.Binary("gt", s, ex.const(0.0)),
            ex.Unary("sqrt", s),
            ex.Unary("log", ex.Binary("add", ex.Unary("neg", s), ex.const(2.0))),
        ),
        ex.Binary("min", ex.Unary("tanh", s), ex.const(0.3)),
    ]
    from attncc.runtime.reference import evaluate

    for e in cases:
        d = ex.diff(e, s)
        for x in (-1.3, -0.2, 0.4, 1.7):
            h = 1e-6
            numeric = (float(evaluate(e, {"s": x + h}, {})) - float(evaluate(e, {"s": x - h}, {}))) / (2 * h)
            assert math.isclose(float(evaluate(d, {"s": x}, {})), numeric, rel_tol=1e-5, abs_tol=1e-6), (str(e), x)


def test_tiling_matches_the_paper_when_no_limit_binds() -> None:
    assert paper_blocks(12288, 64) == (48, 48)  # M = 48 KiB of fp32: Bc = ceil(M/4d), Br = min(Bc, d)
    assert paper_blocks(100_000, 64) == (64, 391)
    big_l1 = Target("big", "cpu", onchip_bytes=1 << 30, l1_bytes=1 << 30)
    small = Target("small", "cpu", onchip_bytes=16 * 1024, l1_bytes=1 << 30)
    g = tile(fuse_attention(canonicalize(parse_program(program("s = q @ k.T"), "t.attn"))), small)
    table = fused_node(g)[1].tiling
    plan = table.for_head_dim(16)
    with pytest.raises(AttnccError, match="no tiling fits"):
        table.for_head_dim(256)
    # M = 4096 fp32: paper Bc = 64, Br = 16, both already multiples of the micro-kernel.
    assert (plan.paper_block_rows, plan.paper_block_cols) == (16, 64)
    assert (plan.block_rows, plan.block_cols) == (16, 64)
    assert fused_node(tile(g, big_l1))[1].tiling.for_head_dim(64).block_rows == 64


@pytest.mark.parametrize("target_name", ["cpu", *GPUS])
def test_every_plan_fits_its_target(target_name: str) -> None:
    target = get_target(target_name)
    stages = run_pipeline(program("s = q @ k.T * scale\nmask j <= i"), "t.attn", target)
    table = fused_node(stages[-1].graph)[1].tiling
    assert table.max_head_dim == (CPU_MAX_HEAD_DIM if target.kind == "cpu" else GPU_MAX_HEAD_DIM)
    for d in range(1, table.max_head_dim + 1):
        forward = table.for_head_dim(d)
        plans = [forward, table.for_head_dim(d, backward=True)]
        for p in plans:
            assert p.head_dim >= d and p.onchip_bytes <= target.onchip_bytes
            if target.kind == "cpu":
                assert p.block_rows % 4 == 0 and p.block_cols % 32 == 0
                # the K^T panel stays in L1, or is the narrowest (d > 256: absorbed MLA's 576)
                assert 4 * p.head_dim * p.block_cols <= target.l1_bytes or p.block_cols == 32
            else:
                assert p.block_rows % target.mma_shape[0] == 0 and p.block_cols % 16 == 0
                assert gpu_registers(p.block_cols, p.head_dim) <= target.max_registers_per_thread
                assert p.threads <= target.max_threads_per_block
        if target.kind == "cpu":  # one set of tasks for both passes
            assert (plans[1].block_rows, plans[1].block_cols) == (forward.block_rows, forward.block_cols)
        else:  # the backward's rows: a lane's dropout keep bits (4 Br / 8) fit one 32-bit word
            assert plans[1].block_rows <= 64 and plans[1].block_cols <= 128


def test_gpu_target_too_small_for_the_backward_runs_the_forward() -> None:
    """A GPU row with 48 KiB of shared memory: at d=256 the 16 x 16 forward fits (42 KiB), no
    backward does (half of dV in registers: 58 KiB), and asking for one says what it needs."""
    small = replace(GPUS["sm80"], name="small", onchip_bytes=48 * 1024)
    table = fused_node(run_pipeline(program("s = q @ k.T * scale"), "t.attn", small)[-1].graph)[1].tiling
    assert (table.for_head_dim(256).block_rows, table.for_head_dim(256).block_cols) == (16, 16)
    assert table.for_head_dim(256).backward is None and table.for_head_dim(128).backward is not None
    with pytest.raises(
        AttnccError, match=r"forward runs on target small, but no backward tiling fits .* needs 59264 B"
    ):
        table.for_head_dim(256, backward=True)


def test_cpu_target_reads_the_machine() -> None:
    t = cpu()
    assert t.l1_bytes >= 16 * 1024 and t.onchip_bytes >= t.l1_bytes


def test_cost_model_fused_moves_less_than_unfused() -> None:
    stages = run_pipeline(program("s = q @ k.T * scale\nmask j <= i"), "t.attn", cpu())
    model = fused_node(stages[-1].graph)[1].cost
    dense = model.predict(1, 8, 4096, 4096, 64, 4, 64, 128)
    half = model.predict(1, 8, 4096, 4096, 64, 4, 64, 128, density=0.5)
    assert dense.fused_fwd_bytes < dense.unfused_fwd_bytes / 3
    # Algorithm 1: Q, O once; K and V once per query tile (N / Br = 64 of them)
    assert dense.fused_fwd_bytes == pytest.approx(8 * (2 * 4096 * 64 * 4 + 4 * 4096 + 64 * 32 * 2 * 128 * 64 * 4))
    assert dense.fused_bwd_bytes < dense.unfused_bwd_bytes
    assert half.fused_fwd_flops == pytest.approx(dense.fused_fwd_flops / 2)
    assert dense.fused_fwd_flops == pytest.approx(4 * 8 * 4096 * 4096 * 64)
    # unfused traffic is dominated by N x M fp32 passes: at least 4 reads/writes of S
    assert dense.unfused_fwd_bytes >= 4 * 4 * 8 * 4096 * 4096
    # v 32 wide (Dv): V read and O written at their own width, and P V multiplied at it
    narrow = model.predict(1, 8, 4096, 4096, 64, 4, 64, 128, Dv=32)
    assert narrow.fused_fwd_bytes == pytest.approx(8 * (4096 * 96 * 4 + 4 * 4096 + 64 * 32 * 128 * 96 * 4))
    assert narrow.fused_fwd_flops == pytest.approx(2 * 8 * 4096 * 4096 * 96)
    assert narrow.fused_bwd_bytes < dense.fused_bwd_bytes


def test_verifier_names_the_broken_node() -> None:
    g = fuse_attention(canonicalize(parse_program(program("s = q @ k.T"), "t.attn")))
    node, op = fused_node(g)
    g.nodes[node]["op"] = replace(op, mask=ex.Binary("lt", ex.var("i"), ex.var("window")))
    with pytest.raises(IRVerificationError, match=rf"node {node} \(fused_attention.*unknown variable window"):
        verify(g, "test")
    g.nodes[node]["op"] = replace(op, score=ex.Binary("lt", ex.var("i"), ex.var("j")))
    with pytest.raises(IRVerificationError, match="score expression: has type bool"):
        verify(g, "test")


def test_pipeline_runs_the_verifier_after_each_pass() -> None:
    stages = run_pipeline(SOFTCAP_ALIBI, "t.attn", cpu())
    assert [s.name for s in stages] == [
        "parse",
        "canonicalize",
        "fuse_attention",
        "analyse_sparsity",
        "derive_backward",
        "tile",
        "cost",
    ]
    op = fused_node(stages[-1].graph)[1]
    assert op.sparsity and op.backward and op.tiling and op.cost


@pytest.mark.parametrize(
    ("blocks", "tiles", "sms"), [(8, 64, 132), (1, 2, 108), (3, 1000, 40), (16, 3, 108), (50, 7, 84)]
)
def test_split_kv_fills_the_gpu_with_non_empty_splits(blocks: int, tiles: int, sms: int) -> None:
    """Decoding-sized calls split the keys in a power of two; every split gets tiles; its last
    wave is nearly as full as the best power of two's."""
    splits = choose_kv_splits(blocks, tiles, sms)
    assert 1 < splits <= tiles and splits & (splits - 1) == 0
    per = math.ceil(tiles / splits)
    assert math.ceil(tiles / per) == splits  # no empty split

    def fill(s: int) -> float:
        return blocks * s / sms / math.ceil(blocks * s / sms)

    powers = [2**p for p in range(min(tiles, sms, 128).bit_length())]
    assert fill(splits) >= SPLIT_EFFICIENCY * max(fill(s) for s in powers)


def test_split_kv_only_where_the_query_tiles_leave_the_gpu_idle() -> None:
    assert choose_kv_splits(132, 64, 132) == 1  # a full wave already
    assert choose_kv_splits(106, 64, 132) == 1  # 80% of one
    assert choose_kv_splits(8, 1, 132) == 1  # one key tile: nothing to split
    assert choose_kv_splits(8, 64, 0) == 1  # no SM count known
    assert choose_kv_splits(0, 64, 132) == 1  # an empty call (B, H or N is 0)
    assert choose_kv_splits(8, 4096 // 64, 132) == 16  # decoding at B=1, H=8, M=4096 on an H100
