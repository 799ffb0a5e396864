"""Targets as data: the hardware facts the tiling pass and the cost model read.

Adding a GPU is adding a table row. `cpu()` reads the cache sizes and the instruction-set
features of the machine it runs on, and picks the fastest CPU kernel ISA the machine runs (or the
one `ATTNCC_CPU_ISA` forces, any level the machine runs).
"""

from __future__ import annotations

import ctypes
import os
import platform
import warnings
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from attncc.errors import AttnccError


@dataclass(frozen=True)
class Target:
    """Facts about one compilation target.

    onchip_bytes: the fast memory a tile set must fit (per core L2 on CPUs, shared memory per
    block on GPUs); l1_bytes: the innermost cache (CPU) or 0; isa: the CPU kernel ISA (a key of
    CPU_ISAS), whose vector_bytes (SIMD width), vector_registers and compile_flags are copied
    here; fma_ports: vector FMA issue per cycle (CPU); features: the ISA extensions the machine
    reports (CPU, for the plan's printout);
    registers_per_sm / max_registers_per_thread / warp_size / mma_shape: GPU facts; fp8_mma:
    the tensor cores multiply fp8 (e4m3/e5m2, mma m16n8k32: sm_89 and newer);
    multiprocessors: the SM count of the target's reference part (T4, A100, A40, L40S, H100 SXM),
    for call-time decisions where no device can be asked (the emulator); a real GPU's own
    count is used on it.
    """

    name: str
    kind: str  # "cpu" | "cuda"
    onchip_bytes: int
    l1_bytes: int = 0
    vector_bytes: int = 64
    cores: int = 1
    isa: str = ""
    vector_registers: int = 0
    fma_ports: int = 0
    compile_flags: tuple[str, ...] = ()
    features: tuple[str, ...] = ()
    sm_version: int = 0
    shared_bytes_per_sm: int = 0
    registers_per_sm: int = 0
    max_registers_per_thread: int = 0
    max_threads_per_block: int = 0
    warp_size: int = 32
    mma_shape: tuple[int, int, int] = (0, 0, 0)
    multiprocessors: int = 0
    fp8_mma: bool = False


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


@dataclass(frozen=True)
class CpuIsa:
    """One level of CPU kernel: what the machine must report (`requires`, /proc/cpuinfo flag
    names), the SIMD registers it gives the micro-kernels and the compiler flags that select it."""

    name: str
    requires: frozenset[str]
    vector_bytes: int
    vector_registers: int
    march: str
    extra_flags: tuple[str, ...] = ()
    bf16_products: str = ""  # "amx" | "dpbf16" | "": how bf16 tile products run (else widened to fp32)


# Best first. The kernels are generated for a level's vector width and register count
# (passes/tiling.py `choose_micro_kernel`); each level's -march is the x86-64 micro-architecture
# level (gcc >= 11) holding exactly the features it requires, so a forced lower level really
# runs the lower instructions on a better machine. -mtune=native keeps the machine's scheduling.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx2", "fma"})
CPU_ISAS: dict[str, CpuIsa] = {
    "amx": CpuIsa("amx", _AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, 64, 32, "x86-64-v4",
                  ("-mavx512bf16", "-mamx-tile", "-mamx-bf16"), "amx"),
    "avx512bf16": CpuIsa("avx512bf16", _AVX512 | {"avx512_bf16"}, 64, 32, "x86-64-v4", ("-mavx512bf16",), "dpbf16"),
    "avx512": CpuIsa("avx512", _AVX512, 64, 32, "x86-64-v4"),
    "avx2": CpuIsa("avx2", frozenset({"avx2", "fma", "f16c", "bmi2"}), 32, 16, "x86-64-v3"),
    "generic": CpuIsa("generic", frozenset(), 16, 16, "x86-64-v2"),
}  # fmt: skip
# Reported for the plan (attncc explain).
REPORTED_FEATURES = ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f", "avx2", "fma")
ISA_ENV = "ATTNCC_CPU_ISA"
NATIVE_FLAGS = ("-march=native",)  # for code built for no particular level (off x86, test harnesses)


def cpu_features(cpuinfo: str | None = None) -> frozenset[str]:
    """The instruction-set flags of cpu0 (/proc/cpuinfo, or `cpuinfo` text); empty where it
    cannot be read."""
    return frozenset(_cpuinfo_field("flags", cpuinfo).split())


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """cpu0's vendor_id (/proc/cpuinfo, or `cpuinfo` text: "GenuineIntel", "AuthenticAMD");
    empty where unknown."""
    return _cpuinfo_field("vendor_id", cpuinfo).strip()


