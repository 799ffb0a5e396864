"""Kernels for Nsight Compute, in a profiler range (ncu --profile-from-start off):

    the default: one dense bf16 forward and backward (B=4 H=16 N=4096 d=128);
    --backward: dense bf16 forward and backward at d=64 and d=128 (B=4 H=16 N=4096, the backward
    tile sweep's problem), for the backward's stall reasons (`gpu_session.sh stalls`);
    --decode: bf16 decoding at d=128, one query, M=64K, B=8: MHA 32/32 on the key-split forward
    unsplit and on the 64-row one, GQA 32/8 on the key-split forward (its split count, and the
    merge), and GQA 32/8 from a paged cache (pages of 16, shuffled, planned).

ncu --profile-from-start off --section SpeedOfLight ... python3 bench/profile_cuda.py [--decode]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402
from bench.bench_cuda import paged_decode_operands  # noqa: E402


def profiled(label: str, call: Callable[[], object]) -> None:
    """`call` once outside the profiler (builds, loads, plans) and once inside its range."""
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", label, flush=True)


def dense(d: int = 128) -> None:
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="cuda")
    q, k, v = (torch.randn(4, 16, 4096, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def step() -> None:
        out = kern(q, k, v)
        out.backward(torch.ones_like(out))

    profiled(f"dense d={d} forward and backward: {kern.plan(q, k, None, backward=True)}", step)


def decode(B: int = 8, M: int = 65536) -> None:
    program = ROOT / "examples" / "vanilla.attn"
    key_split, rows64 = (attncc.compile(program, target="cuda") for _ in range(2))
    rows64.key_split_warps = False
    q = torch.randn(B, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, 32, M, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    profiled(f"MHA B={B} M={M} key-split", lambda: key_split(q, k, v))
    profiled(f"MHA B={B} M={M} 64 rows", lambda: rows64(q, k, v))
    k, v = (t[:, :8].contiguous() for t in (k, v))
    profiled(f"GQA 32/8 B={B} M={M} key-split", lambda: key_split(q, k, v))
    q, k_cache, v_cache, table, lengths, _, _ = paged_decode_operands(B, M)
    plan = attncc.plan_paged(k_cache, table, lengths)
    profiled(f"paged GQA 32/8 B={B} M={M} key-split", lambda: key_split.paged(q, k_cache, v_cache, plan=plan))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--decode", action="store_true")
    mode.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    if args.decode:
        decode()
    else:
        for d in (64, 128) if args.backward else (128,):
            dense(d)
