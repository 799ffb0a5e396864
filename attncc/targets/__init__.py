"""Targets as data: the hardware facts the tiling pass and the cost model read.

Adding a GPU is adding a table row. `cpu()` reads the cache sizes of the machine it runs on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from attncc.errors import AttnccError


@dataclass(frozen=True)
class Target:
    """Facts about one compilation target.

    onchip_bytes: the fast memory a tile set must fit (per core L2 on CPUs, shared memory per
    block on GPUs); l1_bytes: the innermost cache (CPU) or 0; vector_bytes: SIMD width (CPU);
    registers_per_sm / max_registers_per_thread / warp_size / mma_shape: GPU facts;
    multiprocessors: the SM count of the target's reference part (T4, A100, A40, H100 SXM),
    for call-time decisions where no device can be asked (the emulator); a real GPU's own
    count is used on it.
    """

    name: str
    kind: str  # "cpu" | "cuda"
    onchip_bytes: int
    l1_bytes: int = 0
    vector_bytes: int = 64
    cores: int = 1
    sm_version: int = 0
    shared_bytes_per_sm: int = 0
    registers_per_sm: int = 0
    max_registers_per_thread: int = 0
    max_threads_per_block: int = 0
    warp_size: int = 32
    mma_shape: tuple[int, int, int] = (0, 0, 0)
    multiprocessors: int = 0


def _cache_sizes() -> dict[tuple[int, str], int]:
    """(level, type) -> bytes for cpu0, from sysfs; empty where sysfs is unavailable."""
    sizes: dict[tuple[int, str], int] = {}
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in sorted(base.glob("index*")) if base.exists() else []:
        try:
            level = int((index / "level").read_text())
            kind = (index / "type").read_text().strip()
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
        sizes[(level, kind)] = int(text.rstrip("KM")) * unit
    return sizes


@cache
def cpu() -> Target:
    """The host CPU: L1d and L2 per core read from the machine (defaults 32 KiB / 1 MiB)."""
    sizes = _cache_sizes()
    l1 = sizes.get((1, "Data"), 32 * 1024)
    l2 = sizes.get((2, "Unified"), 1024 * 1024)
    return Target("cpu", "cpu", onchip_bytes=l2, l1_bytes=l1, vector_bytes=64, cores=os.cpu_count() or 1)


# Shared memory is the opt-in per-block maximum; registers per SM are 64K 32-bit registers.
GPUS = {
    "sm75": Target("sm75", "cuda", onchip_bytes=64 * 1024, sm_version=75, shared_bytes_per_sm=64 * 1024,
                   registers_per_sm=65536, max_registers_per_thread=255, max_threads_per_block=1024,
                   mma_shape=(16, 8, 8), multiprocessors=40),
    "sm80": Target("sm80", "cuda", onchip_bytes=163 * 1024, sm_version=80, shared_bytes_per_sm=164 * 1024,
                   registers_per_sm=65536, max_registers_per_thread=255, max_threads_per_block=1024,
                   mma_shape=(16, 8, 16), multiprocessors=108),
    "sm86": Target("sm86", "cuda", onchip_bytes=99 * 1024, sm_version=86, shared_bytes_per_sm=100 * 1024,
                   registers_per_sm=65536, max_registers_per_thread=255, max_threads_per_block=1024,
                   mma_shape=(16, 8, 16), multiprocessors=84),
    "sm90": Target("sm90", "cuda", onchip_bytes=227 * 1024, sm_version=90, shared_bytes_per_sm=228 * 1024,
                   registers_per_sm=65536, max_registers_per_thread=255, max_threads_per_block=1024,
                   mma_shape=(16, 8, 16), multiprocessors=132),
}  # fmt: skip


def get_target(name: str | Target) -> Target:
    if isinstance(name, Target):
        return name
    if name == "cpu":
        return cpu()
    if name in GPUS:
        return GPUS[name]
    raise AttnccError(f"unknown target `{name}`; expected one of cpu, {', '.join(GPUS)}")
