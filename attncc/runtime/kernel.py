"""Compiled kernels as PyTorch ops: validation, call-time planning, autograd, torch.compile.

`Kernel.__call__` validates every argument (naming it, with expected and actual shape, dtype
or device) and calls the custom op ``attncc::attention``. The op's implementation classifies
the tiles, builds the variant's library for the input dtype on first use (cached on disk)
and runs it; the registered autograd formula calls ``attncc::attention_backward``. Both ops
have fake implementations, so kernels work under `torch.compile`.
"""

from __future__ import annotations

import copy
import ctypes
import difflib
import hashlib
import heapq
import inspect
import itertools
import math
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache, partial, wraps
from pathlib import Path
from typing import Any

import torch

from attncc import targets
from attncc.codegen.abi import OPERANDS, ROPE_CONTROL, KernelAbi, kernel_abi
from attncc.codegen.cpu import BF16_PRODUCTS, bf16_backward, bf16_products, generate_cpu
from attncc.errors import AttnccError, InputError
from attncc.frontend.lower import CALL_ARGUMENTS
from attncc.ir.expr import SIZE_VARS, free_vars, python_number
from attncc.ir.expr import render as ex_render
from attncc.ir.graph import Graph, fused_node, print_graph, runtime_inputs
from attncc.ir.ops import Input
from attncc.passes import Stage, with_rows, with_tiles
from attncc.passes.positions import GLOBAL_SIZES
from attncc.passes.sparsity import (
    Problem,
    check_reads_and_divisors,
    classify_tiles,
    host_read_tensors,
    partial_fraction,
    runtime_tensors,
    values_key,
    visible_keys,
)
from attncc.passes.tiling import CPU_AMX_KEY_STEP, CPU_FEW_KEYS_STEP, TilePlan, TilingTable
from attncc.runtime.amp import autocast_dtype, cast_operands
from attncc.runtime.build import build_library, load_library
from attncc.runtime.fp8 import (
    FP8_DTYPES,
    FP8_QUERY_DTYPES,
    by_name,
    check_operand_dtypes,
    dequantised,
    kv_descales,
    library_dtype,
)
from attncc.runtime.locks import instance_lock
from attncc.runtime.nested import any_nested, nested_attention
from attncc.runtime.ragged import (
    Appends,
    CallOptions,
    CheckedPagedCall,
    PagedPlan,
    VarlenPlan,
    append_to_caches,
    offsets_plan,
    paged_attention,
    paged_forward,
    planned,
    planned_call_key,
    planned_sequences,
    varlen_attention,
    varlen_backward,
    varlen_forward,
)
from attncc.runtime.reference import evaluate, reference_attention, values_unreadable
from attncc.runtime.rope import rope_tables, rotate_padded
from attncc.runtime.sinks import padded_rows, sink_gradient, sink_logits
from attncc.targets import ISA_ENV

_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# call_key -> kernel, weakly: a kernel nobody holds is freed (autograd contexts hold theirs)
_REGISTRY: weakref.WeakValueDictionary[str, Kernel] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def registered(key: str) -> Kernel:
    """The kernel an op call names by `call_key` ("NAME_<digest>#<class>#<n>"). A graph that
    outlives its kernel or another process's (torch.export, a saved program) names a kernel not
    held here, and `#n` counts the kernels made before it: the one live kernel of the same
    program (digest) and class serves it; none, or several with their own settings, is an error
    saying why."""
    kern = _REGISTRY.get(key)
    if kern is not None:
        return kern
    program = key.rpartition("#")[0]
    alive = [k for k in list(_REGISTRY.values()) if k.call_key.rpartition("#")[0] == program]
    if len(alive) == 1:
        return alive[0]
    why = "none is" if not alive else f"{len(alive)} are, and which one this graph was made with is not known"
    raise AttnccError(
        f"attncc: this graph calls kernel {program.partition('#')[0]} (a {program.partition('#')[2]}), and {why} "
        "alive in this process: compile the program "
        "(attncc.compile) and hold the kernel where a saved, exported or compiled graph runs, one per program "
        "(a drop-in's kernels: one eager call of the drop-in with the graph's options makes them)"
    )


#: Learnable-input gradients get one buffer per thread (reproducible sums) up to this size in
#: all; beyond it, one shared buffer with atomics, or fewer threads (`Kernel.backward_threads`).
PER_THREAD_GRAD_BUFFERS_MAX = 256 * 2**20
#: The fused backward runs one task per (b, kv head): with fewer than this many tasks per
#: thread, a thread with a heavier task (a longer sequence of a packed batch) leaves the others
#: idle, so a padded call's tasks are cut into key chunks (`fused_key_chunks`) and a packed
#: batch's run the two passes (`Kernel.backward_passes`).
FUSED_BACKWARD_TASKS_PER_THREAD = 2
#: Its per-thread buffers (dQ, group x N x D fp32, and the query tiles it keeps loaded, at most
#: as large) above which the two passes run instead; also the most its key chunks' dQ rows take.
FUSED_BACKWARD_MAX_BUFFER = 256 * 2**20
#: The most a thread's tasks may exceed the average where key chunks even them out.
FUSED_BACKWARD_IMBALANCE = 1.25


def fused_key_chunks(tasks: int, threads: int) -> int:
    """The key chunks each of `tasks` equal (b, kv head) tasks of the fused backward is cut into
    for `threads`: the fewest that give every thread a task and none more than
    FUSED_BACKWARD_IMBALANCE times the average (1 task, 2 threads: 2 chunks; 3 tasks: 2; 5 tasks
    on 4 threads: 2). Zen 5, 2 threads, B=1 MQA backward (ms; the two passes, then 1 / 2 / 4 / 8
    chunks): causal bf16 H=8 N=2048 D=128 41.5 / 53.1 / 29.4 / 31.4 / 34.3; H=32 N=1024 45.4 /
    61.7 / 37.4 / 40.2 / 79.8; causal fp32 H=8 N=2048 D=128 76.5 / 99.1 / 53.7 / 53.8 / 61.0;
    vanilla fp32 H=8 N=512 D=64 4.6 / 5.7 / 3.2 / 3.4 / 3.5: each chunk loads its task's query
    tiles again and adds a copy of its dQ rows."""
    chunks = 1
    while chunks < threads and (
        tasks * chunks < threads
        or math.ceil(tasks * chunks / threads) * threads > FUSED_BACKWARD_IMBALANCE * tasks * chunks
    ):
        chunks += 1
    return chunks


