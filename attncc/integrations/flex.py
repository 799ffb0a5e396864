"""A drop-in for PyTorch's `flex_attention` on attncc kernels.

    from attncc.integrations.flex import flex_attention
    from torch.nn.attention.flex_attention import create_block_mask

    def softcap(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / 30) * 30

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = create_block_mask(causal, B=None, H=None, Q_LEN=N, KV_LEN=N, device="cpu")
    out = flex_attention(q, k, v, score_mod=softcap, block_mask=mask)

The score and mask functions are traced into a DSL program (`attncc.frontend.flex`), compiled
once per program text and target and run with the tensors they read as runtime inputs, so
`attncc.flex_program(score_mod, mask_mod).source` is the program a `.attn` file would hold.
The block structure is attncc's own, derived from the mask function by its sparsity analysis:
a BlockMask means what compiled Flex runs (`_mask_function`): keys in its listed blocks only,
its `mask_mod` in the partial blocks and not in the full ones (its mask_mod alone where the
lists are those `create_block_mask` makes from it; `BlockMask.from_kv_blocks` lists, with or
without a mask function, as lists); its sequence lengths must be the call's. `kernel_options` (Triton tile choices) are
accepted and have no effect: the tiles are the target's. Under torch.compile the tracing runs
eagerly (a graph break before the kernel's call); `torch.compile(fullgraph=True)` takes the
program's kernel, `attncc.compile(attncc.flex_program(score_mod, mask_mod).source)`, called
with the program's `inputs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from attncc.errors import DslError, FlexTraceError, InputError
from attncc.frontend.flex import FlexProgram, flex_program, too_large
from attncc.integrations.made import MadeKernels
from attncc.passes.sparsity import EMPTY, FULL, Problem, check_reads_and_divisors, classify_tiles, runtime_tensors
from attncc.runtime.kernel import Kernel, drop_in_scale
from attncc.runtime.locks import module_lock
from attncc.runtime.reference import values_unreadable

#: The last PROOFS_KEPT BlockMasks proven to be their mask function alone (`_lists_implied`), by
#: the mask's program, the call's sizes and device and the block size: copies of the lists and
#: of the tensors the mask reads, from which the proof was made (0.3 ms of host work per call).
_PROVEN: dict[tuple, tuple[torch.Tensor, ...]] = {}
PROOFS_KEPT = 16
_LOCK = module_lock(__name__, "_LOCK")


@torch.compiler.disable
def _traced(score_mod: Callable[..., Any] | None, mask_mod: Callable[..., Any] | None) -> FlexProgram:
    """flex_program, run eagerly under torch.compile (a graph break): dynamo cannot trace the
    tracer's symbols through a closure's tensor reads (an internal error, not a graph break)."""
    return flex_program(score_mod, mask_mod)


@dataclass(frozen=True)
class TracedProgram:
    """The DSL text traced from a call's score_mod and mask_mod."""

    source: str


#: The traced programs' kernels (under torch.compile built while the graph is traced, as the other
#: drop-ins' are: a lock here was one more graph break per call).
_KERNELS = MadeKernels(TracedProgram, lambda program: program.source)


def _kernel(source: str, device: torch.device) -> Kernel:
    try:
        return _KERNELS(TracedProgram(source), device)
    except DslError as error:
        said = (
            str(error).splitlines()[0].split("error: ")[-1]
        )  # (a position in the generated text means nothing to the caller)
        if "nested too deeply" in said:
            raise FlexTraceError(
                f"the functions traced into an expression nested too deeply for the compiler ({said}): compose "
                "fewer functions in one value"
            ) from None
        if "too large" not in said:
            raise
        raise FlexTraceError(too_large(said)) from None


