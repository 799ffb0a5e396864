"""Host time per call of the GPU code path: what a decoding step's attention costs the CPU
before any kernel runs (validation, plans, tile classes, packing the ABI), measured without a
GPU by running an emulated sm90 kernel whose library entry points are stubbed out (they return
at once). On a GPU the same Python runs, plus the launch itself and, for unplanned paged calls,
the copies of block_table and cache_seqlens to the host (a synchronisation each), which this
script cannot show.

Cases (bf16, d=128): decoding on padded K/V (MHA 32 heads B=1, GQA 32/8 B=8, M=4096), a
paged cache (GQA 32/8, B=8, pages of 16 shuffled, M=4096: equal lengths and ragged ones, with
one appended token), each without and with an `attncc.plan_paged` plan, and a packed batch's
forward (`varlen`: the same batch each call, a new one each call, one batch through a
`plan_varlen` plan), and a padded causal
prefill and decoding step with key ranges (the transformers integration's padding, B=8, N=2048
and N=1 M=4096, each layer's call after the first; a new step's, one key more each call). Medians of
`--repeats` timings of `--calls` calls.

With `--cuda` (on a GPU machine) the same cases run the real kernels: each timing enqueues
`--calls` calls without waiting for the GPU (their launches fit the launch queue, so the wall
time is the host's: validation, plans, allocations, the launches), then synchronises outside
the timed region; `--profile [CASE]` adds cProfile's top functions of one case (the first).
Each case also says where its time went (`phases`): in the library's entry points (on a GPU:
the CUDA launches, with the stub: none), in a kept launch's allocations and pointers around
them, and the rest (checks, the call's Python); session 59's planned paged call took 122 us
of host time on the H200's host where cProfile put no Python function above 25 us. On the H100
(session 29) an eager decoding call took ~48 us more than its CUDA-graph replay (MHA B=1
M=16K: 0.163 against 0.115 ms per call) where this script's emulated path says 13 us.

    python bench/bench_host.py [--cuda [--profile [CASE]]] [--json bench/results/host-<machine>.json]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import attncc  # noqa: E402
from attncc.runtime.emulate import EmulatedKernel  # noqa: E402
from bench.bench_cpu import cpu_meta  # noqa: E402


class StubLibrary:
    """A kernel library whose every entry point returns 0 (success) at once."""

    def __getattr__(self, name: str) -> Callable[..., int]:
        return lambda *args: 0


class HostOnlyKernel(EmulatedKernel):
    """The emulated sm90 kernel's host path, its library stubbed out, with a GPU's defaults
    for calls of few query rows (GpuKernel)."""

    short_query_tiles = key_split_warps = True

    def emulated_library(self, dtype: str, head_dim: int, value_dim: int | None = None) -> StubLibrary:  # type: ignore[override]
        return StubLibrary()


def host_path_kernel(program: str | Path, device: str) -> attncc.Kernel:
    """`program`'s kernel on the real GPU (device "cuda"), else on the stubbed sm90 host path."""
    if device == "cuda":
        return attncc.compile(program, target="cuda")
    return HostOnlyKernel(attncc.lower(program, "sm90"), "sm90")


def decode(kern: attncc.Kernel, B: int, H: int, Hkv: int, M: int, device: str = "cpu") -> Callable[[], object]:
    q = torch.randn(B, H, 1, 128, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(B, Hkv, M, 128, dtype=torch.bfloat16, device=device) for _ in range(2))
    return lambda: kern(q, k, v)