@lru_cache(maxsize=64)
def packed_key_chunks(
    lengths: tuple[tuple[int, int], ...], block_rows: int, block_cols: int, kv_heads: int, threads: int, most: int
) -> tuple[int, bool]:
    """The key chunks of a packed batch's fused backward (templates/cpu `chunk_key_tiles`: each
    (sequence, kv head)'s key tiles cut into that many, a task each, equal in visible tiles) and
    whether they keep the threads balanced: the tasks' tiles (query tiles times key tiles, per
    sequence and kv head; `lengths`: the sequences' (N, M)) dealt largest first to the least
    loaded thread (dynamic scheduling, as the kernel runs them in order of size only roughly)
    leave none more than FUSED_BACKWARD_IMBALANCE times the average. The fewest chunks up to
    `most` (and `threads`) that do, else (1, False). Cached: the layers of a model repeat a
    batch's lengths. (Before, a packed batch took the fused pass from two tasks per thread,
    however unequal: [2048, 64, 64, 64] MQA on 2 threads ran the long sequence on one thread.)"""
    work = [-(-n // block_rows) * -(-m // block_cols) for n, m in lengths]
    work = sorted((w for w in work if w), reverse=True) * kv_heads
    total = sum(work)

    def balanced(chunks: int) -> bool:
        if not total or len(work) * chunks < threads:
            return False
        if len(work) * chunks > PACKED_BALANCE_TASKS:  # (many tasks: the greedy deal's bound)
            return work[0] / chunks <= (FUSED_BACKWARD_IMBALANCE - 1) * total / threads
        loads = [0.0] * threads
        for w in sorted(work * chunks, reverse=True):
            heapq.heapreplace(loads, loads[0] + w / chunks)
        return max(loads) <= FUSED_BACKWARD_IMBALANCE * total / threads

    for chunks in range(1, max(1, min(most, threads)) + 1):
        if balanced(chunks):
            return chunks, True
    return 1, False


#: Tasks beyond which `packed_key_chunks` bounds the greedy deal instead of dealing it.
PACKED_BALANCE_TASKS = 1024
#: Prepared calls (tile classes, layout grids) kept per kernel where no runtime tensor decides them.
PREPARED_CALLS_KEPT = 32


#: Entries of a plan's memo (`PagedPlan.keys.prepared`, `VarlenPlan.packed.prepared`): each
#: kernel calling with the plan keeps ~3 (prepared call, kept launch, checked call), so every
#: layer's kernel of a model fits; a plan held for calls of ever new scales or query counts
#: (a shared prefix's) grew by ~11 KB a call before it was bounded.
PLAN_MEMO_KEPT = 1024


def keep_bounded(memo: dict, key: object, value: object, kept: int = PREPARED_CALLS_KEPT) -> None:
    """`memo[key] = value`, the oldest entry dropped beyond `kept`. The caller holds its kernel's
    lock; a plan's memo is shared by kernels, whose locks differ (hence `pop(..., None)`)."""
    if key not in memo and len(memo) >= kept:
        memo.pop(next(iter(memo), None), None)  # the oldest key
    memo[key] = value


#: ... and the largest tile classes (bytes) kept of a call whose classes follow its sequences'
#: lengths (packed and unplanned paged calls) or runtime tensors' values, keyed by them, and the
#: most elements of host-read runtime tensors whose values key a prepared call.
PREPARED_LENGTHS_BYTES = 2**20
PREPARED_VALUES_MAX = 4096
#: Entry-point status of an AMX kernel that Linux refused the tile state (templates/cpu kAmxRefused).
AMX_REFUSED = 3
#: The status a CPU kernel entry point returns where a buffer could not be allocated.
OUT_OF_MEMORY = 4


def outside_unrelated_transforms(call: Callable[..., Any]) -> Callable[..., Any]:
    """`call` (a public entry point) run outside torch.func's transforms where none of its
    tensors is transformed: a kernel called inside `torch.func.grad(f)` on tensors that f
    captured is a constant to the transform, as torch's own ops are (its allocations came back
    wrapped, without storage, and the launch failed reading their addresses; session 65's
    review). Transformed tensors keep the transform, whose clear error `_reject_transforms` gives;
    a tensor that records torch.autograd's graph there cannot (torch refuses autograd.Functions
    inside transforms): a clear error too."""

    @wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling() or _functorch.peek_interpreter_stack() is None:
            return call(*args, **kwargs)
        named: dict[str, object] = {}
        for name, value in inspect.signature(call).bind(*args, **kwargs).arguments.items():
            if isinstance(value, dict):  # (**runtime: the runtime inputs by their names)
                named.update(value)
            elif isinstance(value, (list, tuple)):
                named.update((f"{name}[{i}]", t) for i, t in enumerate(value))
            else:
                named[name] = value
        _reject_transforms(named)  # (the argument a transform wraps, by its name)
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in named.values()):
            raise InputError(
                "a tensor requiring grad inside a torch.func transform: attncc kernels record torch.autograd's graph, "
                "which torch.func transforms refuse; detach it there, or use torch.autograd.grad or .backward()"
            )
        with torch._C._DisableFuncTorch():
            return call(*args, **kwargs)

    return run


_functorch = torch._C._functorch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class CallPlan:
    """Everything fixed for one call besides the tensors' data."""

    problem: Problem
    tiles: TilePlan
    scale: float  # multiplies q.k: FusedAttention.scale at this call's sizes and scale value
    scale_value: float  # the program's name `scale` (the call's `scale=`, else its default)
    kv_splits: int = 1  # blocks sharing one query tile's keys (the CUDA forward's split-KV)


#: Per-object settings that a kernel's variants (`Kernel._variant`) follow.
ROW_VARIANT_SETTINGS = (
    "backward", "deterministic", "kv_splits", "fp8_mma", "short_query_tiles", "key_split_warps", "schedule",
    "racecheck", "key_split_stages",
)  # fmt: skip


@dataclass(frozen=True)
class PagedKeys:
    """A paged call's keys, read in place (`Kernel.forward_impl`): the block table [B, pages]
    (int64, on the kernel's device), its page size, and the keys per sequence (the call's M).
    Made by `of`."""

    table: torch.Tensor
    page_size: int
    keys: int
    #: int64 [B] each sequence's key count (host), where they differ: one launch for all, the
    #: call's M the longest (`keys`); None: every sequence has `keys`
    key_counts: torch.Tensor | None
    #: their cumulative sums (int64 [B + 1], on the kernel's device; `seq_m`), or None
    k_starts: torch.Tensor | None
    #: a PagedPlan's memo of prepared calls (`Kernel._prepare`), which outlive the call; or None
    prepared: dict | None = None

    @staticmethod
    def of(
        table: torch.Tensor, page_size: int, totals: Sequence[int], device: torch.device, prepared: dict | None = None
    ) -> PagedKeys:
        """The keys of a block table (host or device) whose sequences hold `totals` keys each.
        The kernels step along a row of the table by 1 (its row stride is `st_pages_0`): a table
        whose entries are not adjacent (a transposed copy's view, a column of a stack) is made
        so, where it was read with the columns' stride taken for 1."""
        counts = None if len(set(totals)) <= 1 else torch.tensor(totals, dtype=torch.int64, device="cpu")
        starts = None if counts is None else torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(device)
        pages = table.to(device)
        if pages.shape[1] > 1 and pages.stride(1) != 1:
            pages = pages.contiguous()
        return PagedKeys(pages, page_size, max(totals, default=0), counts, starts, prepared)

    def lengths(self, queries: int) -> Lengths | None:
        """Each sequence's query and key counts where the key counts differ (the tile classes
        follow them), else None."""
        if self.key_counts is None:
            return None
        return torch.full_like(self.key_counts, queries), self.key_counts

    def buffers(self) -> dict[str, torch.Tensor]:
        """The ABI pointers of the paged call: the block table, and where the key counts differ,
        their cumulative sums as k_starts."""
        return {"pages": self.table} if self.k_starts is None else {"pages": self.table, "k_starts": self.k_starts}

    def keys_like(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """What plans see as k: [B, Hkv, keys, D] over the cache [pages, page_size, Hkv, D]
        (sizes; strides 0 where the table decides)."""
        return cache.as_strided(
            (q.shape[0], cache.shape[2], self.keys, cache.shape[3]), (0, cache.stride(2), 0, cache.stride(3))
        )

    @staticmethod
    def strides(caches: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
        """The kernels' strides of k, v (and their fp8 descale factors) by operand name for
        caches [pages, page_size, Hkv, D]: page, kv head, row, element (`Kernel.pack`'s
        override; the kernels' key_row_offset)."""
        return {name: (t.stride(0), t.stride(2), t.stride(1), t.stride(3)) for name, t in caches.items()}


#: int64 [B] query and key counts of each sequence (host tensors) where they differ in one launch.
Lengths = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class PackedSequences:
    """A packed (varlen) batch in one launch (`Kernel.forward_impl`, `backward_impl`; CPU and
    CUDA kernels alike): sequence b's queries are rows q_starts[b] .. q_starts[b + 1] of q
    [total_q, H, D] (and of out, dout, dq, and of lse, delta, sink [total_q, H]), its keys rows
    k_starts[b] .. k_starts[b + 1] of k and v. The kernels see each operand as [B, heads,
    longest, D] with batch stride 0 and shift a row by its sequence's first
    (templates/common/variant.jinja `query_row_offset`)."""

    q_starts: torch.Tensor  # int64 [B + 1], contiguous, on the kernel's device
    k_starts: torch.Tensor
    lengths: Lengths
    longest: tuple[int, int]  # the longest sequence's query and key counts (the call's N and M)
    total_rows: tuple[int, int]  # the rows of q and of k the offsets cover (their last entries)
    #: a plan's (`attncc.plan_varlen`) memo: the GPU path's forward launches kept for its batch
    prepared: dict | None = field(default=None, compare=False)

    @staticmethod
    def of(q_starts: list[int], k_starts: list[int], device: torch.device) -> PackedSequences:
        # (from the lists: a handful of tensor operations took ~40 us of each call)
        n = [end - start for start, end in itertools.pairwise(q_starts)]
        m = [end - start for start, end in itertools.pairwise(k_starts)]
        on_device = torch.tensor([q_starts, k_starts], dtype=torch.int64, device="cpu").to(device)
        lengths = torch.tensor([n, m], dtype=torch.int64, device="cpu")
        longest = (max(n, default=0), max(m, default=0))
        totals = (q_starts[-1] if q_starts else 0, k_starts[-1] if k_starts else 0)
        return PackedSequences(on_device[0], on_device[1], (lengths[0], lengths[1]), longest, totals)

    @property
    def batch(self) -> int:
        """The number of sequences."""
        return self.lengths[0].shape[0]

    def buffers(self) -> dict[str, torch.Tensor]:
        """The ABI pointers of the packed call (cu_seqlens: `seq_n`, `seq_m`, `first_query_row`)."""
        return {"q_starts": self.q_starts, "k_starts": self.k_starts}

    def as_batch(self, rows: torch.Tensor, keys: bool) -> torch.Tensor:
        """rows [total, heads, D] as the kernels' [B, heads, longest, D] (batch stride 0)."""
        longest = self.longest[1] if keys else self.longest[0]
        shape = (self.lengths[0].shape[0], rows.shape[1], longest, rows.shape[2])
        return rows.as_strided(shape, (0, rows.stride(1), rows.stride(0), rows.stride(2)))


@dataclass(frozen=True)
class SlotNames:
    """The names `Kernel.pack` fills, in the ABI's order: pointers, ints, and the int slots of
    each operand's, runtime tensor's strides and learnable input's gradient slice."""

    pointers: list[str]
    ints: list[str]
    operand_strides: list[tuple[str, tuple[str, ...]]]
    tensor_strides: list[tuple[str, tuple[str, ...]]]
    grad_slices: list[tuple[str, str]]


class Kernel:
    """A compiled attention variant. Call it like `kern(q, k, v, **runtime_inputs)`."""

    device_type = "cpu"  # where q, k, v and runtime tensors must live
    cuda_abi = False  # the kernels' ABI has the CUDA kernels' slots (see KernelAbi.cuda)
    #: Whether the forward's library writes a paged call's appended keys into the caches (the
    #: CUDA kernels' `append_new_keys`, launched before the forward); else torch writes them.
    appends_in_library = False
    #: "auto" (see `backward_passes`), "fused" or "two-pass".
    backward = "auto"
    #: Attributes `_register` makes, left out of pickles and copies.
    _PER_PROCESS: tuple[str, ...] = (
        "_libraries", "_lock", "call_key", "_calls", "_calls_by_values", "_plans", "_scales", "_repeats", "_row_variants",
        "_varlen_plans",
    )  # fmt: skip

    def __init__(self, stages: list[Stage], target: str) -> None:
        self.target = target
        self._take_stages(stages)
        self._register()

    def _take_stages(self, stages: list[Stage]) -> None:
        self.stages = stages
        self.graph: Graph = stages[-1].graph
        _, self.op = fused_node(self.graph)
        self.name: str = self.graph.graph["name"]
        self.abi: KernelAbi = kernel_abi(self.graph, cuda=self.cuda_abi)
        self.inputs: list[Input] = runtime_inputs(self.graph)
        self._size_inputs = tuple(d for d in self.inputs if d.size_of is not None)
        self._scalar_names = tuple(d.name for d in self.inputs if d.role == "scalar")  # (the ops' scalars' order)
        # (properties of the program read by every call's checks, also while torch.compile
        # traces one: attributes, where a cached_property takes a lock dynamo cannot trace)
        self.reads_scale: bool = self.op.reads_scale
        self._host_reads: frozenset[str] = host_read_tensors(self.op.mask, self.op.score)
        self._default_scale_reads: frozenset[str] = frozenset(free_vars(self.op.default_scale))
        text = print_graph(self.graph) + repr(self.op) + self.target
        self.key = f"{self.name}_{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    def at_global_positions(self) -> Kernel:
        """This variant for chunk pairs of a longer sequence (passes/positions.py): the same kind
        of kernel (target, emulation settings), taking the int scalars `__query_position0`,
        `__key_position0` (the chunks' first global positions), `__global_N` and `__global_M`
        (the whole sequence's lengths) besides the program's inputs. Made once per kernel."""
        return self._with_rows("globalize_positions")

    def with_folded_query_heads(self) -> Kernel:
        """This variant for q viewed as [B, Hkv, G * N, D] (passes/positions.py
        `fold_query_heads`), taking the int scalars `__fold_rows` (N) and `__fold_group` (G)
        besides the program's inputs. Made once per kernel."""
        return self._with_rows("fold_query_heads")

    def for_short_queries(self) -> Kernel:
        """This variant with the GPU forward tiles of calls of at most GPU_SHORT_QUERY_ROWS query
        rows per (batch, head) (`TilingTable.for_short_queries`; forward only). Made once per kernel."""
        return self._variant("short_queries", lambda stages: with_tiles(stages, TilingTable.for_short_queries))

    def for_key_split_warps(self, rows: int = 16, kv_stages: int | None = None) -> Kernel:
        """This variant with the GPU forward of calls of at most `rows` (16 or 32) query rows
        per (batch, head) whose warps split each key tile (`TilingTable.for_key_split_warps`;
        forward only), with `kv_stages` K/V buffers (None: the target's choice). Made once per
        kernel, `rows` and `kv_stages`."""
        retile = partial(TilingTable.for_key_split_warps, rows=rows, kv_stages=kv_stages)
        name = f"key_split_warps_{rows}" + (f"_{kv_stages}_stages" if kv_stages else "")
        return self._variant(name, lambda stages: with_tiles(stages, retile))

    def _with_rows(self, rewrite: str) -> Kernel:
        return self._variant(rewrite, lambda stages: with_rows(stages, rewrite))

    def _variant(self, name: str, make_stages: Callable[[list[Stage]], list[Stage]]) -> Kernel:
        """This kernel with its stages through `make_stages`, made once per `name`."""
        with self._lock:
            variant = self._row_variants.get(name)
            if variant is None:
                variant = copy.copy(self)  # (a fresh registration: __setstate__)
                variant._take_stages(make_stages(self.stages))
                variant._register()
                self._row_variants[name] = variant
        for name in ROW_VARIANT_SETTINGS:  # as this kernel's now (kern.kv_splits = 1 set after the variant was made)
            if hasattr(self, name):
                setattr(variant, name, getattr(self, name))
        return variant

    def _register(self) -> None:
        self._libraries: dict[str | tuple[str, int], ctypes.CDLL] = {}  # CPU: dtype; CUDA: (dtype, head dim)
        self._lock = instance_lock(self)
        self._calls: dict[tuple, dict] = {}  # prepared calls by shape (see _prepare)
        self._calls_by_values: dict[tuple, dict] = {}  # ... and by host-read values, lengths (see _prepare)
        self._plans: dict[tuple, CallPlan] = {}  # call plans by sizes, dtype and scale (see plan)
        self._scales: dict[tuple, tuple[float, float]] = {}  # see _scale_values
        self._repeats: dict[tuple, KeptLaunch] = {}  # packed launches of checked calls (see _repeat_key)
        self._row_variants: dict[str, Kernel] = {}  # by name: see _variant
        self._varlen_plans: OrderedDict[tuple, VarlenPlan] = OrderedDict()  # by offsets (see ragged.offsets_plan)
        # The op dispatches on this key; one per object, so per-object settings (an emulated
        # kernel's schedule or deterministic mode) reach the right implementation.
        self.call_key = f"{self.key}#{type(self).__name__}#{next(_KEYS)}"  # (the class: an emulated or GPU kernel)
        _REGISTRY[self.call_key] = self

    def __getstate__(self) -> dict[str, object]:
        """Pickling and deepcopy keep the compiled program; what `_register` makes (loaded
        libraries, the lock, caches) is per process and the copy gets its own op key."""
        return {k: v for k, v in self.__dict__.items() if k not in self._PER_PROCESS}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._register()

    def __setattr__(self, name: str, value: object) -> None:
        """A registered kernel's settings are its class's attributes (ROW_VARIANT_SETTINGS that
        it has: `backward`, and on the GPU and emulator `deterministic`, `kv_splits`, ...): a
        public name the kernel does not have is an error, where a typo (`kern.determinstic =
        True`) made a new attribute that changed nothing, silently."""
        if (
            not (name.startswith("_") or name in self.__dict__ or hasattr(type(self), name))
            and "call_key" in self.__dict__
        ):
            settings = [n for n in ROW_VARIANT_SETTINGS if hasattr(type(self), n)]
            if name in ROW_VARIANT_SETTINGS:
                why = f"a setting of the GPU kernels and their emulator, not of target {self.target}'s"
            else:
                near = difflib.get_close_matches(name, settings, n=1)
                why = (f"did you mean {near[0]!r}? " if near else "") + f"its settings: {', '.join(settings)}"
            raise AttributeError(f"{type(self).__name__} {self.name} has no setting {name!r} ({why})")
        object.__setattr__(self, name, value)

    # ------------------------------------------------------------------ public API
    def __repr__(self) -> str:
        return f"<attncc.Kernel {self.name} target={self.target}>"

    @outside_unrelated_transforms
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        return_lse: bool = False,
        scale: float | None = None,
        train: bool = True,
        seed: int | None = None,
        dropout_p: float | None = None,
        k_descale: object = None,
        v_descale: object = None,
        **runtime: object,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of q [B, H, N, D], k [B, Hkv, M, D], v [B, Hkv, M, Dv] with this variant;
        out is [B, H, N, Dv] (Dv: v's own head dim, DeepSeek's MLA, or D).

        k and v may be fp8 (float8_e4m3fn or float8_e5m2, forward only) with q float32,
        bfloat16 or float16: k_descale and v_descale (numbers, or tensors broadcastable to
        [B, Hkv, M]: per tensor, per head, per token) multiply them as the kernels widen them
        (runtime/fp8.py).

        scale sets the name `scale` (default: the program's `scale = ...`, else 1/sqrt(D)): the
        q.k factor and every score expression using `scale` follow it; train=False disables dropout; seed fixes the
        dropout bits (default: drawn from torch's generator, so torch.manual_seed applies);
        dropout_p, for a program with dropout, is this call's rate in place of the program's
        (the kernels take it at run time: one program serves every rate, as FlashAttention's);
        runtime inputs are passed by their declared names. Returns out (and lse [B, H, N] in
        float32, float64 for float64 inputs, when return_lse). q, k and v may be jagged nested
        tensors ([B, H, j, D] as scaled_dot_product_attention takes them, or [B, j, H, D]): one
        packed call, out nested like q (runtime/nested.py).
        """
        return_lse = checked_flag("return_lse", return_lse)
        # (two detours, each asked in ~0.2 us; the options dict is made on them only)
        nested, lower = any_nested(q, k, v), autocast_dtype(q)
        if nested or lower is not None:
            options = dict(
                scale=scale, train=train, seed=seed, dropout_p=dropout_p, k_descale=k_descale, v_descale=v_descale
            )
            if nested:  # (jagged: one packed call, runtime/nested.py)
                return nested_attention(self, q, k, v, return_lse, options, runtime)
            with torch.autocast(q.device.type, enabled=False):  # (as SDPA under torch.autocast: runtime/amp.py)
                return self(*cast_operands(lower, q, k, v), return_lse=return_lse, **options, **runtime)  # type: ignore[arg-type]
        # (descale factors: fp8 K/V's, which never repeat; given with other K/V, the full path's error)
        repeat_key = None
        if k_descale is None and v_descale is None and dropout_p is None:
            repeat_key = self._repeat_key(q, k, v, runtime, scale, train, seed, tensors_too=True)
        repeat = self._repeats.get(repeat_key) if repeat_key is not None else None
        if repeat is not None:
            if _records_graph(q, k, v):  # (never with runtime tensors: their keys refuse a graph)
                scalars = [float(runtime[d.name]) for d in self.inputs if d.role == "scalar"]  # type: ignore[arg-type]
                out, lse = _EagerAttention.apply(
                    self.call_key, repeat, q, k, v, scalars, checked_scale(scale), 0.0, NO_DROPOUT_SEED
                )
            else:
                out, lse = repeat(q, k, v, runtime=runtime)
            return (out, lse) if return_lse else out
        _reject_transforms({"q": q, "k": k, "v": v, **runtime})
        q, k, v = _resolved(q, k, v)
        self.validate(q, k, v, runtime)
        tensors: list[torch.Tensor] = [runtime[d.name] for d in self.inputs if d.role == "tensor"]  # type: ignore[misc]
        scalars = [float(runtime[d.name]) for d in self.inputs if d.role == "scalar"]  # type: ignore[arg-type]
        dropout = self.call_dropout(train, dropout_p)
        seed_value = seed_tensor(seed, dropout)
        scale = self.call_scale(scale)
        # scale None: the op computes the program's default from the sizes (symbolic under
        # torch.compile with dynamic shapes, so not here)
        descale = kv_descales(k, v, k_descale, v_descale)
        sink = None
        if self.op.sink is not None:  # [B, H, N], differentiable w.r.t. the inputs it reads
            B, H, N, _ = q.shape
            rows = padded_rows(B, H, N, q.device)
            sink = self.sink_rows(rows, _sizes(q, k), scale, runtime, acc_dtype(q.dtype)).expand(B, H, N).contiguous()
        if _plain_call(q, k, v, *tensors, *([sink] if sink is not None else [])):
            if repeat_key is not None and self._launches_kept(q, v):
                out, lse = self._launch_and_keep(repeat_key, q, k, v, tensors, scalars, scale, runtime)
                return (out, lse) if return_lse else out
            out, lse = self.forward_impl(
                q, k, v, tensors, scalars, scale, dropout, int(seed_value.item()), sink=sink, descale=descale
            )
        elif sink is None and not descale and _eager_autograd(q, k, v, *tensors):
            out, lse = _EagerAttention.apply(
                self.call_key, None, q, k, v, scalars, scale, dropout, seed_value, *tensors
            )
        else:
            out, lse = torch.ops.attncc.attention(
                self.call_key,
                q,
                k,
                v,
                tensors,
                scalars,
                scale,
                dropout,
                seed_value,
                sink,
                descale.get("k_descale"),
                descale.get("v_descale"),
            )
        # (a call with a repeat key takes one of the two branches above: the op sees none)
        if repeat_key is not None and out.numel():
            self._remember_repeat(repeat_key, q, k, v, out, lse, scalars, scale, tensors=tensors)
        return (out, lse) if return_lse else out

    def call_dropout(self, train: object, dropout_p: object = None) -> float:
        """A call's dropout rate: the program's, or `dropout_p` in its place (a number in [0, 1)),
        0 with train=False. The kernels take the rate at run time (the program's constant says
        that they draw dropout bits at all), so one program serves every rate; a program without
        dropout refuses a rate above 0, as its kernels draw no bits (0 is taken: FlashAttention
        code passes `dropout_p=p if training else 0.0`)."""
        train = checked_train(train)
        if dropout_p is None:
            return self.op.dropout if train else 0.0
        rate = python_number(dropout_p)
        if isinstance(rate, torch.SymFloat | torch.SymInt):  # (traced: a guard on its value)
            from torch.fx.experimental.symbolic_shapes import guard_scalar

            rate = guard_scalar(rate)
        elif isinstance(rate, torch.Tensor):
            if torch.compiler.is_compiling():
                raise traced_tensor_number("dropout_p")
            if rate.numel() == 1 and not rate.requires_grad and not rate.is_complex() and rate.dtype != torch.bool:
                rate = rate.item()
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate < 1:
            raise InputError(f"dropout_p: expected a number in [0, 1), got {dropout_p!r}")
        if not self.op.dropout and rate:
            raise InputError(
                f"dropout_p: {self.name} has no dropout; write `p = dropout(p, rate)` in the program "
                "(a call's dropout_p then takes the place of its rate)"
            )
        return float(rate) if train else 0.0

    def rope_applied(
        self, q: torch.Tensor, k: torch.Tensor, runtime: Mapping[str, object]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k [B, heads, rows, D] after the program's rope, in torch (runtime/rope.py;
        differentiable; in fp32, or fp64 for fp64 inputs, rounded once to the inputs' dtype):
        the eager reference's (the kernels rotate as they load)."""
        if self.op.q_rope is None and self.op.k_rope is None:
            return q, k
        scalars = {d.name: runtime[d.name] for d in self.inputs if d.role == "scalar"}
        tensors = {d.name: runtime[d.name] for d in self.inputs if d.role == "tensor"}
        sizes = _sizes(q, k)
        turned = []
        for x, spec in ((q, self.op.q_rope), (k, self.op.k_rope)):
            turned.append(x if spec is None else rotate_padded(spec, x, sizes, scalars, tensors))  # type: ignore[arg-type]
        return turned[0], turned[1]

    def rope_buffers(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        tensors: list[torch.Tensor],
        scalars: list[float],
        lengths: Lengths | None = None,
    ) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """The kernels' rope tables (abi.py ROPE_BUFFERS, ROPE_CONTROL) for q [B, H, N, D]
        and k [B, Hkv, M, D] (the batch views of packed and paged calls, whose sequences have
        `lengths`): cos and sin of each row's angles, [B or 1, rows, pairs]."""
        ptrs: dict[str, torch.Tensor] = {}
        ints: dict[str, int] = {}
        if self.op.q_rope is None and self.op.k_rope is None:
            return ptrs, ints
        scalar_map = {d.name: s for d, s in zip([d for d in self.inputs if d.role == "scalar"], scalars)}
        tensor_map = {d.name: t for d, t in zip([d for d in self.inputs if d.role == "tensor"], tensors)}
        B = q.shape[0]
        sizes: dict[str, int | torch.Tensor] = dict(_sizes(q, k))
        if lengths is not None:  # each sequence's own N and M
            sizes.update(N=lengths[0].view(-1, 1), M=lengths[1].view(-1, 1))
        for name, x, spec in (("q", q, self.op.q_rope), ("k", k, self.op.k_rope)):
            if spec is None:
                continue
            rows = x.shape[2]
            # on x's device: the tables are the kernel's operands (a CPU table for a GPU kernel
            # is a host pointer), and a position may read an input there (start[b])
            index = {
                "b": torch.arange(B, device=x.device).view(-1, 1),
                "i" if name == "q" else "j": torch.arange(rows, device=x.device).view(1, -1),
            }
            cos, sin = rope_tables(spec, index, sizes, scalar_map, tensor_map, x.shape[3], acc_dtype(q.dtype))
            shape = (*torch.broadcast_shapes(cos.shape[:-1], (1, rows)), cos.shape[-1])
            cos, sin = cos.expand(shape).contiguous(), sin.expand(shape).contiguous()
            ptrs.update({f"{name}_cos": cos, f"{name}_sin": sin})
            ints.update({f"rope_{name}_first": spec.first, f"rope_{name}_half": shape[-1]})
            ints[f"rope_{name}_sb"] = cos.stride(0) if shape[0] > 1 else 0
        return ptrs, ints

    def runtime_values(self, tensors: list[torch.Tensor], scalars: list[float]) -> dict[str, object]:
        """The runtime inputs by name from an op's lists (tensors and scalars in declaration order)."""
        values: dict[str, object] = {}
        tensor_values, scalar_values = iter(tensors), iter(scalars)
        for decl in self.inputs:
            values[decl.name] = next(tensor_values) if decl.role == "tensor" else next(scalar_values)
        return values

    def sink_rows(
        self,
        rows: Mapping[str, torch.Tensor],
        sizes: Mapping[str, int | torch.Tensor],
        scale: float | None,
        runtime: Mapping[str, object],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The program's softmax sink at the rows whose b, h, i `rows` holds (broadcasting;
        sizes per row where they vary), differentiable w.r.t. the float inputs it reads."""
        assert self.op.sink is not None
        scalars = {d.name: runtime[d.name] for d in self.inputs if d.role == "scalar"}
        tensors = {d.name: runtime[d.name] for d in self.inputs if d.role == "tensor"}
        value = scale if scale is not None else evaluate(self.op.default_scale, sizes, {})
        device = next(iter(rows.values())).device  # (a constant sink is a 0-d host tensor: on the rows' device)
        return sink_logits(self.op.sink, rows, sizes, value, scalars, tensors, dtype).to(device)  # type: ignore[arg-type]

    def _repeat_key(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        runtime: Mapping[str, object],
        scale: float | None,
        train: bool,
        seed: int | None,
        tensors_too: bool = False,
    ) -> tuple | None:
        """What decides a plain call's packed launch and the outcome of its checks: the
        operands' sizes, strides, dtypes and devices, the scale, the scalar inputs' values,
        torch's thread count and the kernel's settings (`kern.kv_splits = 1` after a split
        launch was kept must launch unsplit); with `tensors_too` (a padded call), the runtime
        tensors' part too (`_tensors_signature`). None where a call cannot repeat a packed launch: a forward
        implementation that keeps none (`_keeps_launches`), sinks, runtime tensors but where `_tensors_signature` keys them,
        dropout (a fresh seed per call), and calls that the op must see or that are not plain
        tensors (`_untransformed`, `_unwatched`: torch.func transforms, forward-mode AD, modes, tracing)."""
        # (This runs right after the previous call's kernel evicted the interpreter's data from
        # cache: every attribute chain and call here costs ~1-2 us; 28-35 us in all before it was
        # trimmed to the checks below, 10-26 us after, of a 0.5-0.8 ms bf16 call at B=1 H=8 N=512
        # on the 2-core Sapphire Rapids-class Xeon.)
        if (
            seed is not None
            or _is_compiling()  # (first: dynamo traces no cached_property)
            or not self._repeatable
            or (train and self.op.dropout > 0)
            or type(q) is not torch.Tensor
            or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor
            or k.dtype in FP8_DTYPES  # (descale factors: values)
            or q.is_meta  # (shapes alone: through the op's fake implementation)
            or not _untransformed(q, k, v)
            or not _unwatched()  # (a call recording a graph repeats through _EagerAttention)
        ):
            return None
        # (the scale as the launch takes it: a 0-d tensor's value, not its identity)
        scalars = tuple(runtime.items()) if runtime else ()
        if all(type(value) in (int, float) for _, value in scalars):
            return self._launch_signature(q, k, v, checked_scale(scale), scalars)
        tensors = self._tensors_signature(q, k, v, runtime) if tensors_too else None
        if tensors is None:
            return None
        scalars = tuple((name, value) for name, value in scalars if type(value) is not torch.Tensor)
        return (*self._launch_signature(q, k, v, checked_scale(scale), scalars), tensors)

    def _tensors_signature(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runtime: Mapping[str, object]
    ) -> tuple | None:
        """The runtime tensors' part of a padded call's repeat key: each one's name, shape,
        strides, dtype and device, and the values of those the host reads (`host_read_tensors`:
        they decide the tile classes and the read checks, `_prepare`), as bytes. A kept launch
        points at each call's tensors (`KeptLaunch.tensor_slots`), so the others' values may
        change. None where such a call cannot repeat one: a kernel that keeps no launches, a
        value neither a number nor a plain tensor, a tensor given for a scalar input (its value
        is the scalar's: it was left out of the key, session 57's review), more than
        PREPARED_VALUES_MAX values to read (the full path classifies those per call), a graph
        to record, a torch.func transform or a negative-bit view (`_untransformed`). A masked
        decoding step's host time (bool mask [1, 1, 1, S]) was ~115 us on the full path."""
        if not self._repeatable:
            return None
        tensors = {}
        declared = self.tensor_names
        for name, value in runtime.items():
            kind = type(value)
            if kind is torch.Tensor and name in declared:
                tensors[name] = value
            elif kind is not int and kind is not float:
                return None
        if _records_graph(q, k, v, *tensors.values()) or not _untransformed(*tensors.values()):
            return None
        return self.tensors_launch_key(tensors)  # type: ignore[arg-type]

    def tensors_launch_key(self, tensors: Mapping[str, torch.Tensor]) -> tuple | None:
        """What of a call's runtime tensors (by name) decides its launch besides their
        addresses: each one's shape, strides, dtype and device, and the bytes of those whose
        values the host reads (`host_read_tensors`: tile classes, read checks). None where the
        host would read more than PREPARED_VALUES_MAX values (classified per call) or values
        on a GPU (a synchronisation: the full path's)."""
        signature = []
        for name, value in tensors.items():
            values = None
            if name in self._host_reads:
                if value.device.type != "cpu" or value.numel() > PREPARED_VALUES_MAX:
                    return None
                values = values_key(value)
            signature.append((name, value.shape, value.stride(), value.dtype, value.device, values))
        return tuple(signature)

    def per_call_tensor_slots(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, int]:
        """Where a kept launch puts each call's copy of the runtime tensors `tensors` (by name)
        in its pointers, by ABI ident: all but those the host reads from another device than
        the kernel's (a GPU kernel's key ranges given on the CPU), whose device copies the
        prepared call holds (`_prepare`)."""
        names = self._slot_names.pointers
        on_host = {n for n, t in tensors.items() if n in self._host_reads and t.device.type != self.device_type}
        return {t.ident: names.index(t.ident) for t in self.abi.tensors if t.name in tensors and t.name not in on_host}

    def _launch_signature(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, scalars: tuple
    ) -> tuple:
        """The repeat key of a call that can repeat a kept launch (`_repeat_key`, `op_repeat_key`):
        `scalars` its scalar inputs' (name, value) pairs."""
        return (
            q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, signed_zeros((scale,)), tuple((n, *signed_zeros((x,))) for n, x in scalars),
            self.launch_settings(),
        )  # fmt: skip

    def launch_settings(self) -> tuple:
        """What a kept launch follows besides its operands, the scale and the scalar inputs: the
        kernel's settings now (ROW_VARIANT_SETTINGS) and the thread count."""
        return torch.get_num_threads(), tuple(getattr(self, name, None) for name in ROW_VARIANT_SETTINGS)

    def op_repeat_key(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scalars: list[float], scale: float | None
    ) -> tuple | None:
        """`_repeat_key` inside the ops' implementations (`attention_op`, the backward op: what a
        torch.compile'd graph runs), for calls without dropout, sinks or fp8 K/V (the callers'
        checks; `attention_op` adds its runtime tensors' `tensors_launch_key`, the backward op
        takes calls without them): their tensors are plain there, checked when the graph was traced.
        Without it every compiled call took the full path: ~100 us of host time per forward,
        ~280 per forward and backward (fp32 B=1 H=8 N=16 d=64, 2 Zen 5 cores)."""
        if not self._repeatable or k.dtype in FP8_DTYPES:
            return None
        return self._launch_signature(q, k, v, scale, tuple(zip(self._scalar_names, scalars)))

    @cached_property
    def tensor_names(self) -> tuple[str, ...]:
        """The runtime tensors' names in declaration order (that of the ops' tensor lists)."""
        return tuple(d.name for d in self.inputs if d.role == "tensor")

    @cached_property
    def _repeatable(self) -> bool:
        """Whether this kernel's plain calls can repeat a kept launch at all: a forward that keeps
        them, no sinks or rope (their tables and values are per call)."""
        return self._keeps_launches() and self.op.sink is None and self.op.q_rope is None and self.op.k_rope is None

    def _keeps_launches(self) -> bool:
        """Whether `_remember_repeat` can keep this kernel's forward launches: the CPU forward's
        (a subclass replacing forward_impl keeps none unless it says so)."""
        return type(self).forward_impl is Kernel.forward_impl

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
        """Keep the packed launch of a call that passed every check, for calls with the same
        `_repeat_key` (plans and prepared calls are cached already, so this takes little); a
        planned packed call's (`packed`: its plan's sequences, rows [total, heads, D]) in the
        plan's memo, under (call_key, key), as long-lived as the plan. `tensors`: a padded
        call's runtime tensors (declaration order), whose slots the launch fills per call."""
        self._keep_repeat(key, self._launch_to_keep(q, k, v, out, lse, scalars, scale, packed, tensors), packed)

    def _launches_kept(self, q: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether a padded call with a repeat key that finds no kept launch launches as the calls
        repeating it will (`_launch_and_keep`): the CPU forward's, where out is not empty."""
        return type(self).forward_impl is Kernel.forward_impl and q.shape[:-1].numel() > 0 and v.shape[-1] > 0

    def _launch_and_keep(
        self, key: tuple, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor],
        scalars: list[float], scale: float | None, runtime: Mapping[str, object],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """out and lse of a checked padded call with a repeat key that no kept launch has: its
        launch prepared and packed once, run as the calls repeating it run it, then kept (the
        full path, then `_remember_repeat`, prepared and packed it twice: ~100 us of a decoding
        step's first call, where every token makes a new M)."""
        out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty(q.shape[:-1], dtype=acc_dtype(q.dtype), device=q.device)
        launch = self._launch_to_keep(q, k, v, out, lse, scalars, scale, tensors=tensors)
        out, lse = launch(q, k, v, runtime=runtime)
        self._keep_repeat(key, launch)
        return out, lse

    def _launch_to_keep(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
        scalars: list[float], scale: float | None, packed: PackedSequences | None = None,
        tensors: Sequence[torch.Tensor] = (),
    ) -> KeptLaunch:  # fmt: skip
        """The `KeptLaunch` of a checked call (`_remember_repeat`'s arguments): out and lse only
        give their shapes and strides, each call its own."""
        value_dim = v.shape[-1]
        operands = {"q": q, "k": k, "v": v, "out": out}
        lengths = None
        if packed is not None:
            operands = {name: packed.as_batch(t, name in ("k", "v")) for name, t in operands.items()}
            lengths = packed.lengths
        plan, call = self._forward_call(
            operands["q"], operands["k"], scale, list(tensors), scalars, lengths=lengths, value_dim=value_dim
        )
        call["offset"] = 0
        operands["lse"] = lse
        ptrs = operands if packed is None else {**operands, **packed.buffers()}
        slots = self.per_call_tensor_slots(dict(zip(self.tensor_names, tensors)))
        launch = self._forward_launch(plan, call, ptrs, out, lse, without_call_tensors(call, slots), packed=packed)
        launch.tensor_slots = slots
        return launch

    def _forward_launch(
        self, plan: CallPlan, call: dict, ptrs: dict[str, torch.Tensor], out: torch.Tensor, lse: torch.Tensor,
        kept: object, strides: Mapping[str, tuple[int, ...]] | None = None, packed: PackedSequences | None = None,
        packed_args: tuple | None = None,
    ) -> KeptLaunch:  # fmt: skip
        """The CPU forward's `KeptLaunch` of a call packed from `ptrs` (out and lse as the forward
        returns them; `kept`: what its pointers point into besides the operands; `packed_args`:
        the arrays `_run` packed for the call's own run without dropout, reused)."""
        pointers, ints, reals = packed_args or self.pack(plan, call, ptrs, 0.0, 0, strides)
        library = self.library(_DTYPES[out.dtype])
        names = self._slot_names.pointers
        return KeptLaunch(
            self, library, self._entry(library, "attncc_forward"), list(pointers),
            {name: names.index(name) for name in CALL_OPERANDS if name in ptrs}, ints, reals,
            tuple(out.shape), tuple(lse.shape), lse.dtype, None, kept, packed=packed,
        )  # fmt: skip

    def _keep_repeat(self, key: tuple, launch: KeptLaunch, packed: PackedSequences | None = None) -> None:
        """`launch` under `key` among the kept launches, the oldest dropped beyond
        PREPARED_CALLS_KEPT; a planned packed call's in its plan's memo (`packed.prepared`)."""
        with self._lock:
            if packed is not None:  # (the plan's memo holds every kernel's: capped all the same)
                keep_bounded(packed.prepared, (self.call_key, key), launch, PLAN_MEMO_KEPT)  # type: ignore[arg-type]
                return
            keep_bounded(self._repeats, key, launch)

    def check_inputs_named_apart(self, call: str) -> None:
        """An InputError where one of the program's inputs has the name of an argument of `call`
        (frontend CALL_ARGUMENTS: `input plan: int` in a packed call, `group` in context_parallel),
        which takes that argument itself, so the input could never be given there."""
        taken = CALL_ARGUMENTS[call]
        clash = next((d.name for d in self.inputs if d.name in taken), None)
        if clash is not None:
            raise InputError(
                f"{call}: program {self.name}'s input `{clash}` has the name of an argument of {call}, which takes it "
                "itself, so the input cannot be given there; rename the input"
            )

    @outside_unrelated_transforms
    def varlen(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        *,
        plan: VarlenPlan | None = None,
        return_lse: bool = False,
        scale: float | None = None,
        train: bool = True,
        seed: int | None = None,
        dropout_p: float | None = None,
        k_descale: object = None,
        v_descale: object = None,
        **runtime: object,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of a packed batch (FlashAttention's varlen layout), forward and backward.

        q [total_q, H, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]; sequence b is rows cu_seqlens_q[b] ..
        cu_seqlens_q[b + 1] of q and cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of k and v (int32 or
        int64 offsets, B + 1 of them, starting at 0). In the program, b is the sequence and N, M
        its own lengths. Runtime tensors keep padded shapes: B sequences, N = max_seqlen_q,
        M = max_seqlen_k (default: the longest). Returns out [total_q, H, D] (and lse
        [total_q, H] with return_lse); dropout keeps `dropout_mask(seed, b, 1, H, N_b, M_b, p)`
        for sequence b. fp8 k and v (forward only) with k_descale and v_descale broadcastable to
        [total_k, Hkv], as in `__call__`. `plan=attncc.plan_varlen(cu_seqlens_q, cu_seqlens_k)`
        instead of the offsets: read and checked once for every call on the batch (each layer's,
        forward and backward), so a call reads nothing back from the device. A call given the
        offsets reads them and takes the plan of the kernel's last call given the same values
        (`ragged.offsets_plan`; the last VARLEN_PLANS_KEPT batches'). Planned calls repeating a
        checked one's sizes, strides, dtypes, scalars and threads launch what it packed, forward
        and backward (`KeptLaunch`, kept in the plan). See attncc/runtime/ragged.py.
        """
        self.check_inputs_named_apart("varlen")
        return_lse = checked_flag("return_lse", return_lse)
        self._check_launch_scale(scale, ("N", "M"), "packed")
        lower = autocast_dtype(q)
        if lower is not None:  # (as SDPA under torch.autocast: runtime/amp.py)
            with torch.autocast(q.device.type, enabled=False):
                return self.varlen(
                    *cast_operands(lower, q, k, v), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, plan=plan,
                    return_lse=return_lse, scale=scale, train=train, seed=seed, dropout_p=dropout_p,
                    k_descale=k_descale, v_descale=v_descale, **runtime,
                )  # fmt: skip
        if plan is None and cu_seqlens_q is not None and cu_seqlens_k is not None and not values_unreadable(q):
            if all(type(t) is torch.Tensor for t in (q, k, v)) and not _untransformed(q, k, v):
                # (the clear error, before the offsets are read)
                _reject_transforms({"q": q, "k": k, "v": v})
            with self._lock:  # the offsets read; the plan of the last call given the same (checked then)
                plan = offsets_plan(self._varlen_plans, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            cu_seqlens_q = cu_seqlens_k = max_seqlen_q = max_seqlen_k = None
        # a planned call repeating a checked one repeats its kept launch (`_repeat_key`, in the
        # plan's memo): no offsets, checks, plan or packing per layer and step
        repeat_key = repeat = None
        if (
            type(plan) is VarlenPlan
            and cu_seqlens_q is None
            and cu_seqlens_k is None
            and max_seqlen_q is None
            and max_seqlen_k is None
            and k_descale is None
            and v_descale is None
            and dropout_p is None
        ):
            repeat_key = self._repeat_key(q, k, v, runtime, scale, train, seed)
            if repeat_key is not None:
                repeat = plan.packed.prepared.get((self.call_key, repeat_key))  # type: ignore[union-attr]
        if repeat is not None:
            if _records_graph(q, k, v):
                scalars = [float(runtime[d.name]) for d in self.inputs if d.role == "scalar"]  # type: ignore[arg-type]
                out, lse = _EagerVarlen.apply(
                    self.call_key, plan.packed, q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k,  # type: ignore[union-attr]
                    plan.max_seqlen_q, plan.max_seqlen_k, scalars, checked_scale(scale), 0.0,  # type: ignore[union-attr]
                    NO_DROPOUT_SEED, repeat,
                )  # fmt: skip
            else:
                out, lse = repeat(q, k, v)
            return (out, lse) if return_lse else out
        _reject_transforms({"q": q, "k": k, "v": v, **runtime})
        q, k, v = _resolved(q, k, v)
        out, lse = varlen_attention(
            self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            return_lse=True, scale=scale, train=train, seed=seed, dropout_p=dropout_p, runtime=runtime,
            k_descale=k_descale, v_descale=v_descale, plan=plan,
        )  # fmt: skip
        # (a call with a repeat key ran forward_impl, directly or through _EagerVarlen: see __call__)
        if repeat_key is not None and out.numel():
            scalars = [float(runtime[d.name]) for d in self.inputs if d.role == "scalar"]  # type: ignore[arg-type]
            self._remember_repeat(repeat_key, q, k, v, out, lse, scalars, checked_scale(scale), plan.packed)  # type: ignore[union-attr]
        return (out, lse) if return_lse else out

    @outside_unrelated_transforms
    def paged(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor | None = None,
        cache_seqlens: torch.Tensor | None = None,
        *,
        plan: PagedPlan | None = None,
        k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None,
        layout: str = "bnhd",
        return_lse: bool = False,
        scale: float | None = None,
        train: bool = False,
        k_descale: object = None,
        v_descale: object = None,
        **runtime: object,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention of new queries over a paged KV cache (the FlashAttention / vLLM layout); forward only.

        q [B, N, H, D] (layout="bnhd", default) or [B, H, N, D] ("bhnd"); k_cache [num_pages,
        page_size, Hkv, D], v_cache [num_pages, page_size, Hkv, Dv]; block_table [B, max_pages]
        (int32/int64 page ids); cache_seqlens [B]: keys held per sequence. k_new [B, N_new, Hkv,
        D] and v_new [B, N_new, Hkv, Dv], if given, are
        written into the cache at cache_seqlens[b] .. + N_new first (in place; cache_seqlens is
        not changed). Sequence b then attends over M_b = cache_seqlens[b] + N_new keys; the
        queries are its last N positions, so bottom-right causal is `mask j <= i + (M - N)`.
        Runtime tensors keep padded shapes (M: the block table's capacity). Returns out in q's
        layout, Dv wide (and lse, q's layout without the head dim, with return_lse). An fp8
        cache (float8_e4m3fn or float8_e5m2; k_new and v_new in its dtype, already quantised)
        takes k_descale and v_descale broadcastable to [num_pages, page_size, Hkv] (a per-token
        factor sits beside its row: write the appended rows' factors before the call).

        `plan` (`attncc.plan_paged(k_cache, block_table, cache_seqlens, new_tokens)`) in place of
        block_table and cache_seqlens: the table and lengths read and checked once for every
        call that shares them (each layer of a decoding step), so the call reads nothing back
        from the device and its tile classes are prepared once per kernel and plan (under
        torch.compile the op takes the plan's table and lengths and reads them, as an unplanned
        call's: one graph for every step's plan).

        Paged calls are inference: a program's dropout is not applied (train=True with one is
        an error; `train` is taken, as the other calls take it, for code that passes it through).
        """
        self.check_inputs_named_apart("paged")
        return_lse = checked_flag("return_lse", return_lse)
        self._check_launch_scale(scale, ("M",), "paged")
        if checked_train(train) and self.op.dropout > 0:
            raise InputError(
                f"{self.name}: paged calls are inference and apply no dropout; pass train=False (a program's "
                f"dropout p = {self.op.dropout} runs in padded and packed calls)"
            )
        if "dropout_p" in runtime:  # (a call keyword of the others: not an unknown runtime input)
            raise InputError("dropout_p: paged calls are inference and apply no dropout; give none")
        key = planned_call_key(
            self, plan, q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new, layout, scale, runtime,
            k_descale, v_descale,
        )  # fmt: skip
        memo = (
            plan.keys.prepared
            if key is not None and isinstance(plan, PagedPlan) and plan.keys.prepared is not None
            else {}
        )
        checked = memo.get(key)
        if checked is not None:
            result = checked(self, plan, q, k_cache, v_cache, k_new, v_new, layout, return_lse)
            if result is not None:
                return result
        _reject_transforms({"q": q, "k_cache": k_cache, "v_cache": v_cache, **runtime})
        q, k_new, v_new = _resolved(q, k_new, v_new)
        result = paged_attention(
            self, q, k_cache, v_cache, block_table, cache_seqlens, k_new=k_new, v_new=v_new,
            layout=layout, return_lse=return_lse, scale=scale, runtime=runtime,
            k_descale=k_descale, v_descale=v_descale, plan=plan,
        )  # fmt: skip
        # every check passed: calls repeating this one skip them, where the kernel kept a launch
        if key is not None and isinstance(plan, PagedPlan):
            scalars = [float(runtime[d.name]) for d in self.inputs if d.role == "scalar"]  # type: ignore[arg-type]
            checked = CheckedPagedCall(checked_scale(scale), scalars)
            if checked.launch(self, plan, q, k_cache, v_cache, layout) is not None:
                with self._lock:
                    keep_bounded(memo, key, checked, PLAN_MEMO_KEPT)
        return result

    def kept_launch(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scalars: list[float], scale: float | None,
        paged: PagedKeys | None = None,
    ) -> KeptLaunch | None:  # fmt: skip
        """The forward launch the forward kept for these operands (q [B, H, N, D]; with `paged`,
        k and v the caches of a planned call), if any: the CPU forward keeps a planned paged
        call's in the plan's memo (`_keep_paged_launch`), its plain calls' by call
        (`_remember_repeat`)."""
        if paged is None or paged.prepared is None:
            return None
        key = self._paged_launch_key(q, k, v, scalars, scale)
        return None if key is None else paged.prepared.get(key)

    def _paged_launch_key(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scalars: list[float], scale: float | None
    ) -> tuple | None:
        """What decides a planned paged CPU call's launch besides its plan (whose memo holds it):
        `_launch_signature` of q [B, H, N, D] and the caches. None where none is kept (`_repeatable`)."""
        if not self._repeatable or k.dtype in FP8_DTYPES:
            return None
        pairs = tuple(zip(self._scalar_names, scalars))  # (as `op_repeat_key`'s)
        return ("paged forward", self.call_key, *self._launch_signature(q, k, v, scale, pairs))

    def _keep_paged_launch(
        self, key: tuple, paged: PagedKeys, plan: CallPlan, call: dict, ptrs: dict[str, torch.Tensor],
        strides: Mapping[str, tuple[int, ...]], out: torch.Tensor, lse: torch.Tensor, packed_args: tuple,
    ) -> None:  # fmt: skip
        """Keep a planned paged call's packed launch in its plan's memo under `key`
        (`_paged_launch_key`), for the calls repeating it (`CheckedPagedCall`): the next layers of
        a decoding step. Before, each planned paged CPU call took the full path: B=1 H=8 M=256
        D=64 fp32 decoding 129 us a call, where a padded call repeating a kept launch took 17."""
        launch = self._forward_launch(plan, call, ptrs, out, lse, (call, paged), strides, packed_args=packed_args)
        with self._lock:
            keep_bounded(paged.prepared, key, launch, PLAN_MEMO_KEPT)  # type: ignore[arg-type]

    def call_scale(self, scale: object) -> float | None:
        """A call's `scale=` (padded, packed, paged): a finite number that the program reads
        (`checked_scale`, `check_scale_is_read`); while torch.compile traces, as given (it may
        be symbolic), a tensor refused (`traced_tensor_number`)."""
        if torch.compiler.is_compiling():
            if isinstance(scale, torch.Tensor):
                raise traced_tensor_number("scale")
            return scale  # type: ignore[return-value]
        checked = checked_scale(scale)
        self.check_scale_is_read(checked)
        return checked

    def check_scale_is_read(self, scale: float | None) -> None:
        """A call's `scale=` where the program reads no name `scale` (`s = q @ k.T`, a literal
        factor) would change nothing: a clear error, where an SDPA user's scale was ignored."""
        if scale is not None and not self.reads_scale:
            raise InputError(
                f"scale: program {self.name} does not use the name `scale` (q.k is multiplied by {self.op.scale}), "
                f"so scale={scale!r} would change nothing; write `* scale` where it applies"
            )

    def default_scale(self, q: torch.Tensor, k: torch.Tensor) -> float:
        """The value of the name `scale` when a call gives none: the program's or 1/sqrt(D)."""
        return self._scale_values(_sizes(q, k), None)[0]

    def reference(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        train: bool = True,
        seed: int = 0,
        dropout_p: float | None = None,
        dtype: torch.dtype = torch.float64,
        k_descale: object = None,
        v_descale: object = None,
        **runtime: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager result (out, lse) of the same IR (float64 unless `dtype`), for tests and
        `attncc check`; fp8 k and v dequantised first (in fp32, rounded to q's dtype). It runs on
        the device of its inputs, whatever the target."""
        self.validate(q, k, v, runtime, on_target=False)
        descale = kv_descales(k, v, k_descale, v_descale)
        if descale:
            k, v = (dequantised(t, descale[name], q.dtype) for t, name in ((k, "k_descale"), (v, "v_descale")))
        q, k = self.rope_applied(q, k, runtime)
        scalars = {d.name: runtime[d.name] for d in self.inputs if d.role == "scalar"}
        tensors = {d.name: runtime[d.name] for d in self.inputs if d.role == "tensor"}
        problem = _problem(q, k, v.shape[3])
        tensors = runtime_tensors(self.op.sparsity, problem, tensors, scalars)  # type: ignore[arg-type]
        scale_value = float(scale) if scale is not None else self.default_scale(q, k)
        dropout = self.call_dropout(train, dropout_p)
        return reference_attention(self.op, q, k, v, scale_value, scalars, tensors, seed, 0, dropout, dtype)  # type: ignore[arg-type]

    def tile_classes(self, q: torch.Tensor, k: torch.Tensor, **runtime: object) -> torch.Tensor:
        """The [B|1, H|1, Ti, Tj] tile classes (0 empty, 1 partial, 2 full) for these inputs."""
        return self.forward_classes(q, k, **runtime)[1]

    def forward_classes(self, q: torch.Tensor, k: torch.Tensor, **runtime: object) -> tuple[TilePlan, torch.Tensor]:
        """The forward's tiles for these inputs and its [B|1, H|1, Ti, Tj] tile classes (those
        `_forward_call` chooses, streaming included)."""
        self._bind_sizes(runtime)
        tensors: list[torch.Tensor] = [runtime[d.name] for d in self.inputs if d.role == "tensor"]  # type: ignore[misc]
        scalars = [float(runtime[d.name]) for d in self.inputs if d.role == "scalar"]  # type: ignore[arg-type]
        plan, call = self._forward_call(q, k, None, tensors, scalars)
        return plan.tiles, call["classes"].cpu()  # type: ignore[union-attr]

    def plan(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        scale: float | None,
        backward: bool = False,
        value_dim: int | None = None,
    ) -> CallPlan:
        """The call's sizes (v's head dim `value_dim`, default k's), tiles (the backward kernels'
        with `backward`) and scale factors; kept per (sizes, dtype, scale), since evaluating the
        scale expressions takes ~20 us."""
        if (isinstance(scale, bool) or not isinstance(scale, float | int | None)) and not torch.compiler.is_compiling():
            scale = checked_scale(scale)  # (a tensor given as the scale: v by mistake)
        problem = _problem(q, k, value_dim)
        key = (problem, q.dtype, signed_zeros((scale,)), backward)  # (-0.0 == 0.0, but 1 / scale differs)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        tiles = self._tiles(plan_head_dim(problem), q.dtype, backward)
        value, multiplier = self._scale_values(_sizes(q, k), scale)
        plan = CallPlan(problem, tiles, multiplier, value)
        with self._lock:
            keep_bounded(self._plans, key, plan)
        return plan

    def _scale_values(self, sizes: Mapping[str, int], scale: float | None) -> tuple[float, float]:
        """The name `scale`'s value (`scale`, else the program's default) and the q.k factor,
        kept by the sizes the two expressions read (D for 1/sqrt(D)): a decoding step plans anew
        for every token (M grows), and evaluating them took ~17 us of its ~23."""
        key = (signed_zeros((scale,)), *(sizes[name] for name in self._scale_sizes))
        values = self._scales.get(key)
        if values is None:
            value = scale if scale is not None else float(evaluate(self.op.default_scale, sizes, {}))
            if not math.isfinite(value):  # (every output was NaN; a call's scale= is checked before,
                # but where torch.compile traces, passed as given)
                if scale is not None:
                    raise InputError(f"scale: expected a finite number, got {scale!r}")
                read = ", ".join(f"{name}={sizes[name]}" for name in self._scale_sizes)
                raise InputError(
                    f"{self.name}: the program's `scale = {ex_render(self.op.default_scale)}` is {value}"
                    f"{f' at {read}' if read else ''}: expected a finite number"
                )
            values = value, float(evaluate(self.op.scale, {**sizes, "scale": value}, {}))
            with self._lock:
                keep_bounded(self._scales, key, values)
        return values

    def _check_launch_scale(self, scale: object, own_sizes: tuple[str, ...], layout: str) -> None:
        """A clear error where a call that gives no scale would take the program's default
        scale at sizes its sequences have each their own (`own_sizes`: a packed batch's N and M,
        a paged cache's M): one launch takes one scale (it was the longest sequence's, session 58)."""
        if scale is None and (read := [name for name in own_sizes if name in self._default_scale_reads]):
            raise InputError(
                f"{self.name}: the program's `scale = {ex_render(self.op.default_scale)}` reads {' and '.join(read)}, "
                f"each sequence's own in a {layout} call, and a launch takes one scale: give scale=, or write the "
                "factor into the scores (s = q @ k.T * ...), which read each sequence's sizes"
            )

    @cached_property
    def _scale_sizes(self) -> tuple[str, ...]:
        """The sizes (B, H, ...) that the scale expressions read."""
        names = free_vars(self.op.scale) | free_vars(self.op.default_scale)
        return tuple(name for name in SIZE_VARS if name in names)

    def _tiles(self, head_dim: int, dtype: torch.dtype, backward: bool) -> TilePlan:
        """The plan's tiles for this head dim and dtype (the forward's may then stream:
        TilePlan.for_keys, or follow pages: TilePlan.for_pages)."""
        assert self.op.tiling is not None
        tiles = self.op.tiling.for_head_dim(head_dim, backward)
        micro_kernel = self.op.tiling.micro_kernel
        if micro_kernel is None:
            return tiles
        if backward:
            return tiles.for_bf16_backward() if bf16_backward(_DTYPES[dtype], micro_kernel) else tiles
        return tiles.for_bf16_products() if bf16_products(_DTYPES[dtype], micro_kernel) else tiles

    def source(self, dtype: str = "float32") -> str:
        return generate_cpu(self.graph, dtype, self.key)

    def library_path(self, dtype: str) -> Path:
        """The built library for q/k/v of `dtype` (prebuilt, cached or built now), not loaded."""
        assert self.op.tiling is not None and self.op.tiling.micro_kernel is not None
        flags = self.op.tiling.micro_kernel.compile_flags
        return build_library(self.source(dtype), f"{self.name}-{dtype}", isa_flags=flags, parts=2)

    def library(self, dtype: str) -> ctypes.CDLL:
        """The compiled library for q/k/v of `dtype` (built once, then from the disk cache)."""
        return self._loaded(dtype, lambda: self.library_path(dtype), "attncc_forward")

    def _loaded(self, key: str | tuple[str, int, int], build: Callable[[], Path], symbol: str | None) -> ctypes.CDLL:
        """The library of `key`, loaded once; `build()` (its path: seconds of compiler on a first
        use) runs outside the kernel's lock, so calls of the kernel's other libraries go on
        meanwhile (they stalled for the whole build) and threads building the same one wait
        on the cache entry's file lock (runtime/build.py) instead."""
        library = self._libraries.get(key)
        if library is not None:
            return library
        path = build()
        with self._lock:
            if key not in self._libraries:
                self._libraries[key] = load_library(path, symbol)
            return self._libraries[key]

    def prebuild(
        self, dtypes: Sequence[torch.dtype], head_dims: Sequence[int], kv_dtypes: Sequence[torch.dtype] = ()
    ) -> list[Path]:
        """Build, without loading, every library that calls with q/k/v of `dtypes` and these head
        dims use (`attncc prebuild`), and for fp8 `kv_dtypes` the forward of q of `dtypes` with
        such k and v. A CPU library serves every head dim."""
        del head_dims  # the CPU kernels take D at run time
        names = [_DTYPES[d] for d in dict.fromkeys(dtypes)]
        names += [
            library_dtype(q, kv)
            for kv in dict.fromkeys(kv_dtypes)
            for q in dict.fromkeys(dtypes)
            if q in FP8_QUERY_DTYPES
        ]
        return [self.library_path(name) for name in names]

    # ------------------------------------------------------------------ validation
    def validate(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        runtime: Mapping[str, object],
        *,
        on_target: bool = True,
    ) -> None:
        """Clear errors for calls the kernels cannot run; `on_target=False` (the eager reference,
        which runs wherever its inputs are) leaves out the check of the target's device type."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
            if t.layout != torch.strided:  # (sparse, mkldnn: "Cannot access data pointer" from inside torch)
                raise InputError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
            if t.dim() != 4:
                raise InputError(
                    f"{name}: expected 4 dimensions [B, {'H' if name == 'q' else 'Hkv'}, {'N' if name == 'q' else 'M'}, D], got shape {tuple(t.shape)}"
                )
            if t.dtype not in _DTYPES and (name == "q" or t.dtype not in FP8_DTYPES):
                fp8 = (
                    "" if name == "q" else " (or, with q of float32, bfloat16 or float16, float8_e4m3fn or float8_e5m2)"
                )
                raise InputError(f"{name}: expected dtype float32, float64, bfloat16 or float16{fp8}, got {t.dtype}")
            if on_target and t.device.type != self.device_type and not t.is_meta:
                raise InputError(
                    f"{name}: the `{self.target}` target runs on {self.device_type} tensors, got device {t.device}"
                )
        for name, t in (("k", k), ("v", v)):
            if t.device != q.device:
                raise InputError(f"{name}: expected device {q.device} (that of q), got {t.device}")
        check_operand_dtypes(q, k, v, runtime)
        B, H, _N, D = q.shape
        if k.shape[0] != B:
            raise InputError(f"k: expected batch size {B} (from q), got shape {tuple(k.shape)}")
        if k.shape[3] != D:
            raise InputError(f"k: expected head dim {D} (from q), got shape {tuple(k.shape)}")
        if v.shape[:3] != k.shape[:3]:
            raise InputError(
                f"v: expected shape [{', '.join(map(str, k.shape[:3]))}, Dv] (that of k but the head dim), got {tuple(v.shape)}"
            )
        Hkv = k.shape[1]
        if Hkv == 0:
            raise InputError(f"k: expected at least one key/value head, got shape {tuple(k.shape)}")
        if H % Hkv != 0:
            raise InputError(f"k: query heads H={H} must be a multiple of key/value heads Hkv={Hkv}")
        assert self.op.tiling is not None
        limit = self.op.tiling.max_head_dim
        for name, dim, size in (("q", "D", D), ("v", "Dv", v.shape[3])):
            if not 1 <= size <= limit:
                raise InputError(f"{name}: head dim {dim}={size} must be in [1, {limit}] on target {self.target}")
        self.check_input_names(runtime)
        sizes = _sizes(q, k)
        # a globalized program's N and M are the whole sequence's (passes/positions.py)
        sizes.update({size: int(runtime[name]) for size, name in GLOBAL_SIZES.items() if name in runtime})  # type: ignore[call-overload]
        # a dimension named after an int scalar input is that many (`input L: int` with `float[L]`:
        # a table of another length was taken, silently)
        bound: dict[str, int] = {}
        for decl in self.inputs:
            if decl.role == "scalar" and decl.dtype == "int" and decl.size_of is None:
                value = python_number(runtime[decl.name])
                whole = isinstance(value, int) and not isinstance(value, bool)
                if whole or (isinstance(value, float) and value.is_integer()):
                    bound[decl.name] = int(value)  # type: ignore[arg-type]
        for decl in self.inputs:
            value = self._validate_input(decl, runtime[decl.name], sizes, bound, q.device)
            if value is not runtime[decl.name] and isinstance(runtime, dict):
                runtime[decl.name] = value  # (numpy's scalars as Python's: every later step takes those)

    def check_input_names(self, runtime: dict[str, object]) -> None:
        """Every declared runtime input given and no other (static: also while traced); each
        free dimension name a program uses is bound here, in `runtime`, to its tensor's size."""
        self._bind_sizes(runtime)
        expected = {d.name for d in self.inputs}
        unknown = sorted(set(runtime) - expected)
        if unknown:
            raise InputError(f"unknown runtime input(s) {', '.join(unknown)}; {self.name} takes {_names(self.inputs)}")
        for decl in self.inputs:
            if decl.name not in runtime:
                raise InputError(
                    f"missing runtime input `{decl.name}` ({_declared(decl)}); {self.name} takes {_names(self.inputs)}"
                )

    def checked_scalar(self, decl: Input, value: object) -> object:
        """A scalar input's value checked as a call checks it (numpy's numbers as Python's)."""
        assert decl.role == "scalar"
        return self._validate_input(decl, value, {}, {}, torch.device("cpu"))

    def _bind_sizes(self, runtime: dict[str, object]) -> None:
        """Sets each size input (`input t: float[L, H]` with `L` used in an expression) to its
        tensor's size; a value the caller gave must equal it. A tensor not given is left to
        the checks that name it."""
        for decl in self._size_inputs:
            tensor, axis = decl.size_of  # type: ignore[misc]
            value = runtime.get(tensor)
            if not isinstance(value, torch.Tensor) or value.dim() <= axis:
                continue
            size = value.shape[axis]
            given = runtime.get(decl.name, size)
            number = python_number(given)
            if isinstance(number, torch.Tensor):  # (a one-element tensor's value; any other, no size)
                number = number.item() if number.numel() == 1 and not number.is_complex() else None
            if given is not size and number != size:
                raise InputError(
                    f"{decl.name}: the size of {tensor}'s dimension {axis} ({size}), bound from its shape; "
                    f"given {given!r} (leave it out)"
                )
            runtime[decl.name] = size

    def _validate_input(
        self, decl: Input, value: object, sizes: dict[str, int], bound: dict[str, int], device: torch.device
    ) -> object:
        """Checks one runtime input; returns it, a numpy scalar as the Python number it holds."""
        if decl.role == "scalar":
            if torch.compiler.is_compiling():
                if isinstance(value, torch.Tensor):
                    raise traced_tensor_number(decl.name)
                return value  # may be symbolic: the op implementation gets (and the kernel reads) concrete values
            value = python_number(value)
            if isinstance(value, torch.Tensor):
                if value.numel() != 1:
                    raise InputError(
                        f"{decl.name}: expected a scalar ({decl.dtype}), got a tensor of shape {tuple(value.shape)}"
                    )
                if value.requires_grad and torch.is_grad_enabled():  # its gradient would be dropped silently
                    raise InputError(
                        f"{decl.name}: a scalar input (`input {decl.name}: {decl.dtype}`) gets no gradient, but "
                        f"this tensor requires grad; pass it detached, or declare `input {decl.name}: float[1]` "
                        f"and read `{decl.name}[0]` to learn it"
                    )
                if value.is_meta:  # (.item() raised inside torch)
                    raise InputError(f"{decl.name}: a scalar on the meta device has no value; pass a number")
                value = value.item()
            # (|value| < 2^1024: float() of a larger int raised OverflowError; inf and NaN fail it too)
            ok = isinstance(value, (bool, int, float)) and abs(value) < 2**1024  # type: ignore[operator]
            ok = ok and (decl.dtype == "float" or float(value).is_integer())  # type: ignore[arg-type]
            if not ok or (decl.dtype == "float" and not math.isfinite(float(value))):  # type: ignore[arg-type]
                kind = {"float": "a finite float", "int": "an int"}.get(decl.dtype, f"a {decl.dtype}")
                raise InputError(f"{decl.name}: expected {kind} scalar, got {value!r}")
            if decl.dtype == "int" and abs(int(value)) > 2**53:  # type: ignore[arg-type]
                raise InputError(
                    f"{decl.name}: {value!r} is beyond 2^53 (int scalars reach the kernel as exact float64)"
                )
            return value
        if not isinstance(value, torch.Tensor):
            raise InputError(f"{decl.name}: expected a tensor {_declared(decl)}, got {type(value).__name__}")
        if value.layout != torch.strided and not value.is_nested:  # (sparse: an error from inside torch)
            raise InputError(
                f"{decl.name}: expected a dense (strided) tensor {_declared(decl)}, got layout {value.layout}"
            )
        host_read = decl.name in self._host_reads
        if value.device != device and not (host_read and value.device.type == "cpu"):
            where = " or the CPU (the host reads its values)" if host_read else ""
            raise InputError(
                f"{decl.name}: expected a tensor on {device} (that of q){where}, got device {value.device}"
            )
        kinds = {
            "float": value.is_floating_point(),
            "int": not value.is_floating_point() and value.dtype != torch.bool and not value.is_complex(),
            "bool": value.dtype == torch.bool,
        }
        if not kinds[decl.dtype] and not (decl.dtype == "bool" and kinds["int"]):
            raise InputError(
                f"{decl.name}: expected {'an' if decl.dtype == 'int' else 'a'} {decl.dtype} tensor, got dtype {value.dtype}"
            )
        if value.dim() != len(decl.dims):
            raise InputError(f"{decl.name}: expected shape {_declared(decl)}, got {tuple(value.shape)}")
        for axis, (dim, actual) in enumerate(zip(decl.dims, value.shape)):
            want = dim if isinstance(dim, int) else sizes.get(dim, bound.get(dim))
            if want is not None and want != actual:
                raise InputError(
                    f"{decl.name}: expected shape {_declared(decl)}{'' if isinstance(dim, int) else f' with {dim}={want}'}, "
                    f"got {tuple(value.shape)} (dimension {axis})"
                )
            if isinstance(dim, str):
                bound[dim] = actual
        return value

    # ------------------------------------------------------------------ op implementations
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
        """out and lse of one padded call; `offset` is the dropout counters' fourth word
        (0 for plain calls, the sequence's index for packed and paged calls). With `paged`, k
        and v are caches [pages, page_size, Hkv, D] read in place through its block table
        (any page size: TilePlan.for_pages). `sink` [B, H, N]: the softmax's sink logit per row, merged into each
        row as the kernel writes it (out and lse are those of the softmax with the sink). With
        `packed`, q, k, v are a packed batch [total, heads, D], out and lse
        [total_q, H, D] and [total_q, H] (sink too), all sequences in one launch. With fp8 k and v,
        `descale` holds their descale factors by ABI name, shaped as k and v with a head dim of 1
        (runtime/fp8.py `descale_rows`: whatever layout k and v have, the factors have too).
        `appends`: a paged call's new keys, written into the caches k and v before they are read."""
        if appends is not None:
            append_to_caches(k, v, appends)
        dtype = library_dtype(q.dtype, k.dtype)
        strides: dict[str, tuple[int, ...]] = {}
        scales = dict(descale or {})
        value_dim = v.shape[-1]
        # (packed: the rows the kernel writes through `out`)
        rows_out = torch.empty((*q.shape[:-1], value_dim), dtype=q.dtype, device=q.device)
        if packed is not None:
            q, k, v = packed.as_batch(q, False), packed.as_batch(k, True), packed.as_batch(v, True)
            scales = {name: packed.as_batch(t, True) for name, t in scales.items()}
            plan, call = self._forward_call(q, k, scale, tensors, scalars, lengths=packed.lengths, value_dim=value_dim)
        elif paged is None:
            plan, call = self._forward_call(q, k, scale, tensors, scalars, value_dim=value_dim)
        else:  # the plan sees keys [B, Hkv, M, D]; the kernel, pages and rows at the cache's strides
            plan, call = self._forward_call(
                q,
                paged.keys_like(q, k),
                scale,
                tensors,
                scalars,
                page_size=paged.page_size,
                lengths=paged.lengths(q.shape[2]),
                value_dim=value_dim,
                memo=paged.prepared,
            )
            call["page_size"] = paged.page_size
            strides = PagedKeys.strides({"k": k, "v": v, **scales})
        call["offset"] = offset
        out = rows_out if packed is None else packed.as_batch(rows_out, False)
        lse = torch.empty(rows_out.shape[:-1], dtype=acc_dtype(q.dtype), device=q.device)
        if out.numel() == 0:
            return rows_out, lse
        ptrs = {"q": q, "k": k, "v": v, "out": out, "lse": lse, **scales}
        lengths = packed.lengths if packed is not None else paged.lengths(q.shape[2]) if paged is not None else None
        rope_ptrs, call["rope"] = self.rope_buffers(
            q, k if paged is None else paged.keys_like(q, k), tensors, scalars, lengths
        )
        ptrs.update(rope_ptrs)
        if paged is not None:
            ptrs.update(paged.buffers())
        if packed is not None:
            ptrs.update(packed.buffers())
        if sink is not None:
            ptrs["sink"] = sink.detach().to(lse.dtype).contiguous()
        packed_args = self._run("attncc_forward", dtype, plan, call, ptrs, dropout, seed, strides=strides)
        if paged is not None and paged.prepared is not None and not tensors and not scales and sink is None:
            key = self._paged_launch_key(q, k, v, scalars, scale)  # (a planned call: the plan's memo)
            if key is not None and key not in paged.prepared and dropout == 0:
                self._keep_paged_launch(key, paged, plan, call, ptrs, strides, rows_out, lse, packed_args)
        return rows_out, lse

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
        kept_by: KeptLaunch | None = None,
        sink: torch.Tensor | None = None,
        all_keys: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """dq, dk, dv and the learnable inputs' gradients (empty where not wanted; with `sink`,
        the rows' lse residuals after them, for the sink's gradient); `packed` as in
        `forward_impl` (q, k, v, out, dout, dq, dk, dv rows [total, heads, D]). `kept_by`: the
        forward's kept launch this call repeated (`KeptLaunch.backward`), which keeps the
        backward's packed launch for the calls repeating it. `sink`: the forward's sink logits
        (lse's layout), and `all_keys` False where k and v are only part of each row's keys (a
        ring step's, whose lse is the whole row's): both for the lse residuals of rows whose
        lse lost log l (templates/cpu `lse_residuals`), which a partial row cannot recover."""
        dtype = _DTYPES[q.dtype]
        acc = acc_dtype(q.dtype)
        dq, dk, dv = (
            torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device),
        )
        operands = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "dq": dq, "dk": dk, "dv": dv}
        if packed is not None:  # (key-side operands: those of k's shape)
            operands = {name: packed.as_batch(t, name in ("k", "v", "dk", "dv")) for name, t in operands.items()}
        plan = self.plan(operands["q"], operands["k"], scale, backward=True, value_dim=v.shape[-1])
        plan = self._with_few_keys(plan, q.dtype)
        call = self._prepare(plan, q.dtype, tensors, scalars, None if packed is None else packed.lengths)
        call["offset"] = offset
        tensor_decls = [d for d in self.inputs if d.role == "tensor"]
        grads: dict[str, torch.Tensor] = {}  # [threads, *shape]: one slice per thread, summed after
        learnable = [
            (d, t) for d, t, wanted in zip(tensor_decls, tensors, grad_inputs) if wanted and d.name in self.abi.grads
        ]
        grad_dtype = torch.float64  # the kernels' grad_t: sums of N x M terms
        threads = self.backward_threads(sum(t.numel() for _, t in learnable) * grad_dtype.itemsize)
        for decl, t in learnable:
            slices = threads if threads * t.numel() * grad_dtype.itemsize <= PER_THREAD_GRAD_BUFFERS_MAX else 1
            grads[decl.name] = torch.zeros((slices, *t.shape), dtype=grad_dtype, device=q.device)
        call["threads"] = threads
        call["grad_slices"] = {self.abi.ident_of(n): g[0].numel() if len(g) > 1 else 0 for n, g in grads.items()}
        if q.numel() and k.numel():
            lse = lse.contiguous()
            # rowsum(dO * O), the first pass's (row_stat's layout, as lse)
            delta = torch.empty(lse.shape, dtype=acc, device=q.device)
            ptrs = dict(operands, lse=lse, delta=delta)
            if all_keys:  # (the first pass's too)
                ptrs["lse_residual"] = torch.empty(lse.shape, dtype=acc, device=q.device)
            if sink is not None:
                ptrs["sink"] = sink.detach().to(acc).contiguous()
            rope_ptrs, call["rope"] = self.rope_buffers(
                operands["q"], operands["k"], tensors, scalars, None if packed is None else packed.lengths
            )
            ptrs.update(rope_ptrs)
            if packed is not None:
                ptrs.update(packed.buffers())
            ptrs.update({f"grad_{self.abi.ident_of(n)}": g for n, g in grads.items()})
            p = plan.problem
            call["key_tiles_per_sweep"] = plan.tiles.key_tiles_per_sweep(p.H // p.Hkv * p.N)
            lengths = None if packed is None else packed.lengths
            entries, call["key_chunks"] = self.backward_passes(plan, threads, lengths, acc.itemsize)
            library = self._library_for(dtype, plan)
            pointers, ints, reals = self.pack(plan, call, ptrs, dropout, seed)
            names = self._slot_names.pointers
            launch = BackwardLaunch(
                library, self._entry(library, "attncc_backward_delta"),
                tuple(self._entry(library, entry) for entry in entries),
                pointers, {name: names.index(name) for name in BACKWARD_OPERANDS}, ints, reals,
                (threads, self.backward), operand_layout(q, k, v, out, dout), call,
            )  # fmt: skip
            launch.run(self, ptrs, dlse)
            # (`call` keeps the layout grids alive; rope's tables, only in ptrs, would not be)
            if kept_by is not None and not grads and not rope_ptrs:
                kept_by.backward_launch = launch
        else:
            dq.zero_(), dk.zero_(), dv.zero_()
        grad_list = [
            grads[d.name].sum(0).to(t.dtype) if d.name in grads else t.new_empty(0)
            for d, t in zip(tensor_decls, tensors)
        ]
        if sink is not None:  # the rows' lse residuals, for the sink's gradient (`_input_gradients`)
            residual = ptrs.get("lse_residual") if q.numel() and k.numel() else None
            grad_list.append(residual if residual is not None else torch.zeros(lse.shape, dtype=acc, device=q.device))
        return dq, dk, dv, grad_list

    def backward_threads(self, grad_bytes: int) -> int:
        """Threads for the backward. Learnable-input gradients get a buffer per thread (summed
        in thread order: reproducible) while they fit PER_THREAD_GRAD_BUFFERS_MAX in all; beyond,
        the threads share one buffer with float atomics, unless torch's deterministic mode is on:
        then fewer threads, each with its own buffer (slower, still reproducible)."""
        threads = max(1, torch.get_num_threads())
        if not torch.are_deterministic_algorithms_enabled() or threads * grad_bytes <= PER_THREAD_GRAD_BUFFERS_MAX:
            return threads
        fewer = max(1, PER_THREAD_GRAD_BUFFERS_MAX // grad_bytes)
        warnings.warn(
            f"attncc kernel {self.name}: reproducible learnable-input gradients need a {grad_bytes / 2**20:.0f} MiB "
            f"buffer per thread; the backward runs on {fewer} of {threads} threads to stay within "
            f"{PER_THREAD_GRAD_BUFFERS_MAX // 2**20} MiB (torch.use_deterministic_algorithms is on)",
            stacklevel=3,
        )
        return fewer

    def backward_passes(
        self, plan: CallPlan, threads: int | None = None, lengths: Lengths | None = None, acc_bytes: int = 4
    ) -> tuple[tuple[str, ...], int]:
        """The backward's passes after the delta pass, and the fused pass's key chunks: one fused
        pass (dQ in a per-task buffer, 5 tile products) where its buffers are small and its tasks
        keep every thread busy, else a dK/dV pass and a dQ pass (7 tile products, parallel over
        tiles). The fused pass's tasks are the (b, kv head) pairs; with fewer than
        FUSED_BACKWARD_TASKS_PER_THREAD per thread each is cut into key chunks (templates/cpu
        `chunk_key_tiles`, a task each; `fused_key_chunks`), at most one per sweep over its query
        tiles and their dQ rows (a copy of dQ in fp32 per chunk) within
        FUSED_BACKWARD_MAX_BUFFER; where that leaves the threads short the two passes run. A
        packed batch's tasks (`lengths`: its sequences' query and key counts) differ in size:
        they are cut where the largest would hold a thread more than FUSED_BACKWARD_IMBALANCE
        times its share of all their tiles (`packed_key_chunks`). `backward` forces either
        (fused: with the chunks auto would take, or none). `threads`: those the backward runs on
        (default: torch's); `acc_bytes`: the accumulators' element size (8 for float64 calls)."""
        if self.backward not in ("auto", "fused", "two-pass"):  # (a typo ran two-pass silently)
            raise AttnccError(f"backward: expected 'auto', 'fused' or 'two-pass', got {self.backward!r}")
        p, tiles = plan.problem, plan.tiles
        threads = threads or max(1, torch.get_num_threads())
        rows = (p.H // p.Hkv) * math.ceil(p.N / tiles.block_rows) * tiles.block_rows
        # fp32 dQ, and the task's query tiles (QuerySlots: fp32 Q and dO, or four bf16 forms of
        # them); head dims rounded up to 32, at least the kernels' vector width (Dp)
        padded_dims = -(-p.D // 32) * 32, -(-p.Dv // 32) * 32
        buffers = acc_bytes * rows * (padded_dims[0] + sum(padded_dims))
        tasks = max(1, p.B * p.Hkv)
        # no more chunks than sweeps over the task's query tiles (none is loaded more often), and
        # their dQ copies within FUSED_BACKWARD_MAX_BUFFER
        most = math.ceil(p.M / tiles.block_cols) // tiles.key_tiles_per_sweep(p.H // p.Hkv * p.N)
        most = max(1, min(most, FUSED_BACKWARD_MAX_BUFFER // max(1, acc_bytes * tasks * rows * padded_dims[0])))
        if lengths is not None:
            pairs = tuple(zip(lengths[0].tolist(), lengths[1].tolist()))
            chunks, busy = packed_key_chunks(pairs, tiles.block_rows, tiles.block_cols, p.Hkv, threads, most)
        else:
            many = tasks >= FUSED_BACKWARD_TASKS_PER_THREAD * threads
            chunks = 1 if many else min(fused_key_chunks(tasks, threads), most)
            busy = many or chunks > 1 or tasks >= threads
        if self.backward == "fused" or (self.backward == "auto" and busy and buffers <= FUSED_BACKWARD_MAX_BUFFER):
            return ("attncc_backward_fused",), chunks
        return ("attncc_backward_dkdv", "attncc_backward_dq"), 1

    def _forward_call(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        scale: float | None,
        tensors: list[torch.Tensor],
        scalars: list[float],
        page_size: int | None = None,
        lengths: Lengths | None = None,
        value_dim: int | None = None,
        memo: dict | None = None,
    ) -> tuple[CallPlan, dict[str, object]]:
        """The forward's plan and prepared call. Where many of the visible tiles are partial the
        AMX forward's wide key tiles narrow (TilePlan.for_partial_tiles); where a query tile sees
        enough keys that a kv head's K/V panels outgrow L2, a task takes more query rows
        (TilePlan.for_keys). Both count from the tile classes, so a sliding window's few visible
        tiles keep the L2-sized tasks at any M (taking 192 rows there cost 1.8x at N = 8192 on
        Zen 4). `value_dim`: v's head dim (default k's)."""
        plan = self.plan(q, k, scale, value_dim=value_dim)
        problem = plan.problem
        group = problem.H // max(problem.Hkv, 1)
        by_rows = plan.tiles.reads_by_rows(problem.N, group)  # (a packed batch's: by its longest sequence)
        dot_products = by_rows and not plan.tiles.transposes_keys(problem.N, group)
        if page_size is not None:
            plan = replace(plan, tiles=plan.tiles.for_pages(page_size, dot_products))
        else:
            plan = self._with_few_keys(plan, q.dtype)
        side_by_side = page_size is not None or k.stride(1) < k.stride(2)  # kv heads within each key row
        if dot_products and problem.Hkv > 1 and side_by_side:
            plan = replace(plan, tiles=plan.tiles.for_side_by_side_decoding())
        call = self._prepare(plan, q.dtype, tensors, scalars, lengths, memo)
        narrowed = plan.tiles.for_partial_tiles(call["partial_fraction"])  # type: ignore[arg-type]
        if narrowed is not plan.tiles:
            plan = replace(plan, tiles=narrowed)
            call = self._prepare(plan, q.dtype, tensors, scalars, lengths, memo)
        visible = call["visible_keys"]
        streamed = plan.tiles.for_keys(visible)
        if streamed is not plan.tiles:
            plan = replace(plan, tiles=streamed)
            call = self._prepare(plan, q.dtype, tensors, scalars, lengths, memo)
        call["by_rows"] = int(by_rows)  # (retiling only widens Br: the rows still fit one query tile)
        return plan, call

    def _with_few_keys(self, plan: CallPlan, dtype: torch.dtype) -> CallPlan:
        """`plan` with key tiles fitted to a key count below Bc (TilePlan.for_few_keys) on the
        CPU, whose kernels take Bc at run time, in multiples of one vector of fp32 lanes (32
        keys for AMX's bf16 products); the GPU kernels' tiles are compiled in."""
        assert self.op.tiling is not None
        micro_kernel = self.op.tiling.micro_kernel
        if micro_kernel is None:
            return plan
        amx = bf16_products(_DTYPES[dtype], micro_kernel) == BF16_PRODUCTS["amx"]
        return replace(
            plan, tiles=plan.tiles.for_few_keys(plan.problem.M, CPU_AMX_KEY_STEP if amx else CPU_FEW_KEYS_STEP)
        )

    def _prepare(
        self,
        plan: CallPlan,
        dtype: torch.dtype,
        tensors: list[torch.Tensor],
        scalars: list[float],
        lengths: Lengths | None = None,
        memo: dict | None = None,
    ) -> dict[str, object]:
        """`_prepare_call`'s result, placed on the kernel's device. The tile classes and read
        checks depend only on the sizes, scalars and tensor shapes, and on the values of the
        runtime tensors the host reads (`host_read_tensors`: a padding or document mask's, an
        index read's) and on each sequence's `lengths` where there are any: they are classified
        (and copied to a GPU) once per such key, which takes ~0.5 ms of host work off every call,
        and the runtime tensors (ALiBi slopes, bias tables) are converted per call where they
        live. Keyed by values: the host-read tensors' where they hold at most
        PREPARED_VALUES_MAX elements (else classified per call), and the lengths, the classes
        kept where they are at most PREPARED_LENGTHS_BYTES (every layer of a model on one
        padded batch's key ranges, or on one packed batch, forward and backward, classifies
        once: 0.15-1 ms of host work each); a `memo` (a PagedPlan's, whose lengths are fixed)
        holds a paged call's under this kernel's key instead. Host-read tensors given on the CPU
        to a GPU kernel (the transformers integration's key ranges) are copied to the device
        with the classes, once per key: no call reads them back from the GPU (a synchronisation
        per layer) nor copies them there."""
        names = self.tensor_names
        given, values = tensors, ()
        on_host = frozenset(
            n for n, t in zip(names, tensors) if n in self._host_reads and t.device.type != self.device_type
        )
        if self._host_reads & set(names):
            tensors = [self._on_host(t) if n in self._host_reads else t for n, t in zip(names, tensors)]
            read = [t for n, t in zip(names, tensors) if n in self._host_reads]
            if sum(t.numel() for t in read) > PREPARED_VALUES_MAX:
                return self._to_device(self._prepare_call(plan, dtype, tensors, scalars, lengths))
            values = (on_host, *(values_key(t) for t in read))
        tiles = (plan.tiles.block_rows, plan.tiles.block_cols)
        shapes = tuple(tuple(t.shape) for t in tensors)
        key: tuple = (
            plan.problem, tiles, dtype, signed_zeros((plan.scale_value,)), signed_zeros(scalars), shapes,
            self._device_index(),
        )  # fmt: skip
        calls = self._calls
        if lengths is not None and memo is not None and not values:
            calls, key = memo, (self.call_key, *key)
        elif lengths is not None or values:
            calls, key = self._calls_by_values, (*key, values)
            if lengths is not None:
                key = (*key, tuple(lengths[0].tolist()), tuple(lengths[1].tolist()))
        with self._lock:
            call = calls.get(key)
        if call is None:
            call = self._to_device(self._prepare_call(plan, dtype, tensors, scalars, lengths))
            per_call = {slot.ident for slot in self.abi.tensors if slot.name in names and slot.name not in on_host}
            call["tensors"] = {
                ident: t for ident, t in call["tensors"].items() if ident not in per_call
            }  # layout grids
            classes: torch.Tensor = call["classes"]  # type: ignore[assignment]
            if calls is not self._calls_by_values or classes.numel() <= PREPARED_LENGTHS_BYTES:
                with self._lock:  # (a plan's memo holds every kernel's entries: PLAN_MEMO_KEPT)
                    keep_bounded(calls, key, call, PLAN_MEMO_KEPT if calls is memo else PREPARED_CALLS_KEPT)
        fresh = self._kernel_tensors({n: t for n, t in zip(names, given) if n not in on_host}, acc_dtype(dtype))
        return dict(call, tensors={**call["tensors"], **fresh})

    @cached_property
    def _slot_names(self) -> SlotNames:
        """The ABI's slot names, built once rather than per call (`pack`)."""
        abi = self.abi
        return SlotNames(
            pointers=[name for name, _ in abi.pointer_slots()],
            ints=abi.int_slots(),
            operand_strides=[(name, tuple(f"st_{name}_{d}" for d in range(4))) for name, _ in OPERANDS],
            tensor_strides=[(t.ident, tuple(f"st_{t.ident}_{d}" for d in range(t.rank))) for t in abi.tensors],
            grad_slices=[(abi.ident_of(n), f"grad_slice_{abi.ident_of(n)}") for n in abi.grads],
        )

    def _on_host(self, t: torch.Tensor) -> torch.Tensor:
        """`t` where the host can read its values (CPU kernels' tensors already are)."""
        return t

    def _to_device(self, call: dict) -> dict:
        """The call's tensors on the kernel's device (CPU kernels and the emulator run on the host)."""
        return call

    def _device_index(self) -> int | None:
        return None

    def _prepare_call(
        self,
        plan: CallPlan,
        dtype: torch.dtype,
        tensors: list[torch.Tensor],
        scalars: list[float],
        lengths: Lengths | None = None,
    ) -> dict[str, object]:
        """Kernel-ready runtime tensors (converted, contiguous), layout grids and tile classes
        (with `lengths`, per sequence: tiles past a sequence's end are empty)."""
        acc = acc_dtype(dtype)
        names = [d for d in self.inputs if d.role == "tensor"]
        given = {d.name: t for d, t in zip(names, tensors)}
        scalar_map = {d.name: s for d, s in zip([d for d in self.inputs if d.role == "scalar"], scalars)}
        scalar_map["scale"] = plan.scale_value  # a mask may use it
        info = self.op.sparsity
        assert info is not None
        problem = plan.problem
        all_tensors = runtime_tensors(info, problem, given, scalar_map)
        exprs = self.op.per_score_expressions
        if problem.N and problem.M:
            check_reads_and_divisors(exprs, problem, scalar_map, all_tensors, lengths)
            classes = classify_tiles(
                info, problem, scalar_map, all_tensors, plan.tiles.block_rows, plan.tiles.block_cols, lengths
            )
        else:
            classes = torch.zeros((1, 1, 0, 0), dtype=torch.uint8, device="cpu")
        return {
            "classes": classes,
            "tensors": self._kernel_tensors(all_tensors, acc),
            "scalars": scalar_map,
            # (what `_forward_call` retiles by, counted with the classes, so once per prepared key:
            # ~30 us of a masked decoding call's host time when counted per call)
            "partial_fraction": partial_fraction(classes),
            "visible_keys": visible_keys(classes, plan.tiles.block_cols, problem.M),
        }

    def _kernel_tensors(self, tensors: Mapping[str, torch.Tensor], acc: torch.dtype) -> dict[str, torch.Tensor]:
        """The ABI slots among `tensors` (by program name) in the kernel's element types, contiguous."""
        converted = {}
        for slot in self.abi.tensors:
            t = tensors.get(slot.name)
            if t is None:
                continue
            want = acc if slot.ctype == "acc_t" else torch.int64 if slot.ctype == "int64_t" else None
            if t.dtype == want and not t.requires_grad and not t.is_neg() and t.is_contiguous():
                converted[slot.ident] = t  # (as given: each repeated decoding call converts its key ranges)
                continue
            # (a negative-bit view, x.conj().imag, keeps its sign in a flag: its stored values were read
            # unnegated until session 57)
            t = t.detach().resolve_neg()
            t = (
                t.to(want)
                if want is not None
                else t.contiguous().view(torch.uint8)  # (bool's bytes are 0 and 1: no pass over it)
                if t.dtype == torch.bool
                else (t != 0).to(torch.uint8)  # bool: any nonzero is true (256 must not wrap to 0)
            )
            converted[slot.ident] = t.contiguous()
        return converted

    def _run(
        self,
        entry: str,
        dtype: str,
        plan: CallPlan,
        call: dict[str, object],
        ptrs: dict[str, torch.Tensor],
        dropout: float,
        seed: int,
        *extra: object,
        strides: Mapping[str, tuple[int, ...]] | None = None,
    ) -> tuple:
        """Packs a call (`pack`; `extra`: arguments after the packed ones) and runs entry point
        `entry` of the library for `dtype` and the plan's head dims; the packed arrays, for a
        launch kept to repeat the call (the kernels read them, never write)."""
        lib = self._library_for(dtype, plan)
        packed = self.pack(plan, call, ptrs, dropout, seed, strides)
        self._launch(lib, self._entry(lib, entry), (*packed, *extra))
        return packed

    def _library_for(self, dtype: str, plan: CallPlan) -> ctypes.CDLL:
        """The library a call runs in: the CPU's serves every head dim."""
        del plan
        return self.library(dtype)

    def _entry(self, lib: ctypes.CDLL, entry: str) -> ctypes._CFuncPtr:
        """The library's entry point `entry`, returning a status."""
        fn = getattr(lib, entry)
        fn.restype = ctypes.c_int
        return fn

    def _launch(self, lib: ctypes.CDLL, fn: ctypes._CFuncPtr, args: tuple, device: torch.device | None = None) -> None:
        """Runs entry point `fn` of `lib` with `args` (`device`: the operands', where a GPU
        launch is made); a clear error where it fails."""
        del lib, device
        _check_status(fn(*args), fn.__name__, self.name)

    def pack(
        self,
        plan: CallPlan,
        call: dict[str, object],
        ptrs: dict[str, torch.Tensor],
        dropout: float,
        seed: int,
        strides: Mapping[str, tuple[int, ...]] | None = None,
    ) -> tuple:
        """The (pointers, ints, reals) arrays of the kernel ABI for one call; `strides` replaces
        operands' own (a paged cache's).

        The caller keeps `call` and `ptrs` alive until the kernel returns.
        """
        classes: torch.Tensor = call["classes"]  # type: ignore[assignment]
        tensors: dict[str, torch.Tensor] = call["tensors"]  # type: ignore[assignment]
        all_ptrs = dict(ptrs, classes=classes, **tensors)
        names = self._slot_names
        pointer_values = [all_ptrs[name].data_ptr() if name in all_ptrs else None for name in names.pointers]
        p = plan.problem
        ints: dict[str, int] = {"B": p.B, "H": p.H, "Hkv": p.Hkv, "N": p.N, "M": p.M, "D": p.D, "Dv": p.Dv}
        for name, stride_names in names.operand_strides:
            operand = ptrs.get(name)
            given = (strides or {}).get(name) or (operand.stride() if operand is not None else (0, 0, 0, 0))
            ints.update(zip(stride_names, given))
        pages = ptrs.get("pages")
        ints.update(page_size=call.get("page_size", 0), st_pages_0=pages.stride(0) if pages is not None else 0)
        ints.update(dict.fromkeys(ROPE_CONTROL, 0), **call.get("rope", {}))  # type: ignore[arg-type]
        cls_strides = [classes.stride(d) if classes.shape[d] > 1 else 0 for d in range(3)]
        ints.update(
            Br=plan.tiles.block_rows,
            Bc=plan.tiles.block_cols,
            cls_sb=cls_strides[0],
            cls_sh=cls_strides[1],
            cls_si=cls_strides[2],
        )
        threads = call.get("threads", max(1, torch.get_num_threads()))
        ints.update(seed=seed & (2**63 - 1), offset=call.get("offset", 0), threads=threads, splits=plan.kv_splits)
        ints.update(appended_rows=ptrs["append_rows"].numel() if "append_rows" in ptrs else 0)
        ints.update(by_rows=call.get("by_rows", 0), key_tiles_per_sweep=call.get("key_tiles_per_sweep", 1))
        ints.update(key_chunks=call.get("key_chunks", 1))
        for ident, stride_names in names.tensor_strides:
            ints.update(zip(stride_names, tensors[ident].stride()))
        grad_slices: dict[str, int] = call.get("grad_slices", {})  # type: ignore[assignment]
        ints.update((name, grad_slices.get(ident, 0)) for ident, name in names.grad_slices)
        reals = [plan.scale, dropout, plan.scale_value]
        reals += [float(call["scalars"][name]) for name, _, _ in self.abi.scalars]  # type: ignore[index]
        int_values = [ints[name] for name in names.ints]
        return (
            (ctypes.c_void_p * len(pointer_values))(*pointer_values),
            (ctypes.c_int64 * len(int_values))(*int_values),
            (ctypes.c_double * len(reals))(*reals),
        )


def _check_status(status: int, entry: str, kernel: str) -> None:
    if status == AMX_REFUSED:
        raise AttnccError(
            f"attncc kernel {entry} of {kernel}: Linux refused this process the AMX tile state "
            f"(arch_prctl ARCH_REQ_XCOMP_PERM); set {ISA_ENV}={targets.best_cpu_isa_without_amx(targets.cpu_features())} "
            "to run without AMX"
        )
    if status == OUT_OF_MEMORY:
        raise MemoryError(f"attncc kernel {entry} of {kernel}: a buffer could not be allocated")
    if status != 0:
        raise RuntimeError(f"attncc kernel {entry} of {kernel} failed with status {status}")


#: The forward's operands whose addresses change from call to call (`KeptLaunch`).
CALL_OPERANDS = ("q", "k", "v", "out", "lse", "o_partial", "lse_partial", "k_new", "v_new")
#: The backward's (`BackwardLaunch`; delta: the rows' rowsum(dO * O), its first pass's result).
BACKWARD_OPERANDS = ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "delta", "lse_residual")


def signed_zeros(values: Sequence[object]) -> tuple:
    """`values` as a cache key that tells -0.0 from 0.0 (equal, and equal hashes, as floats; a
    program's `1.0 / sf` tells them apart: a call with sf = -0.0 after one with 0.0 reused its
    tile classes and launch)."""
    return tuple((x, math.copysign(1.0, x)) if type(x) is float and x == 0.0 else x for x in values)


def operand_layout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor
) -> tuple[object, ...]:
    """What a kept backward launch's packed sizes and strides assume of its operands."""
    return q.dtype, q.stride(), k.stride(), v.stride(), out.stride(), dout.stride()


@dataclass(frozen=True)
class BackwardLaunch:
    """A CPU backward's packed launch: the delta pass, then `passes` (fused, or dK/dV and dQ),
    all on one set of arrays. Kept by the forward's `KeptLaunch` (`Kernel.backward_impl`), it
    repeats the backward of calls repeating that forward without the plan, the prepared call
    and the packing. A grad-recording fp32 call and its backward at B=1 H=8 N=16 d=64 (2 Zen 5
    cores, kernels ~21 us of it) took ~150 us, ~81 with this and lse's unused gradient left None
    (SDPA's: ~55; an autograd.Function doing nothing but allocate: ~32)."""

    library: ctypes.CDLL
    delta_entry: ctypes._CFuncPtr
    passes: tuple[ctypes._CFuncPtr, ...]
    pointers: ctypes.Array  # the ABI's pointer slots, the operands' for the call that packed them
    operand_slots: dict[str, int]  # where each of BACKWARD_OPERANDS goes in `pointers`
    ints: ctypes.Array
    reals: ctypes.Array
    settings: tuple[int, str]  # the threads and the kernel's `backward` setting that chose `passes`
    # q's dtype and the strides of q, k, v, out and dout packed into `ints` (`operand_layout`):
    # the tensors autograd saved may come back in another layout (saved-tensor hooks that offload)
    layout: tuple[object, ...]
    kept: object  # what `pointers` points into besides the operands (the prepared call)

    def run(self, kernel: Kernel, operands: Mapping[str, torch.Tensor], dlse: torch.Tensor | None) -> None:
        """The passes on `operands` (by BACKWARD_OPERANDS' names; a loss on lse, `dlse`, turns
        delta into delta - dlse between the delta pass and the others, as delta_rows does)."""
        pointers = type(self.pointers).from_buffer_copy(self.pointers)
        for name, slot in self.operand_slots.items():  # (no lse_residual: a ring step's, null)
            pointers[slot] = operands[name].data_ptr() if name in operands else None
        args = (pointers, self.ints, self.reals)
        kernel._launch(self.library, self.delta_entry, args)
        if dlse is not None:
            delta = operands["delta"]
            delta.sub_(dlse.to(delta.dtype))
        for entry in self.passes:
            kernel._launch(self.library, entry, args)


@dataclass(eq=False)
class KeptLaunch:
    """A forward's packed launch, kept for calls that repeat what decided it: a checked call's
    sizes, strides, dtypes, scalars and thread count (`Kernel._repeat_key`), and on the GPU path
    also the split count and a paged call's plan (`EmulatedKernel.launch_key`). Such a call
    allocates out and lse (and the splits' partials), puts their addresses and the operands'
    into a copy of `pointers` and launches; the plan, the prepared call's lookups, the checks
    and the packing are not redone. The full path costs ~100 us of Python per CPU call once the
    kernel has evicted the interpreter's data from cache (bf16 B=1 H=8 N=512 D=64, ~15% of the
    call); decoding pays it once per layer and token (bench/bench_host.py)."""

    kernel: Kernel  # the kernel (or its folded variant) that launched it
    library: ctypes.CDLL
    entry: ctypes._CFuncPtr  # attncc_forward (attncc_emulated_forward on the emulator)
    pointers: list[int | None]  # the ABI's pointer slots (tile classes, layout grids, ...)
    operand_slots: dict[str, int]  # where each of CALL_OPERANDS the call has goes in `pointers`
    ints: ctypes.Array
    reals: ctypes.Array
    out_shape: tuple[int, ...]  # out and lse as the forward returns them
    lse_shape: tuple[int, ...]
    lse_dtype: torch.dtype
    partial_shapes: tuple[tuple[int, ...], tuple[int, ...]] | None  # o_partial, lse_partial (split-KV)
    kept: object  # what `pointers` points into (the prepared call, a paged plan's keys)
    backward_launch: BackwardLaunch | None = None  # the first backward of a call repeating this launch kept it
    packed: PackedSequences | None = None  # a planned packed call's sequences (its plan's: alive as long)
    # where each runtime tensor's converted copy goes in `pointers`, by ABI ident (`_tensors_signature`)
    tensor_slots: dict[str, int] = field(default_factory=dict)

    @property
    def repeats_backward(self) -> bool:
        """Whether the backward of calls repeating this launch can repeat a kept launch too:
        the CPU kernels' (`BackwardLaunch`)."""
        return type(self.kernel).backward_impl is Kernel.backward_impl

    def backward(self, key: str, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """`_attention_backward` (the same arguments) for a call that repeated this launch (so no
        runtime tensors, no dropout): the kept backward launch where the operands' strides and
        the settings that chose its passes are those it was packed for, else the full path,
        which keeps one."""
        # (a sink after them, from `_backward`: None, the calls kept launches repeat have none)
        q, k, v, out, lse, dout, dlse, tensors, scalars, scale, dropout, seed, grad_inputs, *_ = args
        dout = dout.contiguous()
        launch = self.backward_launch
        if (
            launch is None
            or launch.layout != operand_layout(q, k, v, out, dout)
            or launch.settings != (max(1, torch.get_num_threads()), self.kernel.backward)
        ):
            return registered(key).backward_impl(
                q, k, v, out, lse, dout, dlse, tensors, scalars, scale, dropout, int(seed.item()), grad_inputs,
                packed=self.packed, kept_by=self,
            )  # fmt: skip
        lse = lse.contiguous()  # (as backward_impl packs it)
        # (empty_like: ~0.8 us each, where torch.empty of a torch.Size took ~1.6)
        dq, dk, dv, delta, residual = (
            torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v, lse, lse)
        )
        operands = {
            "q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "dq": dq, "dk": dk, "dv": dv, "delta": delta,
            "lse_residual": residual,
        }  # fmt: skip
        launch.run(self.kernel, operands, dlse)
        return dq, dk, dv, []

    @cached_property
    def _pointer_template(self) -> ctypes.Array:
        """`pointers` as the ABI's array, copied for each call (0.2 us; building it from the
        list took 2 us)."""
        return (ctypes.c_void_p * len(self.pointers))(*self.pointers)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None, runtime: Mapping[str, object] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """out and lse of the launch with these operands; a launch kept from a call whose library
        appended keys (`Kernel.appends_in_library`) takes each call's k_new and v_new
        [B, appended, Hkv, D] contiguous (never the kept call's: they would be written again);
        one kept with runtime tensors (`tensor_slots`), each call's from `runtime`, converted as
        the full path converts them."""
        # (sizes unpacked: torch.empty of a tuple took ~0.4 us more per allocation)
        out = torch.empty(*self.out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(*self.lse_shape, dtype=self.lse_dtype, device=q.device)
        template, slots = self._pointer_template, self.operand_slots
        pointers = type(template).from_buffer_copy(template)
        pointers[slots["q"]] = q.data_ptr()
        pointers[slots["k"]] = k.data_ptr()
        pointers[slots["v"]] = v.data_ptr()
        pointers[slots["out"]] = out.data_ptr()
        pointers[slots["lse"]] = lse.data_ptr()
        if "k_new" in slots:
            pointers[slots["k_new"]] = k_new.data_ptr()  # type: ignore[union-attr]
            pointers[slots["v_new"]] = v_new.data_ptr()  # type: ignore[union-attr]
        if self.partial_shapes is not None:  # (alive until the launch returns)
            partials = [torch.empty(*shape, dtype=torch.float32, device=q.device) for shape in self.partial_shapes]
            pointers[slots["o_partial"]] = partials[0].data_ptr()
            pointers[slots["lse_partial"]] = partials[1].data_ptr()
        if self.tensor_slots:  # (alive until the launch returns; lse's dtype is the accumulator's)
            converted = self.kernel._kernel_tensors(runtime or {}, self.lse_dtype)
            for ident, slot in self.tensor_slots.items():
                pointers[slot] = converted[ident].data_ptr()
        self.kernel._launch(self.library, self.entry, (pointers, self.ints, self.reals), q.device)
        return out, lse


def without_call_tensors(call: dict[str, object], slots: Mapping[str, int]) -> dict[str, object]:
    """A prepared call as a kept launch keeps it: without the runtime tensors it takes per call
    (`slots`, by ABI ident), so that it holds no call's tensors alive (a bias table dropped by
    its caller stayed in memory as long as the launch)."""
    tensors: dict[str, torch.Tensor] = call["tensors"]  # type: ignore[assignment]
    return dict(call, tensors={ident: t for ident, t in tensors.items() if ident not in slots})


def checked_seed(seed: object) -> int:
    """A call's `seed=`, an int in [0, 2^63)."""
    seed = python_number(seed)
    if isinstance(seed, bool) or not isinstance(seed, (int, torch.SymInt)) or not 0 <= seed < 2**63:
        raise InputError(f"seed: expected an int in [0, 2^63), got {seed!r}")
    return seed  # type: ignore[return-value]


def checked_train(train: object) -> bool:
    """A call's `train=`: a bool (`train="no"` would be truthy: dropout on, silently)."""
    return checked_flag("train", train)


def checked_flag(argument: str, value: object) -> bool:
    """A call's bool option (a numpy bool too): `return_lse="no"` returned the lse."""
    if value is True or value is False:
        return value
    value = python_number(value)
    if not isinstance(value, bool):
        raise InputError(f"{argument}: expected True or False, got {value!r}")
    return value


#: The seed a repeated call (never with dropout) saves for its backward: one tensor for all of
#: them, read and never written (a fresh one took ~1 us of a 10-20 us small call). A normal
#: tensor wherever attncc is first imported (under torch.inference_mode, an inference tensor,
#: which autograd refused to save for backward in every later training call's repeat).
with torch.inference_mode(False):
    NO_DROPOUT_SEED = torch.zeros(1, dtype=torch.int64, device="cpu")


def seed_tensor(seed: int | None, dropout: float) -> torch.Tensor:
    """A call's dropout seed as a one-element int64 tensor: drawn from torch's generator (where
    not given) it stays a tensor under torch.compile, with no data-dependent .item() while tracing.
    On the CPU whatever torch's default device (`with torch.device("meta")` made it a meta tensor,
    and the op on CPU operands then ran its fake implementation: uninitialised outputs)."""
    if seed is None:
        return (
            torch.randint(0, 2**62, (1,), device="cpu")
            if dropout > 0
            else torch.zeros(1, dtype=torch.int64, device="cpu")
        )
    return torch.tensor([checked_seed(seed)], dtype=torch.int64, device="cpu")


def traced_tensor_number(name: str) -> InputError:
    """A tensor given for a number while torch.compile traces the call: its value would reach
    the kernel only through a graph break (and failed deep inside the op's schema check)."""
    return InputError(
        f"{name}: a tensor under torch.compile; pass a Python number (a compiled graph recompiles for each "
        "new value, dynamic=True or not: declare a value that changes every step as a tensor, `int[1]`)"
    )


def drop_in_scale(scale: object, argument: str, drop_in: str) -> object:
    """A drop-in's scale argument checked as its API takes it (`checked_scale`), or as given
    while torch.compile traces (a symbolic float: the kernel's call takes it as it is)."""
    return scale if torch.compiler.is_compiling() else checked_scale(scale, argument, drop_in)


def checked_scale(scale: object, argument: str = "scale", drop_in: str | None = None) -> float | None:
    """A call's `scale=`: None (the program's default) or a finite number (a one-element tensor's
    value, where no gradient is asked of it: the kernels take the scale as a number). A drop-in
    (`drop_in`, the API it stands for) names its own `argument`; a tensor requiring grad there is
    an error without the DSL's advice (its callers write no program)."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor) and scale.requires_grad and torch.is_grad_enabled():
        if drop_in:
            raise InputError(
                f"{argument}: this tensor requires grad, but {drop_in} takes {argument} as a number, which gets "
                "no gradient; pass a float or a detached tensor"
            )
        raise InputError(
            "scale: this tensor requires grad, but a call's scale gets no gradient; pass it detached, or "
            "declare `input temperature: float[1]` and write `s = q @ k.T * scale * temperature[0]` to learn it"
        )
    scale = python_number(scale)
    real = isinstance(scale, float | int) and not isinstance(scale, bool)
    if isinstance(scale, torch.Tensor):
        real = scale.numel() == 1 and scale.dtype != torch.bool and not scale.is_complex()
    if not real:
        shown = (
            f"a {scale.dtype} tensor of shape {tuple(scale.shape)}" if isinstance(scale, torch.Tensor) else repr(scale)
        )
        raise InputError(f"{argument}: expected a real number (or a one-element tensor of one), got {shown}")
    try:
        value = float(scale)  # type: ignore[arg-type]
    except OverflowError:  # (an int beyond float's range, 10**400)
        value = math.inf
    if not math.isfinite(value):
        # (an int's repr beyond 4300 digits raises ValueError: 10**5000)
        huge = isinstance(scale, int) and scale.bit_length() > 1024
        shown = "an int beyond float's range" if huge else repr(scale)
        shown = shown if len(shown) <= 40 else f"{shown[:40]}..."
        raise InputError(f"{argument}: expected a finite number, got {shown}")
    return value


def _sizes(q: torch.Tensor, k: torch.Tensor) -> dict[str, int]:
    B, H, N, D = q.shape
    return {"B": B, "H": H, "Hkv": k.shape[1], "N": N, "M": k.shape[2], "D": D}


def _problem(q: torch.Tensor, k: torch.Tensor, value_dim: int | None = None) -> Problem:
    """The call's sizes; v's head dim `value_dim` (default: k's)."""
    return Problem(**_sizes(q, k), Dv=k.shape[3] if value_dim is None else value_dim)


def plan_head_dim(problem: Problem) -> int:
    """The head dim whose tiles a call takes: the larger of q/k's and v's, whose tiles fit the
    on-chip memory for both."""
    return max(problem.D, problem.Dv)


def _declared(decl: Input) -> str:
    return f"{decl.dtype}[{', '.join(map(str, decl.dims))}]" if decl.role == "tensor" else decl.dtype


def _names(inputs: list[Input]) -> str:
    return ", ".join(f"{d.name}: {_declared(d)}" for d in inputs) or "no runtime inputs"


# ---------------------------------------------------------------------- custom ops
@torch.library.custom_op("attncc::attention", mutates_args=())
def attention_op(
    key: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensors: list[torch.Tensor],
    scalars: list[float],
    scale: float | None,
    dropout: float,
    seed: torch.Tensor,
    sink: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kern = registered(key)
    repeat_key, runtime = None, dict(zip(kern.tensor_names, tensors))
    if dropout == 0 and sink is None and k_descale is None and v_descale is None:
        repeat_key = kern.op_repeat_key(q, k, v, scalars, scale)
        if repeat_key is not None and tensors:  # (a compiled model's key ranges: new tensors every call)
            launch_tensors = kern.tensors_launch_key(runtime)
            repeat_key = None if launch_tensors is None else (*repeat_key, launch_tensors)
        launch = kern._repeats.get(repeat_key) if repeat_key is not None else None
        if launch is not None:
            return launch(q, k, v, runtime=runtime)
    descale = by_name(k_descale, v_descale)
    out, lse = kern.forward_impl(
        q, k, v, tensors, scalars, scale, dropout, int(seed.item()), sink=sink, descale=descale
    )
    if repeat_key is not None and out.numel():
        kern._remember_repeat(repeat_key, q, k, v, out, lse, scalars, scale, tensors=tensors)
    return out, lse


@attention_op.register_fake
def _attention_fake(
    key: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensors: list[torch.Tensor],
    scalars: list[float],
    scale: float | None,
    dropout: float,
    seed: torch.Tensor,
    sink: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


def _attention_backward(
    key: str,
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
    seed: torch.Tensor,
    grad_inputs: list[bool],
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The backward op's implementation, also called directly (`_EagerAttention`): the kept
    backward launch of the forward's kept launch where there is one (`op_repeat_key`), else the
    full path. `sink`: the forward's sink logits, if any."""
    kern = registered(key)
    if not tensors and dropout == 0 and sink is None:
        repeat_key = kern.op_repeat_key(q, k, v, scalars, scale)
        launch = kern._repeats.get(repeat_key) if repeat_key is not None else None
        if launch is not None and launch.repeats_backward:
            args = (q, k, v, out, lse, dout, dlse, tensors, scalars, scale, dropout, seed, grad_inputs)
            return launch.backward(key, *args)
    return kern.backward_impl(
        q, k, v, out, lse, dout.contiguous(), dlse, tensors, scalars, scale, dropout, int(seed.item()), grad_inputs,
        sink=sink,
    )  # fmt: skip


# (the op runs the function itself, which _EagerAttention also calls without the dispatch)
attention_backward_op = torch.library.custom_op("attncc::attention_backward", mutates_args=())(_attention_backward)


@attention_backward_op.register_fake
def _attention_backward_fake(
    key: str,
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
    seed: torch.Tensor,
    grad_inputs: list[bool],
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    return _empty_gradients(q, k, v, tensors, grad_inputs, lse if sink is not None else None)


def _empty_gradients(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tensors: list[torch.Tensor],
    grad_inputs: list[bool],
    residual_like: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A backward op's outputs as the fake implementations give them: dq, dk, dv and each
    runtime tensor's gradient (empty where not wanted), then for a call with a sink the rows'
    lse residuals (`residual_like`: lse)."""
    grads = [t.new_empty(t.shape) if wanted else t.new_empty(0) for t, wanted in zip(tensors, grad_inputs)]
    if residual_like is not None:
        grads.append(residual_like.new_empty(residual_like.shape))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), grads


def _input_gradients(
    ctx,  # noqa: ANN001 - autograd ctx
    grads: list[torch.Tensor],
    sink: torch.Tensor | None,
    sink_position: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
) -> tuple[list[torch.Tensor | None], list | None, torch.Tensor | None]:
    """What a forward op's backward returns for its runtime tensors, its scalars and its sink
    (input `sink_position` of the op): the wanted tensor gradients, None for a non-empty scalar
    list (torch takes it as one leaf with no gradient) or [] for an empty one, and dsink (`grads`
    ends with the rows' lse residuals where the call has a sink: `Kernel.backward_impl`)."""
    tensor_grads = [g if wanted else None for g, wanted in zip(grads, ctx.grad_inputs)]
    dsink = None
    if sink is not None and ctx.needs_input_grad[sink_position]:
        residual = grads[len(ctx.grad_inputs)]
        dsink = sink_gradient(sink, lse, delta_rows(out, dout, dlse, lse.dtype), residual.to(lse.dtype))
    return tensor_grads, None if ctx.scalars else [], dsink


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001 - autograd ctx
    key, q, k, v, tensors, scalars, scale, dropout, seed, sink, _, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seed, sink, *tensors)
    ctx.key, ctx.scalars, ctx.scale, ctx.dropout = key, scalars, scale, dropout
    ctx.grad_inputs = [t.requires_grad and t.is_floating_point() for t in tensors]
    ctx.kernel = registered(key)  # alive until the backward ran


def _backward(ctx, dout: torch.Tensor, dlse: torch.Tensor, backward: Callable[..., tuple] | None = None) -> tuple:  # noqa: ANN001 - autograd ctx
    """The op's registered backward; `backward`: what runs the kernels (default: the backward op,
    which torch.compile traces and whose derivative raises the double-backward error)."""
    _reject_batched_gradients(dout, dlse)
    q, k, v, out, lse, seed, sink, *tensors = ctx.saved_tensors
    dq, dk, dv, grads = (backward or torch.ops.attncc.attention_backward)(
        ctx.key,
        q,
        k,
        v,
        out,
        lse,
        dout,
        dlse,
        tensors,
        ctx.scalars,
        ctx.scale,
        ctx.dropout,
        seed,
        ctx.grad_inputs,
        sink,
    )
    tensor_grads, scalar_grads, dsink = _input_gradients(ctx, grads, sink, 9, out, lse, dout, dlse)
    return None, dq, dk, dv, tensor_grads, scalar_grads, None, None, None, dsink, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The attention op with its registered autograd (`_setup_context`, `_backward`: the same
    forward_impl, saved tensors and backward) for eager calls that record a graph
    (`_eager_autograd`), without torch.library's dispatch; the forward a kept launch where the
    call repeats one (`launch`, `Kernel._repeat_key`). Host time of a grad-recording forward
    at B=1 H=8 N=16 d=64 fp32: 0.27 ms through the op, 0.16 ms here by the full path."""

    @staticmethod
    def forward(ctx, key, launch, q, k, v, scalars, scale, dropout, seed, *tensors: torch.Tensor):  # noqa: ANN001, ANN205 - Function
        if launch is not None:
            out, lse = launch(q, k, v)
        else:
            out, lse = registered(key).forward_impl(q, k, v, list(tensors), scalars, scale, dropout, int(seed.item()))
        _setup_context(ctx, (key, q, k, v, list(tensors), scalars, scale, dropout, seed, None, None, None), (out, lse))
        ctx.launch = launch
        ctx.set_materialize_grads(False)  # an unused lse's gradient stays None: no zeros to subtract from delta
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:  # noqa: ANN001 - autograd ctx
        if dout is None:  # only lse took part in the loss
            dout = torch.zeros_like(ctx.saved_tensors[3])
        # create_graph: through the backward op, whose derivative raises the clear error; a
        # repeated forward's backward repeats a kept launch where the kernel keeps one
        direct = None if torch.is_grad_enabled() else _attention_backward
        if direct is not None and ctx.launch is not None and ctx.launch.repeats_backward:
            direct = ctx.launch.backward
        _, dq, dk, dv, tensor_grads, *_ = _backward(ctx, dout, dlse, direct)
        return None, None, dq, dk, dv, None, None, None, None, *tensor_grads


def _records_graph(*tensors: torch.Tensor, grad_enabled: Callable[[], bool] = torch.is_grad_enabled) -> bool:
    """Whether a call with these tensors records an autograd graph (a kept launch repeats only
    calls without runtime tensors, so there q, k and v decide)."""
    if grad_enabled():
        for t in tensors:  # (loops: a generator is one more object to allocate)
            if t.requires_grad:
                return True
    return False


def _eager_autograd(*tensors: torch.Tensor) -> bool:
    """Whether a call that records an autograd graph may run `_EagerAttention` rather than the
    op: `_plain_uncompiled`, `_untransformed` and `_unwatched` (the others see the op)."""
    return _plain_uncompiled(*tensors) and _untransformed(*tensors) and _unwatched()


def _varlen_call(
    key: str,
    q: torch.Tensor,
    k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    tensors: list[torch.Tensor],
    scalars: list[float],
    scale: float | None,
    dropout: float,
    seed: torch.Tensor,
) -> tuple[Kernel, VarlenPlan, CallOptions]:
    """The kernel, the plan of the offsets (read and checked, or the kernel's plan of the same
    values: `ragged.offsets_plan`) and the shared options of a varlen op's call (forward or
    backward). The runtime inputs are the caller's to check (`_varlen_sequences`)."""
    kern = registered(key)
    with kern._lock:
        plan = offsets_plan(kern._varlen_plans, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return kern, plan, CallOptions(scalars, scale, dropout, int(seed.item()))


def _varlen_repeat(
    kern: Kernel, plan: VarlenPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scalars: list[float],
    scale: float | None,
) -> tuple[tuple | None, KeptLaunch | None]:  # fmt: skip
    """A varlen op's repeat key (`Kernel.op_repeat_key`; the caller has checked that the call
    has no runtime tensor, dropout, sink or fp8 factors) and the launch kept under it in the plan."""
    repeat_key = kern.op_repeat_key(q, k, v, scalars, scale)
    return repeat_key, None if repeat_key is None else plan.packed.prepared.get((kern.call_key, repeat_key))  # type: ignore[union-attr]


def _varlen_sequences(
    kern: Kernel, plan: VarlenPlan, q: torch.Tensor, k: torch.Tensor, tensors: list, scalars: list
) -> PackedSequences:
    """The plan's sequences for a varlen op's full path, the runtime inputs checked at the batch's padded sizes."""
    return planned_sequences(kern, plan, q, k, kern.runtime_values(tensors, scalars))


# The packed (varlen) call as one op: its offsets are read on the host inside, so torch.compile
# traces a varlen call whole (fullgraph) and the offsets' checks run when the graph does.
@torch.library.custom_op("attncc::varlen_attention", mutates_args=())
def varlen_op(
    key: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    tensors: list[torch.Tensor],
    scalars: list[float],
    scale: float | None,
    dropout: float,
    seed: torch.Tensor,
    sink: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    kern, plan, options = _varlen_call(
        key, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tensors, scalars, scale, dropout, seed
    )
    repeat_key = None
    if not tensors and dropout == 0 and sink is None and k_descale is None and v_descale is None:
        repeat_key, launch = _varlen_repeat(kern, plan, q, k, v, scalars, scale)
        if launch is not None:
            return launch(q, k, v)
    packed = _varlen_sequences(kern, plan, q, k, tensors, scalars)
    out, lse = varlen_forward(kern, packed, options, q, k, v, sink, tensors, by_name(k_descale, v_descale))
    if repeat_key is not None and out.numel():
        kern._remember_repeat(repeat_key, q, k, v, out, lse, scalars, scale, packed)
    return out, lse


@varlen_op.register_fake
def _varlen_fake(
    key: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    tensors: list[torch.Tensor],
    scalars: list[float],
    scale: float | None,
    dropout: float,
    seed: torch.Tensor,
    sink: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return q.new_empty((*q.shape[:2], v.shape[2])), q.new_empty(q.shape[:2], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("attncc::varlen_attention_backward", mutates_args=())
def varlen_backward_op(
    key: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    tensors: list[torch.Tensor],
    scalars: list[float],
    scale: float | None,
    dropout: float,
    seed: torch.Tensor,
    grad_inputs: list[bool],
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    kern, plan, options = _varlen_call(
        key, q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, tensors, scalars, scale, dropout, seed
    )
    if not tensors and dropout == 0 and sink is None:  # (the forward's kept launch, where it kept one: no fp8)
        _, launch = _varlen_repeat(kern, plan, q, k, v, scalars, scale)
        if launch is not None and launch.repeats_backward:
            args = (q, k, v, out, lse, dout, dlse, tensors, scalars, scale, dropout, seed, grad_inputs)
            return launch.backward(key, *args)
    packed = _varlen_sequences(kern, plan, q, k, tensors, scalars)
    return varlen_backward(kern, packed, options, (q, k, v, out, lse), dout, dlse, tensors, grad_inputs, sink)


@varlen_backward_op.register_fake
def _varlen_backward_fake(
    key: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    tensors: list[torch.Tensor],
    scalars: list[float],
    scale: float | None,
    dropout: float,
    seed: torch.Tensor,
    grad_inputs: list[bool],
    sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    return _empty_gradients(q, k, v, tensors, grad_inputs, lse if sink is not None else None)


def _setup_varlen_context(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001 - autograd ctx
    key, q, k, v, cu_q, cu_k, max_q, max_k, tensors, scalars, scale, dropout, seed, sink, _, _ = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, sink, *tensors)
    ctx.key, ctx.lengths, ctx.scalars, ctx.scale, ctx.dropout = key, (max_q, max_k), scalars, scale, dropout
    ctx.grad_inputs = [t.requires_grad and t.is_floating_point() for t in tensors]
    ctx.kernel = registered(key)  # alive until the backward ran


def _varlen_backward(ctx, dout: torch.Tensor, dlse: torch.Tensor) -> tuple:  # noqa: ANN001 - autograd ctx
    q, k, v, out, lse, cu_q, cu_k, seed, sink, *tensors = ctx.saved_tensors
    dq, dk, dv, grads = torch.ops.attncc.varlen_attention_backward(
        ctx.key, q, k, v, out, lse, dout, dlse, cu_q, cu_k, *ctx.lengths,
        tensors, ctx.scalars, ctx.scale, ctx.dropout, seed, ctx.grad_inputs, sink,
    )  # fmt: skip
    tensor_grads, scalar_grads, dsink = _input_gradients(ctx, grads, sink, 13, out, lse, dout, dlse)
    return None, dq, dk, dv, None, None, None, None, tensor_grads, scalar_grads, None, None, None, dsink, None, None


varlen_op.register_autograd(_varlen_backward, setup_context=_setup_varlen_context)


class _EagerVarlen(torch.autograd.Function):
    """The varlen op with its registered autograd (`_setup_varlen_context`; the same forward,
    saved tensors and backward) for eager calls that record a graph (`_eager_autograd`), without
    torch.library's dispatch and with the sequences `varlen_attention` checked: the offsets are
    read on the host once per call and step, not again inside the op and its backward op (on a
    GPU each read waits for the device)."""

    @staticmethod
    def forward(  # noqa: ANN205 - Function
        ctx,  # noqa: ANN001 - autograd ctx
        key: str,
        packed: PackedSequences,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        max_q: int | None,
        max_k: int | None,
        scalars: list[float],
        scale: float | None,
        dropout: float,
        seed: torch.Tensor,
        launch: KeptLaunch | None,
        *tensors: torch.Tensor,
    ):
        options = CallOptions(scalars, scale, dropout, int(seed.item()))
        if launch is not None:
            out, lse = launch(q, k, v)
        else:
            out, lse = varlen_forward(registered(key), packed, options, q, k, v, None, list(tensors))
        inputs = (
            key, q, k, v, cu_q, cu_k, max_q, max_k, list(tensors), scalars, scale, dropout, seed, None, None, None,
        )  # fmt: skip
        _setup_varlen_context(ctx, inputs, (out, lse))  # (the op's inputs: no sink, no fp8 factors)
        ctx.packed, ctx.options, ctx.launch = packed, options, launch
        ctx.set_materialize_grads(False)  # an unused lse's gradient stays None: no zeros to subtract from delta
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:  # noqa: ANN001 - autograd ctx
        _reject_batched_gradients(dout, dlse)
        if dout is None:  # only lse took part in the loss
            dout = torch.zeros_like(ctx.saved_tensors[3])
        if torch.is_grad_enabled():  # create_graph: through the backward op, whose derivative raises the clear error
            if dlse is None:
                dlse = torch.zeros_like(ctx.saved_tensors[4])
            _, dq, dk, dv, _, _, _, _, tensor_grads, *_ = _varlen_backward(ctx, dout, dlse)
        else:
            q, k, v, out, lse, _, _, seed, _, *tensors = ctx.saved_tensors  # (offsets, sink: as checked)
            if ctx.launch is not None and ctx.launch.repeats_backward:  # (a repeated call's: no tensors)
                dq, dk, dv, grads = ctx.launch.backward(
                    ctx.key, q, k, v, out, lse, dout, dlse, tensors, ctx.scalars, ctx.scale, ctx.dropout, seed,
                    ctx.grad_inputs,
                )  # fmt: skip
            else:
                dq, dk, dv, grads = varlen_backward(
                    ctx.kernel, ctx.packed, ctx.options, (q, k, v, out, lse), dout, dlse, tensors, ctx.grad_inputs
                )
            tensor_grads = [g if wanted else None for g, wanted in zip(grads, ctx.grad_inputs)]
        return None, None, dq, dk, dv, *(None,) * 9, *tensor_grads


# The paged call as one op (forward only), for the same reason; it writes k_new and v_new into
# the cache before attending.
@torch.library.custom_op("attncc::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_op(
    key: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    tensors: list[torch.Tensor],
    scalars: list[float],
    scale: float | None,
    sink: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    plan_key: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = CallOptions(scalars, scale, 0.0, 0)
    descale = by_name(k_descale, v_descale)
    return paged_forward(
        registered(key), q, k_cache, v_cache, block_table, cache_seqlens, k_new, v_new, options, tensors, sink, descale,
        planned(plan_key),
    )  # fmt: skip


@paged_op.register_fake
def _paged_fake(
    key: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    tensors: list[torch.Tensor],
    scalars: list[float],
    scale: float | None,
    sink: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
    plan_key: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    out_shape = (*q.shape[:3], v_cache.shape[3])  # (q's layout, bnhd or bhnd: the head dim last)
    return q.new_empty(out_shape), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


def no_double_backward(ctx, *grads: torch.Tensor) -> tuple:  # noqa: ANN001 - autograd ctx
    raise RuntimeError(
        "attncc kernels are differentiable once: the backward kernel has no derivative "
        "(double backward, gradgradcheck and Hessian products are not supported)"
    )


attention_backward_op.register_autograd(no_double_backward, setup_context=lambda ctx, inputs, output: None)
varlen_backward_op.register_autograd(no_double_backward, setup_context=lambda ctx, inputs, output: None)


def delta_rows(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """D = rowsum(dO * O) (Algorithm 4), less the gradient of the log-sum-exp: d lse / d S = P,
    so a loss on lse adds dlse * P to dS = P * (dP - D), which is D - dlse in place of D."""
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
    if dlse is not None:
        delta = delta - dlse.to(dtype)
    return delta.contiguous()


_is_compiling = torch.compiler.is_compiling


def _plain_call(*tensors: torch.Tensor) -> bool:
    """Whether a call may run the op's implementation without its dispatch (~30 us of host time
    per call): no autograd graph to record, no tracing (torch.compile, torch.jit.trace),
    profiling, mode or tensor subclass that must see the op."""
    return _plain_uncompiled(*tensors) and _unobserved(*tensors)


def _plain_uncompiled(*tensors: torch.Tensor) -> bool:
    """Tensors of torch.Tensor's own type (no subclass) with values (meta tensors, shapes alone
    from a model on the meta device or a shape or FLOP count, take the ops, whose fake
    implementations give every output's shape), outside torch.compile's tracing."""
    for t in tensors:
        if type(t) is not torch.Tensor or t.is_meta:
            return False
    return not _is_compiling()


# torch's checks below are bound once, as keyword defaults: a kept launch's checks run right
# after the previous call's kernel has evicted the interpreter's data from cache, where each
# module attribute lookup misses (~1-2 us each).
def _unwatched(
    tracing: Callable[[], bool] = torch._C._is_tracing,
    dispatch_modes: Callable[[], int] = torch._C._len_torch_dispatch_stack,
    function_modes: Callable[[], int] = torch._C._len_torch_function_stack,
    profiling: Callable[[], bool] = torch.autograd._profiler_enabled,
) -> bool:
    """No torch.jit tracing, mode or profiler that must see the op."""
    return not (tracing() or dispatch_modes() or function_modes() or profiling())


def _unobserved(*tensors: torch.Tensor) -> bool:
    """`_plain_call` but its type and torch.compile checks: `_unwatched`, and no autograd graph
    to record (`_records_graph`)."""
    return _unwatched() and not _records_graph(*tensors)


def _untransformed(
    *tensors: torch.Tensor,
    wrapped: Callable[[torch.Tensor], bool] = torch._C._functorch.is_functorch_wrapped_tensor,
    forward_ad: object = torch.autograd.forward_ad,
) -> bool:
    """No torch.func transform or forward-mode AD tangent (`_reject_transforms` names which), and
    no negative-bit view (the full path resolves it: `_resolved`)."""
    if forward_ad._current_level >= 0:  # type: ignore[attr-defined]
        return False
    for t in tensors:
        if wrapped(t) or t.is_neg():
            return False
    return True


def _resolved(*tensors: object) -> tuple:
    """`tensors` with negative-bit views (x.conj().imag, torch._neg_view) materialised: a kernel
    reads a tensor's stored values, and such a view keeps its sign in a flag (read unnegated
    until session 52). Differentiable, as resolve_neg is. Not while torch.compile traces: dynamo
    cannot trace is_neg (fullgraph calls failed on it), and its graphs read values."""
    if _is_compiling():
        return tensors
    return tuple(t.resolve_neg() if isinstance(t, torch.Tensor) and t.is_neg() else t for t in tensors)


def _plain_untransformed(*tensors: torch.Tensor) -> bool:
    """Whether a kept launch may serve tensors of plain type without a graph (the caller checks
    types and torch.compile first): `_untransformed` and `_unobserved`."""
    return _untransformed(*tensors) and _unobserved(*tensors)


def _reject_batched_gradients(dout: torch.Tensor | None, dlse: torch.Tensor | None) -> None:
    """A backward handed batched gradients (torch.autograd.grad(..., is_grads_batched=True) runs
    the backward under vmap) would reach the kernels as tensors without storage."""
    functorch = torch._C._functorch
    for g in (dout, dlse):
        if (
            g is not None
            and not torch.compiler.is_compiling()
            and (functorch.is_legacy_batchedtensor(g) or functorch.is_functorch_wrapped_tensor(g))
        ):
            raise InputError(
                "attncc kernels' backward takes one gradient at a time: is_grads_batched=True (and torch.func "
                "transforms over the backward) are not supported; loop over the gradients instead"
            )


def _reject_transforms(values: Mapping[str, object]) -> None:
    """torch.func transforms and forward-mode AD would see no derivative of the op (it has a
    reverse-mode formula only): a clear error instead of zero tangents."""
    if torch.compiler.is_compiling():  # dynamo traces plain tensors (and cannot trace these checks)
        return
    for name, t in values.items():
        if not isinstance(t, torch.Tensor):
            continue
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise InputError(
                f"{name}: attncc kernels do not support torch.func transforms (grad, vjp, jvp, vmap, jacrev, "
                "jacfwd); use torch.autograd.grad or .backward()"
            )
        if torch.autograd.forward_ad.unpack_dual(t).tangent is not None:
            raise InputError(f"{name}: attncc kernels have no forward-mode derivative (a dual tensor was passed)")
