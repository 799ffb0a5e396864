"""nvcc: find it, compile generated CUDA to cubin/PTX, read the ptxas resource report."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from attncc.errors import BuildError

INCLUDE_DIR = Path(__file__).resolve().parents[1] / "include"
NVCC_FLAGS = ("-std=c++17", "-O3", "--use_fast_math")


def _matches_torch(wheel_nvcc: Path) -> bool:
    """Whether a wheel's nvcc (…/nvidia/<layout>/bin/nvcc) is of torch's CUDA major."""
    layout = wheel_nvcc.parents[1].name
    major = layout[2:] if re.fullmatch(r"cu\d+", layout) else "12" if layout == "cuda_nvcc" else None
    return major is not None and major == (torch.version.cuda or "").split(".")[0]


def nvcc_install_hint(torch_cuda: str | None) -> str:
    """How to get an nvcc that builds kernels for this torch (torch.version.cuda).

    `attncc[cuda]` pulls `nvidia-cuda-nvcc` >= 13, a whole toolchain (it requires the nvvm, crt
    and cudart wheels). No wheel carries a CUDA 12 nvcc: `nvidia-cuda-nvcc-cu12` (12.4.131,
    12.9.86) holds ptxas only. A CUDA 12 torch can still use the CUDA 13 wheel where the driver
    runs CUDA 13 (the kernels link their own CUDA runtime statically), else a CUDA 12 toolkit.
    """
    major = (torch_cuda or "").split(".")[0]
    if not major:
        return (
            "this torch is a CPU build, which runs no CUDA kernels: emulate them on the host "
            "(emulate=True, `attncc check --emulate`), or install a CUDA toolkit to only emit and compile them"
        )
    if int(major) >= 13:
        return "`pip install 'attncc[cuda]'` (the nvidia-cuda-nvcc 13 wheels), or install the CUDA toolkit and set CUDA_HOME"
    return (
        f"torch is built for CUDA {torch_cuda}: `pip install 'attncc[cuda]'` (nvcc 13) works where the GPU driver "
        f"supports CUDA 13 (driver 580 or newer); otherwise install a CUDA {major} toolkit and set CUDA_HOME "
        f"(no pip wheel carries a CUDA {major} nvcc)"
    )


def find_nvcc() -> str:
    """nvcc from $CUDA_HOME, then PATH, then the nvidia-cuda-nvcc wheel; a clear error if none."""
    looked = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            candidate = Path(home) / "bin" / "nvcc"
            looked.append(str(candidate))
            if candidate.is_file():
                return str(candidate)
    found = shutil.which("nvcc")
    looked.append("PATH")
    if found:
        return found
    nvidia = importlib.util.find_spec("nvidia")  # the wheels' namespace package
    roots = list(nvidia.submodule_search_locations or []) if nvidia else []
    for root in roots:
        # nvidia-cuda-nvcc: nvidia/cu13/bin (CUDA 13); nvidia/cuda_nvcc/bin is the CUDA 12 wheels'
        # layout, which hold ptxas only today; with both, the one of torch's CUDA major first
        looked.append(str(Path(root) / "*" / "bin" / "nvcc"))
        for candidate in sorted(Path(root).glob("*/bin/nvcc"), key=lambda c: (not _matches_torch(c), str(c))):
            if candidate.is_file():
                return str(candidate)
    raise BuildError("nvcc not found (looked in " + ", ".join(looked) + "); " + nvcc_install_hint(torch.version.cuda))


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int


@dataclass(frozen=True)
class PtxasReport:
    """ptxas resources of every kernel in a translation unit (the worst one in the totals)."""

    arch: str
    kernels: tuple[KernelResources, ...]
    ptx: str

    @property
    def registers(self) -> int:
        return max(k.registers for k in self.kernels)

    @property
    def spill_stores(self) -> int:
        return sum(k.spill_stores for k in self.kernels)

    @property
    def spill_loads(self) -> int:
        return sum(k.spill_loads for k in self.kernels)

    @property
    def stack_bytes(self) -> int:
        return max(k.stack_bytes for k in self.kernels)

    def describe(self) -> str:
        return f"{self.arch}: " + "; ".join(
            f"{k.name} {k.registers} registers, {k.spill_stores}/{k.spill_loads} B spill stores/loads, {k.stack_bytes} B stack"
            for k in self.kernels
        )


@cache
def nvcc_fingerprint() -> str:
    """Which nvcc builds the GPU libraries, its version and flags: part of their cache key, so
    switching toolkits (the CUDA runtime is linked into each library) rebuilds them."""
    nvcc = find_nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    return "\n".join([nvcc, version, " ".join(NVCC_FLAGS)])


def nvcc_release() -> tuple[int, int]:
    """The CUDA release of the nvcc in use, e.g. (13, 0)."""
    found = re.search(r"release (\d+)\.(\d+)", nvcc_fingerprint())
    if not found:
        raise BuildError(f"cannot read the CUDA release from `{find_nvcc()} --version`")
    return int(found.group(1)), int(found.group(2))


def check_driver_runs_nvcc_builds(driver_version: int) -> None:
    """A clear error where the driver (CUDA's version code, e.g. 12040 for 12.4) is older than
    the major release of nvcc, whose runtime each GPU library links statically: every launch
    would fail with "driver version is insufficient"."""
    release = nvcc_release()
    driver = divmod(driver_version // 10, 100)
    if driver[0] < release[0]:
        raise BuildError(
            f"{find_nvcc()} is CUDA {release[0]}.{release[1]}, but the GPU driver supports CUDA {driver[0]}.{driver[1]}: "
            f"point CUDA_HOME at a CUDA {driver[0]}.x toolkit (or install a newer driver)"
        )


def find_ptxas(nvcc: str) -> str:
    candidate = Path(nvcc).resolve().parent / "ptxas"
    return str(candidate) if candidate.is_file() else shutil.which("ptxas") or "ptxas"


#: ptxas's reports (with the PTX, compressed) in the kernel cache, keyed by the source, the headers
#: it includes, the architecture and nvcc: the spill checks of the test suite compile the same
#: sources on every run (48 + 36 + ... nvcc runs: about 3 of a warm run's 7 minutes on a 2-core
#: Zen 5), and `attncc compile --target smXX` a source it compiled before.
PTXAS_CACHE_DIR = ".ptxas"


def compile_cuda(source: str, arch: str, keep_dir: Path | None = None) -> PtxasReport:
    """nvcc -ptx, then ptxas -v for `arch` (e.g. "sm80"): the PTX and the resource report.

    The front end runs once; ptxas produces the cubin and the register/spill report. A failure
    raises BuildError with the command that reproduces it. A report of the same source, headers,
    architecture and nvcc comes from the cache (PTXAS_CACHE_DIR), except where `keep_dir` asks
    for the files; a damaged entry is compiled again.
    """
    from attncc.runtime.build import cache_dir, cache_key  # (build imports this module)

    nvcc = find_nvcc()
    key = cache_key(f"{source}\n//--ptxas {arch}\n{nvcc_fingerprint()}")
    entry = cache_dir() / PTXAS_CACHE_DIR / f"{key}.json.gz"
    if keep_dir is None:
        try:
            cached = json.loads(gzip.decompress(entry.read_bytes()))
            return parse_ptxas(cached["report"], arch, cached["ptx"])
        except (OSError, ValueError, KeyError, TypeError, BuildError):
            pass  # none yet, or damaged: compile
    sm = "sm_" + arch.removeprefix("sm")
    with tempfile.TemporaryDirectory() as tmp:
        work = keep_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cu, ptx_path = work / "kernel.cu", work / "kernel.ptx"
        cu.write_text(source)
        steps = [
            [nvcc, f"-arch={sm}", *NVCC_FLAGS, f"-I{INCLUDE_DIR}", "-ptx", str(cu), "-o", str(ptx_path)],
            [find_ptxas(nvcc), f"-arch={sm}", "-v", str(ptx_path), "-o", str(work / "kernel.cubin")],
        ]
        for cmd in steps:
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise BuildError(f"{Path(cmd[0]).name} failed (reproduce: {' '.join(cmd)}):\n{result.stderr[-4000:]}")
        text, ptx = result.stdout + result.stderr, ptx_path.read_text()
    report = parse_ptxas(text, arch, ptx)
    try:  # (written whole, then renamed: a reader never sees half an entry)
        entry.parent.mkdir(parents=True, exist_ok=True)
        partial = entry.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        partial.write_bytes(gzip.compress(json.dumps({"report": text, "ptx": ptx}).encode(), compresslevel=1))
        partial.replace(entry)
    except OSError:
        pass  # a read-only cache: the report stands, uncached
    return report


#: The generated kernels' names in ptxas's report (mangled there); _dq before its prefix.
KERNEL_NAMES = ("attention_forward", "combine_splits", "append_new_keys", "attention_backward_dq", "attention_backward")


def parse_ptxas(report: str, arch: str, ptx: str = "") -> PtxasReport:
    """The resources of every kernel entry in a `-v` report."""
    kernels = []
    for section in report.split("Compiling entry function")[1:]:
        name = re.search(r"'([^']+)'", section)
        registers = re.search(r"Used (\d+) registers", section)
        spills = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", section)
        if not (name and registers and spills):
            raise BuildError(f"unexpected ptxas report:\n{report[-2000:]}")
        short = next((k for k in KERNEL_NAMES if k in name.group(1)), name.group(1))
        kernels.append(
            KernelResources(
                short, int(registers.group(1)), int(spills.group(2)), int(spills.group(3)), int(spills.group(1))
            )
        )
    if not kernels:
        raise BuildError(f"no kernel in the ptxas report:\n{report[-2000:]}")
    return PtxasReport(arch, tuple(kernels), ptx)