def paged(
    kern: attncc.Kernel, B: int, M: int, ragged: bool, planned: bool, device: str = "cpu"
) -> Callable[[], object]:
    H, Hkv, page = 32, 8, 16
    pages = B * M // page
    k_cache, v_cache = (torch.randn(pages, page, Hkv, 128, dtype=torch.bfloat16, device=device) for _ in range(2))
    table = torch.randperm(pages, device=device).view(B, M // page).int()
    lengths = torch.full((B,), M - 1, dtype=torch.int32, device=device)
    if ragged:
        lengths -= torch.arange(B, dtype=torch.int32, device=device) * 37
    q = torch.randn(B, 1, H, 128, dtype=torch.bfloat16, device=device)
    k_new, v_new = (torch.randn(B, 1, Hkv, 128, dtype=torch.bfloat16, device=device) for _ in range(2))
    if planned:
        plan = attncc.plan_paged(k_cache, table, lengths, new_tokens=1)
        return lambda: kern.paged(q, k_cache, v_cache, plan=plan, k_new=k_new, v_new=v_new)
    return lambda: kern.paged(q, k_cache, v_cache, table, lengths, k_new=k_new, v_new=v_new)


def varlen(
    kern: attncc.Kernel, fresh_lengths: bool, device: str = "cpu", planned: bool = False
) -> Callable[[], object]:
    """A packed batch's forward as bench_cuda's serving cases run it (8 sequences up to 4096 at
    50% padding, H=16, d=128); `fresh_lengths`: each call's lengths differ from the last
    PREPARED_CALLS_KEPT calls' (a training loop's new batch each step: the tile classes are
    classified per call), else every call repeats one batch (every layer of a model on it);
    `planned`: through an `attncc.plan_varlen` plan of that batch (no offsets read per call)."""
    from attncc.runtime.kernel import PREPARED_CALLS_KEPT
    from bench.bench_cpu import padded_lengths

    lengths = padded_lengths(8, 4096, 0.5)
    batches = []
    for shift in range(PREPARED_CALLS_KEPT + 1 if fresh_lengths else 1):  # one token moved between two sequences
        lens = [*lengths]
        lens[0], lens[-1] = lens[0] + shift, lens[-1] - shift
        batches.append(torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device))
    q, k, v = (torch.randn(sum(lengths), 16, 128, dtype=torch.bfloat16, device=device) for _ in range(3))
    calls = itertools.count()
    if planned:
        plan = attncc.plan_varlen(batches[0], batches[0])
        return lambda: kern.varlen(q, k, v, plan=plan)

    def call() -> object:
        offsets = batches[next(calls) % len(batches)]
        return kern.varlen(q, k, v, offsets, offsets)

    return call


def padded_with_ranges(
    N: int, M: int, device: str = "cpu", ranges_on: str | None = None, growing: bool = False
) -> Callable[[], object]:
    """The transformers integration's padded batch (a prefill, N = M, or a decoding step,
    N = 1): bottom-right causal with each sequence's key range (`kv_start`, `kv_end` int[B], on
    the CPU as the integration passes them, or on `ranges_on`), B=8, GQA 32/8 (every layer of
    a model calls it with the same ranges: from the second, a kept launch since session 57).
    `growing`: each call one key more, as each decoding step's first layer (a cache's
    view; new ranges): the full path, its tile classes anew."""
    from attncc.integrations.transformers import LayerNeeds, model_program

    program = model_program(LayerNeeds(causal=True, window=False, softcap=False, padding=True, dropout=False))
    kern = host_path_kernel(program, device)
    B, steps = 8, 1000 if growing else 0
    q = torch.randn(B, 32, N, 128, dtype=torch.bfloat16, device=device)
    k, v = (torch.randn(B, 8, M + steps, 128, dtype=torch.bfloat16, device=device) for _ in range(2))
    calls = itertools.count()

    def call() -> object:
        keys = M + next(calls) % (steps + 1)
        start, end = (torch.full((B,), n, dtype=torch.int64, device=ranges_on or "cpu") for n in (0, keys))
        start[1], end[0] = 300, keys - 348  # one left-padded sequence, one right-padded
        return kern(q, k[:, :, :keys], v[:, :, :keys], kv_start=start, kv_end=end)

    return call