def _cpuinfo_field(name: str, text: str | None = None) -> str:
    """The value of cpu0's field `name` in /proc/cpuinfo (or `text` in its format): the first
    line whose key is exactly `name` ("flags", not "vmx flags")."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return ""
    line = next((line for line in text.splitlines() if line.split(":")[0].strip() == name), "")
    return line.partition(":")[2]


# vdpbf16ps FLOPs per cycle over fp32 FMA FLOPs per cycle, by vendor (bench/peak_cpu.py, every
# core issuing independent instructions): AMD's Zen 4 runs it at twice the FMAs' rate (466 vs
# 234 GFLOP/s on 2 cores, session 68), Intel's cores at half of it (Emerald Rapids 6/207 with
# AMX hidden by its VM: 172 vs 352 GFLOP/s, session 70), where the bf16 kernels widened to
# fp32 ran 1.6-1.9x faster than on vdpbf16ps. A vendor not listed keeps the dot products.
DPBF16_RATE_OVER_FMA = {"AuthenticAMD": 2.0, "GenuineIntel": 0.5}
AMX_FEATURES = frozenset({"amx_tile", "amx_bf16", "amx_fp16", "amx_int8"})


def _pays(isa: CpuIsa, vendor: str) -> bool:
    """Whether a level's bf16 unit beats the fp32 FMAs the level below widens bf16 onto."""
    return isa.bf16_products != "dpbf16" or DPBF16_RATE_OVER_FMA.get(vendor, 2.0) > 1.0


def runs_cpu_isa(name: str, features: frozenset[str], machine: str | None = None) -> bool:
    """Whether a machine with these flags runs the level's instructions (off x86, the portable
    level alone)."""
    if (machine or platform.machine()) not in ("x86_64", "AMD64"):
        return name == "generic"
    return CPU_ISAS[name].requires <= features


def best_cpu_isa(features: frozenset[str], machine: str | None = None, vendor: str | None = None) -> str:
    """The fastest level the machine runs: the first of CPU_ISAS whose requirements it meets and
    whose bf16 unit is faster there than the fp32 FMAs (`DPBF16_RATE_OVER_FMA`, by `vendor`,
    default the machine's); x86-64 only: elsewhere the portable level, compiled for the host's
    own -march."""
    vendor = cpu_vendor() if vendor is None else vendor
    return next(name for name, isa in CPU_ISAS.items() if runs_cpu_isa(name, features, machine) and _pays(isa, vendor))


def best_cpu_isa_without_amx(features: frozenset[str]) -> str:
    """The fastest level the machine runs where Linux refuses this process AMX tile data."""
    return best_cpu_isa(features - AMX_FEATURES)


def select_cpu_isa(features: frozenset[str], forced: str | None, vendor: str | None = None) -> str:
    """The machine's best level, or `forced` (ATTNCC_CPU_ISA) when it names a level the machine
    runs (a slower one included, to test or measure it); a level the machine cannot run or an
    unknown name is an error, not a silent fallback."""
    best = best_cpu_isa(features, vendor=vendor)
    if not forced:
        return best
    if forced not in CPU_ISAS:
        raise AttnccError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(CPU_ISAS)}")
    if not runs_cpu_isa(forced, features):
        if platform.machine() not in ("x86_64", "AMD64"):
            raise AttnccError(f"{ISA_ENV}={forced!r}: this machine is not x86-64; its only CPU kernel ISA is generic")
        missing = ", ".join(sorted(CPU_ISAS[forced].requires - features))
        raise AttnccError(f"{ISA_ENV}={forced!r}: this machine lacks {missing}; its best CPU kernel ISA is {best}")
    return forced


@cache
def _cpu_target(isa_name: str) -> Target:
    sizes = _cache_sizes()
    l1 = sizes.get((1, "Data"), 32 * 1024)
    l2 = sizes.get((2, "Unified"), 1024 * 1024)
    isa = CPU_ISAS[isa_name]
    x86 = platform.machine() in ("x86_64", "AMD64")
    flags = (f"-march={isa.march}", "-mtune=native", *isa.extra_flags) if x86 else NATIVE_FLAGS
    features = cpu_features()
    return Target(
        "cpu", "cpu", onchip_bytes=l2, l1_bytes=l1, vector_bytes=isa.vector_bytes, cores=os.cpu_count() or 1,
        isa=isa.name, vector_registers=isa.vector_registers, fma_ports=2, compile_flags=flags,
        features=tuple(f for f in REPORTED_FEATURES if f in features),
    )  # fmt: skip


