"""Hugging Face transformers models with their attention on attncc kernels.

    from attncc.integrations.transformers import register
    register("attncc")                                   # programs made from what each layer asks
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attncc")
    register("my-variant", "my_variant.attn")           # or every layer runs one DSL program

transformers calls the registered function per layer with q [B, H, N, D], k, v [B, Hkv, M, D]
(GQA heads not repeated: the kernels share each K/V head among its group), the layer's
`scaling`, `sliding_window`, `softcap`, `dropout`, learned sinks (GPT-OSS's `s_aux`) and its
padding mask. The mask function
registered beside it (`attncc_attention_mask`) is transformers' FlashAttention one with the
mask's pattern checked: it hands over the 2-D padding mask [B, M] (None where the model was
given none) instead of a dense [B, 1, N, M] mask, and refuses patterns the programs here do not
make (Llama 4's chunks, Gemma 3's image blocks: they ran as plain causal); each sequence's valid
keys are a contiguous range [kv_start, kv_end) of it (left or right padding), passed to the
kernel as two int[B] tensors, so padding costs no N x M mask and its tiles are skipped.

Sequences packed into rows (padding-free training, no padding mask) attend each within itself,
as transformers' FlashAttention path has them: the layer's `cu_seq_lens_q` / `cu_seq_lens_k`
(and `max_length_q` / `_k`) when the model is given them (DataCollatorWithFlattening), else
offsets read from the position ids wherever a position does not follow its predecessor (sdpa's
packed-sequence mask does the same), once per forward; the layer then runs as one
`kern.varlen` call over the flattened tokens.

Queries are the last N of the M key columns (a KV cache holds the M - N before them; padding
is columns masked out, not positions removed), so causal is bottom-right: query i sits at key
column i + M - N. The programs made here say so; a program given to `register` must too (its
inputs `kv_start`, `kv_end`, `window`, `cap` are filled by name where the model needs them).
Keys beyond the padding mask's columns (a static cache's unfilled slots) are cut off before the
call, as transformers' sdpa path does.

transformers is an optional dependency: `pip install 'attncc[transformers]'`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

import attncc
from attncc.errors import AttnccError
from attncc.runtime.kernel import Kernel
from attncc.runtime.ragged import VarlenPlan

T = TypeVar("T")

#: Keyword arguments of transformers' attention call that change its result and that no attncc
#: program receives here: a clear error instead of a silently different attention.
UNMAPPED_KWARGS = {
    "position_bias": "an additive position bias (T5-style)",
    "block_table": "a paged cache of transformers' continuous batching (call the kernel's .paged instead)",
    "indices": "the keys each query attends to (DeepSeek-V3.2's sparse top-k attention)",
    "block_indices": "the key blocks each query attends to (block-sparse attention)",
}
#: Runtime inputs of a program that this integration fills (name -> what it holds).
FILLED_INPUTS = {
    "kv_start": "int[B]: each sequence's first valid key (left padding)",
    "kv_end": "int[B]: one past each sequence's last valid key",
    "window": "int: the layer's sliding window (query position - key position < window)",
    "cap": "float: the layer's logit soft-cap (s = cap * tanh(s / cap))",
    "sinks": "float[H]: the layer's learned attention sinks (gpt-oss's `s_aux`: one more logit per query row)",
}
#: The keyword arguments that carry a layer's learned sinks ([H], one logit per query head).
SINK_KWARGS = ("s_aux", "sinks")


@dataclass(frozen=True)
class LayerNeeds:
    """What one attention call asks of its program."""

    causal: bool
    window: bool
    softcap: bool
    padding: bool
    dropout: float
    sinks: bool = False


def model_program(needs: LayerNeeds) -> str:
    """The DSL program for a layer with these needs (every number in it is formatted here from
    validated Python values; the parser checks the text like any program)."""
    lines = [f"attention hf_{'causal' if needs.causal else 'bidirectional'}"]
    if needs.padding:
        lines += ["input kv_start: int[B]", "input kv_end: int[B]"]
    if needs.window:
        lines.append("input window: int")
    if needs.softcap:
        lines.append("input cap: float")
    if needs.sinks:
        lines.append("input sinks: float[H]")
    lines.append("s = q @ k.T * scale")
    if needs.softcap:
        lines.append("s = cap * tanh(s / cap)")
    terms = ["j >= kv_start[b]", "j < kv_end[b]"] if needs.padding else []
    if needs.causal:
        terms.append("j <= i + M - N")  # query i is key column i + M - N
    if needs.window:
        terms.append("i + M - N - j < window")
    if terms:
        lines.append("mask " + " and ".join(terms))
    lines.append("p = softmax(s, sink=sinks[h])" if needs.sinks else "p = softmax(s)")
    if needs.dropout > 0:
        lines.append(f"p = dropout(p, {float(needs.dropout)!r})")
    lines += ["o = p @ v", "output o"]
    return "\n".join(lines) + "\n"


#: Model types that accept any registered attention name but never call the attention function
#: (their masks, made by the registered mask function, ran without attncc: Bloom silently wrong).
NO_ATTENTION_INTERFACE = {"bloom", "mpt"}
#: A layer's call without a `sliding_window=` keyword (PhiMoE's: its window is in the mask only).
NOT_PASSED = object()


def layer_window(module: torch.nn.Module, sliding_window: object) -> int | None:
    """The layer's sliding window: as passed; where the layer passes none but its config has a
    window in force (PhiMoE), the window is in transformers' mask alone, which the 2-D padding
    mask handed over here does not carry, and the layer may or may not slide: a clear error
    (it ran without the window, silently)."""
    if sliding_window is not NOT_PASSED:
        return sliding_window  # type: ignore[return-value]
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        raise AttnccError(
            f"{type(module).__name__}: the config's sliding_window={window} is not passed to the attention call "
            "(it is in the model's mask only), so attncc cannot tell whether this layer slides: no attncc mapping"
        )
    return None


def mask_pattern_window(mask_function: Callable) -> int | None:
    """The sliding window of a transformers mask function, checked to be a pattern the
    programs here make: causal or bidirectional, a sliding window, the padding and packed
    sequences (which reach the layers as the 2-D mask and the position ids). Anything else
    (Llama 4's chunks, Gemma 3's bidirectional image blocks, a custom mask) is a clear error:
    the FlashAttention mask function hands over the 2-D padding mask alone, so those ran as
    plain causal attention, silently."""
    from transformers import masking_utils as masks

    if mask_function in (masks.causal_mask_function, masks.bidirectional_mask_function):
        return None
    made_by = getattr(mask_function, "__qualname__", type(mask_function).__name__).split(".<locals>")[0]
    cells = (
        dict(zip(mask_function.__code__.co_freevars, mask_function.__closure__ or ()))
        if hasattr(mask_function, "__code__")
        else {}
    )
    if made_by == "and_masks" and "mask_functions" in cells:
        windows = [mask_pattern_window(part) for part in cells["mask_functions"].cell_contents]
        return min((w for w in windows if w is not None), default=None)
    if made_by in ("sliding_window_overlay", "sliding_window_bidirectional_overlay") and "sliding_window" in cells:
        return int(cells["sliding_window"].cell_contents)
    if made_by in ("remap_positions_for_packed_sequence", "add_offsets_to_mask_function") and "mask_function" in cells:
        # (positions within packed sequences, a cache's offsets: the layers get them as they are)
        return mask_pattern_window(cells["mask_function"].cell_contents)
    if made_by in ("padding_mask_function", "packed_sequence_mask_function"):
        return None
    what = {"chunked_overlay": "chunked attention (Llama 4's attention_chunk_size)", "or_masks": "a union of masks "
            "(Gemma 3's bidirectional image tokens, say)"}.get(made_by, f"the mask function `{made_by}`")  # fmt: skip
    raise AttnccError(f"the model's attention mask is {what}: no attncc mapping")


def attncc_attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor | None:
    """The mask function registered beside the attention: transformers' FlashAttention one (the
    2-D padding mask, sliced to the layer's keys) with the mask's pattern checked
    (`mask_pattern_window`), and an all-ones mask handed over as given (FlashAttention's turns
    it into None, where the layers then read packed sequences from the position ids that a
    given mask rules out)."""
    model_type = getattr(kwargs.get("config"), "model_type", None)
    if model_type in NO_ATTENTION_INTERFACE:
        raise AttnccError(
            f"{model_type} models compute attention in their own code, not through transformers' attention "
            "interface: attncc cannot run it (and the mask they would get from this name is not theirs)"
        )
    if mask_function is not None:
        mask_pattern_window(mask_function)
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def key_ranges(padding_mask: torch.Tensor, batch: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_start, kv_end) int64 [B] on the CPU from a 2-D padding mask [B, L] (1 or True: a real
    token) over the call's `keys` key columns (L > keys: the last `keys` columns, a
    sliding-window cache). Each row's valid keys must be one contiguous run."""
    if padding_mask.dim() != 2 or padding_mask.shape[0] != batch:
        raise AttnccError(
            f"attention_mask: expected the 2-D padding mask [B={batch}, keys] from transformers' "
            f"flash_attention_mask, got shape {tuple(padding_mask.shape)}"
        )
    # read on the host once per model forward: the kernels classify their tiles by these ranges
    # there (copying them to a GPU once per distinct ranges), so no layer's call reads them back
    valid = padding_mask[:, -keys:].to("cpu", torch.bool)
    length = valid.shape[1]
    position = torch.arange(length, device=valid.device).expand(batch, length)
    any_valid = valid.any(1)
    start = torch.where(any_valid, position.masked_fill(~valid, length).amin(1), 0)
    end = torch.where(any_valid, position.masked_fill(~valid, -1).amax(1) + 1, 0)
    if not torch.equal(valid.sum(1), end - start):
        rows = torch.nonzero(valid.sum(1) != end - start).flatten().tolist()
        raise AttnccError(
            f"attention_mask: rows {rows} have padding between real tokens (packed sequences?); attncc maps "
            "left or right padding only, one contiguous run of keys per sequence (use the kernel's .varlen "
            "for packed sequences)"
        )
    return start.to(torch.int64), end.to(torch.int64)


