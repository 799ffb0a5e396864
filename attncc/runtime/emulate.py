"""CUDA kernels on the host: the generated .cu text run by attncc's CUDA emulator.

`EmulatedKernel` is a `Kernel` whose forward runs the CUDA forward kernel (fp16/bf16 tensor
cores, emulated lane by lane) on CPU tensors, so the CUDA code generator is golden-tested on
machines without a GPU. Each call can pick the emulator's schedule; a correct kernel gives the
same bits under every schedule.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from attncc.codegen import FP8_MMA_SUFFIX, PAGED_SUFFIX
from attncc.codegen.cuda import FP8_MMA_K, emulation_wrapper, generate_cuda, rounded_head_dim, storage_dtypes
from attncc.errors import AttnccError, InputError
from attncc.passes.positions import FOLD_GROUP, FOLD_ROWS
from attncc.passes.tiling import (
    GPU_KEY_SPLIT_ROWS,
    GPU_SHORT_QUERY_ROWS,
    choose_kv_splits,
    split_kv_blocks,
    split_kv_slots,
)
from attncc.runtime.build import EMULATOR_FLAGS, build_library
from attncc.runtime.fp8 import is_fp8, library_dtype
from attncc.runtime.kernel import (
    CALL_OPERANDS,
    PLAN_MEMO_KEPT,
    CallPlan,
    KeptLaunch,
    Kernel,
    PackedSequences,
    PagedKeys,
    _sizes,
    acc_dtype,
    delta_rows,
    keep_bounded,
    without_call_tensors,
)
from attncc.runtime.locks import module_lock
from attncc.runtime.merge import merge_states
from attncc.runtime.ragged import Appends, append_to_caches
from attncc.targets import GPUS

#: The emulator's schedules (include/attncc/cuda/emulator.h): the order its threads run to their
#: sync points, and with "-eager-copies" cp.async copies landing as issued instead of at the wait.
SCHEDULES = {"lockstep": 0, "warp-greedy": 1, "lockstep-eager-copies": 2, "warp-greedy-eager-copies": 3}
#: Added to a schedule where `EmulatedKernel.racecheck` is on (emulator.h kRaceCheck).
RACE_CHECK = 4
_LOCK = module_lock(__name__, "_LOCK")


FP16_MAX = 65504.0


def rows_of(t: torch.Tensor, storage: torch.dtype, name: str) -> torch.Tensor:
    """`t` in the kernel's storage dtype with unit stride along D: the kernels copy rows of D
    halves (16-byte cp.async chunks); any other batch, head and row strides are fine. fp32/fp64
    values beyond fp16's range are an error where the target converts them to fp16 (sm75)."""
    if storage == torch.float16 and t.dtype in (torch.float32, torch.float64) and t.numel():
        largest = float(t.detach().abs().nan_to_num(0.0, 0.0, 0.0).amax())
        if largest > FP16_MAX:
            raise InputError(
                f"{name}: holds {largest:.4g}, beyond float16's range (65504); this target's tensor cores take "
                "float16 only, so fp32 inputs are converted: scale them down or use an sm80+ GPU (bf16)"
            )
    t = t.to(storage)
    return t if t.stride(-1) == 1 else t.contiguous()


#: Non-finite terms seen per element (grad_flags bits, as kPosInf/kNegInf/kNaN in the CUDA template).
POS_INF, NEG_INF, NAN = 1, 2, 4


