"""CUDA code generator: the fused IR node -> one .cu translation unit per (dtype, head dims).

The same text compiles with nvcc for a GPU and, wrapped by `emulation_wrapper`, with the host
compiler on attncc's CUDA emulator.
"""

from __future__ import annotations

from attncc.codegen import render, split_dtype
from attncc.codegen.abi import kernel_abi
from attncc.codegen.cpu import hook_values
from attncc.errors import AttnccError
from attncc.ir.graph import Graph, fused_node
from attncc.passes.tiling import HEAD_DIM_STEP, TilePlan, q_in_registers
from attncc.targets import GPUS

#: torch dtype name -> the storage type in generated CUDA.
CUDA_STORAGE_TYPES = {"float16": "attncc::f16", "bfloat16": "attncc::bf16"}
#: Turing (sm75) has fp16 tensor cores only; bf16 mma starts with sm80.
TURING = 75
#: k of one fp8 mma (m16n8k32): Q/K bytes per product step, keys per P.V step.
FP8_MMA_K = 32


def arch_number(arch: str) -> int:
    """75 for "sm75": the ATTNCC_ARCH the primitives header selects instructions by."""
    return int(arch.removeprefix("sm"))


def storage_dtypes(arch: str) -> tuple[str, ...]:
    """The q/k/v dtypes the tensor cores of `arch` take; other inputs are converted to the first."""
    return ("float16",) if arch_number(arch) <= TURING else ("bfloat16", "float16")


def rounded_head_dim(head_dim: int) -> int:
    """A head dim as the CUDA kernels are built for it: rounded up to HEAD_DIM_STEP (16)."""
    return -(-head_dim // HEAD_DIM_STEP) * HEAD_DIM_STEP


def generate_cuda(
    g: Graph,
    dtype: str,
    plan: TilePlan,
    arch: str = "sm80",
    head_dim: int | None = None,
    value_dim: int | None = None,
) -> str:
    """CUDA source of the forward and backward kernels of `g` for q/k/v of `dtype`, with `plan`'s
    tiles (`plan.backward`'s for the backward; forward only where that is None).

    `head_dim` (q's and k's; default the plan's) and `value_dim` (v's; default head_dim): the
    call's, rounded up to 16 here; the plan is that of the larger (its tiles and register
    columns fit both: a dK or dV accumulator narrower than the plan's keeps at most its own
    columns in registers). The text for equal dims (a library only such calls use) reads one
    bound for both (`value_dim` in the template). A dtype naming fp8 K/V too (`split_dtype`)
    gives the forward alone, widening K and V into shared memory, or with "+mma" (sm89, sm90)
    multiplying their bytes on the fp8 tensor cores (runtime/fp8.py). With "+paged" (last) the
    forward alone, reading K/V through a page table (Kernel.paged); the other libraries' kernels
    take K/V in place only, so the page lookups cost them no registers."""
    dtype, kv_format, fp8_mma, paged = split_dtype(dtype)
    if fp8_mma and not GPUS[arch].fp8_mma:
        raise AttnccError(f"{arch} has no fp8 tensor cores (sm89 and sm90 have)")
    if dtype not in CUDA_STORAGE_TYPES:
        raise AttnccError(f"CUDA kernels take float16 or bfloat16, not {dtype} (fp32 inputs are converted)")
    if dtype not in storage_dtypes(arch):
        raise AttnccError(f"{arch} tensor cores take {' or '.join(storage_dtypes(arch))}, not {dtype}")
    _, op = fused_node(g)
    exact_head_dim = plan.head_dim if head_dim is None else head_dim
    exact_value_dim = exact_head_dim if value_dim is None else value_dim
    head_dim, value_dim = rounded_head_dim(exact_head_dim), rounded_head_dim(exact_value_dim)
    if max(head_dim, value_dim) != plan.head_dim:
        raise AttnccError(f"head dims {head_dim} and {value_dim} do not fit the plan of head dim {plan.head_dim}")
    if fp8_mma:  # Q and K in steps of 32 bytes of k (zero filled beyond D)
        head_dim = -(-head_dim // FP8_MMA_K) * FP8_MMA_K
        if head_dim > plan.head_dim or plan.block_cols % FP8_MMA_K:
            raise AttnccError(f"fp8 products need a head dim and key tiles in steps of {FP8_MMA_K}")
    backward = plan.backward if kv_format is None and not paged else None
    # (the fp8 products' warps take one row block and whole key tiles)
    row_blocks, key_warps = (1, 1) if fp8_mma else (plan.warp_rows // 16, plan.key_warps)
    return render(
        "cuda/attention.cu.jinja",
        variant_name=g.graph["name"],
        arch=arch,
        arch_number=arch_number(arch),
        storage_type=CUDA_STORAGE_TYPES[dtype],
        head_dim=head_dim,
        value_dim=value_dim,
        same_dims=exact_head_dim == exact_value_dim,
        dk_register_columns=min(backward.dk_register_columns, head_dim) if backward else 0,
        dv_register_columns=min(backward.dv_register_columns, value_dim) if backward else 0,
        block_rows=plan.block_rows,
        stages=plan.stages,
        block_cols=plan.block_cols,
        backward=backward,
        abi=kernel_abi(g, cuda=True),
        has_dropout=op.dropout > 0,
        warp_row_blocks=row_blocks,
        key_warps=key_warps,
        q_in_registers=q_in_registers(head_dim, 16 * row_blocks),
        kv_format=kv_format,
        fp8_mma=fp8_mma,
        paged=paged,
        page_group_copies=paged and plan.page_group_copies,
        rope_q=op.q_rope,
        rope_k=op.k_rope,
        **hook_values(g),
    )


def emulation_wrapper(arch: str) -> str:
    """The host source that runs kernel.cu (generated for `arch`) on the CUDA emulator; its
    preamble is kernel.cu's (the same macros and headers), so that it is precompiled."""
    return render("cuda/emulator.cpp.jinja", arch_number=arch_number(arch))
