"""CPU code generator: the fused IR node -> one C++ translation unit per storage dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attncc.codegen import render, split_dtype
from attncc.codegen.abi import KernelAbi, kernel_abi
from attncc.codegen.cexpr import emit, uses_rounding
from attncc.errors import AttnccError
from attncc.ir import expr as ex
from attncc.ir.graph import Graph, fused_node
from attncc.passes.tiling import CPU_BF16_KEPT_DOT_ROWS, CPU_SIDE_BY_SIDE_TILE_PRODUCT_ROWS, cpu_transposed_key_rows

if TYPE_CHECKING:
    from attncc.passes.tiling import CpuMicroKernel

#: torch dtype name -> (storage type, accumulator type) in the generated C++.
STORAGE_TYPES = {
    "float32": ("float", "float"),
    "float64": ("double", "double"),
    "bfloat16": ("attncc::bf16_t", "float"),
    "float16": ("attncc::fp16_t", "float"),
}

#: ATTNCC_BF16_PRODUCTS (include/attncc/cpu/primitives.h) of a bf16 kernel, by the ISA level's unit.
BF16_PRODUCTS = {"amx": 1, "dpbf16": 2}


def bf16_products(dtype: str, micro_kernel: CpuMicroKernel) -> int:
    """ATTNCC_BF16_PRODUCTS of a CPU forward for q/k/v of `dtype` (0: multiplied widened to
    fp32): bf16 on the machine's bf16 unit, fp16 too on AMX as two bf16 terms per value (three
    products for one; the template's kFp16Split). AMX multiplies bf16 at ~5x the fp32 FMAs' rate
    (Sapphire Rapids-class Xeon: fp16 forwards 2x faster as terms); vdpbf16ps at ~2x (Zen 4: 416
    against 186 GFLOP/s), where three products would lose to widening."""
    unit = micro_kernel.bf16_products
    if dtype == "bfloat16" or (dtype == "float16" and unit == "amx"):
        return BF16_PRODUCTS.get(unit, 0)
    return 0


def bf16_backward(dtype: str, micro_kernel: CpuMicroKernel) -> bool:
    """Whether a CPU backward for q/k/v of `dtype` multiplies bf16 on the bf16 unit (the
    template's kBf16Backward): bf16 inputs only; an fp16 backward widens to fp32 even where its
    forward runs as bf16 terms."""
    return dtype == "bfloat16" and bf16_products(dtype, micro_kernel) != 0


#: The forward's packed K/V panels live at once (templates/cpu/attention.cpp.jinja `Panels`):
#: kv heads are packed and processed in batches of at most this many bytes of panels. Small enough
#: that a batch stays in the last-level cache and its buffer is reused from the heap (at 64 MiB, a
#: batch of many short heads was a fresh mmap per call: B=64 H=8 N=M=16 D=64 fp32 took 17.6 ms,
#: 3.2 ms at 4 MiB, on Zen 4; N = 1K..8K unchanged within noise).
PANEL_BUDGET_BYTES = 4 << 20


@dataclass(frozen=True)
class InputGradHook:
    ident: str
    offset: str
    derivative: str
    per_tile: bool  # the element depends only on b and h (passes/backward.py InputGradient)


def hook_values(g: Graph) -> dict[str, object]:
    """The variant's hooks as C++ expressions, for templates/common/variant.jinja."""
    _, op = fused_node(g)
    assert op.backward is not None, "derive_backward must run before code generation"
    abi: KernelAbi = kernel_abi(g)
    grads = []
    for grad in op.backward.inputs:
        ident = abi.ident_of(grad.read.tensor)
        offset = " + ".join(f"({emit(i)}) * x.st_{ident}_{d}" for d, i in enumerate(grad.read.index)) or "0"
        grads.append(InputGradHook(ident, offset, emit(grad.derivative), grad.per_tile))
    needs_s0 = ex.SCORE_VAR in ex.free_vars(op.backward.dscore) or any(
        ex.SCORE_VAR in ex.free_vars(gr.derivative) for gr in op.backward.inputs
    )
    dscore = op.backward.dscore
    query_position0, key_position0 = (emit(e) for e in op.position0) if op.position0 else ("0", "0")
    emitted = [op.score, dscore, *(op.position0 or ()), *([op.mask] if op.mask is not None else [])]
    emitted += [e for grad in op.backward.inputs for e in (grad.derivative, *grad.read.index)]
    return {
        "rounding": uses_rounding(emitted),
        "has_score_map": op.score != ex.score(),
        # dS0 = dS * dscore unless dscore is the constant 1 (a constant such as `s * 2` or a
        # runtime scalar `s * temp` still scales it)
        "has_dscore": not (isinstance(dscore, ex.Const) and dscore.value == 1),
        "needs_s0": needs_s0,
        "score": emit(op.score),
        "mask": emit(op.mask) if op.mask is not None else "true",
        "dscore": emit(op.backward.dscore),
        "input_grads": grads,
        "query_position0": query_position0,
        "key_position0": key_position0,
    }


def generate_cpu(g: Graph, dtype: str, variant_key: str) -> str:
    """C++ source of the forward and backward kernels of `g` for q/k/v of `dtype`; for a dtype
    naming fp8 K/V too (`split_dtype`: "bfloat16+float8_e4m3fn"), the forward alone, widening
    K and V as it loads them."""
    _, op = fused_node(g)
    assert op.tiling is not None and op.tiling.micro_kernel is not None, "tile must run for a CPU target first"
    dtype, kv_format, fp8_mma, paged = split_dtype(dtype)
    if fp8_mma:
        raise AttnccError("CPU kernels widen fp8 K/V: fp8 products are a CUDA sm_89+ choice")
    if paged:
        raise AttnccError("CPU kernels read pages in every library: a paged library is a CUDA one")
    storage, acc = STORAGE_TYPES[dtype]
    hooks = hook_values(g)
    bf16_unit = op.tiling.micro_kernel.bf16_products if bf16_products(dtype, op.tiling.micro_kernel) else ""
    return render(
        "cpu/attention.cpp.jinja",
        variant=g.graph["name"],
        variant_key=variant_key,
        storage_type=storage,
        acc_type=acc,
        abi=kernel_abi(g),
        micro_kernel=op.tiling.micro_kernel,
        bf16_products=bf16_products(dtype, op.tiling.micro_kernel),
        panel_budget_bytes=PANEL_BUDGET_BYTES,
        transposed_key_rows=cpu_transposed_key_rows(op.tiling.micro_kernel.vector_bytes, bf16_unit),
        kept_dot_rows=CPU_BF16_KEPT_DOT_ROWS.get(bf16_unit, 0),
        side_by_side_tile_product_rows=CPU_SIDE_BY_SIDE_TILE_PRODUCT_ROWS,
        has_dropout=op.dropout > 0,
        rope_q=op.q_rope,
        rope_k=op.k_rope,
        kv_format=kv_format,
        max_head_dim=op.tiling.max_head_dim,
        # tasks -> threads fixed when learnable inputs get gradients (reproducible sums)
        backward_schedule="static, 1" if hooks["input_grads"] else "dynamic, 1",
        **hooks,
    )
