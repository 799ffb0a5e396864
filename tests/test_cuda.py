"""CUDA backend without a GPU: nvcc/ptxas on every example, and the exact generated text run on
the host emulator, golden-tested like the CPU backend."""

from __future__ import annotations

import copy
import re
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attncc
from attncc.codegen.cuda import generate_cuda
from attncc.errors import AttnccError, InputError
from attncc.ir.graph import fused_node
from attncc.passes import with_tiles
from attncc.passes.roofline import gpu_dq_shared_bytes
from attncc.passes.tiling import (
    GPU_BACKWARD_STATE_CUT_ABOVE_D64,
    GPU_MAX_BACKWARD_STATE,
    GPU_MAX_LIGHT_BACKWARD_COLUMNS,
    GPU_MAX_LIGHT_BACKWARD_STATE,
    GPU_WIDE_LIGHT_BACKWARD_PLANS,
    MEASURED_BACKWARD_TILES,
    backward_candidates,
    fastest_backward,
    gpu_backward_shared_bytes,
    gpu_shared_bytes,
    is_light_backward,
    wide_light_backward_plans,
)
from attncc.runtime.check import check
from attncc.runtime.emulate import NAN, NEG_INF, POS_INF, EmulatedKernel, fixed_point_shifts, from_fixed_point
from attncc.runtime.inputs import Shape, adapt, make_inputs
from attncc.runtime.kernel import CallPlan
from attncc.runtime.nvcc import compile_cuda, find_nvcc, nvcc_install_hint
from attncc.targets import GPUS, get_target
from tests.conftest import EXAMPLES, ROOT, recorded_problems
from tests.test_serving import BOTTOM_RIGHT

try:
    find_nvcc()
    HAVE_NVCC = True
except AttnccError:
    HAVE_NVCC = False


@cache
def emulated(name: str, arch: str = "sm80", tiles: tuple[int, int] | None = None) -> attncc.Kernel:
    return attncc.compile(ROOT / "examples" / f"{name}.attn", target=arch, tiles=tiles, emulate=True)


#: Split-KV and mask tests need rows crossing 3+ key tiles at emulator-sized shapes: 64-wide
#: tiles (sm80 plans 128 x 128 at these head dims; the golden tests run the default plans).
SMALL_TILES = (64, 64)


def _ptxas(job: tuple[str, str, int, str], warp_rows: int | None = 16):
    """ptxas's report of example `name`'s kernels (by default its forward at warps of 16 rows:
    sm90's default of 32 for most examples has its own bounds, test_default_32_row_warps...)."""
    name, arch, head_dim, dtype = job
    stages = attncc.lower(ROOT / "examples" / f"{name}.attn", arch, warp_rows=warp_rows)
    plan = fused_node(stages[-1].graph)[1].tiling.for_head_dim(head_dim)
    return job, plan, compile_cuda(generate_cuda(stages[-1].graph, dtype, plan, arch), arch)


#: The PTX each architecture's kernels must contain (sm75: two m16n8k8 per m16n8k16, no cp.async).
INSTRUCTIONS = {
    "sm80": ("mma.sync.aligned.m16n8k16.row.col.f32", "cp.async.cg.shared.global"),
    "sm75": ("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32",),
}
COMMON_INSTRUCTIONS = (
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
    "ldmatrix.sync.aligned.m8n8.x4.trans",
    "ex2.approx",
)


