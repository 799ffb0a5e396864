"""CPU benchmark: attncc against torch SDPA, eager attention and FlexAttention, side by side.

Every comparison runs in this one process on the same inputs; each time is the median of
`--repeats` runs after a warm-up, and the table prints ratios (anchor time / attncc time, so
> 1 means attncc is faster). Memory is the peak resident-set growth of a fresh subprocess.

    python bench/bench_cpu.py                 # everything (FlexAttention compiles for ~1 min)
    python bench/bench_cpu.py --quick --no-flex
    python bench/bench_cpu.py --sweep         # tile sizes for the dense forward
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402

EX = ROOT / "examples"


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up (and build)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def eager(q, k, v, mask=None, scale=None):
    s = (q @ k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def fwd_bwd(fn, q, k, v):
    def run():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).sum().backward()

    return run


class Flex:
    """FlexAttention compiled for the CPU (forward only: its CPU backward is not implemented)."""

    def __init__(self) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.create_block_mask = create_block_mask
        self.fn = torch.compile(flex_attention, dynamic=False)

    def __call__(self, q, k, v, mask_mod=None):
        block_mask = None
        if mask_mod is not None:
            block_mask = self.create_block_mask(mask_mod, 1, 1, q.shape[2], k.shape[2], device="cpu")
        return lambda: self.fn(q, k, v, block_mask=block_mask)


def row(results: list, name: str, attncc_s: float, anchors: dict[str, float], extra: str = "") -> None:
    ratios = "  ".join(f"{k} {v * 1e3:8.1f} ms ({v / attncc_s:5.2f}x)" for k, v in anchors.items())
    line = f"{name:44s} attncc {attncc_s * 1e3:8.1f} ms  {ratios} {extra}"
    print(line, flush=True)
    results.append({"case": name, "attncc_s": attncc_s, **{f"{k}_s": v for k, v in anchors.items()}, "note": extra})


def two_pass(kern, fn, repeats: int) -> float:
    """The same call with the backward forced into its two passes (dK/dV, then dQ)."""
    kern.backward = "two-pass"
    try:
        return median_s(fn, repeats)
    finally:
        kern.backward = "auto"


def dense_cases(results: list, args, flex) -> None:
    B, H, N, D = 1, 8, 2048, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, generator=gen) for _ in range(3))
    vanilla, causal = attncc.compile(EX / "vanilla.attn"), attncc.compile(EX / "causal.attn")
    r = args.repeats
    anchors = {
        "sdpa": median_s(lambda: F.scaled_dot_product_attention(q, k, v), r),
        "eager": median_s(lambda: eager(q, k, v), r),
    }
    if flex:
        anchors["flex"] = median_s(flex(q, k, v), r)
    row(results, f"dense fwd fp32 B={B} H={H} N={N} D={D}", median_s(lambda: vanilla(q, k, v), r), anchors)
    causal_mask = torch.ones(N, N, dtype=torch.bool).tril()
    anchors = {
        "sdpa": median_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), r),
        "eager": median_s(lambda: eager(q, k, v, causal_mask), r),
    }
    if flex:
        anchors["flex"] = median_s(flex(q, k, v, lambda b, h, i, j: j <= i), r)
    row(results, f"causal fwd fp32 N={N}", median_s(lambda: causal(q, k, v), r), anchors)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    anchors = {
        "sdpa": median_s(fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), qg, kg, vg), r),
        "eager": median_s(fwd_bwd(eager, qg, kg, vg), r),
        "attncc_two_pass_bwd": two_pass(vanilla, fwd_bwd(vanilla, qg, kg, vg), r),
    }
    row(results, f"dense fwd+bwd fp32 N={N}", median_s(fwd_bwd(vanilla, qg, kg, vg), r), anchors)
    anchors = {
        "sdpa": median_s(
            fwd_bwd(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), qg, kg, vg), r
        ),
        "eager": median_s(fwd_bwd(lambda a, b, c: eager(a, b, c, causal_mask), qg, kg, vg), r),
        "attncc_two_pass_bwd": two_pass(causal, fwd_bwd(causal, qg, kg, vg), r),
    }
    row(results, f"causal fwd+bwd fp32 N={N}", median_s(fwd_bwd(causal, qg, kg, vg), r), anchors)
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    anchors = {"sdpa": median_s(lambda: F.scaled_dot_product_attention(qb, kb, vb), r)}
    row(results, f"dense fwd bf16 N={N}", median_s(lambda: vanilla(qb, kb, vb), r), anchors)


def decode_cases(results: list, args) -> None:
    """One query per sequence against a long K/V (a KV-cache step): memory-bound, N < 4 rows."""
    vanilla = attncc.compile(EX / "vanilla.attn")
    gen = torch.Generator().manual_seed(0)
    for B, H, M, D in ((1, 32, 8192, 128), (8, 32, 4096, 128)):
        q = torch.randn(B, H, 1, D, generator=gen)
        k, v = (torch.randn(B, H, M, D, generator=gen) for _ in range(2))
        anchors = {"sdpa": median_s(partial(F.scaled_dot_product_attention, q, k, v), args.repeats)}
        ours = median_s(partial(vanilla, q, k, v), args.repeats)
        row(results, f"decode fwd fp32 B={B} H={H} N=1 M={M} D={D}", ours, anchors)


def sparse_cases(results: list, args, flex) -> None:
    B, H, N, D = 1, 8, args.long_n, 64
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, generator=gen) for _ in range(3))
    r = max(3, args.repeats // 2)
    vanilla = attncc.compile(EX / "vanilla.attn")
    dense_s = median_s(lambda: vanilla(q, k, v), r)
    row(
        results,
        f"dense fwd fp32 N={N} (baseline for sparsity)",
        dense_s,
        {"sdpa": median_s(lambda: F.scaled_dot_product_attention(q, k, v), r)},
    )
    window = attncc.compile(EX / "sliding_window.attn")
    classes = window.tile_classes(q, k)
    density = (classes != 0).float().mean().item()
    i = torch.arange(N).view(-1, 1)
    j = torch.arange(N).view(1, -1)
    bool_mask = (j <= i) & (i - j < 256)
    anchors = {"sdpa+mask": median_s(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask), r)}
    if flex:
        anchors["flex"] = median_s(flex(q, k, v, lambda b, h, i, j: (j <= i) & (i - j < 256)), r)
    t = median_s(lambda: window(q, k, v), r)
    row(
        results,
        f"sliding window 256 fwd N={N}",
        t,
        anchors,
        f"tiles {density:.3f} of dense, time {t / dense_s:.3f} of dense",
    )
    butterfly = attncc.compile(EX / "blocksparse_butterfly.attn")
    density = (butterfly.tile_classes(q, k) != 0).float().mean().item()
    t = median_s(lambda: butterfly(q, k, v), r)
    row(
        results,
        f"butterfly block-sparse fwd N={N}",
        t,
        {},
        f"tiles {density:.3f} of dense, time {t / dense_s:.3f} of dense",
    )


MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys, torch, attncc
    def rss_kb(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])
    which, N = sys.argv[1], int(sys.argv[2])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 8, N, 64, generator=gen).requires_grad_() for _ in range(3))
    kern = attncc.compile(sys.argv[3])
    if which == "attncc":
        fn = lambda: kern(q, k, v)
    elif which == "sdpa":
        fn = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        mask = torch.ones(N, N, dtype=torch.bool).tril()
        fn = lambda: torch.softmax((q @ k.transpose(-1, -2) / 8).masked_fill(~mask, float("-inf")), -1) @ v
    fn().sum().backward()  # build, warm up allocators
    q.grad = k.grad = v.grad = None
    base = rss_kb("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    fn().sum().backward()
    print((rss_kb("VmHWM") - base) / 1024)
    """
)


