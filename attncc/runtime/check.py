"""Golden comparison of a kernel against the eager float64 reference of the same IR."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attncc.runtime.inputs import Shape, make_inputs
from attncc.runtime.kernel import Kernel

#: fp32 and fp64 kernels must match float64 within these (relative to max(1, |reference|)).
TIGHT = {torch.float32: (2e-5, 2e-4), torch.float64: (1e-10, 1e-9)}
#: Low-precision kernels may err at most this many times the eager low-precision error.
LOW_PRECISION_FUDGE = 2.0


@dataclass
class CheckResult:
    shape: Shape
    dtype: torch.dtype
    errors: dict[str, float] = field(default_factory=dict)
    limits: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(self.errors[n] <= self.limits[n] for n in self.errors)

    def describe(self) -> str:
        parts = [f"{n} {self.errors[n]:.1e}/{self.limits[n]:.0e}" for n in self.errors]
        status = "ok" if self.ok else "MISMATCH"
        return f"{status:8s} {str(self.dtype).replace('torch.', ''):8s} {self.shape}: " + ", ".join(parts)


def _error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Max abs difference relative to max(1, |ref|); -inf must match -inf exactly; NaN fails."""
    got, ref = got.double(), ref.double()
    if got.shape != ref.shape or torch.isnan(got).any():
        return float("inf")
    inf_mismatch = (torch.isinf(got) | torch.isinf(ref)) & (got != ref)
    if inf_mismatch.any():
        return float("inf")
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    diff = (got[finite] - ref[finite]).abs().max().item()
    return diff / max(1.0, ref[finite].abs().max().item())


def _on(device: str, t: object) -> object:
    """A leaf copy of `t` on `device` (same requires_grad); other values unchanged."""
    if not isinstance(t, torch.Tensor) or device == "cpu":
        return t
    return t.detach().to(device).requires_grad_(t.requires_grad)


def check(
    kern: Kernel,
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    backward: bool = True,
    seed: int = 0,
    device: str = "cpu",
) -> CheckResult:
    """Forward (out, lse) and backward (q, k, v and learnable inputs) against float64 eager.

    The reference always runs on the CPU; with device="cuda" the kernel gets copies on the GPU.
    """
    q, k, v, runtime = make_inputs(kern, shape, dtype, seed)
    learnable = [n for n, t in runtime.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    kq, kk, kv = (_on(device, t) for t in (q, k, v))
    kruntime = {n: _on(device, t) for n, t in runtime.items()}
    out, lse = kern(kq, kk, kv, return_lse=True, seed=seed + 1, **kruntime)
    ref_out, ref_lse = kern.reference(q, k, v, seed=seed + 1, **runtime)
    result = CheckResult(shape, dtype)
    wrt = [q, k, v] + [runtime[n] for n in learnable]
    names = ["out", "lse", "dq", "dk", "dv"] + [f"d{n}" for n in learnable]
    got = [out.cpu(), lse.cpu()]
    ref = [ref_out, ref_lse]
    if backward:
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
        kernel_wrt = [kq, kk, kv] + [kruntime[n] for n in learnable]
        grads = torch.autograd.grad(out, kernel_wrt, dout.to(out.dtype).to(out.device), allow_unused=True)
        got += [g.cpu() if g is not None else None for g in grads]
        ref += list(torch.autograd.grad(ref_out, wrt, dout, allow_unused=True))
    else:
        names = names[:2]
    for name, g, r in zip(names, got, ref):
        result.errors[name] = _error(g, r) if g is not None and r is not None else 0.0
    if dtype in TIGHT:
        fwd, bwd = TIGHT[dtype]
        result.limits = {n: fwd if n in ("out", "lse") else bwd for n in result.errors}
    else:
        low_out, low_lse = kern.reference(q, k, v, seed=seed + 1, dtype=dtype, **runtime)
        low = [low_out, low_lse]
        if backward:
            low += list(torch.autograd.grad(low_out, wrt, dout.to(dtype), allow_unused=True))
        floor = 4 * torch.finfo(dtype).eps
        result.limits = {
            n: LOW_PRECISION_FUDGE * max(_error(lo, r), floor) if lo is not None and r is not None else 0.0
            for n, lo, r in zip(names, low, ref)
        }
    return result