#: The examples whose kernels differ beyond their mask predicate: a score map and its derivative
#: (alibi, relative_bias with its learnable table, softcap), dropout (gpt2), runtime-tensor
#: reads in the mask (document) and a generated layout (local_blocks). The others add a
#: comparison or two to the same kernel.
REGISTER_HEAVY = ("alibi", "relative_bias", "softcap", "gpt2", "document", "local_blocks")


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_every_example_compiles_for_sm75_to_sm90_without_spills() -> None:
    """Every example's kernels at warps of 16 rows (the 32-row default forwards: their own bounds
    below) on sm90 at d = 128 (the most registers of the common head dims); the
    register-heavy ones on sm80 at d = 128 and on sm75 at d = 64; head dims 16 to 256 for the
    score map with a learnable input (alibi) and dropout (gpt2) on sm80 fp16, sm75 and sm86 bf16:
    39 nvcc runs (every example at every arch and both head dims was 84 runs, 8 minutes on 2 busy
    cores; register use grows with the head dim and the variant's extra state, which these cover);
    the heaviest score maps at d = 64, where the roofline's choice gives 128 x 128 forward
    tiles (sm86: 64 x 128), and the register-heavy ones on sm80 at d = 64, whose backward holds
    dK and dV wholly in registers with 8 warps; causal bf16 at d = 256, whose backward kernels
    spilled 20-52 B before their dQ columns were bounded at 128 per thread and Br at 32; the
    light programs with the most registers (238) in sm90's light backward at d = 64: 50 runs."""
    jobs = [(n, "sm90", 128, "bfloat16") for n in EXAMPLES]
    jobs += [(n, "sm80", 128, "bfloat16") for n in REGISTER_HEAVY]
    jobs += [(n, "sm80", d, "float16") for n in ("alibi", "gpt2") for d in (16, 80, 256)]
    jobs += [(n, "sm75", 64, "float16") for n in REGISTER_HEAVY] + [("gpt2", "sm75", d, "float16") for d in (128, 256)]
    jobs += [("alibi", "sm86", d, "bfloat16") for d in (128, 256)]  # backward tiles smaller than the forward's
    jobs += [(n, "sm90", 64, "bfloat16") for n in ("alibi", "relative_bias")]  # 128 x 128 forward tiles
    jobs += [("alibi", "sm86", 64, "bfloat16")]  # 64 x 128
    jobs += [(n, "sm80", 64, "bfloat16") for n in REGISTER_HEAVY]  # dK, dV in registers, 8 warps
    jobs += [("causal", a, 256, "bfloat16") for a in ("sm80", "sm90")]  # spilled in both backward kernels
    jobs += [(n, "sm90", 64, "bfloat16") for n in ("strided", "local_blocks")]  # light backward, r = 64
    assert len(jobs) == 50
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(_ptxas, jobs))
    for (name, arch, head_dim, dtype), plan, report in results:
        where = f"{name} {arch} d={head_dim} {dtype}: {report.describe()}"
        assert report.spill_stores == 0 and report.spill_loads == 0, where
        assert report.stack_bytes == 0, where  # every fragment stays in registers
        target = GPUS[arch]
        assert report.registers <= target.max_registers_per_thread, where
        threads = max(plan.threads, plan.backward.threads if plan.backward else 0)
        assert report.registers * threads <= target.registers_per_sm, where  # >= 1 block per SM
        kernels = ["attention_backward_dq", "attention_backward"] if plan.backward else []  # sm75 d=256: forward only
        assert [k.name for k in report.kernels] == [
            *kernels,
            "append_new_keys",
            "combine_splits",
            "attention_forward",
        ], where
        for instruction in INSTRUCTIONS.get(arch, INSTRUCTIONS["sm80"]) + COMMON_INSTRUCTIONS:
            assert instruction in report.ptx, f"{where}: no {instruction}"
        if arch == "sm75":
            assert "cp.async" not in report.ptx and "m16n8k16" not in report.ptx, where


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_ptxas_reports_come_from_the_cache_and_a_damaged_entry_compiles_again(tmp_path, monkeypatch) -> None:
    """A source compiled before (same headers, architecture, nvcc) gives its report without
    running nvcc; another architecture or a damaged entry runs it."""
    import subprocess

    import attncc.runtime.nvcc as nvcc_module

    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    nvcc_module.nvcc_fingerprint()  # (its `nvcc --version`, once per process, before counting)
    runs: list[str] = []
    run = subprocess.run

    def counted(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        if Path(cmd[0]).name in ("nvcc", "ptxas"):  # (not the host compiler's version, read once for the key)
            runs.append(cmd[0])
        return run(cmd, **kwargs)

    monkeypatch.setattr(subprocess, "run", counted)
    source = 'extern "C" __global__ void attention_forward(float* x) { x[0] += 1.0f; }\n'
    first = compile_cuda(source, "sm80")
    assert len(runs) == 2  # nvcc -ptx, ptxas -v
    assert compile_cuda(source, "sm80") == first and len(runs) == 2
    assert compile_cuda(source, "sm90").arch == "sm90" and len(runs) == 4
    for cached in (tmp_path / nvcc_module.PTXAS_CACHE_DIR).iterdir():
        cached.write_bytes(b"damaged")
    assert compile_cuda(source, "sm80") == first and len(runs) == 6
    assert compile_cuda(source, "sm80") == first and len(runs) == 6  # (rewritten)


@pytest.mark.parametrize("arch", ["sm75", "sm80", "sm86", "sm90"])
def test_plan_states_the_kernels_shared_memory_and_fits(arch: str) -> None:
    stages = attncc.lower(ROOT / "examples" / "causal.attn", arch)
    table = fused_node(stages[-1].graph)[1].tiling
    for d in range(16, 257, 16):
        plan = table.for_head_dim(d)
        assert plan.onchip_bytes == gpu_shared_bytes(plan.block_rows, plan.block_cols, d, plan.stages)
        assert plan.onchip_bytes <= GPUS[arch].shared_bytes_per_sm
        source = generate_cuda(stages[-1].graph, "float16", plan, arch)
        assert f"#define ATTNCC_ARCH {arch[2:]}" in source
        # the kernel computes the same number from its own constants
        assert (
            f"constexpr int kBr = {plan.block_rows};" in source and f"constexpr int kBc = {plan.block_cols};" in source
        )
        assert f"constexpr int kStages = {plan.stages};" in source
        # (K and V rows of one width: kValueStride = kStride)
        assert f"constexpr int kHeadDim = {d};" in source and f"constexpr int kValueDim = {d};" in source
        assert (
            "constexpr int kSharedBytes = ((kBr + kStages * kBc) * kStride + kStages * kBc * kValueStride) * "
            "int(sizeof(storage_t));" in source
        )
        backward = plan.backward
        assert backward is not None and table.for_head_dim(d, backward=True) == backward
        assert backward.onchip_bytes == gpu_backward_shared_bytes(
            backward.block_rows,
            backward.block_cols,
            d,
            backward.dv_register_columns,
            backward.dk_register_columns,
            backward.stages,
        )
        assert backward.stages == (2 if d <= 128 else 1)  # the next query tile prefetched
        if d <= 128:  # the roofline's choice: dK and dV split alike, the state within the budget
            assert backward.dk_register_columns == backward.dv_register_columns
            budget = GPU_MAX_BACKWARD_STATE - (GPU_BACKWARD_STATE_CUT_ABOVE_D64 if d > 64 else 0)
            # (causal is light: sm90's timed light plan at d = 64 within the light budget, at
            # d = 128 a wide light plan, GPU_WIDE_LIGHT_BACKWARD_PLANS)
            light = "MEASURED_LIGHT_BACKWARD_TILES" in backward.reason
            assert light == (arch == "sm90" and d in (64, 128))
            budget = GPU_MAX_LIGHT_BACKWARD_STATE if light else budget
            wide = set(GPU_WIDE_LIGHT_BACKWARD_PLANS.get(arch, {}).get(d, ()))
            shape = (backward.block_rows, backward.block_cols, backward.dv_register_columns)
            assert backward.block_rows + backward.dv_register_columns <= budget or (light and shape in wide)
        else:  # 64 KiB: fp32 dK and dV do not both fit; 32 columns of dV go to registers
            assert backward.dk_register_columns == 0
            assert backward.dv_register_columns == (32 if arch == "sm75" and d == 256 else 0)
        # the deterministic dQ kernel, launched with the same plan, needs no more
        assert gpu_dq_shared_bytes(backward.block_rows, backward.block_cols, d) <= backward.onchip_bytes
        assert f"constexpr int kDvRegisterColumns = {backward.dv_register_columns};" in source
        assert f"constexpr int kDkRegisterColumns = {backward.dk_register_columns};" in source
        assert backward.onchip_bytes <= GPUS[arch].shared_bytes_per_sm
        assert f"constexpr int kBwdBr = {backward.block_rows};" in source
        assert f"constexpr int kBwdBc = {backward.block_cols};" in source
        assert (
            "constexpr int kBwdSharedBytes = (kBwdStages * kBwdBr + kBwdBc) * (kStride + kValueStride) * "
            "int(sizeof(storage_t)) +" in source
        )
    # the backward's larger working set no longer shrinks the forward's tiles
    sm86 = table.for_head_dim(128) if arch == "sm86" else None
    if sm86 is not None:
        assert (sm86.block_rows, sm86.block_cols) == (64, 64) and sm86.backward.block_rows == 16


SHAPES = (Shape(2, 4, 2, 77, 130, 48), Shape(1, 2, 1, 129, 300, 64))


@pytest.mark.parametrize("name", EXAMPLES)
def test_emulated_forward_backward_match_fp64_within_eager_error(name: str) -> None:
    kern = emulated(name)
    # the first two calls take split-KV (a few blocks for 108 SMs), the third one block per query tile
    for shape, dtype, splits in (
        (SHAPES[0], torch.float16, None),
        (SHAPES[1], torch.bfloat16, None),
        (SHAPES[0], torch.float16, 1),
    ):
        kern.kv_splits = splits
        try:
            assert (kern.plan(*make_inputs(kern, shape, dtype)[:2], None).kv_splits > 1) == (splits is None)
            result = check(kern, adapt(shape, kern), dtype)
        finally:
            kern.kv_splits = None
        assert result.ok, f"kv_splits={splits}: {result.describe()}"


@pytest.mark.parametrize("name", ["vanilla", "gpt2", "gpt_oss", "alibi", "document"])
def test_forward_warps_of_32_rows_compute_what_warps_of_16_do(name: str) -> None:
    """`warp_rows=32` (two mma row blocks per warp, each K/V fragment feeding both): at d = 128
    sm90 plans the same 128 x 64 tiles as with 16 rows, in 4 warps instead of 8, and each row's
    products and softmax run in the same order, so the forward gives the same bits (dropout
    drawn the same: gpt2), at a query tail, decoding (one row of 32 live) and GQA; at d = 64 its
    own tiles (128 x 64) within the eager error forward and backward."""
    compile_sm90 = partial(attncc.compile, ROOT / "examples" / f"{name}.attn", target="sm90", emulate=True)
    wide, narrow = compile_sm90(warp_rows=32), compile_sm90(warp_rows=16)
    plan_wide, plan_narrow = (fused_node(k.graph)[1].tiling.for_head_dim(128) for k in (wide, narrow))
    assert (plan_wide.block_rows, plan_wide.block_cols) == (plan_narrow.block_rows, plan_narrow.block_cols) == (128, 64)
    assert (plan_wide.warps, plan_wide.warp_rows, plan_narrow.warps) == (4, 32, 8)
    assert "constexpr int kWarpTiles = 2;" in wide.cuda_source("bfloat16", 128)
    for shape in (Shape(1, 2, 1, 77, 130, 128), Shape(2, 4, 2, 1, 300, 128), Shape(1, 1, 1, 160, 64, 128)):
        q, k, v, runtime = make_inputs(wide, adapt(shape, wide), torch.bfloat16, requires_grad=False)
        torch.manual_seed(1)
        ours = wide(q, k, v, **runtime)
        torch.manual_seed(1)
        assert torch.equal(ours, narrow(q, k, v, **runtime)), shape
    result = check(wide, adapt(Shape(1, 2, 1, 77, 130, 64), wide), torch.bfloat16)
    assert result.ok, result.describe()


@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_the_forward_takes_32_row_warps_on_sm90_unless_the_scores_are_register_heavy(arch: str) -> None:
    """`warp_rows` left out: sm90 (GPU_WIDE_WARP_TARGETS, measured on the H100 of session 36)
    takes warps of 32 rows up to d = 128 except where the score map reads the positions i, j
    (alibi, relative_bias) or the program has dropout (gpt2), whose 32-row forwards spill; other
    GPUs, d = 256 (two row blocks' state does not fit), `tiles=` overrides and the forwards of
    short calls keep 16."""
    heavy = {"alibi", "relative_bias", "gpt2"}
    for name in EXAMPLES:
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target=arch, emulate=True)
        table = kern.op.tiling
        wide = 32 if arch == "sm90" and name not in heavy else 16
        assert [table.for_head_dim(d).warp_rows for d in (32, 64, 96, 128, 256)] == [wide] * 4 + [16], name
        assert {p.warp_rows for p in kern.for_short_queries().op.tiling.plans if p} == {16}, name
        assert f"{wide} rows" in table.describe(128), name
    overridden = attncc.compile(ROOT / "examples" / "vanilla.attn", target=arch, emulate=True, tiles=(64, 64))
    assert overridden.op.tiling.for_head_dim(128).warp_rows == 16


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_default_32_row_warps_compile_within_their_spill_bounds() -> None:
    """ptxas on sm90 for the forwards that take warps of 32 rows by default (CUDA 13.0 when
    measured): none spills at d = 64 (128 x 64 tiles, Q in registers); at d = 128 (state 192,
    Q re-read) up to 104 B (prefix_lm; sliding window 92 B ran 1.08-1.33x faster than at 16
    rows on the H100 of session 36, ALiBi's 136 B 1.03x). relative_bias at 32 rows, d = 128,
    spills 584 B: why register-heavy scores keep 16 rows (and that the bounds are not vacuous)."""
    jobs = [((name, "sm90", d, "bfloat16"), None) for name in EXAMPLES for d in (64, 128)]
    jobs.append((("relative_bias", "sm90", 128, "bfloat16"), 32))
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda job: _ptxas(*job), jobs))
    checked = 0
    for (name, _, head_dim, _), plan, report in results:
        (forward,) = [k for k in report.kernels if k.name == "attention_forward"]
        if plan.warp_rows != 32:
            continue
        checked += 1
        most = 0 if head_dim == 64 else 128 if name != "relative_bias" else 1024
        assert forward.spill_stores <= most, f"{name} d={head_dim}: {report.describe()}"
    assert checked == 2 * (len(EXAMPLES) - 3) + 1 and forward.spill_stores > 128  # relative_bias, last


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_paged_forwards_compile_forward_only_within_their_spill_bounds() -> None:
    """A paged call's library ("+paged", Kernel.paged) on sm90, bf16: the forward alone (and the
    split merge), its block-table lookups staged per tile. ptxas (CUDA 13.0 when measured): none
    spill at d = 128 at warps of 16 rows, the plan's and the short-query tiles alike; at d = 64
    (128 x 128 tiles) alibi spills 16 B and relative_bias 28 B, where the in-place libraries
    spill none; sm90's default warps of 32 rows (vanilla, causal and the other light score
    maps) within the in-place forwards' bound, 128 B (vanilla 8 B). Bounds, so that growth shows."""
    jobs = [(name, 128, 0) for name in ("vanilla", "causal", *REGISTER_HEAVY)]
    jobs += [(name, 64, 32) for name in ("alibi", "relative_bias")]

    def ptxas(job: tuple[str, int, int]) -> tuple[tuple[str, int, int], tuple[list, list]]:
        name, head_dim, _ = job
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="sm90", emulate=True)
        tiles = (kern, kern.for_short_queries()) if head_dim == 128 else (kern,)
        rows = [k.op.tiling.for_head_dim(head_dim).warp_rows for k in tiles]
        return job, (rows, [compile_cuda(k.cuda_source("bfloat16+paged", head_dim), "sm90") for k in tiles])

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(ptxas, jobs))
    for (name, head_dim, most), (rows, reports) in results:
        for warp_rows, report in zip(rows, reports):
            where = f"{name} d={head_dim} {warp_rows} rows/warp: {report.describe()}"
            most = 128 if warp_rows == 32 else most
            assert [k.name for k in report.kernels] == ["append_new_keys", "combine_splits", "attention_forward"], where
            assert report.spill_stores <= most and report.spill_loads <= 2 * most, where