class Phases:
    """Seconds spent in the kernel's library calls (`Kernel._launch`) and in kept launches
    (`KeptLaunch.__call__`, the library calls among them), by wrapping both while `measure`
    runs (and only then: the main timings take no wrapper): the call's path is unchanged (a
    profiler or a mode would send it through the op's dispatch)."""

    def __init__(self, kern: attncc.Kernel) -> None:
        self.kind = type(kern)
        self.library = self.kept = 0.0

    def _wrapped(self) -> tuple[Callable[..., object], Callable[..., object]]:
        """The wrappers of `_launch` and `KeptLaunch.__call__` (the originals are theirs)."""
        from attncc.runtime.kernel import KeptLaunch

        launch, kept_call = self.kind._launch, KeptLaunch.__call__

        def timed_launch(kernel: attncc.Kernel, *args: object, **kwargs: object) -> None:
            began = time.perf_counter()
            try:
                return launch(kernel, *args, **kwargs)
            finally:
                self.library += time.perf_counter() - began

        def timed_kept(kept: KeptLaunch, *args: object, **kwargs: object) -> object:
            began = time.perf_counter()
            try:
                return kept_call(kept, *args, **kwargs)
            finally:
                self.kept += time.perf_counter() - began

        return timed_launch, timed_kept

    def measure(self, call: Callable[[], object], calls: int, wait: Callable[[], None]) -> dict[str, float]:
        """us per call: all of it, in library calls, in kept launches outside their library
        calls (allocations, pointers), the rest (checks, the full path's plan and packing)."""
        from attncc.runtime.kernel import KeptLaunch

        originals = self.kind._launch, KeptLaunch.__call__
        self.kind._launch, KeptLaunch.__call__ = self._wrapped()  # type: ignore[method-assign]
        try:
            self.library = self.kept = 0.0
            wait()
            began = time.perf_counter()
            for _ in range(calls):
                call()
            total = time.perf_counter() - began
        finally:
            self.kind._launch, KeptLaunch.__call__ = originals  # type: ignore[method-assign]
        # (a kept launch's library call is inside it: only where no kept launch ran is it not)
        kept_outside = max(self.kept - self.library, 0.0)
        per_call = {"total": total, "library": self.library, "kept launch": kept_outside}
        per_call["rest"] = total - self.library - kept_outside
        return {name: seconds / calls * 1e6 for name, seconds in per_call.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--cuda", action="store_true", help="the real kernels on this machine's GPU")
    parser.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=0,
        metavar="CASE",
        help="cProfile's top functions of case CASE (0: the first)",
    )
    parser.add_argument("--sort", default="tottime", help="cProfile's order (tottime, cumtime)")
    args = parser.parse_args()
    program = ROOT / "examples" / "vanilla.attn"
    device = "cuda" if args.cuda else "cpu"
    kern = host_path_kernel(program, device)
    cases = [
        ("decode MHA B=1 H=32 M=4096", decode(kern, 1, 32, 32, 4096, device)),
        ("decode GQA 32/8 B=8 M=4096", decode(kern, 8, 32, 8, 4096, device)),
        ("paged GQA 32/8 B=8 M=4096 +1 appended", paged(kern, 8, 4096, False, False, device)),
        ("  the same with a plan", paged(kern, 8, 4096, False, True, device)),
        ("paged, ragged lengths", paged(kern, 8, 4096, True, False, device)),
        ("  the same with a plan (ragged)", paged(kern, 8, 4096, True, True, device)),
        ("varlen fwd 8 seqs <= 4096 H=16, one batch", varlen(kern, False, device)),
        ("  a new batch each call", varlen(kern, True, device)),
        ("  one batch, planned (plan_varlen)", varlen(kern, False, device, planned=True)),
        ("padded prefill with key ranges B=8 N=2048", padded_with_ranges(2048, 2048, device)),
        ("  the ranges on q's device (read back)", padded_with_ranges(2048, 2048, device, ranges_on=device)),
        ("padded decode with key ranges B=8 M=4096", padded_with_ranges(1, 4096, device)),
        ("  one key more each call (a new step)", padded_with_ranges(1, 4096, device, growing=True)),
    ]
    if args.profile is not None and not 0 <= args.profile < len(cases):  # (an IndexError after every timing)
        parser.error(f"--profile {args.profile}: expected a case from 0 to {len(cases) - 1}")
    rows = []
    meta = {**cpu_meta(), "torch": torch.__version__, "device": torch.cuda.get_device_name() if args.cuda else "none"}
    print(
        f"{meta['cpu_model']} ({meta['cpu_family_model']}), torch {torch.__version__}, {meta['device']}: "
        "host us per call (median)"
    )
    wait = torch.cuda.synchronize if args.cuda else lambda: None
    phases = Phases(kern)
    for name, call in cases:
        for _ in range(5):
            call()
        times = []
        for _ in range(args.repeats):
            wait()  # (outside the timing: the GPU's queue starts empty)
            began = time.perf_counter()
            for _ in range(args.calls):
                call()
            times.append((time.perf_counter() - began) / args.calls * 1e6)
        split = phases.measure(call, args.calls, wait)  # (one more timing, phase by phase)
        rows.append({"case": name.strip(), "host_us": statistics.median(times), "phases_us": split})
        said = ", ".join(f"{part} {us:.0f}" for part, us in split.items() if part != "total")
        print(f"{name:40s} {rows[-1]['host_us']:7.0f} us   ({said})", flush=True)
    if args.profile is not None:
        profiler = cProfile.Profile()
        wait()
        profiler.enable()
        for _ in range(args.calls):
            cases[args.profile][1]()
        profiler.disable()
        wait()
        pstats.Stats(profiler).sort_stats(args.sort).print_stats(30)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
