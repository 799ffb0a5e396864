"""transformers models with attn_implementation="attncc" against the same weights on sdpa (eager
where sdpa does not apply): prefill logits with padding, greedy generation through the KV cache,
and training gradients (small random-init Llama with GQA, Mistral with a sliding window, Gemma 2
with logit soft-capping and alternating sliding layers, DeepSeek-V3's multi-head latent attention
with q and k 24 wide and v 12: v has a head dim of its own)."""

from __future__ import annotations

import copy
import random
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attncc  # noqa: E402
from attncc.errors import AttnccError  # noqa: E402
from attncc.integrations import transformers as integration  # noqa: E402

NAME = "attncc-test"
VOCAB = 96


@pytest.fixture(scope="module", autouse=True)
def registered() -> integration.ModelAttention:
    return integration.register(NAME)


def config(family: str) -> tuple[transformers.PretrainedConfig, str]:
    """A tiny config of `family` whose attention matters to the logits (a large init makes
    the scores sharp), and the implementation to compare with."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.3,
    )  # fmt: skip
    if family == "llama":
        return transformers.LlamaConfig(**common), "sdpa"
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=7), "sdpa"
    if family == "deepseek_v3":
        mla = dict(
            kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=1, n_group=1, topk_group=1,
        )  # fmt: skip
        # (head_dim is the rotary part's, qk_rope_head_dim, in DeepSeek's config)
        shared = {n: v for n, v in common.items() if n != "head_dim"}
        return transformers.DeepseekV3Config(**{**shared, "num_key_value_heads": 4}, **mla), "sdpa"
    if family == "llama4":  # chunked attention (3 of 4 layers, chunks of 6 tokens), the fourth layer full
        return transformers.Llama4TextConfig(
            **{**common, "num_hidden_layers": 4}, intermediate_size_mlp=96, attention_chunk_size=6, num_local_experts=2
        ), "sdpa"  # fmt: skip
    if family == "gpt_oss":  # learned sinks (`s_aux`), sliding and full layers in turn, a mixture of experts
        return transformers.GptOssConfig(
            **common, sliding_window=6, num_local_experts=2, num_experts_per_tok=1
        ), "eager"  # fmt: skip
    assert family == "gemma2"
    return transformers.Gemma2Config(
        **common, sliding_window=6, attn_logit_softcapping=4.0, final_logit_softcapping=None, query_pre_attn_scalar=24
    ), "eager"  # fmt: skip


def models(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The reference and attncc models with the same weights (each its own config: a model reads
    the attention implementation from its config at every call)."""
    cfg, anchor = config(family)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=anchor)
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    ours.load_state_dict(reference.state_dict())
    assert reference.config._attn_implementation == anchor
    return reference, ours


def base_models(cfg: transformers.PretrainedConfig, anchor: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The reference and attncc base models (AutoModel: hidden states) of `cfg`, same weights."""
    torch.manual_seed(0)
    reference = transformers.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation=anchor)
    ours = transformers.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    ours.load_state_dict(reference.state_dict())
    return reference, ours


def batch(right_padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two sequences of 21 tokens, the second left-padded by 5 (as generation pads), the first
    right-padded by `right_padding`."""
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    mask[0, 21 - right_padding :] = 0
    return ids, mask


def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the calls that reach attncc's attention function."""
    calls = [0]
    original = integration.ModelAttention.__call__

    def call(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(integration.ModelAttention, "__call__", call)
    return calls


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "deepseek_v3", "gpt_oss", "llama4"])
def test_prefill_logits_with_padding(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reference, ours = (m.eval() for m in models(family))
    ids, mask = batch(right_padding=4)
    calls = counted(monkeypatch)
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
        unpadded = ours(ids).logits  # no mask at all: the programs without padding inputs
    assert calls[0] == 2 * ours.config.num_hidden_layers
    real = mask.bool()
    assert expected[real].std() > 0.3  # the logits depend on the attention, not just the embeddings
    assert (got - expected)[real].abs().max() < 2e-4
    with torch.no_grad():
        assert (unpadded[0] - reference(ids[:1]).logits[0]).abs().max() < 2e-4


@pytest.mark.parametrize("family", ["llama", "gemma2", "llama4"])
def test_a_model_on_the_meta_device_gives_the_reference_s_shapes(family: str) -> None:
    """A model built on the meta device (shape inference, FLOP counting before the weights are
    loaded) failed (the kernels refused meta tensors, the integration read the position ids'
    values): the layers give their outputs' shapes, forward and backward; the mask function
    makes no mask of meta values (Llama 4's chunks read its padding's values). (DeepSeek-V3's
    experts fail on the meta device in transformers itself.)"""
    cfg, anchor = config(family)
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=anchor)
        ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME)
    ids = torch.randint(0, cfg.vocab_size, (2, 7), device="meta")
    got = ours(ids, labels=ids)
    assert got.logits.shape == reference(ids).logits.shape == (2, 7, cfg.vocab_size)
    got.loss.backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in ours.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "deepseek_v3", "gpt_oss", "llama4"])
def test_greedy_generation_through_the_cache(family: str) -> None:
    """Decoding steps have N = 1 query against M cached keys (bottom-right causal); Mistral's and
    Gemma 2's sliding layers keep fewer keys than positions once the window is full."""
    reference, ours = (m.eval() for m in models(family))
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    expected = reference.generate(ids, **kwargs)
    got = ours.generate(ids, **kwargs)
    assert torch.equal(got, expected)


def test_each_decoding_steps_later_layers_repeat_the_first_layers_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generating on a padded batch, every layer of a step calls its kernel with the same sizes
    and key ranges (`kv_start`, `kv_end`: runtime tensors): the first layer's call is checked,
    the others repeat the launch it kept (no checks, plan or tile classes: ~100 us of host per
    layer and token, session 57). Tokens as sdpa's."""
    reference, ours = (m.eval() for m in models("llama"))
    ids, mask = batch()
    checked, forwards = [0], [0]
    validate = attncc.Kernel.validate

    def counting(self: attncc.Kernel, *args: object, **kwargs: object) -> None:
        checked[0] += 1
        validate(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attncc.Kernel, "validate", counting)
    ours.register_forward_pre_hook(lambda *args: forwards.__setitem__(0, forwards[0] + 1))
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected, got = reference.generate(ids, **kwargs), ours.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    assert ours.config.num_hidden_layers == 2 and forwards[0] == 6 and checked[0] == forwards[0]


