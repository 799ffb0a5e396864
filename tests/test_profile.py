"""The emulator's performance counters, exact against hand-computed counts, and the estimate.

Planted layouts (bank conflicts, uncoalesced and misaligned accesses) run as hand-written
kernels on the emulator; a generated forward kernel's counts are derived by hand from its
tiles; the occupancy and roofline arithmetic is checked on made-up counts.
"""

from __future__ import annotations

import csv
import ctypes
from pathlib import Path

import pytest
import torch

import attncc
from attncc.cli import main
from attncc.ir.graph import fused_node
from attncc.passes.roofline import MMA_FLOPS, Work, backward_work, blocks_per_sm, estimate, forward_work
from attncc.passes.tiling import q_in_registers
from attncc.runtime.build import build_library, load_library
from attncc.runtime.inputs import Shape, make_inputs
from attncc.runtime.profile import KernelCounts, Site, forward_estimate, parse_counters, profile, scaled
from tests.conftest import ROOT

HARNESS = r"""
#define ATTNCC_EMULATE 1
#include "attncc/cuda/primitives.cuh"
using namespace attncc;

// Each kernel is one warp (or two) doing one thing per source line; the test finds the lines
// by their LINE markers.
__global__ void shared_layouts(float* global) {
  float* sm = shared_memory<float>();
  const int lane = lane_id();
  st_shared(sm + lane * 32, 1.0f);  // LINE column: every lane in bank 0
  st_shared(sm + lane, 1.0f);  // LINE row: conflict-free
  st_shared(sm + lane * 2, 1.0f);  // LINE stride2: two words per bank
  const float b = ld_shared(sm + 0);  // LINE broadcast: one word for all
  f32x2* pairs = reinterpret_cast<f32x2*>(sm);
  st_shared(pairs + lane, f32x2{b, b});  // LINE pairs: two phases of 16 lanes
  st_shared(pairs + lane * 8, f32x2{b, b});  // LINE pairs_strided: 8 words per bank and phase
  if (lane < 16) st_shared(sm + 64 + lane, b);  // LINE half: 16 lanes active
  for (int i = 0; i < 4; ++i) st_shared(sm + 32 * i + lane, b);  // LINE loop: four requests
  block_sync();
  st_global(global + lane, b);
}

__global__ void matrices(const uint16_t* global) {
  uint16_t* sm = shared_memory<uint16_t>();
  const int lane = lane_id();
  uint32_t r[4];
  ldmatrix_x4<false>(r, sm + lane * 64);  // LINE ldmatrix_unpadded: rows 128 B apart
  ldmatrix_x4<false>(r, sm + lane * 72);  // LINE ldmatrix_padded: rows 144 B apart
  cp_async_16(sm + lane * 8, global + lane * 8);  // LINE copy: 512 contiguous bytes
  cp_async_16(sm + 4096 + lane * 64, global + lane * 64);  // LINE copy_strided: 128 B apart
  cp_async_commit();
  cp_async_wait<0>();
}

__global__ void global_patterns(float* global) {
  const int lane = lane_id();
  float v = ld_global(global + lane);  // LINE coalesced: 128 aligned bytes
  v += ld_global(global + lane + 1);  // LINE misaligned: 128 bytes over five sectors
  v += ld_global(global + lane * 32);  // LINE scattered: a sector per lane
  v += ld_global(global + 7);  // LINE uniform: one word for all
  atomic_add(global + 2048 + lane, v);  // LINE atomics: one per lane
  atomic_add(global + 4096, v);  // LINE same_address: one word
}

__global__ void instructions(float* global) {
  const int lane = lane_id();
  float c[4] = {0, 0, 0, 0};
  const uint32_t a[4] = {0, 0, 0, 0}, bb[2] = {0, 0};
  mma_m16n8k16<f16>(c, a, bb);  // LINE mma: instruction
  float x = shfl_xor(c[0] + float(lane), 1);  // LINE shfl: instruction
  x = fast_exp2(x);  // LINE ex2: instruction
  if (lane < 8) x = fast_exp2(x);  // LINE ex2_divergent: instruction
  block_sync();  // LINE barrier: every warp
  st_global(global + thread_id(), x);
}

extern "C" void profile(int on) { attncc_emu::profile_on(on != 0); }
extern "C" const char* counters() {
  static std::string text;
  text = attncc_emu::counters_json();
  return text.c_str();
}
extern "C" void run(int which, void* global) {
  if (which == 0) ATTNCC_LAUNCH(shared_layouts, dim3(1), dim3(32), 4096, nullptr, static_cast<float*>(global));
  if (which == 1) ATTNCC_LAUNCH(matrices, dim3(1), dim3(32), 16384, nullptr, static_cast<const uint16_t*>(global));
  if (which == 2) ATTNCC_LAUNCH(global_patterns, dim3(1), dim3(32), 0, nullptr, static_cast<float*>(global));
  if (which == 3) ATTNCC_LAUNCH(instructions, dim3(3), dim3(64), 0, nullptr, static_cast<float*>(global));
}
"""