@pytest.mark.parametrize(("key_tile", "warps"), [(16, 1), (32, 2), (48, 3), (64, 4)])
def test_key_split_warps_take_whole_16_key_steps(key_tile: int, warps: int) -> None:
    """Up to 4 warps split a key tile, each taking a whole number of 16-key mma steps: a tile
    of 48 keys goes to 3 warps, one of 16 to a single warp (a 16-row forward); with 32 rows,
    up to 2 warps per 16 rows."""
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm90", emulate=True, tiles=(64, key_tile))
    plan = kern.for_key_split_warps().op.tiling.for_head_dim(64)
    assert (plan.block_rows, plan.key_warps, plan.warps, plan.threads) == (16, warps, warps, 32 * warps)
    keys = key_tile // warps
    layout = f"{warps} warps of 16 rows, {keys} keys" if warps > 1 else "1 warps of 16 rows (32 threads)"
    assert layout in kern.for_key_split_warps().op.tiling.describe(64)
    pair = kern.for_key_split_warps(32).op.tiling.for_head_dim(64)
    assert (pair.block_rows, pair.key_warps) == (32, min(warps, 2) if key_tile != 48 else 1)
    with pytest.raises(AttnccError, match="key-split forwards take"):
        kern.for_key_split_warps(48)


@pytest.mark.parametrize(
    ("target", "head_dim", "stages"),
    [("sm90", 128, 3), ("sm90", 256, 3), ("sm80", 64, 3), ("sm86", 64, 2), ("sm86", 128, 2), ("sm86", 256, 3),
     ("sm75", 64, 2)],
)  # fmt: skip
def test_key_split_forwards_take_a_third_kv_buffer_where_it_fits(target: str, head_dim: int, stages: int) -> None:
    """The decoding forwards keep two K/V tiles in flight (three buffers) where the target has
    cp.async and a block's shared memory takes the third buffer (sm86: 99 KiB, where d = 256's
    16-key tiles fit three times), else double-buffer; `kv_stages` forces 2 (or 3), nothing else."""
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target=target, emulate=True)
    for rows in (16, 32):
        plan = kern.for_key_split_warps(rows).op.tiling.for_head_dim(head_dim)
        assert plan.stages == stages
        assert (
            plan.onchip_bytes
            == gpu_shared_bytes(rows, plan.block_cols, plan.head_dim, stages)
            <= GPUS[target].onchip_bytes
        )
        assert f"{stages} K/V stage(s)" in kern.for_key_split_warps(rows).op.tiling.describe(head_dim)
        assert kern.for_key_split_warps(rows, 2).op.tiling.for_head_dim(head_dim).stages == 2
    with pytest.raises(AttnccError, match="2 or 3 K/V stages, not 4"):
        kern.for_key_split_warps(16, 4)


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_key_split_forwards_compile_forward_only_without_spills() -> None:
    """The forwards of warps splitting each key tile (`for_key_split_warps`, 16 and 32 rows) on
    sm90, bf16: the forward alone (and the split merge), in place and paged, no spills at
    d = 64, 128 and 256 (ptxas, CUDA 13.0: 147-212 registers)."""
    jobs = [(name, 128, dtype, 16) for name in ("vanilla", *REGISTER_HEAVY) for dtype in ("bfloat16", "bfloat16+paged")]
    jobs += [(name, d, "bfloat16", 16) for name in ("alibi", "relative_bias") for d in (64, 256)]
    jobs += [(name, 128, "bfloat16", 32) for name in ("vanilla", "alibi", "document", "relative_bias")]

    def ptxas(job: tuple[str, int, str, int]) -> tuple[tuple[str, int, str, int], object]:
        name, head_dim, dtype, rows = job
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="sm90", emulate=True)
        return job, compile_cuda(kern.for_key_split_warps(rows).cuda_source(dtype, head_dim), "sm90")

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(ptxas, jobs))
    for job, report in results:
        where = f"{job}: {report.describe()}"
        assert [k.name for k in report.kernels] == ["append_new_keys", "combine_splits", "attention_forward"], where
        assert report.spill_stores == 0 and report.spill_loads == 0 and report.stack_bytes == 0, where


def test_warp_rows_are_checked() -> None:
    with pytest.raises(AttnccError, match="warp_rows: expected one of"):
        attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm90", emulate=True, warp_rows=8)
    with pytest.raises(AttnccError, match="GPU targets only"):
        attncc.compile(ROOT / "examples" / "vanilla.attn", target="cpu", warp_rows=32)
    with pytest.raises(AttnccError, match="Br must be a multiple of warp_rows=32"):
        attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm90", emulate=True, tiles=(48, 64), warp_rows=32)


#: Examples whose masks or layouts need long rows, with their constants shrunk in a copy so that
#: an emulator-sized shape shows them (the example itself: the program text, the replacement),
#: and the plain program each must differ from. (relative_bias's clamp at 128 is shown on the
#: CPU, where N = 600: test_golden MASK_SPAN_SHAPE and test_independent_references.)
SHRUNK = {
    "sliding_window": (("window = 256", "window = 40"), "causal"),
    "strided": (("strided(block=32, stride=4)", "strided(block=16, stride=3)"), "causal"),
    "local_blocks": (("local(block=64, width=2)", "local(block=16, width=1)"), "vanilla"),
    "blocksparse_butterfly": (("block=64", "block=16"), "vanilla"),
}


@pytest.mark.parametrize("name", SHRUNK)
def test_emulated_masks_take_effect(name: str) -> None:
    """The shrunk examples on a shape 4+ times their window or span, whose rows cross 3+ key
    tiles, forward and backward within the eager error; each differs from the plain program by
    far more than that error, so a kernel ignoring the mask would fail."""
    (old, new), plain = SHRUNK[name]
    text = (ROOT / "examples" / f"{name}.attn").read_text()
    assert old in text
    kern = attncc.compile(text.replace(old, new), target="sm80", tiles=SMALL_TILES, emulate=True)
    shape = adapt(Shape(1, 2, 1, 150, 200, 48), kern)
    q, k, v, runtime = make_inputs(kern, shape, torch.float16, requires_grad=False)
    assert shape.M >= 3 * kern.plan(q, k, None).tiles.block_cols
    result = check(kern, shape, torch.float16)
    assert result.ok, result.describe()
    ours, _ = kern.reference(q, k, v, **runtime)
    theirs, _ = emulated(plain).reference(q, k, v)
    assert (ours - theirs).abs().max() > 100 * result.limits["out"]


def test_split_kv_on_the_emulator() -> None:
    """Forced splits, some of whose keys are all masked (padding, causal) or dropped (dropout):
    the merged out and log-sum-exp equal the unsplit kernel's up to rounding, fully masked rows
    stay O = 0 and lse = -inf, the dropout mask is the same."""
    shape = Shape(2, 2, 1, 3, 200, 40)  # 4 key tiles of 64
    for name, runtime in (("padding", {"lengths": torch.tensor([0, 70])}), ("gpt2", {}), ("alibi", None)):
        kern = emulated(name, tiles=SMALL_TILES)
        q, k, v, made = make_inputs(kern, shape, torch.float16, requires_grad=False)
        runtime = made if runtime is None else runtime
        results = {}
        for splits in (1, 3, 4):
            kern.kv_splits = splits
            try:
                results[splits] = kern(q, k, v, seed=3, return_lse=True, **runtime)
                assert kern.plan(q, k, None).kv_splits == splits
                if splits == 3:
                    result = check(kern, adapt(shape, kern), torch.float16)
                    assert result.ok, f"{name}: {result.describe()}"
            finally:
                kern.kv_splits = None
        out, lse = results[1]
        for splits in (3, 4):
            assert torch.allclose(results[splits][0].float(), out.float(), atol=2e-3, rtol=0)
            assert torch.allclose(results[splits][1], lse, atol=1e-4, rtol=0)
            assert torch.equal(results[splits][0] == 0, out == 0)  # masked rows, dropped keys
        if name == "padding":
            assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()


