"""Tiling: block sizes Br x Bc, threads and on-chip bytes per head dimension and target.

Algorithm 1 of the FlashAttention paper sets Bc = ceil(M / 4d), Br = min(Bc, d) for an
on-chip memory of M elements. The head dimension is only known at call time, so the pass
computes a plan for every head dimension up to 256 (rounded up to 16) and the runtime picks
the row. Each plan starts from the paper's formula and is refined for the target's real
limits; `TilePlan.reason` says which refinement applied.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from functools import lru_cache

from attncc.errors import AttnccError
from attncc.ir import expr as ex
from attncc.ir.expr import free_vars
from attncc.ir.graph import Graph, clone, fused_node
from attncc.ir.ops import FusedAttention
from attncc.passes.roofline import (
    Estimate,
    Work,
    backward_work,
    estimate,
    forward_work,
    gpu_backward_shared_bytes,
    gpu_shared_bytes,
)
from attncc.passes.sparsity import Problem
from attncc.targets import CPU_ISAS, GPU_RATES, NATIVE_FLAGS, Target, get_target

HEAD_DIM_STEP = 16
#: The largest head dim (of q and k, and of v) per target kind. The CPU kernels take D and Dv at
#: run time: up to DeepSeek's absorbed multi-head latent attention (decoding: q and k 576 wide,
#: v 512). The CUDA kernels keep Q and the O accumulator of a warp's rows in registers, as
#: FlashAttention does, up to 256.
CPU_MAX_HEAD_DIM = 576
GPU_MAX_HEAD_DIM = 256
MAX_HEAD_DIM = CPU_MAX_HEAD_DIM  # of any target

# CPU tiles: Br a multiple of 4 (the kernels pad a tile's rows to 4), Bc a multiple of 32 floats
# (a whole number of vectors at every ISA's width).
CPU_ROW_BLOCK = 4
CPU_COL_MULTIPLE = 32
# The micro-kernel's register block (include/attncc/cpu/primitives.h `gemm_block`): at most 8
# rows, 1, 2 or 4 vectors (powers of two divide Bc and the padded head dims evenly), and at least
# FMA latency x ports accumulators so the FMA pipes never wait on a result.
CPU_GEMM_MAX_ROWS = 8
CPU_GEMM_VECS = (1, 2, 4)
CPU_FMA_LATENCY = 4
# Beside the accumulators, the block's B vectors and one broadcast of A stay in registers: a block
# that leaves them fewer reloads B from memory for every row. Measured on Zen 3 (AVX2, 16
# registers; d=64, Bc=128 tile products, GFLOP/s per core, bench-style harness): 4x2 39-46,
# 4x3 50-58, 3x4 (B reloaded) 56-69, 6x2 69-81.
# The micro-kernel streams the packed K^T panel (d x Bc fp32) once per row block, so the panel
# should stay in L1: Bc <= L1_FRACTION * L1 / (4 d), and at most CPU_MAX_BC. Measured
# (bench/bench_cpu.py --sweep, dense fwd N=2048, GFLOP/s): a 48 KiB-L1 AVX-512 machine, d=64:
# Bc=128 210, Bc=256 (64 KiB panel) 77; Zen 3 (32 KiB L1, AVX2, packed panels), d=64, Br=64:
# Bc=32 74, 64 80, 128 85, 256 82; d=128: Bc=32 79, 64 80, 128 89, 256 88.
CPU_L1_FRACTION = 1.0
CPU_MAX_BC = 128
# Rows per task: more rows reuse each K/V tile more, but fewer tasks balance worse over cores.
CPU_MAX_BR = 64
# ... except where a kv head's packed K/V panels (M x 2d fp32) outgrow L2: each task then
# streams them from L3 or memory once, so the forward takes this many rows per task (a multiple
# of the 6-row gemm block). Measured on Zen 3 (dense fwd fp32, ratio to SDPA, Br 64 -> 192):
# D=128 N=8192 0.84 -> 0.98, N=4096 1.26 -> 1.40; D=64 N=8192 0.96 -> 1.04, N=4096 0.95 -> 1.06;
# N <= 2048 within noise.
CPU_STREAMING_BR = 192
# bf16 products (AMX tiles, vdpbf16ps): the panels are half the bytes and the products several
# times faster, so the softmax's per-row work dominates and bigger tiles amortise it. Measured
# on Sapphire Rapids (2 cores, AMX, B=1 H=8 N=2048, ms; SDPA 10.8 / 14.3): d=64 Br x Bc = 64x64
# 11.7, 64x96 13.5, 64x128 10.0, 128x128 9.4, 128x256 9.7; d=128 64x128 13.8, 128x128 13.4;
# d=256 64x64 27.1, 128x128 24.4. At N=8192 Br=256 beats 128 by 6-9% (panels from L3).
# With lazy rescaling, the row sums kept in lanes and the short exp2 (templates/cpu), 256 keys
# per tile pay on AMX (fewer per-row, per-tile steps; longer PV products). Measured on the same
# Xeon (ms, SDPA in brackets): d=64 N=512 128x128 0.76, 128x256 0.68 (0.72); N=2048 8.00, 7.45
# (10.0); N=8192 Br=256: Bc=128 104.2, 256 104.0 (159); d=128 N=2048 10.17, 9.73 (13.2); d=256
# N=2048 18.9, 18.0 (23.2). avx512bf16 (vdpbf16ps, Zen 4) keeps 128: not measured with 256.
CPU_BF16_BLOCK = 128
CPU_AMX_BLOCK_COLS = 256
# ... with half the rows per task where d >= 128 on AMX: the task's Q, S, P and O (Br x 2d + 6 Bc
# bytes per row) halve beside the kv head's panels in L2, and twice the tasks balance better.
# Measured on the Sapphire Rapids-class Xeon (bf16 dense fwd, alternating medians, ms, Br = 128
# -> 64 at Bc = 256; SDPA in brackets): d=128 N=512 0.69-0.77 -> 0.66-0.71 (1.06-1.18), N=1024
# 2.74-2.82 -> 2.58-2.64 (4.3-4.5), N=2048 9.78-9.80 -> 9.30-9.64 (16.2-16.5); d=256 N=2048
# 16.3-16.6 -> 15.6-16.1 (24.9-25.4); at d=64 no gain (N=512 and 1024 1-2% slower, 4096 equal).
CPU_AMX_WIDE_HEAD_ROWS = 64
# ... except where a call's mask leaves partial tiles (the predicate evaluated per score, the
# scale not folded into the exponent): from this fraction of its visible tiles on, the AMX
# forward takes CPU_BF16_BLOCK keys per tile (TilePlan.for_partial_tiles). Measured on the Xeon
# (bf16 fwd ms, 128x256 -> 128x128): causal d=64 N=512 0.72 -> 0.55, N=2048 6.23 -> 5.43; d=128
# N=512 0.98 -> 0.83, N=2048 6.92 -> 6.63, N=4096 24.8 -> 24.4 (partial fraction 0.5 .. 0.12);
# sliding window 256 d=64 N=2048 4.15 -> 2.84, d=128 N=4096 11.2 -> 8.0.
CPU_PARTIAL_TILES_FRACTION = 0.1
# The backward of bf16 inputs on AMX takes Br = Bc = this (the fp32 backward's 64 x 64 at d >=
# 128, 64 x 128 below): its accumulating products (dV^T += dO^T P, dK^T += Q^T dS over a key
# tile's query tiles, dQ += dS K) have Br or Bc as their K, and at 64 the tile unit waits on
# loading and storing the fp32 C tiles around 2 steps of K. Measured on the Sapphire
# Rapids-class Xeon (bf16, backward alone, alternating medians, ms): d=64 N=2048 19.8 -> 18.9;
# d=128 N=512 2.62 -> 2.41, N=2048 37.1 -> 30.5; d=256 N=1K 25.4 -> 17.7; causal d=128 N=2048
# 20.4 -> 18.6. (128 x 256 was faster at d >= 128 N=2048, 28.0-28.6, but slower at N=512, 2.52,
# and causal, 19.3; fp32 stays fastest at its own tiles: d=128 N=2048 123 ms, 128 x 128 128.)
CPU_AMX_BACKWARD_BLOCK = 128
# The fused CPU backward (templates/cpu backward_fused: one task per (b, kv head)) sweeps all of
# its task's query tiles (fp32 dQ, Q and dO: 6 MiB at D=64, N=8K) once per key tile. Where they
# outgrow the caches they come from memory on every sweep, and the backward's rate fell with N
# (Zen 5, fp32 D=64, ms: N=2K 48.6, 4K 192, 8K 917 (4.8x), 16K 3870 (4.2x)). From
# CPU_FUSED_SWEEP_ROWS query rows per task on, a sweep takes several key tiles, as many as their
# workspaces (cpu_key_side_bytes) fit L2, at most CPU_MAX_SWEEP_KEY_TILES. Measured on Zen 5
# (1 MiB L2, a 32 MiB L3 shared with other guests; B=1 H=8, backward alone, alternating medians,
# ms, one key tile -> four): fp32 D=64 N=2K 48.6 -> 49.9, 4K 192 -> 202, 6K 425 -> 440, 8K
# 840-918 -> 789-805, 16K 3927 -> 3204; D=128 N=2K 95.5 -> 99.0, 4K 375 -> 396, 6K 888 -> 899,
# 8K 1924 -> 1631, 16K 8166 -> 6459; bf16 D=128 4K 203 -> 216, 8K 1015 -> 898. Rows, not bytes,
# separate the two sides there (D=64 N=8K, 6 MiB, gains; D=128 N=6K, 9 MiB, loses). Two key
# tiles: 16K D=64 3428, D=128 6836; eight: D=64 16K 3067 against four's 3168.
CPU_FUSED_SWEEP_ROWS = 8192
CPU_MAX_SWEEP_KEY_TILES = 4
CPU_BF16_STREAMING_BR = 256
# CPU forwards of few query rows per kv head (N x group: decoding, speculative decoding's
# drafts, a short chunk of a prompt against a long cache) read K and V rows where they are
# stored, the scores by dot products (templates/cpu forward_decode, TilePlan.reads_by_rows),
# instead of packing K^T and V panels per kv head for tile products: with so few rows the
# packing (a copy of K and V) costs more than the products save. Measured on the Sapphire
# Rapids-class Xeon (B=8, M=4096, D=128, alternating medians, ms, panels -> by rows): fp32 GQA
# 32/8 N=4 46.1 -> 16.6, N=8 55.2 -> 24.1, N=16 68.8 -> 41.8, N=32 88.6 -> 95.5; MHA N=16
# 39.2 -> 15.7, N=64 71.7 -> 39.0; D=64 MHA N=8 10.2 -> 4.5, N=32 15.1 -> 12.2. bf16 on AMX
# (whose tile products are ~5x the FMAs'): MHA N=4 13.1 -> 6.8, N=8 13.3 -> 9.7 (D=64 4.65 ->
# 4.78), N=16 12.9 -> 15.5; GQA 32/8 N=8 18.0 -> 28.8; fewer than CPU_DECODING_QUERIES queries
# by rows whatever the group: GQA 32/4 N=2 11.6 -> 7.4, N=3 10.9 -> 10.7, MQA 32/1 N=1 6.5 -> 3.4.
# `vdpbf16ps` multiplies at ~2x the FMAs' rate, not AMX's ~5x, so by rows pays there up to 16
# rows. Zen 5 (avx512bf16, D=128 M=4096, medians of 9, ms, panels -> by rows): bf16 GQA 32/8
# B=8 N=4 (16 rows) 11.4 -> 8.7, MHA N=16 43.5 -> 34.2; 32 rows stay panels: GQA N=8 13.4 ->
# 15.1, MHA N=32 53.3 -> 60.6 (B=1 M=16384 GQA N=8 10.8 -> 8.0, the one exception: 8 tasks);
# fp32 there confirms 64: 64 rows 52.0 -> 32.5, 128 rows 71.6 -> 101.5.
# On AVX-512 (and AVX2, below), from 48 rows per kv head each key tile is transposed into K^T
# strips as it is read (templates/cpu kTransposedKeyRows) and S comes from gemm's register blocks
# instead of dot products; by rows then pays up to 512 rows, where panels (K/V of a kv head packed per call,
# re-read by every query head's task) cost more. Zen 5, M=4096, ms, panels -> by rows: fp32 GQA
# 32/8 B=8 D=128 N=32 (128 rows) 73.2 -> 44.4, N=64 (256) 113.0 -> 81.3; fp16 N=32 54.6 -> 44.0,
# N=64 95.0 -> 82.4; D=64 N=32 29.2 -> 22.8, N=64 48.4 -> 41.3; GQA 64/8 B=2 N=64 (512 rows)
# D=128 44.8 -> 40.4, D=256 107.5 -> 87.8, fp16 47.7 -> 39.3.
# AVX2 (8 x 8 transposes): the same measured with the avx2 level forced on Zen 5 (Zen 3, AVX2's
# machine, unmeasured), fp32 N=16 (64 rows) 48.6 -> 43.9 ms, fp16 48.7 -> 43.0, N=12 (48) 35.2 ->
# 33.8; panels -> by rows: N=32 (128 rows) 124.1 -> 78.1, bf16 117.8 -> 79.5, N=64 (256) 208.3 ->
# 155.3; up to 256 rows there: Zen 3's L2 (512 KiB) holds 256 rows' Q, O and S at d = 128.
CPU_DOT_PRODUCT_ROWS = {64: 512, 32: 256}  # by vector bytes (the kernels' vector width); 64 elsewhere
CPU_NARROW_DOT_PRODUCT_ROWS = 64
# Fewer rows than this per kv head keep dot products (dot_rows): a tile's transpose costs more
# than gemm saves at 32 rows (GQA 32/8 B=8 N=8 15.2 -> 18.3 ms), 48 rows gain 1.05x, 64 1.20x.
CPU_TRANSPOSED_KEY_ROWS = 48
# bf16 on `vdpbf16ps`: by rows up to 512 rows too, from 9 rows per kv head (below) each key tile
# packed as the panels are (pair-packed K^T and V) for the tile products, the next tile's rows
# prefetched meanwhile. Zen 5, GQA 32/8 M=4096 D=128, ms, panels -> by rows: B=8 N=6 (24 rows)
# 12.8 -> 9.0, N=8 (32) 13.2 -> 8.7, N=16 (64) 17.8 -> 12.5, N=32 (128) 27.5 -> 22.0, N=64 (256)
# 46.9 -> 41.0; GQA 64/8 B=2 N=64 (512) 21.1 -> 19.9. AMX keeps 8 rows (by rows beyond is
# unmeasured there: no AMX machine at hand since).
CPU_BF16_DOT_PRODUCT_ROWS = {"amx": 8, "dpbf16": 512}  # by CpuIsa.bf16_products
# From 9 rows the packed tiles beat the dot products at every count but the bf16 dot blocks' own 16
# (4 x 4-row blocks, kBf16Dots: 16 rows stay dot products): Zen 5, GQA B=8 M=4096 D=128, ms, dot
# products -> packed tiles: 10 rows 7.6 -> 6.7, 12 7.6 -> 6.6 (and 7.1 -> 6.6), 14 9.5 -> 7.0, 15
# 10.4 -> 6.5; 16 rows 6.2 / 6.0 / 6.1 -> 6.6 / 6.5 / 7.1 (kept), 8 rows 5.3 -> 5.4 (kept).
CPU_BF16_TRANSPOSED_KEY_ROWS = {"dpbf16": 9}
CPU_BF16_KEPT_DOT_ROWS = {"dpbf16": 16}
CPU_DECODING_QUERIES = 4
# Keys per tile when decoding from kv heads side by side in each key row (TilePlan
# for_side_by_side_decoding): one vector of fp32 lanes, the softmax's smallest row.
CPU_SIDE_BY_SIDE_DECODING_BC = 16
# Where the kv heads lie side by side and the scores come from tile products by rows
# (`transposes_keys`), a task takes several kv heads of a sequence as segments (templates/cpu
# forward_decode, kSideBySideTileProductRows) up to this many query rows per kv head. Zen 5, GQA
# 32/8 B=8 M=4096 D=128 from a [B, M, Hkv, D] view, against a kv head per task, fp32 / bf16:
# N = 16 1.08 / 1.06x, N = 32 1.04 / 1.03x, N = 64 1.02 / 1.00x; 512 rows a kv head (GQA 64/8
# B=2 N=64) 1.00 / 0.99x with 8x the task's buffers.
CPU_SIDE_BY_SIDE_TILE_PRODUCT_ROWS = 256
# A call with fewer keys than Bc takes key tiles of its key count rounded up to this many
# (TilePlan.for_few_keys): one vector of fp32 lanes; AMX's P V products take 32 keys per tile
# (CPU_AMX_KEY_STEP). Measured on Zen 4 (fp32 / bf16 fwd, B=64 H=8 N=M=16 D=64): Bc = 128
# 4.72 / 1.45 ms, 32 1.43 / 0.48, 16 1.04 / 0.34 (SDPA 1.0-1.9 / 1.4-1.8).
CPU_FEW_KEYS_STEP = 16
CPU_AMX_KEY_STEP = 32


class NoFit(Exception):
    """No tiling of this head dimension fits the target (internal to the pass)."""


@dataclass(frozen=True)
class TilePlan:
    """Tiles for one (padded) head dimension."""

    head_dim: int
    block_rows: int  # Br
    block_cols: int  # Bc
    paper_block_rows: int
    paper_block_cols: int
    threads: int  # per block, the largest of the plan's kernels (GPU), or vector lanes used per row (CPU)
    warps: int
    stages: int
    onchip_bytes: int
    registers_per_thread: int
    reason: str
    #: The backward kernels' tiles (on GPUs they need more shared memory per tile than the
    #: forward, so they may be smaller); None where no backward tiling fits the target.
    backward: TilePlan | None = None
    #: GPU backward: the last columns of each warp's dV accumulator held in registers, where
    #: fp32 dK and dV do not both fit the shared memory (a multiple of 16; 0: all shared).
    dv_register_columns: int = 0
    #: GPU backward: the same for dK (d where FlashAttention-2-style register accumulators fit).
    dk_register_columns: int = 0
    #: CPU forward: from this many keys on, a kv head's K/V panels outgrow L2 and a task takes
    #: `streaming_block_rows` query rows (0: never).
    streaming_keys: int = 0
    streaming_block_rows: int = 0
    #: CPU forward of bf16 inputs on a level with bf16 tile products (AMX, vdpbf16ps): its own
    #: Br x Bc and streaming Br (0: the plan's).
    bf16_block_rows: int = 0
    bf16_block_cols: int = 0
    bf16_streaming_block_rows: int = 0
    #: CPU forward of bf16 inputs on a level with bf16 tile products: its `dot_product_rows` and
    #: `transposed_key_rows` and `kept_dot_rows`.
    bf16_dot_product_rows: int = 0
    bf16_transposed_key_rows: int = 0
    bf16_kept_dot_rows: int = 0
    #: CPU backward of bf16 inputs on AMX: Br = Bc = this (0: the plan's).
    bf16_backward_block: int = 0
    #: CPU fused backward: key tiles per sweep over a task's query tiles where those outgrow the
    #: caches (`key_tiles_per_sweep`; 1: one).
    sweep_key_tiles: int = 1
    #: CPU forward: calls of at most this many query rows per kv head read K and V by rows
    #: (`reads_by_rows`; 0: a GPU plan, never).
    dot_product_rows: int = 0
    #: CPU by-rows forward: from this many query rows per kv head, K^T tiles and gemm
    #: (`cpu_transposed_key_rows`; 0: never), but at exactly `kept_dot_rows` rows (0: none).
    transposed_key_rows: int = 0
    kept_dot_rows: int = 0
    #: GPU forward: query rows per warp, 16 (one mma row block) or 32 (two, each K and V
    #: fragment read from shared memory feeding both: FlashAttention-2's layout).
    warp_rows: int = 16
    #: GPU forward: warps sharing each row block, each taking Bc / key_warps consecutive keys of
    #: every K/V tile with its own softmax state, merged at the end (`for_key_split_warps`).
    key_warps: int = 1
    #: GPU paged forward: each thread copies rows of one 16-row group of a K/V tile from its
    #: page (one block-table entry per thread and tile, no per-row starts and no barrier; pages
    #: of a multiple of 16 rows). The decoding forwards only (`for_key_split_warps`), whose
    #: registers leave room for it: prefill forwards at 255 registers spilled up to 140 B with it.
    page_group_copies: bool = False

    def key_tiles_per_sweep(self, query_rows: int) -> int:
        """CPU fused backward: the key tiles each sweep over a task's `query_rows` query rows
        (its group's heads x N) takes: `sweep_key_tiles` from CPU_FUSED_SWEEP_ROWS on, else one."""
        return self.sweep_key_tiles if query_rows >= CPU_FUSED_SWEEP_ROWS else 1

    def for_bf16_products(self) -> TilePlan:
        """The forward's tiles where its products run on the CPU's bf16 unit (codegen/cpu.py
        `bf16_products`: bf16 inputs, and fp16 as bf16 terms on AMX), and the fewer query rows
        it reads K and V by rows for (CPU_BF16_DOT_PRODUCT_ROWS of the unit)."""
        if self.bf16_block_rows:
            return replace(
                self, block_rows=self.bf16_block_rows, block_cols=self.bf16_block_cols,
                streaming_block_rows=self.bf16_streaming_block_rows, dot_product_rows=self.bf16_dot_product_rows,
                transposed_key_rows=self.bf16_transposed_key_rows, kept_dot_rows=self.bf16_kept_dot_rows,
                backward=self.backward or self,
            )  # fmt: skip
        return self

    def reads_by_rows(self, queries: int, group: int) -> bool:
        """CPU forward: whether a call of `queries` query rows per (b, head), `group` query heads
        per kv head, reads K and V rows where they are stored (templates/cpu forward_decode: a
        task per kv head's group, scores by dot products) rather than packing panels for tile
        products: below CPU_DECODING_QUERIES queries, or at most `dot_product_rows` rows per kv
        head, as long as the rows fit one query tile (the tile classes' rows)."""
        if not self.dot_product_rows or queries > self.block_rows:
            return False
        return queries < CPU_DECODING_QUERIES or queries * group <= self.dot_product_rows

    def transposes_keys(self, queries: int, group: int) -> bool:
        """Whether a by-rows CPU forward of `queries` rows per head, `group` heads per kv head (a
        task of a group's heads), takes S from tile products: on K^T tiles, or with bf16
        products on packed key tiles (templates/cpu tile_products_by_rows)."""
        return 0 < self.transposed_key_rows <= queries * group != self.kept_dot_rows

    def for_bf16_backward(self) -> TilePlan:
        """The backward's tiles where its products run on AMX (bf16 inputs; an fp16 backward
        widens to fp32 and keeps the plan's): CPU_AMX_BACKWARD_BLOCK square."""
        if self.bf16_backward_block:
            block = self.bf16_backward_block
            return replace(self, block_rows=block, block_cols=block, backward=self.backward or self)
        return self

    def for_pages(self, page_size: int, dot_products: bool) -> TilePlan:
        """The forward's tiles for keys read through a page table (CPU paged calls): Bc divides
        the page size, so no key tile straddles two pages and its rows are read where they
        are, and is a whole number of vectors (the softmax's rows; 16 fp32 lanes), of 32 keys
        where the scores come from tile products (their key step: panels, and by rows where
        `transposes_keys`), 16 where they come from dot products (`dot_products`): the largest such
        divisor up to the plan's Bc. Where there is none (pages of 5 keys, of 16 under tile
        products) the plan's: a tile's rows are copied page by page (templates/cpu key_source)
        as the kernel reads them. (Zen 5, fp32 GQA 32/8 B=8 N=16 M=4096 D=128, pages of 16,
        shuffled: transposed K tiles of 16 keys 49.9 ms, of 64 copied by pages 36.3.)"""
        step = 16 if dot_products else 32
        fitting = [c for c in range(step, min(page_size, self.block_cols) + 1, step) if page_size % c == 0]
        return replace(self, block_cols=fitting[-1], backward=self.backward or self) if fitting else self

    def for_side_by_side_decoding(self) -> TilePlan:
        """The forward's tiles for decoding (`reads_by_rows`) where the kv heads lie side by side in each
        key row (K as [B, M, Hkv, D]: a paged cache, a transposed view) and a task reads several
        kv heads' parts of every row (templates/cpu forward_decode): key tiles of one vector of
        keys, so the rows one tile touches, each in its own 4 KiB page, stay few while the task
        goes through its kv heads. fp32 decode B=8 H=32/8 M=4096 D=128 from a [B, M, Hkv, D]
        view: 31 ms with Bc = 64, 27 with 32, 19 with 16."""
        return replace(self, block_cols=CPU_SIDE_BY_SIDE_DECODING_BC, backward=self.backward or self)

    def for_partial_tiles(self, fraction: float) -> TilePlan:
        """The forward's tiles for a call where `fraction` of the visible tiles are partial:
        the AMX forward's wide key tiles narrow to CPU_BF16_BLOCK from
        CPU_PARTIAL_TILES_FRACTION on (halving the area its masked edges waste), with at least
        CPU_BF16_BLOCK rows (the wide heads' 64-row tiles measured for 256 keys only: causal
        bf16 d=128 N=2048 took 6.0 ms in 128 x 128 tiles, 6.45 in 64 x 128)."""
        if self.block_cols <= CPU_BF16_BLOCK or fraction < CPU_PARTIAL_TILES_FRACTION:
            return self
        rows = max(self.block_rows, CPU_BF16_BLOCK)
        return replace(self, block_rows=rows, block_cols=CPU_BF16_BLOCK, backward=self.backward or self)

    def for_few_keys(self, m: int, key_step: int) -> TilePlan:
        """The forward's tiles for a call with `m` keys, fewer than Bc: Bc = m rounded up to
        `key_step`, so that a short sequence's panels and tile products are not padded to Bc."""
        fitted = max(key_step, -(-m // key_step) * key_step)
        return self if fitted >= self.block_cols else replace(self, block_cols=fitted, backward=self.backward or self)

    def for_short_queries(self) -> TilePlan:
        """A GPU forward plan narrowed to GPU_SHORT_QUERY_ROWS query rows (its warps with it,
        Bc kept) and without a backward: the forward of calls that have no more rows than that
        per (batch, head), a GQA group's query heads folded in (decoding). Where the plan has
        no more rows, itself without its backward."""
        rows = min(self.block_rows, GPU_SHORT_QUERY_ROWS)
        if rows == self.block_rows:
            return replace(self, backward=None)
        warps = rows // self.warp_rows
        return replace(
            self, block_rows=rows, warps=warps, threads=warps * 32, backward=None,
            onchip_bytes=gpu_shared_bytes(rows, self.block_cols, self.head_dim, self.stages),
            reason=f"{self.reason}; {rows} rows for calls of at most {rows} query rows (decoding)",
        )  # fmt: skip

    def for_key_split_warps(
        self, rows: int = 16, target: Target | None = None, kv_stages: int | None = None
    ) -> TilePlan:
        """A GPU forward plan for calls of at most `rows` (16 or 32) query rows per (batch,
        head), a GQA group's query heads folded in (decoding, speculative decoding): `rows` / 16
        row blocks of 16 rows, each shared by up to GPU_KEY_WARPS / (rows / 16) warps that take
        Bc / key_warps consecutive keys of every K/V tile (Bc kept) with their own running max,
        sum and O, merged through shared memory at the end (flash-decoding inside the block:
        FlashInfer's decode kernels split keys over warps the same way). Forward only. K/V
        buffers: `kv_stages` (2 or 3) where given, else with `target` GPU_DECODING_STAGES where
        its cp.async and a block's shared memory take them (`decoding_stages`)."""
        if rows not in GPU_KEY_SPLIT_ROWS:
            raise AttnccError(f"key-split forwards take {GPU_KEY_SPLIT_ROWS} rows, not {rows}")
        if kv_stages not in (None, GPU_STAGES, GPU_DECODING_STAGES):
            raise AttnccError(
                f"key-split forwards take {GPU_STAGES} or {GPU_DECODING_STAGES} K/V stages, not {kv_stages}"
            )
        row_blocks = rows // GPU_ROWS_PER_WARP
        most = GPU_KEY_WARPS // row_blocks
        key_warps = max(w for w in range(1, most + 1) if self.block_cols % (16 * w) == 0)
        warps = row_blocks * key_warps
        stages = kv_stages or (
            self.stages if target is None else decoding_stages(target, rows, self.block_cols, self.head_dim)
        )
        return replace(
            self, block_rows=rows, warp_rows=GPU_ROWS_PER_WARP, key_warps=key_warps, warps=warps,
            threads=warps * 32, backward=None, page_group_copies=True, stages=stages,
            onchip_bytes=gpu_shared_bytes(rows, self.block_cols, self.head_dim, stages),
            registers_per_thread=gpu_registers(self.block_cols // key_warps, self.head_dim),
            reason=f"{self.reason}; {rows} rows, {key_warps} warp(s) sharing each key tile per 16 rows (decoding)",
        )  # fmt: skip

    def for_keys(self, m: int) -> TilePlan:
        """The forward's tiles for a call with `m` keys."""
        if self.streaming_block_rows and m >= self.streaming_keys:
            return replace(self, block_rows=self.streaming_block_rows, backward=self.backward or self)
        return self


@dataclass(frozen=True)
class CpuMicroKernel:
    """The CPU kernels' instruction set and gemm register block, chosen from the target's facts;
    part of the IR, so of the kernel's cache key."""

    isa: str
    vector_bytes: int
    rows: int
    vecs: int
    compile_flags: tuple[str, ...]
    bf16_products: str = ""  # targets.CpuIsa.bf16_products: "amx", "dpbf16" or "" (widened to fp32)

    def describe(self) -> str:
        products = {"amx": ", bf16 products on AMX tiles", "dpbf16": ", bf16 products by vdpbf16ps"}
        return (
            f"ISA {self.isa} ({8 * self.vector_bytes}-bit vectors{products.get(self.bf16_products, '')}), "
            f"gemm block {self.rows} rows x {self.vecs} vectors"
        )


@dataclass(frozen=True)
class TilingTable:
    """Plans per head dim (rounded up to 16); None where no tiling fits the target."""

    target: str
    plans: tuple[TilePlan | None, ...]
    micro_kernel: CpuMicroKernel | None = None  # CPU targets only
    #: GPU tables whose plans took warps of 32 rows by default: the plans at 16 rows, from which
    #: the forwards of short calls start (`for_short_queries`, `for_key_split_warps`: decoding
    #: was timed on them; at d <= 64 their key tiles are twice as wide). Empty: from `plans`.
    short_call_plans: tuple[TilePlan | None, ...] = ()

    @property
    def max_head_dim(self) -> int:
        """The largest head dim the table plans (CPU_MAX_HEAD_DIM, GPU_MAX_HEAD_DIM)."""
        return len(self.plans) * HEAD_DIM_STEP

    def for_head_dim(self, d: int, backward: bool = False) -> TilePlan:
        """The forward plan for head dim `d` (its `backward` field holds the backward's), or with
        `backward` the backward kernels' plan."""
        if not 1 <= d <= self.max_head_dim:
            raise AttnccError(f"head dim {d} outside [1, {self.max_head_dim}] (target {self.target})")
        plan = self.plans[self._slot(d)]
        if plan is None:
            raise AttnccError(f"head dim {d}: no tiling fits the on-chip memory of target {self.target}")
        if not backward:
            return plan
        if plan.backward is None:  # GPU plans only: the CPU backward uses the forward's tiles
            half = plan.head_dim // 2
            smallest = gpu_backward_shared_bytes(GPU_ROWS_PER_WARP, GPU_ROWS_PER_WARP, plan.head_dim, half)
            raise AttnccError(
                f"head dim {d}: the forward runs on target {self.target}, but no backward tiling fits its on-chip "
                f"memory (the smallest backward, 16 x 16 tiles with {half} dV columns in registers, needs {smallest} B "
                "of shared memory); run the backward on a target with more shared memory"
            )
        return plan.backward

    @staticmethod
    def _slot(d: int) -> int:
        """The plan of head dim `d`: one per HEAD_DIM_STEP head dims."""
        return math.ceil(d / HEAD_DIM_STEP) - 1

    def with_backward(self, d: int, backward: TilePlan) -> TilingTable:
        """The table with `backward` as the backward's tiles at head dim `d` (a GPU plan of
        `backward_candidates`: bench/sweep_tiles_cuda.py times them against each other)."""
        plans = list(self.plans)
        plans[self._slot(d)] = replace(self.for_head_dim(d), backward=backward)
        return replace(self, plans=tuple(plans))

    def for_short_queries(self) -> TilingTable:
        """GPU tables: every plan `TilePlan.for_short_queries` (forward only); CPU tables as they are."""
        return self._with_gpu_plans(TilePlan.for_short_queries)

    def for_key_split_warps(self, rows: int = 16, kv_stages: int | None = None) -> TilingTable:
        """GPU tables: every plan `TilePlan.for_key_split_warps(rows, target, kv_stages)`
        (forward only); CPU tables as they are."""
        target = get_target(self.target)
        return self._with_gpu_plans(lambda plan: plan.for_key_split_warps(rows, target, kv_stages))

    def _with_gpu_plans(self, retile: Callable[[TilePlan], TilePlan]) -> TilingTable:
        if self.micro_kernel is not None:  # (a CPU table: its plans serve every call)
            return self
        plans = self.short_call_plans or self.plans
        return replace(self, plans=tuple(p and retile(p) for p in plans), short_call_plans=())

    def describe(self, d: int = 64) -> str:
        p = self.for_head_dim(d)
        if self.micro_kernel is not None:
            layout = f"{self.micro_kernel.describe()}, one task per (b, h, query tile)"
        else:
            rows = (
                f"{p.warp_rows} rows" if p.key_warps == 1 else f"{p.warp_rows} rows, {p.block_cols // p.key_warps} keys"
            )
            layout = (
                f"{p.warps} warps of {rows} ({p.threads} threads), {p.stages} K/V stage(s), "
                f"~{p.registers_per_thread} registers/thread"
            )
        b = p.backward
        backward = (
            "no backward tiling fits"
            if b is None
            else "backward: same tiles"
            if (b.block_rows, b.block_cols) == (p.block_rows, p.block_cols)
            else f"backward: Br={b.block_rows} Bc={b.block_cols}"
        )
        backward += f", on-chip {b.onchip_bytes} B" if b is not None and b.onchip_bytes != p.onchip_bytes else ""
        backward += f" ({b.reason.rsplit('; ', 1)[-1]})" if b is not None and b.reason != p.reason else ""
        return (
            f"{self.target} d={p.head_dim}: Br={p.block_rows} Bc={p.block_cols} (paper: Br={p.paper_block_rows} "
            f"Bc={p.paper_block_cols}); {layout}; on-chip {p.onchip_bytes} B; {backward}; {p.reason}"
        )


def paper_blocks(onchip_elements: int, d: int) -> tuple[int, int]:
    """(Br, Bc) from Algorithm 1: Bc = ceil(M / 4d), Br = min(Bc, d)."""
    bc = math.ceil(onchip_elements / (4 * d))
    return min(bc, d), bc


def tile(g: Graph, target: Target, override: tuple[int, int] | None = None, warp_rows: int | None = None) -> Graph:
    """Attach a `TilingTable` for `target` to the fused node.

    Guarantees: for every head dim, Br and Bc are positive multiples of the kernel's row and
    column granularity and the plan's on-chip bytes fit the target (`onchip_bytes`); on GPUs
    the register estimate is at most the per-thread limit. `override` = (Br, Bc) replaces the
    choice (validated the same way). `warp_rows` (GPU targets): query rows per warp of the
    forward, 16 or 32 (`TilePlan.warp_rows`), Br a multiple of it; None: `plan_gpu` chooses
    (32 on targets in GPU_WIDE_WARP_TARGETS unless the forward is register-heavy).
    """
    if warp_rows is not None and (
        warp_rows not in GPU_WARP_ROWS or (target.kind == "cpu" and warp_rows != GPU_ROWS_PER_WARP)
    ):
        raise AttnccError(f"warp_rows: expected one of {GPU_WARP_ROWS} (GPU targets only), got {warp_rows!r}")
    g = clone(g)
    node, op = fused_node(g)
    heavy, light = register_heavy_forward(op), is_light_backward(op)

    def plan_or_none(d: int, rows: int | None = warp_rows) -> TilePlan | None:
        try:
            if target.kind == "cpu":
                return plan_cpu(target, d, override)
            return plan_gpu(target, d, override, rows, heavy_forward=heavy, light_backward=light)
        except NoFit:
            return None

    limit = CPU_MAX_HEAD_DIM if target.kind == "cpu" else GPU_MAX_HEAD_DIM
    dims = range(HEAD_DIM_STEP, limit + 1, HEAD_DIM_STEP)
    plans = tuple(plan_or_none(d) for d in dims)
    if all(p is None for p in plans):
        raise AttnccError(f"no tiling fits target {target.name}" + (f" with tiles {override}" if override else ""))
    micro_kernel = choose_micro_kernel(target) if target.kind == "cpu" else None
    short_call_plans: tuple[TilePlan | None, ...] = ()
    if warp_rows is None and any(p is not None and p.warp_rows != GPU_ROWS_PER_WARP for p in plans):
        short_call_plans = tuple(plan_or_none(d, GPU_ROWS_PER_WARP) for d in dims)
    g.nodes[node]["op"] = replace(op, tiling=TilingTable(target.name, plans, micro_kernel, short_call_plans))
    return g


def register_heavy_forward(op: FusedAttention) -> bool:
    """Whether the forward needs registers beyond the fragments: a score expression that reads
    the score's own positions (i, j: ALiBi, relative position tables), dropout (its
    counter-based random bits per score) or rotary embeddings (applied as the Q and K tiles
    load). ptxas on sm90, bf16, warps of 32 rows: the first two spill 88-160 B at d = 64 where
    the other examples spill none, relative_bias 584 B at d = 128; the rope test program 92 B."""
    return bool(op.dropout) or bool({"i", "j"} & free_vars(op.score)) or op.q_rope is not None or op.k_rope is not None


def choose_micro_kernel(target: Target) -> CpuMicroKernel:
    """The gemm register block for the target's ISA: the most accumulators (rows x vecs) that
    fit its vector registers beside the vecs B vectors and one broadcast (and no fewer than FMA
    latency x ports), ties broken by the fewest loads per FMA ((rows + vecs) / (rows x vecs)).
    A CPU target written without ISA facts gets the portable level's."""
    if not target.isa:
        generic = CPU_ISAS["generic"]
        target = replace(
            target, isa=generic.name, vector_bytes=generic.vector_bytes, vector_registers=generic.vector_registers,
            fma_ports=2, compile_flags=NATIVE_FLAGS,
        )  # fmt: skip
    candidates = [
        (rows, vecs)
        for rows in range(1, CPU_GEMM_MAX_ROWS + 1)
        for vecs in CPU_GEMM_VECS
        if CPU_FMA_LATENCY * target.fma_ports <= rows * vecs <= target.vector_registers - vecs - 1
    ]
    if not candidates:
        raise AttnccError(f"target {target.name}: {target.vector_registers} vector registers hold no gemm block")
    rows, vecs = max(candidates, key=lambda rv: (rv[0] * rv[1], -(rv[0] + rv[1]) / (rv[0] * rv[1])))
    bf16_products = CPU_ISAS[target.isa].bf16_products if target.isa in CPU_ISAS else ""
    return CpuMicroKernel(target.isa, target.vector_bytes, rows, vecs, target.compile_flags, bf16_products)


def cpu_key_side_bytes(br: int, bc: int, d: int) -> int:
    """fp32 workspace of one key tile in the fused CPU backward: K^T, V^T and K (d x Bc each),
    the dK and dV accumulators (Bc x d each) and dQ's rows (Br x d), S and dP (Br x Bc)."""
    return 4 * (5 * bc * d + br * d + 2 * br * bc)


def cpu_onchip_bytes(br: int, bc: int, d: int) -> int:
    """fp32 working set of one task: Q, O tiles (Br x d), K^T, V (d x Bc), S (Br x Bc)."""
    return 4 * (2 * br * d + 2 * bc * d + br * bc)


def cpu_transposed_key_rows(vector_bytes: int, bf16_unit: str = "") -> int:
    """By-rows CPU forwards (`TilePlan.reads_by_rows`): from how many query rows per kv head a
    key tile is transposed into gemm's K^T strips as it is read, S then by gemm (0: never: the
    transposes run in registers on AVX-512 and AVX2, 16 x 16 and 8 x 8, word by word below); for a
    forward whose products run on `bf16_unit`, from how many each key tile is packed as panels
    are for its tile products."""
    if bf16_unit:
        return CPU_BF16_TRANSPOSED_KEY_ROWS.get(bf16_unit, 0)
    return CPU_TRANSPOSED_KEY_ROWS if vector_bytes >= 32 else 0


def plan_cpu(target: Target, d: int, override: tuple[int, int] | None = None) -> TilePlan:
    elements = target.onchip_bytes // 4
    paper_br, paper_bc = paper_blocks(elements, d)
    if override is not None:
        br, bc = override
        reason = "override"
        if br % CPU_ROW_BLOCK or bc % CPU_COL_MULTIPLE or br <= 0 or bc <= 0:
            raise AttnccError(
                f"CPU tiles must be positive with Br % {CPU_ROW_BLOCK} == 0 and Bc % {CPU_COL_MULTIPLE} == 0, got {override}"
            )
    else:
        l1_bc = int(CPU_L1_FRACTION * target.l1_bytes) // (4 * d)
        bc = max(CPU_COL_MULTIPLE, min(paper_bc, l1_bc, CPU_MAX_BC) // CPU_COL_MULTIPLE * CPU_COL_MULTIPLE)
        br = max(CPU_ROW_BLOCK, min(CPU_MAX_BR, paper_br) // CPU_ROW_BLOCK * CPU_ROW_BLOCK)
        reason = (
            f"paper's blocks with M = L2; Bc cut so the K^T panel fits {CPU_L1_FRACTION:.0%} of L1 and to at most "
            f"{CPU_MAX_BC}, Br capped at {CPU_MAX_BR}, rounded to multiples of {CPU_ROW_BLOCK} x {CPU_COL_MULTIPLE}"
        )
        while cpu_onchip_bytes(br, bc, d) > target.onchip_bytes and bc > CPU_COL_MULTIPLE:
            bc -= CPU_COL_MULTIPLE
        # whole register blocks of the micro-kernel across Bc: a column tail (Bc = 96 with 64-lane
        # blocks, d = 128 on a 48 KiB L1) runs on fewer accumulators than the FMA pipes need.
        # Sapphire Rapids-class Xeon, fp32 d=128 B=1 H=8, ms (SDPA): N=512 64x96 4.29, 64x64 3.77
        # (3.17); N=2048 64x96 52.5, 64x64 50.7 (48.6).
        micro = choose_micro_kernel(target)
        column_block = micro.vecs * micro.vector_bytes // 4
        if bc > column_block:
            bc = bc // column_block * column_block
        reason += f", whole {column_block}-column register blocks"
    onchip = cpu_onchip_bytes(br, bc, d)
    if onchip > target.onchip_bytes:
        raise NoFit(f"tiles {br}x{bc} need {onchip} B, more than the target's {target.onchip_bytes} B")
    sweep = max(1, min(CPU_MAX_SWEEP_KEY_TILES, target.onchip_bytes // cpu_key_side_bytes(br, bc, d)))
    plan = TilePlan(
        d, br, bc, paper_br, paper_bc, target.vector_bytes // 4, 0, 1, onchip, 0, reason,
        dot_product_rows=CPU_DOT_PRODUCT_ROWS.get(target.vector_bytes, CPU_NARROW_DOT_PRODUCT_ROWS), sweep_key_tiles=sweep,
        transposed_key_rows=cpu_transposed_key_rows(target.vector_bytes),
    )  # fmt: skip
    if override is None:
        plan = replace(
            plan,
            streaming_keys=target.onchip_bytes // (4 * 2 * d) + 1,
            streaming_block_rows=CPU_STREAMING_BR,
            reason=f"{reason}; Br={CPU_STREAMING_BR} in the forward where a kv head's K/V panels outgrow L2; "
            f"the fused backward sweeps {sweep} key tile(s) at a time from {CPU_FUSED_SWEEP_ROWS} query rows per task",
        )
        if target.isa in CPU_ISAS and CPU_ISAS[target.isa].bf16_products:
            unit = CPU_ISAS[target.isa].bf16_products
            amx = unit == "amx"
            cols = CPU_AMX_BLOCK_COLS if amx else CPU_BF16_BLOCK
            rows = CPU_AMX_WIDE_HEAD_ROWS if amx and d >= 128 else CPU_BF16_BLOCK
            backward_block = CPU_AMX_BACKWARD_BLOCK if amx else 0
            plan = replace(
                plan, bf16_block_rows=rows, bf16_block_cols=cols,
                bf16_streaming_block_rows=CPU_BF16_STREAMING_BR, bf16_backward_block=backward_block,
                bf16_dot_product_rows=CPU_BF16_DOT_PRODUCT_ROWS[unit],
                bf16_transposed_key_rows=cpu_transposed_key_rows(target.vector_bytes, unit),
                bf16_kept_dot_rows=CPU_BF16_KEPT_DOT_ROWS.get(unit, 0),
                reason=f"{plan.reason}; bf16 forward {rows}x{cols} (Br={CPU_BF16_STREAMING_BR} streaming)"
                + (f", bf16 backward {backward_block}x{backward_block}" if amx else ""),
            )  # fmt: skip
    return replace(plan, backward=plan)  # the CPU backward re-tiles nothing: same tasks, same tiles


def gpu_fragment_registers(bc: int, d: int, warp_rows: int = 16) -> int:
    """Per-thread registers of the forward's fragments (each warp owns `warp_rows` rows whatever
    Br): the S fragment (rows x Bc fp32 per warp), the O accumulator (rows x d fp32), the Q
    fragments (rows x d halves) where they stay in registers (`q_in_registers`); for warps of
    16 rows counted even where they are re-read per tile (the budget the 16-row plans and
    GPU_MAX_FRAGMENT_REGISTERS were measured with)."""
    blocks = warp_rows // 16
    q_fragments = blocks * d // 4 if q_in_registers(d, warp_rows) or blocks == 1 else 0
    return blocks * (bc // 2 + d // 2) + q_fragments


def q_in_registers(d: int, warp_rows: int = 16) -> bool:
    """Whether the forward holds its warp's Q fragments in registers across key tiles (else
    re-reads them from shared memory per tile): up to Q_IN_REGISTERS_MAX_HEAD_DIM columns of
    16-row blocks (d = 64 for warps of 32 rows)."""
    return d * (warp_rows // 16) <= Q_IN_REGISTERS_MAX_HEAD_DIM


def gpu_registers(bc: int, d: int, warp_rows: int = 16) -> int:
    """Per-thread registers of the forward's live state: its fragments plus ~40 for addressing,
    statistics and loop state. The backward kernels' state is of the same order; ptxas's
    reports are checked by the tests."""
    return gpu_fragment_registers(bc, d, warp_rows) + 40


GPU_ROWS_PER_WARP = 16  # one mma m16n8k16 row block per warp
# Calls of at most this many query rows per (batch, head) run a forward of this many rows where
# the plan's has more. H200, bf16 decoding at d=128, M=16K..64K (session 23, sweep-decode.log):
# Br=64 took 0.855 / 3.36 ms where Br=128 took 1.33 / 5.24 (B=8, H=32), 0.139 against 0.195
# (B=1, best splits of each): all of Br=128's 8 warps but one compute on padding rows, and half
# as many blocks fit an SM (resident_blocks).
GPU_SHORT_QUERY_ROWS = 64
# Calls of at most 16 (32) rows may instead run one (two) row block(s) whose warps split every
# key tile, 4 warps in all (`TilePlan.for_key_split_warps`; opt-in, `kern.key_split_warps`:
# not yet timed on a GPU).
GPU_KEY_WARPS = 4
GPU_KEY_SPLIT_ROWS = (16, 32)
# `tiles=` overrides apply to the forward and the backward alike: the backward keeps one 32-bit
# word of dropout keep bits per lane for 4 x Br / 8 (or, in the dQ kernel, Bc / 8) scores, so
# they go up to 64 (the roofline's backward plans reach Bc = 128 by splitting the dQ kernel's
# key tiles in two).
GPU_MAX_TILE = 64
GPU_STAGES = 2  # the forward template double-buffers K/V: tile n + 1 loads while tile n computes
# The decoding forwards (`for_key_split_warps`) keep two K/V tiles in flight, not one, where a
# block's shared memory takes the third buffer: they run one block per SM
# (GPU_SPLIT_BLOCKS_PER_SM) and stream K/V, and one 32 KiB tile (d = 128, Bc = 64) in flight per
# SM over ~1 us of memory latency is ~32 GB/s per SM, ~4.2 TB/s over 132 SMs: where the H200's
# key-split decoding stood (GQA 32/8 B=8 M=64K 0.522 ms, 4.1 TB/s; SDPA 4.5, session 46). The
# third buffer also takes a barrier per tile off the loop: after the barrier that makes tile n
# visible, every warp is done with tile n - 1, whose buffer takes tile n + 2.
GPU_DECODING_STAGES = 3


def decoding_stages(target: Target, rows: int, cols: int, d: int) -> int:
    """K/V buffers of a decoding forward on `target`: GPU_DECODING_STAGES where it has cp.async
    (sm80+) and a block's shared memory holds them, else GPU_STAGES."""
    fits = gpu_shared_bytes(rows, cols, d, GPU_DECODING_STAGES) <= target.onchip_bytes
    return GPU_DECODING_STAGES if target.sm_version >= 80 and fits else GPU_STAGES


# The forward's candidates: 4 or 8 warps of 16 rows, Bc a multiple of 16 up to 128 (a row's
# dropout keep bits, 2 per 8 keys, fill one 32-bit word), chosen by the roofline estimate at a
# long-prefill problem (the shape FlashAttention's benchmarks report).
GPU_FORWARD_ROWS = (64, 128)
GPU_FORWARD_MAX_BC = 128
# ... and whose fragment state per thread (S: Bc / 2, O: d / 2, Q: d / 4 fp32 registers) is at
# most that of d = 128, Bc = 64, which every example compiles without spills (relative_bias:
# 254 registers on sm90). ptxas on sm90 (bf16, Br = 128): d = 96, Bc = 128 (state 136) spills
# 32 B in alibi; d = 128, Bc = 96 (state 128 + 16) spills 68 B; d = 64, Bc = 128 (state 112)
# compiles at 255 registers without spills (alibi, relative_bias); above d = 128, where Q is
# re-read per tile, d = 144, Bc = 96 spills 112 B on sm80 though its S and O state is 120.
GPU_MAX_FRAGMENT_REGISTERS = 128
# Warps of 32 rows (two row blocks; `warp_rows=32`, GPU_WIDE_WARP_TARGETS' default): S and O of
# Bc = 64, d = 128 (state 192, Q re-read) is about the most ptxas fits on sm90 (CUDA 13.0,
# session 36): vanilla, causal, gqa, gpt_oss no spills, the other masks 24-104 B, alibi 136 B,
# relative_bias 584 B; at d = 64 alibi 116 B, gpt2 88 B, relative_bias 160 B, the others none.
GPU_MAX_TWO_BLOCK_FRAGMENT_REGISTERS = 192
GPU_WARP_ROWS = (16, 32)
# Where the forward's warps take 32 rows unless told (`plan_gpu`): measured on the H100 of
# session 36 (bench/results/cuda-h100-session36.md), bf16, B*N = 64K tokens, N = 4K and 16K,
# forward time at 16 rows / at 32: dense 1.14-1.18x, causal 1.16-1.22x, sliding window
# 1.06-1.33x, softcap 1.05-1.14x at d = 64 and 128, ALiBi 1.03x at d = 128 (the same 128 x 64
# tiles, 136 B of spills) but 0.90x at d = 64 (128 x 64 against 16-row warps' 128 x 128, 116 B
# of spills). Other GPUs keep 16 until measured.
GPU_WIDE_WARP_TARGETS = ("sm90",)
# Bc above 64 only up to d = 64: the mask and score map are unrolled over Bc / 2 scores per
# thread, whose temporaries come on top of the state (d = 80, Bc = 128, state 124: alibi fp16
# spills 16 B on sm80).
GPU_WIDE_BC_MAX_HEAD_DIM = 64
GPU_REFERENCE_PROBLEM = Problem(4, 16, 16, 4096, 4096, 0)
# Above this head dim the Q fragments (d/4 registers per thread) are re-read from shared memory
# for every key tile instead of held in registers (the code generator's choice; the cost model
# counts the reloads): at d=256 holding them pushed ptxas to 255 registers with spills
# (padding.attn: 116 B spill stores).
Q_IN_REGISTERS_MAX_HEAD_DIM = 128


def cheapest(target: Target, problem: Problem, candidates: Iterable[tuple[TilePlan, Work]]) -> TilePlan | None:
    """The candidate plan whose work has the smallest roofline estimate at `problem` (the
    largest term, then the sum of all terms, which overlap imperfectly), its reason prefixed
    with the estimate; None for no candidates."""
    best: tuple[tuple[float, float], TilePlan, Estimate] | None = None
    for plan, work in candidates:
        est = estimate(work, target.name, plan.registers_per_thread)
        key = (est.seconds, sum(est.terms.values()))
        if best is None or key < best[0]:
            best = (key, plan, est)
    if best is None:
        return None
    _, plan, est = best
    why = f"the smallest roofline estimate at {problem} ({1e6 * est.seconds:.0f} us, {est.bound}-bound) {plan.reason}"
    return replace(plan, reason=why)


def fastest_forward(target: Target, d: int, paper_br: int, paper_bc: int, warp_rows: int = 16) -> TilePlan | None:
    """The forward tiles with the smallest roofline estimate (passes/roofline.py `forward_work`)
    at GPU_REFERENCE_PROBLEM among the candidates (warps of `warp_rows` rows) whose shared
    memory, register estimate and fragment state fit; None if none does; None above d = 128
    and for targets without rates in GPU_RATES (plan_gpu's fallback)."""
    if d > Q_IN_REGISTERS_MAX_HEAD_DIM:  # Q reloaded per tile: ptxas's needs outgrow the state (d=144, 128 x 96 spills)
        return None
    if target.name not in GPU_RATES:  # a target row without published rates: plan_gpu's fallback
        return None
    problem = replace(GPU_REFERENCE_PROBLEM, D=d, Dv=d)
    reason = f"of Br in {GPU_FORWARD_ROWS}, Bc in 16..{GPU_FORWARD_MAX_BC} fitting shared memory and registers"
    if warp_rows != GPU_ROWS_PER_WARP:
        reason += f", {warp_rows} rows per warp"
    # (for two row blocks the state bound is the binding one: 192 + 40 leaves no 32 to spare)
    max_state, margin = (
        (GPU_MAX_FRAGMENT_REGISTERS, 32)
        if warp_rows == GPU_ROWS_PER_WARP
        else (GPU_MAX_TWO_BLOCK_FRAGMENT_REGISTERS, 0)
    )

    def candidates() -> Iterator[tuple[TilePlan, Work]]:
        for br in GPU_FORWARD_ROWS:
            for bc in range(16, GPU_FORWARD_MAX_BC + 1, 16):
                shared, registers = gpu_shared_bytes(br, bc, d, GPU_STAGES), gpu_registers(bc, d, warp_rows)
                too_many = (
                    registers > target.max_registers_per_thread - margin
                    or gpu_fragment_registers(bc, d, warp_rows) > max_state
                    or (bc > 64 and d > GPU_WIDE_BC_MAX_HEAD_DIM)
                )
                if shared > target.onchip_bytes or too_many:
                    continue
                warps = br // warp_rows
                plan = TilePlan(
                    d,
                    br,
                    bc,
                    paper_br,
                    paper_bc,
                    warps * target.warp_size,
                    warps,
                    GPU_STAGES,
                    shared,
                    registers,
                    reason,
                    warp_rows=warp_rows,
                )
                yield plan, forward_work(d, br, bc, problem, q_in_registers(d, warp_rows), warp_rows=warp_rows)

    return cheapest(target, problem, candidates())


# The backward's candidates: Br up to 64 (a lane's dropout keep bits for 4 Br / 8 scores fill
# one 32-bit word), a warp per 16 keys up to 8 warps, and the last r columns of each warp's dK
# and dV accumulators in registers (r / 2 + r / 2 registers per thread beside the Br of the S^T
# and dP^T fragments). ptxas on sm90 (bf16, alibi, Bc = 128): d = 64, Br = 64, r = 64 (state
# 128): 245 registers, no spill; d = 128, r = 64: Br = 64 230 registers, no spill; r = 128:
# Br = 16 (state 144) 238, no spill, but Br = 32 (160) spills 16 B and Br = 64 (192) 52 B.
GPU_BACKWARD_ROWS = (16, 32, 48, 64)
# Bc above 64 only where the deterministic dQ kernel can take the key tile in two equal parts
# of at most 64 keys (its score fragments and dropout keep bits are sized for 64).
GPU_BACKWARD_COLS = (16, 32, 48, 64, 96, 128)
GPU_MAX_BACKWARD_STATE = 112
# sm75 (each m16n8k16 issued as two m16n8k8) with the prefetching loop: gpt2 at d = 128, Br = 16,
# r = 96 (state 112) spilled 4 B; 96 keeps Turing spill-free.
GPU_MAX_BACKWARD_STATE_SM75 = 96
# Above d = 64 the budget is 16 lower: with packed batches (the kernels read q_starts/k_starts,
# the dropout counters per sequence) gpt2 at d = 128 spilled 4-16 B on sm75 (Br = 16, r = 80),
# sm80 (Br = 64, r = 48) and sm90 (Br = 64, r = 48) at the budgets above; 16 less is spill-free.
GPU_BACKWARD_STATE_CUT_ABOVE_D64 = 16
# Light programs (`is_light_backward`: no dropout, no score map, no learnable inputs, sink or
# rope) leave more registers to the accumulators: ptxas on sm90 (bf16, CUDA 13.0, session 46)
# at state 112-128 with r = 64: d = 128 48 x 128 245-246 registers, 64 x 128 254-255, 64 x 96
# 253-255; d = 64 64 x 128 237-241, 64 x 96 242-247; none spills (session 49's backward, the
# mma adding into the register columns: 64 x 128 r = 64 214-240 for every light example).
# r = 96 spilled 8-132 B (Br = 32-48), r = 128 40-92 B before session 49. The budget for
# `backward_candidates(..., light=True)`, which the backward sweep times for vanilla and
# causal; where a GPU timed one fastest it is the light programs' default
# (MEASURED_LIGHT_BACKWARD_TILES).
GPU_MAX_LIGHT_BACKWARD_STATE = 128
GPU_MAX_LIGHT_BACKWARD_COLUMNS = 64
# Q/dO buffers of the roofline's backward candidates: the next visible query tile loads while
# this one computes (as FA2's backward); the fallback plans (d > 128, small shared memory) keep one.
GPU_BACKWARD_STAGES = 2
# What ptxas gives the backward kernel (197 to 255 registers at d = 64..128): the estimate's
# occupancy assumes the most.
GPU_BACKWARD_REGISTERS = 255


def backward_candidates(target: Target, d: int, light: bool = False) -> Iterator[tuple[TilePlan, Work]]:
    """The backward's candidate tiles and register accumulator columns whose shared memory and
    fragment state fit `target` at head dim `d` (up to d = 128, targets with rates), each with
    its `backward_work` at GPU_REFERENCE_PROBLEM (bench/sweep_tiles_cuda.py times them); with
    `light`, the larger state of light programs beside them (GPU_MAX_LIGHT_BACKWARD_STATE)."""
    if d > Q_IN_REGISTERS_MAX_HEAD_DIM or target.name not in GPU_RATES:
        return
    state_budget = GPU_MAX_BACKWARD_STATE_SM75 if target.name == "sm75" else GPU_MAX_BACKWARD_STATE
    state_budget -= GPU_BACKWARD_STATE_CUT_ABOVE_D64 if d > 64 else 0

    def fits(br: int, columns: int) -> bool:
        if br + columns <= state_budget:
            return True
        light_fit = br + columns <= GPU_MAX_LIGHT_BACKWARD_STATE and columns <= GPU_MAX_LIGHT_BACKWARD_COLUMNS
        return light and target.name != "sm75" and light_fit

    for br in GPU_BACKWARD_ROWS:
        for bc in GPU_BACKWARD_COLS:
            for columns in range(0, d + 1, HEAD_DIM_STEP):
                shared = gpu_backward_shared_bytes(br, bc, d, columns, columns, GPU_BACKWARD_STAGES)
                if not fits(br, columns) or shared > target.onchip_bytes:
                    continue
                held = "none" if columns == 0 else "all" if columns == d else f"columns {d - columns}..{d - 1}"
                reason = (
                    f"of the backward's candidates fitting shared memory and registers; dK, dV in registers: {held}"
                )
                yield backward_plan(target, d, br, bc, columns, reason)


def backward_plan(target: Target, d: int, br: int, bc: int, columns: int, reason: str) -> tuple[TilePlan, Work]:
    """The two-stage backward plan of Br x Bc tiles with the last `columns` of dK and dV in
    registers (a warp per 16 keys), and its `backward_work` at GPU_REFERENCE_PROBLEM."""
    paper_br, paper_bc = paper_blocks(target.onchip_bytes // 2, d)
    shared = gpu_backward_shared_bytes(br, bc, d, columns, columns, GPU_BACKWARD_STAGES)
    warps = bc // GPU_ROWS_PER_WARP
    plan = TilePlan(
        d, br, bc, paper_br, paper_bc, warps * target.warp_size, warps, GPU_BACKWARD_STAGES, shared,
        GPU_BACKWARD_REGISTERS, reason, dv_register_columns=columns, dk_register_columns=columns,
    )  # fmt: skip
    problem = replace(GPU_REFERENCE_PROBLEM, D=d, Dv=d)
    return plan, backward_work(d, br, bc, problem, (columns, columns), target.name == "sm90")


#: Light plans past GPU_MAX_LIGHT_BACKWARD_STATE for the backward sweep to time (a default only
#: where MEASURED_LIGHT_BACKWARD_TILES names one: sm90 d = 128's 64 x 128 r = 96, session 59):
#: with session 49's backward (the mma accumulating into the register columns) ptxas, sm90
#: bf16, compiles them without spills for vanilla (d = 128: 64 x 128 r = 96 245 registers,
#: 48 x 128 r = 128 255; causal 64 x 128 r = 96 252), where r = 128 at 64 x 128 spills 44 B.
#: Fewer shared dK/dV columns: their read-add-write per tile was the d = 128 backward's most
#: stalled instruction (FADD waiting on LDS, the H200 profile of session 49).
GPU_WIDE_LIGHT_BACKWARD_PLANS: dict[str, dict[int, tuple[tuple[int, int, int], ...]]] = {
    "sm90": {128: ((64, 128, 96), (48, 128, 128))}
}


def wide_light_backward_plans(target: Target, d: int) -> Iterator[tuple[TilePlan, Work]]:
    """GPU_WIDE_LIGHT_BACKWARD_PLANS for `target` at head dim `d`, each with its `backward_work`
    at GPU_REFERENCE_PROBLEM (as `backward_candidates` gives its plans)."""
    for br, bc, columns in GPU_WIDE_LIGHT_BACKWARD_PLANS.get(target.name, {}).get(d, ()):
        reason = (
            f"a wide light plan for the backward sweep (GPU_WIDE_LIGHT_BACKWARD_PLANS); dK, dV in registers: {columns}"
        )
        plan, work = backward_plan(target, d, br, bc, columns, reason)
        assert plan.onchip_bytes <= target.onchip_bytes, (target.name, d, br, bc, columns)
        yield plan, work


#: The backward's (Br, Bc) per target and head dim where a GPU timed its candidates and the
#: roofline ranked them wrongly: its estimates of the six timed lay within 1% (d = 64) and 8%
#: (d = 128) of each other while the clock spread them 1.5x and 2.4x (the H200 of session 46,
#: bf16 B=4 H=16 N=4096, dense and causal,
#: bench/results/cuda-h200-session46/backward/sweep-backward.log). d = 64: 48 x 128 took
#: 5.17 / 3.28 ms where the estimate's 48 x 96 took 6.22 / 3.98 (1.20x); d = 128: 48 x 128 took
#: 9.39 / 5.75 ms where 64 x 96 took 9.95 / 6.05 (1.06x). Their dK/dV register columns stay
#: the estimate's choice (those were the timed plans).
MEASURED_BACKWARD_TILES: dict[str, dict[int, tuple[int, int]]] = {"sm90": {64: (48, 128), 128: (48, 128)}}


#: The same for light programs (`is_light_backward`): (Br, Bc, dK/dV register columns) among
#: `backward_candidates(..., light=True)` and `wide_light_backward_plans`. The H200 of session 49
#: (bf16 B=4 H=16 N=4096, two sweeps 1% apart, bench/results/cuda-h200-session49/sweep-backward.log)
#: timed 64 x 128 with 64 columns in registers fastest at both head dims: dense d = 64 4.17-4.20 ms
#: against 48 x 128's 4.66-4.72 (1.12x), d = 128 7.77-7.79 against 8.77-8.80 (1.13x). Session
#: 59's H200 (bench/results/cuda-h200-session59/serving/sweep-backward.log; backward/ again,
#: within 1.5%) timed session 49's backward changes: at d = 64, 64 x 128 r = 64 still fastest
#: dense (3.95 ms; causal 2.35, 64 x 64 2.34); at
#: d = 128 the wide plans beat it: 64 x 128 with 96 columns in registers 7.06 ms dense against
#: 7.42 (1.05x), causal 4.16 against 4.47 (1.07x); 48 x 128 with all 128 took 6.73 / 4.22 but
#: spills 24-56 B in ptxas (sm90 bf16) for causal, gqa, sliding_window, prefix_lm, strided,
#: local_blocks and blocksparse_butterfly, where 64 x 128 r = 96 spills in none (244-255
#: registers). One entry per head dim.
MEASURED_LIGHT_BACKWARD_TILES: dict[str, dict[int, tuple[int, int, int]]] = {
    "sm90": {64: (64, 128, 64), 128: (64, 128, 96)}
}


def is_light_backward(op: FusedAttention) -> bool:
    """Whether the program's backward is light: the score is the scaled product (no score map,
    so no learnable inputs), no dropout, no rotary embeddings, no sink. Such kernels leave
    the accumulators GPU_MAX_LIGHT_BACKWARD_STATE (ptxas, sm90 bf16, session 49: 64 x 128 with
    r = 64 at d = 128 takes 225 registers for vanilla, no spills); masks (causal, windows,
    documents, block-sparse layouts) are tested only on partial tiles."""
    plain = op.score == ex.score() and not op.dropout and op.sink is None
    return plain and op.q_rope is None and op.k_rope is None


def fastest_backward(target: Target, d: int, light: bool = False) -> TilePlan | None:
    """The backward tiles and register accumulator columns with the smallest roofline estimate
    (`backward_work`) at GPU_REFERENCE_PROBLEM among `backward_candidates`, restricted to the
    tiles MEASURED_BACKWARD_TILES names for this target and head dim where it names fitting
    ones; for a `light` program, first among the light candidates and the wide light plans
    (`wide_light_backward_plans`) with the tiles and register columns that
    MEASURED_LIGHT_BACKWARD_TILES names (light plans without a timing are no default). None
    above d = 128 and for targets without rates (plan_gpu's fallback)."""
    problem = replace(GPU_REFERENCE_PROBLEM, D=d, Dv=d)
    common_plans = list(backward_candidates(target, d))
    tables: list[tuple[str, dict[str, dict[int, tuple[int, ...]]], list[tuple[TilePlan, Work]]]] = []
    if light:
        light_plans = [*backward_candidates(target, d, light=True), *wide_light_backward_plans(target, d)]
        tables.append(("MEASURED_LIGHT_BACKWARD_TILES", MEASURED_LIGHT_BACKWARD_TILES, light_plans))
    tables.append(("MEASURED_BACKWARD_TILES", MEASURED_BACKWARD_TILES, common_plans))
    for name, table, plans in tables:
        measured = table.get(target.name, {}).get(d)
        if measured is None:
            continue
        # (Br, Bc) for every program; light programs' entries name the register columns too
        timed = [
            (plan, work)
            for plan, work in plans
            if (plan.block_rows, plan.block_cols, plan.dk_register_columns)[: len(measured)] == measured
        ]
        if timed:
            chosen = cheapest(target, problem, timed)
            assert chosen is not None
            return replace(chosen, reason=f"the tiles timed fastest on this target ({name}); {chosen.reason}")
    return cheapest(target, problem, common_plans)


def plan_gpu(
    target: Target,
    d: int,
    override: tuple[int, int] | None = None,
    warp_rows: int | None = None,
    heavy_forward: bool = False,
    light_backward: bool = False,
) -> TilePlan:
    """Forward: the candidate (Br, Bc) with the smallest roofline estimate (`fastest_forward`);
    where none fits the registers (d = 256), or with `override`, Br = 16 x 4 warps and Bc from
    the paper's formula capped so the per-thread state fits the register file without spills;
    two K/V stages. Backward: the candidate with the smallest estimate (`fastest_backward`, up
    to d = 128); else (d > 128, targets without rates, `override`) Br = 64 (32 above d = 128), Bc
    from the paper capped at 64 and by registers, one Q/dO buffer, cut separately until its
    larger working set (Q, dO, K, V, dS and fp32 dK, dV) fits, so a small shared memory shrinks
    the backward's tiles without shrinking the forward's; where even 16 x 16 does not fit, the
    fewest dV columns held in registers that make it fit. `warp_rows`: the forward's rows per
    warp (16 or 32; Br a multiple of it); None: 32 on GPU_WIDE_WARP_TARGETS where the forward
    is not register-heavy (`register_heavy_forward`: `heavy_forward`), else 16.
    `light_backward` (`is_light_backward`): the light programs' timed backward plans first."""
    elements = target.onchip_bytes // 2
    paper_br, paper_bc = paper_blocks(elements, d)
    rows_why = ""
    if warp_rows is None:
        wide = override is None and target.name in GPU_WIDE_WARP_TARGETS and not heavy_forward
        warp_rows = 32 if wide else GPU_ROWS_PER_WARP
        if override is None and target.name in GPU_WIDE_WARP_TARGETS:
            rows_why = (
                f" ({target.name}'s default where the score map reads no positions i, j, without dropout and rope)"
                if wide
                else "; 16 rows per warp (the score map reads the positions i, j, or dropout or rotary "
                "embeddings: 32-row warps spill)"
            )
    if override is not None:
        br, bc = override
        reason = "override"
        if br % GPU_ROWS_PER_WARP or bc % 16 or not (0 < br <= GPU_MAX_TILE and 0 < bc <= GPU_MAX_TILE):
            raise AttnccError(
                f"a tiles= override on a GPU target takes Br and Bc in 16, 32, 48 or 64 (multiples of 16 up to "
                f"{GPU_MAX_TILE}), got {override}; the planner's own plans go past 64 (128 x 128 at d = 64 on sm80: "
                "32-row warps, split key tiles in the backward), which an override does not choose: leave tiles= out "
                "for them"
            )
        if br % warp_rows:
            raise AttnccError(f"GPU tiles {override}: Br must be a multiple of warp_rows={warp_rows}")
    else:
        br = GPU_ROWS_PER_WARP * 4
        bc = max(16, min(paper_bc // 16 * 16, GPU_MAX_TILE))
        while gpu_registers(bc, d) > target.max_registers_per_thread - 32 and bc > 16:
            bc -= 16
        reason = "Br = 16 rows x 4 warps; Bc from the paper, capped at 64 and cut to keep registers below the limit"

    def fit(
        kernel: str,
        shared: Callable[[int, int], int],
        warps: Callable[[int, int], int],
        first_rows: int = br,
        stages: int = GPU_STAGES,
    ) -> TilePlan | None:
        """From (first_rows, bc), cut Bc then Br until `shared` bytes fit; None if 16 x 16 does not."""
        rows, cols, why = first_rows, bc, reason
        if override is None and shared(rows, cols) > target.onchip_bytes:
            why += f"; then cut until the {kernel} fits the shared memory"
        while override is None and shared(rows, cols) > target.onchip_bytes and (cols > 16 or rows > 16):
            if cols > 16:
                cols -= 16
            else:  # fewer query rows per block (d=256: the sm75 forward, the sm86 backward)
                rows //= 2
        regs = gpu_registers(cols, d)
        if shared(rows, cols) > target.onchip_bytes or regs > target.max_registers_per_thread:
            return None
        n = warps(rows, cols)
        return TilePlan(
            d, rows, cols, paper_br, paper_bc, n * target.warp_size, n, stages, shared(rows, cols), regs, why
        )

    forward = fastest_forward(target, d, paper_br, paper_bc, warp_rows) if override is None else None
    # (the fallback above d = 128 keeps warps of 16 rows: two row blocks' state would not fit)
    fallback_warp_rows = warp_rows if override is not None else GPU_ROWS_PER_WARP
    forward = forward or fit(
        "forward",
        lambda rows, cols: gpu_shared_bytes(rows, cols, d, GPU_STAGES),
        lambda rows, cols: rows // fallback_warp_rows,  # a warp per warp_rows query rows
    )
    if forward is not None and override is not None:
        forward = replace(forward, warp_rows=warp_rows)
    if forward is not None and forward.warp_rows == warp_rows:
        forward = replace(forward, reason=forward.reason + rows_why)
    if forward is None:
        raise NoFit(f"tiles {br}x{bc} at d={d} do not fit target {target.name}")

    def backward_warps(rows: int, cols: int) -> int:  # a warp per 16 keys (dK/dV) or query rows (dQ)
        return max(rows, cols) // GPU_ROWS_PER_WARP

    backward = fastest_backward(target, d, light_backward) if override is None else None
    # Above d = 128 (Q re-read per tile) the backward starts from 32 query rows: at 64, ptxas
    # spills 20-40 B in attention_backward for causal bf16 at d = 256 on sm80 and sm90.
    backward_rows = br if override is not None or d <= Q_IN_REGISTERS_MAX_HEAD_DIM else min(br, 32)
    backward = backward or fit(
        "backward", lambda rows, cols: gpu_backward_shared_bytes(rows, cols, d), backward_warps, backward_rows, 1
    )
    if backward is None:  # part of dV in registers: as few 16-column blocks as make the rest fit,
        # at most half of it (d / 4 registers per thread; sm75 at d=256 needs 32 columns: 198
        # registers, no spills)
        for register_columns in range(HEAD_DIM_STEP, d // 2 + 1, HEAD_DIM_STEP):  # d: a multiple of 16
            backward = fit(
                "backward",
                lambda rows, cols, n=register_columns: gpu_backward_shared_bytes(rows, cols, d, n),
                backward_warps,
                backward_rows,
                1,
            )
            if backward is not None:
                why = f"{backward.reason}; dV columns {d - register_columns}..{d - 1} in registers"
                backward = replace(backward, dv_register_columns=register_columns, reason=why)
                break
    return replace(forward, backward=backward)


#: At most this many blocks share one query tile's keys (FlashAttention-2's cap as well).
MAX_KV_SPLITS = 128
#: Query blocks that fill this much of the GPU's resident blocks need no split.
FULL_WAVE = 0.8
#: Among split counts (powers of two), the fewest whose last wave is at least this fraction as
#: full as the best's.
SPLIT_EFFICIENCY = 0.9
#: Split-KV counts at most this many of an SM's resident blocks: a decoding forward streams
#: K/V, and one block per SM (double-buffering its tiles) already keeps the memory busy; more
#: splits add fp32 partials and merge work, not bytes in flight. H100 decoding sweep of session
#: 35 (bench/results/cuda-h100-session35/decode/sweep-decode.log, the kernels with whole-tile
#: direct copies): both forwards ran fastest (or within 2%) at the count that fills 1 block per
#: SM in every shape, and 2 per SM cost up to 30%: GQA 32/8 B=1 M=16K key-split 0.058 ms at 16
#: splits, 0.074 at 32; 8 queries 0.059 at 16, 0.077 at 32; MHA B=1 0.120 at 4, 0.126 at 8.
#: (Session 29's kernels needed 2 per SM; session 23's H200 ones, slower per block, more.)
GPU_SPLIT_BLOCKS_PER_SM = 1
#: A block's shared memory the CUDA runtime reserves besides the kernel's (1 KiB from sm_80 on).
GPU_RESERVED_SHARED_BYTES = 1024


def split_kv_blocks(B: int, H: int, N: int, M: int, tiles: TilePlan) -> tuple[int, int]:
    """(query blocks, key tiles) of a GPU forward with `tiles`: what `choose_kv_splits` weighs."""
    return B * H * math.ceil(N / tiles.block_rows), math.ceil(M / tiles.block_cols)


def resident_blocks(tiles: TilePlan, target: Target) -> int:
    """Forward blocks of `tiles` one SM runs at once, as its shared memory (the tiles and the
    runtime's reserve per block) and registers (the plan's estimate per thread) allow; at least 1.
    On the H200 the decoding sweep's fastest split counts filled these slots: Br=128 (256
    threads of ~168+ registers: 1 per SM) best at ~132 blocks, Br=64 (87 KiB, 128 threads: 2)
    at ~264 (session 23)."""
    by_shared = target.shared_bytes_per_sm // (tiles.onchip_bytes + GPU_RESERVED_SHARED_BYTES)
    by_registers = target.registers_per_sm // max(1, tiles.threads * tiles.registers_per_thread)
    return max(1, min(by_shared, by_registers))


def split_kv_slots(tiles: TilePlan, target: Target, multiprocessors: int) -> int:
    """The blocks `choose_kv_splits` fills: `multiprocessors` x the blocks of `tiles` one SM
    holds (`resident_blocks`), at most GPU_SPLIT_BLOCKS_PER_SM."""
    return multiprocessors * min(resident_blocks(tiles, target), GPU_SPLIT_BLOCKS_PER_SM)


@lru_cache(maxsize=4096)  # (ints in, an int out: called per GPU forward; a server's sizes are many)
def choose_kv_splits(query_blocks: int, key_tiles: int, slots: int) -> int:
    """Split-KV for the GPU forward: how many blocks share the key tiles of one query tile.

    `slots`: the blocks the GPU runs at once (`split_kv_slots`). A call whose B x H x
    query tiles blocks fill most of them (decoding one token, small batches do not) runs
    unsplit: a split adds a merge kernel and fp32 partials. Otherwise each count s gives waves
    w = blocks * s / slots and an efficiency w / ceil(w) (how full the last wave is); the
    answer is the fewest splits within SPLIT_EFFICIENCY of the best, among powers of two where
    every split gets tiles (s is the smallest count with its ceil(tiles / s)).

    Powers of two: they divide power-of-two key counts evenly, and they are what the H200
    decoding sweep timed (session 23, bench/results/cuda-h200-session23/sweep-decode.log), where
    this rule picks the fastest count of each shape and tile plan; counting all s (and one
    block per SM), it took 14 splits for 8 query blocks (0.081 ms at M=16K; 16: 0.077) and 4
    for 32 with 64-row tiles (0.195 ms; 8: 0.139).
    """
    if slots <= 0 or key_tiles < 2 or query_blocks <= 0 or query_blocks >= FULL_WAVE * slots:
        return 1

    def every_split_has_tiles(s: int) -> bool:
        return s == 1 or math.ceil(key_tiles / s) != math.ceil(key_tiles / (s - 1))

    def efficiency(s: int) -> float:
        waves = query_blocks * s / slots
        return waves / math.ceil(waves)

    most = min(MAX_KV_SPLITS, slots, key_tiles)
    candidates = [2**p for p in range(most.bit_length()) if every_split_has_tiles(2**p)]
    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= SPLIT_EFFICIENCY * best)