@pytest.mark.parametrize("family", ["llama", "gemma2", "deepseek_v3", "gpt_oss", "llama4"])
def test_training_gradients(family: str) -> None:
    reference, ours = (m.train() for m in models(family))
    ids, mask = batch(right_padding=3)
    # a padding row sees no key, so its output is each implementation's own: no loss reads it
    # (position t predicts label t + 1)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100
    for model in (reference, ours):
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    for (name, expected), got in zip(reference.named_parameters(), ours.parameters()):
        scale = expected.grad.abs().max().clamp_min(1e-6)
        assert (got.grad - expected.grad).abs().max() / scale < 1e-3, name


def test_gemma4_kv_shared_layers_take_the_masks_sliced_to_their_queries() -> None:
    """Gemma 4's KV-shared layers run a prefill's last token alone, slicing each mask as an
    sdpa mask, `mask[:, :, -1:, :]`: on attncc's 2-D masks an IndexError until session 62; the
    masks handed out are [B, 1, 1, keys] now. Prefill logits with padding and generation
    (dynamic and static caches) against eager; a mask holding a pattern, sliced, is an error
    (its pattern is kept by the tensor's identity: it ran without it)."""
    cfg = transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, sliding_window=6, initializer_range=0.3,
        num_kv_shared_layers=2, layer_types=["sliding_attention", "full_attention"] * 2,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    ours.load_state_dict(reference.state_dict())
    ids, mask = batch()
    with torch.no_grad():
        expected, got = (model(ids, attention_mask=mask).logits for model in (reference, ours))
    assert (got - expected)[mask.bool()].abs().max() < 1e-4
    for cache in ("dynamic", "static"):
        kwargs = dict(
            attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation=cache
        )
        assert torch.equal(ours.generate(ids, **kwargs), reference.generate(ids, **kwargs)), cache
    # packed sequences (a pattern beside the mask): Gemma 4 slices every mask, a view of the same
    # rows, which lost the pattern kept by the mask's identity (an AttnccError until session 62)
    # (under torch.inference_mode too, whose views keep no base: kept by the carrier's storage)
    positions = torch.cat([torch.arange(7), torch.arange(9)])[None]
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            expected, got = (m(ids[:1, :16], position_ids=positions, use_cache=False).logits for m in (reference, ours))
        assert (got - expected).abs().max() < 1e-4, mode.__name__
    chunks = integration.ModelMask("j >= 0", {})
    carrier = integration.carried(torch.ones(2, 5, dtype=torch.bool), chunks)
    assert integration.mask_pattern(carrier) is chunks and integration.mask_pattern(carrier[:, :, -1:, :]) is chunks
    for changed in (carrier.clone(), carrier[..., :3], carrier[:1]):
        with pytest.raises(AttnccError, match="copied an attention mask that holds a pattern"):
            integration.mask_pattern(changed)


def test_a_users_integer_4d_mask_is_no_carrier_and_a_program_file_is_read_at_each_registration(tmp_path: Path) -> None:
    """Carriers' dtypes are none a user's mask has: an int64 or uint8 mask [B, 1, 1, M] given to a
    causal model was read as a bidirectional carrier (future tokens attended: 12.2 off sdpa) until
    the session's diff review; it is an error now. A program file registered again after an edit
    runs the edit (a process-wide table of given programs ran the old one)."""
    ours = models("llama")[1].eval()
    ids, mask = batch()
    for dtype in (torch.int64, torch.uint8):
        with pytest.raises(AttnccError, match="attention_mask: expected a padding mask"), torch.no_grad():
            ours(ids, attention_mask=mask[:, None, None, :].to(dtype))
    module = torch.nn.Module()
    q, k = (torch.randn(1, 2, 6, 16, generator=torch.Generator().manual_seed(seed)) for seed in (4, 5))
    path = tmp_path / "given.attn"
    outputs = []
    for mask_line in ("mask j <= i + M - N\n", ""):
        path.write_text(f"attention given\ns = q @ k.T * scale\n{mask_line}p = softmax(s)\no = p @ v\noutput o\n")
        outputs.append(integration.ModelAttention(path)(module, q, k, k, None, scaling=0.25)[0])
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    for out, keep in zip(outputs, (causal, torch.ones(6, 6, dtype=torch.bool))):
        want = torch.softmax((q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep, -torch.inf), -1) @ k
        torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_a_mask_narrower_than_the_keys_is_cut_to_only_where_the_mask_function_said_so() -> None:
    """A static cache's mask covers the tokens so far, its later slots empty: the layer cuts its
    keys to the mask's width. MiniMax's decoding layers got masks made for a linear-attention
    layer's sizes (1 key of 17) and were cut to 1 key, silently (logits 6.8 off sdpa's); only a
    mask the mask function made narrower than the keys it was asked for is cut now."""
    module = models("llama")[1].model.layers[0].self_attn
    q, k = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 17, 16)
    made_for_one = integration.carried(torch.ones(2, 1, dtype=torch.bool), integration.ModelMask(None, {}, causal=True))
    with pytest.raises(AttnccError, match="the attention mask covers 1 keys, the call has 17"):
        integration.ModelAttention()(module, q, k, k, made_for_one, scaling=0.25)
    empty_after = integration.ModelMask(None, {}, causal=True, empty_after=True)
    filled = integration.carried(torch.ones(2, 5, dtype=torch.bool), empty_after)
    out, _ = integration.ModelAttention()(module, q, k, k, filled, scaling=0.25)
    keys = k[:, :, :5].repeat_interleave(2, 1)
    want = torch.softmax(q @ keys.transpose(-1, -2) * 0.25, -1) @ keys
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_a_custom_4d_bool_mask_is_read_as_a_dense_mask() -> None:
    """A 4-D bool mask given to the model (transformers passes one through to the layers as it
    is: two documents per row here) runs as a dense mask, the runtime input `kept`; it was an
    error ("expected the 2-D padding mask") until session 62. Logits as sdpa's."""
    reference, ours = (m.eval() for m in models("llama"))
    ids = batch()[0]
    n = ids.shape[1]
    position = torch.arange(n)
    document = (position >= 9).long()
    dense = (document[:, None] == document[None, :]) & (position[None, :] <= position[:, None])
    with torch.no_grad():
        expected, got = (m(ids, attention_mask=dense.expand(2, 1, n, n)).logits for m in (reference, ours))
    assert (got - expected).abs().max() < 1e-4


