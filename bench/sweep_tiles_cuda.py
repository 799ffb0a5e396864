"""Sweeps on a GPU for calibrating the tiling pass's choices.

Forward tiles: the dense bf16 forward (B=4 H=16 N=4096) at each (Br, Bc) the `tiles=` override
takes (Br, Bc up to 64), against the roofline's choice, and the roofline's choice among warps of
32 rows (`warp_rows=32`: two mma row blocks per warp sharing each K/V fragment, FA2's layout). Decoding (`--decode`): one query, d=128,
MHA 32/32 and GQA 32/8 (a group's heads folded into one head's rows), B=1 and 8, M=16K and 64K,
and 8 queries of GQA 32/8 (speculative decoding), the default forward (whose warps split each
key tile, `key_split_warps`) and the 64-row one, at
split-KV counts 1..64 against `choose_kv_splits`'s, and SDPA (torch's choice of backend); then
paged GQA decoding with both (pages of 16, 64 and 256 rows) against SDPA on contiguous K/V.

Backward tiles (`--backward`): the dense and causal bf16 backward (B=4 H=16 N=4096) at the
roofline's choice among `backward_candidates` and at the next best (Br, Bc) pairs by its
estimate (the backward's plans were never timed against each other on a GPU), against SDPA-flash's
backward.

    python bench/sweep_tiles_cuda.py --dims 64 128
    python bench/sweep_tiles_cuda.py --decode
    python bench/sweep_tiles_cuda.py --backward --dims 64 128
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402
from attncc.passes import with_tiles  # noqa: E402
from attncc.passes.roofline import estimate  # noqa: E402
from attncc.passes.tiling import (  # noqa: E402
    TilePlan,
    backward_candidates,
    fastest_backward,
    wide_light_backward_plans,
)
from attncc.targets import get_target  # noqa: E402
from bench.bench_cuda import PAGED_DECODE_HEADS, median_ms, paged_decode_operands  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--decode", action="store_true", help="the split-KV sweep of decoding instead")
    parser.add_argument("--backward", action="store_true", help="the backward's tiles instead")
    args = parser.parse_args()
    if args.decode:
        decode_splits()
    elif args.backward:
        backward_tiles(args.dims)
    else:
        forward_tiles(args.dims)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (tests/test_gpu.py's dry run)"


def forward_tiles(dims: list[int], B: int = 4, H: int = 16, N: int = 4096) -> None:
    """The dense bf16 forward at each layout: the roofline's tiles and the overrides, warps of
    16 and 32 rows."""
    program = ROOT / "examples" / "vanilla.attn"
    layouts = [
        (None, 16),
        ((64, 32), 16),
        ((64, 64), 16),
        ((32, 64), 16),
        (None, 32),
    ]  # (tiles override, rows per warp)
    variants = {(d, tiles, rows): None for d in dims for tiles, rows in layouts}
    kernels = {key: attncc.compile(program, target="cuda", tiles=key[1], warp_rows=key[2]) for key in variants}
    with ThreadPoolExecutor(16) as pool:  # nvcc is single-threaded: build every variant at once
        list(pool.map(lambda key: kernels[key].library_path_for("bfloat16", key[0]), kernels))
    print(f"{device_name()}: dense bf16 forward, B={B} H={H} N={N}", flush=True)
    for (d, tiles, _), kern in kernels.items():
        q, k, v = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        plan = kern.plan(q, k, None).tiles
        ms = median_ms(partial(kern, q, k, v), 15, 5)
        flops = 4 * B * H * N * N * d
        label = "roofline" if tiles is None else "override"
        print(f"d={d:3d} {label:8s} Br={plan.block_rows:3d} Bc={plan.block_cols:3d} warps={plan.warps} "
              f"rows/warp={plan.warp_rows}: "
              f"{ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)  # fmt: skip


def with_backward_plan(kern: attncc.Kernel, d: int, plan: TilePlan) -> attncc.Kernel:
    """`kern`'s program with `plan` as the backward's tiles at head dim `d` (a kernel of its own:
    its cache key covers the tiles)."""
    return type(kern)(with_tiles(kern.stages, lambda table: table.with_backward(d, plan)), kern.target)


def backward_plans(target: str, d: int, top: int, light: int = 0) -> list[tuple[TilePlan, float]]:
    """Every program's default backward plan (`fastest_backward`; the light programs the sweep
    times, vanilla and causal, default to a light plan where MEASURED_LIGHT_BACKWARD_TILES names
    one, which is then among the light plans below), the
    best-estimated plan of each of the next `top` - 1 (Br, Bc) pairs, and with `light` > 0 the
    best-estimated light-only plan (`backward_candidates(..., light=True)`: more dK/dV columns
    in registers than the budget of every program allows) of `light` (Br, Bc) pairs and the
    wide light plans (`wide_light_backward_plans`), with their estimates (seconds at
    GPU_REFERENCE_PROBLEM)."""
    chosen = fastest_backward(get_target(target), d)
    assert chosen is not None, f"{target} plans no backward candidates at d = {d}"
    everyone = {
        (p.block_rows, p.block_cols, p.dk_register_columns) for p, _ in backward_candidates(get_target(target), d)
    }
    best: dict[tuple[int, int, bool], tuple[TilePlan, float]] = {}  # (Br, Bc, light-only)
    for plan, work in backward_candidates(get_target(target), d, light=light > 0):
        seconds = estimate(work, target, plan.registers_per_thread).seconds
        light_only = (plan.block_rows, plan.block_cols, plan.dk_register_columns) not in everyone
        key = (plan.block_rows, plan.block_cols, light_only)
        if key not in best or seconds < best[key][1]:
            best[key] = (plan, seconds)
    first = best.pop((chosen.block_rows, chosen.block_cols, False))[1]
    by_estimate = sorted(best.items(), key=lambda item: item[1][1])
    others = [value for key, value in by_estimate if not key[2]][: top - 1]
    light_plans = [value for key, value in by_estimate if key[2]][:light]
    wide = [
        (plan, estimate(work, target, plan.registers_per_thread).seconds)
        for plan, work in wide_light_backward_plans(get_target(target), d)
        if light > 0
    ]
    return [(chosen, first), *others, *light_plans, *wide]


#: How many backward plans the sweep times per head dim (the default's and the next by estimate),
#: and how many light-only ones beside them for the light programs it times (vanilla, causal).
BACKWARD_SWEEP_PLANS = 6
BACKWARD_SWEEP_LIGHT_PLANS = 4


def backward_tiles(
    dims: list[int],
    B: int = 4,
    H: int = 16,
    N: int = 4096,
    top: int = BACKWARD_SWEEP_PLANS,
    masks: tuple[str, ...] = ("vanilla", "causal"),
) -> None:
    """The bf16 backward of each of `masks` (examples, "vanilla": dense; time of
    torch.autograd.grad of out after one forward) at `backward_plans`' tiles, against
    SDPA-flash's backward on the same inputs."""
    programs = {mask: ROOT / "examples" / f"{mask}.attn" for mask in masks}
    kernels = {}
    for (mask, program), d in itertools.product(programs.items(), dims):
        base = attncc.compile(program, target="cuda")
        for plan, seconds in backward_plans(base.target, d, top, BACKWARD_SWEEP_LIGHT_PLANS):
            kernels[mask, d, plan.block_rows, plan.block_cols, plan.dk_register_columns, seconds] = with_backward_plan(
                base, d, plan
            )
    with ThreadPoolExecutor(16) as pool:  # nvcc is single-threaded: build every variant at once
        list(pool.map(lambda key: kernels[key].library_path_for("bfloat16", key[1]), kernels))
    print(f"{device_name()}: bf16 backward, B={B} H={H} N={N}; ms (roofline estimate us)", flush=True)
    for mask, d in itertools.product(programs, dims):
        q, k, v, dout = (torch.randn(B, H, N, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        with (
            torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
            if q.is_cuda
            else nullcontext()
        ):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal")
            sdpa = median_ms(partial(torch.autograd.grad, out, (q, k, v), dout, retain_graph=True), 10, 3)
        flops = 10 * B * H * N * N * d / (2 if mask == "causal" else 1)
        print(f"{mask} d={d}: sdpa-flash backward {sdpa:.3f} ms {flops / sdpa / 1e9:6.1f} TFLOP/s", flush=True)
        for (m, dk, br, bc, columns, seconds), kern in kernels.items():
            if (m, dk) != (mask, d):
                continue
            out = kern(q, k, v)
            ms = median_ms(partial(torch.autograd.grad, out, (q, k, v), dout, retain_graph=True), 10, 3)
            print(
                f"{mask} d={d} Br={br:3d} Bc={bc:3d} dK/dV register columns {columns:3d} "
                f"(estimate {seconds * 1e6:5.0f} us): {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s = {sdpa / ms:.2f}x sdpa",
                flush=True,
            )


#: ((H, Hkv), B, M, N): one query at 16K and 64K keys, MHA and GQA 32/8 (4 rows a group);
#: then 8 queries of GQA 32/8 (speculative decoding: 32 rows a group, the 32-row key-split forward).
DECODING_SHAPES = (
    *((heads, B, M, 1) for heads, B, M in itertools.product(((32, 32), (32, 8)), (1, 8), (16384, 65536))),
    ((32, 8), 1, 16384, 8),
    ((32, 8), 8, 16384, 8),
)
#: Rows per page of the paged decoding cases.
PAGE_SIZES = (16, 64, 256)


def decode_splits(
    shapes: Iterable[tuple[tuple[int, int], int, int, int]] = DECODING_SHAPES,
    splits_tried: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64),
    pages: tuple[int, ...] = PAGE_SIZES,
) -> None:
    """Decoding, d=128 at each ((H, Hkv), B, M, N) of `shapes`: SDPA, then each forward at its
    chosen split count and at every count of `splits_tried`; then GQA 32/8 from a paged cache
    (planned, pages of 16, 64 and 256 shuffled) against SDPA on the same keys stored contiguously. The
    forwards: the default (warps splitting each key tile for calls of at most 32 rows,
    `key_split_warps`, three K/V buffers where they fit), the same with two K/V buffers
    (`key_split_stages`), and the 64-row forward (Kernel.for_short_queries; the session-23 sweep
    timed it fastest against the plan's 128 rows)."""
    program = ROOT / "examples" / "vanilla.attn"
    kernels = {label: attncc.compile(program, target="cuda") for label in ("key-split", "2 stages", "64 rows")}
    kernels["key-split"].key_split_warps, kernels["64 rows"].key_split_warps = True, False
    # (session 48: the key-split forwards' third K/V buffer, never timed, against two)
    kernels["2 stages"].key_split_warps, kernels["2 stages"].key_split_stages = True, 2
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda kern: kern.for_rows(1, 128).library_path_for("bfloat16", 128), kernels.values()))
    print(f"{device_name()}: bf16 decoding, d=128; ms per call (splits)", flush=True)
    shapes = list(shapes)
    for (H, Hkv), B, M, N in shapes:
        q = torch.randn(B, H, N, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(B, Hkv, M, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        sdpa = median_ms(partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=Hkv < H), 15, 5)
        print(f"H={H} Hkv={Hkv} B={B} M={M:5d} N={N}: sdpa {sdpa:.3f}", flush=True)
        for label, kern in kernels.items():
            rows = q.reshape(B, Hkv, H // Hkv * N, 128)  # as the forward runs it (a group's heads as rows)
            chosen = kern.for_rows(H // Hkv * N, 128).plan(rows, k, None)
            best = median_ms(partial(kern, q, k, v), 15, 5)
            times = []
            for splits in splits_tried if label != "2 stages" else ():  # (the buffers: at the chosen count)
                kern.kv_splits = splits
                times.append(f"{median_ms(partial(kern, q, k, v), 15, 5):.3f} ({splits})")
            kern.kv_splits = None
            print(
                f"H={H} Hkv={Hkv} B={B} M={M:5d} N={N} {label:9s} Br={chosen.tiles.block_rows:3d}: chosen {best:.3f} "
                f"({chosen.kv_splits}) = {sdpa / best:.2f}x sdpa  " + "  ".join(times),
                flush=True,
            )
    for B, M in sorted({(B, M) for _, B, M, N in shapes if N == 1}):
        paged_decoding(kernels, B, M, pages)


def paged_decoding(kernels: dict[str, attncc.Kernel], B: int, M: int, pages: tuple[int, ...] = PAGE_SIZES) -> None:
    """GQA 32/8 decoding, one query, d=128, from a paged cache (pages of each size in `pages`,
    shuffled, a plan per step) with each forward at its chosen splits, against SDPA on
    contiguous K/V: whether paging's cost (1.6x the padded call at pages of 16, session 29)
    shrinks with longer runs of rows per page. Two rows split the cost's likely causes: the
    same cache with its pages in order (what shuffling costs: scattered pages, address
    translation) and the padded call on the cache's rows read in place as [B, M, Hkv, D]
    (what the layout costs: a kv head's row is a 256-byte piece of each 2 KiB cache row)."""
    H, Hkv = PAGED_DECODE_HEADS
    for page in pages:
        q, k_cache, v_cache, table, lengths, k, v = paged_decode_operands(B, M, page=page)
        sdpa = median_ms(partial(F.scaled_dot_product_attention, q.transpose(1, 2), k, v, enable_gqa=True), 15, 5)
        in_order = torch.arange(table.numel(), device=table.device, dtype=table.dtype).view_as(table)
        plans = {
            "shuffled": attncc.plan_paged(k_cache, table, lengths),
            "in order": attncc.plan_paged(k_cache, in_order, lengths),
        }
        for order, plan in plans.items():
            line = f"paged H={H} Hkv={Hkv} B={B} M={M:5d} page {page:3d} {order:8s}: sdpa (contiguous) {sdpa:.3f}"
            for label, kern in kernels.items():
                ms = median_ms(partial(kern.paged, q, k_cache, v_cache, plan=plan), 15, 5)
                line += f"  {label} {ms:.3f} = {sdpa / ms:.2f}x sdpa"
            print(line, flush=True)
    # the last cache's rows in place, side by side (unshuffled they are one [B, M, Hkv, D] tensor)
    rows_in_place = [c.view(B, M, Hkv, c.shape[-1]).transpose(1, 2) for c in (k_cache, v_cache)]
    q_rows = q.transpose(1, 2)
    line = f"padded H={H} Hkv={Hkv} B={B} M={M:5d}, K/V [B, M, Hkv, D] in place:"
    for label, kern in kernels.items():
        side_by_side = median_ms(partial(kern, q_rows, *rows_in_place), 15, 5)
        contiguous = median_ms(partial(kern, q_rows, k, v), 15, 5)
        line += f"  {label} {side_by_side:.3f} (contiguous {contiguous:.3f})"
    print(line, flush=True)


if __name__ == "__main__":
    main()
