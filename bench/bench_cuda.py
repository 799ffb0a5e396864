"""GPU benchmark: attncc's CUDA kernels against torch SDPA (flash backend) and FlexAttention.

Runs side by side in one process on the same inputs: bf16, B*H*N = 16K*16 tokens per case,
N from 512 to 16K, d 64 and 128, forward and forward+backward, for the cases asked
(`--cases`: dense and causal against SDPA-flash and FlexAttention; sliding window 256, ALiBi
and softcap against FlexAttention with the same block mask / score_mod); before them, with
--decode, decoding (one query per sequence against M = 4K..64K keys, H = 32, d = 128: attncc's
split-KV forward against itself unsplit (`kv_splits = 1`) and the anchors; GQA 32/8 from a
paged cache against SDPA on the keys stored contiguously; each also replayed from a CUDA graph,
attncc's and SDPA's, which takes the host time out), with --serving, packed batches
(`kern.varlen` against SDPA on the padded batch with its mask, 25% and 50% padding) and, with
--fp8, fp8 K/V widened and on the fp8 tensor cores (`fp8_cases`).

Each time is the median of `--repeats` measurements, taken two ways: one call between CUDA
events (host overhead included: validation, packing, the ctypes call) and `--calls`
back-to-back calls between events, per call (the GPU's pace). Ratios are anchor / attncc
(> 1: attncc faster), back-to-back. Beside each forward, the roofline estimate of the tiling
pass's model (attncc/passes/roofline.py) and measured / estimate, for
calibrating its rates. Rows go to JSON with the device name and versions after every case;
`--budget-s` stops starting new cases past that many seconds, so a device call stays within
its limit and still returns what it measured.

    python bench/bench_cuda.py --json bench/results/cuda-<device>.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402
from attncc.targets import GPU_RATES  # noqa: E402


def median_ms(fn, repeats: int, calls: int = 1) -> float:
    """Median over `repeats` of the time of `calls` back-to-back calls between CUDA events, per call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def graph_ms(fn: Callable[[], object], repeats: int) -> float | str:
    """Median time per replay of `fn` captured into a CUDA graph (no host work per call: how
    serving stacks run decoding steps), after warm-up calls on a side stream as torch asks; or
    why the capture failed."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(), fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return median_ms(graph.replay, repeats, 10)
    except Exception as exc:  # (recorded in the results: the bench goes on)
        return f"{type(exc).__name__}: {exc}"[:300]


def ratio(anchor: float | str, ours: float | str) -> str:
    return f"{anchor / ours:5.2f}x" if isinstance(anchor, float) and isinstance(ours, float) else "  n/a"


#: The sliding_window and softcap examples' constants, for FlexAttention's block mask and score_mod.
WINDOW, CAP = 256, 30.0


def live_fraction(case: str, N: int) -> float:
    if case in ("dense", "softcap"):
        return 1.0
    if case in ("causal", "alibi"):
        return (N + 1) / (2 * N)
    w = min(WINDOW, N)  # sliding window: row i sees min(i + 1, W) keys
    return (N * w - w * (w - 1) / 2) / (N * N)


def flex_args(case: str, N: int, H: int) -> dict:
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b, h, i, j):
        return j <= i

    def window(b, h, i, j):
        return (j <= i) & (i - j < WINDOW)

    if case == "dense":
        return {}
    if case == "softcap":
        return {"score_mod": lambda score, b, h, i, j: CAP * torch.tanh(score / CAP)}
    mask = window if case == "sliding_window" else causal
    args = {"block_mask": create_block_mask(mask, None, None, N, N)}
    if case == "alibi":
        slopes = alibi_slopes(H)
        args["score_mod"] = lambda score, b, h, i, j: score - slopes[h] * (i - j)
    return args


def alibi_slopes(H: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device="cuda")


def step(fn, backward: bool) -> None:
    out = fn()
    if backward:
        out.backward(torch.ones_like(out))


def decode_cases(
    kern: attncc.Kernel,
    flex: Callable | None,
    repeats: int,
    batches: tuple[int, ...] = (1, 8),
    lengths: tuple[int, ...] = (4096, 16384, 65536),
) -> list[dict]:
    """One query token per sequence (a KV-cache step): the query tiles alone fill few SMs.
    `flex`: compiled flex_attention, or None to leave it out."""
    rows = []
    for B in batches:
        for M in lengths:
            H, D = 32, 128
            q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, H, M, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            splits = kern.for_rows(1, D).plan(q, k, None).kv_splits  # (the forward one-query calls run)
            ours = median_ms(partial(kern, q, k, v), repeats)
            kern.kv_splits = 1
            try:
                unsplit = median_ms(partial(kern, q, k, v), repeats)
            finally:
                kern.kv_splits = None
            sdpa_call = partial(F.scaled_dot_product_attention, q, k, v)  # torch picks the backend
            sdpa = median_ms(sdpa_call, repeats)
            graphed, sdpa_graphed = graph_ms(partial(kern, q, k, v), repeats), graph_ms(sdpa_call, repeats)
            rows.append(
                {"decode": True, "B": B, "H": H, "N": 1, "M": M, "D": D, "kv_splits": splits, "attncc_ms": ours,
                 "attncc_unsplit_ms": unsplit, "sdpa_ms": sdpa, "attncc_graph_ms": graphed, "sdpa_graph_ms": sdpa_graphed}
            )  # fmt: skip
            if flex is not None:
                rows[-1]["flex_ms"] = median_ms(partial(flex, q, k, v), repeats)
            print(
                f"decode B={B} M={M:5d} d={D}: attncc {ours:7.3f} ms ({splits} splits)  unsplit {unsplit / ours:5.2f}x  "
                f"sdpa {sdpa / ours:5.2f}x"
                + (f"  flex {rows[-1]['flex_ms'] / ours:5.2f}x" if flex is not None else "")
                + f"  | CUDA graphs: attncc {graphed if isinstance(graphed, str) else f'{graphed:.3f} ms'}"
                f"  sdpa {ratio(sdpa_graphed, graphed)}",
                flush=True,
            )
            rows.append(paged_decode_case(kern, B, M, repeats))
    return rows


PAGED_DECODE_HEADS = (32, 8)  # (H, Hkv): GQA 32/8


def paged_decode_operands(B: int, M: int, D: int = 128, page: int = 16) -> tuple[torch.Tensor, ...]:
    """bf16 decoding operands for GQA PAGED_DECODE_HEADS from a paged cache: q [B, 1, H, D],
    k_cache, v_cache [pages, page, Hkv, D] with block_table in shuffled page order and cache
    lengths M, and the same keys and values stored contiguously ([B, Hkv, M, D], for SDPA)."""
    H, Hkv = PAGED_DECODE_HEADS
    pages = B * M // page
    k_cache, v_cache = (torch.randn(pages, page, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(pages, device="cuda").view(B, M // page).int()
    lengths = torch.full((B,), M, device="cuda", dtype=torch.int32)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (c[table.long()].flatten(1, 2).transpose(1, 2).contiguous() for c in (k_cache, v_cache))
    return q, k_cache, v_cache, table, lengths, k, v


def paged_decode_case(kern: attncc.Kernel, B: int, M: int, repeats: int) -> dict:
    """GQA 32/8 decoding from a paged cache (pages of 16 rows in shuffled order) against SDPA on
    the same keys stored contiguously: what paging costs."""
    (H, Hkv), D, page = PAGED_DECODE_HEADS, 128, 16
    q, k_cache, v_cache, table, lengths, k, v = paged_decode_operands(B, M, D, page)
    ours = median_ms(partial(kern.paged, q, k_cache, v_cache, table, lengths), repeats)
    plan = attncc.plan_paged(k_cache, table, lengths)  # once per step; each layer's call reads nothing back
    planned = median_ms(partial(kern.paged, q, k_cache, v_cache, plan=plan), repeats)
    sdpa_call = partial(F.scaled_dot_product_attention, q.transpose(1, 2), k, v, enable_gqa=True)
    sdpa = median_ms(sdpa_call, repeats)
    graphed = graph_ms(partial(kern.paged, q, k_cache, v_cache, plan=plan), repeats)
    sdpa_graphed = graph_ms(sdpa_call, repeats)
    print(
        f"paged decode GQA 32/8 B={B} M={M:5d} d={D}: attncc {ours:7.3f} ms (with a plan {planned:7.3f} ms)  "
        f"sdpa (contiguous) {sdpa / ours:5.2f}x ({sdpa / planned:5.2f}x planned)  | CUDA graphs: attncc "
        f"{graphed if isinstance(graphed, str) else f'{graphed:.3f} ms'}  sdpa {ratio(sdpa_graphed, graphed)}",
        flush=True,
    )
    return {"paged_decode": True, "B": B, "H": H, "Hkv": Hkv, "N": 1, "M": M, "D": D, "page_size": page,
            "attncc_ms": ours, "attncc_planned_ms": planned, "sdpa_contiguous_ms": sdpa,
            "attncc_planned_graph_ms": graphed, "sdpa_contiguous_graph_ms": sdpa_graphed}  # fmt: skip


def fp8_cases(repeats: int, sizes: tuple[int, ...] = (4096, 16384), batch: int | None = None) -> list[dict]:
    """Issue 12's fp8 K/V forward on the GPU: e4m3 K/V with a factor per token (k) and per kv head
    (v), bf16 q, dense, H=16 d=128, N = M = 4K and 16K: widened into bf16 tiles, on the fp8
    tensor cores (`fp8_mma`, sm89/sm90), the bf16 call, and SDPA-flash on bf16 K/V."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="cuda")
    H, D = 16, 128
    for N in sizes:
        B = batch or max(1, 16384 // N)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        k_descale = k.float().abs().amax(-1) / 448
        v_descale = v.float().abs().amax((-1, -2), keepdim=True).squeeze(-1) / 448
        k8 = (k.float() / k_descale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        v8 = (v.float() / v_descale.unsqueeze(-1)).to(torch.float8_e4m3fn)
        row = {"fp8": True, "B": B, "H": H, "N": N, "M": N, "D": D}
        with torch.no_grad():
            row["attncc_bf16_ms"] = median_ms(partial(kern, q, k, v), repeats, 10)
            fp8_call = partial(kern, q, k8, v8, k_descale=k_descale, v_descale=v_descale)
            row["attncc_fp8_widened_ms"] = median_ms(fp8_call, repeats, 10)
            kern.fp8_mma = True
            try:
                row["attncc_fp8_mma_ms"] = median_ms(fp8_call, repeats, 10)
            finally:
                kern.fp8_mma = False
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                row["sdpa_flash_bf16_ms"] = median_ms(partial(F.scaled_dot_product_attention, q, k, v), repeats, 10)
        rows.append(row)
        print(
            f"fp8 e4m3 K/V dense d={D} N={N:5d}: fp8 products {row['attncc_fp8_mma_ms']:7.3f} ms  "
            f"widened {row['attncc_fp8_widened_ms'] / row['attncc_fp8_mma_ms']:5.2f}x  "
            f"attncc bf16 {row['attncc_bf16_ms'] / row['attncc_fp8_mma_ms']:5.2f}x  "
            f"sdpa-flash bf16 {row['sdpa_flash_bf16_ms'] / row['attncc_fp8_mma_ms']:5.2f}x",
            flush=True,
        )
    return rows


def serving_cases(
    repeats: int, batch: int = 8, longest: int = 4096, warp_rows: Sequence[int | None] = (None,)
) -> list[dict]:
    """Issue 11's packed batches on the GPU: `kern.varlen` (its forward with warps of each of
    `warp_rows` query rows) against SDPA on the padded batch with its padding mask, 8 sequences
    up to 4096 tokens at 25% and 50% padding, H=16 d=128 bf16, dense and causal, forward and
    forward+backward."""
    from bench.bench_cpu import padded_lengths

    rows = []
    H, D = 16, 128
    for program, causal in (("vanilla", False), ("causal", True)):
        kernels = {
            each: attncc.compile(ROOT / "examples" / f"{program}.attn", target="cuda", warp_rows=each)
            for each in warp_rows
        }
        for padding in (0.25, 0.5):
            lens = padded_lengths(batch, longest, padding)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            plan = attncc.plan_varlen(cu, cu)  # (the offsets read once: every layer's calls would share it)
            packed = [torch.randn(sum(lens), H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            padded = [torch.zeros(batch, H, longest, D, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
            for b in range(batch):
                for dst, src in zip(padded, packed):
                    dst[b, :, : lens[b]] = src[cu[b] : cu[b + 1]].transpose(0, 1)
            keys = torch.arange(longest, device="cuda").view(1, -1) < torch.tensor(lens, device="cuda").view(-1, 1)
            mask = keys.view(batch, 1, 1, longest)
            if causal:
                mask = mask & torch.ones(longest, longest, dtype=torch.bool, device="cuda").tril()
            for backward in (False, True):
                leaves = [t.clone().requires_grad_(backward) for t in packed]
                boxes = [t.clone().requires_grad_(backward) for t in padded]
                sdpa_call = partial(F.scaled_dot_product_attention, *boxes, attn_mask=mask)
                sdpa = median_ms(partial(step, sdpa_call, backward), repeats)
                for each, kern in kernels.items():
                    ours = median_ms(partial(step, partial(kern.varlen, *leaves, cu, cu), backward), repeats)
                    planned = median_ms(partial(step, partial(kern.varlen, *leaves, plan=plan), backward), repeats)
                    rows.append(
                        {"varlen": program, "padding": padding, "lengths": lens, "H": H, "D": D, "backward": backward,
                         "warp_rows": each, "attncc_ms": ours, "attncc_planned_ms": planned, "sdpa_padded_ms": sdpa}
                    )  # fmt: skip
                    print(
                        f"varlen {program:7s} pad {padding:.0%} {'fwd+bwd' if backward else 'fwd    '} rows/warp {each or 'default'}: "
                        f"attncc {ours:7.3f} ms (planned {planned:7.3f})  sdpa (padded, mask) {sdpa / ours:5.2f}x "
                        f"({sdpa / planned:5.2f}x planned)",
                        flush=True,
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=10, help="back-to-back calls per timing")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    cases = ["dense", "causal", "sliding_window", "alibi", "softcap"]
    parser.add_argument("--cases", nargs="+", default=["dense", "causal"], choices=cases)
    parser.add_argument("--budget-s", type=float, default=480.0, help="start no case after this many seconds")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--decode", action="store_true", help="also the decoding cases (split-KV)")
    parser.add_argument("--serving", action="store_true", help="also the packed (varlen) cases")
    parser.add_argument("--fp8", action="store_true", help="also fp8 K/V: widened, fp8 products (sm89+)")
    parser.add_argument(
        "--warp-rows",
        type=lambda text: None if text == "default" else int(text),
        nargs="+",
        default=[None],
        choices=[None, 16, 32],
        help="query rows per warp of the forward: 16, 32 or default (the compiler's choice)",
    )
    parser.add_argument(
        "--no-flex", action="store_true", help="leave FlexAttention out (its compiles take a short lease's minutes)"
    )
    parser.add_argument("--tokens", type=int, default=16384, help="B x N of each grid case")
    parser.add_argument("--width", type=int, default=2048, help="H x D of each grid case")
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention

    began = time.monotonic()
    # One compiled FlexAttention per shape: past dynamo's default recompile limit (8) it would
    # fall back to eager flex_attention, which materialises the scores.
    torch._dynamo.config.cache_size_limit = 256
    flex = None if args.no_flex else torch.compile(flex_attention)
    kernels = {
        (case, rows): attncc.compile(
            ROOT / "examples" / f"{'vanilla' if case == 'dense' else case}.attn", target="cuda", warp_rows=rows
        )
        for case in args.cases
        for rows in args.warp_rows
    }
    device = torch.cuda.get_device_name()
    meta = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "attncc": attncc.__version__}
    if kernels:  # the part whose published rates the estimates use (attncc.targets.GPU_RATES)
        meta["estimate_rates_of"] = GPU_RATES[next(iter(kernels.values())).target].part
    print(f"{device}, torch {torch.__version__}, CUDA {torch.version.cuda}; ratio = anchor / attncc (back-to-back)")
    results: list[dict] = []

    def save() -> None:
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))

    # first the short ones, so that the budget cuts the grid below, not these
    if args.decode:
        results += decode_cases(
            kernels.get(("dense", None)) or attncc.compile(ROOT / "examples" / "vanilla.attn", target="cuda"),
            flex,
            args.repeats,
        )
        save()
    if args.serving:
        results += serving_cases(args.repeats, warp_rows=args.warp_rows)
        save()
    if args.fp8:
        results += fp8_cases(args.repeats)
        save()

    for D in args.dims:
        for N in args.sizes:
            B, H = max(1, args.tokens // N), args.width // D
            for case in args.cases:
                if time.monotonic() - began > args.budget_s:
                    print(f"budget of {args.budget_s:.0f} s reached: the remaining cases were not run", flush=True)
                    save()
                    return
                q, k, v = (
                    torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
                )
                runtime = {"slopes": alibi_slopes(H)} if case == "alibi" else {}
                flex_kwargs = flex_args(case, N, H)
                for backward in (False, True):
                    anchors = {}
                    if case in ("dense", "causal"):
                        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                            sdpa_fn = partial(F.scaled_dot_product_attention, q, k, v, is_causal=case == "causal")
                            anchors["sdpa_flash_ms"] = median_ms(
                                partial(step, sdpa_fn, backward), args.repeats, args.calls
                            )
                    if flex is not None:
                        flex_fn = partial(step, partial(flex, q, k, v, **flex_kwargs), backward)
                        anchors["flex_ms"] = median_ms(flex_fn, args.repeats, args.calls)
                    for rows in args.warp_rows:
                        row = {"case": case, "D": D, "N": N, "B": B, "H": H, "backward": backward, "warp_rows": rows}
                        results.append(grid_row(row, kernels[case, rows], q, k, v, runtime, anchors, args))
                        save()


def grid_row(
    row: dict,
    kern: attncc.Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    runtime: dict,
    anchors: dict,
    args: argparse.Namespace,
) -> dict:
    """Times `kern` on q, k, v (forward, or forward and backward), beside the anchors' times."""
    from attncc.runtime.profile import forward_estimate

    backward, B, H, N, D = row["backward"], row["B"], row["H"], row["N"], row["D"]
    ours_fn = partial(step, partial(kern, q, k, v, **runtime), backward)
    row["attncc_single_ms"] = median_ms(ours_fn, args.repeats)
    row["attncc_ms"] = ours = median_ms(ours_fn, args.repeats, args.calls)
    row |= anchors
    f = 4 * B * H * N * N * D * live_fraction(row["case"], N) * (3.5 if backward else 1.0)
    row["attncc_tflops"] = f / ours / 1e9
    model = ""
    if not backward:
        # occupancy from the plan's register estimate (ptxas's count costs nvcc time per kernel)
        est = forward_estimate(kern, q, k, kern.plan(q, k, None).tiles.registers_per_thread, **runtime)
        row["estimate_ms"], row["estimate_bound"] = 1e3 * est.seconds, est.bound
        model = f"  measured/estimate {ours / row['estimate_ms']:5.2f} ({est.bound})"
    ratios = "  ".join(
        f"{name} {row[key] / ours:5.2f}x"
        for name, key in (("sdpa-flash", "sdpa_flash_ms"), ("flex", "flex_ms"))
        if key in row
    )
    print(
        f"d={D:3d} N={N:5d} {row['case']:14s} {'fwd+bwd' if backward else 'fwd    '} rows/warp {row['warp_rows'] or 'default'}: "
        f"attncc {ours:7.3f} ms (single call {row['attncc_single_ms']:7.3f}, {row['attncc_tflops']:6.1f} TFLOP/s)  "
        f"{ratios}{model}",
        flush=True,
    )
    return row


if __name__ == "__main__":
    main()