def test_a_compiled_forward_generates_through_a_static_cache_as_eager_does() -> None:
    """`torch.compile(model.forward, fullgraph=True)` with a static cache, transformers' recipe
    for fast generation: generate makes the masks before each compiled forward (causal and
    sliding, with padding) and the layers read their causality from the mask's dtype (a traced
    mask has no id) and build their kernels while the graph is traced (`MadeKernels`).
    It failed at the first layer until session 62 (the inference-mode read, then the kernels'
    lock, the host read of the padding). Gemma 2 with padding: sliding and full layers,
    soft-capping; Mistral without: its sliding layers' masks made in the graph once the window
    is full (no mask handed out: `dense_mask`; refused until session 62); Llama 4's chunks, whose
    masks generate makes ahead of the forward are sdpa's (`made_ahead_for_generate`: the pattern
    kept beside a carrier is out of a traced layer's reach; refused until session 63)."""
    for family, padded in (("gemma2", True), ("mistral", False), ("llama4", True)):
        reference, ours = (m.eval() for m in models(family))
        ids, mask = batch()
        ids = ids if padded else ids[:1, 5:].clamp_min(1)
        kwargs = dict(attention_mask=mask if padded else None, max_new_tokens=4, do_sample=False, pad_token_id=0)
        expected = reference.generate(ids, **kwargs)
        torch._dynamo.reset()
        ours.forward = torch.compile(ours.forward, fullgraph=True)
        got = ours.generate(ids, **kwargs, cache_implementation="static")
        assert torch.equal(got, expected), family


def test_only_generate_s_masks_made_ahead_of_the_forward_are_dense() -> None:
    """`made_ahead_for_generate`: create_masks_for_generate called by generate's
    prepare_inputs_for_generation (a model's override calling super() between them too);
    Gemma 3's and Gemma 4's forwards call it themselves for their own masks, which stay carriers
    (they were made dense, the pattern's tile skipping and packing lost: review of session 63)."""

    def create_masks_for_generate() -> bool:
        return integration.made_ahead_for_generate()

    def prepare_inputs_for_generation(through_super: bool = False) -> bool:
        return prepare_inputs_for_generation() if through_super else create_masks_for_generate()

    def forward() -> bool:
        return create_masks_for_generate()

    assert prepare_inputs_for_generation() and prepare_inputs_for_generation(through_super=True)
    assert not forward() and not create_masks_for_generate()


def compiled_gradients_match(family: str, with_mask: bool, **compile_options: object) -> None:
    """A fullgraph-compiled forward and backward of `family` (padded batch, or no mask and no
    cache) has the reference's gradients."""
    reference, ours = (m.train() for m in models(family))
    ids, mask = batch(right_padding=3)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100
    kwargs = dict(attention_mask=mask, labels=labels) if with_mask else dict(labels=ids, use_cache=False)
    torch._dynamo.reset()
    reference(ids, **kwargs).loss.backward()
    torch.compile(ours.forward, fullgraph=True, **compile_options)(ids, **kwargs).loss.backward()
    for (name, expected), got in zip(reference.named_parameters(), ours.parameters()):
        scale = expected.grad.abs().max().clamp_min(1e-6)
        assert (got.grad - expected.grad).abs().max() / scale < 1e-3, name


def test_a_compiled_training_step_matches_eager_and_patterns_made_outside_are_refused() -> None:
    """Fullgraph-compiled training steps: Llama over a padded batch (the mask function and the
    layers traced, the padding's key ranges made in the graph and checked when it runs: no host
    read); Mistral's sliding window with padding and dynamic sizes, and without any mask (its
    mask function an `and_masks` closure, of the window or of packed sequences found from the
    position ids, which dynamo cannot read: the layers get sdpa's dense mask made in the graph,
    `dense_mask`; refused until session 62, and dynamic=True's symbolic dropout rate failed the
    kernel's constant key); sequences packed into a row. A pattern recorded beside a mask made outside the graph is a clear
    error (a traced layer ran plain causal attention: Llama 4's chunks in a compiled generate, whose
    masks are sdpa's since session 63)."""
    compiled_gradients_match("llama", with_mask=True)
    compiled_gradients_match("mistral", with_mask=True, dynamic=True)
    compiled_gradients_match("mistral", with_mask=False)
    # sequences packed into a row, by position ids (Llama: in transformers' dense mask) or by
    # cu_seq_lens (gpt-oss, whose masks do not see the position ids: each sequence its own, as in
    # eager mode, the varlen op reading the offsets; refused until session 62, a plan reads them)
    ids, positions, offsets = packed_row()
    flash_kwargs = dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=9, max_length_k=9)
    # (Llama 4 by cu_seq_lens: its chunks in the dense mask, ANDed with the packing; the packing
    # alone ran, its chunks dropped, 11.0 off, until the session's diff review)
    for family, kwargs in (("llama", {}), ("gpt_oss", flash_kwargs), ("llama4", flash_kwargs)):
        reference, ours = (m.eval() for m in models(family))
        torch._dynamo.reset()
        compiled = torch.compile(ours.forward, fullgraph=True)
        with torch.no_grad():
            alone = torch.cat([reference(part).logits for part in ids.split(PACKED_LENGTHS, 1)], 1)
            got = compiled(ids, position_ids=positions, use_cache=False, **kwargs).logits
        assert (got - alone).abs().max() < 2e-4, family
    torch._dynamo.reset()
    carrier = integration.carried(torch.ones(2, 5, dtype=torch.bool), integration.ModelMask("j >= 0", {}))
    with pytest.raises(Exception, match="attncc maps it in eager mode only, not under torch"):
        torch.compile(integration.mask_pattern, fullgraph=True)(carrier)


@pytest.mark.parametrize("family", ["llama", "gemma2", "llama4"])
def test_a_static_cache_without_padding_attends_its_filled_slots_only(family: str) -> None:
    """generate drops an all-ones mask, so with a static cache the layers got its whole buffer
    and no mask: the queries, taken as the last key columns, attended the empty slots (Llama's
    step logits off by 11.8, other tokens; Gemma 2's sliding layers 0.09, Llama 4's chunks 0.41).
    The mask function now hands over ones over the filled columns, from the queries' position."""
    reference, ours = (m.eval() for m in models(family))
    ids = batch()[0].clamp_min(1)  # (no pad token: generate would infer a padding mask from it)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, cache_implementation="static")
    kwargs.update(output_logits=True, return_dict_in_generate=True)
    expected, got = reference.generate(ids, **kwargs), ours.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert max((a - b).abs().max() for a, b in zip(got.logits, expected.logits)) < 2e-4