def line_of(marker: str) -> int:
    """The harness line whose comment says `LINE marker:`."""
    found = [n for n, text in enumerate(HARNESS.splitlines(), 1) if f"// LINE {marker}:" in text]
    assert len(found) == 1, marker
    return found[0]


@pytest.fixture(scope="module")
def harness() -> ctypes.CDLL:
    lib = load_library(build_library(HARNESS, "emulator-profile-test"))
    lib.counters.restype = ctypes.c_char_p
    return lib


def counted(lib: ctypes.CDLL, which: int) -> KernelCounts:
    storage = torch.zeros((1 << 16) + 128, dtype=torch.float32)
    memory = storage[(-storage.data_ptr() % 512) // 4 :]  # 512-byte aligned: sector counts are exact
    assert memory.data_ptr() % 512 == 0
    lib.profile(1)
    try:
        lib.run(which, ctypes.c_void_p(memory.data_ptr()))
        (counts,) = parse_counters(lib.counters().decode()).values()
    finally:
        lib.profile(0)
    return counts


def site(counts: KernelCounts, marker: str, op: str) -> Site:
    (found,) = [s for s in counts.sites if s.line == line_of(marker) and s.op == op]
    return found


def test_shared_memory_bank_conflicts_are_counted_exactly(harness: ctypes.CDLL) -> None:
    k = counted(harness, 0)
    expected = {  # marker: (requests, lanes, wavefronts, ideal wavefronts)
        "column": (1, 32, 32, 1),
        "row": (1, 32, 1, 1),
        "stride2": (1, 32, 2, 1),
        "pairs": (1, 32, 2, 2),
        "pairs_strided": (1, 32, 16, 2),  # lane l: words 16 l, 16 l + 1: banks 0, 1 or 16, 17, 8 lanes each
        "half": (1, 16, 1, 1),
        "loop": (4, 128, 4, 4),
    }
    for marker, (requests, lanes, wavefronts, ideal) in expected.items():
        s = site(k, marker, "st.shared")
        assert (s.requests, s.lanes, s.wavefronts, s.ideal_wavefronts) == (requests, lanes, wavefronts, ideal), marker
    b = site(k, "broadcast", "ld.shared")
    assert (b.requests, b.wavefronts, b.bytes) == (1, 1, 128)
    assert (k.launches, k.blocks, k.threads_per_block, k.shared_bytes) == (1, 1, 32, 4096)


def test_ldmatrix_and_async_copies_are_counted_exactly(harness: ctypes.CDLL) -> None:
    k = counted(harness, 1)
    unpadded, padded = site(k, "ldmatrix_unpadded", "ldmatrix"), site(k, "ldmatrix_padded", "ldmatrix")
    # 8 rows of 16 bytes per matrix: 128 B apart they all sit in banks 0-3 (8 words each)
    assert (unpadded.wavefronts, unpadded.ideal_wavefronts) == (32, 4)
    assert (padded.wavefronts, padded.ideal_wavefronts) == (4, 4)
    copy_shared, copy_global = site(k, "copy", "cp.async.shared"), site(k, "copy", "cp.async.global")
    assert (copy_shared.wavefronts, copy_shared.ideal_wavefronts) == (4, 4)
    assert (copy_global.sectors, copy_global.ideal_sectors, copy_global.bytes) == (16, 16, 512)
    strided_shared, strided_global = (
        site(k, "copy_strided", "cp.async.shared"),
        site(k, "copy_strided", "cp.async.global"),
    )
    assert (strided_shared.wavefronts, strided_shared.ideal_wavefronts) == (32, 4)  # 8 lanes per phase in banks 0-3
    assert (strided_global.sectors, strided_global.ideal_sectors) == (32, 16)
    # distinct sectors of the launch: 16 of the first copy, 32 of the second (sectors 0, 4, 8, 12 in both)
    assert k.distinct_sectors == 16 + 32 - 4


def test_global_sectors_are_counted_exactly(harness: ctypes.CDLL) -> None:
    k = counted(harness, 2)
    expected = {  # marker: (op, sectors, ideal sectors)
        "coalesced": ("ld.global", 4, 4),
        "misaligned": ("ld.global", 5, 4),
        "scattered": ("ld.global", 32, 4),
        "uniform": ("ld.global", 1, 1),
        "atomics": ("atom.global", 4, 4),
        "same_address": ("atom.global", 1, 1),
    }
    for marker, (op, sectors, ideal) in expected.items():
        s = site(k, marker, op)
        assert (s.requests, s.sectors, s.ideal_sectors) == (1, sectors, ideal), marker


def test_instructions_are_counted_per_warp(harness: ctypes.CDLL) -> None:
    k = counted(harness, 3)  # 3 blocks of 2 warps
    assert (k.blocks, k.threads_per_block) == (3, 64)
    for marker, op, requests, lanes in (
        ("mma", "mma", 6, 192),
        ("shfl", "shfl", 6, 192),
        ("ex2", "ex2", 6, 192),
        ("ex2_divergent", "ex2", 6, 48),
        ("barrier", "bar.sync", 6, 192),
    ):
        s = site(k, marker, op)
        assert (s.requests, s.lanes) == (requests, lanes), marker


def test_a_generated_forward_counts_what_its_tiles_imply() -> None:
    """vanilla at N = M = D = 64 on sm80 with 64 x 64 tiles: one block of 4 warps, one key tile."""
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", "sm80", tiles=(64, 64), emulate=True)
    counts = profile(kern, Shape(1, 1, 1, 64, 64, 64), torch.float16, backward=False)
    assert set(counts) == {"attention_forward"}
    k = counts["attention_forward"]
    assert (k.blocks, k.threads_per_block) == (1, 128)
    warps = 4
    per_warp = {
        "ldmatrix": 4 + 16 + 16,  # Q: D/16; K: (D/16) x (Bc/16); V: (Bc/16) x (D/16)
        "mma": 2 * 16 + 2 * 16,  # two n8 halves per 16x16 block of S = QK^T and of O = PV
        "cp.async.shared": 3 * 64 * 8 // 128,  # Q, K, V: 64 rows of 8 16-byte chunks over 128 threads
        "ex2": 2 * (1 + 8 * 2),  # per row pair: alpha, then 8 key blocks x 2 scores
        "shfl": 2 * 4,  # max and sum over the quad, per row pair
        "bar.sync": 3,  # Q landed; per key tile: buffer free, tile landed
        "st.global": 2 * 8 + 2,  # O: 2 rows x 8 column blocks (a column pair per lane); lse: 2 rows (t = 0)
    }
    for op, n in per_warp.items():
        assert k.warp_instructions(op) == warps * n, op
    ldmatrix = sum(s.wavefronts for s in k.sites if s.op == "ldmatrix")
    assert ldmatrix == warps * 36 * 4  # rows padded to 72 halves: every ldmatrix conflict-free
    copies = [s for s in k.sites if s.op == "cp.async.global"]
    assert sum(s.sectors for s in copies) == 3 * 64 * 64 * 2 // 32  # Q, K, V read once, whole sectors
    # O is stored 4 bytes (a bf16 pair) per lane, 8 rows x 4 lanes per request: 8 sectors for 128 bytes
    (out_store,) = [s for s in k.sites if s.op == "st.global" and s.lanes == 32 * s.requests]
    assert out_store.bytes == 4 * out_store.lanes
    assert out_store.sectors == 8 * out_store.requests and out_store.ideal_sectors == 4 * out_store.requests


def test_backward_accumulators_are_free_of_bank_conflicts() -> None:
    """dK and dV accumulate in fp32 shared memory as float2 per lane (XOR-swizzled rows): the
    minimum of 2 wavefronts per request; unswizzled rows of D floats give 8 per request."""
    # 64 x 64 tiles: the override keeps both accumulators in shared memory (the roofline's plan
    # holds them in registers at these head dims)
    kern = attncc.compile(ROOT / "examples" / "causal.attn", "sm80", tiles=(64, 64), emulate=True)
    for d in (64, 48):  # rows of 64 floats (swizzle by row % 4) and of 48 (by row / 2 % 2)
        k = profile(kern, Shape(1, 1, 1, 80, 80, d), torch.bfloat16)["attention_backward"]
        pairs = [s for s in k.sites if s.op in ("ld.shared", "st.shared") and s.bytes == 8 * s.lanes]
        assert len(pairs) == 2 and all(s.requests > 0 for s in pairs)
        assert all(s.wavefronts == s.ideal_wavefronts == 2 * s.requests for s in pairs), pairs


def test_occupancy_follows_the_calculator_rules() -> None:
    # A100: 164 KiB shared memory per SM, 1 KiB reserved per block
    assert blocks_per_sm(128, 87040, 204, "sm80") == (1, "shared memory")
    assert blocks_per_sm(128, 40000, 204, "sm80") == (2, "registers")  # 204 -> 6656 per warp, 4 warps
    assert blocks_per_sm(128, 0, 16, "sm80") == (16, "threads")
    assert blocks_per_sm(32, 0, 16, "sm80") == (32, "blocks")


def test_estimate_takes_the_largest_term() -> None:
    mma = Site(1, "mma", 108 * 4 * 1000, 108 * 4 * 1000 * 32, 0, 0, 0, 0, 0)
    lds = Site(2, "ldmatrix", 108 * 4 * 100, 0, 108 * 4 * 100 * 8, 108 * 4 * 100 * 4, 0, 0, 0)
    counts = KernelCounts("k", 1, 108, 128, 1024, 1000, (mma, lds))
    work = counts.work("sm80")
    assert (work.mma_flops, work.shared_wavefronts, work.dram_bytes) == (
        mma.requests * MMA_FLOPS,
        lds.wavefronts,
        32000,
    )
    est = estimate(work, "sm80", registers=64)
    # one block per SM, 4 warps: 4000 mma x 4096 FLOP at 2048 FLOP per clock at 1.41 GHz
    assert est.terms["tensor"] == pytest.approx(4000 * 4096 / 2048 / 1.41e9)
    assert est.terms["shared memory"] == pytest.approx(4 * 100 * 8 / 1.41e9)
    assert est.terms["DRAM"] == pytest.approx(32000 / 2039e9)
    assert est.bound == "tensor" and est.seconds == est.terms["tensor"]
    # one warp per block on 108 SMs: 1 of 4 sub-partitions' tensor cores works
    one_warp = Work(108, 32, 1024, 108 * 1000 * 4096, 0, 0, 0, 0)
    assert estimate(one_warp, "sm80").terms["tensor"] == pytest.approx(4 * 1000 * 4096 / 2048 / 1.41e9)
    # 20 blocks: the grid leaves most SMs idle
    assert estimate(KernelCounts("k", 1, 20, 128, 1024, 1000, (mma, lds)).work("sm80"), "sm80", 64).bound == (
        "latency/occupancy"
    )
    doubled = scaled({"k": counts}, Shape(1, 1, 1, 64, 64, 64), 2, 1)["k"]
    assert (doubled.blocks, doubled.sites[0].requests, doubled.distinct_sectors) == (216, 2 * mma.requests, 2000)


@pytest.mark.parametrize(
    ("arch", "shape", "warp_rows"),
    [
        ("sm80", Shape(1, 2, 1, 256, 256, 64), 16),
        ("sm90", Shape(2, 1, 1, 256, 192, 128), 16),
        ("sm86", Shape(1, 1, 1, 128, 256, 32), 16),
        ("sm90", Shape(1, 1, 1, 256, 128, 128), 32),  # Q re-read per key tile
        ("sm80", Shape(1, 2, 1, 128, 128, 64), 32),  # Q in registers
    ],
)
def test_the_tiling_pass_cost_model_counts_what_the_emulator_counts(arch: str, shape: Shape, warp_rows: int) -> None:
    """passes/roofline.py `forward_work` (the tiling pass's model of the forward) against the
    emulator's counters of the generated kernel, at shapes whose N and M are multiples of the
    plan's tiles (128 x 128, 128 x 64, 64 x 128), warps of 16 and 32 rows: every modelled
    quantity exactly."""
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", arch, emulate=True, warp_rows=warp_rows)
    kern.kv_splits = 1  # the model is of the unsplit forward
    plan = fused_node(kern.graph)[1].tiling.for_head_dim(shape.D)
    assert shape.N % plan.block_rows == 0 and shape.M % plan.block_cols == 0 and plan.warp_rows == warp_rows
    measured = profile(kern, shape, torch.bfloat16, backward=False)["attention_forward"].work(arch)
    in_registers = q_in_registers(shape.D, warp_rows)
    model = forward_work(shape.D, plan.block_rows, plan.block_cols, shape, in_registers, warp_rows=warp_rows)
    assert measured == model


@pytest.mark.parametrize(
    ("arch", "shape", "tiles"),
    [
        ("sm80", Shape(1, 2, 1, 96, 256, 64), (48, 128, 64)),  # dK, dV wholly in registers, 8 warps
        ("sm90", Shape(1, 1, 1, 128, 256, 128), (64, 128, 96)),  # light: 32 columns of each in shared memory
        ("sm86", Shape(1, 1, 1, 64, 128, 32), (64, 64, 32)),
    ],
)
def test_the_backward_cost_model_counts_what_the_emulator_counts(
    arch: str, shape: Shape, tiles: tuple[int, int, int]
) -> None:
    """passes/roofline.py `backward_work` against the emulator's counters of the generated
    `attention_backward` (GQA with 2 query heads per kv head; sm90's float2 dQ atomics), at
    shapes whose N and M are multiples of the plan's tiles: every modelled quantity exactly."""
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", arch, emulate=True)
    plan = fused_node(kern.graph)[1].tiling.for_head_dim(shape.D, backward=True)
    assert (plan.block_rows, plan.block_cols, plan.dk_register_columns) == tiles
    assert plan.dv_register_columns == plan.dk_register_columns
    measured = profile(kern, shape, torch.bfloat16)["attention_backward"].work(arch)
    columns = (plan.dk_register_columns, plan.dv_register_columns)
    model = backward_work(
        shape.D, plan.block_rows, plan.block_cols, shape, columns, pair_atomics=arch == "sm90", stages=plan.stages
    )
    assert measured == model


def test_the_backward_tiles_follow_the_roofline() -> None:
    """Accumulating dK and dV in registers removes their 16 wavefronts per warp, 16 columns and
    query tile (as many as the ldmatrix of the dV and dK products); with no shared memory spent
    on them 8 warps (Bc = 128) fit, which halves the L2 traffic of Q, dO and the dQ atomics per
    key. On sm80 at d = 64 the pass takes 48 x 128 with both wholly in registers (FA2 keeps
    them in registers too), about 19% below the 64 x 64 shared-memory plan; at d = 128 the
    state budget (16 below d = 64's) allows 32 columns of each in registers."""
    table = fused_node(attncc.lower(ROOT / "examples" / "causal.attn", "sm80")[-1].graph)[1].tiling
    wide, large = table.for_head_dim(64, backward=True), table.for_head_dim(128, backward=True)
    assert (wide.block_rows, wide.block_cols, wide.dk_register_columns, wide.dv_register_columns) == (48, 128, 64, 64)
    assert (large.dk_register_columns, large.dv_register_columns) == (32, 32)
    problem = Shape(4, 16, 16, 4096, 4096, 64)
    chosen = estimate(backward_work(64, 48, 128, problem, (64, 64)), "sm80", 255)
    shared = estimate(backward_work(64, 64, 64, problem, (0, 0)), "sm80", 255)
    assert chosen.seconds < 0.85 * shared.seconds
    assert chosen.terms["L2"] < 0.55 * shared.terms["L2"]


def test_the_forward_tiles_follow_the_roofline() -> None:
    """On sm80 the 16-row warps make the forward shared-memory bound at every tile (an
    ldmatrix.x4, 4 wavefronts, feeds two mma, 4 clocks of tensor work); 128-row blocks halve
    the L2 traffic for K and V: the pass takes Br = 128, and Bc as large as registers allow."""
    table = fused_node(attncc.lower(ROOT / "examples" / "causal.attn", "sm80")[-1].graph)[1].tiling
    assert [(table.for_head_dim(d).block_rows, table.for_head_dim(d).block_cols) for d in (64, 128)] == [
        (128, 128),
        (128, 64),
    ]
    assert "roofline" in table.for_head_dim(64).reason and "shared memory-bound" in table.for_head_dim(64).reason
    for d in (64, 128):  # the backward's rows stay at most 64 (a lane's dropout keep bits)
        assert table.for_head_dim(d).backward.block_rows <= 64


def test_profile_command(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(ROOT / "examples" / "causal.attn")
    assert main(["profile", path, "--target", "sm80", "--emulate", "--shape", "1,1,1,64,64,64", "--lines", "3"]) == 0
    text = capsys.readouterr().out
    for expected in ("attention_forward:", "attention_backward:", "per warp: mma", "bound:", "line "):
        assert expected in text
    assert main(["profile", path, "--target", "sm80"]) == 1
    assert "for --target sm80: add --emulate" in capsys.readouterr().err


def test_forward_estimate_counts_only_visible_tiles() -> None:
    """Causal at N = M = 512 with 128 x 128 tiles: 10 of 16 tiles per (b, h) are visible, so
    the tensor work is 10/16 of the dense program's."""
    causal = attncc.compile(ROOT / "examples" / "causal.attn", "sm80", emulate=True)
    dense = attncc.compile(ROOT / "examples" / "vanilla.attn", "sm80", emulate=True)
    q, k, _, _ = make_inputs(causal, Shape(2, 4, 4, 512, 512, 64), torch.bfloat16, requires_grad=False)
    ours, theirs = forward_estimate(causal, q, k, registers=200), forward_estimate(dense, q, k, registers=200)
    assert ours.terms["tensor"] == pytest.approx(theirs.terms["tensor"] * 10 / 16)


def test_per_head_input_gradients_take_one_atomic_per_warp_and_tile() -> None:
    """ALiBi's slopes[h] gradient: summed over a tile's scores and the warp, then one atomic,
    not one per live score (65,792 here, all to two addresses)."""
    kern = attncc.compile(ROOT / "examples" / "alibi.attn", "sm80", tiles=(64, 64), emulate=True)
    k = profile(kern, Shape(1, 2, 2, 256, 256, 64), torch.bfloat16)["attention_backward"]
    (slopes,) = [s for s in k.sites if s.op == "atom.global" and s.lanes == s.requests]
    # 64 x 64 backward tiles, causal: 4 + 3 + 2 + 1 visible (key tile, query tile) pairs per head
    assert slopes.requests == 4 * 10 * 2  # warps x pairs x heads


def test_dq_atomics_are_float2_on_sm90() -> None:
    """dQ's fp32 atomics add a column pair per lane with one vector atomic on sm90 (float2
    atomicAdd), two scalar ones on sm80: the same bytes in half the requests (the same 64 x 64
    tiles on both)."""
    counts = {}
    for arch in ("sm80", "sm90"):
        kern = attncc.compile(ROOT / "examples" / "causal.attn", arch, tiles=(64, 64), emulate=True)
        k = profile(kern, Shape(1, 1, 1, 128, 128, 64), torch.bfloat16)["attention_backward"]
        counts[arch] = [s for s in k.sites if s.op == "atom.global"]  # causal has no learnable inputs: dQ only
    sm80, sm90 = (sum(s.bytes for s in counts[a]) for a in ("sm80", "sm90"))
    assert sm80 == sm90 > 0
    assert {s.bytes // s.lanes for s in counts["sm80"]} == {4} and {s.bytes // s.lanes for s in counts["sm90"]} == {8}
    assert sum(s.requests for s in counts["sm80"]) == 2 * sum(s.requests for s in counts["sm90"])


def test_the_ncu_sass_summary_groups_lines_into_regions(tmp_path: Path) -> None:
    """bench/ncu_sass_summary.py on a hand-made `ncu --page source --csv --print-source sass`
    file of two kernels: executed instructions by opcode (predicates and modifiers dropped),
    stall samples by region (lines executed equally often), by opcode and reason, and the
    most sampled line, each as the CSV's numbers give them."""
    from bench.ncu_sass_summary import read_kernels, summarize

    header = [
        "Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
        "stall_barrier", "stall_wait", "stall_selected", "stall_wait (Not Issued)",
    ]  # fmt: skip
    rows = [
        ["Kernel Name", "attention_backward"], header,
        ["0x0", "LDC R1, c[0x0][0x28]", "10", "16", "0", "10", "0", "0"],
        ["0x10", "@!P0 IMAD.MOV.U32 R2, RZ, RZ, R3", "30", "1,000", "0", "20", "10", "5"],
        ["0x20", "HMMA.16816.F32.BF16 R4, R8, R12, R4", "50", "1000", "0", "50", "0", "0"],
        ["0x30", "BAR.SYNC 0x0", "0", "1000", "0", "0", "0", "0"],
        ["0x40", "ULDC UR8, c[0x0][0x4c8]", "60", "1000", "60", "0", "0", "0"],
        ["0x50", "IMAD R5, R5, 0x2, R6", "50", "250", "0", "50", "0", "0"],
        ["Kernel Name", "attention_forward"], header,
        ["0x0", "EXIT", "1", "8", "0", "1", "0", "0"],
    ]  # fmt: skip
    path = tmp_path / "sass.csv"
    with path.open("w", newline="") as f:
        csv.writer(f).writerows(rows)
    backward, forward = read_kernels(str(path))
    assert (backward.name, forward.name, len(backward.lines), len(forward.lines)) == (
        "attention_backward", "attention_forward", 6, 1,
    )  # fmt: skip
    assert [line.opcode for line in backward.lines] == ["LDC", "IMAD", "HMMA", "BAR", "ULDC", "IMAD"]
    assert backward.lines[1].executed == 1000 and backward.lines[4].stalls["barrier"] == 60
    text = summarize(backward, top=3)
    assert "4,266 warp instructions, 200 stall samples" in text
    assert "IMAD 29.3%, HMMA 23.4%, BAR 23.4%" in text  # (1250, 1000, 1000 of 4266)
    assert "1,000 x    4 lines (first     1):  70.0% of samples; IMAD 1, HMMA 1, BAR 1, ULDC 1" in text
    assert "250 x    1 lines (first     5):  25.0% of samples" in text
    assert "IMAD/wait 35.0%, ULDC/barrier 30.0%, HMMA/wait 25.0%" in text  # (selected is no stall)
    assert text.splitlines()[-3].split()[:3] == ["4", "30.00%", "(barrier"]
