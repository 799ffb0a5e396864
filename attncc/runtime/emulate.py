"""CUDA kernels on the host: the generated .cu text run by attncc's CUDA emulator.

`EmulatedKernel` is a `Kernel` whose forward runs the CUDA forward kernel (fp16/bf16 tensor
cores, emulated lane by lane) on CPU tensors, so the CUDA code generator is golden-tested on
machines without a GPU. Each call can pick the emulator's schedule; a correct kernel gives the
same bits under every schedule.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from attncc.codegen.cuda import EMULATION_WRAPPER, generate_cuda
from attncc.errors import AttnccError
from attncc.runtime.build import build_library, load_library
from attncc.runtime.kernel import Kernel, acc_dtype

SCHEDULES = {"lockstep": 0, "warp-greedy": 1}
_LOCK = threading.Lock()


class EmulationFailure(AttnccError):
    """The emulator caught a kernel bug: divergent barrier, deadlock, bad lane mask, misaligned ldmatrix."""


class EmulatedKernel(Kernel):
    """Forward on the CUDA emulator; backward is not generated for CUDA yet."""

    schedule = "lockstep"

    def cuda_source(self, dtype: str, head_dim: int) -> str:
        assert self.op.tiling is not None
        return generate_cuda(self.graph, dtype, self.op.tiling.for_head_dim(head_dim), self.target)

    def emulated_library(self, dtype: str, head_dim: int) -> ctypes.CDLL:
        key = f"emu-{dtype}-{head_dim}"
        with self._lock:
            if key not in self._libraries:
                source = self.cuda_source(dtype, head_dim)
                path = build_library(EMULATION_WRAPPER, f"{self.name}-{self.target}-{key}", {"kernel.cu": source})
                self._libraries[key] = load_library(path)
            return self._libraries[key]

    def forward_impl(self, q, k, v, tensors, scalars, scale, dropout, seed):  # noqa: ANN001, ANN201 - as Kernel
        storage = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16  # fp32/fp64: bf16 on GPU
        plan = self.plan(q, k, scale)
        qs, ks, vs = (t.to(storage) for t in (q, k, v))
        out = torch.empty(q.shape, dtype=storage)
        lse = torch.empty(q.shape[:3], dtype=torch.float32)
        call = self._prepare(plan, torch.float32, tensors, scalars)
        if out.numel():
            ptrs = {"q": qs, "k": ks, "v": vs, "out": out, "lse": lse}
            lib = self.emulated_library(str(storage).replace("torch.", ""), plan.tiles.head_dim)
            fn = lib.attncc_emulated_forward
            fn.restype = ctypes.c_int
            with _LOCK:  # the emulator's schedule is process-wide
                status = fn(*self.pack(plan, call, ptrs, dropout, seed), SCHEDULES[self.schedule])
            if status == 3:
                lib.attncc_emulator_error.restype = ctypes.c_char_p
                raise EmulationFailure(f"{self.name} on the CUDA emulator: {lib.attncc_emulator_error().decode()}")
            if status != 0:
                raise RuntimeError(f"emulated kernel of {self.name} returned {status}")
        return out.to(q.dtype), lse.to(acc_dtype(q.dtype))

    def backward_impl(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        raise AttnccError(
            f"{self.name}: the CUDA backward kernels are not generated yet; use target='cpu' for training"
        )