def test_bidirectional_local_attention_reads_its_window_from_the_mask() -> None:
    """ModernBERT's local layers (a bidirectional window, the layer passing its flash window
    `local_attention // 2 + 1` and the mask `abs(q - kv) <= local_attention // 2`) were refused;
    now the window comes from the mask: last hidden states with right padding and gradients as
    sdpa's."""
    cfg = transformers.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        initializer_range=0.3, local_attention=6, global_attn_every_n_layers=3, pad_token_id=0,
        embedding_dropout=0.0, attention_dropout=0.0, mlp_dropout=0.0,
    )  # fmt: skip
    reference, ours = base_models(cfg, "sdpa")
    ids, mask = batch(right_padding=5)
    mask[1] = 1  # (one row padded on the right only: ModernBERT unpads by the mask)
    weights = torch.randn(2, 21, 64, generator=torch.Generator().manual_seed(9))
    outs = []
    for model in (reference, ours):
        out = model(ids, attention_mask=mask).last_hidden_state
        ((out * weights)[mask.bool()]).sum().backward()
        outs.append(out.detach())
    real = mask.bool()
    assert outs[0][real].std() > 0.3 and (outs[1] - outs[0])[real].abs().max() < 2e-4
    for (name, want), got in zip(reference.named_parameters(), ours.parameters()):
        if want.grad is not None:
            scale = want.grad.abs().max().clamp_min(1e-4)
            assert (got.grad - want.grad).abs().max() / scale < 1e-3, name


def test_gemma3_with_bidirectional_attention_is_bidirectional_everywhere() -> None:
    """EmbeddingGemma's configuration (use_bidirectional_attention): its full layers OR causal
    with `lambda *args: torch.tensor(True)` (an error before: a function of no argument is read
    as its constant), its sliding layers with Gemma 3's own bidirectional window overlay; the
    last hidden states with right padding as eager's (the causal model's differ by 2.2)."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, initializer_range=0.3, max_position_embeddings=128,
        query_pre_attn_scalar=16, use_bidirectional_attention=True,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    reference, ours = base_models(cfg, "eager")
    ids, mask = batch(right_padding=5)
    mask[1] = 1
    with torch.no_grad():
        expected = reference(ids, attention_mask=mask).last_hidden_state
        got = ours(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert expected[real].std() > 0.3 and (got - expected)[real].abs().max() < 2e-4


PACKED_LENGTHS = (8, 5, 9)


def packed_row() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three sequences packed into one row of 22 tokens (padding-free training): the ids, the
    position ids (restarting at each sequence) and the offsets, cu_seq_lens."""
    ids = torch.randint(0, VOCAB, (1, sum(PACKED_LENGTHS)), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS]).view(1, -1)
    offsets = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return ids, positions, offsets


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "deepseek_v3", "llama4"])
def test_packed_sequences_attend_each_within_itself(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences packed into a row, told apart by their position ids (sdpa's and eager's
    packed-sequence masks; FlashAttention's path reads them the same way) or by the
    cu_seq_lens FlashAttention kwargs: logits and training gradients as the reference's, which
    are each sequence's alone (attention across the packed sequences changes them); the
    offsets are planned once per forward, not per layer."""
    reference, ours = (m.eval() for m in models(family))
    ids, positions, offsets = packed_row()
    flash_kwargs = dict(cu_seq_lens_q=offsets, cu_seq_lens_k=offsets, max_length_q=9, max_length_k=9)
    with torch.no_grad():
        expected = reference(ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat([reference(part).logits for part in ids.split(PACKED_LENGTHS, 1)], 1)
        across = reference(ids, use_cache=False).logits[:, PACKED_LENGTHS[0] :]  # (no restart: one sequence)
        by_positions = ours(ids, position_ids=positions, use_cache=False).logits
        by_offsets = ours(ids, position_ids=positions, use_cache=False, **flash_kwargs).logits
    assert (expected - alone).abs().max() < 2e-4
    assert (across - expected[:, PACKED_LENGTHS[0] :]).abs().max() > 0.1
    assert (by_positions - expected).abs().max() < 2e-4
    assert (by_offsets - expected).abs().max() < 2e-4
    planned = []
    plan_varlen = integration.attncc.plan_varlen
    monkeypatch.setattr(integration.attncc, "plan_varlen", lambda *args: planned.append(1) or plan_varlen(*args))
    for model in (reference.train(), ours.train()):
        model(ids, position_ids=positions, labels=ids, use_cache=False).loss.backward()
    assert len(planned) == 1 and ours.config.num_hidden_layers > 1  # once per forward, not per layer
    for (name, want), got in zip(reference.named_parameters(), ours.parameters()):
        scale = want.grad.abs().max().clamp_min(1e-6)
        assert (got.grad - want.grad).abs().max() / scale < 1e-3, name


def test_programs_made_per_layer_say_bottom_right_causal() -> None:
    needs = integration.LayerNeeds(causal=True, window=True, softcap=True, padding=True, dropout=False)
    text = integration.model_program(needs)
    assert "mask j >= kv_start[b] and j < kv_end[b] and j <= i + M - N and i + M - N - j < window" in text
    assert "s = cap * tanh(s / cap)" in text


def test_a_given_program_runs_every_layer_and_must_declare_what_layers_need(monkeypatch: pytest.MonkeyPatch) -> None:
    """register(name, program): the program's inputs are filled by name; a layer needing a window
    the program does not declare, or a program input no call fills, is a clear error."""
    alibi = (
        "attention hf_alibi\ninput kv_start: int[B]\ninput kv_end: int[B]\ninput slopes: float[H]\n"
        "s = q @ k.T * scale - slopes[h] * (i + M - N - j)\n"
        "mask j >= kv_start[b] and j < kv_end[b] and j <= i + M - N\np = softmax(s)\no = p @ v\noutput o\n"
    )
    integration.register("attncc-alibi", alibi)
    cfg, _ = config("llama")
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="attncc-alibi")
    ids, mask = batch()
    with pytest.raises(AttnccError, match="input `slopes` has no value in a transformers attention call"):
        model(ids, attention_mask=mask)
    causal = alibi.replace("input slopes: float[H]\n", "").replace(" - slopes[h] * (i + M - N - j)", "")
    integration.register("attncc-given", causal)
    reference, _ = models("llama")
    given = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="attncc-given")
    given.load_state_dict(reference.state_dict())
    with torch.no_grad():
        expected, got = reference.eval()(ids, attention_mask=mask).logits, given.eval()(ids, attention_mask=mask).logits
    assert (got - expected)[mask.bool()].abs().max() < 2e-4
    windowed = transformers.AutoModelForCausalLM.from_config(config("mistral")[0], attn_implementation="attncc-given")
    with pytest.raises(AttnccError, match="the layer needs `window`"):
        windowed(ids, attention_mask=mask)


def test_a_layers_attention_dropout_rate_is_the_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A training layer's `attention_dropout` reaches its kernel call as the call's rate, made
    program or given one (a given program's own rate was required to equal the layer's until
    session 68); eval calls draw none; a given program without dropout is a clear error."""
    from attncc.runtime.kernel import Kernel

    rates: list[float] = []
    call_dropout = Kernel.call_dropout
    monkeypatch.setattr(
        Kernel, "call_dropout", lambda self, *args: rates.append(call_dropout(self, *args)) or rates[-1]
    )
    cfg, _ = config("llama")
    cfg.attention_dropout = 0.25
    ids, mask = batch()
    dropped = "p = softmax(s)\np = dropout(p, 0.1)\n"
    program = (
        "attention hf_dropped\ninput kv_start: int[B]\ninput kv_end: int[B]\ns = q @ k.T * scale\n"
        f"mask j >= kv_start[b] and j < kv_end[b] and j <= i + M - N\n{dropped}o = p @ v\noutput o\n"
    )
    for name, text in ((NAME, None), ("attncc-dropped", program)):
        if text is not None:
            integration.register(name, text)
        model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=name)
        rates.clear()
        model.train()(ids, attention_mask=mask)
        assert rates == [0.25] * cfg.num_hidden_layers, name
        rates.clear()
        model.eval()(ids, attention_mask=mask)
        assert rates == [0.0] * cfg.num_hidden_layers, name
    integration.register("attncc-undropped", program.replace("p = dropout(p, 0.1)\n", ""))
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="attncc-undropped")
    with pytest.raises(AttnccError, match="the layer asks for attention dropout, which program hf_dropped does not"):
        model.train()(ids, attention_mask=mask)


