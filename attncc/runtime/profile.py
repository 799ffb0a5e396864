"""Performance counters of the generated CUDA kernels, from the emulator, and a roofline estimate.

The emulator runs the exact generated `.cu` text and sees every shared- and global-memory
access, mma, ldmatrix, shuffle, exp2 and barrier with the source line that issued it
(attncc/include/attncc/cuda/emulator.h, "performance counters"). `profile` runs a kernel's
forward (and backward) on the emulator with counting on; `report_text` prices them with
attncc/passes/roofline.py (the target's published rates, occupancy from ptxas registers and
shared memory per block) into a time per kernel and its bound. No GPU is needed; the rates are the reference
part's datasheet figures, to be calibrated against measured times when a GPU is lent.
"""

from __future__ import annotations

import ctypes
import json
from dataclasses import dataclass

import torch

from attncc.errors import AttnccError, BuildError
from attncc.passes.roofline import MMA_FLOPS, SECTOR_BYTES, Estimate, Work, estimate, forward_work
from attncc.passes.tiling import q_in_registers
from attncc.runtime.emulate import EmulatedKernel
from attncc.runtime.inputs import Shape, make_inputs
from attncc.targets import GPU_RATES

SHARED_OPS = ("ld.shared", "st.shared", "cp.async.shared", "ldmatrix")
GLOBAL_OPS = ("ld.global", "st.global", "atom.global", "cp.async.global")


@dataclass(frozen=True)
class Site:
    """One (source line, operation) of a kernel: warp requests and what they cost."""

    line: int
    op: str
    requests: int
    lanes: int
    wavefronts: int
    ideal_wavefronts: int
    sectors: int
    ideal_sectors: int
    bytes: int


@dataclass(frozen=True)
class KernelCounts:
    """A kernel's counters summed over its launches in one profiled call."""

    name: str
    launches: int
    blocks: int
    threads_per_block: int
    shared_bytes: int
    distinct_sectors: int
    sites: tuple[Site, ...]

    def total(self, field: str, ops: tuple[str, ...]) -> int:
        return sum(getattr(s, field) for s in self.sites if s.op in ops)

    def warp_instructions(self, op: str) -> int:
        return sum(s.requests for s in self.sites if s.op == op)

    def work(self, target: str) -> Work:
        """The counts in the roofline's units (sm75 issues each m16n8k16 as two m16n8k8)."""
        mma_flops = MMA_FLOPS // (2 if target == "sm75" else 1)
        return Work(
            blocks=self.blocks,
            threads_per_block=self.threads_per_block,
            shared_bytes=self.shared_bytes,
            mma_flops=mma_flops * self.warp_instructions("mma"),
            ex2=32 * self.warp_instructions("ex2"),
            shared_wavefronts=self.total("wavefronts", SHARED_OPS),
            l2_sectors=self.total("sectors", GLOBAL_OPS),
            dram_bytes=SECTOR_BYTES * self.distinct_sectors,
        )


def parse_counters(text: str) -> dict[str, KernelCounts]:
    """The emulator's JSON (attncc_emulator_counters) as KernelCounts per kernel name."""
    kernels = {}
    for name, k in json.loads(text).items():
        sites = tuple(Site(**s) for s in k.pop("sites"))
        kernels[name] = KernelCounts(name=name, sites=sites, **k)
    return kernels


def profile(
    kern: EmulatedKernel, shape: Shape, dtype: torch.dtype = torch.bfloat16, backward: bool = True, seed: int = 0
) -> dict[str, KernelCounts]:
    """Counters of every kernel one forward (and backward) call of `kern` launches at `shape`."""
    if not isinstance(kern, EmulatedKernel):
        raise AttnccError("profile: counters come from the CUDA emulator; compile with a GPU target and emulate=True")
    q, k, v, runtime = make_inputs(kern, shape, dtype, seed=seed, requires_grad=backward)
    storage = str(kern.storage_dtype(dtype)).removeprefix("torch.")
    assert kern.op.tiling is not None
    lib = kern.emulated_library(storage, kern.op.tiling.for_head_dim(shape.D).head_dim)
    lib.attncc_emulator_counters.restype = ctypes.c_char_p
    lib.attncc_emulator_profile(1)
    try:
        out = kern(q, k, v, **runtime)
        if backward:
            out.float().sum().backward()
        text = lib.attncc_emulator_counters().decode()
    finally:
        lib.attncc_emulator_profile(0)
    return parse_counters(text)


def ptxas_registers(kern: EmulatedKernel, dtype: torch.dtype, head_dim: int) -> dict[str, int]:
    """Registers per thread of each kernel as ptxas allocates them for the target; empty when no
    nvcc is installed (the estimate then assumes the register file is not the limit)."""
    from attncc.runtime.nvcc import compile_cuda

    storage = str(kern.storage_dtype(dtype)).removeprefix("torch.")
    assert kern.op.tiling is not None
    try:
        report = compile_cuda(kern.cuda_source(storage, kern.op.tiling.for_head_dim(head_dim).head_dim), kern.target)
    except BuildError:
        return {}
    return {k.name: k.registers for k in report.kernels}