def fixed_point_shifts(bound: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Per element, the shift of the grid 2^-shift on which its finite terms sum exactly in int64.

    `bound` holds the largest |term| as float bits and `count` the number of terms. With
    |term| < 2^e (e from the exponent field; also for zero and subnormals) and count < 2^c,
    each rounded term is at most 2^(63 - c) and the sum of all of them at most
    2^63 - 2^(63 - c): it fits int64, and partial sums may wrap (two's complement addition
    is exact modulo 2^64), so the order the atomics land in cannot change the result. The
    grid step is at least 62 - c bits below the largest term: finer than that term's fp32
    rounding up to 2^38 terms per element.
    """
    exponent = ((bound >> 23) & 0xFF) - 126
    count_bits = torch.ceil(torch.log2(count.double() + 1)).to(torch.int32)
    return (63 - count_bits - exponent).to(torch.int32)


def from_fixed_point(sums: torch.Tensor, shifts: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """The fp32 gradient: sums x 2^-shift; where a term was not finite, what float addition
    gives in any order without an intermediate overflow: NaN for a NaN or both infinities, else
    the infinity."""
    exact = torch.ldexp(sums.double(), -shifts.double()).float()
    nan = ((flags & NAN) != 0) | ((flags & (POS_INF | NEG_INF)) == (POS_INF | NEG_INF))
    exact = torch.where(flags == POS_INF, float("inf"), torch.where(flags == NEG_INF, float("-inf"), exact))
    return torch.where(nan, float("nan"), exact)


class EmulationFailure(AttnccError):
    """The emulator caught a kernel bug: divergent barrier, deadlock, bad lane mask, misaligned
    ldmatrix, a copy in flight at exit; with `racecheck`, a shared-memory race or an access past
    the block's shared memory."""


def library_dims(head_dim: int, value_dim: int | None) -> tuple[int, int, bool]:
    """What a CUDA library is built for: q/k's and v's head dims rounded up to 16, and whether
    they are equal (codegen/cuda.py generate_cuda); value_dim None: head_dim."""
    value_dim = head_dim if value_dim is None else value_dim
    return rounded_head_dim(head_dim), rounded_head_dim(value_dim), head_dim == value_dim


def _check_lengths_fit_32_bits(
    q: torch.Tensor, k: torch.Tensor, paged: PagedKeys | None, packed: PackedSequences | None
) -> None:
    """The CUDA kernels count a sequence's queries and keys in 32 bits (`n_b`, `m_b`, tile
    column counts): a sequence of 2^31 keys or more had its key tiles read as negative widths
    and masked, silently (the answer of its last keys alone). Refused, naming the argument."""
    if packed is not None:
        counts = {"cu_seqlens_q": packed.longest[0], "cu_seqlens_k": packed.longest[1]}
    else:
        counts = {"q": q.shape[2], "cache_seqlens" if paged is not None else "k": paged.keys if paged else k.shape[2]}
    for name, count in counts.items():
        if count >= 2**31:
            what = "queries" if name.endswith("q") else "keys"
            raise InputError(
                f"{name}: a sequence of {count} {what}; the CUDA kernels take fewer than 2^31 per sequence "
                "(the cpu target takes more)"
            )


class EmulatedKernel(Kernel):
    """Forward and backward CUDA kernels run on the host emulator (CPU tensors)."""

    schedule = "lockstep"
    cuda_abi = True
    appends_in_library = True

    #: Every shared-memory access of the kernels checked for races (the emulator's kRaceCheck):
    #: two threads' accesses to a byte, one a write, with no barrier between (lanes of one warp:
    #: no collective), or a cp.async's bytes touched before its thread's wait. The first race
    #: fails the call with `EmulationFailure` naming both kernel lines, where comparing schedules
    #: finds only the races whose outcome differs between them. On by default: it costs ~1.15x
    #: the emulator's time (causal fwd+bwd, N = 256: 0.151 -> 0.172 s).
    racecheck = True

    #: dQ by a second kernel instead of fp32 atomics, and gradients of learnable inputs as exact
    #: fixed-point sums (a bounds pass, then the sums; see `fixed_point_shifts`), so every gradient is
    #: bit-reproducible on a GPU; also on under torch.use_deterministic_algorithms(True).
    deterministic = False

    #: Split-KV of the forward: None chooses per call (`choose_kv_splits`: only where the query
    #: tiles leave most of the GPU idle, as when decoding); an int forces that many splits.
    kv_splits: int | None = None

    #: Calls of at most GPU_SHORT_QUERY_ROWS query rows per (batch, head), a GQA group's heads
    #: folded in (decoding), run the forward of that many rows (`Kernel.for_short_queries`): on
    #: by default on a GPU (GpuKernel); off on the emulator, where it would build a second
    #: library for every short test call (the tests that cover it turn it on).
    short_query_tiles = False

    #: Calls of at most 16 (32) query rows per (batch, head), GQA folded in, run one (two) row
    #: block(s) whose warps split each key tile (`Kernel.for_key_split_warps`) instead, unless
    #: they multiply on the fp8 tensor cores: on by default on a GPU (GpuKernel; the H100 sweep
    #: of session 29 timed it at or ahead of the 64-row forward at every decoding shape, at the
    #: split counts `split_kv_slots` now gives), off on the emulator (as short_query_tiles).
    key_split_warps = False

    #: K/V buffers of those forwards: None, the target's choice (`decoding_stages`: 3 where a
    #: block's shared memory takes them, two tiles in flight); 2 or 3 to force one (the GPU
    #: decoding sweep times 2 against the default).
    key_split_stages: int | None = None

    #: fp8 K/V calls multiply on the fp8 tensor cores where the target has them (sm89, sm90; see
    #: `takes_fp8_products`): q and P are rounded to e4m3 in the kernel, which moves the result
    #: by about e4m3's precision (runtime/fp8.py). False: K and V are widened to q's dtype, and
    #: the result is that of the dequantised operands.
    fp8_mma = False

    def flag(self, name: str) -> bool:
        """The True/False setting `name` (deterministic, fp8_mma, key_split_warps,
        short_query_tiles): anything else is an error (a
        string "False" is truthy: it switched the mode on, silently)."""
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise AttnccError(f"{name}: expected True or False, got {value!r}")
        return value

    def multiprocessors(self) -> int:
        """SMs the split-KV choice fills: the target's reference part (the emulator has no device)."""
        return GPUS[self.target].multiprocessors

    def plan(self, q, k, scale, backward=False, value_dim=None) -> CallPlan:  # noqa: ANN001 - as Kernel
        """As Kernel's; the forward's also says how many blocks share a query tile's keys."""
        plan = super().plan(q, k, scale, backward, value_dim)
        if backward:
            return plan
        p = plan.problem
        query_blocks, key_tiles = split_kv_blocks(p.B, p.H, p.N, p.M, plan.tiles)
        if self.kv_splits is None:
            slots = split_kv_slots(plan.tiles, GPUS[self.target], self.multiprocessors())
            splits = choose_kv_splits(query_blocks, key_tiles, slots)
        elif isinstance(self.kv_splits, int) and not isinstance(self.kv_splits, bool) and self.kv_splits >= 1:
            splits = self.kv_splits
        else:
            raise AttnccError(f"kv_splits: expected None or an int >= 1, got {self.kv_splits!r}")
        return replace(plan, kv_splits=max(1, min(splits, key_tiles)))

    def for_rows(self, rows: int, head_dim: int) -> EmulatedKernel:
        """The kernel whose forward runs a call of `rows` query rows per (batch, head) at this
        (plan) head dim: `for_key_split_warps` of 16 or 32 rows where `key_split_warps` is on
        (and not `fp8_mma`) and the rows are at most 32; else `for_short_queries` where
        `short_query_tiles` is on, the rows are at most GPU_SHORT_QUERY_ROWS and the plan's
        forward has more; else this one."""
        assert self.op.tiling is not None
        if self.flag("key_split_warps") and not self.flag("fp8_mma") and rows <= GPU_KEY_SPLIT_ROWS[-1]:
            fitting = next(r for r in GPU_KEY_SPLIT_ROWS if rows <= r)
            return self.for_key_split_warps(fitting, self.key_split_stages)  # type: ignore[return-value]
        if not self.flag("short_query_tiles") or rows > GPU_SHORT_QUERY_ROWS:
            return self
        if self.op.tiling.for_head_dim(head_dim).block_rows <= GPU_SHORT_QUERY_ROWS:
            return self
        return self.for_short_queries()  # type: ignore[return-value]

    def decoding_forwards(self, head_dim: int) -> list[EmulatedKernel]:
        """The forwards other than this one that `for_rows` gives calls of 1 to
        GPU_SHORT_QUERY_ROWS query rows per (batch, head) at `head_dim`: what a deployment
        prebuilds beside each kernel (`attncc prebuild`)."""
        row_counts = (*GPU_KEY_SPLIT_ROWS, GPU_SHORT_QUERY_ROWS)
        forwards = {id(kern): kern for kern in (self.for_rows(rows, head_dim) for rows in row_counts)}
        return [kern for kern in forwards.values() if kern is not self]

    def deployed_forwards(self, head_dim: int) -> list[EmulatedKernel]:
        """This kernel, the forwards of calls of few query rows (`decoding_forwards`) and all
        again with a GQA group's query heads folded into rows (`with_folded_query_heads`: GQA
        decoding): each a library of its own at `head_dim`, what a deployment prebuilds."""
        kernels = (self, self.with_folded_query_heads())
        return [each for kern in kernels for each in (kern, *kern.decoding_forwards(head_dim))]  # type: ignore[attr-defined]

    def storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The tensor-core dtype q, k, v of `dtype` run in: fp16/bf16 as given, fp32/fp64 converted
        to the target's first choice (bf16; fp16 on sm75, whose tensor cores lack bf16)."""
        allowed = [getattr(torch, name) for name in storage_dtypes(self.target)]
        return dtype if dtype in allowed else allowed[0]

    def validate(self, q, k, v, runtime, *, on_target: bool = True) -> None:  # noqa: ANN001 - as Kernel
        super().validate(q, k, v, runtime, on_target=on_target)
        if q.dtype in (torch.float16, torch.bfloat16) and self.storage_dtype(q.dtype) != q.dtype:
            raise InputError(
                f"q: the {self.target} tensor cores take {' or '.join(storage_dtypes(self.target))}, got {q.dtype}"
            )

    def source(self, dtype: str = "float16", head_dim: int | None = None, value_dim: int | None = None) -> str:
        """The CUDA text (`cuda_source`): a CUDA kernel's text is made per head dim, so it is
        asked for with one (the CPU kernels' `source(dtype)` serves every head dim). A bare
        AssertionError from the CPU generator before (session 64's review)."""
        if head_dim is None:
            raise InputError(
                f"{self.target} kernels' text is made per head dim: source({dtype!r}, head_dim=64) or "
                "cuda_source(dtype, head_dim)"
            )
        return self.cuda_source(dtype, head_dim, value_dim)

    def cuda_source(self, dtype: str, head_dim: int, value_dim: int | None = None) -> str:
        """The CUDA text for q/k/v of storage `dtype`, q and k of `head_dim`, v of `value_dim`
        (default: head_dim), with the tiles of the larger."""
        assert self.op.tiling is not None
        value_dim = head_dim if value_dim is None else value_dim
        plan = self.op.tiling.for_head_dim(max(head_dim, value_dim))
        return generate_cuda(self.graph, dtype, plan, self.target, head_dim, value_dim)

    def library_name(self, kind: str, dtype: str, head_dim: int, value_dim: int | None) -> str:
        """The cache name of a built library: one per storage dtype and `library_dims`."""
        rounded, rounded_value, same = library_dims(head_dim, value_dim)
        suffix = f"{rounded}" if same else f"{rounded}x{rounded_value}"
        return f"{self.name}-{self.target}-{kind}-{dtype}-{suffix}"

    def library_path_for(self, dtype: str, head_dim: int, value_dim: int | None = None) -> Path:
        """The emulator's library for storage `dtype` and these head dims, built, not loaded."""
        return build_library(
            emulation_wrapper(self.target),
            self.library_name("emu", dtype, head_dim, value_dim),
            {"kernel.cu": self.cuda_source(dtype, head_dim, value_dim)},
            optimized=EMULATOR_FLAGS,
            parts=2,
        )

    def emulated_library(self, dtype: str, head_dim: int, value_dim: int | None = None) -> ctypes.CDLL:
        key = (dtype, *library_dims(head_dim, value_dim))  # (the text depends on the key alone)
        return self._loaded(key, lambda: self.library_path_for(dtype, head_dim, value_dim), None)

    def prebuild(
        self,
        dtypes: Sequence[torch.dtype],
        head_dims: Sequence[int],
        kv_dtypes: Sequence[torch.dtype] = (),
        paged: bool = False,
    ) -> list[Path]:
        """Build, without loading, the libraries for q/k/v of `dtypes` (their tensor-core storage
        dtypes) at the plans of `head_dims`, and the fp8 forwards of those storages with
        `kv_dtypes`; with `paged`, each one's paged forward too (Kernel.paged)."""
        assert self.op.tiling is not None
        storages = dict.fromkeys(self.storage_dtype(d) for d in dtypes)
        names = [library_dtype(s, s) for s in storages]
        names += [library_dtype(s, kv) for kv in dict.fromkeys(kv_dtypes) for s in storages]
        if self.fp8_mma and GPUS[self.target].fp8_mma:  # and the same on fp8 tensor cores
            names += [library_dtype(s, kv) + FP8_MMA_SUFFIX for kv in dict.fromkeys(kv_dtypes) for s in storages]
        if paged:
            names += [name + PAGED_SUFFIX for name in names]
        plans = dict.fromkeys(rounded_head_dim(d) for d in head_dims)
        return [self.library_path_for(name, d) for name in names for d in plans]

    def forward_impl(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tensors: list[torch.Tensor],
        scalars: list[float],
        scale: float | None,
        dropout: float,
        seed: int,
        offset: int = 0,
        paged: PagedKeys | None = None,
        sink: torch.Tensor | None = None,
        packed: PackedSequences | None = None,
        descale: Mapping[str, torch.Tensor] | None = None,
        appends: Appends | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        launch_key = self.launch_key(q, k, v, tensors, scalars, scale, dropout, paged, sink, packed, descale)
        launches = paged.prepared if paged is not None else packed.prepared if packed is not None else self._repeats
        launch = launches.get(launch_key) if launch_key is not None and launches is not None else None
        new_rows = None if appends is None else [t.contiguous() for t in appends[1:]]  # (as the library reads them)
        if launch is not None:
            if new_rows is not None:
                return launch(q, k, v, *new_rows)
            return launch(q, k, v, runtime=dict(zip(self.tensor_names, tensors)))
        _check_lengths_fit_32_bits(q, k, paged, packed)
        storage = self.storage_dtype(q.dtype)
        qs = rows_of(q, storage, "q")

        def kernel_rows() -> tuple[torch.Tensor, torch.Tensor]:  # fp8: the bytes as stored, widened by the kernel
            if is_fp8(k):
                return k if k.stride(-1) == 1 else k.contiguous(), v if v.stride(-1) == 1 else v.contiguous()
            return rows_of(k, storage, "k"), rows_of(v, storage, "v")

        ks, vs = kernel_rows()
        # by torch where the kernel reads converted copies of the caches, or runs for no query
        if appends is not None and (ks.data_ptr() != k.data_ptr() or vs.data_ptr() != v.data_ptr() or not q.numel()):
            append_to_caches(k, v, appends)
            ks, vs, appends = *kernel_rows(), None
        scales = dict(descale or {})
        value_dim = v.shape[-1]
        rows_out = torch.empty((*q.shape[:-1], value_dim), dtype=storage, device=q.device)  # (packed: [total_q, H, Dv])
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        out, lengths = rows_out, None
        if packed is not None:  # the kernels see [B, heads, longest, D] views (PackedSequences)
            qs, ks, vs = packed.as_batch(qs, False), packed.as_batch(ks, True), packed.as_batch(vs, True)
            scales = {name: packed.as_batch(t, True) for name, t in scales.items()}
            out, lengths = packed.as_batch(rows_out, False), packed.lengths
        kern, kernel_lse = self, lse
        keys = ks if paged is None else paged.keys_like(qs, ks)  # [B, Hkv, keys, D], as plans see k
        group = self.query_head_group(qs, keys.shape[1], value_dim, dropout, packed)
        launch_scales = None
        if group > 1:  # the group's query heads as one head's rows: K/V tiles read once per group
            # (the scale values at the call's sizes: the default scale and q.k factor may read H,
            # which folding changes, and were 0.6-1.2 off, session 58)
            launch_scales = self._scale_values(_sizes(qs, keys), scale)
            kern = self.with_folded_query_heads()
            B, H, N, D = qs.shape
            qs = qs.reshape(B, H // group, group * N, D)
            out = out.view(B, H // group, group * N, value_dim)
            kernel_lse = lse.view(B, H // group, group * N)
            values = {**self.runtime_values(tensors, scalars), FOLD_ROWS: N, FOLD_GROUP: group}
            tensors = [values[d.name] for d in kern.inputs if d.role == "tensor"]  # type: ignore[misc]
            scalars = [float(values[d.name]) for d in kern.inputs if d.role == "scalar"]  # type: ignore[arg-type]
        kern = kern.for_rows(qs.shape[2], max(qs.shape[-1], value_dim))
        if paged is not None:
            lengths = paged.lengths(qs.shape[2])
        plan = kern.plan(qs, keys, scale, value_dim=value_dim)
        if launch_scales is not None:
            plan = replace(plan, scale_value=launch_scales[0], scale=launch_scales[1])
        call = kern._prepare(plan, torch.float32, tensors, scalars, lengths, None if paged is None else paged.prepared)
        call["offset"] = offset
        if rows_out.numel():
            ptrs = {"q": qs, "k": ks, "v": vs, "out": out, "lse": kernel_lse, **scales}
            rope_ptrs, call["rope"] = kern.rope_buffers(qs, keys, tensors, scalars, lengths)
            ptrs.update(rope_ptrs)
            if packed is not None:
                ptrs.update(packed.buffers())
            if plan.kv_splits > 1:  # each split's O and log-sum-exp per row [B, H, longest], merged by the kernel
                # (fp32, whatever torch's default dtype: a bf16 default halved them, and the kernel's
                # writes corrupted the heap, session 67's review)
                rows = qs.shape[0] * qs.shape[1] * qs.shape[2]
                ptrs["o_partial"] = torch.empty(plan.kv_splits, rows, value_dim, dtype=torch.float32, device=q.device)
                ptrs["lse_partial"] = torch.empty(plan.kv_splits, rows, dtype=torch.float32, device=q.device)
            strides = None
            if paged is not None:  # caches [pages, page_size, Hkv, D] read through the block table
                ptrs.update(paged.buffers())
                call["page_size"] = paged.page_size
                strides = PagedKeys.strides({"k": ks, "v": vs, **scales})
            if appends is not None:  # written by the library before its forward (`append_new_keys`)
                ptrs.update(append_rows=appends[0].rows, k_new=new_rows[0], v_new=new_rows[1])  # type: ignore[index]
            dtype = library_dtype(storage, k.dtype)
            token_dims = (0,) if packed is not None else (0, 1) if paged is not None else (2,)
            if kern.takes_fp8_products(k, (descale or {}).get("v_descale"), token_dims, plan):
                dtype += FP8_MMA_SUFFIX
            if paged is not None:  # its own forward, which reads K/V through the block table
                dtype += PAGED_SUFFIX
            packed_args = kern._run("attncc_emulated_forward", dtype, plan, call, ptrs, dropout, seed, strides=strides)
            # kept only where the kernel reads the caller's q, k and v in place: a folded q that
            # reshape had to copy (a transposed q with N > 1) would leave the copy's strides in it
            in_place = all(ptrs[n].data_ptr() == t.data_ptr() for n, t in (("q", q), ("k", k), ("v", v)))
            if launch_key is not None and launches is not None and in_place:
                pointers, ints, reals = packed_args
                library = kern.emulated_library(dtype, plan.problem.D, plan.problem.Dv)
                names = kern._slot_names.pointers
                partials = (ptrs["o_partial"].shape, ptrs["lse_partial"].shape) if plan.kv_splits > 1 else None
                slots = kern.per_call_tensor_slots(dict(zip(kern.tensor_names, tensors)))
                launch = KeptLaunch(
                    kern, library, kern._entry(library, "attncc_emulated_forward"), list(pointers),
                    {name: names.index(name) for name in CALL_OPERANDS if name in ptrs}, ints, reals,
                    tuple(rows_out.shape), tuple(lse.shape), lse.dtype, partials,
                    (without_call_tensors(call, slots), paged),
                )  # fmt: skip
                launch.tensor_slots = slots
                if paged is None and packed is None:
                    self._keep_repeat(launch_key, launch)
                else:  # the plan's memo: as long-lived as the plan
                    with self._lock:
                        keep_bounded(launches, launch_key, launch, PLAN_MEMO_KEPT)
        if sink is not None:  # merged on the host with an empty part of lse `sink` (runtime/sinks.py)
            with torch.no_grad():
                sink_lse = sink.to(lse.dtype).expand(lse.shape)
                rows_out, lse = merge_states([rows_out, torch.zeros_like(rows_out)], [lse, sink_lse])
        return rows_out.to(q.dtype), lse.to(acc_dtype(q.dtype))

    def takes_fp8_products(
        self, k: torch.Tensor, v_descale: torch.Tensor | None, token_dims: tuple[int, ...], plan: CallPlan
    ) -> bool:
        """Whether an fp8 K/V call runs its products on the fp8 tensor cores: asked for
        (`fp8_mma`) on a target that has them, K not rotated in the kernel (the kernel takes its
        bytes as stored), q's and k's head dim in steps of 32 once rounded to 16 (one mma's k)
        and key tiles too, and one v factor per kv head: `v_descale` ([..., 1], as
        fp8.descale_rows gives it) constant along the layout's token dims, since the kernel
        scales the output by it (a factor per token would have to enter P before its rounding)."""
        if not (self.flag("fp8_mma") and GPUS[self.target].fp8_mma and is_fp8(k) and v_descale is not None):
            return False
        if self.op.k_rope is not None or plan.tiles.block_cols % FP8_MMA_K:
            return False
        if rounded_head_dim(k.shape[-1]) % FP8_MMA_K:
            return False
        return all(v_descale.stride(d) == 0 or v_descale.shape[d] == 1 for d in token_dims)

    def _keeps_launches(self) -> bool:
        return True  # those forward_impl keeps (`launch_key`): `_remember_repeat` finds them

    def _remember_repeat(
        self,
        key: tuple,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        scalars: list[float],
        scale: float | None,
        packed: PackedSequences | None = None,
        tensors: Sequence[torch.Tensor] = (),
    ) -> None:
        """The launch forward_impl kept for this checked call (if it kept one), also under the
        call's `_repeat_key`: a call repeating it skips the checks too, not only the plan and
        packing (a planned packed call's in its plan's memo). `tensors`: a padded call's
        runtime tensors (declaration order)."""
        launch = self.kept_launch(q, k, v, scalars, scale, packed=packed, tensors=tensors)
        if launch is not None:
            self._keep_repeat(key, launch, packed)

    def kept_launch(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scalars: list[float], scale: float | None,
        paged: PagedKeys | None = None, packed: PackedSequences | None = None, tensors: Sequence[torch.Tensor] = (),
    ) -> KeptLaunch | None:  # fmt: skip
        """The launch forward_impl kept for these operands (a plain call's, or in the plan's
        memo a planned paged or packed call's), if any."""
        key = self.launch_key(q, k, v, list(tensors), scalars, scale, 0.0, paged, None, packed, None)
        launches = self._repeats if paged is None and packed is None else (paged or packed).prepared  # type: ignore[union-attr]
        return None if key is None or launches is None else launches.get(key)

    def launch_key(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        tensors: list[torch.Tensor],
        scalars: list[float],
        scale: float | None,
        dropout: float,
        paged: PagedKeys | None,
        sink: torch.Tensor | None,
        packed: PackedSequences | None,
        descale: Mapping[str, torch.Tensor] | None,
    ) -> tuple | None:
        """What decides a forward's packed launch (`KeptLaunch`) besides the operands'
        addresses: their sizes, strides, dtypes and device, the scale, the scalar inputs' values
        (they reach the kernel and may decide tile classes), the split count asked for and, for
        a paged or packed call, the plan (whose memo then holds the launch, so it lives as
        long as the plan's table or offsets), and a padded call's runtime tensors'
        (`tensors_launch_key`: the kept launch points at each call's). None where a call cannot
        repeat one: runtime tensors of a paged or packed call or whose values the host reads per
        call, dropout (a seed per call), sinks, rope, fp8 K/V, a paged or packed call without a
        plan (`attncc.plan_paged`, `attncc.plan_varlen`: buffers made per call), and operands
        the kernel would convert first."""
        if dropout > 0 or sink is not None or descale or (packed is not None and packed.prepared is None):
            return None
        if self.op.q_rope is not None or self.op.k_rope is not None or (paged is not None and paged.prepared is None):
            return None
        storage = self.storage_dtype(q.dtype)
        if any(t.dtype != storage or t.stride(-1) != 1 for t in (q, k, v)):
            return None
        tensor_key: tuple | None = ()
        if tensors:
            plain = paged is None and packed is None
            tensor_key = self.tensors_launch_key(dict(zip(self.tensor_names, tensors))) if plain else None
            if tensor_key is None:
                return None
        return (
            "forward", self.call_key, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
            q.device, scale, tuple(scalars), self.launch_settings(), tensor_key,
        )  # fmt: skip

    def query_head_group(
        self, q: torch.Tensor, kv_heads: int, value_dim: int, dropout: float, packed: PackedSequences | None
    ) -> int:
        """G = H / Hkv where the forward runs each GQA group's query heads as the rows of one
        head (`with_folded_query_heads`), else 1: where that needs fewer query tiles (decoding,
        short chunks; with G heads of N rows, ceil(G N / Br) < G ceil(N / Br)), and only for
        padded and paged calls without dropout (packed sequences have their own N; dropout
        counts its counters from the program's head and row)."""
        _, H, N, D = q.shape
        if packed is not None or dropout > 0 or kv_heads == 0 or H == kv_heads or N == 0:
            return 1
        assert self.op.tiling is not None
        rows = self.op.tiling.for_head_dim(max(D, value_dim)).block_rows
        group = H // kv_heads
        return group if math.ceil(group * N / rows) < group * math.ceil(N / rows) else 1

    def backward_impl(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        tensors: list[torch.Tensor],
        scalars: list[float],
        scale: float | None,
        dropout: float,
        seed: int,
        grad_inputs: list[bool],
        offset: int = 0,
        packed: PackedSequences | None = None,
        sink: torch.Tensor | None = None,  # (as Kernel's; the CUDA backward takes P = exp(S - lse)
        all_keys: bool = True,  # as FlashAttention's, so its lse residuals are 0)
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        storage = self.storage_dtype(q.dtype)
        qs, ks, vs, dos = (rows_of(t, storage, n) for t, n in ((q, "q"), (k, "k"), (v, "v"), (dout, "grad of out")))
        dk = torch.empty(k.shape, dtype=storage, device=k.device)
        dv = torch.empty(v.shape, dtype=storage, device=v.device)
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # rows as lse's, by D
        dq_out = torch.empty(q.shape, dtype=storage, device=q.device)
        operands = {"q": qs, "k": ks, "v": vs, "dout": dos, "dk": dk, "dv": dv, "dq": dq_out}
        if packed is not None:  # (key-side operands: those of k's shape)
            operands = {name: packed.as_batch(t, name in ("k", "v", "dk", "dv")) for name, t in operands.items()}
        plan = self.plan(operands["q"], operands["k"], scale, backward=True, value_dim=v.shape[-1])
        call = self._prepare(plan, torch.float32, tensors, scalars, None if packed is None else packed.lengths)
        call["offset"] = offset
        tensor_decls = [d for d in self.inputs if d.role == "tensor"]
        grads = {
            d.name: torch.zeros(t.shape, dtype=torch.float32, device=t.device)
            for d, t, want in zip(tensor_decls, tensors, grad_inputs)
            if want and d.name in self.abi.grads
        }
        if q.numel() and k.numel():
            delta = delta_rows(out, dout, dlse, torch.float32)
            ptrs = {name: operands[name] for name in ("q", "k", "v", "dout", "dk", "dv")}
            ptrs.update(lse=lse.float().contiguous(), delta=delta)
            rope_ptrs, call["rope"] = self.rope_buffers(
                operands["q"], operands["k"], tensors, scalars, None if packed is None else packed.lengths
            )
            ptrs.update(rope_ptrs)
            if packed is not None:
                ptrs.update(packed.buffers())
            ptrs.update({f"grad_{self.abi.ident_of(n)}": g for n, g in grads.items()})
            dtype = str(storage).replace("torch.", "")
            deterministic = self.flag("deterministic") or torch.are_deterministic_algorithms_enabled()
            if deterministic:  # dQ from its own kernel, no atomics
                ptrs["dq"] = operands["dq"]
            if deterministic and grads:  # exact sums: first the bounds, then the grid per element
                self._bound_input_grads(grads, dtype, plan, call, ptrs, dropout, seed)
            accum = None if deterministic else ctypes.c_void_p(dq_accum.data_ptr())
            self._run("attncc_emulated_backward", dtype, plan, call, ptrs, dropout, seed, accum)
            dq = (dq_out if deterministic else dq_accum).to(q.dtype)
            if deterministic and grads:
                for n, g in grads.items():
                    ident = self.abi.ident_of(n)
                    sums, shifts, flags = (ptrs[f"grad_{kind}_{ident}"] for kind in ("fixed", "shift", "flags"))
                    g.copy_(from_fixed_point(sums, shifts, flags))
        else:
            dk.zero_(), dv.zero_()
            dq = dq_accum.to(q.dtype)
        grad_list = [
            grads[d.name].to(t.dtype) if d.name in grads else t.new_empty(0) for d, t in zip(tensor_decls, tensors)
        ]
        if sink is not None:  # (as Kernel's: the lse residuals, none here)
            grad_list.append(torch.zeros(lse.shape, dtype=torch.float32, device=lse.device))
        return dq, dk.to(k.dtype), dv.to(v.dtype), grad_list

    def _bound_input_grads(self, grads, dtype, plan, call, ptrs, dropout, seed) -> None:  # noqa: ANN001
        """The first pass of deterministic mode's exact learnable-input gradients: the kernel
        records each element's largest finite |term|, its finite terms' count and the non-finite
        values seen; then ptrs get each element's grid (`fixed_point_shifts`) and zeroed int64
        sums for attncc_backward's second pass."""
        for n, g in grads.items():
            ident = self.abi.ident_of(n)
            for kind, dtype_of_buffer in (("bound", torch.int32), ("flags", torch.int32), ("fixed", torch.int64)):
                ptrs[f"grad_{kind}_{ident}"] = torch.zeros(g.shape, dtype=dtype_of_buffer, device=g.device)
        self._run("attncc_emulated_backward_grad_bounds", dtype, plan, call, ptrs, dropout, seed)
        for n in grads:
            ident = self.abi.ident_of(n)
            ptrs[f"grad_shift_{ident}"] = fixed_point_shifts(ptrs[f"grad_bound_{ident}"], ptrs[f"grad_fixed_{ident}"])
            ptrs[f"grad_fixed_{ident}"].zero_()  # from term counts to sums

    def _library_for(self, dtype: str, plan: CallPlan) -> ctypes.CDLL:
        """The library a call runs in: one per storage dtype and head-dim plan."""
        return self.emulated_library(dtype, plan.problem.D, plan.problem.Dv)

    def _launch(self, lib: ctypes.CDLL, fn: ctypes._CFuncPtr, args: tuple, device: torch.device | None = None) -> None:
        """Runs entry point `fn` with `args` and the emulator's schedule (`device`: the operands',
        which a GPU launch is made on); a clear error where it fails."""
        with _LOCK:  # the emulator's schedule is process-wide
            status = fn(*args, SCHEDULES[self.schedule] | (RACE_CHECK if self.racecheck else 0))
        if status == 3:
            lib.attncc_emulator_error.restype = ctypes.c_char_p
            raise EmulationFailure(f"{self.name} on the CUDA emulator: {lib.attncc_emulator_error().decode()}")
        if status != 0:
            raise RuntimeError(f"emulated {fn.__name__} of {self.name} returned {status}")