@torch.compiler.disable  # (host work on the lists' values: eager under torch.compile, as `_traced`)
def _mask_function(block_mask: object, query: torch.Tensor, key: torch.Tensor) -> Callable[..., Any] | None:
    """The mask a BlockMask stands for, as compiled Flex runs it (None where it masks nothing):
    keys in its listed blocks only, its mask_mod applied in the partial ones and not in the full
    ones; its mask_mod alone where that is proven the same (`_lists_implied`: the lists of
    create_block_mask). Checked against the call."""
    queries, keys = query.shape[2], key.shape[2]
    if block_mask is None:
        return None
    from torch.nn.attention.flex_attention import BlockMask, noop_mask

    if not isinstance(block_mask, BlockMask):
        raise InputError(
            f"block_mask: expected a BlockMask (create_block_mask) or None, got {type(block_mask).__name__}"
        )
    lengths = tuple(int(n) for n in block_mask.seq_lengths)
    if lengths != (queries, keys):
        raise InputError(
            f"block_mask: made for (Q_LEN, KV_LEN) = {lengths}, called with query length {queries} and key length {keys}"
        )
    rows, cols = _block_size(block_mask.BLOCK_SIZE)
    counts, indices = block_mask.kv_num_blocks, block_mask.kv_indices
    for name, count, index in (
        ("kv", counts, indices),
        ("full_kv", block_mask.full_kv_num_blocks, block_mask.full_kv_indices),
    ):
        if count is not None and (count.dim() != 3 or index is None or tuple(index.shape[:-1]) != tuple(count.shape)):
            shown = (tuple(count.shape), None if index is None else tuple(index.shape))
            raise InputError(
                f"block_mask: {name}_num_blocks [B, H, query blocks] and {name}_indices [B, H, query blocks, "
                f"width] expected, got shapes {shown}"
            )
    mask_mod = block_mask.mask_mod
    lists = tuple(
        t
        for t in (
            block_mask.kv_num_blocks,
            block_mask.kv_indices,
            block_mask.full_kv_num_blocks,
            block_mask.full_kv_indices,
        )
        if t is not None
    )
    # (torch.export traces this: the lists' values cannot be read, so no shortcut by them and no
    # proof; the mask is the lists' and mask_mod's, read by the kernel when it runs)
    traced = torch.compiler.is_exporting() or values_unreadable(counts)
    proof = None
    if mask_mod is not noop_mask and not traced:  # (a proof of these lists' and tensors' values is kept: `_PROVEN`)
        mask_program = _traced(None, mask_mod)
        proof = (mask_program.source, tuple(query.shape), tuple(key.shape), str(query.device), rows, cols)
        values = (*lists, *mask_program.inputs.values())
        with _LOCK:
            proven = _PROVEN.get(proof)
        if proven is not None and _same_values(proven, values):
            return mask_mod
    key_blocks = -(-keys // cols)
    partial_blocks = _listed_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, key_blocks)
    for dim, (size, what) in enumerate(zip(query.shape[:2], ("B", "H"))):
        if partial_blocks.shape[dim] not in (1, size):  # (a broadcast error from deep inside until session 58)
            raise InputError(
                f"block_mask: made for {what}={partial_blocks.shape[dim]} (create_block_mask's {what}), but the call "
                f"has {what}={size}: make it with {what}={size} or {what}=None"
            )
    full_blocks = None
    if block_mask.full_kv_num_blocks is not None:
        full_blocks = _listed_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, key_blocks)
    if full_blocks is not None and not traced and bool(full_blocks.all()):
        return None
    listed = partial_blocks if full_blocks is None else partial_blocks | full_blocks
    if mask_mod is noop_mask and not traced and bool(listed.all()):
        return None
    if proof is not None and _lists_implied(mask_program, listed, full_blocks, query, key, (rows, cols)):
        with _LOCK:
            _PROVEN[proof] = tuple(t.detach().clone() for t in values)
            while len(_PROVEN) > PROOFS_KEPT:
                _PROVEN.pop(next(iter(_PROVEN)))
        return mask_mod
    # (the block tables read with index 0 where they broadcast over the batch or the heads)
    batch_of = (lambda b: b) if partial_blocks.shape[0] > 1 else (lambda b: 0)
    head_of = (lambda h: h) if partial_blocks.shape[1] > 1 else (lambda h: 0)

    def in_listed_blocks(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - traced by flex_program
        block = (batch_of(b), head_of(h), q_idx // rows, kv_idx // cols)
        kept = partial_blocks[block]
        if mask_mod is not noop_mask:
            kept = kept & mask_mod(b, h, q_idx, kv_idx)
        return kept if full_blocks is None else kept | full_blocks[block]

    return in_listed_blocks


def _block_size(size: object) -> tuple[int, int]:
    """A BlockMask's BLOCK_SIZE as (query rows, key columns), positive ints."""
    pair = tuple(size) if isinstance(size, tuple | list) else (size, size)
    try:
        rows, cols = (int(x) for x in pair)  # type: ignore[call-overload]
        valid = len(pair) == 2 and all(int(x) == x and not isinstance(x, bool | float) for x in pair)  # type: ignore[call-overload]
    except (TypeError, ValueError, RuntimeError):
        valid = False
    if not valid or rows < 1 or cols < 1:
        raise InputError(f"block_mask: BLOCK_SIZE must be a positive int or two, got {size!r}")
    return rows, cols


def _same_values(kept: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...]) -> bool:
    """Whether the tensors hold what the copies kept do (by value: a buffer rewritten through
    numpy or `.data` keeps its version counter)."""
    return len(kept) == len(values) and all(
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
        for a, b in zip(kept, values)
    )


def _lists_implied(
    mask_program: FlexProgram,
    listed: torch.Tensor,
    full_blocks: torch.Tensor | None,
    query: torch.Tensor,
    key: torch.Tensor,
    block: tuple[int, int],
) -> bool:
    """Whether a BlockMask's lists say nothing its mask function does not, proven by the sparsity
    analysis of the mask at the lists' block size: the mask keeps no key of an unlisted block and
    every key of a full one (so the kernel of the mask alone is the same attention, without the
    lists' reads: 9% of a causal N = 2K fp32 forward, 0.2 ms of an N = 128 call)."""
    info = _kernel(mask_program.source, query.device).op.sparsity
    assert info is not None
    B, H, N, D = query.shape
    problem = Problem(B, H, key.shape[1], N, key.shape[2], D, D)
    tensors = runtime_tensors(info, problem, {name: t.detach().cpu() for name, t in mask_program.inputs.items()})
    if info.predicate is not None:  # (classification reads the mask's tensors where this proves it may)
        check_reads_and_divisors([info.predicate], problem, {}, tensors)
    classes = classify_tiles(info, problem, {}, tensors, *block)
    if classes.shape[2:] != listed.shape[2:]:  # (lists of another block count than the sizes have)
        return False
    classes, listed = torch.broadcast_tensors(classes, listed.cpu())
    if bool((classes[~listed] != EMPTY).any()):
        return False
    return full_blocks is None or bool((classes[full_blocks.cpu().expand_as(classes)] == FULL).all())


def _listed_blocks(counts: torch.Tensor, indices: torch.Tensor, key_blocks: int) -> torch.Tensor:
    """A BlockMask's block lists (per query block the first `counts` entries of `indices`) as a
    dense bool tensor [B|1, H|1, query blocks, key blocks]."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < counts.unsqueeze(-1)
    slots = torch.where(listed & (indices >= 0) & (indices < key_blocks), indices.long(), key_blocks)
    dense = torch.zeros((*indices.shape[:-1], key_blocks + 1), dtype=torch.bool, device=indices.device)
    return dense.scatter_(-1, slots, True)[..., :key_blocks]


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod: Callable[..., Any] | None = None,
    block_mask: object = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    *,
    return_aux: object = None,
    mask_mod: Callable[..., Any] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, object]:
    """torch.nn.attention.flex_attention.flex_attention's call on attncc: query [B, H, L, E],
    key [B, Hkv, S, E], value [B, Hkv, S, Ev]; out [B, H, L, Ev] (and the natural-log lse
    [B, H, L] with return_lse). Fully masked rows give 0 and an lse of -inf, as Flex does.
    `mask_mod=` may be given instead of a BlockMask (attncc needs no block lists).
    `return_aux=AuxRequest(lse=True)` returns (out, AuxOutput(lse=...)), as torch's does
    (`max_scores` is not kept by the kernels: an error)."""
    del kernel_options  # (Triton tile choices: the target's tiles are attncc's)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(f"{name}: expected a 4-dimensional tensor [B, heads, length, head dim], got {shape}")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise InputError(
            f"query has {query.shape[1]} heads and key {key.shape[1]}: pass enable_gqa=True for grouped-query attention"
        )
    if mask_mod is not None and block_mask is not None:
        raise InputError("mask_mod and block_mask: give one (a BlockMask carries its mask_mod)")
    if return_aux is not None and return_lse:  # (torch's rule; return_lse was dropped, silently)
        raise InputError(
            "return_lse and return_aux: give one (return_lse is deprecated in torch: return_aux=AuxRequest(lse=True))"
        )
    scale = drop_in_scale(scale, "scale", "flex_attention")
    mask = mask_mod if mask_mod is not None else _mask_function(block_mask, query, key)
    program = _traced(score_mod, mask)
    kern = _kernel(program.source, query.device)
    if return_aux is None:
        return kern(query, key, value, scale=scale, return_lse=return_lse, **program.inputs)
    from torch.nn.attention.flex_attention import AuxOutput

    if getattr(return_aux, "max_scores", False):
        raise InputError("return_aux: max_scores is not kept by attncc's kernels (lse is)")
    if not getattr(return_aux, "lse", False):
        return kern(query, key, value, scale=scale, **program.inputs), AuxOutput()
    out, lse = kern(query, key, value, scale=scale, return_lse=True, **program.inputs)
    return out, AuxOutput(lse=lse)