@pytest.mark.parametrize("pattern", ["chunks", "blocks", "blocks in a window"])
def test_read_masks_agree_with_the_mask_functions_at_a_cache_offset(pattern: str) -> None:
    """A layer's call through the mask function's pattern (`ModelMask`; 3 queries after 11 positions,
    against 9 keys from position 5 of a cache that dropped the first 5, left padding of 3 in the
    second sequence) against float64 attention under the dense mask that transformers' own mask
    function gives at those absolute positions."""
    from transformers import masking_utils as masks

    batch, heads, queries, keys, first, dim = 2, 4, 3, 9, 5, 16
    padding = torch.ones(batch, first + keys, dtype=torch.bool)
    padding[1, :3] = False
    groups = torch.full((batch, first + keys), -1)
    groups[0, 6:10], groups[1, 8:13] = 0, 1  # an image across the cache's queries and keys
    function = {
        "chunks": masks.chunked_causal_mask_function(4, torch.tensor([0, 3])),
        "blocks": masks.or_masks(masks.causal_mask_function, masks.blockwise_overlay(groups)),
        "blocks in a window": masks.and_masks(
            masks.or_masks(masks.causal_mask_function, masks.blockwise_overlay(groups)),
            masks.sliding_window_overlay(4),
        ),
    }[pattern]
    given = integration.attncc_attention_mask(
        batch, queries, keys, first + keys - queries, first, mask_function=function, attention_mask=padding
    )
    assert integration.mask_pattern(given).predicate is not None  # (a bool tensor, the pattern beside it)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, queries, dim, generator=generator)
    k, v = (torch.randn(batch, 2, keys, dim, generator=generator) for _ in range(2))
    module = torch.nn.Module()
    out, _ = integration.ModelAttention()(module, q, k, v, given)
    keep = torch.tensor(
        [
            [[bool(function(*map(torch.tensor, (b, 0, first + keys - queries + i, first + j)))) and bool(padding[b, first + j])
              for j in range(keys)] for i in range(queries)]
            for b in range(batch)
        ]
    )  # fmt: skip
    scores = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / dim**0.5
    weights = scores.masked_fill(~keep[:, None], -torch.inf).softmax(-1).nan_to_num()
    expected = (weights @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    assert keep.any(-1).all() and not keep.all()
    assert (out.double() - expected).abs().max() < 1e-5


def test_what_cannot_be_mapped_is_a_clear_error() -> None:
    module = torch.nn.Module()
    q = torch.randn(1, 4, 3, 16)
    k = torch.randn(1, 2, 3, 16)
    with pytest.raises(AttnccError, match=r"Module: `position_bias` \(an additive position bias"):
        integration.ModelAttention()(module, q, k, k, None, position_bias=torch.zeros(1, 4, 3, 3))
    with pytest.raises(AttnccError, match=r"`indices` \(the keys each query attends to"):
        integration.ModelAttention()(module, q, k, k, None, indices=torch.zeros(1, 3, 2, dtype=torch.long))
    with pytest.raises(AttnccError, match="cu_seq_lens_q and cu_seq_lens_k go together"):
        integration.ModelAttention()(module, q, k, k, None, cu_seq_lens_q=torch.tensor([0, 3]))
    module.is_causal = False
    with pytest.raises(AttnccError, match="bidirectional sliding window"):
        integration.ModelAttention()(module, q, k, k, None, sliding_window=4)


def test_mask_functions_are_read_as_dsl_predicates_and_the_rest_is_a_clear_error() -> None:
    """The mask function hands the layers the 2-D padding mask where the pattern is causal or a
    window (the layers know those) and reads the rest from the makers' closures: Llama 4's
    chunks (counted from each sequence's first token, after left padding and the cache's
    offset), Gemma 3's image blocks (the key columns' slice of the groups). A custom function,
    and PhiMoE's window (in its mask only, not passed to the layer's call), ran as plain causal
    attention, silently (logits off by ~10): clear errors."""
    from transformers import masking_utils as masks

    window = integration.mask_term(masks.sliding_window_causal_mask_function(6))
    assert (window.text, window.inputs, window.pattern) == ("(i + M - N - j < window) and (j <= i + M - N)", {"window": ("int", 6)}, False)  # fmt: skip
    padded = masks.and_masks(
        masks.causal_mask_function, masks.padding_mask_function(torch.ones(1, 4, dtype=torch.bool))
    )
    assert integration.mask_term(padded).text == "j <= i + M - N"
    left_padding = torch.tensor([0, 3])
    chunked = integration.mask_term(masks.chunked_causal_mask_function(4, left_padding), key_offset=5, keys=9)
    assert chunked.pattern and chunked.text == f"({integration.CHUNK_TERM}) and (j <= i + M - N)"
    assert chunked.inputs["chunk"] == ("int", 4) and chunked.inputs["first_key"][1].tolist() == [5, 2]
    groups = torch.tensor([[-1, 0, 0, -1, 1, 1, -1]])
    blocks = integration.mask_term(masks.or_masks(masks.causal_mask_function, masks.blockwise_overlay(groups)), 2, 7)
    assert blocks.text == f"(j <= i + M - N) or ({integration.BLOCK_TERM})"
    assert blocks.inputs["blocks"][1].tolist() == [[0, -1, 1, 1, -1, -1, -1]]  # (padded with text, -1)
    packed = integration.mask_term(
        masks.packed_sequence_mask_function(torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]))
    )
    assert integration.sequence_offsets(packed.packed).tolist() == [0, 2, 5, 6, 10]
    everything = integration.mask_term(masks.or_masks(masks.causal_mask_function, lambda *args: torch.tensor(True)))
    assert everything.text is None  # (a function of no argument and no closure: its constant, True)
    with pytest.raises(
        AttnccError, match=r"the mask function `.*<lambda>` \(test_transformers.py:\d+\): no attncc mapping"
    ):
        integration.mask_term(masks.or_masks(masks.causal_mask_function, lambda b, h, i, j: j < 2))
    ids, mask = batch()
    phimoe = transformers.PhimoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=6, num_local_experts=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(phimoe, attn_implementation=NAME)
    with pytest.raises(AttnccError, match="the config's sliding_window=6 is not passed to the attention call"):
        model(ids, attention_mask=mask)
    bloom = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4)
    model = transformers.AutoModelForCausalLM.from_config(bloom, attn_implementation=NAME)
    with pytest.raises(AttnccError, match="bloom models compute attention in their own code"):
        model(ids[:1])  # (no padding: it ran without a causal mask, silently)
    doge = transformers.AutoConfig.for_model(
        "doge", vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(doge, attn_implementation=NAME)
    with pytest.raises(AttnccError, match="doge models add a learned dynamic mask"):
        model(ids, attention_mask=mask)  # (an IndexError inside Doge's own mask code before)


def test_a_config_window_that_no_mask_applies_is_no_window() -> None:
    """Moshi's configs carry a `sliding_window` its modeling code never applies (its masks are
    plain causal ones, and its layers pass no window): every Moshi model was refused as if the
    window were in its mask alone (PhiMoE's, refused above). A layer whose config's masks were
    all made without a window runs without one, with and without padding, as sdpa does."""
    cfg = transformers.MoshiConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, sliding_window=5, initializer_range=0.3, audio_vocab_size=32, num_codebooks=2,
        depth_hidden_size=32, depth_num_hidden_layers=1, depth_num_attention_heads=2, depth_ffn_dim=64,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.MoshiForCausalLM(copy.deepcopy(cfg)).eval()
    ours = transformers.MoshiForCausalLM(copy.deepcopy(cfg)).eval()
    ours.load_state_dict(reference.state_dict())
    reference.set_attn_implementation("sdpa")
    ours.set_attn_implementation(NAME)
    ids, mask = batch()
    with torch.no_grad():
        expected, got = (m(ids, attention_mask=mask).logits for m in (reference, ours))
        unpadded = [m(ids[:1]).logits for m in (reference, ours)]
    real = mask.bool()
    assert expected[real].std() > 0.3
    assert (got - expected)[real].abs().max() < 2e-4
    assert (unpadded[1] - unpadded[0]).abs().max() < 2e-4


def test_models_computing_attention_in_their_own_code_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Models whose modules never import the attention interface applied the mask made for
    attncc as their own (GPT-NeoX-Japanese, ImageGPT, MegatronBert / RoFormer / RemBert
    decoders: 0.01-0.5 off in their logits, session 64's review): refused by model type (also
    under torch.compile) and, beyond the list, by what their classes' modules import; a LoRA or
    quantised Linear in them changes nothing, a user's subclass of an interface layer counts."""
    ids, mask = batch()
    small = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96)
    roformer = transformers.RoFormerConfig(**small, is_decoder=True)
    japanese = transformers.GPTNeoXJapaneseConfig(**{**small, "intermediate_size": None}, intermediate_multiple_size=2)
    for config in (roformer, japanese):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME)
        with pytest.raises(AttnccError, match=rf"{config.model_type} models compute attention in their own code"):
            model(ids, attention_mask=mask)
    monkeypatch.delitem(integration.UNSUPPORTED_MODELS, "roformer")  # (a model type the list does not name)
    model = transformers.AutoModelForCausalLM.from_config(roformer, attn_implementation=NAME)
    model.roformer.encoder.layer[0].output.dense = type("LoraLinear", (torch.nn.Linear,), {})(96, 64)
    with pytest.raises(AttnccError, match=r"RoFormerModel \(roformer\) computes attention in its own code"):
        model(ids, attention_mask=mask)
    llama, _ = models("llama")
    assert not integration.own_attention(llama)
    own_layer = type("MyAttention", (type(llama.model.layers[0].self_attn),), {"__module__": "my_models"})
    llama.model.layers[0].self_attn.__class__ = own_layer
    assert not integration.own_attention(llama) and integration.own_attention(torch.nn.Linear(2, 2))