@pytest.mark.parametrize("name", ["vanilla", "causal", "alibi"])
def test_split_kv_merges_several_non_empty_partials(name: str) -> None:
    """Forced 3 and 4 splits where most rows see keys in several splits (dense, causal, and
    ALiBi's learnable slopes): forward and backward within the eager error, like unsplit."""
    kern = emulated(name, tiles=SMALL_TILES)
    shape = Shape(1, 2, 1, 150, 200, 40)  # 4 key tiles of 64: rows >= 128 see 3+ of them causally
    for splits in (3, 4):
        kern.kv_splits = splits
        try:
            q, k, _, _ = make_inputs(kern, shape, torch.float16)
            plan = kern.plan(q, k, None)
            assert plan.kv_splits == splits and -(-shape.M // plan.tiles.block_cols) >= splits
            result = check(kern, shape, torch.float16)
        finally:
            kern.kv_splits = None
        assert result.ok, f"kv_splits={splits}: {result.describe()}"


def test_split_kv_keeps_nan_rows_and_empty_calls() -> None:
    """A NaN in a query row: its lse is NaN split or not (not -inf, which the backward would
    take for a fully masked row), and dV is NaN in the same places. Empty calls stay empty."""
    kern = emulated("vanilla")
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 1, n, 16, generator=gen).half() for n in (2, 200, 200))
    q[0, 0, 0, 3] = float("nan")
    grads = {}
    for splits in (1, 4):
        kern.kv_splits = splits
        try:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = kern(*leaves, return_lse=True)
            out.float().sum().backward()
        finally:
            kern.kv_splits = None
        assert torch.isnan(lse[0, 0, 0]) and torch.isfinite(lse[0, 0, 1]), f"kv_splits={splits}"
        grads[splits] = leaves[2].grad
    assert torch.equal(torch.isnan(grads[1]), torch.isnan(grads[4])) and torch.isnan(grads[1]).any()
    for empty in ((1, 1, 0, 16), (0, 1, 4, 16)):
        q0 = torch.randn(empty).half()
        assert (
            kern(q0, torch.randn(empty[0], 1, 200, 16).half(), torch.randn(empty[0], 1, 200, 16).half()).shape == empty
        )


@pytest.mark.parametrize(
    "shape",
    [Shape(1, 1, 1, 1, 1, 16), Shape(1, 2, 2, 33, 70, 80), Shape(1, 1, 1, 40, 50, 256), Shape(2, 3, 1, 64, 64, 128)],
    ids=str,
)
def test_emulated_head_dims_and_edges(shape: Shape) -> None:
    for name in ("alibi", "padding"):
        result = check(emulated(name), shape, torch.float16)
        assert result.ok, result.describe()


@pytest.mark.parametrize("name", EXAMPLES)
def test_emulator_schedules_give_identical_bits(name: str) -> None:
    """Forward and backward under each thread order and with cp.async copies landing at their
    wait (the latest) and as issued (the earliest): a missing barrier, a missing wait or a
    buffer refilled before its last readers are done changes the bits. 300 keys in one split:
    three key tiles a block, so that the forward refills a K/V buffer."""
    kern = emulated(name)
    kern.kv_splits = 1
    q, k, v, runtime = make_inputs(kern, adapt(Shape(1, 2, 1, 90, 300, 64), kern), torch.bfloat16)
    learnable = [t for t in runtime.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    for deterministic in (False, True):
        results = []
        for schedule in ("lockstep", "warp-greedy", "warp-greedy-eager-copies"):
            kern.schedule, kern.deterministic = schedule, deterministic
            try:
                out, lse = kern(q, k, v, seed=9, return_lse=True, **runtime)
                grads = torch.autograd.grad(out, [q, k, v, *learnable], torch.ones_like(out))
            finally:
                kern.schedule, kern.deterministic = "lockstep", False
            results.append([out, lse, *grads])
        # out, lse, dq, dk, dv always bit-identical; learnable-input gradients too in deterministic
        # mode (exact sums), else sums of fp32 atomics whose order (as on a GPU) depends on the
        # schedule: equal up to rounding (relative_bias: sums of ~10^3 terms, 2e-5 of the largest apart)
        exact = len(results[0]) if deterministic else 5
        for other in results[1:]:
            for a, b in zip(results[0][:exact], other[:exact]):
                assert torch.equal(a, b), f"deterministic={deterministic}"
            for a, b in zip(results[0][exact:], other[exact:]):
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-4 * max(1.0, float(a.abs().max())))


def test_dropout_bits_identical_to_the_cpu_backend() -> None:
    B, H, N = 1, 2, 64
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(B, H, N, 64, generator=gen).half(), torch.randn(B, H, N, 64, generator=gen).half()
    v = torch.eye(N, 64).expand(B, H, N, 64).contiguous().half()  # out[..., j] = P after dropout
    gpu = emulated("gpt2")(q, k, v, seed=4321)
    cpu = attncc.compile(ROOT / "examples" / "gpt2.attn")(q.float(), k.float(), v.float(), seed=4321)
    keep = attncc.dropout_mask(4321, 0, B, H, N, N, 0.1)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert torch.equal(gpu[..., causal] != 0, keep[..., causal])
    assert torch.equal(gpu != 0, cpu != 0)


def test_strided_inputs_on_the_emulator() -> None:
    """D not the innermost dimension (a transposed view), and row-strided views: same bits as
    contiguous copies, forward and backward."""
    kern = emulated("causal")
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 64, 40, generator=gen).half().transpose(-1, -2).requires_grad_()  # D stride 40
    k = torch.randn(1, 2, 64, 40, generator=gen).half().transpose(-1, -2).requires_grad_()
    v = torch.randn(1, 2, 40, 128, generator=gen).half()[..., ::2].requires_grad_()  # D stride 2
    dense = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    out, ref = kern(q, k, v), kern(*dense)
    assert torch.equal(out, ref)
    grads = torch.autograd.grad(out, [q, k, v], torch.ones_like(out))
    ref_grads = torch.autograd.grad(ref, dense, torch.ones_like(ref))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_tile_classes_are_prepared_once_per_shape(monkeypatch) -> None:
    """The classes depend on sizes, scalars and shapes, and on the values of the runtime tensors
    a mask reads: a repeated call reuses them (on a GPU: no host classification, no copy, no
    synchronisation) and takes the call's own tensors; a mask over runtime tensors is classified
    again for other values (and the call is a fresh kernel's), not for the same ones (every
    layer of a model on one batch's padding)."""
    import attncc.runtime.kernel as kernel_module

    counted = []
    original = kernel_module.classify_tiles
    monkeypatch.setattr(kernel_module, "classify_tiles", lambda *a: counted.append(1) or original(*a))
    causal = attncc.compile(ROOT / "examples" / "causal.attn", target="sm80", emulate=True)
    q = torch.randn(1, 1, 20, 16).half()
    first = causal(q, q, q)
    assert torch.equal(causal(q, q, q), first) and len(counted) == 1
    causal(q[:, :, :10], q, q)  # another shape: classified again
    assert len(counted) == 2
    padding = emulated("padding")
    padding(q, q, q, lengths=torch.tensor([0]))  # no key: every tile empty
    padding(q, q, q, lengths=torch.tensor([0]))
    assert len(counted) == 3
    other = padding(q, q, q, lengths=torch.tensor([17]))  # (with the empty tiles kept: all zeros)
    assert len(counted) == 4
    fresh_padding = attncc.compile(ROOT / "examples" / "padding.attn", target="sm80", emulate=True)
    assert torch.equal(other, fresh_padding(q, q, q, lengths=torch.tensor([17]))) and len(counted) == 5
    assert other.abs().sum() > 0
    alibi = attncc.compile(ROOT / "examples" / "alibi.attn", target="sm80", emulate=True)
    outs = []
    for slopes in (torch.tensor([0.5]), torch.tensor([2.0])):  # the slopes only shift scores
        fresh = attncc.compile(ROOT / "examples" / "alibi.attn", target="sm80", emulate=True)  # empty cache
        outs.append(alibi(q, q, q, slopes=slopes))
        assert torch.equal(outs[-1], fresh(q, q, q, slopes=slopes))  # the call's own slopes
    assert not torch.equal(outs[0], outs[1])
    assert len(counted) == 5 + 1 + 2  # alibi classified once, each fresh kernel once


def test_backward_blocks_whose_keys_no_query_sees_wait_for_their_copies() -> None:
    """Causal with M > N: no query sees keys beyond N, so their backward blocks skip every
    query tile; they must still wait for their K/V copies before exiting (on a GPU a copy in
    flight lands in the shared memory of the SM's next block). The emulator fails a block that
    exits with copies in flight; found by reading the kernel (issue 14, item 1). Likewise the
    deterministic dQ kernel's blocks whose query tile sees no key (a batch entry of length 0)
    with their Q and dO copies (found by the emulator check)."""
    kern = emulated("causal")
    result = check(kern, adapt(Shape(1, 2, 1, 20, 100, 32), kern), torch.float16)
    assert result.ok, result.describe()
    padding = emulated("padding")
    padding.deterministic = True
    q, k, v, _ = make_inputs(padding, Shape(2, 2, 1, 20, 40, 32), torch.float16, requires_grad=True)
    out = padding(q, k, v, lengths=torch.tensor([0, 9]))
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    for grad in (dq, dk, dv):  # batch 0 sees nothing: no gradient reaches it
        assert torch.equal(grad[0], torch.zeros_like(grad[0])) and torch.isfinite(grad).all()


