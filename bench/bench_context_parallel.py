"""Context parallelism on the CPU: per-rank time and peak memory against the world size.

    python bench/bench_context_parallel.py [--n 8192] [--world-sizes 1 2 4] [--json out.json]

For each program (causal, sliding window) and world size P, P gloo ranks on localhost (spawned,
loopback) run `attncc.distributed.context_parallel` forward + backward on their slices of one
sequence [B, H, N, D] (layout: `choose_layout`'s); each rank reports its median time and its
peak resident memory above what was resident before its first large call (the peak reset by
/proc/self/clear_refs, read as VmHWM; allocations of 128 KiB and more are mmapped, so freed
memory leaves the resident set). In the same
run, one process times the single-process kernel and SDPA on the whole sequence (P = 1 rows,
the anchors). The ranks share this machine's cores (threads per rank: cores / P, at least 1),
so time against P shows the ring's overhead, not a speedup; memory per rank is what must fall
as 1/P. Chunk pairs skipped: from the plan, the same on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402
from attncc import distributed as cp  # noqa: E402
from bench.bench_cpu import cpu_meta  # noqa: E402

PROGRAMS = ("causal", "sliding_window")


def status_mib(field: str) -> float:
    """A /proc/self/status memory field (VmRSS: resident now, VmHWM: its peak) in MiB."""
    line = next(line for line in open("/proc/self/status") if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024  # kB


def reset_peak() -> float:
    """Reset the resident-memory peak (Linux: clear_refs 5) and return what is resident now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_mib("VmRSS")


def timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, name: str, layout: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn")
    B, H, D = args.b, args.h, args.d
    small = [torch.randn(B, H, 64 * world, D) for _ in range(3)]  # load the libraries first
    cp.context_parallel(kern, *(t.requires_grad_() for t in small), layout=layout).sum().backward()
    local = args.n // world
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(B, H, local, D, generator=gen).requires_grad_() for _ in range(3))
    dist.barrier()
    before = reset_peak()

    def step() -> None:
        q.grad = k.grad = v.grad = None
        cp.context_parallel(kern, q, k, v, layout=layout).sum().backward()
        dist.barrier()

    seconds = timed(step, args.reps)
    queue.put((rank, seconds, status_mib("VmHWM") - before))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, args: argparse.Namespace, name: str, layout: str) -> list[tuple[int, float, float]]:
    # ranks allocate with mmap from 128 KiB up and so unmap what they free: the resident peak is
    # what was live, not what glibc's heap kept (a dynamic threshold keeps up to 32 MiB blocks)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    ranks = [context.Process(target=rank_main, args=(r, world, port, args, name, layout, queue)) for r in range(world)]
    for p in ranks:
        p.start()
    results = sorted(queue.get(timeout=1800) for _ in ranks)
    for p in ranks:
        p.join()
    return results


def anchors(args: argparse.Namespace, name: str) -> dict[str, float]:
    """Single-process attncc and SDPA forward + backward on the whole sequence (this process)."""
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn")
    B, H, N, D = args.b, args.h, args.n, args.d
    q, k, v = (torch.randn(B, H, N, D).requires_grad_() for _ in range(3))
    i, j = torch.arange(N).view(-1, 1), torch.arange(N).view(1, -1)
    mask = (j <= i) & (i - j < 256) if name == "sliding_window" else None

    def ours() -> None:
        kern(q, k, v).sum().backward()

    def sdpa() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None).sum().backward()

    ours()
    sdpa()
    return {"attncc": timed(ours, args.reps), "sdpa": timed(sdpa, args.reps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--b", type=int, default=1)
    parser.add_argument("--h", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--programs", nargs="+", default=list(PROGRAMS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"# {platform.node()} {cpu}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"# forward + backward, fp32, B={args.b} H={args.h} N={args.n} D={args.d}; medians of {args.reps}")
    rows = []
    for name in args.programs:
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn")
        base = anchors(args, name)
        print(f"{name}: single process attncc {base['attncc'] * 1e3:.0f} ms, SDPA {base['sdpa'] * 1e3:.0f} ms")
        for world in args.world_sizes:
            plan = cp.choose_layout(kern, world, args.n, B=args.b, H=args.h, D=args.d)
            kern.at_global_positions().library("float32")
            results = run_world(world, args, name, plan.layout)
            slowest = max(r[1] for r in results)
            memory = [round(r[2], 1) for r in results]
            row = {
                "program": name, "world_size": world, "layout": plan.layout,
                "chunk_pairs": plan.classes.numel(), "skipped_pairs": plan.skipped_pairs,
                "seconds_slowest_rank": slowest, "peak_mib_per_rank": memory,
                "single_process_attncc_s": base["attncc"], "single_process_sdpa_s": base["sdpa"],
            }  # fmt: skip
            rows.append(row)
            print(
                f"  P={world} {plan.layout:10s}: {plan.skipped_pairs:2d}/{plan.classes.numel():2d} chunk pairs skipped, "
                f"slowest rank {slowest * 1e3:7.0f} ms (single-process attncc / this {base['attncc'] / slowest:.2f}x, "
                f"SDPA / this {base['sdpa'] / slowest:.2f}x), peak MiB per rank {memory}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)  # (a missing folder failed after every measurement)
        meta = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, **cpu_meta()}
        args.json.write_text(
            json.dumps({**meta, "args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