def cpu() -> Target:
    """The host CPU: L1d and L2 per core read from the machine (defaults 32 KiB / 1 MiB), and the
    kernel ISA: the fastest the machine runs, or the one ATTNCC_CPU_ISA names. Every x86 server
    core of the families we run on (Zen 3/4/5, Sapphire and Emerald Rapids) issues two vector
    FMAs per cycle."""
    features = cpu_features()
    name = select_cpu_isa(features, os.environ.get(ISA_ENV, "").strip() or None)
    if CPU_ISAS[name].bf16_products == "amx" and not amx_permitted():
        name = best_cpu_isa_without_amx(features)
        warnings.warn(
            f"attncc: Linux refused this process AMX tile data (arch_prctl); CPU kernels use {name}", stacklevel=2
        )
    return _cpu_target(name)


SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86-64 Linux


@cache
def amx_permitted() -> bool:
    """Whether this process may run AMX instructions: Linux (5.16+) faults on them until the
    process asks for the tile-data state with arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
    The permission is per process (kernels in any thread may then use it), so it is asked once
    here, before any AMX kernel is built or run; the kernels ask again and fail cleanly if refused."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


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
    "sm89": Target("sm89", "cuda", onchip_bytes=99 * 1024, sm_version=89, shared_bytes_per_sm=100 * 1024,
                   registers_per_sm=65536, max_registers_per_thread=255, max_threads_per_block=1024,
                   mma_shape=(16, 8, 16), multiprocessors=142, fp8_mma=True),
    "sm90": Target("sm90", "cuda", onchip_bytes=227 * 1024, sm_version=90, shared_bytes_per_sm=228 * 1024,
                   registers_per_sm=65536, max_registers_per_thread=255, max_threads_per_block=1024,
                   mma_shape=(16, 8, 16), multiprocessors=132, fp8_mma=True),
}  # fmt: skip


@dataclass(frozen=True)
class GpuRates:
    """Throughputs of a GPU target's reference part, for the emulator's roofline estimate
    (attncc/runtime/profile.py). Published figures (datasheets, whitepapers, the CUDA
    programming guide's throughput table), not measured by attncc; calibrate them on a GPU.

    clock_hz: boost clock; mma_flops_per_sm_clock: dense fp16/bf16 FLOPs per SM and clock that
    mma.sync reaches (on sm90 about 2/3 of wgmma's peak, FlashAttention-3 paper section 2);
    ex2_per_sm_clock: special-function unit results; fp32_per_sm_clock: FMA lanes;
    l2_bytes_per_sm_clock: L2 to SM bandwidth per SM; dram_bytes_per_s: HBM/GDDR bandwidth;
    shared memory serves one 128-byte wavefront per SM and clock on all of them; the SM runs
    up to max_threads_per_sm threads in max_blocks_per_sm blocks, a warp on one of 4 sub-partitions
    (each with its own tensor core and quarter of the SFUs); reserved_shared_per_block: shared
    memory the runtime keeps per resident block (sm80+).
    """

    part: str
    clock_hz: float
    mma_flops_per_sm_clock: int
    ex2_per_sm_clock: int
    fp32_per_sm_clock: int
    l2_bytes_per_sm_clock: int
    dram_bytes_per_s: float
    max_threads_per_sm: int
    max_blocks_per_sm: int
    reserved_shared_per_block: int
    sub_partitions: int = 4


GPU_RATES = {
    "sm75": GpuRates("Tesla T4", 1.59e9, 1024, 16, 64, 64, 320e9, 1024, 16, 0),
    "sm80": GpuRates("A100 SXM4 80GB", 1.41e9, 2048, 16, 64, 64, 2039e9, 2048, 32, 1024),
    "sm86": GpuRates("A40", 1.74e9, 1024, 16, 128, 64, 696e9, 1536, 16, 1024),
    "sm89": GpuRates("L40S", 2.52e9, 1024, 16, 128, 64, 864e9, 1536, 24, 1024),
    "sm90": GpuRates("H100 SXM5", 1.83e9, 2731, 16, 128, 64, 3350e9, 2048, 32, 1024),
}  # fmt: skip


def get_target(name: str | Target) -> Target:
    if isinstance(name, Target):
        return name
    if name == "cpu":
        return cpu()
    if name in GPUS:
        return GPUS[name]
    raise AttnccError(f"unknown target `{name}`; expected one of cpu, {', '.join(GPUS)}")