def test_fully_masked_rows_on_the_emulator() -> None:
    kern = emulated("padding")
    q, k, v, _ = make_inputs(kern, Shape(2, 2, 1, 20, 40, 32), torch.float16, requires_grad=False)
    out, lse = kern(q, k, v, return_lse=True, lengths=torch.tensor([0, 9]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out).all()


def test_more_batch_entries_than_a_grid_dimension_holds() -> None:
    """B * H beyond 65535 (gridDim.y/z's limit, which the emulator enforces): one-dimensional grids
    (16 x 16 tiles: a warp per block, the fewest emulated threads for 65536 blocks)."""
    kern = emulated("vanilla", tiles=(16, 16))
    q, k, v = (torch.randn(65536, 1, n, 16, dtype=torch.float16) for n in (1, 3, 3))
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert (kern(q, k, v).double() - reference).abs().max() < 2e-3


@pytest.mark.parametrize("name", ["alibi", "gpt2", "document", "softcap"])
def test_turing_kernels_on_the_emulator(name: str) -> None:
    """sm75: m16n8k16 as two m16n8k8, synchronous copies; fp16 only, fp32 converted to fp16."""
    kern = emulated(name, "sm75")
    for shape in (SHAPES[0], Shape(1, 2, 1, 33, 40, 128)):
        result = check(kern, adapt(shape, kern), torch.float16)
        assert result.ok, result.describe()
    q, k, v, runtime = make_inputs(kern, adapt(Shape(1, 2, 1, 20, 30, 16), kern), torch.float32, requires_grad=False)
    half = kern(q.half(), k.half(), v.half(), seed=5, **runtime)
    assert torch.equal(kern(q, k, v, seed=5, **runtime), half.float())  # fp32 runs in fp16


def test_forward_and_backward_tiles_are_planned_separately() -> None:
    """Where shared memory is small the backward gets smaller tiles than the forward (sm86
    d=128: 64 x 64 forward, 32 x 64 backward; d=256: 32 x 16, its dQ kernel on fewer warps than
    the forward; each call classifies tiles for its own plan), and on sm75 at d=256 (16 x 16,
    one warp) the backward keeps 32 columns of dV in registers."""
    for name, arch, head_dim in (("document", "sm86", 128), ("alibi", "sm86", 256), ("alibi", "sm75", 256)):
        kern = emulated(name, arch)
        result = check(kern, adapt(Shape(1, 2, 1, 70, 90, head_dim), kern), torch.float16)
        assert result.ok, f"{arch}: {result.describe()}"


def test_turing_schedules_give_identical_bits() -> None:
    kern = emulated("gpt2", "sm75")
    q, k, v, _ = make_inputs(kern, Shape(1, 2, 1, 70, 90, 64), torch.float16)
    results = []
    for schedule in ("lockstep", "warp-greedy"):
        kern.schedule = schedule
        out = kern(q, k, v, seed=3)
        results.append([out, *torch.autograd.grad(out, [q, k, v], torch.ones_like(out))])
    kern.schedule = "lockstep"
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_turing_rejects_bf16_clearly() -> None:
    kern = emulated("vanilla", "sm75")
    q = torch.randn(1, 1, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(InputError, match=r"q: the sm75 tensor cores take float16, got torch.bfloat16"):
        kern(q, q, q)
    stages = attncc.lower(ROOT / "examples" / "vanilla.attn", "sm75")
    plan = fused_node(stages[-1].graph)[1].tiling.for_head_dim(64)
    with pytest.raises(AttnccError, match="sm75 tensor cores take float16, not bfloat16"):
        generate_cuda(stages[-1].graph, "bfloat16", plan, "sm75")


def test_torch_deterministic_mode_selects_the_atomic_free_dq() -> None:
    kern = emulated("causal")
    q, k, v, _ = make_inputs(kern, Shape(1, 2, 1, 70, 90, 32), torch.float16)
    grads = {}
    for mode in ("atomics", "kernel flag", "torch flag"):
        kern.deterministic = mode == "kernel flag"
        torch.use_deterministic_algorithms(mode == "torch flag")
        try:
            out = kern(q, k, v)
            grads[mode] = torch.autograd.grad(out, [q, k, v], torch.ones_like(out))
        finally:
            torch.use_deterministic_algorithms(False)
            kern.deterministic = False
    assert all(torch.equal(a, b) for a, b in zip(grads["kernel flag"], grads["torch flag"]))
    # the atomic dQ is rounded once from fp32, the dQ kernel's too: same values up to rounding order
    assert torch.allclose(grads["atomics"][0].float(), grads["torch flag"][0].float(), atol=2e-3)
    assert torch.equal(grads["atomics"][1], grads["torch flag"][1])  # dK, dV never use atomics


def test_deterministic_dq_beyond_128_columns_on_the_emulator() -> None:
    """Above d = 128 the dQ kernel accumulates the columns before the last 128 in fp32 shared
    memory (16 at d = 144, 128 at d = 256) and the rest in registers: golden and repeatable."""
    kern = emulated("causal")
    kern.deterministic = True
    try:
        for head_dim in (144, 256):
            shape = Shape(1, 2, 1, 40, 70, head_dim)
            result = check(kern, shape, torch.float16)
            assert result.ok, f"d={head_dim}: {result.describe()}"
            q, k, v, _ = make_inputs(kern, shape, torch.float16)
            first, second = (torch.autograd.grad(kern(q, k, v).sum(), [q])[0] for _ in range(2))
            assert torch.equal(first, second)
    finally:
        kern.deterministic = False


@pytest.mark.parametrize("arch", ["sm75", "sm80", "sm90"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_light_backward_candidates_add_register_columns_within_their_budget(arch: str, head_dim: int) -> None:
    """The light programs' candidates (the backward sweep's, for vanilla and causal) are every
    program's and more: plans whose dK/dV register columns exceed the common state budget
    but stay within GPU_MAX_LIGHT_BACKWARD_STATE and GPU_MAX_LIGHT_BACKWARD_COLUMNS (ptxas:
    r = 96 spilled); none on sm75, whose budget is Turing's own. The default backward stays
    among every program's candidates: on sm90 at d = 64 and 128 the tiles a GPU timed fastest.
    A light program's default is a light plan only where a GPU timed one (sm90: 64 x 128 with
    64 columns of each in registers at d = 64, the wide light plan 64 x 128 with 96 at
    d = 128); elsewhere every program's."""
    target = get_target(arch)
    shape = lambda plan: (plan.block_rows, plan.block_cols, plan.dk_register_columns)  # noqa: E731
    common = {shape(plan) for plan, _ in backward_candidates(target, head_dim)}
    light = {shape(plan) for plan, _ in backward_candidates(target, head_dim, light=True)}
    extra = light - common
    assert common <= light
    assert all(br + r <= GPU_MAX_LIGHT_BACKWARD_STATE and r <= GPU_MAX_LIGHT_BACKWARD_COLUMNS for br, _, r in extra)
    if arch == "sm75":
        assert not extra
    else:  # (sm90, 64 x 128 with 64 columns at d = 128: 254-255 registers for vanilla and causal, no spill)
        assert extra and all(br + r > GPU_MAX_BACKWARD_STATE - 16 for br, _, r in extra)
        assert arch != "sm90" or (64, 128, 64) in extra
    chosen = fastest_backward(target, head_dim)
    assert chosen is not None and shape(chosen) in common
    measured = MEASURED_BACKWARD_TILES.get(arch, {}).get(head_dim)
    assert measured is None or (chosen.block_rows, chosen.block_cols) == measured
    light_choice = fastest_backward(target, head_dim, light=True)
    assert light_choice is not None
    if arch == "sm90":
        wide = {shape(plan) for plan, _ in wide_light_backward_plans(target, head_dim)}
        expected = (64, 128, 64) if head_dim == 64 else (64, 128, 96)
        assert shape(light_choice) == expected and shape(light_choice) in (extra if head_dim == 64 else wide)
        assert "MEASURED_LIGHT_BACKWARD_TILES" in light_choice.reason
    else:
        assert light_choice == chosen


def test_light_programs_take_the_light_backward_plans() -> None:
    """`is_light_backward`: the examples whose score is the scaled product, without dropout,
    sink or rotary embeddings (masks and layouts allowed: tested on partial tiles only) take
    sm90's light backward plan, 64 x 128 with dK and dV wholly (d = 64) or 96 of 128 columns
    (d = 128) in registers; score maps (alibi, softcap, relative_bias), dropout (gpt2) and sinks (gpt_oss)
    keep every program's 48 x 128."""
    light = set()
    for name in EXAMPLES:
        op = fused_node(attncc.lower(ROOT / "examples" / f"{name}.attn", "sm90")[-1].graph)[1]
        plans = [op.tiling.for_head_dim(d, backward=True) for d in (64, 128)]
        shapes = [(p.block_rows, p.block_cols, p.dk_register_columns, p.dv_register_columns) for p in plans]
        if is_light_backward(op):
            light.add(name)
            assert shapes == [(64, 128, 64, 64), (64, 128, 96, 96)], name
        else:
            assert shapes == [(48, 128, 64, 64), (48, 128, 48, 48)], name
    assert light == set(EXAMPLES) - {"alibi", "softcap", "relative_bias", "gpt2", "gpt_oss"}


@pytest.mark.parametrize("head_dim", [72, 128])
def test_the_sm90_backward_at_its_own_tiles_on_the_emulator(head_dim: int) -> None:
    """sm90 backward plans that take its two special paths, atomic and deterministic dQ,
    against float64: at d = 128 the 64 x 96 plan (the roofline's choice in session 37, pinned
    here whatever the choice becomes) runs 6 warps over 64-row Q/dO tiles of 128 columns, 12
    rows per copy pass: the last pass is partial, its rows beyond the tile left out by one
    compare; d = 72 rounds up to 80 columns, so dQ's atomics take the column-checked path
    instead of the fixed offsets of a whole-width row."""
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm90", emulate=True)
    if head_dim == 128:
        (plan,) = [
            plan
            for plan, _ in backward_candidates(get_target("sm90"), head_dim)
            if (plan.block_rows, plan.block_cols, plan.dk_register_columns) == (64, 96, 32)
        ]
        assert plan.block_rows % (plan.threads // (head_dim * 2 // 16)), "a partial last copy pass"
        kern = EmulatedKernel(with_tiles(kern.stages, lambda table: table.with_backward(head_dim, plan)), "sm90")
    shape = Shape(1, 2, 1, 131, 200, head_dim)
    for deterministic in (False, True):
        kern.deterministic = deterministic
        try:
            result = check(kern, shape, torch.bfloat16)
        finally:
            kern.deterministic = False
        assert result.ok, f"deterministic={deterministic}: {result.describe()}"


@pytest.mark.parametrize("tiles", [(64, 128, 96), (48, 128, 128)])
def test_wide_light_backward_plans_match_fp64_on_the_emulator(tiles: tuple[int, int, int]) -> None:
    """The backward sweep's wide light plans (GPU_WIDE_LIGHT_BACKWARD_PLANS: 96 or all 128
    columns of dK and dV in registers at d = 128, 32 or none in shared memory) against float64
    on the emulator: causal with GQA, 131 queries and 300 keys (whole tiles, tiles the mask
    cuts, a partial query and key tile), atomic dQ."""
    (plan,) = [
        plan
        for plan, _ in wide_light_backward_plans(get_target("sm90"), 128)
        if (plan.block_rows, plan.block_cols, plan.dk_register_columns) == tiles
    ]
    kern = attncc.compile(ROOT / "examples" / "causal.attn", target="sm90", emulate=True)
    kern = EmulatedKernel(with_tiles(kern.stages, lambda table: table.with_backward(128, plan)), "sm90")
    result = check(kern, adapt(Shape(1, 4, 2, 131, 300, 128), kern), torch.bfloat16)
    assert result.ok, result.describe()


@pytest.mark.parametrize("name", ["alibi", "relative_bias"])
def test_learnable_input_grads_are_exact_sums_in_deterministic_mode(name: str) -> None:
    """Deterministic mode sums learnable-input gradients in int64 fixed point (a bounds pass,
    then the sums): the same bits under every schedule, where the float atomics' bits differ."""
    kern = emulated(name)
    shape = adapt(Shape(2, 2, 1, 70, 90, 32), kern)
    q, k, v, runtime = make_inputs(kern, shape, torch.float16)
    learnable = [t for t in runtime.values() if isinstance(t, torch.Tensor) and t.requires_grad]
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).half()

    def input_grads(schedule: str, deterministic: bool) -> list[torch.Tensor]:
        kern.schedule, kern.deterministic = schedule, deterministic
        try:
            return list(torch.autograd.grad(kern(q, k, v, **runtime), learnable, dout))
        finally:
            kern.schedule, kern.deterministic = "lockstep", False

    atomics = [input_grads(schedule, False) for schedule in ("lockstep", "warp-greedy")]
    exact = [input_grads(schedule, True) for schedule in ("lockstep", "warp-greedy")]
    if name == "relative_bias":  # an atomic per score: the float sums depend on the order
        assert not all(torch.equal(a, b) for a, b in zip(*atomics))
    # (alibi's slopes: per-warp sums, one atomic per warp and tile; their order may not change the bits here)
    assert all(torch.equal(a, b) for a, b in zip(*exact))
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(exact[0], atomics[0]))
    torch.use_deterministic_algorithms(True)  # torch's flag selects the same path, no warning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert all(torch.equal(a, b) for a, b in zip(input_grads("lockstep", False), exact[0]))
    finally:
        torch.use_deterministic_algorithms(False)
    kern.deterministic = True
    try:
        result = check(kern, shape, torch.float16)  # and the exact sums match float64 eager
    finally:
        kern.deterministic = False
    assert result.ok, result.describe()


def test_fixed_point_grid_sums_exactly_without_overflow() -> None:
    """The grid `fixed_point_shifts` picks: terms rounded onto it sum in int64 to a value that
    fits (partial sums may wrap), the same in any order, within half a grid step per term of
    the float64 sum; worst case: every term just below the bound's power of two, as many terms
    as the count's bits allow."""
    gen = torch.Generator().manual_seed(0)
    scales = torch.tensor([[1e-40], [1e-30], [1.0], [3e4], [0.0]], dtype=torch.float64)  # 1e-40: subnormal
    terms = (torch.randn(5, 5000, generator=gen, dtype=torch.float64) * scales).float()
    bound = terms.abs().view(torch.int32).amax(1)
    shifts = fixed_point_shifts(bound, torch.full((5,), terms.shape[1], dtype=torch.int64))
    fixed = torch.round(torch.ldexp(terms.double(), shifts[:, None].double())).to(torch.int64)
    exact_sums = [sum(row) for row in fixed.tolist()]  # Python ints: no overflow
    assert all(-(2**63) <= total < 2**63 for total in exact_sums)
    assert fixed.sum(1).tolist() == exact_sums == fixed.flip(1).sum(1).tolist()
    got = from_fixed_point(fixed.sum(1), shifts, torch.zeros(5, dtype=torch.int32))
    step = torch.ldexp(torch.ones(5, dtype=torch.float64), -shifts.double())
    error = (got.double() - terms.double().sum(1)).abs()
    assert (error <= terms.shape[1] * step / 2 + 2**-24 * got.double().abs()).all() and got[4] == 0
    worst = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))  # just below 2^0, bound exponent field 126
    count = 2**20 - 1
    shift = int(fixed_point_shifts(worst.view(torch.int32)[None], torch.tensor([count]))[0])
    term = round(float(worst) * 2.0**shift)
    assert term * count < 2**63 and term <= 2 ** (63 - 20)
    flags = torch.tensor([0, POS_INF, NEG_INF, POS_INF | NEG_INF, NAN | POS_INF], dtype=torch.int32)
    got = from_fixed_point(torch.ones(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int32), flags)
    assert got[0] == 1 and got[1] == float("inf") and got[2] == float("-inf") and got[3:].isnan().all()


def test_non_finite_learnable_input_grads_in_deterministic_mode() -> None:
    """An inf in one row of the gradient of out makes that row's bias-gradient terms inf or NaN
    (one term per bias element: the row meets each distance once). The exact mode gives those
    elements inf or NaN from the kinds of terms seen, as the float atomics do, with the same bits
    under every schedule; the other elements keep their exact sums. (Eager gives NaN for all
    of them: its softmax backward sums the row's mixed infinities into delta, where FlashAttention's
    delta = rowsum(dO * O) is one infinity.)"""
    kern = emulated("relative_bias")
    q, k, v, runtime = make_inputs(kern, adapt(Shape(1, 2, 1, 40, 40, 32), kern), torch.float16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dout[0, 1, 7, 3] = float("inf")

    def bias_grad(schedule: str, deterministic: bool) -> torch.Tensor:
        kern.schedule, kern.deterministic = schedule, deterministic
        try:
            return torch.autograd.grad(kern(q, k, v, **runtime), [runtime["bias"]], dout.half())[0]
        finally:
            kern.schedule, kern.deterministic = "lockstep", False

    exact = [bias_grad(schedule, True) for schedule in ("lockstep", "warp-greedy")]
    atomics = bias_grad("lockstep", False)
    assert torch.equal(exact[0].view(torch.int32), exact[1].view(torch.int32))  # bits (NaN != NaN)
    assert exact[0].isnan().any() and exact[0].isposinf().any()
    for kind in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(kind(exact[0]), kind(atomics))
    ref_out, _ = kern.reference(q, k, v, **runtime)
    (expected,) = torch.autograd.grad(ref_out, [runtime["bias"]], dout)
    finite = expected.isfinite()
    assert torch.equal(exact[0].isfinite(), finite) and finite[0].all()  # head 0 untouched
    assert torch.allclose(exact[0][finite].double(), expected[finite].double(), atol=2e-2)


def test_gpu_target_without_emulation_is_a_clear_error() -> None:
    with pytest.raises(AttnccError, match="emulate=True"):
        attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm90")


def test_missing_nvcc_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(AttnccError, match=r"nvcc not found \(looked in PATH.*attncc\[cuda\]"):
        find_nvcc()


@pytest.mark.parametrize(
    ("torch_cuda", "says"),
    [
        ("13.0", r"^`pip install 'attncc\[cuda\]'`"),
        ("12.8", r"CUDA 12.8: .*attncc\[cuda\].*driver supports CUDA 13.*CUDA 12 toolkit.*no pip wheel"),
        (None, r"CPU build.*emulate=True"),
    ],
)
def test_nvcc_install_hint_follows_torchs_cuda(torch_cuda: str | None, says: str) -> None:
    """The nvcc to install depends on torch's CUDA major: the CUDA 13 wheels for CUDA 13, the
    same where a CUDA 12 torch's driver runs CUDA 13 or a CUDA 12 toolkit (no CUDA 12 nvcc
    wheel exists), none for a CPU build."""
    assert re.search(says, nvcc_install_hint(torch_cuda))


@pytest.mark.parametrize(
    ("layouts", "torch_cuda", "found"),
    [
        (["cuda_nvcc"], None, "cuda_nvcc"),  # nvidia-cuda-nvcc for CUDA 12
        (["cu13"], None, "cu13"),  # for CUDA 13
        (["cuda_nvcc", "cu13"], "12.8", "cuda_nvcc"),  # both: torch's CUDA major first
        (["cuda_nvcc", "cu13"], "13.0", "cu13"),
    ],
)
def test_nvcc_from_the_wheel(tmp_path, monkeypatch, layouts: list[str], torch_cuda: str | None, found: str) -> None:
    import importlib
    import sys

    for layout in layouts:
        nvcc = tmp_path / "nvidia" / layout / "bin" / "nvcc"
        nvcc.parent.mkdir(parents=True)
        nvcc.write_text("#!/bin/sh\n")
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    importlib.invalidate_caches()
    assert find_nvcc() == str(tmp_path / "nvidia" / found / "bin" / "nvcc")


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_driver_older_than_nvcc_is_a_clear_error() -> None:
    from attncc.runtime.nvcc import check_driver_runs_nvcc_builds, nvcc_release

    major, minor = nvcc_release()
    check_driver_runs_nvcc_builds(major * 1000 + minor * 10)  # the same release: fine
    with pytest.raises(
        AttnccError, match=rf"is CUDA {major}\.{minor}, but the GPU driver supports CUDA {major - 1}\.4"
    ):
        check_driver_runs_nvcc_builds((major - 1) * 1000 + 40)


def test_cuda_target_without_a_gpu_is_a_clear_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; tests/test_gpu.py covers it")
    with pytest.raises(AttnccError, match="torch sees no CUDA device"):
        attncc.compile(ROOT / "examples" / "vanilla.attn", target="cuda")


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_gpu_library_builds_with_host_launch_code(tmp_path, monkeypatch) -> None:
    """What target='cuda' builds on a GPU machine: kernels plus launchers, as a shared library."""
    import subprocess

    from attncc.runtime.build import build_library

    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    stages = attncc.lower(ROOT / "examples" / "alibi.attn", "sm90")
    plan = fused_node(stages[-1].graph)[1].tiling.for_head_dim(64)
    library = build_library(generate_cuda(stages[-1].graph, "bfloat16", plan, "sm90"), "alibi-gpu", cuda_arch="sm90")
    symbols = subprocess.run(["nm", "-D", str(library)], capture_output=True, text=True).stdout
    for entry in ("attncc_forward", "attncc_backward", "attncc_backward_grad_bounds", "attncc_cuda_error"):
        assert f" {entry}\n" in symbols, entry


def test_gpu_launch_path_with_the_emulated_library(monkeypatch) -> None:
    """What target="cuda" runs, short of device memory: GpuKernel's entry points, argument
    order, stream argument and deterministic passes, with the emulated library standing in for
    nvcc's (it exports the same attncc_* entry points; the emulator ignores the stream)."""
    import contextlib
    from types import SimpleNamespace

    from attncc.runtime.emulate import EmulatedKernel
    from attncc.runtime.gpu import GpuKernel

    class HostGpuKernel(GpuKernel):
        device_type = "cpu"
        library_path_for = EmulatedKernel.library_path_for  # the host build instead of nvcc's

        def _device_index(self) -> None:
            return None

        def _to_device(self, call: dict) -> dict:
            return call

    monkeypatch.setattr(torch.cuda, "current_stream", lambda: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(multi_processor_count=132))
    kern = HostGpuKernel(attncc.lower(ROOT / "examples" / "relative_bias.attn", "sm86"), "sm86")
    for deterministic in (False, True):
        kern.deterministic = deterministic
        result = check(kern, adapt(Shape(1, 2, 1, 50, 70, 128), kern), torch.bfloat16)
        assert result.ok, f"deterministic={deterministic}: {result.describe()}"
    q = torch.randn(1, 2, 50, 128)
    assert kern.plan(q, torch.randn(1, 1, 70, 128), None).kv_splits == 2  # 2 blocks on 132 SMs: split


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
def test_cli_writes_self_contained_cuda_sources(tmp_path) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "attncc.cli",
            "compile",
            "examples/document.attn",
            "--target",
            "sm90",
            "-o",
            str(tmp_path),
            "--head-dim",
            "64",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "tensor cores: yes" in proc.stdout and "0/0 B spill" in proc.stdout
    source = tmp_path / "document_sm90_bfloat16_d64.cu"
    result = subprocess.run(
        [
            find_nvcc(),
            "-arch=sm_90",
            "-std=c++17",
            "-c",
            "-I",
            attncc.include_dir(),
            str(source),
            "-o",
            str(tmp_path / "k.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["alibi", "relative_bias", "gpt_oss", "padding", "prefix_lm", "rope_causal", "gpt2"])
@pytest.mark.parametrize("queries", [1, 5])
def test_gqa_decoding_runs_a_groups_query_heads_as_one_heads_rows(
    name: str, queries: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding and short chunks with GQA (H = 8 over Hkv = 2, groups of 4): the forward runs q
    as [B, Hkv, 4 N, D] (`with_folded_query_heads`: a block per K/V head and split reads each K/V
    tile once for the group) and gives the bits of the call with a block per query head, on
    programs that read h (ALiBi slopes, a per-head bias table, sinks), i and N (padding,
    prefix, rope, bottom-right windows). With dropout (gpt2 in training) it does not fold."""
    from tests.test_context_parallel import ROPE_CAUSAL

    kern = attncc.compile(ROPE_CAUSAL, target="sm80", emulate=True) if name == "rope_causal" else emulated(name)
    shape = Shape(2, 8, 2, queries, 150, 64)
    q, k, v, runtime = make_inputs(kern, shape, torch.bfloat16, requires_grad=False)
    problems = recorded_problems(kern, monkeypatch)
    train = name == "gpt2"
    folded = kern(q, k, v, return_lse=True, train=train, seed=5, **runtime)
    monkeypatch.setattr(kern, "query_head_group", lambda *args: 1)
    kern._repeats.clear()  # (the folded launch kept for calls repeating this one: a method patched is not in its key)
    per_head = kern(q, k, v, return_lse=True, train=train, seed=5, **runtime)
    assert problems == ([(8, 2, queries)] * 2 if train else [(2, 2, 4 * queries), (8, 2, queries)])
    assert torch.equal(folded[0], per_head[0]) and torch.equal(folded[1], per_head[1])
    if not train:  # and a reference: rows of the right heads and positions, not merely consistent
        exact = {
            n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in runtime.items()
        }
        want_out, want_lse = kern.reference(q.double(), k.double(), v.double(), train=False, **exact)
        torch.testing.assert_close(folded[0].double(), want_out, atol=3e-2, rtol=0)
        torch.testing.assert_close(folded[1].double(), want_lse, atol=1e-2, rtol=0)  # rope: bf16 rotated rows


def one_query_plan(heads: tuple[int, int], B: int, M: int, key_split_warps: bool) -> CallPlan:
    """What a GPU forward (GpuKernel's short_query_tiles on, key_split_warps as given) plans on
    sm90 for one bf16 query of d=128 per (batch, head) against M keys, a GQA group's query
    heads folded into rows as the forward runs them."""
    H, Hkv = heads
    kern = emulated("vanilla", "sm90")
    kern.short_query_tiles, kern.key_split_warps = True, key_split_warps
    q = torch.empty(B, H, 1, 128, device="meta", dtype=torch.bfloat16)
    k = torch.empty(B, Hkv, M, 128, device="meta", dtype=torch.bfloat16)
    group = kern.query_head_group(q, Hkv, 128, 0.0, None)
    folded = kern.with_folded_query_heads() if group > 1 else kern
    return folded.for_rows(group, 128).plan(q.view(B, Hkv, group, 128) if group > 1 else q, k, None)


#: H100 decoding sweep (session 35, bench/results/cuda-h100-session35/decode/sweep-decode.log),
#: bf16 d=128, one query: ((H, Hkv), B, M) -> ms per call at 1, 2, 4, ..., 64 splits, of the
#: key-split forward (16 rows, 4 warps) and of the 64-row forward (`short_query_tiles`).
H100_DECODING = {
    ((32, 32), 1, 16384): ((0.254, 0.146, 0.120, 0.126, 0.148, 0.170, 0.220), (0.362, 0.203, 0.121, 0.128, 0.148, 0.175, 0.230)),
    ((32, 32), 1, 65536): ((0.968, 0.500, 0.396, 0.404, 0.444, 0.453, 0.501), (1.423, 0.730, 0.391, 0.413, 0.424, 0.452, 0.507)),
    ((32, 32), 8, 16384): ((0.768, 0.840, 0.795, 0.793, 0.803, 0.829, 0.882), (0.779, 0.779, 0.779, 0.789, 0.780, 0.804, 0.889)),
    ((32, 32), 8, 65536): ((2.943, 3.183, 2.988, 3.008, 3.009, 2.988, 3.094), (2.971, 3.024, 3.052, 3.126, 2.979, 2.976, 3.029)),
    ((32, 8), 1, 16384): ((0.247, 0.146, 0.082, 0.062, 0.058, 0.074, 0.101), (0.357, 0.195, 0.109, 0.070, 0.061, 0.074, 0.118)),
    ((32, 8), 1, 65536): ((0.946, 0.516, 0.258, 0.144, 0.127, 0.151, 0.220), (1.404, 0.721, 0.363, 0.197, 0.125, 0.150, 0.221)),
    ((32, 8), 8, 16384): ((0.250, 0.210, 0.215, 0.240, 0.238, 0.264, 0.321), (0.365, 0.212, 0.219, 0.224, 0.238, 0.267, 0.323)),
    ((32, 8), 8, 65536): ((0.961, 0.753, 0.762, 0.825, 0.792, 0.812, 0.871), (1.404, 0.741, 0.780, 0.777, 0.792, 0.843, 0.870)),
}  # fmt: skip


@pytest.mark.parametrize("key_split_warps", [True, False])
@pytest.mark.parametrize(("heads", "B", "M"), list(H100_DECODING))
def test_gpu_decoding_runs_at_a_split_count_the_h100_timed_near_its_best(
    heads: tuple[int, int], B: int, M: int, key_split_warps: bool
) -> None:
    """What a GPU forward (GpuKernel: short_query_tiles on) plans for one query on sm90 (132
    SMs): the key-split forward (16 rows, 4 warps) or the 64-row forward, at a split count the
    H100 timed within 5% of the fastest. Planted faults this catches: slots for 2 resident
    blocks per SM (32 splits for GQA 32/8 B=1: 0.074 ms where 16 took 0.058), for 3 (128),
    Br = 128 kept for one-query calls."""
    plan = one_query_plan(heads, B, M, key_split_warps)
    times = H100_DECODING[(heads, B, M)][0 if key_split_warps else 1]
    assert (plan.tiles.block_rows, plan.tiles.key_warps) == ((16, 4) if key_split_warps else (64, 1))
    assert plan.kv_splits in (1, 2, 4, 8, 16, 32, 64), plan.kv_splits
    assert times[plan.kv_splits.bit_length() - 1] <= 1.05 * min(times), (plan.kv_splits, times)


KEY_SPLIT_SHAPES = (
    (Shape(2, 8, 2, 1, 300, 128), None),  # decoding, a GQA group of 4 folded: 4 rows; M a tail of 64
    (Shape(1, 4, 4, 1, 77, 128), None),  # one row per head
    (Shape(1, 4, 1, 4, 130, 128), 3),  # a group of 4 x 4 queries: 16 rows; forced split-KV
    (Shape(2, 2, 2, 13, 1, 128), None),  # one key: three of the four warps see none
    (Shape(1, 2, 1, 3, 333, 64), None),  # d = 64: 128-key tiles, 32 keys per warp
    (Shape(1, 8, 1, 4, 200, 128), None),  # a group of 8 x 4 queries (speculative decoding): 32 rows, 2 x 2 warps
    (Shape(2, 2, 2, 20, 90, 64), 2),  # 20 rows of one head: 32-row blocks, 2 warps of 64 keys per 16 rows
)


#: Programs for decoding rows: bottom-right causal (queries are the last N positions), so that
#: every warp's keys are visible (top-left `j <= i` leaves one-query calls a single key).
DECODING_PROGRAMS = {
    "alibi": BOTTOM_RIGHT,  # (tests/test_serving.py: ALiBi from the query's position)
    "dropout": """attention decoding_dropout
s = q @ k.T * scale
mask j <= i + (M - N)
p = softmax(s)
p = dropout(p, 0.1)
o = p @ v
output o
""",
}


@pytest.mark.parametrize("name", ["alibi", "dropout", "gpt_oss", "padding", "softcap"])
def test_key_split_warps_run_calls_of_16_rows_and_match_float64(name: str) -> None:
    """With key_split_warps, calls of at most 16 query rows per (batch, head), GQA groups
    folded, run `for_key_split_warps` (16 rows, 4 warps each taking 16 keys of every 64-key
    tile at d = 128, 32 of 128 at d = 64, merged at the end), calls of 17-32 rows its 32-row
    forward (2 warps per 16 rows), forward and lse against float64 (the backward keeps the plan's):
    score maps (alibi, softcap), sinks and a window (gpt_oss), dropout bits by key (each warp
    draws for its own keys), runtime lengths (padding), fully masked rows (one key), split-KV,
    tails; alibi also with warps run ahead to their barriers. Planted faults this catches: a
    warp's keys not offset in the mask, in V or in the dropout draws, the merge's weights
    swapped, no barrier before the merge overwrites the K/V tiles (warp-greedy)."""
    program = DECODING_PROGRAMS.get(name) or ROOT / "examples" / f"{name}.attn"
    for schedule in ("lockstep", "warp-greedy")[: 2 if name == "alibi" else 1]:
        check_key_split_warps(attncc.compile(program, target="sm90", emulate=True), schedule)


def check_key_split_warps(kern: attncc.Kernel, schedule: str) -> None:
    """KEY_SPLIT_SHAPES through `kern` with key_split_warps on, under the emulator's `schedule`
    (warp-greedy runs each warp ahead to its next barrier: a merge that does not wait for every
    warp to leave the K/V tiles reads them overwritten)."""
    kern.schedule = schedule
    kern.key_split_warps = True
    for rows, key_warps in ((16, 4), (32, 2)):
        for head_dim, key_tile in ((128, 64), (64, 128)):
            plan = kern.for_key_split_warps(rows).op.tiling.for_head_dim(head_dim)
            assert (plan.block_rows, plan.block_cols, plan.key_warps, plan.threads) == (rows, key_tile, key_warps, 128)
            assert plan.backward is None  # its libraries hold the forward alone
    for shape, splits in KEY_SPLIT_SHAPES:
        kern.kv_splits = splits
        result = check(kern, adapt(shape, kern), torch.bfloat16)
        assert result.ok, f"{shape}: {result.describe()}"
        q = torch.empty(shape.B, shape.H, shape.N, shape.D, device="meta")
        folds = kern.query_head_group(q, shape.Hkv, shape.D, kern.op.dropout, None) > 1  # (not with dropout)
        ran = kern.with_folded_query_heads() if folds else kern
        rows = shape.N * (shape.H // shape.Hkv if folds else 1)
        variant = ran._row_variants.get(f"key_split_warps_{16 if rows <= 16 else 32}")
        assert variant is not None and any(d == "bfloat16" for d, *_ in variant._libraries), f"{shape}: not key-split"
        variant._libraries.clear()  # (so that the next shape's use is its own)


@pytest.mark.parametrize("name", ["alibi", "gpt_oss"])
def test_short_query_calls_run_the_64_row_forward(name: str) -> None:
    """With short_query_tiles (a GPU's default), calls of at most 64 query rows per (batch,
    head), GQA groups folded, run `for_short_queries` (64 rows, forward only), longer ones the
    plan's 128; both against float64, forward and backward (the backward keeps the plan's)."""
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="sm90", emulate=True)
    kern.short_query_tiles = True
    assert kern.op.tiling.for_head_dim(128).block_rows == 128
    short = kern.for_short_queries()
    assert short.op.tiling.for_head_dim(128).block_rows == 64
    assert short.op.tiling.for_head_dim(128).backward is None  # its libraries hold the forward alone
    for shape, runs_short in (
        (Shape(2, 8, 2, 1, 300, 128), True),  # decoding, a GQA group of 4 folded: 4 rows
        (Shape(1, 4, 2, 33, 130, 64), False),  # a group of 2 folded: 66 rows
        (Shape(1, 2, 2, 64, 100, 64), True),
    ):
        result = check(kern, adapt(shape, kern), torch.bfloat16)
        assert result.ok, f"{shape}: {result.describe()}"
        group = shape.H // shape.Hkv
        ran = kern.with_folded_query_heads() if group > 1 and kern.query_head_group(
            torch.empty(shape.B, shape.H, shape.N, shape.D, device="meta"), shape.Hkv, shape.D, 0.0, None
        ) > 1 else kern  # fmt: skip
        variant = ran._row_variants.get("short_queries")
        used = variant is not None and any(d == "bfloat16" for d, *_ in variant._libraries)
        assert used == runs_short, f"{shape}: short-query forward used: {used}"
        if variant is not None:
            variant._libraries.clear()  # (so that the next shape's use is its own)


def test_true_or_false_settings_refuse_other_values() -> None:
    """`kern.deterministic = "False"` (a truthy string) switched deterministic mode on, and
    `kern.fp8_mma = "x"` the fp8 products, silently: each is a clear error at the call."""
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm80", emulate=True)
    q = torch.randn(1, 2, 9, 16, requires_grad=True)
    kern.deterministic = "False"
    try:
        with pytest.raises(AttnccError, match="deterministic: expected True or False, got 'False'"):
            kern(q, q, q).sum().backward()
    finally:
        kern.deterministic = False
    kern.key_split_warps, kern.fp8_mma = True, "x"
    try:
        with pytest.raises(AttnccError, match="fp8_mma: expected True or False, got 'x'"):
            kern(q[:, :, :1].detach(), q.detach(), q.detach())
    finally:
        kern.key_split_warps, kern.fp8_mma = False, False
    for setting in ("key_split_warps", "short_query_tiles"):  # (session 62: read as truthy, "False" was on)
        setattr(kern, setting, "False")
        try:
            with pytest.raises(AttnccError, match=f"{setting}: expected True or False, got 'False'"):
                kern(q[:, :, :1].detach(), q.detach(), q.detach())
        finally:
            setattr(kern, setting, False)


def test_a_setting_the_kernel_does_not_have_is_an_error() -> None:
    """`kern.determinstic = True` (a typo) made a new attribute and left deterministic mode off,
    silently; a GPU setting on a CPU kernel did nothing either. Both are errors naming the
    settings; a kernel's own settings and private attributes are still set."""
    emulated = attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm80", emulate=True)
    with pytest.raises(AttributeError, match="no setting 'determinstic' \\(did you mean 'deterministic'\\?"):
        emulated.determinstic = True
    assert not hasattr(emulated, "determinstic") and emulated.deterministic is False
    cpu = attncc.compile(ROOT / "examples" / "vanilla.attn")
    with pytest.raises(AttributeError, match=r"'kv_splits' \(a setting of the GPU kernels .*not of target cpu's"):
        cpu.kv_splits = 2
    with pytest.raises(
        AttributeError, match="no setting 'backwards' \\(did you mean 'backward'\\? its settings: backward\\)"
    ):
        cpu.backwards = "fused"
    cpu.backward = "fused"
    emulated.deterministic, emulated._scratch = True, 1
    assert emulated.deterministic and emulated._scratch == 1
    copied = copy.deepcopy(emulated)  # (a copy's registration sets its attributes anew)
    assert copied.deterministic and copied.call_key != emulated.call_key