def gemma3_models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A tiny Gemma 3 with a SigLIP vision tower (4 image tokens per image), a window of 3 on its
    sliding layers and a full layer between them; the eager reference and attncc's."""
    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=3, initializer_range=0.3, max_position_embeddings=128,
        query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
    )  # fmt: skip
    cfg = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=95, boi_token_index=93,
        eoi_token_index=94,
    )  # fmt: skip
    torch.manual_seed(0)
    made = [
        transformers.Gemma3ForConditionalGeneration._from_config(copy.deepcopy(cfg), attn_implementation=name)
        for name in ("eager", NAME)
    ]
    with torch.no_grad():  # (initialised to zeros: image tokens would reach the text model as zeros)
        made[0].model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)
    made[1].load_state_dict(made[0].state_dict())
    return made[0], made[1]


def test_gemma3_image_tokens_attend_bidirectionally_within_their_image() -> None:
    """Gemma 3's image tokens see their whole image (or_masks of causal and the blocks; on the
    sliding layers within the window): prefill logits with left padding, greedy generation
    through the cache and training gradients as eager's; without the blocks the logits differ."""
    reference, ours = (m.eval() for m in gemma3_models())
    ids = torch.randint(0, 90, (2, 20), generator=torch.Generator().manual_seed(1))
    ids[0, 6:10] = ids[1, 11:15] = 95  # one image of 4 tokens per row
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    images = dict(pixel_values=torch.randn(2, 3, 16, 16), token_type_ids=(ids == 95).long(), attention_mask=mask)
    with torch.no_grad():
        expected = reference(ids, **images).logits
        got = ours(ids, **images).logits
        causal_only = reference(ids, **{**images, "token_type_ids": None}).logits
    real = mask.bool()
    assert (got - expected)[real].abs().max() < 2e-4
    assert (causal_only - expected)[real].abs().max() > 0.5  # (the blocks change the logits)
    kwargs = dict(**images, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kwargs), reference.generate(ids, **kwargs))
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100  # (a padding row's output is each implementation's own)
    for model in (reference.train(), ours.train()):
        model(ids, **images, labels=labels).loss.backward()
    for (name, want), got in zip(reference.named_parameters(), ours.parameters()):
        if want.grad is not None:  # (a key bias's gradient is zero but for rounding: 1e-9)
            scale = want.grad.abs().max().clamp_min(1e-4)
            assert (got.grad - want.grad).abs().max() / scale < 1e-3, name


