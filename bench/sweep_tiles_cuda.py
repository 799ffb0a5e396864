"""Forward tile sweep on a GPU: the dense bf16 forward (B=4 H=16 N=4096) at each (Br, Bc) the
`tiles=` override takes (Br, Bc up to 64), against the roofline's choice, for calibrating the tiling pass.

    python bench/sweep_tiles_cuda.py --dims 64 128
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402
from bench.bench_cuda import median_ms  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()
    program = ROOT / "examples" / "vanilla.attn"
    variants = {(d, tiles): None for d in args.dims for tiles in [None, (64, 32), (64, 64), (32, 64)]}
    kernels = {key: attncc.compile(program, target="cuda", tiles=key[1]) for key in variants}
    with ThreadPoolExecutor(16) as pool:  # nvcc is single-threaded: build every variant at once
        list(pool.map(lambda key: kernels[key].library_path_for("bfloat16", key[0]), kernels))
    print(f"{torch.cuda.get_device_name()}: dense bf16 forward, B=4 H=16 N=4096", flush=True)
    for (d, tiles), kern in kernels.items():
        q, k, v = (torch.randn(4, 16, 4096, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        plan = kern.plan(q, k, None).tiles
        ms = median_ms(partial(kern, q, k, v), 15, 5)
        flops = 4 * 4 * 16 * 4096 * 4096 * d
        label = "roofline" if tiles is None else "override"
        print(f"d={d:3d} {label:8s} Br={plan.block_rows:3d} Bc={plan.block_cols:3d} warps={plan.warps}: "
              f"{ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
