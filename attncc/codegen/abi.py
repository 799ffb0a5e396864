"""The calling convention between the Python runtime and a generated kernel library.

A kernel entry point is ``int attncc_<kernel>(void* const* ptrs, const int64_t* ints,
const double* reals)``. One `KernelAbi`, built from the IR, lists every slot in order; the
template unpacks the arrays from that list and the runtime packs them from the same list, so
the two sides cannot disagree about an index.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncc.codegen.cexpr import scalar_ident, tensor_ident
from attncc.ir.graph import Graph, fused_node, inputs, runtime_inputs

#: q/k/v-shaped operands: (name, C type). "storage_t" is q's element type, "kv_t" that of k and
#: v: storage_t, or fp8 bytes (runtime/fp8.py) with their descale factors, one per row of k and
#: of v (k-shaped with a head dim of 1: per tensor, head or token by their strides; null without fp8).
OPERANDS = (
    ("q", "const storage_t*"), ("k", "const kv_t*"), ("v", "const kv_t*"),
    ("out", "storage_t*"), ("dout", "const storage_t*"), ("dq", "storage_t*"),
    ("dk", "storage_t*"), ("dv", "storage_t*"),
    ("k_descale", "const float*"), ("v_descale", "const float*"),
)  # fmt: skip
#: Per-row statistics (delta: written by the CPU backward's first pass, read by the GPU's), the
#: tile classes, and the softmax's sink logit per row ([B, H, N]; null without one: the CPU
#: forward merges it as it writes each row, runtime/sinks.py, and the CPU backward's first pass
#: reads it for the lse residuals).
ROW_BUFFERS = (("lse", "acc_t*"), ("delta", "acc_t*"), ("classes", "const uint8_t*"), ("sink", "const acc_t*"))
#: The CPU backward's lse residual per row (row_stat's layout, as lse; null where the call's
#: keys are not all the row's, a ring step's): what lse = m + log l lost of log l beside a huge
#: m, recovered by its delta pass (templates/cpu `backward_delta`) and taken out of P.
CPU_ROW_BUFFERS = (("lse_residual", "acc_t*"),)
SIZES = ("B", "H", "Hkv", "N", "M", "D", "Dv")  # D: q and k head dim; Dv: v and out head dim
CONTROL = ("Br", "Bc", "cls_sb", "cls_sh", "cls_si", "seed", "offset", "threads")
#: scale: the multiplier of q.k (FusedAttention.scale evaluated); scale_value: the name `scale`
REALS = ("scale", "dropout", "scale_value")
_ELEMENT_TYPES = {"float": "acc_t", "int": "int64_t", "bool": "uint8_t"}


@dataclass(frozen=True)
class TensorSlot:
    name: str  # program name
    ident: str  # C++ member
    ctype: str  # element type
    rank: int


#: Per learnable input, the buffers of the CUDA deterministic mode's exact sums
#: (templates/cuda/attention.cu.jinja `input_grads_exact`): largest |term| (float bits),
#: non-finite flags, the grid shift chosen from them, and the int64 term counts, then sums.
EXACT_GRAD_BUFFERS = (("bound", "int32_t*"), ("flags", "int32_t*"), ("shift", "const int32_t*"), ("fixed", "int64_t*"))
#: The CUDA forward's split-KV partials (`combine_splits`): fp32 O and log-sum-exp per split and
#: row, and the number of splits.
SPLIT_BUFFERS = (("o_partial", "acc_t*"), ("lse_partial", "acc_t*"))
SPLIT_CONTROL = ("splits",)
#: A paged call's appended keys and values (CUDA forward: `append_new_keys`, run before it
#: reads the cache): k_new and v_new [appended_rows, Hkv, D / Dv] contiguous, and the cache row
#: (page * page_size + slot) of each, int64 [appended_rows]; null and 0 without an append.
APPEND_BUFFERS = (("k_new", "const kv_t*"), ("v_new", "const kv_t*"), ("append_rows", "const int64_t*"))
APPEND_CONTROL = ("appended_rows",)
#: The CPU kernels' schedule: by_rows, 1 where the forward reads K and V by rows
#: (TilePlan.reads_by_rows, the template's forward_decode), 0 where it packs panels per kv head
#: for tile products; key_tiles_per_sweep, the fused backward's key tiles per sweep over a task's
#: query tiles (TilePlan.key_tiles_per_sweep); key_chunks, the chunks the fused backward cuts
#: each (b, kv head)'s key tiles into, a task each (`Kernel.backward_passes`).
CPU_CONTROL = ("by_rows", "key_tiles_per_sweep", "key_chunks")
#: A paged call's block table (int64 [B, pages]; null otherwise), then its page size and the
#: table's row stride (`Kernel.paged` reads K/V through it: templates/cpu and templates/cuda
#: `key_row_offset`).
PAGE_BUFFERS = (("pages", "const int64_t*"),)
PAGE_CONTROL = ("page_size", "st_pages_0")
#: A packed (varlen) call's sequences in one launch (CPU and CUDA kernels): int64 [B + 1] first query rows
#: and first key rows of each sequence in the packed operands (cu_seqlens), null in padded calls
#: (templates/common/variant.jinja `seq_n`, `seq_m`). A paged call may give key bounds alone:
#: then only the per-sequence key counts come from them (its rows come from the block table).
SEQUENCE_BUFFERS = (("q_starts", "const int64_t*"), ("k_starts", "const int64_t*"))
#: Rotary embeddings applied by the kernels as they load q and k (runtime/rope.py): cos and
#: sin [B or 1, rows, half] of q's and k's rows (null without rope), then per operand the first
#: rotated head dim, the pairs' count `half` and the tables' batch stride (0: one for all).
ROPE_BUFFERS = (
    ("q_cos", "const acc_t*"),
    ("q_sin", "const acc_t*"),
    ("k_cos", "const acc_t*"),
    ("k_sin", "const acc_t*"),
)
ROPE_CONTROL = ("rope_q_first", "rope_q_half", "rope_q_sb", "rope_k_first", "rope_k_half", "rope_k_sb")


@dataclass(frozen=True)
class KernelAbi:
    tensors: tuple[TensorSlot, ...]  # runtime tensors read by the variant, then layout grids
    scalars: tuple[tuple[str, str, str], ...]  # (program name, C++ member, C type)
    grads: tuple[str, ...]  # float tensors that can receive gradients (program names)
    cuda: bool = False  # the CUDA kernels' slots (EXACT_GRAD_BUFFERS, SPLIT_*, APPEND_*) too

    def pointer_slots(self) -> list[tuple[str, str]]:
        """(member, C type) of every pointer, in order."""
        slots = (
            [(n, t) for n, t in OPERANDS]
            + list(ROW_BUFFERS)
            + list(SPLIT_BUFFERS + APPEND_BUFFERS if self.cuda else CPU_ROW_BUFFERS)
            + list(PAGE_BUFFERS)
            + list(SEQUENCE_BUFFERS)
            + list(ROPE_BUFFERS)
        )
        slots += [(t.ident, f"const {t.ctype}*") for t in self.tensors]
        slots += [(f"grad_{self.ident_of(n)}", "grad_t*") for n in self.grads]
        for kind, ctype in EXACT_GRAD_BUFFERS if self.cuda else ():
            slots += [(f"grad_{kind}_{self.ident_of(n)}", ctype) for n in self.grads]
        return slots

    def int_slots(self) -> list[str]:
        names = list(SIZES)
        names += [f"st_{n}_{d}" for n, _ in OPERANDS for d in range(4)]
        names += list(CONTROL) + list(SPLIT_CONTROL + APPEND_CONTROL if self.cuda else CPU_CONTROL) + list(PAGE_CONTROL)
        names += list(ROPE_CONTROL)
        names += [f"st_{t.ident}_{d}" for t in self.tensors for d in range(t.rank)]
        names += [f"grad_slice_{self.ident_of(n)}" for n in self.grads]  # per-thread buffer stride
        return names

    def real_slots(self) -> list[str]:
        return list(REALS) + [ident for _, ident, _ in self.scalars]

    def ident_of(self, name: str) -> str:
        return next(t.ident for t in self.tensors if t.name == name)


def kernel_abi(g: Graph, cuda: bool = False) -> KernelAbi:
    """The ABI of the fused kernel in `g` (after sparsity analysis); `cuda` adds the CUDA
    kernels' slots (exact learnable-input gradient sums, split-KV partials)."""
    _, op = fused_node(g)
    declared = inputs(g)
    tensors = [d for d in runtime_inputs(g) if d.role == "tensor"]
    tensors += [declared[name] for name, _ in op.sparsity.layout_grids] if op.sparsity else []
    slots = tuple(TensorSlot(d.name, tensor_ident(d.name), _ELEMENT_TYPES[d.dtype], len(d.dims)) for d in tensors)
    scalars = tuple(
        (d.name, scalar_ident(d.name), {"float": "acc_t", "int": "int64_t", "bool": "bool"}[d.dtype])
        for d in runtime_inputs(g)
        if d.role == "scalar"
    )
    grads = tuple(t.name for t in slots if declared[t.name].dtype == "float" and declared[t.name].role == "tensor")
    return KernelAbi(slots, scalars, grads, cuda)