def memory_cases(results: list, args) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for which, n in (("attncc", 8192), ("sdpa", 8192), ("attncc", 4096), ("eager", 4096)):
        proc = subprocess.run(
            [sys.executable, "-c", MEMORY_SCRIPT, which, str(n), str(EX / "causal.attn")],
            capture_output=True,
            text=True,
            env=env,
        )
        mb = float(proc.stdout.strip() or "nan")
        grads = 3 * 8 * n * 64 * 4 / 2**20
        line = f"peak extra memory causal fwd+bwd {which:6s} N={n}: {mb:8.1f} MiB (q/k/v grads alone {grads:.0f} MiB; one N x N fp32 {8 * n * n * 4 / 2**20:.0f} MiB)"
        print(line, flush=True)
        results.append({"case": f"memory {which} N={n}", "peak_extra_mib": mb, "stderr": proc.stderr[-300:]})


def build_cases(results: list) -> None:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, ATTNCC_CACHE_DIR=cache, PYTHONPATH=str(ROOT))
        script = "import sys, time, attncc\nt = time.perf_counter()\nk = attncc.compile(sys.argv[1])\nk.library('float32')\nprint(time.perf_counter() - t)"
        for label in ("cold build", "cached load (new process)"):
            proc = subprocess.run(
                [sys.executable, "-c", script, str(EX / "alibi.attn")], capture_output=True, text=True, env=env
            )
            seconds = float(proc.stdout.strip() or "nan")
            print(
                f"{label:28s} alibi fp32: {seconds:.2f} s (compile + pipeline, excluding Python start-up)", flush=True
            )
            results.append({"case": label, "seconds": seconds})


def sweep(args) -> None:
    B, H, N, D = 1, 8, 2048, args.sweep_d
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    sdpa = median_s(lambda: F.scaled_dot_product_attention(q, k, v), args.repeats)
    for br in (32, 64, 128):
        for bc in (32, 64, 128, 256):
            kern = attncc.compile(EX / "vanilla.attn", tiles=(br, bc))
            t = median_s(lambda kern=kern: kern(q, k, v), args.repeats)
            print(
                f"d={D} Br={br:3d} Bc={bc:3d}: {t * 1e3:7.1f} ms  sdpa/attncc {sdpa / t:.2f}  {4 * B * H * N * N * D / t / 1e9:.0f} GFLOP/s",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--long-n", type=int, default=8192)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="fewer repeats, N=4096 for the sparse cases, no memory runs"
    )
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-d", type=int, default=64)
    parser.add_argument("--json", type=Path, help="write raw results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.sweep:
        sweep(args)
        return
    if args.quick:
        args.repeats, args.long_n = 3, 4096
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; ratios are anchor/attncc (>1: attncc faster)"
    )
    flex = None
    if not args.no_flex:
        try:
            flex = Flex()
        except Exception as exc:  # report, do not hide: FlexAttention may be unavailable
            print(f"FlexAttention unavailable: {exc}")
    results: list = []
    dense_cases(results, args, flex)
    decode_cases(results, args)
    sparse_cases(results, args, flex)
    if not args.quick:
        memory_cases(results, args)
    build_cases(results)
    if args.json:
        meta = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "machine": platform.machine(),
            "python": platform.python_version(),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