def test_a_given_mask_of_ones_rules_out_packed_sequences() -> None:
    """With an attention mask given, transformers reads no packed sequences from the position
    ids; FlashAttention's mask function turned an all-ones mask into None, and the layers then
    split a row at a jump of its positions (logits off by 12)."""
    reference, ours = (m.eval() for m in models("llama"))
    ids = torch.randint(0, VOCAB, (1, 21), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(10), torch.arange(20, 31)]).view(1, 21)
    with torch.no_grad():
        want = reference(ids, attention_mask=torch.ones_like(ids), position_ids=positions, use_cache=False).logits
        got = ours(ids, attention_mask=torch.ones_like(ids), position_ids=positions, use_cache=False).logits
    assert (got - want).abs().max() < 2e-4


def test_packed_offsets_follow_the_position_ids_row_after_row() -> None:
    """A sequence starts at each row's start and wherever a position does not follow its
    predecessor; rows of one sequence each are no packing."""
    positions = torch.tensor([[0, 1, 2, 0, 1], [4, 5, 6, 7, 8]])
    assert integration.packed_offsets(positions, 2, 5).tolist() == [0, 3, 5, 10]
    assert integration.packed_offsets(torch.arange(5).view(1, 5), 3, 5) is None  # (broadcast over the batch)
    assert integration.plain_positions(positions, 2, 5) and integration.plain_positions(positions[0], 2, 5)
    assert not integration.plain_positions(positions.expand(3, 2, 5), 2, 5)  # multimodal rotary sections


def test_padding_with_holes_is_a_clear_error() -> None:
    holes = torch.tensor([[1, 1, 0, 1, 1]])
    # (the hint for right-padded generation, whose new tokens follow the padding: session 66's review)
    with pytest.raises(AttnccError, match=r"rows \[0\] have padding between real tokens .*padding_side='left'"):
        integration.key_ranges(holes, 1, 5)
    start, end = integration.key_ranges(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]]), 3, 5)
    assert start.tolist() == [2, 0, 0] and end.tolist() == [5, 3, 0]


def test_key_ranges_eager_and_in_a_graph_are_each_rows_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each row's first real key and one past its last, (0, 0) for a row without one, from the
    mask's last `keys` columns, in eager calls (read from the mask's bytes) and in a graph
    (torch ops, `torch.compiler.is_compiling`): both against a plain loop over the rows, on
    left, right and no padding, int, bool and uint8 masks."""
    rng = random.Random(3)
    for _ in range(60):
        batch, length = rng.randint(1, 6), rng.randint(1, 40)
        keys = rng.randint(1, length)
        rows = []
        for _ in range(batch):
            first = rng.randint(0, length)
            end = rng.randint(first, length)
            rows.append([int(first <= column < end) for column in range(length)])
        dtype = rng.choice([torch.int64, torch.bool, torch.uint8])
        mask = torch.tensor(rows).to(dtype)
        want_start, want_end = [], []
        for row in rows:
            real = [column for column, value in enumerate(row[length - keys :]) if value]
            if real and real[-1] - real[0] + 1 != len(real):  # (a run cut by the last `keys` columns stays one)
                raise AssertionError("not a run")
            want_start.append(real[0] if real else 0)
            want_end.append(real[-1] + 1 if real else 0)
        for in_graph in (False, True):
            monkeypatch.setattr(torch.compiler, "is_compiling", lambda in_graph=in_graph: in_graph)
            start, end = integration.key_ranges(mask, batch, keys)
            assert start.dtype == end.dtype == torch.int64
            assert (start.tolist(), end.tolist()) == (want_start, want_end), (rows, keys, in_graph)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    with pytest.raises(AttnccError, match=r"rows \[1\] have padding between"):
        integration.key_ranges(torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.uint8), 2, 3)


def test_key_ranges_are_computed_once_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers share the mask's key ranges, by value: a mask written in place (by torch or
    through numpy, which leaves its version counter as it was) or other sizes are computed
    afresh, another mask object with the same values is not (and the logits stay right)."""
    computed: list[tuple[int, int]] = []
    original = integration.key_ranges

    def counting(mask: torch.Tensor, batch: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
        computed.append((batch, keys))
        return original(mask, batch, keys)

    monkeypatch.setattr(integration, "key_ranges", counting)
    reference, ours = (m.eval() for m in models("llama"))
    ids, mask = batch(right_padding=4)
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
    assert len(computed) == 1 and ours.config.num_hidden_layers > 1
    attend = integration.ModelAttention()
    first = attend.ranges(mask, 2, 21)
    assert attend.ranges(mask, 2, 21) is first and len(computed) == 2
    mask[0, :3] = 0  # in place: sequence 0 now starts at key 3
    start, end = attend.ranges(mask, 2, 21)
    assert start.tolist() == [3, 5] and end.tolist() == [17, 21] and len(computed) == 3
    attend.ranges(mask.clone(), 2, 21)
    assert len(computed) == 3
    mask.numpy()[1, 5] = 0
    start, end = attend.ranges(mask, 2, 21)
    assert start.tolist() == [3, 6] and len(computed) == 4
    attend.ranges(mask, 2, 20)
    assert len(computed) == 5
    with torch.no_grad():
        expected = reference(ids, attention_mask=batch(right_padding=4)[1]).logits
    real = batch(right_padding=4)[1].bool()
    assert (got - expected)[real].abs().max() < 2e-4


def test_inference_mode_and_position_ids_rewritten_without_a_version() -> None:
    """Under torch.inference_mode (its tensors have no version counter: every padded forward
    failed there), a server's position ids rewritten through numpy between forwards (the object
    and its version counter unchanged: the second forward reused the first one's packing,
    logits off by 12) are packed afresh."""
    reference, ours = (m.eval() for m in models("llama"))
    ids, positions, _ = packed_row()
    lengths = (5, 9, 8)
    padded_ids, mask = batch()
    with torch.inference_mode():
        first = ours(ids, position_ids=positions, use_cache=False).logits
        positions.numpy()[:] = torch.cat([torch.arange(n) for n in lengths]).numpy()
        second = ours(ids, position_ids=positions, use_cache=False).logits
        alone = torch.cat([reference(part).logits for part in ids.split(lengths, 1)], 1)
        padded = ours(padded_ids, attention_mask=mask).logits
        expected = reference(padded_ids, attention_mask=mask).logits
    assert (second - alone).abs().max() < 2e-4 and (first - second).abs().max() > 0.1
    assert (padded - expected)[mask.bool()].abs().max() < 2e-4


def test_bidirectional_layers_mask_padding_on_both_sides() -> None:
    """A layer with is_causal False (an encoder) sees exactly its sequence's real keys."""
    module = torch.nn.Module()
    module.is_causal = False
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 9, 16, generator=gen)
    k, v = (torch.randn(2, 2, 9, 16, generator=gen) for _ in range(2))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 6:] = False
    mask[1, :2] = False
    out, weights = integration.ModelAttention()(module, q, k, v, mask, scaling=0.3)
    kk, vv = (t.repeat_interleave(2, 1).double() for t in (k, v))
    allowed = mask[:, None, None, :]
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=allowed, scale=0.3)
    assert weights is None and out.shape == (2, 9, 4, 16)
    assert (out.double() - expected.transpose(1, 2)).abs().max() < 1e-5


