"""Roofline estimates of the CUDA kernels: what a launch does, priced at a GPU target's rates.

`Work` is a launch in the units the roofline prices (tensor-core FLOPs, exp2 results,
shared-memory wavefronts, L2 sectors, DRAM bytes); `estimate` turns it into time per resource
with the occupancy calculator's rules. Two sources of Work: the emulator's counters of the
generated code (`attncc profile`, attncc/runtime/profile.py) and `forward_work` /
`backward_work`, the kernels' counts derived from their tiles, which the tiling pass uses to
choose tiles (tests check that they equal the emulator's counts at tile-aligned shapes). The
kernels' shared-memory layouts (`gpu_*shared_bytes`) live here, for both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from attncc.errors import AttnccError
from attncc.passes.sparsity import Problem
from attncc.targets import GPU_RATES, GPUS

MMA_FLOPS = 2 * 16 * 8 * 16  # one warp-wide mma.m16n8k16
SECTOR_BYTES = 32


@dataclass(frozen=True)
class Work:
    """One kernel launch (or the sum of a kernel's launches in one call)."""

    blocks: int
    threads_per_block: int
    shared_bytes: int  # per block
    mma_flops: int
    ex2: int  # exp2 results (lanes)
    shared_wavefronts: int
    l2_sectors: int  # global-memory sectors the SMs request
    dram_bytes: int  # distinct bytes touched: what DRAM moves at least


@dataclass(frozen=True)
class Estimate:
    """Seconds per resource, the largest, and the bound."""

    blocks_per_sm: int
    limiter: str  # what caps blocks_per_sm
    terms: dict[str, float]
    seconds: float
    bound: str


def blocks_per_sm(threads: int, shared_bytes: int, registers: int | None, target: str) -> tuple[int, str]:
    """Resident blocks per SM and what limits them (the occupancy calculator's rules: registers
    allocated per warp in units of 256, shared memory plus the runtime's reserve per block)."""
    gpu, rates = GPUS[target], GPU_RATES[target]
    warps = -(-threads // gpu.warp_size)
    limits = {"blocks": rates.max_blocks_per_sm, "threads": rates.max_threads_per_sm // threads}
    if shared_bytes:
        limits["shared memory"] = gpu.shared_bytes_per_sm // (shared_bytes + rates.reserved_shared_per_block)
    if registers:
        per_warp = -(-registers * gpu.warp_size // 256) * 256
        limits["registers"] = gpu.registers_per_sm // (per_warp * warps)
    limiter = min(limits, key=lambda name: limits[name])
    return limits[limiter], limiter


def estimate(work: Work, target: str, registers: int | None = None, name: str = "kernel") -> Estimate:
    """Time of `work` on the target's reference part, per resource:

    - per-SM resources (tensor cores, SFU exp2, shared-memory wavefronts, L2 to SM sectors): the
      busiest SM runs ceil(blocks / SMs) blocks, at the SM's rate; a block's warps can use only
      as many of the SM's 4 sub-partitions (tensor cores, SFUs) as there are resident warps;
    - DRAM: the distinct bytes once, at the part's bandwidth.
    The estimate is the largest term; its bound is that term's resource, or latency/occupancy
    where the grid leaves most SMs idle or fewer warps than sub-partitions are resident (there
    the throughput terms are lower bounds)."""
    gpu, rates = GPUS[target], GPU_RATES[target]
    resident, limiter = blocks_per_sm(work.threads_per_block, work.shared_bytes, registers, target)
    if resident == 0:
        raise AttnccError(f"{name}: one block needs more than an SM of {target} has ({limiter})")
    blocks = max(work.blocks, 1)
    per_sm_blocks = math.ceil(blocks / gpu.multiprocessors)
    warps = -(-work.threads_per_block // gpu.warp_size) * min(resident, per_sm_blocks)
    partitions = min(rates.sub_partitions, warps) / rates.sub_partitions
    sm_seconds = per_sm_blocks / blocks / rates.clock_hz  # x work / (rate per SM and clock)
    terms = {
        "tensor": sm_seconds * work.mma_flops / (rates.mma_flops_per_sm_clock * partitions),
        "exp2": sm_seconds * work.ex2 / (rates.ex2_per_sm_clock * partitions),
        "shared memory": sm_seconds * work.shared_wavefronts,
        "L2": sm_seconds * SECTOR_BYTES * work.l2_sectors / rates.l2_bytes_per_sm_clock,
        "DRAM": work.dram_bytes / rates.dram_bytes_per_s,
    }
    worst = max(terms, key=lambda term: terms[term])
    idle = blocks < gpu.multiprocessors / 2 or warps < rates.sub_partitions
    return Estimate(resident, limiter, terms, terms[worst], "latency/occupancy" if idle else worst)


def phase_wavefronts(addresses: list[int], size: int) -> int:
    """Shared-memory wavefronts of one phase: the most distinct 4-byte words in one of the 32
    banks (the emulator's rule, include/attncc/cuda/emulator.h)."""
    banks: dict[int, set[int]] = {}
    for address in addresses:
        for word in range(address // 4, (address + size - 1) // 4 + 1):
            banks.setdefault(word % 32, set()).add(word)
    return max((len(words) for words in banks.values()), default=0)


@cache
def copy_wavefronts(rows: int, head_dim: int) -> int:
    """Wavefronts of `load_tile`'s 16-byte cp.async destinations for `rows` rows of head_dim
    halves padded to head_dim + 8 (chunk c of the tile: row c / (D/8), column 8 (c % (D/8)));
    a warp's 32 consecutive chunks are one request, 8 lanes a phase. Conflict-free where a phase
    stays in one row (D a multiple of 64); two rows per phase can share banks (D = 32: 2-way)."""
    chunks_per_row, stride = head_dim // 8, 2 * (head_dim + 8)
    addresses = [(c // chunks_per_row) * stride + (c % chunks_per_row) * 16 for c in range(rows * chunks_per_row)]
    return sum(phase_wavefronts(addresses[p : p + 8], 16) for p in range(0, len(addresses), 8))


def gpu_shared_bytes(br: int, bc: int, d: int, stages: int) -> int:
    """fp16/bf16 shared memory of templates/cuda/attention.cu.jinja: the Q tile plus `stages`
    buffers of K and V tiles, rows padded by 8 halves (16 bytes) against bank conflicts."""
    return 2 * (br + stages * 2 * bc) * (d + 8)


def gpu_backward_shared_bytes(
    br: int, bc: int, d: int, dv_register_columns: int = 0, dk_register_columns: int = 0, stages: int = 1
) -> int:
    """The backward kernel's shared memory: `stages` buffers of the Q, dO (Br rows) tiles and
    their rows' lse and delta, K, V (Bc rows) tiles, dS^T (Bc x (Br + 8) halves) and the shared
    columns of the fp32 dK and dV accumulators (Bc x (d - register columns) each)."""
    shared_columns = 2 * d - dv_register_columns - dk_register_columns
    return 2 * (2 * stages * br + 2 * bc) * (d + 8) + 2 * bc * (br + 8) + 4 * (bc * shared_columns + 2 * stages * br)


def gpu_dq_shared_bytes(br: int, bc: int, d: int) -> int:
    """The deterministic dQ kernel's shared memory: Q, dO (Br rows) and K, V parts of at most 64
    keys (halves of a Bc above 64), and the fp32 dQ columns before the last 128 (d > 128)."""
    part = bc if bc <= 64 else bc // 2
    return 2 * (2 * br + 2 * part) * (d + 8) + 4 * br * max(d - 128, 0)


def forward_work(
    head_dim: int,
    br: int,
    bc: int,
    problem: Problem,
    q_in_registers: bool,
    visible_tiles: int | None = None,
    warp_rows: int = 16,
) -> Work:
    """The forward kernel (templates/cuda/attention.cu.jinja `attention_forward`, unsplit) at
    `problem` with Br x Bc tiles, `warp_rows` rows (u = warp_rows / 16 row blocks) per warp,
    fp16/bf16 storage, from its loops:

    per block: Q's cp.async copies (16 bytes each, `copy_wavefronts`) and, with Q in registers,
    its u D/16 ldmatrix per warp; per visible key tile and warp: (D/16)(Bc/16) ldmatrix each for
    K and V (4 wavefronts: rows are padded to D + 8 halves) and u D/16 more for Q when it is
    reloaded, 4 u (D/16)(Bc/16) mma, u (2 + Bc/2) exp2 instructions, K and V's copies; per row:
    O stored a column pair per lane (a sector per row and 8 columns), the lse. `visible_tiles`
    counts the (b, h, query tile, key tile) pairs the sparsity analysis keeps (all by default).
    Exact for N and M multiples of the tiles and D = head_dim; the tail tiles' zero-filled rows
    are not modelled."""
    d = head_dim
    query_tiles, key_tiles = -(-problem.N // br), -(-problem.M // bc)
    blocks = problem.B * problem.H * query_tiles
    visible = blocks * key_tiles if visible_tiles is None else visible_tiles
    warps, row_blocks = br // warp_rows, warp_rows // 16
    computing = visible * warps  # (warp, visible key tile) pairs
    ldmatrix_per_tile = 2 * (d // 16) * (bc // 16) + (0 if q_in_registers else row_blocks * d // 16)
    chunks_per_tile = 2 * bc * d // 8  # K and V: 16-byte copies
    chunks_per_block = br * d // 8  # Q
    rows = problem.B * problem.H * problem.N
    return Work(
        blocks=blocks,
        threads_per_block=warps * 32,
        shared_bytes=gpu_shared_bytes(br, bc, d, 2),  # two K/V stages (the template asserts it)
        mma_flops=computing * row_blocks * 4 * (d // 16) * (bc // 16) * MMA_FLOPS,
        ex2=computing * row_blocks * 32 * (2 + bc // 2),
        shared_wavefronts=4 * computing * ldmatrix_per_tile
        + 4 * blocks * warps * (row_blocks * d // 16 if q_in_registers else 0)
        + 2 * visible * copy_wavefronts(bc, d)
        + blocks * copy_wavefronts(br, d),
        l2_sectors=(visible * chunks_per_tile + blocks * chunks_per_block) * 16 // SECTOR_BYTES
        + rows * d // 8
        + rows * 4 // SECTOR_BYTES,
        dram_bytes=2 * (2 * rows * d + 2 * problem.B * problem.Hkv * problem.M * d) + 4 * rows,
    )


def backward_work(
    head_dim: int,
    br: int,
    bc: int,
    problem: Problem,
    register_columns: tuple[int, int] = (0, 0),
    pair_atomics: bool = False,
    visible_tiles: int | None = None,
    stages: int = 2,
) -> Work:
    """The backward kernel (`attention_backward`, atomic dQ, no dropout or learnable inputs) at
    `problem` with Br x Bc tiles, a warp per 16 keys, the last `register_columns` = (dK, dV)
    columns of each warp's accumulators in registers and the rest in fp32 shared memory, from
    its loops:

    per block: K and V copied in once, the shared accumulator columns zeroed, then stored
    (a column per thread) and the register columns stored as column pairs; per visible
    (query tile, key tile) pair: Q and dO copied in, their rows' lse and delta (a float per
    thread); per warp S^T = K Q^T and dP^T = V dO^T ((D/16) ldmatrix each for K and V, (D/16)
    (Br/16) for Q and dO, 4 per pair of them mma), an exp2 and two shared reads (lse, delta)
    per score, dV and dK ((D/16)(Br/16) ldmatrix.trans for dO and Q, 4 mma per pair), 16
    wavefronts (2 float2 loads and stores per row pair and half) per shared 16-column block of
    each accumulator, dS^T stored as halves pairs; dQ = dS K in (Br/16) query blocks times
    slices of D over the warps (an ldmatrix.trans of dS^T per 16 keys, one of K per 16 columns, 2
    mma) and its fp32 atomics, a column pair per atomic where `pair_atomics` (sm90). `stages`
    Q/dO buffers (2: the next query tile prefetched) change only the shared memory. Exact for N
    and M multiples of the tiles and D = head_dim <= 128 (above, the template also cuts the dQ
    product into slices of at most 128 columns, which this model does not)."""
    d, (dk_registers, dv_registers) = head_dim, register_columns
    query_tiles, key_tiles = -(-problem.N // br), -(-problem.M // bc)
    blocks = problem.B * problem.Hkv * key_tiles
    visible = problem.B * problem.H * query_tiles * key_tiles if visible_tiles is None else visible_tiles
    warps = bc // 16
    threads = 32 * warps
    rows, kv_rows = problem.B * problem.H * problem.N, problem.B * problem.Hkv * problem.M
    shared_columns = 2 * d - dk_registers - dv_registers
    dq_blocks = br // 16
    slices = warps // dq_blocks if warps > dq_blocks and (d // 16) % (warps // dq_blocks) == 0 else 1
    # per visible pair and warp: ldmatrix and mma of S^T, dP^T, dV, dK; dQ's over all warps
    ldmatrix = warps * ((d // 16) * (2 + 2 * (br // 16)) + 2 * (d // 16) * (br // 16))
    ldmatrix += dq_blocks * slices * (bc // 16) * (1 + d // slices // 16)
    mma = warps * 8 * (d // 16) * (br // 16) + dq_blocks * (bc // 16) * 2 * (d // 16)
    # lse and delta: a float per thread, rows of one tile per request of up to 32 lanes
    row_requests = 2 * -(-br // 32)
    row_sectors = 2 * br * 4 // SECTOR_BYTES
    accumulator_wavefronts = warps * 16 * (shared_columns // 16)
    ds_store_addresses = [(g * (br + 8) + 2 * t) * 2 for g in range(8) for t in range(4)]
    ds_stores = warps * 2 * (br // 8) * phase_wavefronts(ds_store_addresses, 4)
    per_visible_wavefronts = (
        4 * ldmatrix
        + 2 * copy_wavefronts(br, d)
        + row_requests
        + warps * br  # lse and delta per score: one (broadcast) wavefront each
        + accumulator_wavefronts
        + ds_stores
    )
    # per block: copies of K, V; zeroing and storing the shared accumulator columns (a float per
    # thread and request); the accumulator reads when stored
    zero_requests = -(-bc * shared_columns // threads) * warps
    per_block_wavefronts = 2 * copy_wavefronts(bc, d) + zero_requests + bc * shared_columns // 32
    # dQ atomics: per (query block, slice) and row pair, a request per 8 columns (two where a
    # column pair takes two atomics), 8 rows of 4 lanes: 8 sectors each
    atomic_requests = dq_blocks * slices * 2 * (d // slices // 8) * (1 if pair_atomics else 2)
    # dK and dV out: register columns as column pairs (8 rows of 16 bytes per request: 8
    # sectors), shared columns a column per thread
    store_sectors = sum(
        8 * warps * 2 * (registers // 16) * 2 + _column_store_sectors(bc, d - registers, d, threads)
        for registers in register_columns
    )
    return Work(
        blocks=blocks,
        threads_per_block=threads,
        shared_bytes=gpu_backward_shared_bytes(br, bc, d, dv_registers, dk_registers, stages),
        mma_flops=visible * mma * MMA_FLOPS,
        ex2=visible * warps * 32 * (br // 2),
        shared_wavefronts=visible * per_visible_wavefronts + blocks * per_block_wavefronts,
        l2_sectors=visible * (2 * br * d * 2 // SECTOR_BYTES + row_sectors + 8 * atomic_requests)
        + blocks * (2 * bc * d * 2 // SECTOR_BYTES + store_sectors),
        # q, dO, k, v read, lse and delta, the fp32 dQ accumulator, dK and dV written
        dram_bytes=2 * (2 * rows * d + 2 * kv_rows * d) + 8 * rows + 4 * rows * d + 2 * 2 * kv_rows * d,
    )


@cache
def _column_store_sectors(keys: int, columns: int, head_dim: int, threads: int) -> int:
    """Sectors of storing `columns` columns of `keys` rows (2-byte elements, rows head_dim
    apart) a column per thread: element e of the loop goes to thread e % threads, a warp's 32
    consecutive elements are one request."""
    sectors = 0
    for start in range(0, keys * columns, threads):
        for warp in range(start, min(start + threads, keys * columns), 32):
            elements = range(warp, min(warp + 32, start + threads, keys * columns))
            sectors += len({(e // columns * head_dim + e % columns) * 2 // SECTOR_BYTES for e in elements})
    return sectors
