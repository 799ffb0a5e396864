"""Golden comparison of a kernel against the eager float64 reference of the same IR."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attncc.runtime.inputs import Shape, make_inputs
from attncc.runtime.kernel import Kernel

#: fp32 and fp64 kernels must match float64 within these (relative to max(1, |reference|)),
#: forward and gradients ...
TIGHT = {torch.float32: (2e-5, 2e-4), torch.float64: (1e-10, 1e-9)}
#: ... fp32 ones also within this many times the eager fp32 error where that is larger: at
#: |s| ~ 100 a score's fp32 rounding moves P by ~1e-5 in eager and kernel alike, summed in
#: different orders (measured: the kernel up to 2.5x eager's error, document with q x 100).
FP32_EAGER_FUDGE = 4.0
#: Low-precision kernels may err at most this many times the eager low-precision error.
LOW_PRECISION_FUDGE = 2.0
#: ... or this many eps of the dtype where that is larger (an eager error of ~0 on a lucky
#: shape must not make the limit 0; a floor of 4 eps let a softcap without its cap pass in bf16).
LOW_PRECISION_FLOOR_EPS = 0.5
#: ... and for a learnable input's gradient, a sum over all N x M scores, this many: its dS uses
#: delta = rowsum(dO * O) from the output rounded to the dtype, as FlashAttention's does, which
#: eager autograd does not (measured: alibi's dslopes, fp16, D = 256, 2.6 eps off).
LEARNABLE_FLOOR_EPS = 4.0
#: ... and at most this many: eager autograd in bf16 / fp16 sums a learnable input's N x M
#: terms in that dtype (alibi's dslopes in bf16 was off by ~5, a limit of 1e+01 that no wrong
#: gradient could fail), where the kernels sum in fp32 or double (error ~5e-5 there).
LEARNABLE_CAP_EPS = 16.0


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


def _error(got: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """Max over elements of |got - ref| / max(1, |ref|): each element against its own size, so
    an error in a small gradient entry is not hidden by a large one elsewhere. Infinities must
    match exactly and NaN must be where the reference has NaN; a missing tensor fails."""
    if got is None or ref is None:
        return float("inf")
    got, ref = got.double(), ref.double()
    if got.shape != ref.shape or not torch.equal(torch.isnan(got), torch.isnan(ref)):
        return float("inf")
    inf_mismatch = (torch.isinf(got) | torch.isinf(ref)) & (got != ref)
    if inf_mismatch.any():
        return float("inf")
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    return ((got[finite] - ref[finite]).abs() / ref[finite].abs().clamp_min(1.0)).max().item()


def _zeros_for_unused(grads: tuple[torch.Tensor | None, ...], wrt: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(w) if g is None else g for g, w in zip(grads, wrt)]


def delta_from_output(
    grads: list[torch.Tensor | None],
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    wrt: list[torch.Tensor],
    dout: torch.Tensor,
    out: torch.Tensor,
) -> list[torch.Tensor | None]:
    """The float64 gradients as a FlashAttention backward defines them: delta = rowsum(dO * O)
    from the output the kernel returned (rounded to its dtype), not the exact one.

    Every score's gradient is P (dP - delta); delta's share, -delta_i P_ij ds_ij / dx summed, is
    -delta_i d lse_i / dx, so an error r_i in delta moves each gradient by -(r . d lse / dx). It
    matters where dP and delta cancel: with one key (N = M = 1), dq and dk are exactly 0 but
    the rounding of O in delta (relative eps / 2, summed over d) leaves ~eps |dO| |V| in them.
    Rows without keys (lse -inf) keep the exact gradients.
    """
    has_keys = torch.isfinite(ref_lse.detach())
    r = torch.where(has_keys, (dout * (out.to(ref_out.dtype) - ref_out.detach())).sum(-1), 0.0)
    finite_lse = torch.where(has_keys, ref_lse, 0.0)
    moved = torch.autograd.grad(finite_lse, wrt, r, allow_unused=True)
    return [g - m if g is not None and m is not None else g for g, m in zip(grads, moved)]


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
    q_scale: float = 1.0,
) -> CheckResult:
    """Forward (out, lse) and backward (q, k, v and learnable inputs) against float64 eager.

    The reference always runs on the CPU; with device="cuda" the kernel gets copies on the GPU.
    `q_scale` multiplies q (large scores: the row max matters, a softcap leaves its linear range).
    """
    q, k, v, runtime = make_inputs(kern, shape, dtype, seed)
    if q_scale != 1.0:
        q = (q.detach() * q_scale).requires_grad_(q.requires_grad)
    learnable = [n for n, t in runtime.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    kq, kk, kv = (_on(device, t) for t in (q, k, v))
    kruntime = {n: _on(device, t) for n, t in runtime.items()}
    out, lse = kern(kq, kk, kv, return_lse=True, seed=seed + 1, **kruntime)
    # float64 leaves for the reference, so that its gradients are not rounded to the inputs' dtype
    exact_qkv = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact_inputs = {n: runtime[n].detach().double().requires_grad_() for n in learnable}  # type: ignore[union-attr]
    ref_out, ref_lse = kern.reference(*exact_qkv, seed=seed + 1, **{**runtime, **exact_inputs})
    result = CheckResult(shape, dtype)
    wrt = [q, k, v] + [runtime[n] for n in learnable]
    exact_wrt = exact_qkv + [exact_inputs[n] for n in learnable]
    names = ["out", "lse", "dq", "dk", "dv"] + [f"d{n}" for n in learnable]
    got = [out.cpu(), lse.cpu()]
    ref = [ref_out, ref_lse]
    if backward:
        # one dout, rounded to the kernel's dtype, for the kernel and every reference
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
        dout = dout.to(out.dtype).double()
        kernel_wrt = [kq, kk, kv] + [kruntime[n] for n in learnable]
        # allow_unused only so that a missing gradient is reported by name (as an error of inf)
        grads = torch.autograd.grad(out, kernel_wrt, dout.to(out.dtype).to(out.device), allow_unused=True)
        got += [g.cpu() if g is not None else None for g in grads]
        # (an operand the program's scores do not read, `s = bias[h, i, j]`, has gradient 0, not none:
        # an error against none was inf, within an eager limit of inf, so any dq passed)
        ref += _zeros_for_unused(
            torch.autograd.grad(ref_out, exact_wrt, dout, allow_unused=True, retain_graph=True), exact_wrt
        )
        flash = ref[:2] + delta_from_output(ref[2:], ref_out, ref_lse, exact_wrt, dout, out.detach().cpu())
    else:
        names = names[:2]
        flash = ref
    for name, g, r, f in zip(names, got, ref, flash):
        result.errors[name] = min(_error(g, r), _error(g, f))
    forward_limit, gradient_limit = TIGHT.get(dtype, TIGHT[torch.float32])
    limits = {n: forward_limit if n in ("out", "lse") else gradient_limit for n in result.errors}
    if dtype == torch.float64:
        result.limits = limits
        return result
    # the same program in eager PyTorch at the kernel's dtype: what that precision can do here
    low_out, low_lse = kern.reference(q, k, v, seed=seed + 1, dtype=dtype, **runtime)
    low = [low_out, low_lse]
    if backward:
        low += _zeros_for_unused(torch.autograd.grad(low_out, wrt, dout.to(dtype), allow_unused=True), wrt)
    eager = {n: _error(lo, r) for n, lo, r in zip(names, low, ref)}
    if dtype == torch.float32:
        result.limits = {n: max(limits[n], FP32_EAGER_FUDGE * eager[n]) for n in names}
    else:
        eps = torch.finfo(dtype).eps
        operand = ("out", "dq", "dk", "dv")
        floors = {n: (LOW_PRECISION_FLOOR_EPS if n in operand else LEARNABLE_FLOOR_EPS) * eps for n in names}
        caps = {n: math.inf if n in operand else LEARNABLE_CAP_EPS * eps for n in names}
        result.limits = {n: max(min(LOW_PRECISION_FUDGE * eager[n], caps[n]), floors[n]) for n in names}
        result.limits["lse"] = limits["lse"]  # returned in fp32 from fp32 statistics
    return result