@pytest.mark.parametrize(
    ("mask_says", "flag", "padded"),
    [("bidirectional", True, False), ("bidirectional", True, True), ("causal", False, True)],
)
def test_layers_follow_the_mask_functions_causality_over_their_flag(mask_says: str, flag: bool, padded: bool) -> None:
    """Step3p7's full layers keep is_causal=True under a bidirectional mask (causal OR all), and
    Aimv2's text layers is_causal=False under the causal mask its model makes: eager and sdpa
    read the mask, attncc read the flag (4.1 and 3.7 off eager, a future token leaking into the
    past; session 61's review). The mask function's causality rides on the mask it hands out."""
    from transformers import masking_utils as masks

    function = (
        masks.or_masks(masks.causal_mask_function, masks.bidirectional_mask_function)
        if mask_says == "bidirectional"
        else masks.causal_mask_function
    )
    batch, length = 2, 7
    padding = torch.ones(batch, length, dtype=torch.bool)
    padding[1, :2] = False
    given = integration.attncc_attention_mask(
        batch, length, length, 0, 0, mask_function=function, attention_mask=padding if padded else None
    )
    module = torch.nn.Module()
    module.is_causal = flag
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(batch, 4, length, 16, generator=gen)
    k, v = (torch.randn(batch, 2, length, 16, generator=gen) for _ in range(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        attend = integration.ModelAttention()
        out, _ = attend(module, q, k, v, given, output_attentions=True)
        attend(module, q, k, v, given, output_attentions=True)
    assert len([w for w in caught if "output_attentions=True" in str(w.message)]) == 1  # (once, not dropped silently)
    keep = (padding if padded else torch.ones_like(padding))[:, None, None, :].expand(batch, 1, length, length)
    if mask_says == "causal":
        keep = keep & torch.ones(length, length, dtype=torch.bool).tril()
    kk, vv = (t.repeat_interleave(2, 1).double() for t in (k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=keep)
    rows = keep.any(-1)[:, :, :, None].transpose(1, 2)  # (rows of no key: 0 here, NaN in torch's)
    assert (out.double() - expected.transpose(1, 2)).where(rows, 0.0).abs().max() < 1e-5


def test_the_training_example_runs_and_learns() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "examples" / "train_transformers.py"
    run = subprocess.run([sys.executable, str(script), "--steps", "10"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    losses = [float(line.split()[3]) for line in run.stdout.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < 0.9 * losses[0], run.stdout


def test_the_generation_benchmark_runs_and_times_each_part(tmp_path: Path) -> None:
    """`bench/bench_generate.py` at tiny sizes (a smoke test of the script, not a timing): both
    models give the same tokens (it exits otherwise) and its JSON holds every figure, the layer
    calls' times of the step's first call and of the others included."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "bench" / "bench_generate.py"
    sizes = ["--layers", "2", "--batch", "2", "--prompt", "40", "--new", "3", "--repeats", "1"]
    out = tmp_path / "generate.json"
    run = subprocess.run(
        [sys.executable, str(script), *sizes, "--json", str(out)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    for figure in ("ms_per_token", "prefill_ms", "ms_per_step"):
        assert set(result[figure]) == {"sdpa", "attncc-bench"} and min(result[figure].values()) > 0, figure
    calls = result["us_per_layer_call"]
    assert all(calls[name][kind] > 0 for name in ("sdpa", "attncc-bench") for kind in ("first", "others")), calls


def test_training_under_autocast_matches_sdpa() -> None:
    """The AMP recipe (fp32 weights, `torch.autocast("cpu", torch.bfloat16)` around the
    forward): Llama's rotary embedding hands attention float32 q and k beside a bfloat16 v,
    which SDPA casts to bfloat16 as autocast's lower-precision op; attncc's call does the same."""
    reference, ours = (m.train() for m in models("llama"))
    ids, mask = batch()
    losses = []
    for model in (reference, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = model(ids, attention_mask=mask, labels=ids)
        assert result.logits.dtype == torch.bfloat16
        result.loss.backward()
        losses.append(result.loss.item())
    assert abs(losses[0] - losses[1]) < 1e-2 * abs(losses[0]), losses
    expected = torch.cat([p.grad.flatten() for p in reference.parameters()])
    got = torch.cat([p.grad.flatten() for p in ours.parameters()])
    assert (got - expected).norm() / expected.norm() < 3e-2


def test_a_dense_masks_scaling_and_a_padding_mask_longer_than_the_keys() -> None:
    """A layer given a 4-D bool mask runs at its `scaling` (a review's mutant dropped it: 1.06
    off), and a padding mask longer than the call's keys (a sliding-window cache) is read over
    its last `keys` columns; against torch's SDPA and the ranges written here."""
    attention = integration.ModelAttention()
    layer = torch.nn.Module()
    layer.is_causal = True
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=gen) for _ in range(3))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    out, _ = attention(layer, q, k, v, mask, scaling=0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5).transpose(1, 2)
    assert (out - want).abs().max() < 1e-5
    start, end = integration.key_ranges(torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]), 2, 4)
    assert start.tolist() == [0, 0] and end.tolist() == [4, 4]
    start, end = integration.key_ranges(torch.tensor([[0, 1, 1, 1, 1, 0], [1] * 6]), 2, 4)
    assert start.tolist() == [0, 0] and end.tolist() == [3, 4]
