"""Random inputs for a kernel at a given shape: what `attncc check`, the examples run and the
tests feed every program, including runtime inputs chosen to produce fully masked rows."""

from __future__ import annotations

from dataclasses import replace

import torch

from attncc.ir.ops import Layout
from attncc.passes.sparsity import Problem
from attncc.runtime.kernel import Kernel

#: A problem's sizes B, H, Hkv, N, M, D and Dv (v's head dim, D unless given; the same record
#: the sparsity analysis uses).
Shape = Problem


#: Shapes that break naive tilings: N = 1, N and M not multiples of any tile, odd head dims,
#: GQA and MQA, cross attention, B*H > 1.
AWKWARD_SHAPES = (
    Shape(1, 1, 1, 1, 1, 16),
    Shape(2, 4, 2, 77, 130, 48),
    Shape(1, 3, 1, 129, 65, 80),
    Shape(2, 2, 2, 100, 100, 64),
    Shape(1, 2, 1, 70, 33, 128),
    Shape(1, 1, 1, 40, 50, 256),
)


def needs_self_attention(kern: Kernel) -> bool:
    """True if a runtime input is indexed by position along N (then M must equal N)."""
    return any("N" in d.dims or "M" in d.dims for d in kern.inputs)


def adapt(shape: Shape, kern: Kernel) -> Shape:
    return replace(shape, M=shape.N) if needs_self_attention(kern) else shape


def make_inputs(
    kern: Kernel,
    shape: Shape,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    requires_grad: bool = True,
    operands: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, object]]:
    """q, k, v and runtime inputs. Length-like ints include 0 so some rows are fully masked.
    operands=False: q, k, v are zeros of the shapes with no storage to speak of (a plan's
    sizes, `attncc explain` at 128K tokens, without gigabytes of random numbers)."""
    gen = torch.Generator().manual_seed(seed)
    s = shape

    def randn(*size: int) -> torch.Tensor:
        if not operands:
            return torch.zeros((), dtype=dtype).expand(*size)
        return torch.randn(*size, generator=gen, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)

    q, k, v = randn(s.B, s.H, s.N, s.D), randn(s.B, s.Hkv, s.M, s.D), randn(s.B, s.Hkv, s.M, s.Dv)
    sizes = {"B": s.B, "H": s.H, "Hkv": s.Hkv, "N": s.N, "M": s.M, "D": s.D}
    blocks = {lay.tensor: lay.block for lay in kern.op.layouts if isinstance(lay, Layout) and lay.tensor}
    runtime: dict[str, object] = {}
    for decl in kern.inputs:  # (scalars first: a dimension named after an int scalar is its value)
        if decl.role == "scalar" and decl.size_of is None:
            runtime[decl.name] = 0.5 if decl.dtype == "float" else max(1, s.N // 3) if decl.dtype == "int" else True
    for decl in kern.inputs:
        if decl.role == "scalar":  # (a tensor's size, size_of: the kernel binds it)
            continue
        dims = []
        for d in decl.dims:
            if isinstance(d, int):
                dims.append(d)
            elif isinstance(runtime.get(d), int) and not isinstance(runtime.get(d), bool):
                dims.append(runtime[d])  # type: ignore[arg-type]
            elif d in sizes:
                dims.append(sizes[d])
            elif decl.name in blocks and d in ("NB", "MB"):
                dims.append(-(-(s.N if d == "NB" else s.M) // blocks[decl.name]))
            else:
                dims.append(4)
        if decl.dtype == "float":  # (float64 calls: float64 tables, whose gradients `check` holds to float64's limit)
            table = torch.randn(*dims, generator=gen, dtype=torch.float64) * 0.5
            runtime[decl.name] = table.to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_(
                requires_grad
            )
        elif decl.dtype == "bool":
            runtime[decl.name] = torch.rand(*dims, generator=gen, dtype=torch.float32) < 0.6
        elif decl.dims and decl.dims[-1] in ("N", "M"):  # per-position ids: sorted segments
            runtime[decl.name] = torch.randint(0, 4, dims, generator=gen).sort(dim=-1).values
        else:  # per-batch lengths in [0, M]; with B > 1 the first is 0 (fully masked rows)
            t = torch.randint(0, s.M + 1, dims, generator=gen)
            if t.numel() > 1:
                t.view(-1)[0] = 0
            runtime[decl.name] = t
    return q, k, v, runtime
