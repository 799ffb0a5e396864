"""Hugging Face transformers models with their attention on attncc kernels.

    from attncc.integrations.transformers import register
    register("attncc")                                   # programs made from what each layer asks
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attncc")
    register("my-variant", "my_variant.attn")           # or every layer runs one DSL program

transformers calls the registered function per layer with q [B, H, N, D], k, v [B, Hkv, M, D]
(GQA heads not repeated: the kernels share each K/V head among its group), the layer's
`scaling`, `sliding_window`, `softcap`, `dropout`, learned sinks (GPT-OSS's `s_aux`) and its
padding mask. The mask function
registered beside it (`attncc_attention_mask`) reads transformers' mask function (`mask_term`)
instead of evaluating it: it hands over the padding mask's rows [B, 1, 1, M] (None where the model was
given none) instead of a dense [B, 1, N, M] mask where the pattern is causal, bidirectional or
a sliding window, and beside it (a `ModelMask`, kept by the mask tensor) the pattern as a DSL
predicate and the runtime inputs it reads where it says more: Llama 4's attention chunks, Gemma
3's bidirectional image blocks, bidirectional windows; anything else is a clear error. Each sequence's valid
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

import dis
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

import attncc
from attncc.errors import AttnccError
from attncc.integrations.made import MadeKernels, masked_softmax_output
from attncc.passes.sparsity import values_key
from attncc.runtime.kernel import Kernel, keep_bounded
from attncc.runtime.locks import instance_lock, module_lock
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
    "chunk": "int: the layer's attention chunk (Llama 4's attention_chunk_size)",
    "first_key": "int[B]: each sequence's position of the call's first key column, counted from its first "
    "token (chunks start there, after left padding)",
    "blocks": "int[B, M]: each key column's image block (Gemma 3's token groups, -1 for text; queries are the "
    "last N columns)",
    "kept": "bool[B, N, M]: the keys each query attends to, a dense mask made under torch.compile from a mask "
    "function attncc cannot read there",
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
    dropout: bool  # (its rate is the call's `dropout_p`: one program for every rate)
    sinks: bool = False
    #: a mask pattern beyond causal and window (`ModelMask`): its predicate and inputs' declarations
    pattern: tuple[str, tuple[tuple[str, str], ...]] | None = None


#: The DSL predicates of transformers' mask functions over the call's i, j (query i is key column
#: i + M - N), with the runtime inputs (`FILLED_INPUTS`) they read.
CAUSAL_TERM = "j <= i + M - N"
WINDOW_TERM = "i + M - N - j < window"
CHUNK_TERM = "(j + first_key[b]) // chunk == (i + M - N + first_key[b]) // chunk"
BLOCK_TERM = "blocks[b, i + M - N] >= 0 and blocks[b, i + M - N] == blocks[b, j]"
#: A dense mask [B, N, M] made in a compiled graph (`dense_mask`): the whole pattern, padding in it.
DENSE_TERM = "kept[b, i, j]"


def model_program(needs: LayerNeeds) -> str:
    """The DSL program for a layer with these needs (every number in it is formatted here from
    validated Python values, the pattern's predicate is made of the fixed terms above; the
    parser checks the text like any program)."""
    kind = "masked" if needs.pattern else "causal" if needs.causal else "bidirectional"
    lines = [f"attention hf_{kind}"]
    if needs.padding:
        lines += ["input kv_start: int[B]", "input kv_end: int[B]"]
    if needs.window:
        lines.append("input window: int")
    if needs.softcap:
        lines.append("input cap: float")
    if needs.sinks:
        lines.append("input sinks: float[H]")
    if needs.pattern:
        lines += [f"input {name}: {kind}" for name, kind in needs.pattern[1]]
    lines.append("s = q @ k.T * scale")
    if needs.softcap:
        lines.append("s = cap * tanh(s / cap)")
    terms = ["j >= kv_start[b]", "j < kv_end[b]"] if needs.padding else []
    if needs.pattern:
        terms.append(f"({needs.pattern[0]})")  # (the pattern says whether the layer is causal)
    elif needs.causal:
        terms.append(CAUSAL_TERM)
    if needs.window:
        terms.append(WINDOW_TERM)
    tail = masked_softmax_output(terms, needs.dropout, "sinks[h]" if needs.sinks else None)
    return "\n".join(lines + tail) + "\n"


#: Model types attncc cannot run, and why. Those that accept any registered attention name but
#: compute attention in their own code apply the masks made by the registered mask function as
#: theirs (Bloom ran without a causal mask; GPT-NeoX-Japanese, ImageGPT, MegatronBert, RoFormer
#: and RemBert decoders 0.01-0.5 off in their logits, session 64's review): named here, so that
#: a compiled forward (whose callers `own_attention` cannot see) is refused too, and found by
#: `own_attention` in eager calls beyond the list. Doge adds a learned dynamic mask to the
#: scores, made in its own code from a 4-D mask (given the 2-D padding mask it failed there
#: with an IndexError).
OWN_CODE = "compute attention in their own code, not through transformers' attention interface"
UNSUPPORTED_MODELS = {
    **dict.fromkeys(
        ("bloom", "mpt", "gpt_neox_japanese", "imagegpt", "megatron-bert", "roformer", "rembert", "xglm"), OWN_CODE
    ),
    "doge": "add a learned dynamic mask, made in their own code from a 4-D attention mask, to the scores",
}
#: The name a modeling module imports where its layers call transformers' attention interface
#: (every such module of transformers 5 imports it from modeling_utils; Doge's defines its own).
INTERFACE_NAME = "ALL_ATTENTION_FUNCTIONS"
INTERFACE_HOME = "transformers.modeling_utils"  # (where it is made: PreTrainedModel's module)
_OWN_ATTENTION: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def own_attention(model: torch.nn.Module) -> bool:
    """Whether a model computes attention in its own code: no class of its modules (nor any
    class those derive from) is defined in a module that imports the attention interface
    (`INTERFACE_NAME`; PreTrainedModel's own module, which makes it, aside). A user's subclass
    of a transformers layer derives from it; a LoRA or quantised Linear (peft, bitsandbytes)
    computes no attention either way. Kept per model."""
    known = _OWN_ATTENTION.get(model)
    if known is None:
        modules = {base.__module__ for m in model.modules() for base in type(m).__mro__} - {INTERFACE_HOME}
        known = not any(hasattr(sys.modules.get(name), INTERFACE_NAME) for name in modules)
        _OWN_ATTENTION[model] = known
    return known


def model_asking(frames: int = 8) -> torch.nn.Module | None:
    """The model whose method asks for the mask being made (transformers calls the mask function
    from the model's forward, or generate's, through a few functions): the nearest of `frames`
    callers that is a method of an nn.Module; None where there is none."""
    frame = sys._getframe(2)
    for _ in range(frames):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self":
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.nn.Module):
                return owner
        frame = frame.f_back
    return None


#: A layer's call without a `sliding_window=` keyword (PhiMoE's: its window is in the mask only).
NOT_PASSED = object()


#: Configs the mask function made masks for (by id, the config held weakly): whether any of those
#: masks carried a sliding window (`layer_window`).
_MASK_WINDOWS: dict[int, tuple[weakref.ref, bool]] = {}
_WINDOWS_LOCK = module_lock(__name__, "_WINDOWS_LOCK")


def note_mask_window(config: object, windowed: bool) -> None:
    """Record that the mask function made a mask for `config`, with or without a window
    (eager calls: torch.compile traces neither the lock nor the weak reference)."""
    if config is None or torch.compiler.is_compiling():
        return
    key = id(config)
    with _WINDOWS_LOCK:
        known = _MASK_WINDOWS.get(key)
        if known is not None and known[0]() is config:
            if windowed and not known[1]:
                _MASK_WINDOWS[key] = (known[0], True)
            return
        try:
            ref = weakref.ref(config, lambda _, key=key: _MASK_WINDOWS.pop(key, None))
        except TypeError:  # (an object that takes no weak reference: nothing is known of it)
            return
        _MASK_WINDOWS[key] = (ref, windowed)


def masks_never_windowed(config: object) -> bool:
    """Whether masks were made for `config` and none of them carried a sliding window (known in
    eager calls alone: `note_mask_window`)."""
    if torch.compiler.is_compiling():
        return False
    with _WINDOWS_LOCK:
        known = _MASK_WINDOWS.get(id(config))
    return known is not None and known[0]() is config and not known[1]


def layer_window(module: torch.nn.Module, sliding_window: object) -> int | None:
    """The layer's sliding window: as passed; where the layer passes none but its config has a
    window in force, the window is in transformers' mask alone, if anywhere. Where every mask
    the mask function made for the layer's config had no window (Moshi's configs carry a
    `sliding_window` its modeling code never applies), the layer does not slide; where one had
    a window (PhiMoE's), or none was made through it (or under torch.compile), the 2-D padding
    mask handed over here does not say whether this layer slides: a clear error (it ran without
    the window, silently)."""
    if sliding_window is not NOT_PASSED:
        return sliding_window  # type: ignore[return-value]
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        if masks_never_windowed(config):
            return None
        raise AttnccError(
            f"{type(module).__name__}: the config's sliding_window={window} is not passed to the attention call "
            "(it is in the model's mask only), so attncc cannot tell whether this layer slides: no attncc mapping"
        )
    return None


@dataclass(frozen=True)
class MaskTerm:
    """A transformers mask function read as a DSL predicate over one call's i, j."""

    text: str | None  # None: every score kept (padding and packing reach the layer otherwise)
    inputs: dict[str, tuple[str, object]]  # name -> (DSL type, value), names from FILLED_INPUTS
    pattern: bool  # says more than causal, bidirectional and a window: the layer needs a `ModelMask`
    packed: torch.Tensor | None = None  # [B, L]: each token's sequence among those packed into its row


@dataclass(frozen=True)
class ModelMask:
    """What a layer's mask says beyond its 2-D padding mask: the pattern's predicate (Llama 4's
    chunks, Gemma 3's image blocks, bidirectional windows; None: the layer's own causal /
    window) and the runtime inputs it reads (on the host); the offsets of sequences packed into
    the rows (cu_seqlens over the flattened tokens, on the host), which not every model passes
    its layers as position ids. The mask function hands the layers a tensor [B, 1, 1, keys]
    (`carried`: its dtype says causal, bidirectional or a pattern) and keeps this beside it
    (`mask_pattern`): transformers passes masks on to the layers as tensors only, and copies them
    (`.contiguous()`: a carrier is contiguous, so that is the carrier itself)."""

    predicate: str | None
    inputs: dict[str, tuple[str, object]]
    packed_offsets: torch.Tensor | None = None
    #: whether the mask function's mask is causal (None: not known here; the predicate says it):
    #: the layers follow it over their `is_causal`, as eager and sdpa, which read the mask, do
    #: (Step3p7's bidirectional full layers keep is_causal=True, Aimv2's causal text model False)
    causal: bool | None = None
    #: the carrier stands for no mask at all (a bidirectional mask without padding): read as None
    no_padding: bool = False
    #: the call's keys past the mask's columns are a static cache's empty slots (the mask function
    #: was asked for more keys than the tokens so far): the layer cuts them off
    empty_after: bool = False


#: The patterns of the last PATTERNS_KEPT masks the mask function handed out holding one, by the
#: address of the carrier's storage, with the 2-D tensor holding it (kept, so no other tensor
#: takes the address while it is here; a weak reference died with the carrier under
#: torch.inference_mode, whose views keep no base, before the model's slice of it was read).
_MASK_PATTERNS: dict[int, tuple[torch.Tensor, ModelMask]] = {}
PATTERNS_KEPT = 32
_PATTERNS_LOCK = module_lock(__name__, "_PATTERNS_LOCK")


#: The dtypes of the masks [B, 1, 1, M] the mask function hands out (`carried`), which tell the
#: layers what they hold: a causal or a bidirectional padding mask, or one with a pattern recorded
#: beside it. The dtype is what a traced layer can read under torch.compile, where a mask, made in
#: the graph or given to it, has no identity to look up; none is one that transformers makes or a
#: user's mask has (int64, int32, uint8 or bool 4-D masks given to a model reached the layers as
#: they are and read as carriers: a causal model ran bidirectional, 12.2 off sdpa).
CARRIER_DTYPES = {
    "causal": torch.int8,
    "bidirectional": torch.uint16,
    "pattern": torch.int16,
    # the same, the call's keys past the mask's columns a static cache's empty slots (`empty_after`)
    "causal, empty slots after": torch.uint32,
    "bidirectional, empty slots after": torch.uint64,
}


def carried(mask: torch.Tensor, pattern: ModelMask) -> torch.Tensor:
    """`mask` [B, keys] as a carrier [B, 1, 1, keys] (`CARRIER_DTYPES`; contiguous, so
    transformers' `.contiguous()` returns this very tensor; 4-D, so a model's own slicing of
    sdpa-like masks, `mask[:, :, -n:, :]`, takes it: Gemma 4's KV-shared layers' queries, an
    IndexError on a 2-D mask): a plain causal or bidirectional mask by its dtype alone; one that
    says more (a predicate, packed sequences, no padding at all) with `pattern` recorded beside
    it for the layers (`mask_pattern`; the last PATTERNS_KEPT such masks), which torch.compile
    cannot trace: a clear error there."""
    # (no padding at all reads as no mask in eager mode; a bidirectional mask of ones under
    # torch.compile, where every key's range is the same)
    plain = pattern.predicate is None and pattern.packed_offsets is None
    plain = plain and not (pattern.no_padding and not torch.compiler.is_compiling())
    if plain and pattern.causal is not None:
        kind = ("causal" if pattern.causal else "bidirectional") + (
            ", empty slots after" if pattern.empty_after else ""
        )
        return mask.to(CARRIER_DTYPES[kind]).contiguous()[:, None, None]
    if torch.compiler.is_compiling():
        raise AttnccError(REFUSED_UNDER_COMPILE)
    # (kept by the storage of the 2-D tensor the carrier is a view of: a model's slices of the
    # carrier, Gemma 4's `mask[:, :, -n:, :]`, are views of it too, with no `_base` under
    # torch.inference_mode; while the tensor lives its storage is no other's)
    base = mask.to(CARRIER_DTYPES["pattern"]).clone()
    with _PATTERNS_LOCK:
        keep_bounded(_MASK_PATTERNS, base.untyped_storage().data_ptr(), (base, pattern), PATTERNS_KEPT)
    return base[:, None, None]


#: Why a mask made outside a compiled graph that holds a pattern (`carried`) cannot run there.
REFUSED_UNDER_COMPILE = (
    "the model's attention mask, made outside the compiled graph, holds a pattern beyond causal, bidirectional and "
    "sliding-window masks: attncc maps it in eager mode only, not under torch.compile, which reads such a mask's "
    "dtype alone (masks the compiled forward makes itself run as sdpa's dense mask)"
)


def mask_pattern(mask: object) -> ModelMask | None:
    """What a mask the mask function handed out holds (`carried`), else None (a mask of
    another dtype is none of its)."""
    kind = next((name for name, dtype in CARRIER_DTYPES.items() if dtype == getattr(mask, "dtype", None)), None)
    if kind is None or mask.dim() != 4 or mask.shape[1:3] != (1, 1):  # type: ignore[union-attr]
        return None
    if kind != "pattern":
        return ModelMask(None, {}, causal=kind.startswith("causal"), empty_after=kind.endswith("after"))
    if torch.compiler.is_compiling():  # (made outside the graph, given to it: generate's masks)
        raise AttnccError(REFUSED_UNDER_COMPILE)
    with _PATTERNS_LOCK:
        entry = _MASK_PATTERNS.get(mask.untyped_storage().data_ptr()) if mask.numel() else None  # type: ignore[union-attr]
    base = entry[0] if entry is not None else None
    if base is None or mask.shape[0] != base.shape[0] or mask.shape[-1] != base.shape[-1]:  # type: ignore[union-attr]
        # (a copy, or a cut of its rows or keys: it ran without the pattern, silently)
        raise AttnccError(
            "the model copied an attention mask that holds a pattern beyond causal, bidirectional and sliding-window "
            "masks (kept beside the mask handed out), or cut its batch or keys: no attncc mapping"
        )
    return entry[1]  # type: ignore[index]


def padding_of(mask: torch.Tensor | None) -> torch.Tensor | None:
    """The 2-D padding mask [B, keys] of a carrier [B, 1, 1, keys] (`carried`), or of any
    mask [B, keys] given as it is."""
    if mask is not None and mask.dim() == 4 and mask.dtype in CARRIER_DTYPES.values() and mask.shape[1:3] == (1, 1):
        return mask[:, 0, 0]
    return mask


def same_value(a: object, b: object) -> bool:
    """Whether two read values of one input agree (tensors by their values)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b))
    return a == b


def combined(how: str, parts: list[MaskTerm]) -> MaskTerm:
    """and_masks / or_masks of read terms (a term that keeps every score drops out of an `and`
    and makes an `or` keep every score); one input name read with two values is an error."""
    inputs: dict[str, tuple[str, object]] = {}
    for part in parts:
        for name, (kind, value) in part.inputs.items():
            if name in inputs and not same_value(inputs[name][1], value):
                raise AttnccError(f"the model's attention mask combines two values of {name}: no attncc mapping")
            inputs[name] = (kind, value)
    texts = [part.text for part in parts]
    pattern = any(part.pattern for part in parts)
    packed = next((part.packed for part in parts if part.packed is not None), None)
    if how == "or" and None in texts:
        return MaskTerm(None, {}, pattern, packed)
    kept = [f"({text})" for text in texts if text is not None]
    text = f" {how} ".join(kept) if len(kept) > 1 else kept[0][1:-1] if kept else None
    return MaskTerm(text, inputs, pattern, packed)


def sequence_offsets(sequence_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (int64 [S + 1], on the host) of the sequences packed into rows, from each
    token's sequence index [B, L] (transformers' packed-sequence mask): one starts wherever the
    index changes and at every row's start, the rows flattened one after another."""
    ids = sequence_ids.to("cpu")
    return offsets_from_starts(torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool), ids[:, 1:] != ids[:, :-1]], 1))


