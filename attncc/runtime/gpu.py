"""CUDA kernels on a real GPU: built with nvcc for the device's architecture, launched on the
current stream through the same ABI as the CPU and emulated kernels.

The golden tests in tests/test_gpu.py run wherever torch sees a GPU (all passed on an H100,
bench/results/cuda-h100-session19.md); elsewhere nvcc/ptxas and the emulator verify the kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import torch

from attncc.errors import AttnccError
from attncc.runtime.build import build_library
from attncc.runtime.emulate import EmulatedKernel
from attncc.runtime.nvcc import check_driver_runs_nvcc_builds
from attncc.targets import GPUS

#: attncc_forward / attncc_backward status when the CUDA runtime refused a launch
#: (attncc_cuda_error() says which kernel and why).
LAUNCH_FAILED = 4


def device_target() -> str:
    """The attncc target for the current CUDA device, or a clear error.

    The newest target whose architecture the device runs (cubins run on later minor versions of
    the same major, and the embedded PTX is JIT-compiled on later majors) and whose shared
    memory plan fits the device's opt-in per-block maximum (e.g. sm_120 has 99 KiB: it gets the
    sm89 plan, not sm90's).
    """
    if not torch.cuda.is_available():
        raise AttnccError("target `cuda`: torch sees no CUDA device (a CPU build of torch, or no GPU)")
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    capability = (props.major, props.minor)
    shared = getattr(props, "shared_memory_per_block_optin", 0)
    for name, target in sorted(GPUS.items(), key=lambda item: -item[1].sm_version):
        major, minor = divmod(target.sm_version, 10)
        if capability >= (major, minor) and (not shared or target.onchip_bytes <= shared):
            return name
    raise AttnccError(
        f"target `cuda`: {props.name} (compute capability {capability[0]}.{capability[1]}) is not supported (sm75 or newer)"
    )


def _check_driver() -> None:
    """Before nvcc builds a library: can this machine's driver run what it builds?"""
    driver_version = getattr(torch._C, "_cuda_getDriverVersion", None)
    if driver_version is not None:
        check_driver_runs_nvcc_builds(driver_version())


class GpuKernel(EmulatedKernel):
    """The generated CUDA kernels compiled by nvcc and launched on torch's current stream."""

    device_type = "cuda"
    short_query_tiles = key_split_warps = True  # (EmulatedKernel's notes)

    def library_path_for(self, dtype: str, head_dim: int, value_dim: int | None = None) -> Path:  # built by nvcc
        return build_library(
            self.cuda_source(dtype, head_dim, value_dim),
            self.library_name("gpu", dtype, head_dim, value_dim),
            cuda_arch=self.target,
            before_build=_check_driver,
        )

    def forward_impl(self, q, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201 - as Kernel
        with torch.cuda.device(q.device):  # launch on q's GPU, whichever is current
            return super().forward_impl(q, *args, **kwargs)

    def backward_impl(self, q, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201 - as Kernel
        with torch.cuda.device(q.device):
            return super().backward_impl(q, *args, **kwargs)

    def multiprocessors(self) -> int:
        return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def _on_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu()  # classification and read checks run on the host

    def _device_index(self) -> int | None:
        return torch.cuda.current_device()

    def _to_device(self, call: dict) -> dict:
        device = torch.device("cuda", torch.cuda.current_device())
        call["classes"] = call["classes"].to(device)
        call["tensors"] = {k: v.to(device) for k, v in call["tensors"].items()}
        return call

    def _entry(self, lib: ctypes.CDLL, entry: str) -> ctypes._CFuncPtr:
        return super()._entry(lib, entry.replace("attncc_emulated_", "attncc_"))

    def _launch(self, lib: ctypes.CDLL, fn: ctypes._CFuncPtr, args: tuple, device: torch.device | None = None) -> None:
        """Launches entry point `fn` with `args` on torch's current stream of `device` (default:
        the current device; forward_impl has made q's current)."""
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            status = fn(*args, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if status == LAUNCH_FAILED:
            lib.attncc_cuda_error.restype = ctypes.c_char_p
            raise RuntimeError(f"{self.name}: {lib.attncc_cuda_error().decode()}")
        if status != 0:
            raise RuntimeError(f"{fn.__name__} of {self.name} returned {status}")