def _ratio(value: int, ideal: int) -> str:
    return f"{value / ideal:.2f}x ideal" if ideal else "-"


def report_text(
    counts: dict[str, KernelCounts], target: str, source: str, registers: dict[str, int], top: int = 8
) -> str:
    """What `attncc profile` prints: per kernel, the instruction mix per warp, memory requests
    against their ideal, occupancy and the estimate; then its costliest source lines."""
    rates = GPU_RATES[target]
    lines = source.splitlines()
    out = [f"// counters from the CUDA emulator; estimate for {target} ({rates.part}, published rates)"]
    for name, k in counts.items():
        warps = k.blocks * -(-k.threads_per_block // 32)
        est = estimate(k.work(target), target, registers.get(name), name)
        regs = f"{registers[name]} registers (ptxas)" if name in registers else "registers unknown (no nvcc)"
        out.append(
            f"{name}: {k.launches} launch(es), {k.blocks} blocks x {k.threads_per_block} threads, "
            f"{k.shared_bytes} B shared, {regs}: {est.blocks_per_sm} block(s)/SM (limit: {est.limiter})"
        )
        mix = ", ".join(
            f"{op} {k.warp_instructions(op) / warps:.1f}"
            for op in ("mma", "ldmatrix", "cp.async.shared", "ex2", "shfl", "bar.sync", "ld.shared", "st.shared",
                       "ld.global", "st.global", "atom.global")
            if k.warp_instructions(op)
        )  # fmt: skip
        out.append(f"  per warp: {mix}")
        wavefronts, ideal_w = k.total("wavefronts", SHARED_OPS), k.total("ideal_wavefronts", SHARED_OPS)
        sectors, ideal_s = k.total("sectors", GLOBAL_OPS), k.total("ideal_sectors", GLOBAL_OPS)
        out.append(
            f"  shared: {wavefronts} wavefronts ({_ratio(wavefronts, ideal_w)}); global: {sectors} sectors "
            f"({_ratio(sectors, ideal_s)}), {SECTOR_BYTES * k.distinct_sectors} distinct bytes"
        )
        terms = ", ".join(f"{t} {1e6 * s:.2f}" for t, s in est.terms.items())
        out.append(f"  estimate {1e6 * est.seconds:.2f} us, bound: {est.bound} (us: {terms})")
        costly = sorted(
            (s for s in k.sites if s.wavefronts > s.ideal_wavefronts or s.sectors > s.ideal_sectors),
            key=lambda s: -max(s.wavefronts - s.ideal_wavefronts, s.sectors - s.ideal_sectors),
        )
        for s in costly[:top]:
            what = (
                f"{s.wavefronts / s.requests:.2f} wavefronts/request (ideal {s.ideal_wavefronts / s.requests:.2f})"
                if s.op in SHARED_OPS
                else f"{s.sectors / s.requests:.2f} sectors/request (ideal {s.ideal_sectors / s.requests:.2f})"
            )
            text = lines[s.line - 1].strip() if 0 < s.line <= len(lines) else ""
            out.append(f"    line {s.line} {s.op}: {s.requests} requests, {what}: {text[:90]}")
    return "\n".join(out)


def scaled(counts: dict[str, KernelCounts], shape: Shape, batch: int, heads: int) -> dict[str, KernelCounts]:
    """The counts of `shape` repeated for `batch` x `heads` sequences: blocks, requests and
    distinct sectors grow by the ratio (each (b, h) runs its own blocks over its own rows).
    Exact for programs whose work does not depend on b or h; GQA keeps its group size."""
    if batch < 1 or heads < 1 or heads % max(shape.H // shape.Hkv, 1):
        raise AttnccError(f"--batch-heads {batch},{heads}: expected positive B and H, H a multiple of the GQA group")
    factor = batch * heads / (shape.B * shape.H)

    def times(n: int) -> int:
        return round(n * factor)

    result = {}
    for name, k in counts.items():
        sites = tuple(
            Site(s.line, s.op, *(times(getattr(s, f)) for f in Site.__dataclass_fields__ if f not in ("line", "op")))
            for s in k.sites
        )
        result[name] = KernelCounts(
            name, k.launches, times(k.blocks), k.threads_per_block, k.shared_bytes, times(k.distinct_sectors), sites
        )
    return result


def forward_estimate(
    kern: EmulatedKernel, q: torch.Tensor, k: torch.Tensor, registers: int | None = None, **runtime: object
) -> Estimate:
    """The tiling pass's model of the unsplit forward (`forward_work`) at this call's shape and
    visible tiles (the sparsity analysis's classes), priced for the kernel's target: what
    bench/bench_cuda.py prints beside each measured forward, to calibrate the rates."""
    plan = kern.plan(q, k, None)
    classes = kern.tile_classes(q, k, **runtime)
    p = plan.problem
    visible = int((classes != 0).sum()) * (p.B // classes.shape[0]) * (p.H // classes.shape[1])
    tiles = plan.tiles
    work = forward_work(
        tiles.head_dim,
        tiles.block_rows,
        tiles.block_cols,
        p,
        q_in_registers(tiles.head_dim, tiles.warp_rows),
        visible,
        tiles.warp_rows,
    )
    return estimate(work, kern.target, registers, kern.name)