def offsets_from_starts(starts: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (int64 [S + 1], on the host) of the rows' tokens flattened one row after another,
    from where sequences start [B, L] (bool, True at every row's first token)."""
    flat = starts.reshape(-1).cpu()
    return torch.cat([flat.nonzero().flatten(), torch.tensor([flat.numel()], device="cpu")])


def reads_nothing(function: Callable) -> bool:
    """Whether a function reads none of its arguments and has no closure (a constant of the
    module's globals alone: EmbeddingGemma's `lambda *args: torch.tensor(True)`)."""
    code = getattr(function, "__code__", None)
    if code is None or getattr(function, "__closure__", None):
        return False
    arguments = set(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x04)])
    return not any(
        instruction.opname.startswith("LOAD_FAST") and instruction.argval in arguments
        for instruction in dis.get_instructions(code)
    )


def mask_term(mask_function: Callable, key_offset: int = 0, keys: int = 0) -> MaskTerm:
    """transformers' mask function, read from its makers' closures, as a DSL predicate over a
    call's keys: `keys` key columns from position `key_offset` of the sequence on (the cache's
    offset; queries are the last columns). Causal, bidirectional, sliding windows, Llama 4's
    chunks and Gemma 3's image blocks, combined by and_masks / or_masks; padding keeps every
    score here (it reaches the layers as the 2-D mask), and so do packed sequences, whose
    sequence ids the term carries (`packed`) for the layers' varlen calls.
    Anything else (a custom function) is a clear error: the FlashAttention mask function hands
    over the 2-D padding mask alone, so it ran as plain causal attention, silently."""
    from transformers import masking_utils as masks

    if mask_function is masks.causal_mask_function:
        return MaskTerm(CAUSAL_TERM, {}, False)
    if mask_function is masks.bidirectional_mask_function:
        return MaskTerm(None, {}, False)
    made_by = getattr(mask_function, "__qualname__", type(mask_function).__name__).split(".<locals>")[0]
    cells = (
        {
            name: cell.cell_contents
            for name, cell in zip(mask_function.__code__.co_freevars, mask_function.__closure__ or ())
        }
        if hasattr(mask_function, "__code__")
        else {}
    )
    if made_by in ("and_masks", "or_masks") and "mask_functions" in cells:
        parts = [mask_term(part, key_offset, keys) for part in cells["mask_functions"]]
        return combined(made_by[:-6], parts)
    if made_by == "sliding_window_overlay" and "sliding_window" in cells:
        return MaskTerm(WINDOW_TERM, {"window": ("int", int(cells["sliding_window"]))}, False)
    if (
        made_by in ("sliding_window_bidirectional_overlay", "_bidirectional_window_overlay")
        and "sliding_window" in cells
    ):
        # (the layers pass their flash window, not this one: the pattern carries it; Gemma 3's own
        # overlay, for use_bidirectional_attention, excludes the window's edge)
        within = "<=" if made_by == "sliding_window_bidirectional_overlay" else "<"
        window = {"window": ("int", int(cells["sliding_window"]))}
        return MaskTerm(f"abs(i + M - N - j) {within} window", window, True)
    if made_by in ("remap_positions_for_packed_sequence", "add_offsets_to_mask_function") and "mask_function" in cells:
        # (positions within packed sequences, a cache's offsets: the layers get them as they are)
        return mask_term(cells["mask_function"], key_offset, keys)
    if made_by == "padding_mask_function":
        return MaskTerm(None, {}, False)
    if made_by == "packed_sequence_mask_function" and "packed_sequence_mask" in cells:
        return MaskTerm(None, {}, False, torch.as_tensor(cells["packed_sequence_mask"]))
    if made_by == "chunked_overlay" and {"chunk_size", "left_padding"} <= cells.keys():
        # chunks count from each sequence's first token: key column j is position j + first_key[b] there
        first_key = key_offset - torch.as_tensor(cells["left_padding"]).to("cpu", torch.int64)
        chunk = int(cells["chunk_size"])
        return MaskTerm(CHUNK_TERM, {"chunk": ("int", chunk), "first_key": ("int[B]", first_key)}, True)
    if made_by == "blockwise_overlay" and "block_sequence_ids" in cells:
        ids = torch.as_tensor(cells["block_sequence_ids"]).to("cpu", torch.int64)
        ids = torch.nn.functional.pad(ids, (0, max(key_offset + keys - ids.shape[-1], 0)), value=-1)
        return MaskTerm(BLOCK_TERM, {"blocks": ("int[B, M]", ids[:, key_offset : key_offset + keys])}, True)
    if reads_nothing(mask_function) and bool(mask_function(*map(torch.tensor, (0, 0, 0, 1)))):
        return MaskTerm(None, {}, False)  # (Gemma 3's `lambda *args: torch.tensor(True)`: every score kept)
    code = getattr(mask_function, "__code__", None)
    where = f" ({Path(code.co_filename).name}:{code.co_firstlineno})" if code is not None else ""
    name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
    raise AttnccError(f"the model's attention mask is the mask function `{name}`{where}: no attncc mapping")


