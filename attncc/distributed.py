"""Context parallelism: one sequence split across ranks, attention over torch.distributed.

Each of P ranks of a process group holds a slice of the sequence's rows: q [B, H, N/P, D],
k and v [B, Hkv, M/P, D]. The sequence is cut into chunks of equal length; a layout assigns
them to ranks: "contiguous" (P chunks, rank r holds chunk r) or "zigzag" (2P chunks, rank r
holds chunks r and 2P-1-r, so a causal program gives every rank the same work; `shard` cuts a
whole tensor this way, `unshard` puts the slices back). `context_parallel` computes, on every
rank, the attention of its query rows over all keys, exactly the single-process call's:

- The program is compiled once more with global positions (passes/positions.py): i, j, N and M
  mean the whole sequence's, so masks, rope, sinks and document ids are written once.
- The chunk pairs are classified like tiles (passes/sparsity.py, one tile per chunk pair, at
  the whole sequence's sizes and inputs): every rank computes the same table, so a pair that is
  empty for every (b, h) costs nothing, neither its compute nor its transfer, and full pairs
  skip mask evaluation inside the kernel (their tiles are full).
- Step s = 0 .. P-1 of the ring: rank r works on the K/V slice of rank r - s, which that rank
  sends to it directly (torch.distributed P2P, `batch_isend_irecv`, gloo or NCCL); the next
  step's transfer is posted before the current step's compute, so they overlap. A slice is
  only sent where the receiver has a non-empty pair with it. Partial outputs are merged by
  their log-sum-exp as they arrive (merge_states), so a rank holds at most two remote slices.
- The backward runs the ring again: the K/V slices travel as in the forward, each pair's
  kernel backward (with the merged out and lse) gives dQ, kept, and dK, dV of the remote
  slice, sent back to its owner. Gradients of learnable inputs are summed over the ranks
  (all-reduce), so every rank holds the single-process gradient.
- Dropout draws from global positions with one seed (broadcast from the group's first rank
  when not given), so a sharded run keeps the same elements as the unsharded one.

Sequence lengths must divide into the layout's chunks (N and M multiples of P, or of 2P for
zigzag): pad the sequence and mask the padding in the program otherwise. Packed (varlen) and
paged calls and fp8 K/V are not context-parallel.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attncc.errors import InputError
from attncc.ir import expr as ex
from attncc.ir.expr import python_number
from attncc.passes.positions import GLOBAL_M, GLOBAL_N, KEY_POSITION0, QUERY_POSITION0
from attncc.passes.sparsity import (
    EMPTY,
    FULL,
    PARTIAL,
    Problem,
    check_reads_and_divisors,
    classify_tiles,
    values_key,
)
from attncc.passes.sparsity import runtime_tensors as with_layout_grids
from attncc.runtime.amp import autocast_dtype, cast_operands
from attncc.runtime.fp8 import is_fp8
from attncc.runtime.kernel import (
    Kernel,
    _resolved,
    checked_flag,
    checked_seed,
    checked_train,
    no_double_backward,
    seed_tensor,
)
from attncc.runtime.merge import merge_states
from attncc.runtime.reference import evaluate

LAYOUTS = ("contiguous", "zigzag")
#: Message tags of the four kinds of transfer (gloo matches by tag; NCCL by order, the same here).
_TAG_K, _TAG_V, _TAG_DK, _TAG_DV = 1, 2, 3, 4


# ----------------------------------------------------------------------------- layouts
def chunks_per_rank(layout: str) -> int:
    if layout not in LAYOUTS:
        raise InputError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    return 2 if layout == "zigzag" else 1


def rank_chunks(layout: str, rank: int, world_size: int) -> tuple[int, ...]:
    """The global chunk indices rank `rank` holds, in the order its slice stacks them."""
    return (rank, 2 * world_size - 1 - rank) if chunks_per_rank(layout) == 2 else (rank,)


def _chunk_length(length: int, world_size: int, layout: str, name: str) -> int:
    count = world_size * chunks_per_rank(layout)
    if length == 0:
        raise InputError(f"{name}: an empty sequence (0 rows) has nothing to split across ranks")
    if length % count:
        raise InputError(
            f"{name}: a sequence of {length} rows does not split into the {count} equal chunks of the "
            f"{layout} layout over {world_size} ranks; pad it to a multiple of {count} and mask the padding"
        )
    return length // count


def shard(x: torch.Tensor, rank: int, world_size: int, layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """Rank `rank`'s slice of the whole-sequence tensor `x` (sequence along `dim`)."""
    _check_world_size(world_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InputError(f"rank: expected an int in [0, {world_size}) (world_size {world_size}), got {rank!r}")
    if not -x.dim() <= dim < x.dim():
        raise InputError(f"dim: expected a dimension of x's {x.dim()}, got {dim}")
    n = _chunk_length(x.shape[dim], world_size, layout, "x")
    return torch.cat([x.narrow(dim, c * n, n) for c in rank_chunks(layout, rank, world_size)], dim=dim)


def unshard(slices: Sequence[torch.Tensor], layout: str = "zigzag", dim: int = 2) -> torch.Tensor:
    """The whole-sequence tensor from every rank's slice (`slices[r]`: rank r's), as `shard` cut it."""
    world_size = len(slices)
    per_rank = chunks_per_rank(layout)
    if not world_size or not all(isinstance(part, torch.Tensor) for part in slices):
        raise InputError(f"slices: expected every rank's slice, a tensor each, got {slices!r:.80}")
    if not all(-part.dim() <= dim < part.dim() for part in slices):
        raise InputError(f"dim: expected a dimension of the slices' {slices[0].dim()}, got {dim}")
    lengths = {part.shape[dim] for part in slices}
    if len(lengths) != 1 or next(iter(lengths)) % per_rank:
        raise InputError(
            f"slices: expected equal slices of whole chunks ({per_rank} per rank in the {layout} layout), got "
            f"{[part.shape[dim] for part in slices]} rows along dim {dim}"
        )
    chunks: dict[int, torch.Tensor] = {}
    for rank, part in enumerate(slices):
        for piece, c in zip(part.chunk(per_rank, dim=dim), rank_chunks(layout, rank, world_size)):
            chunks[c] = piece
    return torch.cat([chunks[c] for c in sorted(chunks)], dim=dim)


def pair_positions(
    layout: str,
    world_size: int,
    problem: Problem,
    chunk_rows: int,
    chunk_cols: int,
    query_rank: int,
    query_slot: int,
    key_rank: int,
    key_slot: int,
) -> dict[str, int]:
    """The position scalars of a globalized kernel (passes/positions.py) for the pair of
    `query_rank`'s query chunk `query_slot` and `key_rank`'s key chunk `key_slot`."""
    return {
        QUERY_POSITION0: rank_chunks(layout, query_rank, world_size)[query_slot] * chunk_rows,
        KEY_POSITION0: rank_chunks(layout, key_rank, world_size)[key_slot] * chunk_cols,
        GLOBAL_N: problem.N,
        GLOBAL_M: problem.M,
    }


# ----------------------------------------------------------------------------- plan
@dataclass(frozen=True)
class ContextParallelPlan:
    """Which chunk pairs a context-parallel call computes, and what travels.

    classes: uint8 [C, C] over the layout's C chunks (query chunk, key chunk): EMPTY where every
    (b, h) of the pair is masked, FULL where none is, else PARTIAL (passes/sparsity.py).
    work: the score elements of each rank's query rows in visible tiles (a finer
    classification, 16 x 16 tiles per zigzag chunk pair), the load `choose_layout` balances."""

    layout: str
    world_size: int
    problem: Problem  # the whole sequence's sizes
    chunk_rows: int
    chunk_cols: int
    classes: torch.Tensor
    work: tuple[int, ...]

    def pairs(self, rank: int, source: int) -> list[tuple[int, int, int]]:
        """(query chunk slot, key chunk slot, class) of the non-empty pairs of rank `rank`'s
        queries with rank `source`'s keys (slots: positions in the ranks' slices)."""
        mine = rank_chunks(self.layout, rank, self.world_size)
        theirs = rank_chunks(self.layout, source, self.world_size)
        return [
            (a, b, int(self.classes[qc, kc]))
            for a, qc in enumerate(mine)
            for b, kc in enumerate(theirs)
            if self.classes[qc, kc] != EMPTY
        ]

    def needs(self, rank: int, source: int) -> bool:
        return bool(self.pairs(rank, source))

    @property
    def skipped_pairs(self) -> int:
        return int((self.classes == EMPTY).sum())

    def transfers(self, rank: int) -> list[tuple[bool, bool]]:
        """Per ring step s (s = 1 .. P-1): whether rank `rank` receives the K/V slice of rank
        rank - s, and whether it sends its own to rank rank + s."""
        P = self.world_size
        return [(self.needs(rank, (rank - s) % P), self.needs((rank + s) % P, rank)) for s in range(1, P)]

    def describe(self, itemsize: int = 2) -> str:
        """The IO report of the ring: per rank and step, the bytes received (forward: a K/V
        slice; backward: it again plus the dK/dV it gets back), against an all-gather design
        (every rank gathers all of K and V, and reduce-scatters dK, dV)."""
        p, P = self.problem, self.world_size
        slice_bytes = p.B * p.Hkv * (p.M // P) * (p.D + p.Dv) * itemsize
        lines = [
            f"context parallel: {self.layout} layout, {P} ranks, {len(self.classes)} chunks of {self.chunk_rows} query "
            f"and {self.chunk_cols} key rows; {self.skipped_pairs} of {self.classes.numel()} chunk pairs empty "
            f"(skipped), {int((self.classes == FULL).sum())} full (no mask evaluation)",
            f"  work per rank (score elements in visible tiles, 16 x 16 per zigzag chunk pair): {list(self.work)}",
        ]
        ring_total = 0
        for rank in range(P):
            steps = self.transfers(rank)
            received = [slice_bytes if recv else 0 for recv, _ in steps]
            returned = [slice_bytes if send else 0 for _, send in steps]  # dK, dV of its own slice
            ring_total += sum(received) * 2 + sum(returned)
            lines.append(
                f"  rank {rank}: forward receives {[_mib(b) for b in received]} MiB per step; backward "
                f"{[_mib(a + b) for a, b in zip(received, returned)]} MiB (K/V again, dK/dV back)"
            )
        gather = P * (P - 1) * slice_bytes * 3  # K/V gathered twice, dK/dV reduce-scattered
        lines.append(
            f"  all ranks, forward + backward: ring {_mib(ring_total)} MiB, all-gather {_mib(gather)} MiB; "
            f"peak remote K/V per rank: ring {_mib(2 * slice_bytes)} MiB, all-gather {_mib((P - 1) * slice_bytes)} MiB"
        )
        return "\n".join(lines)


def _mib(nbytes: float) -> float:
    return round(nbytes / 2**20, 2)


def plan_context_parallel(
    kern: Kernel,
    world_size: int,
    problem: Problem,
    layout: str,
    scalars: Mapping[str, float],
    tensors: Mapping[str, torch.Tensor],
    scale_value: float,
) -> ContextParallelPlan:
    """The chunk-pair classes and per-rank work of `kern` over the whole sequence `problem`."""
    info = kern.op.sparsity
    assert info is not None
    chunk_rows = _chunk_length(problem.N, world_size, layout, "q")
    chunk_cols = _chunk_length(problem.M, world_size, layout, "k")
    scalar_map = {**scalars, "scale": scale_value}
    host_tensors = {name: t.detach().cpu() for name, t in tensors.items()}
    all_tensors = with_layout_grids(info, problem, host_tensors)
    exprs = kern.op.per_score_expressions
    check_reads_and_divisors(exprs, problem, scalar_map, all_tensors)
    per_bh = classify_tiles(info, problem, scalar_map, all_tensors, chunk_rows, chunk_cols)
    classes = torch.where(
        (per_bh == EMPTY).all(0).all(0), EMPTY, torch.where((per_bh == FULL).all(0).all(0), FULL, PARTIAL)
    ).to(torch.uint8)
    # the same fine tiles whatever the layout (so layouts compare): 16 per zigzag chunk
    sub_rows, sub_cols = math.ceil(problem.N / (32 * world_size)), math.ceil(problem.M / (32 * world_size))
    fine = classify_tiles(info, problem, scalar_map, all_tensors, sub_rows, sub_cols)
    visible = (fine != EMPTY).expand(problem.B, problem.H, -1, -1).sum((0, 1, 3))  # per fine query tile
    per_chunk = [0] * len(classes)
    for tile, count in enumerate(visible.tolist()):
        per_chunk[tile * sub_rows // chunk_rows] += count * sub_rows * sub_cols
    work = tuple(sum(per_chunk[c] for c in rank_chunks(layout, r, world_size)) for r in range(world_size))
    return ContextParallelPlan(layout, world_size, problem, chunk_rows, chunk_cols, classes, work)


def layout_plans(
    kern: Kernel,
    world_size: int,
    N: int,
    M: int | None = None,
    *,
    B: int = 1,
    H: int = 1,
    Hkv: int | None = None,
    D: int = 64,
    Dv: int | None = None,
    scale: float | None = None,
    layouts: Sequence[str] = LAYOUTS,
    **inputs: object,
) -> list[ContextParallelPlan]:
    """The plan of every layout of `layouts` (default: all, LAYOUTS order) for this program,
    sizes and inputs (those over the whole sequence, as `context_parallel` takes them)."""
    _check_world_size(world_size)
    _check_sizes(N=N, M=M, B=B, H=H, Hkv=Hkv, D=D, Dv=Dv)
    problem = Problem(B, H, Hkv or H, N, N if M is None else M, D, D if Dv is None else Dv)
    scalars, tensors, scale_value = _program_values(kern, problem, scale, inputs)
    return [plan_context_parallel(kern, world_size, problem, lay, scalars, tensors, scale_value) for lay in layouts]


def _check_sizes(**sizes: object) -> None:
    """The sizes a plan is asked for (None: not given, the default): ints, B >= 0 and the rest
    >= 1, H a multiple of Hkv (a negative N was torch's RuntimeError, N=8.0 a TypeError from
    view(), H=3 with Hkv=2 a plan)."""
    sizes = {name: python_number(value) for name, value in sizes.items()}  # (np.int64(64) is 64)
    for name, value in sizes.items():
        least = 0 if name == "B" else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
            raise InputError(f"{name}: expected an int >= {least}, got {value!r}")
    heads, kv_heads = sizes.get("H"), sizes.get("Hkv")
    if isinstance(heads, int) and isinstance(kv_heads, int) and heads % kv_heads:
        raise InputError(f"H: expected a multiple of Hkv={kv_heads} (a group of query heads per kv head), got {heads}")


def _check_world_size(world_size: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InputError(f"world_size: expected an int >= 1, got {world_size!r}")


def balanced(plans: Sequence[ContextParallelPlan]) -> ContextParallelPlan:
    """The plan whose busiest rank has the least work (ties: the earlier layout, contiguous)."""
    return min(plans, key=lambda plan: (max(plan.work), LAYOUTS.index(plan.layout)))


def choose_layout(
    kern: Kernel, world_size: int, N: int, M: int | None = None, **sizes_and_inputs: object
) -> ContextParallelPlan:
    """The plan of the layout that balances the ranks' work best (`layout_plans`, `balanced`),
    from the tile classes, not from knowing the mask: causal and bottom-right programs get
    zigzag, a sliding window or a dense program contiguous. Shard q, k, v with its `layout`."""
    _check_world_size(world_size)
    _check_sizes(N=N, M=M)
    # (a sequence may split into one layout's chunks only: 9 rows over 3 ranks are contiguous)
    keys = N if M is None else M
    fitting = [lay for lay in LAYOUTS if all(n % (world_size * chunks_per_rank(lay)) == 0 for n in (N, keys))]
    layouts = fitting or list(LAYOUTS)  # (none: the first one's error names the sizes)
    return balanced(layout_plans(kern, world_size, N, M, layouts=layouts, **sizes_and_inputs))  # type: ignore[arg-type]


def _program_values(
    kern: Kernel, problem: Problem, scale: float | None, inputs: Mapping[str, object]
) -> tuple[dict[str, float], dict[str, torch.Tensor], float]:
    """The program's scalars and tensors by name, and the value of `scale` at the whole sizes."""
    kern.check_input_names(inputs)  # type: ignore[arg-type]
    scalars = {d.name: float(kern.checked_scalar(d, inputs[d.name])) for d in kern.inputs if d.role == "scalar"}  # type: ignore[arg-type]
    tensors = {d.name: inputs[d.name] for d in kern.inputs if d.role == "tensor"}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: expected a tensor, got {type(t).__name__}")
    sizes = {name: getattr(problem, name) for name in ex.SIZE_VARS}
    checked = kern.call_scale(scale)
    value = checked if checked is not None else float(evaluate(kern.op.default_scale, sizes, {}))
    return scalars, tensors, value  # type: ignore[return-value]


# ----------------------------------------------------------------------------- the ring
class _SumOverRanks(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group's ranks (learnable inputs
    that every rank holds a copy of, each rank's gradient covering its own query rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:  # noqa: ANN001
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def through_host(t: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether `t` travels through a host copy: gloo's send and recv take host memory only, so
    with gloo, device tensors do (which lets several ranks share one GPU, as NCCL does not)."""
    return t.device.type != "cpu" and dist.get_backend(group) == "gloo"


@dataclass
class _StagedTransfers:
    """Transfers through host memory (gloo with device tensors): wait() waits for them all,
    then copies what arrived into the device tensors. Holds the host copies until then."""

    works: list
    copies: list[tuple[torch.Tensor, torch.Tensor]]  # (device tensor, its host landing buffer)
    sent: list[torch.Tensor]  # (the host copies being sent, alive until then)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        for device_tensor, host in self.copies:
            device_tensor.copy_(host)


@dataclass
class _Ring:
    """One context-parallel call: its plan, rank, group and the globalized kernel's arguments."""

    kern: Kernel  # globalized (Kernel.at_global_positions)
    plan: ContextParallelPlan
    group: dist.ProcessGroup | None
    rank: int
    scalars: dict[str, float]
    scale: float
    dropout: float
    seed: int

    def _peer(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _positions(self, query_slot: int, key_slot: int, source: int) -> list[float]:
        """The program's scalars for one chunk pair, in the globalized kernel's order."""
        p = self.plan
        values = {
            **self.scalars,
            **pair_positions(
                p.layout, p.world_size, p.problem, p.chunk_rows, p.chunk_cols, self.rank, query_slot, source, key_slot
            ),
        }
        return [float(values[d.name]) for d in self.kern.inputs if d.role == "scalar"]

    def _exchange(self, sends: list[tuple[torch.Tensor, int, int]], recvs: list[tuple[torch.Tensor, int, int]]) -> list:
        """Post the transfers; the returned works' wait() completes them (tensors that travel
        through host memory, `through_host`, are copied into place there)."""
        sent = [t.to("cpu", copy=True) if through_host(t, self.group) else t for t, _, _ in sends]
        landing = [
            torch.empty(t.shape, dtype=t.dtype, device="cpu") if through_host(t, self.group) else t for t, _, _ in recvs
        ]
        ops = [dist.P2POp(dist.isend, t, self._peer(peer), self.group, tag) for t, (_, peer, tag) in zip(sent, sends)]
        ops += [
            dist.P2POp(dist.irecv, t, self._peer(peer), self.group, tag) for t, (_, peer, tag) in zip(landing, recvs)
        ]
        works = dist.batch_isend_irecv(ops) if ops else []
        if not any(through_host(t, self.group) for t, _, _ in (*sends, *recvs)):
            return works
        copies = [(t, host) for (t, _, _), host in zip(recvs, landing) if host is not t]
        return [_StagedTransfers(works, copies, sent)]

    def _post_keys(self, step: int, k: torch.Tensor, v: torch.Tensor) -> tuple[list, tuple | None]:
        """Post step `step`'s K/V transfers: this rank's slice to rank + step where it needs it,
        rank - step's slice into fresh buffers where this rank needs it."""
        P, r = self.plan.world_size, self.rank
        source, target = (r - step) % P, (r + step) % P
        sends = [(k, target, _TAG_K), (v, target, _TAG_V)] if self.plan.needs(target, r) else []
        buffers = (torch.empty_like(k), torch.empty_like(v)) if self.plan.needs(r, source) else None
        recvs = [(buffers[0], source, _TAG_K), (buffers[1], source, _TAG_V)] if buffers else []
        return self._exchange(sends, recvs), buffers

    def _ring_keys(self, k: torch.Tensor, v: torch.Tensor):  # noqa: ANN202 - generator
        """(step, source rank, its K, its V) for every step s = 0 .. P-1 (K and V None where this
        rank needs nothing of the source's slice), the next step's transfer posted before the
        current one is handed out."""
        P, r = self.plan.world_size, self.rank
        pending = self._post_keys(1, k, v) if P > 1 else ([], None)
        yield (0, r, k, v) if self.plan.needs(r, r) else (0, r, None, None)
        for step in range(1, P):
            works, buffers = pending
            for work in works:
                work.wait()
            pending = self._post_keys(step + 1, k, v) if step + 1 < P else ([], None)
            held = [buffers if buffers is not None else (None, None)]
            del works, buffers  # (the consumer alone holds this step's slice: it can drop it early)
            yield (step, (r - step) % P, *held.pop())

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n, m = self.plan.chunk_rows, self.plan.chunk_cols
        acc = torch.promote_types(torch.float32, q.dtype)
        # this rank's rows, merged in place chunk slot by chunk slot as pairs arrive
        out = q.new_zeros((*q.shape[:3], v.shape[3]), dtype=acc)
        lse = q.new_full(q.shape[:3], -math.inf, dtype=acc)
        for _, source, ks, vs in self._ring_keys(k.contiguous(), v.contiguous()):
            if ks is None:
                continue
            for a, b, _ in self.plan.pairs(self.rank, source):
                part, part_lse = self.kern.forward_impl(
                    q.narrow(2, a * n, n),
                    ks.narrow(2, b * m, m),
                    vs.narrow(2, b * m, m),
                    tensors,
                    self._positions(a, b, source),
                    self.scale,
                    self.dropout,
                    self.seed,
                )
                _merge_into(out.narrow(2, a * n, n), lse.narrow(2, a * n, n), part, part_lse.to(acc))
                del part, part_lse
            ks = vs = None
        return out.to(q.dtype), lse

    def backward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        tensors: list[torch.Tensor],
        grad_inputs: list[bool],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        P, r = self.plan.world_size, self.rank
        n, m = self.plan.chunk_rows, self.plan.chunk_cols
        acc = torch.promote_types(torch.float32, q.dtype)
        k, v, dout = k.contiguous(), v.contiguous(), dout.contiguous()
        # gradients of q's and k's slices, made by their first contribution (`_accumulate`)
        dq: torch.Tensor | None = None
        dk_own: torch.Tensor | None = None
        dv_own: torch.Tensor | None = None
        grads = [
            torch.zeros(t.shape, dtype=torch.float64, device=t.device) if want else None
            for t, want in zip(tensors, grad_inputs)
        ]
        # Per step: the pairs with the source's slice; then, its K/V dropped, the remote slice's
        # dK/dV sent back, this rank's own coming back from rank + step added, and the sends
        # waited, so no gradient buffer outlives its step (the peak: the step's K/V, the next
        # step's in flight, the remote dK/dV and the pairs' outputs).
        for step, source, ks, vs in self._ring_keys(k, v):
            sends: list = []
            if ks is not None:
                dk, dv = (dk_own, dv_own) if step == 0 else (None, None)
                for a, b, _ in self.plan.pairs(r, source):
                    rows, keys = slice(a * n, (a + 1) * n), slice(b * m, (b + 1) * m)
                    dq_part, dk_part, dv_part, input_grads = self.kern.backward_impl(
                        q[:, :, rows],
                        ks[:, :, keys],
                        vs[:, :, keys],
                        out[:, :, rows],
                        lse[:, :, rows],
                        dout[:, :, rows],
                        None if dlse is None else dlse[:, :, rows],
                        tensors,
                        self._positions(a, b, source),
                        self.scale,
                        self.dropout,
                        self.seed,
                        grad_inputs,
                        all_keys=False,  # (lse is the whole row's: no residual from a step's keys)
                    )
                    dq = _accumulate(dq, dq_part, a, q.shape, acc)
                    dk = _accumulate(dk, dk_part, b, k.shape, acc)
                    dv = _accumulate(dv, dv_part, b, v.shape, acc)
                    for total, part in zip(grads, input_grads):
                        if total is not None and part.numel():
                            total += part
                    del dq_part, dk_part, dv_part
                ks = vs = None
                if step:
                    sends = self._exchange([(dk, source, _TAG_DK), (dv, source, _TAG_DV)], [])  # type: ignore[list-item]
                else:
                    dk_own, dv_own = dk, dv
                dk = dv = None
            helper = (r + step) % P
            if step and self.plan.needs(helper, r):
                back = tuple(torch.empty(t.shape, dtype=acc, device=t.device) for t in (k, v))
                for work in self._exchange([], [(back[0], helper, _TAG_DK), (back[1], helper, _TAG_DV)]):
                    work.wait()
                dk_own = back[0] if dk_own is None else dk_own.add_(back[0])
                dv_own = back[1] if dv_own is None else dv_own.add_(back[1])
                del back
            for work in sends:
                work.wait()
        input_grads = [g.to(t.dtype) if g is not None else None for g, t in zip(grads, tensors)]
        dq, dk_own, dv_own = (
            g if g is not None else torch.zeros_like(t) for g, t in ((dq, q), (dk_own, k), (dv_own, v))
        )
        return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype), input_grads  # type: ignore[return-value]


def _merge_into(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """out, lse (accumulator dtype) <- their merge with a partial result over other keys, in
    place (merge_states' formula without its stacked copies); rows empty in both stay 0, -inf."""
    merged = torch.logaddexp(lse, part_lse)
    empty = torch.isneginf(merged)
    safe = torch.where(empty, torch.zeros_like(merged), merged)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1))
    out.addcmul_(part, torch.exp(part_lse - safe).unsqueeze(-1))
    lse.copy_(merged)


def _accumulate(
    total: torch.Tensor | None, part: torch.Tensor, slot: int, shape: torch.Size, dtype: torch.dtype
) -> torch.Tensor:
    """`total` (a slice's gradient, `shape`, or None before its first contribution) plus the
    contribution `part` of chunk slot `slot`. A slice of one chunk takes its first part as is
    (no zero-filled copy: the single-chunk layouts' memory); others fill a zeroed slice."""
    if part.shape == shape:
        return part.to(dtype) if total is None else total.add_(part)
    if total is None:
        total = torch.zeros(shape, dtype=dtype, device=part.device)
    total.narrow(2, slot * part.shape[2], part.shape[2]).add_(part)
    return total


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring: _Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *tensors: torch.Tensor) -> tuple:  # noqa: ANN001
        out, lse = ring.forward(q, k, v, list(tensors))
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse, *tensors)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, dlse: torch.Tensor) -> tuple:  # noqa: ANN001
        q, k, v, out, lse, *tensors = ctx.saved_tensors
        wanted = list(ctx.needs_input_grad[4:])
        dq, dk, dv, grads = ctx.ring.backward(q, k, v, out, lse, dout, dlse, tensors, wanted)
        # (create_graph: gradients with no graph made a penalty on them add nothing, silently)
        if torch.is_grad_enabled():
            given = [g for g in (dq, dk, dv, *grads) if g is not None]
            marked = iter(_DifferentiableOnce.apply(q, k, v, *given))
            dq, dk, dv, *grads = (None if g is None else next(marked) for g in (dq, dk, dv, *grads))
        return (None, dq, dk, dv, *grads)


class _DifferentiableOnce(torch.autograd.Function):
    """The ring's gradients under create_graph, as they are but depending on q, k and v: a
    term built on them raises in its backward, as the kernels' backward op does."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *grads: torch.Tensor) -> tuple:  # noqa: ANN001
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:  # noqa: ANN001
        return no_double_backward(ctx, *grads)


# ----------------------------------------------------------------------------- public call
# (run eagerly inside a compiled model, a graph break: dynamo failed inside on the process
# group's script object, an internal error, not attncc's)
@torch.compiler.disable(reason="attncc's context_parallel is Python around the kernels and the ring's transfers")
def context_parallel(
    kern: Kernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    layout: str = "zigzag",
    return_lse: bool = False,
    scale: float | None = None,
    train: bool = True,
    seed: int | None = None,
    dropout_p: float | None = None,
    **inputs: object,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of `kern`'s attention over a sequence split across `group` (default:
    the world): q [B, H, N/P, D], k [B, Hkv, M/P, D], v [B, Hkv, M/P, Dv] this rank's slices
    in `layout` (`shard`); inputs are the program's runtime inputs over the whole sequence (a
    document-id tensor [B, N], not a slice), the same on every rank. Returns out [B, H, N/P, Dv]
    (and lse [B, H, N/P]), equal to the rows of the single-process call `kern(q, k, v)` on the
    whole tensors; differentiable (q, k, v and learnable inputs; module docstring). Every rank
    of the group must call it with the same sizes, layout, inputs and dropout options
    (`train`, `seed`, `dropout_p`: the rate in place of the program's, as `kern`'s call)."""
    kern.check_inputs_named_apart("context_parallel")
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("context_parallel: torch.distributed is not initialised (call init_process_group first)")
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.is_nested or t.dim() != 4:
            shape = "a nested tensor" if isinstance(t, torch.Tensor) and t.is_nested else None
            shape = shape or (tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__)
            raise InputError(f"{name}: expected this rank's slice [B, heads, rows, D], a dense tensor, got {shape}")
        if is_fp8(t):
            raise InputError(f"{name}: fp8 K/V are forward-only serving inputs; context_parallel takes float q, k, v")
    return_lse = checked_flag("return_lse", return_lse)  # (`return_lse="no"` returned the lse)
    lower = autocast_dtype(q)
    if lower is not None:  # (as the single-process call under torch.autocast: runtime/amp.py; it ran in fp32)
        with torch.autocast(q.device.type, enabled=False):
            return context_parallel(
                kern, *cast_operands(lower, q, k, v), group=group, layout=layout, return_lse=return_lse, scale=scale,
                train=train, seed=seed, dropout_p=dropout_p, **inputs,
            )  # fmt: skip
    if v.shape[:3] != k.shape[:3]:  # (the checks below see each chunk: v's extra rows were ignored)
        raise InputError(
            f"v: expected shape [{', '.join(map(str, k.shape[:3]))}, Dv] (that of k but the head dim), got "
            f"{tuple(v.shape)}"
        )
    q, k, v = _resolved(q, k, v)  # (a negative-bit view's values: the ring's kernels read storage)
    # (dropout's draws: a seed given on one rank alone hung the others in its broadcast; a seed per
    # rank gave rows of no single call, silently)
    draws = _draws_summary(train, seed, dropout_p) if kern.op.dropout or dropout_p is not None else None
    _check_same_call(group, world_size, rank, layout, (q, k, v), scale, draws, inputs)
    per_rank = chunks_per_rank(layout)
    B, H, N_local, D = q.shape
    problem = Problem(B, H, k.shape[1], N_local * world_size, k.shape[2] * world_size, D, v.shape[3])
    scalars, tensors, scale_value = _program_values(kern, problem, scale, inputs)
    chunk_rows = _chunk_length(problem.N, world_size, layout, "q")
    chunk_cols = _chunk_length(problem.M, world_size, layout, "k")
    globalized = kern.at_global_positions()
    first = {**inputs, **pair_positions(layout, world_size, problem, chunk_rows, chunk_cols, rank, 0, rank, 0)}
    globalized.validate(q.narrow(2, 0, chunk_rows), k.narrow(2, 0, chunk_cols), v.narrow(2, 0, chunk_cols), first)
    dropout = kern.call_dropout(train, dropout_p)  # (after the same-call check: every rank errs alike)
    if dropout and chunk_cols % 4:
        raise InputError(
            f"k: with dropout, key chunks must be multiples of 4 rows (the dropout draws cover aligned quads of "
            f"keys); {problem.M} keys in {world_size * per_rank} chunks of {chunk_cols}"
        )
    plan = plan_context_parallel(kern, world_size, problem, layout, scalars, tensors, scale_value)
    seed_value = seed_tensor(seed, dropout).to(q.device)
    if dropout and seed is None:  # one seed for every rank: the group's first rank's
        dist.broadcast(seed_value, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    ring = _Ring(globalized, plan, group, rank, scalars, scale_value, dropout, int(seed_value.item()))
    shared = [
        _SumOverRanks.apply(t, group) if t.requires_grad and torch.is_grad_enabled() else t for t in tensors.values()
    ]
    out, lse = _RingAttention.apply(ring, q, k, v, *shared)
    if kern.op.sink is not None:  # merged once, at the rows' global positions
        runtime = {**scalars, **dict(zip(tensors, shared))}
        out, lse = _merge_sink(kern, plan, rank, out, lse, scale_value, runtime)
    return (out, lse) if return_lse else out


def _merge_sink(
    kern: Kernel,
    plan: ContextParallelPlan,
    rank: int,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale_value: float,
    runtime: Mapping[str, object],
) -> tuple[torch.Tensor, torch.Tensor]:
    """out and lse with the program's sink merged in (runtime/sinks.py), evaluated at this
    rank's rows' global positions and the whole sizes; differentiable."""
    B, H, rows, _ = out.shape
    n = plan.chunk_rows
    starts = [c * n for c in rank_chunks(plan.layout, rank, plan.world_size)]
    index = {
        "b": torch.arange(B, device=out.device).view(-1, 1, 1),
        "h": torch.arange(H, device=out.device).view(1, -1, 1),
        "i": torch.cat([torch.arange(s, s + n, device=out.device) for s in starts]).view(1, 1, -1),
    }
    sizes = {name: getattr(plan.problem, name) for name in ex.SIZE_VARS}
    sink = kern.sink_rows(index, sizes, scale_value, runtime, lse.dtype).expand(B, H, rows)
    return merge_states([out, torch.zeros_like(out)], [lse, sink])


def _draws_summary(train: object, seed: object, dropout_p: object = None) -> str:
    """What ranks compare of dropout's `train`, `seed` and `dropout_p`: their values (np.int64(5)
    is 5), the seed only where dropout draws (train=False reads none); a value the call refuses
    as given, so that every rank giving it reaches that error after the check rather than alone
    before it (the others hung in the check's all-gather)."""
    rate = "" if dropout_p is None else f" dropout_p={_input_summary(dropout_p)!r}"
    try:
        train = checked_train(train)
    except InputError:
        return f"train={train!r} seed={seed!r}{rate}"
    if not train:
        return f"train=False{rate}"
    try:
        seed = None if seed is None else checked_seed(seed)
    except InputError:
        pass
    return f"train=True seed={seed!r}{rate}"


def _input_summary(value: object) -> object:
    """What ranks compare of a runtime input: a number by its value as text (float.hex: 4, 4.0
    and np.int64(4) alike; NaN is itself there, where pickled nan != nan made one call two), a
    tensor's shape, dtype and a digest of its bytes (two sums of its values let differing tables
    through: +d, -d, -d, +d changed neither)."""
    if not isinstance(value, torch.Tensor):
        number = python_number(value)
        if isinstance(number, float) or (type(number) is int and abs(number) <= 2**53):
            return float(number).hex()  # (4 and 4.0 and np.int64(4) alike, as the kernels take them; nan itself)
        return repr(number)
    # (whether it asks a gradient: a rank alone in the backward's all-reduce hung the group)
    wants_grad = value.requires_grad and torch.is_grad_enabled()
    contents = hashlib.blake2b(values_key(value)[2], digest_size=16).hexdigest()
    return (tuple(value.shape), str(value.dtype), wants_grad, contents)


def _check_same_call(
    group: dist.ProcessGroup | None,
    world_size: int,
    rank: int,
    layout: str,
    operands: tuple[torch.Tensor, ...],
    scale: object,
    draws: str | None,
    inputs: Mapping[str, object],
) -> None:
    """Every rank calls with the same layout, slice shapes and dtypes, scale, dropout's `train`
    and `seed` (`draws`, `_draws_summary`, where the program has dropout) and runtime inputs (else an error on
    every rank naming the first that differs, rather than a hang in a transfer of the wrong
    size, or each rank's rows of a different attention, silently)."""
    grad = torch.is_grad_enabled()
    mine = (layout, *((tuple(t.shape), str(t.dtype), t.requires_grad and grad) for t in operands))
    given = (
        _input_summary(scale),
        draws,
        sorted((name, _input_summary(value)) for name, value in inputs.items()),
    )
    everyone: list[object] = [None] * world_size
    dist.all_gather_object(everyone, (mine, given), group=group)
    for other, (theirs, their_given) in enumerate(everyone):  # type: ignore[misc]
        if theirs != mine:
            raise InputError(
                f"context_parallel: rank {rank} calls with (layout, (q, k, v) shapes, dtypes and whether they "
                f"require grad) {mine}, "
                f"but rank {other} with {theirs}; every rank must call with the same"
            )
        if their_given != given:
            raise InputError(
                f"context_parallel: rank {rank} calls with (scale, dropout's train and seed, runtime inputs) {given}, "
                f"but rank {other} with "
                f"{their_given}; every rank passes the same, over the whole sequence"
            )