def plain_positions(position_ids: object, batch: int, length: int) -> bool:
    """Whether `position_ids` are one position per token, [B or 1, length] or [length] (not,
    say, multimodal rotary sections [3, B, length], which say nothing about packing here)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() > 2 or position_ids.shape[-1] != length:
        return False
    return position_ids.dim() == 1 or position_ids.shape[0] in (1, batch)


def packed_offsets(position_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor | None:
    """cu_seqlens (int64 [S + 1], on the host) of the sequences packed into the rows of a
    batch's `length` tokens, flattened row after row, from their position ids [B or 1, length]
    (transformers' rule, `find_packed_sequence_indices`: a sequence starts wherever a position is
    not its predecessor's plus one, and at every row's start); None where every row holds one
    sequence."""
    positions = position_ids.reshape(-1, position_ids.shape[-1]).expand(batch, length)
    starts = torch.ones(batch, length, dtype=torch.bool, device=positions.device)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    flat = starts.reshape(-1).cpu()
    if int(flat.sum()) == batch:
        return None
    return torch.cat([flat.nonzero().flatten(), torch.tensor([batch * length])])


class ModelAttention:
    """The function registered with transformers' AttentionInterface: one call per layer."""

    def __init__(self, program: str | Path | None = None) -> None:
        self.program = program
        self._lock = threading.Lock()
        self._kernels: dict[tuple[LayerNeeds, str], Kernel] = {}
        self._given: dict[str, Kernel] = {}
        # per kind ("ranges", "plan"): the last result, with the tensors it was made from (weakly:
        # a new tensor at the same address is another object), their versions and the sizes
        self._last: dict[str, tuple[tuple[weakref.ref, ...], tuple[int, ...], tuple, object]] = {}

    def once_per_forward(self, kind: str, sources: tuple[torch.Tensor, ...], sizes: tuple, make: Callable[[], T]) -> T:
        """make(), once per model forward rather than per layer: every layer gets the same mask,
        position ids or offsets, so the last result of `kind` is reused while it was made from
        these very tensors, unwritten since (their version counters), at these sizes."""
        with self._lock:
            last = self._last.get(kind)
        if last is not None:
            refs, versions, made_at, result = last
            if (
                made_at == sizes
                and all(ref() is t for ref, t in zip(refs, sources))
                and versions == tuple(t._version for t in sources)
            ):
                return result  # type: ignore[return-value]
        result = make()
        with self._lock:
            self._last[kind] = (
                tuple(weakref.ref(t) for t in sources),
                tuple(t._version for t in sources),
                sizes,
                result,
            )
        return result

    def ranges(self, padding_mask: torch.Tensor, batch: int, keys: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`key_ranges`, once per model forward; None where every key is a token (the mask was
        given, so the rows are not packed sequences, whatever their position ids)."""

        def make() -> tuple[torch.Tensor, torch.Tensor] | None:
            start, end = key_ranges(padding_mask, batch, keys)
            return None if bool((start == 0).all() and (end == keys).all()) else (start, end)

        return self.once_per_forward("ranges", (padding_mask,), (batch, keys), make)

    def packed_plan(self, layer: str, query: torch.Tensor, keys: int, **kwargs: object) -> VarlenPlan | None:
        """The packed sequences of a layer without a padding mask, as a `VarlenPlan` on q's
        device (once per model forward): from `cu_seq_lens_q` / `_k` (and `max_length_*`) where
        the model was given them, else from plain position ids (`packed_offsets`) where a row
        holds several sequences and no cache precedes its queries; None otherwise."""
        cu_q, cu_k, position_ids = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), kwargs.get("position_ids")
        if (cu_q is None) != (cu_k is None):
            raise AttnccError(f"{layer}: cu_seq_lens_q and cu_seq_lens_k go together, got one")
        device, (batch, _, length, _) = query.device, query.shape
        if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor):
            longest = tuple(
                int(m) if m is not None else None for m in (kwargs.get("max_length_q"), kwargs.get("max_length_k"))
            )
            make = lambda: attncc.plan_varlen(cu_q.to(device), cu_k.to(device), *longest)  # noqa: E731
            return self.once_per_forward("plan", (cu_q, cu_k), (device, *longest), make)
        if not (plain_positions(position_ids, batch, keys) and length == keys > 1):
            return None

        def from_positions() -> VarlenPlan | None:
            offsets = packed_offsets(position_ids, batch, keys)  # type: ignore[arg-type]
            return None if offsets is None else attncc.plan_varlen(*2 * [offsets.to(device)])

        return self.once_per_forward("plan", (position_ids,), (device, batch, keys), from_positions)  # type: ignore[arg-type]

    def kernel(self, needs: LayerNeeds, device: torch.device) -> Kernel:
        target = "cuda" if device.type == "cuda" else "cpu"
        with self._lock:
            if self.program is not None:
                if target not in self._given:
                    self._given[target] = attncc.compile(self.program, target=target)
                return self._given[target]
            if (needs, target) not in self._kernels:
                self._kernels[needs, target] = attncc.compile(model_program(needs), target=target)
            return self._kernels[needs, target]

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: object = NOT_PASSED,
        softcap: float | None = None,
        is_causal: bool | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        for name, what in UNMAPPED_KWARGS.items():
            if kwargs.get(name) is not None:
                raise AttnccError(f"{type(module).__name__}: `{name}` ({what}) has no attncc mapping")
        sliding_window = layer_window(module, sliding_window)
        sinks = next((kwargs[name] for name in SINK_KWARGS if kwargs.get(name) is not None), None)
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if sliding_window is not None and not causal:
            raise AttnccError(f"{type(module).__name__}: a bidirectional sliding window has no attncc mapping")
        batch, keys = query.shape[0], key.shape[2]
        if attention_mask is None:  # sequences packed into rows (padding-free training): each its own
            plan = self.packed_plan(type(module).__name__, query, keys, **kwargs)
            if plan is not None:
                return self.packed(
                    module, query, key, value, plan, dropout, scaling, sliding_window, softcap, causal, sinks
                )  # fmt: skip
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] < keys:
            keys = attention_mask.shape[1]  # a static cache: the slots past the mask hold no token yet
            key, value = key[:, :, :keys], value[:, :, :keys]
        ranges = self.ranges(attention_mask, batch, keys) if attention_mask is not None else None  # type: ignore[arg-type]
        needs = LayerNeeds(
            causal,
            sliding_window is not None,
            softcap is not None,
            ranges is not None,
            float(dropout),
            sinks is not None,
        )

        def key_ranges_or_all() -> tuple[torch.Tensor, torch.Tensor]:
            device = query.device
            return ranges or (
                torch.zeros(batch, dtype=torch.int64, device=device),
                torch.full((batch,), keys, dtype=torch.int64, device=device),
            )

        kern, runtime = self.layer_call(module, needs, query.device, key_ranges_or_all, sliding_window, softcap, sinks)
        out = kern(query, key, value, scale=scaling, train=dropout > 0, **runtime)
        return out.transpose(1, 2).contiguous(), None

    def layer_call(
        self,
        module: torch.nn.Module,
        needs: LayerNeeds,
        device: torch.device,
        ranges: Callable[[], tuple[torch.Tensor, torch.Tensor]],
        sliding_window: int | None,
        softcap: float | None,
        sinks: object = None,
    ) -> tuple[Kernel, dict[str, object]]:
        """The layer's kernel and runtime inputs: each sequence's key range, ranges() (kv_start,
        kv_end int[B], made only where the program reads them), the window and the cap where the
        layer has them; a given program is checked against what the layer needs."""
        kern = self.kernel(needs, device)
        declared = {d.name for d in kern.inputs}
        runtime: dict[str, object] = {}
        if needs.padding or {"kv_start", "kv_end"} & declared:  # (a given program's: all keys valid where no padding)
            runtime.update(zip(("kv_start", "kv_end"), ranges()))
        if sliding_window is not None:
            runtime["window"] = int(sliding_window)
        if softcap is not None:
            runtime["cap"] = float(softcap)
        if sinks is not None:  # (a parameter: its gradient flows through the call)
            runtime["sinks"] = sinks
        if self.program is not None:
            check_given_program(kern, declared, runtime, needs, type(module).__name__)
        return kern, runtime

    def packed(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: VarlenPlan,
        dropout: float,
        scaling: float | None,
        sliding_window: int | None,
        softcap: float | None,
        causal: bool,
        sinks: object = None,
    ) -> tuple[torch.Tensor, None]:
        """The layer over sequences packed into its rows, as FlashAttention's varlen call takes
        them (transformers' `cu_seq_lens_q`/`_k` over the flattened tokens, or offsets read from
        the position ids, planned once per forward): one `kern.varlen` call, each sequence
        attending within itself (its N and M its own, so the made programs' bottom-right causal
        mask is each sequence's)."""
        batch, heads, length, _ = query.shape
        needs = LayerNeeds(
            causal, sliding_window is not None, softcap is not None, False, float(dropout), sinks is not None
        )
        lengths = plan.packed.lengths[1]  # (on the host) each sequence's keys, all valid
        all_keys = lambda: (torch.zeros_like(lengths), lengths)  # noqa: E731
        kern, runtime = self.layer_call(module, needs, query.device, all_keys, sliding_window, softcap, sinks)
        # [B, H, N, D] -> the tokens row after row, [B N, H, D] (a view of the layer's projections)
        q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (query, key, value))
        out = kern.varlen(q, k, v, plan=plan, scale=scaling, train=dropout > 0, **runtime)
        return out.view(batch, length, heads, out.shape[-1]), None


def check_given_program(
    kern: Kernel, declared: set[str], runtime: dict[str, object], needs: LayerNeeds, layer: str
) -> None:
    """A clear error where a layer needs what the given program does not declare, or the
    program declares an input no transformers call fills."""
    for name in sorted(declared - FILLED_INPUTS.keys()):
        raise AttnccError(
            f"program {kern.name}: input `{name}` has no value in a transformers attention call "
            f"(filled by name: {'; '.join(f'{n} {w}' for n, w in FILLED_INPUTS.items())})"
        )
    for name in sorted(runtime.keys() - declared):
        raise AttnccError(
            f"{layer}: the layer needs `{name}` ({FILLED_INPUTS[name]}), which program {kern.name} does not declare"
        )
    for name in sorted(declared - runtime.keys()):
        raise AttnccError(f"program {kern.name}: input `{name}` ({FILLED_INPUTS[name]}), but layer {layer} has none")
    if needs.dropout > 0 and kern.op.dropout != needs.dropout:
        raise AttnccError(
            f"{layer}: the layer asks for attention dropout {needs.dropout}, program {kern.name} has {kern.op.dropout}"
        )


def register(name: str = "attncc", program: str | Path | None = None) -> ModelAttention:
    """Register attncc under `name` with transformers' AttentionInterface (and the FlashAttention
    mask function with its AttentionMaskInterface, so layers get the 2-D padding mask), so that
    `attn_implementation=name` runs every attention layer on attncc kernels. With `program` (a
    .attn path or DSL text) every layer runs that program; without, each layer runs a program
    made from its needs (causal, sliding window, softcap, padding, dropout)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as err:
        raise AttnccError(
            "attncc.integrations.transformers needs transformers: pip install 'attncc[transformers]'"
        ) from err
    attention = ModelAttention(program)
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, attncc_attention_mask)
    return attention
