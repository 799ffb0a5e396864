"""Diff the device primitives between a real GPU and attncc's CUDA emulator, bit for bit.

Runs bench/probe_primitives.cu (mma m16n8k16 in fp16 and bf16 -- two m16n8k8 on sm75 --,
ldmatrix with and without .trans, shuffles) on random inputs twice: built by nvcc for the
current GPU and built for the host emulator with the same architecture's instruction choice.
Prints and optionally saves (JSON, with the device name) every mismatch. The `_int` mma cases
take small integers, whose products and sums are exact in fp32: they must match bit for bit
(fragment layouts); on random normals the tensor cores' internal accumulation order and
rounding may differ from the emulator's in the last bits (max |diff| says how much).

    python bench/probe_primitives.py --json bench/results/probe-<device>.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attncc.codegen.cuda import arch_number, storage_dtypes  # noqa: E402
from attncc.runtime.build import build_library, load_library  # noqa: E402
from attncc.runtime.gpu import device_target  # noqa: E402

PROBE = (ROOT / "bench" / "probe_primitives.cu").read_text()


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def run_case(lib: ctypes.CDLL, case: str, inputs: list[torch.Tensor], device: str) -> torch.Tensor:
    args = [t.to(device) for t in inputs]
    if case.startswith("mma"):
        out = torch.zeros(16, 8, device=device)
        status = getattr(lib, f"probe_{case.removesuffix('_int')}")(ptr(args[0]), ptr(args[1]), ptr(out))
    elif case.startswith("ldmatrix"):
        out = torch.zeros(32, 4, dtype=torch.int32, device=device)
        status = lib.probe_ldmatrix(ptr(args[0]), ptr(out), int(case.endswith("trans")))
    else:
        out = torch.zeros(5, 32, device=device)
        status = lib.probe_shuffles(ptr(args[0]), ptr(out))
    if status != 0:
        raise RuntimeError(f"probe {case} on {device}: launch refused ({lib.attncc_cuda_error().decode()})")
    if device == "cuda":
        torch.cuda.synchronize()
    return out.cpu()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    arch = device_target()
    source = f"#define ATTNCC_ARCH {arch_number(arch)}\n" + PROBE
    gpu = load_library(build_library(source, f"probe-{arch}", cuda_arch=arch))
    gpu.attncc_cuda_error.restype = ctypes.c_char_p
    emulated = f'#define ATTNCC_EMULATE 1\n#define ATTNCC_ARCH {arch_number(arch)}\n#include "probe_primitives.cu"\n'
    emu = load_library(build_library(emulated, f"probe-emulated-{arch}", {"probe_primitives.cu": PROBE}))
    gen = torch.Generator().manual_seed(0)
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cases": {},
    }
    cases = ["mma_f16", "mma_f16_int", "mma_bf16", "mma_bf16_int", "ldmatrix", "ldmatrix_trans", "shuffles"]
    if "bfloat16" not in storage_dtypes(arch):
        cases = [c for c in cases if not c.startswith("mma_bf16")]
    report["arch"] = arch
    for case in cases:
        mismatches, worst = 0, 0.0
        for _ in range(args.trials):
            if case.startswith("mma"):
                dtype = torch.float16 if case.startswith("mma_f16") else torch.bfloat16
                values = (
                    partial(torch.randint, -4, 5, generator=gen)
                    if case.endswith("_int")
                    else partial(torch.randn, generator=gen)
                )
                inputs = [values((16, 16)).to(dtype), values((8, 16)).to(dtype)]
            elif case.startswith("ldmatrix"):
                inputs = [torch.randn(16, 16, generator=gen).half()]
            else:
                inputs = [torch.randn(32, generator=gen)]
            a, b = run_case(gpu, case, inputs, "cuda"), run_case(emu, case, inputs, "cpu")
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                mismatches += 1
                worst = max(worst, (a.double() - b.double()).abs().max().item())
        report["cases"][case] = {"trials": args.trials, "bit_mismatches": mismatches, "max_abs_diff": worst}
        print(f"{case:16s} {args.trials} trials: {mismatches} bit mismatches (max |diff| {worst:.3g})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
