"""Builds here, where nvcc runs without a GPU, the sm90 libraries a device lease uses, and packs
them for `carry`: a lease's 15 minutes then go to running kernels, not to nvcc.

Covers `bash bench/gpu_session.sh lease`: the golden tests (tests/test_gpu.py: every example in
fp16 and bf16 at head dims 64, 128 and 256; Dv != D, rope, fp8 K/V and fp8 products at the
shapes the tests import; paged calls, CUDA graphs, the context-parallel ring), the benchmark (warps of 16 and 32 rows, fp8), the decoding sweep and the backward's.
A library left out is built on the GPU machine as before. The keys are the ones a GPU
machine's `attncc.compile(..., target="cuda")` looks for on an H100 or H200 (sm90), whatever
its torch build (attncc.runtime.build.portable_key).

    python bench/gpu_prebuild.py          # -> .gpu/prebuilt.tar.xz (.gpu/ is ignored by git)
"""

from __future__ import annotations

import argparse
import itertools
import lzma
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402
from attncc.passes.tiling import GPU_KEY_SPLIT_ROWS  # noqa: E402
from attncc.runtime.build import prebuilding_into  # noqa: E402
from attncc.runtime.gpu import GpuKernel  # noqa: E402
from bench.sweep_tiles_cuda import (  # noqa: E402
    BACKWARD_SWEEP_LIGHT_PLANS,
    BACKWARD_SWEEP_PLANS,
    backward_plans,
    with_backward_plan,
)

TARGET = "sm90"  # the H100 and H200 the device tool lends
ARCHIVE = ROOT / ".gpu" / "prebuilt.tar.xz"


def kernel(program: str | Path, tiles: tuple[int, int] | None = None, warp_rows: int | None = None) -> GpuKernel:
    """As `attncc.compile(program, target="cuda", ...)` makes it on an sm90 GPU."""
    return GpuKernel(attncc.lower(program, TARGET, tiles, warp_rows), TARGET)


def example(name: str) -> Path:
    return ROOT / "examples" / f"{name}.attn"


