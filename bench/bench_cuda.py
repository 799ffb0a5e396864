"""GPU benchmark: attncc's CUDA kernels against torch SDPA (flash backend) and FlexAttention.

Runs side by side in one process on the same inputs: bf16, B*H*N = 16K*16 tokens per case,
N from 512 to 16K, d 64 and 128, dense and causal, forward and forward+backward; then decoding
(one query per sequence against M = 4K..64K keys, H = 32, d = 128), where attncc's split-KV
forward runs against itself unsplit (`kv_splits = 1`) and the anchors (with --decode). Times are medians of
CUDA-event timings; ratios are anchor / attncc (> 1: attncc faster). Raw results go to JSON
with the device name and versions.

    python bench/bench_cuda.py --json bench/results/cuda-<device>.json
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def step(fn, backward: bool) -> None:
    out = fn()
    if backward:
        out.backward(torch.ones_like(out))


def flops(B: int, H: int, N: int, D: int, causal: bool, backward: bool) -> float:
    f = 4 * B * H * N * N * D * (0.5 if causal else 1.0)
    return f * (3.5 if backward else 1.0)


def decode_cases(kern: attncc.Kernel, flex, repeats: int) -> list[dict]:
    """One query token per sequence (a KV-cache step): the query tiles alone fill few SMs."""
    rows = []
    for B in (1, 8):
        for M in (4096, 16384, 65536):
            H, D = 32, 128
            q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(B, H, M, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            splits = kern.plan(q, k, None).kv_splits
            ours = median_ms(partial(kern, q, k, v), repeats)
            kern.kv_splits = 1
            try:
                unsplit = median_ms(partial(kern, q, k, v), repeats)
            finally:
                kern.kv_splits = None
            sdpa = median_ms(partial(F.scaled_dot_product_attention, q, k, v), repeats)  # torch picks the backend
            flex_ms = median_ms(partial(flex, q, k, v), repeats)
            rows.append(
                {"decode": True, "B": B, "H": H, "N": 1, "M": M, "D": D, "kv_splits": splits, "attncc_ms": ours,
                 "attncc_unsplit_ms": unsplit, "sdpa_ms": sdpa, "flex_ms": flex_ms}
            )  # fmt: skip
            print(
                f"decode B={B} M={M:5d} d={D}: attncc {ours:7.3f} ms ({splits} splits)  unsplit {unsplit / ours:5.2f}x  "
                f"sdpa {sdpa / ours:5.2f}x  flex {flex_ms / ours:5.2f}x",
                flush=True,
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--decode", action="store_true", help="also the decoding cases (split-KV)")
    args = parser.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compiled FlexAttention per shape: past dynamo's default recompile limit (8) it would
    # fall back to eager flex_attention, which materialises the scores.
    torch._dynamo.config.cache_size_limit = 256
    flex = torch.compile(flex_attention)
    kernels = {
        False: attncc.compile(ROOT / "examples" / "vanilla.attn", target="cuda"),
        True: attncc.compile(ROOT / "examples" / "causal.attn", target="cuda"),
    }
    device = torch.cuda.get_device_name()
    print(f"{device}, torch {torch.__version__}, CUDA {torch.version.cuda}; ratio = anchor / attncc")
    results = []
    for D in args.dims:
        for N in args.sizes:
            B, H = max(1, 16384 // N), 2048 // D
            for causal in (False, True):
                q, k, v = (
                    torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
                )
                kern = kernels[causal]
                block_mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, N, N) if causal else None
                for backward in (False, True):
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        sdpa = median_ms(
                            partial(step, partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal), backward),
                            args.repeats,
                        )
                    ours = median_ms(partial(step, partial(kern, q, k, v), backward), args.repeats)
                    flex_ms = median_ms(
                        partial(step, partial(flex, q, k, v, block_mask=block_mask), backward), args.repeats
                    )
                    tflops = flops(B, H, N, D, causal, backward) / ours / 1e9
                    row = {
                        "D": D,
                        "N": N,
                        "B": B,
                        "H": H,
                        "causal": causal,
                        "backward": backward,
                        "attncc_ms": ours,
                        "sdpa_flash_ms": sdpa,
                        "flex_ms": flex_ms,
                        "attncc_tflops": tflops,
                    }
                    results.append(row)
                    print(
                        f"d={D:3d} N={N:5d} {'causal' if causal else 'dense ':6s} {'fwd+bwd' if backward else 'fwd    '}: attncc {ours:7.3f} ms ({tflops:6.1f} TFLOP/s)  sdpa-flash {sdpa / ours:5.2f}x  flex {flex_ms / ours:5.2f}x",
                        flush=True,
                    )
    if args.decode:
        results += decode_cases(kernels[False], flex, args.repeats)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "attncc": attncc.__version__}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