def same_sequence(cu_q: torch.Tensor, cu_k: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[B, 1, N, M] bool: whether query i and key j of a row lie in one of the sequences packed
    into the rows (cu_seq_lens over the rows' tokens flattened one row after another), made in
    the graph (no offset read on the host): what a dense mask of packed rows is ANDed with where
    its mask function did not see the packing (gpt-oss's masks take no position ids; Llama 4's
    chunks were dropped instead, 11.0 off)."""
    batch, _, queries, keys = shape
    rows = [
        torch.searchsorted(
            cu[1:].to(torch.int64).contiguous(), torch.arange(batch * n, device=cu.device), right=True
        ).view(batch, n)
        for cu, n in ((cu_q, queries), (cu_k, keys))
    ]
    return (rows[0][:, :, None] == rows[1][:, None, :]).to(cu_q.device)[:, None]


def plain_mask_function(mask_function: Callable | None) -> bool:
    """Whether a mask function is none, transformers' causal or its bidirectional one (read by
    identity: torch.compile can read no other function's closure)."""
    from transformers import masking_utils as masks

    return mask_function is None or mask_function in (masks.causal_mask_function, masks.bidirectional_mask_function)


def dense_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int,
    kv_offset: int,
    mask_function: Callable,
    attention_mask: torch.Tensor | None,
    **kwargs: object,
) -> torch.Tensor:
    """The mask [B, 1, N, M] (bool, True: kept) that sdpa gets, made in the graph where
    torch.compile traces a mask function attncc cannot read (a closure: a sliding window's
    `and_masks`, packed sequences found from position ids): the layers read it as a runtime input
    (`DENSE_TERM`), at sdpa's cost of one N x M mask per mask function and forward."""
    from transformers.masking_utils import sdpa_mask

    padding = None if attention_mask is None else attention_mask.to(torch.bool)
    return sdpa_mask(
        batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, padding,
        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, device=kwargs.get("device", "cpu"),
    )  # fmt: skip


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
    2-D padding mask, sliced to the layer's keys) where the pattern is causal, bidirectional or
    a window (the layers know those), with its `ModelMask` beside it (`carried`) where it says
    more (`mask_term`); ones over the filled key columns where a static cache has empty slots
    and no padding mask was given (`filled_keys`); an all-ones mask handed over as given
    (FlashAttention's turns it into None, where the layers then read packed sequences from the
    position ids that a given mask rules out)."""
    model_type = getattr(kwargs.get("config"), "model_type", None)
    if model_type in UNSUPPORTED_MODELS:
        raise AttnccError(
            f"{model_type} models {UNSUPPORTED_MODELS[model_type]}: attncc cannot run it (and the mask they would "
            "get from this name is not theirs)"
        )
    if (isinstance(attention_mask, torch.Tensor) and attention_mask.is_meta) or str(kwargs.get("device")) == "meta":
        return None  # (a model on the meta device: its layers give shapes alone, `ModelAttention`)
    if not torch.compiler.is_compiling():  # (compiled: the callers are dynamo's; the list above alone)
        model = model_asking()
        if model is not None and own_attention(model):
            raise AttnccError(
                f"{type(model).__name__} ({model_type}) computes attention in its own code, not through transformers' "
                "attention interface: attncc cannot run it (and the mask it would get from this name is not its own); "
                "use attn_implementation='eager' or 'sdpa'"
            )
    if torch.compiler.is_compiling() and not plain_mask_function(mask_function):
        return dense_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)
    padding = None if attention_mask is None else attention_mask[:, -kv_length:]
    term = mask_term(mask_function, kv_offset, kv_length) if mask_function is not None else MaskTerm(None, {}, False)
    note_mask_window(kwargs.get("config"), "window" in term.inputs)
    if padding is None and CAUSAL_TERM in (term.text or ""):
        # (keys past the last query's position are empty slots in a causal decoder; a cross-
        # attention's keys are no positions, and its masks are bidirectional)
        keys = filled_keys(q_offset, q_length, kv_offset, kv_length)
        if keys is not None:  # a mask of ones over the filled columns: the layer cuts the rest off
            padding = torch.ones(batch_size, keys, dtype=torch.bool, device=kwargs.get("device", "cpu"))  # type: ignore[arg-type]
    empty_after = padding is not None and padding.shape[1] < kv_length  # (a static cache's slots past the tokens)
    if not term.pattern and term.packed is None:
        if mask_function is None:
            return padding
        causal = CAUSAL_TERM in (term.text or "")
        if padding is not None:  # (what the mask says of causality rides on it: `ModelMask.causal`)
            return carried(padding, ModelMask(None, {}, causal=causal, empty_after=empty_after))
        if causal:  # (no mask: the layers' own causal flag, as ever; nothing to hand out)
            return None
        ones = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device", "cpu"))  # type: ignore[arg-type]
        return carried(ones, ModelMask(None, {}, causal=False, no_padding=True))
    if made_ahead_for_generate():  # (a compiled forward reads the carrier by its dtype alone)
        return dense_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, **kwargs)
    predicate = (term.text or "j >= 0") if term.pattern else None  # ("j >= 0": every key column)
    offsets = None if term.packed is None else sequence_offsets(term.packed)
    if padding is None:  # (packed sequences, or a pattern without padding: a carrier of ones)
        padding = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device", "cpu"))  # type: ignore[arg-type]
    return carried(padding, ModelMask(predicate, term.inputs if term.pattern else {}, offsets, empty_after=empty_after))


#: The transformers function that makes the masks of a generate step ahead of the model's forward
#: (for caches that torch.compile can trace: "when we compile the forwards with Static caches"),
#: and generate's step that calls it there (Gemma 3's and Gemma 4's forwards call it too, for
#: their own masks: those stay carriers)
AHEAD_OF_FORWARD = "create_masks_for_generate"
GENERATE_STEP = "prepare_inputs_for_generation"
FRAMES_SEARCHED = 24  # (through create_causal_mask ..., a model's own create_masks_for_generate, super() calls)


def made_ahead_for_generate() -> bool:
    """Whether the mask being made is one that generate makes ahead of the forward
    (`AHEAD_OF_FORWARD` called by `GENERATE_STEP`, within FRAMES_SEARCHED callers), for a forward
    that may be compiled: a pattern's mask is then sdpa's dense one, since a compiled layer reads
    a carrier by its dtype alone and the pattern kept beside it is out of its reach (Llama 4's
    chunks were refused under `torch.compile` with a static cache)."""
    frame, ahead = sys._getframe(1), False
    for _ in range(FRAMES_SEARCHED):
        if frame is None:
            return False
        ahead = ahead or frame.f_code.co_name == AHEAD_OF_FORWARD
        if ahead and frame.f_code.co_name == GENERATE_STEP:
            return True
        frame = frame.f_back
    return False


def filled_keys(q_offset: object, queries: int, kv_offset: int, keys: int) -> int | None:
    """The key columns that hold tokens, where fewer than the call's `keys`: a static cache's
    slots past the last query's position are empty (transformers' masks keep them out by
    causality, at the queries' absolute positions from `q_offset`); None otherwise. With a
    padding mask the layer cuts them by its columns; without one (generate drops an all-ones
    mask), every layer got the whole buffer, and the queries, taken as the last columns,
    attended the empty slots (logits off by ~10)."""
    filled = int(q_offset) + queries - kv_offset  # type: ignore[call-overload]
    return filled if 0 < filled < keys else None


def key_ranges(padding_mask: torch.Tensor, batch: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_start, kv_end) int64 [B] on the CPU from a 2-D padding mask [B, L] (1 or True: a real
    token) over the call's `keys` key columns (L > keys: the last `keys` columns, a
    sliding-window cache). Each row's valid keys must be one contiguous run."""
    if padding_mask.is_floating_point():
        raise AttnccError(
            f"attention_mask: a float (additive) mask {tuple(padding_mask.shape)} has no attncc mapping: give a bool "
            "mask [B, 1, N, keys] (True: attended), or the 2-D padding mask"
        )
    if padding_mask.dim() != 2 or padding_mask.shape[0] != batch:
        raise AttnccError(
            f"attention_mask: expected a padding mask [B={batch}, keys] or [B, 1, 1, keys], or a bool mask [B, 1, N, "
            f"keys], got {padding_mask.dtype} of shape {tuple(padding_mask.shape)}"
        )
    # read on the host once per model forward: the kernels classify their tiles by these ranges
    # there (copying them to a GPU once per distinct ranges), so no layer's call reads them back
    compiling = torch.compiler.is_compiling()
    valid = padding_mask[:, -keys:].to(padding_mask.device if compiling else "cpu", torch.bool)
    length = valid.shape[1]
    if not compiling:
        # each row's run from its bytes (find, rfind and count run at memchr's pace): ~30 us a
        # decoding step at B=4 over 264 keys, where the torch ops below (a graph's) took ~125 us
        rows = values_key(valid)[2]
        runs = [_run_of(rows[row * length : (row + 1) * length]) for row in range(batch)]
        gaps = [row for row, run in enumerate(runs) if run is None]
        if gaps:
            raise AttnccError(
                f"attention_mask: rows {gaps} have padding between real tokens (packed sequences, or tokens generated "
                "after right padding: generate with padding_side='left'); attncc maps left or right padding only, one "
                "contiguous run of keys per sequence (use the kernel's .varlen for packed sequences)"
            )
        starts, ends = [run[0] for run in runs if run], [run[1] for run in runs if run]
        return torch.tensor(starts, dtype=torch.int64), torch.tensor(ends, dtype=torch.int64)
    position = torch.arange(length, device=valid.device).expand(batch, length)
    any_valid = valid.any(1)
    start = torch.where(any_valid, position.masked_fill(~valid, length).amin(1), 0)
    end = torch.where(any_valid, position.masked_fill(~valid, -1).amax(1) + 1, 0)
    # (in a graph: checked when it runs, without a read on the host)
    torch._assert_async(
        (valid.sum(1) == end - start).all(),
        "attention_mask: a row has padding between real tokens (packed sequences?); attncc maps left or "
        "right padding only, one contiguous run of keys per sequence",
    )
    return start.to(torch.int64), end.to(torch.int64)


def _run_of(row: bytes) -> tuple[int, int] | None:
    """(start, end) of the one run of 1 bytes in `row`, (0, 0) where there is none; None where
    there are several."""
    first = row.find(1)
    if first < 0:
        return 0, 0
    end = row.rfind(1) + 1
    return (first, end) if row.count(1) == end - first else None


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
    offsets = offsets_from_starts(starts)
    return None if len(offsets) == batch + 1 else offsets


def layer_needs(
    causal: bool,
    sliding_window: int | None,
    softcap: float | None,
    padding: bool,
    dropout: float,
    sinks: object,
    pattern: ModelMask | None,
) -> LayerNeeds:
    """What a layer's call asks of its program; a mask's pattern declares its own inputs (its
    window among them: the layer's `window` term is then the pattern's)."""
    pattern = pattern if pattern is not None and pattern.predicate is not None else None
    declared = tuple((name, pattern.inputs[name][0]) for name in sorted(pattern.inputs)) if pattern else ()
    return LayerNeeds(
        causal,
        sliding_window is not None and "window" not in dict(declared),
        softcap is not None,
        padding,
        float(dropout) > 0,
        sinks is not None,
        (pattern.predicate, declared) if pattern else None,  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class GivenProgram:
    """A program given to `register`: its text, or its path (whether `source` is a path)."""

    source: str
    is_path: bool


def given_program(given: GivenProgram) -> str | Path:
    """What `attncc.compile` takes of a given program (a path as a Path)."""
    return Path(given.source) if given.is_path else given.source


#: The kernels of programs made from a layer's needs, shared by every registered attention
#: (looked up and built as the drop-ins' are: under torch.compile while the graph is traced, not
#: in it, so a layer's first call needs no eager call before and holds no lock). A given
#: program's are its registration's own (`ModelAttention._given_kernels`: registered again after
#: its file changed, a shared table ran the old program).
_MADE_KERNELS = MadeKernels(LayerNeeds, model_program)


@dataclass(frozen=True)
class TracedOffsets:
    """A layer's packed sequences under torch.compile: transformers' cu_seq_lens_q / _k on q's
    device, unplanned (a plan reads them on the host; the varlen op reads them when it runs)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor


class ModelAttention:
    """The function registered with transformers' AttentionInterface: one call per layer."""

    def __init__(self, program: str | Path | None = None) -> None:
        self.program = program
        self.warned_attentions = False
        self._lock = instance_lock(self)
        self._given = None if program is None else GivenProgram(str(program), isinstance(program, Path))
        self._given_kernels = MadeKernels(GivenProgram, given_program)
        # per kind ("ranges", "plan"): the last result, with copies of the tensors it was made from
        # and the sizes
        self._last: dict[str, tuple[tuple[torch.Tensor, ...], tuple, object]] = {}

    def once_per_forward(self, kind: str, sources: tuple[torch.Tensor, ...], sizes: tuple, make: Callable[[], T]) -> T:
        """make(), once per model forward rather than per layer: every layer gets the same mask,
        position ids or offsets, so the last result of `kind` is reused while the tensors given
        hold the values it was made from, at these sizes. (By value: a server's preallocated
        position ids rewritten through numpy or `.data` keep their object and version counter,
        and inference tensors have no version counter.)"""
        if torch.compiler.is_compiling():  # (in a graph: made each run, from the run's tensors)
            return make()
        # (what inference mode made holds inference tensors, which a recorded graph cannot save)
        sizes = (*sizes, torch.is_inference_mode_enabled())
        with self._lock:
            last = self._last.get(kind)
        if last is not None:
            seen, made_at, result = last
            if (
                made_at == sizes
                and len(seen) == len(sources)
                and all(
                    a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and bool(torch.equal(a, b))
                    for a, b in zip(seen, sources)
                )
            ):
                return result  # type: ignore[return-value]
        result = make()
        with self._lock:
            self._last[kind] = (tuple(t.detach().clone() for t in sources), sizes, result)
        return result

    def ranges(self, padding_mask: torch.Tensor, batch: int, keys: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`key_ranges`, once per model forward; None where every key is a token (the mask was
        given, so the rows are not packed sequences, whatever their position ids)."""

        def make() -> tuple[torch.Tensor, torch.Tensor] | None:
            start, end = key_ranges(padding_mask, batch, keys)
            if torch.compiler.is_compiling():  # (the values are the run's: ranges whatever they are)
                return start, end
            # (as Python numbers: four tensor ops took ~20 us of each decoding step's first layer call)
            every_key = all(first == 0 for first in start.tolist()) and all(stop == keys for stop in end.tolist())
            return None if every_key else (start, end)

        return self.once_per_forward("ranges", (padding_mask,), (batch, keys), make)

    def packed_plan(
        self, layer: str, query: torch.Tensor, keys: int, mask_offsets: torch.Tensor | None, **kwargs: object
    ) -> VarlenPlan | TracedOffsets | None:
        """The packed sequences of a layer without a padding mask, as a `VarlenPlan` on q's
        device (once per model forward): from `cu_seq_lens_q` / `_k` (and `max_length_*`) where
        the model was given them, else from the offsets its mask read (`ModelMask`), else from
        plain position ids (`packed_offsets`) where a row holds several sequences and no cache
        precedes its queries; None otherwise. Under torch.compile the given offsets alone, unplanned
        (`TracedOffsets`)."""
        cu_q, cu_k, position_ids = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), kwargs.get("position_ids")
        if (cu_q is None) != (cu_k is None):
            raise AttnccError(f"{layer}: cu_seq_lens_q and cu_seq_lens_k go together, got one")
        if torch.compiler.is_compiling():  # (planning reads offsets on the host: a data-dependent guard)
            if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor):
                return TracedOffsets(cu_q.to(query.device), cu_k.to(query.device))  # (the op reads them)
            return None  # (packing from position ids is in transformers' mask there, as sdpa's: `dense_mask`)
        device, (batch, _, length, _) = query.device, query.shape
        if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor):
            longest = tuple(
                int(m) if m is not None else None for m in (kwargs.get("max_length_q"), kwargs.get("max_length_k"))
            )
            make = lambda: attncc.plan_varlen(cu_q.to(device), cu_k.to(device), *longest)  # noqa: E731
            return self.once_per_forward("plan", (cu_q, cu_k), (device, *longest), make)
        if mask_offsets is not None and length == keys and int(mask_offsets[-1]) == batch * length:
            # (each mask type makes its own offsets tensor: keyed by their values, planned once)
            plan = lambda: attncc.plan_varlen(*2 * [mask_offsets.to(device)])  # noqa: E731
            return self.once_per_forward("plan", (), (device, tuple(mask_offsets.tolist())), plan)
        if not (plain_positions(position_ids, batch, keys) and length == keys > 1):
            return None

        def from_positions() -> VarlenPlan | None:
            offsets = packed_offsets(position_ids, batch, keys)  # type: ignore[arg-type]
            return None if offsets is None else attncc.plan_varlen(*2 * [offsets.to(device)])

        return self.once_per_forward("plan", (position_ids,), (device, batch, keys), from_positions)  # type: ignore[arg-type]

    def kernel(self, needs: LayerNeeds, device: torch.device) -> Kernel:
        """The layer's kernel: the given program's, else the one made from its needs."""
        return self._given_kernels(self._given, device) if self._given is not None else _MADE_KERNELS(needs, device)

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
        if kwargs.get("output_attentions") and not self.warned_attentions:  # (it was dropped silently)
            self.warned_attentions = True
            warnings.warn(
                "attncc: output_attentions=True: the kernels never form the attention weights, so none are "
                "returned (as with sdpa); use attn_implementation='eager' for them",
                stacklevel=2,
            )
        sinks = next((kwargs[name] for name in SINK_KWARGS if kwargs.get(name) is not None), None)
        # (a model on the meta device: shapes alone, as sdpa gives them; masks have no values to read)
        if query.is_meta:
            out = torch.nn.functional.scaled_dot_product_attention(
                query, key, value, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
            )
            return out.transpose(1, 2).contiguous(), None
        if (
            isinstance(attention_mask, torch.Tensor)
            and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4
        ):
            cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
            if isinstance(cu_q, torch.Tensor) and isinstance(
                cu_k, torch.Tensor
            ):  # (packed: each its own, as in eager mode)
                attention_mask = attention_mask & same_sequence(cu_q, cu_k, attention_mask.shape)
            return self.dense(module, query, key, value, attention_mask, dropout, scaling, softcap, sinks)
        sliding_window = layer_window(module, sliding_window)
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        pattern = mask_pattern(attention_mask)
        attention_mask = padding_of(attention_mask)
        if pattern is not None and pattern.causal is not None:
            causal = pattern.causal
        if pattern is not None and pattern.no_padding:
            attention_mask = None
        windowed = pattern is not None and "window" in pattern.inputs
        if sliding_window is not None and not causal and not windowed:
            raise AttnccError(
                f"{type(module).__name__}: a bidirectional sliding window passed to the call, not in its mask, has no "
                "attncc mapping"
            )
        if pattern is not None and pattern.packed_offsets is not None:
            attention_mask = None  # (the carrier's ones: the packed sequences are in the offsets)
        batch, keys = query.shape[0], key.shape[2]
        if attention_mask is None:  # sequences packed into rows (padding-free training): each its own
            offsets = pattern.packed_offsets if pattern is not None else None
            plan = self.packed_plan(type(module).__name__, query, keys, offsets, **kwargs)
            if plan is not None:
                return self.packed(
                    module, query, key, value, plan, dropout, scaling, sliding_window, softcap, causal, sinks, pattern
                )  # fmt: skip
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] < keys:
            if pattern is not None and not pattern.empty_after:  # (cut to the mask's keys: 1 of 17, silently)
                raise AttnccError(
                    f"{type(module).__name__}: the attention mask covers {attention_mask.shape[1]} keys, the call has "
                    f"{keys}: the model made its mask for other keys (MiniMax's decoding steps: a linear-attention "
                    "layer's sizes), no attncc mapping"
                )
            keys = attention_mask.shape[1]  # a static cache: the slots past the mask hold no token yet
            key, value = key[:, :, :keys], value[:, :, :keys]
        ranges = self.ranges(attention_mask, batch, keys) if attention_mask is not None else None  # type: ignore[arg-type]
        needs = layer_needs(causal, sliding_window, softcap, ranges is not None, dropout, sinks, pattern)

        def key_ranges_or_all() -> tuple[torch.Tensor, torch.Tensor]:
            device = query.device
            return ranges or (
                torch.zeros(batch, dtype=torch.int64, device=device),
                torch.full((batch,), keys, dtype=torch.int64, device=device),
            )

        kern, runtime = self.layer_call(
            module, needs, query.device, key_ranges_or_all, sliding_window, softcap, sinks, pattern
        )  # fmt: skip
        if "blocks" in runtime:  # (a static cache's slots past the mask cut off above)
            runtime["blocks"] = runtime["blocks"][:, :keys]  # type: ignore[index]
        out = kern(query, key, value, scale=scaling, **layer_dropout(dropout), **runtime)
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
        pattern: ModelMask | None = None,
    ) -> tuple[Kernel, dict[str, object]]:
        """The layer's kernel and runtime inputs: each sequence's key range, ranges() (kv_start,
        kv_end int[B], made only where the program reads them), the window and the cap where the
        layer has them, the inputs of its mask's pattern; a given program is checked against
        what the layer needs."""
        kern = self.kernel(needs, device)
        declared = {d.name for d in kern.inputs}
        runtime: dict[str, object] = {name: value for name, (_, value) in (pattern.inputs if pattern else {}).items()}
        if needs.padding or {"kv_start", "kv_end"} & declared:  # (a given program's: all keys valid where no padding)
            runtime.update(zip(("kv_start", "kv_end"), ranges()))
        if sliding_window is not None:  # (where the mask's pattern has a window, the mask's: what sdpa applies)
            runtime.setdefault("window", int(sliding_window))
        if softcap is not None:
            runtime["cap"] = float(softcap)
        if sinks is not None:  # (a parameter: its gradient flows through the call)
            runtime["sinks"] = sinks
        if self.program is not None:
            check_given_program(kern, declared, runtime, needs, type(module).__name__)
        return kern, runtime

    def dense(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor,
        dropout: float,
        scaling: float | None,
        softcap: float | None,
        sinks: object,
    ) -> tuple[torch.Tensor, None]:
        """The layer under a dense bool mask [B, 1, N, M] (`dense_mask`): its pattern whole (causal,
        window, padding, packed sequences), read as the runtime input `kept`."""
        batch, _, queries, _ = query.shape
        keys = key.shape[2]
        if mask.shape[1] != 1 or mask.shape[2] != queries or mask.shape[3] < keys:
            raise AttnccError(
                f"{type(module).__name__}: a dense attention mask [B, 1, N={queries}, M={keys}] expected, got "
                f"{tuple(mask.shape)}: no attncc mapping"
            )
        pattern = ModelMask(DENSE_TERM, {"kept": ("bool[B, N, M]", mask[:, 0, :, :keys].expand(batch, queries, keys))})
        needs = layer_needs(False, None, softcap, False, dropout, sinks, pattern)
        kern, runtime = self.layer_call(module, needs, query.device, lambda: (), None, softcap, sinks, pattern)  # type: ignore[arg-type, return-value]
        out = kern(query, key, value, scale=scaling, **layer_dropout(dropout), **runtime)
        return out.transpose(1, 2).contiguous(), None

    def packed(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        plan: VarlenPlan | TracedOffsets,
        dropout: float,
        scaling: float | None,
        sliding_window: int | None,
        softcap: float | None,
        causal: bool,
        sinks: object = None,
        pattern: ModelMask | None = None,
    ) -> tuple[torch.Tensor, None]:
        """The layer over sequences packed into its rows, as FlashAttention's varlen call takes
        them (transformers' `cu_seq_lens_q`/`_k` over the flattened tokens, or offsets read from
        the position ids, planned once per forward): one `kern.varlen` call, each sequence
        attending within itself (its N and M its own, so the made programs' bottom-right causal
        mask is each sequence's, and its chunks count from its first token)."""
        batch, heads, length, _ = query.shape
        traced = isinstance(plan, TracedOffsets)
        # each sequence's keys, all valid (on the host; in the graph under torch.compile)
        lengths = (plan.cu_k[1:] - plan.cu_k[:-1]).to(torch.int64) if traced else plan.packed.lengths[1]  # type: ignore[union-attr]
        if pattern is not None:
            if "blocks" in pattern.inputs:
                raise AttnccError(
                    f"{type(module).__name__}: image blocks (Gemma 3's token groups) of packed sequences have no "
                    "attncc mapping: pass one sequence per row with a padding mask"
                )
            inputs = dict(pattern.inputs)
            if "first_key" in inputs:  # (per packed sequence, each from its own first token)
                inputs["first_key"] = ("int[B]", torch.zeros_like(lengths))
            pattern = ModelMask(pattern.predicate, inputs, pattern.packed_offsets)
        needs = layer_needs(causal, sliding_window, softcap, False, dropout, sinks, pattern)
        all_keys = lambda: (torch.zeros_like(lengths), lengths)  # noqa: E731
        kern, runtime = self.layer_call(
            module, needs, query.device, all_keys, sliding_window, softcap, sinks, pattern
        )  # fmt: skip
        # [B, H, N, D] -> the tokens row after row, [B N, H, D] (a view of the layer's projections)
        q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (query, key, value))
        offsets = dict(cu_seqlens_q=plan.cu_q, cu_seqlens_k=plan.cu_k) if traced else dict(plan=plan)  # type: ignore[union-attr]
        out = kern.varlen(q, k, v, **offsets, scale=scaling, **layer_dropout(dropout), **runtime)
        return out.view(batch, length, heads, out.shape[-1]), None


def layer_dropout(dropout: float) -> dict[str, object]:
    """A layer call's dropout options: its rate (`dropout_p`, traced: guarded on its value),
    none with `train=False` where the layer asks for none (eval, or a config without it)."""
    rate = float(dropout)
    return {"train": True, "dropout_p": rate} if rate > 0 else {"train": False}


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
    if needs.dropout and not kern.op.dropout:
        raise AttnccError(
            f"{layer}: the layer asks for attention dropout, which program {kern.name} does not draw (write "
            "`p = dropout(p, rate)` in it: the layer's rate takes the place of its rate)"
        )


def register(name: str = "attncc", program: str | Path | None = None) -> ModelAttention:
    """Register attncc under `name` with transformers' AttentionInterface (and the FlashAttention
    mask function with its AttentionMaskInterface, so layers get the padding mask's rows), so that
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