def lease_builds() -> list[Callable[[], object]]:
    """One thunk per library (the same library listed twice builds once)."""
    from tests.conftest import EXAMPLES
    from tests.test_context_parallel import program as context_parallel_program
    from tests.test_cuda import DECODING_PROGRAMS, KEY_SPLIT_SHAPES
    from tests.test_fp8 import EMULATED_SHAPES as FP8_SHAPES
    from tests.test_gpu import GPU_CONTEXT_PARALLEL_JOBS
    from tests.test_rope import CASES as ROPE_CASES
    from tests.test_rope import program as rope_program
    from tests.test_serving import BOTTOM_RIGHT_CAUSAL
    from tests.test_value_head_dim import EMULATED_SHAPES as VALUE_DIM_SHAPES

    fp16, bf16 = torch.float16, torch.bfloat16
    fp8 = [torch.float8_e4m3fn, torch.float8_e5m2]
    builds: list[Callable[[], object]] = []

    def prebuild(
        kern: GpuKernel, dtypes: list[torch.dtype], dims: list[int], kv: list[torch.dtype] = (), paged: bool = False
    ) -> None:
        builds.extend(lambda d=d, t=t: kern.prebuild([t], [d], kv, paged) for t in dtypes for d in dims)

    def decoding_variants(kern: GpuKernel, head_dim: int = 128) -> list[GpuKernel]:
        """`kern` and the forwards that calls of few query rows run (GpuKernel.for_rows: warps
        splitting each key tile, the 64-row forward), and all again with a GQA group's query
        heads folded into rows."""
        return kern.deployed_forwards(head_dim)  # type: ignore[return-value]

    for name in EXAMPLES:  # test_gpu_forward_backward_match_fp64, test_gpu_32_row_warps_match_fp64 (and the bench)
        prebuild(kernel(example(name)), [fp16, bf16], [64, 128, 256])
        for rows in (16, 32):  # (one of them is the default)
            prebuild(kernel(example(name), warp_rows=rows), [bf16], [64, 128])
    for name in ("alibi", "gpt2", "document"):  # Dv != D
        for kern in decoding_variants(kernel(example(name))):
            builds.extend(lambda kern=kern, s=s: kern.library_path_for("bfloat16", s.D, s.Dv) for s in VALUE_DIM_SHAPES)
    for label, q_args, k_args, _ in ROPE_CASES:
        for kern in decoding_variants(kernel(rope_program(label, q_args, k_args))):
            prebuild(kern, [bf16], [64, 128])
    for name in ("alibi", "gpt_oss"):  # fp8 K/V widened
        for kern in decoding_variants(kernel(example(name))):
            for s in FP8_SHAPES:
                for fmt in ("float8_e4m3fn", "float8_e5m2"):
                    builds.append(lambda kern=kern, s=s, fmt=fmt: kern.library_path_for(f"bfloat16+{fmt}", s.D, s.Dv))
    for name in ("vanilla", "causal"):  # fp8 products (tests, bench)
        kern = kernel(example(name))
        kern.fp8_mma = True
        for each in decoding_variants(kern):  # (and vanilla's paged decoding: bench)
            prebuild(each, [bf16], [64, 128], fp8, paged=name == "vanilla")
    for tiles in ((64, 32), (64, 64), (32, 64)):  # the forward sweep's overrides
        prebuild(kernel(example("vanilla"), tiles), [bf16], [64, 128])
    for name, d in itertools.product(("vanilla", "causal"), (64, 128)):  # the backward sweep's tiles
        for plan, _ in backward_plans(TARGET, d, BACKWARD_SWEEP_PLANS, BACKWARD_SWEEP_LIGHT_PLANS):
            prebuild(with_backward_plan(kernel(example(name)), d, plan), [bf16], [d])
    vanilla = kernel(example("vanilla"))  # the decoding sweep's key-split forwards, in place and paged
    for base, rows, stages in itertools.product(
        (vanilla, vanilla.with_folded_query_heads()), GPU_KEY_SPLIT_ROWS, (None, 2)
    ):
        prebuild(base.for_key_split_warps(rows, stages), [bf16], [128], paged=True)
    for name in ("alibi", "dropout", "gpt_oss", "padding"):  # key-split decoding (test_gpu_key_split_decoding...)
        base = kernel(DECODING_PROGRAMS.get(name) or example(name))
        folded = base.with_folded_query_heads()
        split = [k.for_key_split_warps(rows) for k in (base, folded) for rows in GPU_KEY_SPLIT_ROWS]
        for kern in (base, folded, *split):
            prebuild(kern, [bf16], sorted({shape.D for shape, _ in KEY_SPLIT_SHAPES}))
    for kern in decoding_variants(kernel(BOTTOM_RIGHT_CAUSAL)):  # paged decoding and prefill, CUDA graphs
        prebuild(kern, [bf16], [128], paged=True)
    from attncc.integrations.transformers import LayerNeeds, model_program  # bench_host.py's padded prefill

    padded = model_program(LayerNeeds(causal=True, window=False, softcap=False, padding=True, dropout=False))
    for kern in decoding_variants(kernel(padded)):  # (and its decoding step: built on the device before)
        prebuild(kern, [bf16], [128])
    for job in GPU_CONTEXT_PARALLEL_JOBS:  # the ring on one GPU: each chunk pair's kernel, and the whole call's
        whole = kernel(context_parallel_program(job["name"]))
        for kern in (*decoding_variants(whole), *decoding_variants(whole.at_global_positions())):
            builds.append(lambda kern=kern, job=job: kern.library_path_for("bfloat16", job["D"], job["Dv"]))
    return builds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=2, help="nvcc processes at once")
    parser.add_argument("-o", "--output", type=Path, default=ARCHIVE)
    parser.add_argument(
        "--update", action="store_true", help="start from the archive's libraries: build only the ones it lacks"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "prebuilt"
        if args.update and args.output.exists():  # (a library whose digest is there is not built again)
            with tarfile.open(args.output) as archive:
                archive.extractall(directory, filter="data")

        def built_into_directory(build: Callable[[], object]) -> object:
            with prebuilding_into(directory):  # (it holds for its own thread: each worker enters it)
                return build()

        with ThreadPoolExecutor(args.jobs) as pool:
            built = list(pool.map(built_into_directory, lease_builds()))
        # (with --update, the archive's libraries that no build asks for any more stay out)
        wanted = {path.parent.name for result in built for path in (result if isinstance(result, list) else [result])}
        libraries = sorted(p.relative_to(directory) for p in directory.glob("*/kernel.so*") if p.parent.name in wanted)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        # only the libraries and their digests travel; xz finds the CUDA runtime each one links
        # (at its extreme preset: 636 libraries took 59.1 MB at the default, 53.8 at 9e, and the
        # carry limit is 64 MiB with the working tree; a few minutes more here)
        with tarfile.open(args.output, "w:xz", preset=9 | lzma.PRESET_EXTREME) as archive:
            for library in libraries:
                archive.add(directory / library, arcname=str(library))
    count = sum(1 for p in libraries if p.name == "kernel.so")
    size = args.output.stat().st_size / 2**20
    print(f"{count} {TARGET} libraries in {time.perf_counter() - start:.0f} s -> {args.output} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
