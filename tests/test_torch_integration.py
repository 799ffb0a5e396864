"""Kernels as PyTorch citizens: torch.compile with changing shapes and scalars, the gradient
of the log-sum-exp, clear errors for what is not supported (double backward, torch.func,
forward AD, bad seeds), NaN propagation, pickling and freeing kernels."""

from __future__ import annotations

import copy
import gc
import os
import pickle
import subprocess
import sys
import weakref

import pytest
import torch

import attncc
from attncc.errors import InputError
from attncc.runtime.inputs import Shape, adapt, make_inputs
from tests.conftest import ROOT, ROOT_FIRST_PYTHONPATH, count_full_paths, kernel, loss_gradients

TEMPERED = (
    "attention tempered\ninput n: int\ninput t: float\ns = q @ k.T * scale\ns = s * t\nmask j < n + i\n"
    "p = softmax(s)\no = p @ v\noutput o\n"
)


def test_compile_fullgraph_with_changing_shapes_scalars_and_scale() -> None:
    vanilla = kernel("vanilla")
    dynamic = torch.compile(lambda q: vanilla(q, q, q), fullgraph=True, dynamic=True)
    for shape in ((1, 2, 9, 8), (1, 2, 17, 16), (2, 1, 5, 32)):  # head dim changes too
        q = torch.randn(*shape)
        assert torch.allclose(dynamic(q), vanilla(q, q, q), atol=1e-6)
    tempered = attncc.compile(TEMPERED)
    compiled = torch.compile(lambda q, n, t, sc: tempered(q, q, q, n=n, t=t, scale=sc), fullgraph=True)
    for n, t, sc in ((3, 0.5, 0.3), (5, 0.7, 0.6), (2, 1.5, 0.9)):
        q = torch.randn(1, 2, 9, 8, requires_grad=True)
        out = compiled(q, n, t, sc)
        (grad,) = torch.autograd.grad(out.sum(), q)
        ref = tempered(q, q, q, n=n, t=t, scale=sc)
        (ref_grad,) = torch.autograd.grad(ref.sum(), q)
        assert torch.allclose(out, ref, atol=1e-6) and torch.allclose(grad, ref_grad, atol=1e-5)


def test_a_value_new_every_step_compiles_once_as_a_tensor_input() -> None:
    """What the error for a tensor given as a scalar under torch.compile advises (a graph per
    value of a scalar, dynamic=True or not; the 9th a hard failure under fullgraph=True: session
    61's review): a value new at every step (a window, a cache length) declared `int[1]` is read
    inside the op, one graph for every value, padded (forward and backward), packed and paged,
    each value's answer the eager one."""
    from torch._dynamo.utils import counters

    stepped = attncc.compile(TEMPERED.replace("input n: int\n", "input n: int[1]\n").replace("n + i", "n[0] + i"))
    padded = torch.compile(lambda q, n: stepped(q, q, q, n=n, t=0.5), fullgraph=True, dynamic=True)
    packed = torch.compile(lambda q, cu, n: stepped.varlen(q, q, q, cu, cu, n=n, t=0.5), fullgraph=True, dynamic=True)
    paged = torch.compile(
        lambda q, cache, table, lengths, n: stepped.paged(q, cache, cache, table, lengths, n=n, t=0.5),
        fullgraph=True,
        dynamic=True,
    )
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    cache, table = torch.randn(6, 4, 2, 8, generator=gen), torch.arange(6, dtype=torch.int32).view(2, 3)
    lengths = torch.tensor([5, 11], dtype=torch.int32)
    torch._dynamo.reset()
    counters.clear()
    for value in range(-2, 10):
        n = torch.tensor([value])
        q = torch.randn(1, 2, 9, 8, generator=gen, requires_grad=True)
        out = padded(q, n)
        ref = stepped(q, q, q, n=n, t=0.5)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
        for got, want in zip(torch.autograd.grad(out.sum(), q), torch.autograd.grad(ref.sum(), q)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        rows = q.detach()[0].transpose(0, 1)  # [9 tokens, 2 heads, 8]
        want = stepped.varlen(rows, rows, rows, cu, cu, n=n, t=0.5)
        torch.testing.assert_close(packed(rows, cu, n), want, atol=1e-6, rtol=1e-6)
        with torch.no_grad():
            step = q.detach()[:, :, :2].expand(2, -1, -1, -1).transpose(1, 2)  # [2, 2 rows, 2 heads, 8]
            want = stepped.paged(step, cache, cache, table, lengths, n=n, t=0.5)
            torch.testing.assert_close(paged(step, cache, table, lengths, n), want, atol=1e-6, rtol=1e-6)
    assert counters["stats"]["unique_graphs"] == 3  # (padded, packed, paged: one each)


def test_compile_fullgraph_as_a_fresh_kernels_first_use_with_runtime_tensors() -> None:
    """A model compiled from the start: the kernel's first call is traced (its per-program
    properties were cached_propertys, whose lock dynamo cannot trace)."""
    alibi = attncc.compile(ROOT / "examples" / "alibi.attn")
    compiled = torch.compile(lambda q, slopes: alibi(q, q, q, slopes=slopes), fullgraph=True)
    q, slopes = torch.randn(2, 4, 9, 16), torch.rand(4)
    assert torch.allclose(compiled(q, slopes), attncc.compile(ROOT / "examples" / "alibi.attn")(q, q, q, slopes=slopes))


def test_compile_fullgraph_makes_a_drop_in_s_new_option_set_while_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    """SDPA's and FlashAttention's drop-ins under torch.compile(fullgraph=True) from their first
    call: each kernel a call's options ask for is compiled while dynamo traces (it failed on the
    kernel lock's context manager: every new option set had to run eagerly first)."""
    from attncc.integrations import flash_attn, made, sdpa

    # fresh kernel tables, so that every option set below is new to this process
    monkeypatch.setattr(sdpa, "_kernel", made.MadeKernels(sdpa.SdpaOptions, sdpa.sdpa_program))
    monkeypatch.setattr(flash_attn, "_kernel", made.MadeKernels(flash_attn.CallOptions, flash_attn.flash_program))

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        # (two new option sets of one drop-in in one trace: the second was missing from the table dynamo read)
        biased = sdpa.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        biased = biased + sdpa.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        windowed = flash_attn.flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, window_size=(5, 0), softcap=3.0
        )
        return biased + windowed.transpose(1, 2)

    gen = torch.Generator().manual_seed(5)
    shapes = ((2, 4, 11, 16), (2, 2, 13, 16), (2, 2, 13, 16), (2, 1, 11, 13))
    operands = [torch.randn(shape, generator=gen, requires_grad=True) for shape in shapes]
    out = torch.compile(step, fullgraph=True)(*operands)
    grads = torch.autograd.grad(out.square().sum(), operands)
    monkeypatch.setattr(sdpa, "_kernel", made.MadeKernels(sdpa.SdpaOptions, sdpa.sdpa_program))
    monkeypatch.setattr(flash_attn, "_kernel", made.MadeKernels(flash_attn.CallOptions, flash_attn.flash_program))
    want = step(*operands)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    for got, expected in zip(grads, torch.autograd.grad(want.square().sum(), operands)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    # dynamic sizes and a rate given as a traced number (a guard on its value: each rate is a
    # program), made and found while tracing (the first version of the trace-time compile
    # refused both: dynamo hands no traced number to an untraced function)
    q = operands[0].detach()
    sdpa.scaled_dot_product_attention(q, q, q, dropout_p=0.25)  # (made eagerly: found while tracing)
    torch._dynamo.reset()
    dynamic = torch.compile(
        lambda q, rate: sdpa.scaled_dot_product_attention(q, q, q, dropout_p=rate), fullgraph=True, dynamic=True
    )
    for rate in (0.15, 0.25, 0.35):
        dropped = dynamic(q, rate)
        kept = sdpa.scaled_dot_product_attention(q, q, q)
        assert dropped.shape == q.shape and not torch.equal(dropped, kept)

    # the marker made.py sets in place of torch.compiler.assume_constant_result (which imports dynamo)
    def constant() -> int:
        return 0

    torch.compiler.assume_constant_result(constant)
    assert constant.__dict__ == {"_dynamo_marked_constant": True} and made._made._dynamo_marked_constant


def test_a_scale_tensor_asking_a_gradient_or_traced_is_a_clear_error() -> None:
    """A learnable temperature as `scale=` got no gradient silently; a tensor scale or scalar
    input under torch.compile failed deep inside the op's schema check."""
    kern = attncc.compile(TEMPERED)
    q = torch.randn(1, 2, 9, 8)
    temperature = torch.tensor(0.5, requires_grad=True)
    with pytest.raises(InputError, match="scale: this tensor requires grad, but a call's scale gets no gradient"):
        kern(q, q, q, n=3, t=1.0, scale=temperature)
    assert torch.equal(kern(q, q, q, n=3, t=1.0, scale=temperature.detach()), kern(q, q, q, n=3, t=1.0, scale=0.5))
    with torch.no_grad():
        kern(q, q, q, n=3, t=1.0, scale=temperature)
    for call in (lambda q, x: kern(q, q, q, n=3, t=1.0, scale=x), lambda q, x: kern(q, q, q, n=3, t=x)):
        with pytest.raises(
            Exception,
            match=r"a tensor under torch\.compile; pass a Python number \(a compiled graph "
            r"recompiles for each new value, dynamic=True or not: declare .* as a tensor, `int\[1\]`\)",
        ):
            torch.compile(call, fullgraph=True)(q, torch.tensor(0.5))


@pytest.mark.usefixtures("two_threads")
def test_compiled_calls_repeat_kept_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a torch.compile'd graph the ops' implementations repeat the launches a checked call
    kept (`Kernel.op_repeat_key`: sizes, strides, dtypes, scale, scalar values, threads),
    forward and backward, where they took the full path (plan, prepared call, packing) on every
    call before. Fresh q, k, v and dout each step; the loss on out, on out and lse, on lse; a
    new scalar value is a new key. Every output and gradient against float64 torch code."""
    kern = attncc.compile(TEMPERED)
    full = count_full_paths(monkeypatch)
    compiled = torch.compile(lambda q, k, v, n: kern(q, k, v, n=n, t=0.7, return_lse=True), fullgraph=True)
    gen = torch.Generator().manual_seed(4)
    B, H, N, D = 2, 3, 37, 24
    for step, (loss, n) in enumerate([("out", 5), ("out", 5), ("out and lse", 5), ("lse", 5), ("out", 9), ("out", 9)]):
        q, k, v = (torch.randn(B, H, N, D, generator=gen, requires_grad=True) for _ in range(3))
        dout, dlse = torch.randn(B, H, N, D, generator=gen), torch.randn(B, H, N, generator=gen)
        full["forward"].clear()
        out, lse = compiled(q, k, v, n)
        assert len(full["forward"]) == (1 if step in (0, 4) else 0), step  # (a new n: a new key)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        s = leaves[0] @ leaves[1].transpose(-1, -2) / D**0.5 * 0.7
        s = s.masked_fill(~(torch.arange(N).view(1, -1) < n + torch.arange(N).view(-1, 1)), float("-inf"))
        ref_out, ref_lse = torch.softmax(s, -1) @ leaves[2], torch.logsumexp(s, -1)
        assert (out.double() - ref_out).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5
        got, want = loss_gradients(loss, (out, lse), (ref_out, ref_lse), (q, k, v), tuple(leaves), dout, dlse)
        for name, g, w in zip("qkv", got, want):
            assert (g.double() - w).abs().max() <= 1e-4 * max(1.0, w.abs().max().item()), (step, loss, name)
    # the first backward of each key ran the full path, keeping its launch with the forward's
    assert len(full["backward"]) == 2 and all(kept is not None for kept in full["backward"])
    assert all(kept.backward_launch is not None for kept in full["backward"])


RANGED = (
    "attention ranged\ninput kv_start: int[B]\ninput kv_end: int[B]\ninput slopes: float[H]\n"
    "s = q @ k.T * scale - slopes[h] * (i + M - N - j)\nmask j >= kv_start[b] and j < kv_end[b] and j <= i + M - N\n"
    "p = softmax(s)\no = p @ v\noutput o\n"
)


def test_compiled_calls_with_runtime_tensors_repeat_kept_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runtime tensors made in a compiled graph are new tensors every call (a compiled model's
    key ranges): the op keys a kept launch by their shapes and strides and by the values of
    those the host reads (`kv_start`, `kv_end`: tile classes), and takes the others' (ALiBi
    slopes) from each call. Every compiled call took the full path until session 63 (~100 us of
    host time per layer and token in a compiled generate). New slope values repeat the launch
    and are read; new ranges are a new key; the old ranges again repeat the first launch.
    Every output against float64 torch code."""
    kern = attncc.compile(RANGED)
    full = count_full_paths(monkeypatch)
    B, H, N, M, D = 3, 4, 2, 29, 16
    compiled = torch.compile(
        lambda q, k, v, start, end, slopes: kern(q, k, v, kv_start=start + 0, kv_end=end + 0, slopes=slopes * 1.0),
        fullgraph=True,
    )
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, rows, D, generator=gen) for rows in (N, M, M))
    first, second = ([0, 3, 7], [29, 20, 25]), ([2, 0, 0], [29, 29, 11])
    steps = [(first, 0.5, True), (first, 0.5, False), (first, -0.25, False), (second, -0.25, True), (first, 2.0, False)]
    for step, ((starts, ends), slope, full_path) in enumerate(steps):
        start, end = torch.tensor(starts), torch.tensor(ends)
        slopes = slope * torch.arange(1, H + 1, dtype=torch.float32)
        full["forward"].clear()
        out = compiled(q, k, v, start, end, slopes)
        assert len(full["forward"]) == int(full_path), step
        i, j = torch.arange(N).view(-1, 1) + M - N, torch.arange(M).view(1, -1)
        s = q.double() @ k.double().transpose(-1, -2) / D**0.5 - slopes.double().view(1, H, 1, 1) * (i - j)
        kept = (j >= start.view(B, 1, 1, 1)) & (j < end.view(B, 1, 1, 1)) & (j <= i)
        expected = torch.softmax(s.masked_fill(~kept, float("-inf")), -1) @ v.double()
        assert (out.double() - expected).abs().max() < 1e-5, step


def test_descale_factors_with_other_than_fp8_k_are_refused_on_a_repeat() -> None:
    """A call that would repeat a kept launch but gives descale factors with bf16 K/V gets the
    full path's error, not the launch (descale factors go with fp8 K/V only)."""
    kern = kernel("vanilla")
    q = torch.randn(1, 2, 9, 16).bfloat16()
    kern(q, q, q)
    kern(q, q, q)
    with pytest.raises(attncc.InputError, match="k_descale: descale factors go with fp8 k and v"):
        kern(q, q, q, k_descale=0.5, v_descale=0.5)


def test_a_scale_tensor_changed_in_place_is_not_a_repeat() -> None:
    """A repeated call's key holds the scale's value (a 0-d tensor's, not its identity): the
    same tensor with a new value takes a launch of its own, padded and packed."""
    kern = kernel("vanilla")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 4, 9])
    scale = torch.tensor(0.5)
    for value in (0.5, 0.5, 0.25, 0.25):
        scale.fill_(value)
        expected = torch.softmax(q.double() @ k.double().transpose(-1, -2) * value, -1) @ v.double()
        assert (kern(q, k, v, scale=scale).double() - expected).abs().max() < 1e-5, value
        rows = [t[0].transpose(0, 1) for t in (q, k, v)]  # [9, 2, 16]: sequences of 4 and 5 rows
        out = kern.varlen(*rows, cu, cu, scale=scale)
        for b, (start, end) in enumerate(((0, 4), (4, 9))):
            s = q[0, :, start:end].double() @ k[0, :, start:end].double().transpose(-1, -2) * value
            want = torch.softmax(s, -1) @ v[0, :, start:end].double()
            assert (out[start:end].transpose(0, 1).double() - want).abs().max() < 1e-5, (value, b)


def test_compile_fullgraph_with_dropout_and_no_seed() -> None:
    """The seed is drawn as a tensor, so tracing needs no data-dependent value; the compiled
    call draws from torch's generator like the eager one."""
    gpt2 = kernel("gpt2")
    compiled = torch.compile(lambda q: gpt2(q, q, q), fullgraph=True)
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    torch.manual_seed(5)
    first = compiled(q)
    first.sum().backward()
    torch.manual_seed(5)
    again = compiled(q)
    assert torch.equal(first, again) and torch.isfinite(q.grad).all()
    assert not torch.equal(compiled(q), first)  # a fresh seed per call


@pytest.mark.parametrize("name", ["alibi", "gpt2", "padding"])
def test_lse_is_differentiable(name: str) -> None:
    kern = kernel(name)
    q, k, v, runtime = make_inputs(kern, adapt(Shape(1, 2, 1, 6, 7, 4), kern), torch.float64, seed=4)
    learnable = {
        n: t.detach().double().requires_grad_()
        for n, t in runtime.items()
        if isinstance(t, torch.Tensor) and t.requires_grad
    }
    fixed = {n: t for n, t in runtime.items() if n not in learnable}

    def fn(q, k, v, *extra):
        out, lse = kern(q, k, v, seed=3, return_lse=True, **fixed, **dict(zip(learnable, extra)))
        return out.sum(-1) + 0.5 * lse.nan_to_num(0.0, 0.0, 0.0) ** 2  # loss on both outputs

    assert torch.autograd.gradcheck(fn, (q, k, v, *learnable.values()), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_lse_gradient_on_the_cuda_emulator() -> None:
    kern = attncc.compile(ROOT / "examples" / "causal.attn", target="sm80", emulate=True)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=gen, dtype=torch.float16, requires_grad=True) for _ in range(3))
    _, lse = kern(q, k, v, return_lse=True)
    grads = torch.autograd.grad(lse.sum(), [q, k])
    r = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(kern.reference(*r)[1].sum(), r[:2])
    for g, rg in zip(grads, ref):
        assert (g.double() - rg).abs().max() < 2e-2


def test_eager_training_calls_record_their_graph_without_the_op_and_match_it() -> None:
    """An eager call that records a graph runs the op's forward and backward through a plain
    autograd Function (host time: torch.library's dispatch cost ~0.1 ms a call); a profiler
    (like torch.compile, modes and transforms) sees the op itself. Both give the same values
    and gradients, runtime-input gradients included, against float64 torch code."""
    kern = kernel("alibi")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 37, 24, generator=gen, requires_grad=True) for _ in range(3))
    slopes = torch.rand(4, generator=gen).requires_grad_()
    dout = torch.randn(2, 4, 37, 24, generator=gen)
    eager = kern(q, k, v, slopes=slopes)
    assert type(eager.grad_fn).__name__ == "_EagerAttentionBackward"
    with torch.profiler.profile() as prof:
        through_op = kern(q, k, v, slopes=slopes)
    assert "attncc::attention" in {event.name for event in prof.events()}
    assert type(through_op.grad_fn).__name__ != "_EagerAttentionBackward"
    grads = [torch.autograd.grad(out, (q, k, v, slopes), dout) for out in (eager, through_op)]
    assert torch.equal(eager, through_op)
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, slopes)]
    ref = kern.reference(*leaves[:3], slopes=leaves[3])[0]
    expected = torch.autograd.grad(ref, leaves, dout.double())
    for got, want in zip(grads[0], expected):
        assert (got.double() - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())


def counted_checks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one each time a kernel call runs its checks (`Kernel.validate`)."""
    checked: list[int] = []
    validate = attncc.Kernel.validate

    def counting_validate(self: attncc.Kernel, *args: object, **options: object) -> None:
        checked.append(1)
        validate(self, *args, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(attncc.Kernel, "validate", counting_validate)
    return checked


def test_training_calls_repeat_a_kept_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A call recording a graph that repeats a checked call's launch runs it kept (no checks),
    with the same values and gradients as the first call's full path, and right ones."""
    kern = attncc.compile(ROOT / "examples" / "causal.attn")
    checked = counted_checks(monkeypatch)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 29, 40, generator=gen, requires_grad=True) for _ in range(3))
    dout = torch.randn(2, 3, 29, 40, generator=gen)
    calls = [kern(q, k, v, return_lse=True) for _ in range(3)]
    assert len(checked) == 1
    assert all(type(out.grad_fn).__name__ == "_EagerAttentionBackward" for out, _ in calls)
    grads = [torch.autograd.grad((out, lse), (q, k, v), (dout, torch.ones_like(lse))) for out, lse in calls]
    for (out, lse), call_grads in zip(calls[1:], grads[1:]):
        assert torch.equal(out, calls[0][0]) and torch.equal(lse, calls[0][1])
        assert all(torch.equal(a, b) for a, b in zip(call_grads, grads[0]))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = leaves[0] @ leaves[1].transpose(-1, -2) / 40**0.5
    s = s.masked_fill(torch.ones(29, 29, dtype=torch.bool).triu(1), float("-inf"))
    ref_lse = torch.logsumexp(s, -1)
    ref_out = torch.softmax(s, -1) @ leaves[2]
    expected = torch.autograd.grad((ref_out, ref_lse), leaves, (dout.double(), torch.ones_like(ref_lse)))
    for got, want in zip(grads[-1], expected):
        assert (got.double() - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())


RECENT = (
    "attention recent\ninput n: int\ns = q @ k.T * scale\nmask j <= i and i - j < n\np = softmax(s)\n"
    "o = p @ v\noutput o\n"
)


def recent_mask(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    return (j <= i) & (i - j < 6)


def butterfly_mask(i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    blocks = (i // 64) ^ (j // 64)  # visible where the query and key blocks' xor is 0 or a power of two
    return (blocks & (blocks - 1)) == 0


@pytest.mark.parametrize(
    ("program", "visible", "n", "passes"),
    [
        (RECENT, recent_mask, 23, "fused"),
        (RECENT, recent_mask, 23, "two-pass"),
        (ROOT / "examples" / "blocksparse_butterfly.attn", butterfly_mask, 150, "auto"),  # a layout grid
    ],
)
@pytest.mark.usefixtures("two_threads")  # (the thread count changes to 1 between a forward and its backward)
def test_training_backwards_repeat_a_kept_launch(
    monkeypatch: pytest.MonkeyPatch, program: object, visible: object, n: int, passes: str
) -> None:
    """The backward of a call whose forward kept its launch repeats the backward's packed launch
    (`BackwardLaunch`): from the second backward on no plan, no prepared call, no packing. Every call here has fresh q, k, v and dout (new addresses, new values), the loss on
    out, on out and lse, or on lse alone, dout contiguous or not, and the thread count changed
    between a forward and its backward once; every gradient against float64 torch code."""
    kern = attncc.compile(program)
    kern.backward = passes
    full_paths = []
    backward_impl = attncc.Kernel.backward_impl

    def counting_backward(self: attncc.Kernel, *args: object, **kwargs: object) -> object:
        full_paths.append(kwargs.get("kept_by"))
        return backward_impl(self, *args, **kwargs)

    monkeypatch.setattr(attncc.Kernel, "backward_impl", counting_backward)
    gen = torch.Generator().manual_seed(11)
    B, H, Hkv, D = 2, 4, 2, 24  # GQA; N not a multiple of any tile
    runtime = {"n": 6} if program is RECENT else {}

    def expected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = (t.double().repeat_interleave(H // Hkv, dim=1) for t in (k, v))
        s = q.double() @ k.transpose(-1, -2) / D**0.5
        s = s.masked_fill(~visible(torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)), float("-inf"))
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    losses = ["out", "out", "out and lse", "lse", "out, dout expanded", "out", "out, threads changed"]
    for step, loss in enumerate(losses):
        q = torch.randn(B, H, n, D, generator=gen, requires_grad=True)
        k, v = (torch.randn(B, Hkv, n, D, generator=gen, requires_grad=True) for _ in range(2))
        dout = torch.randn(B, H, n, D, generator=gen)
        if "expanded" in loss:
            dout = torch.randn(1, H, n, D, generator=gen).expand(B, H, n, D)
        dlse = torch.randn(B, H, n, generator=gen)
        out, lse = kern(q, k, v, return_lse=True, **runtime)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = expected(*leaves)
        got, want = loss_gradients(loss, (out, lse), (ref_out, ref_lse), (q, k, v), tuple(leaves), dout, dlse)
        for name, g, w in zip("qkv", got, want):
            assert (g.double() - w).abs().max() <= 1e-4 * max(1.0, w.abs().max().item()), (step, loss, name)
    # the first backward ran the full path and kept its launch with the launch its forward
    # kept (the backward finds it by the call's key: `op_repeat_key`), the others repeated it,
    # but for the thread count the launch was not packed for (the full path, kept again)
    assert len(full_paths) == 2 and full_paths[0] is not None and full_paths[1] is full_paths[0]
    assert full_paths[0].backward_launch is not None


def test_double_backward_is_a_clear_error() -> None:
    q = torch.randn(1, 1, 8, 8, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(kernel("vanilla")(q, q, q).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="attncc kernels are differentiable once"):
        g.sum().backward()


def test_repeated_plain_calls_reuse_the_checked_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain call that repeats a checked call's sizes, strides, dtypes, scalars and thread
    count runs the launch packed then, without checks (host time); anything that changes the
    launch or needs the op takes the full path. Every result against float64 torch code."""
    import torch.autograd.forward_ad as fwad

    kern = attncc.compile(
        "attention recent\ninput n: int\ns = q @ k.T * scale\nmask j <= i and i - j < n\np = softmax(s)\n"
        "o = p @ v\noutput o\n"
    )

    def expected(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
        s = q.double() @ k.double().transpose(-1, -2) / q.shape[-1] ** 0.5
        i, j = torch.arange(q.shape[2]).view(-1, 1), torch.arange(k.shape[2]).view(1, -1)
        s = s.masked_fill(~((j <= i) & (i - j < n)), float("-inf"))
        return torch.softmax(s, -1) @ v.double()

    checked = counted_checks(monkeypatch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 37, 24, generator=g) for _ in range(3))

    def agrees(q: torch.Tensor, n: int, tol: float = 1e-5) -> None:
        out, lse = kern(q, k.to(q.dtype), v.to(q.dtype), n=n, return_lse=True)
        want = expected(q, k.to(q.dtype), v.to(q.dtype), n)
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
        assert out.dtype == q.dtype and lse.shape == q.shape[:3] and torch.isfinite(lse).all()

    for n in (5, 5, 9, 9, 5):  # a scalar's value is part of what repeats
        agrees(q, n)
    assert len(checked) == 2
    transposed = torch.randn(2, 37, 3, 24, generator=g).transpose(1, 2)  # q's strides change
    agrees(transposed, 5)
    agrees(transposed, 5)
    assert len(checked) == 3
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        agrees(q, 5)
    finally:
        torch.set_num_threads(threads)
    assert len(checked) == 4
    agrees(q.bfloat16(), 5, tol=2e-2)
    agrees(q.bfloat16(), 5, tol=2e-2)
    assert len(checked) == 5
    # checks still run where a call differs, and the op still sees what must see it
    with pytest.raises(InputError, match="q, k, v must have one dtype"):
        kern(q, k.double(), v, n=5)
    with pytest.raises(InputError, match="n: expected an int scalar"):
        kern(q, k, v, n=5.5)
    with pytest.raises(InputError, match="missing runtime input `n`"):
        kern(q, k, v)
    assert kern(q.clone().requires_grad_(), k, v, n=5).grad_fn is not None
    with pytest.raises(InputError, match="no forward-mode derivative"), fwad.dual_level():
        kern(fwad.make_dual(q, torch.ones_like(q)), k, v, n=5)
    with pytest.raises(InputError, match=r"do not support torch\.func transforms"):
        torch.func.vmap(lambda x: kern(x, k, v, n=5))(q.unsqueeze(0))


WINDOWED_RANGES = """
attention windowed_ranges
input kv_start: int[B]
input kv_end: int[B]
s = q @ k.T * scale
mask j >= kv_start[b] and j < kv_end[b] and j <= i + (M - N) and j > i + (M - N) - 200
p = softmax(s)
o = p @ v
output o
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decoding_launch_never_reads_its_empty_tiles(dtype: torch.dtype) -> None:
    """A decoding call's kept launch (kept, then repeated) skips the tiles its classes empty: NaN
    keys and infinite values in key tiles that no score of a sequence sees (a cache's slots past
    its tokens, torch.empty's bits) change nothing, a sequence of no key gives out 0 and lse
    -inf, the others float64 torch's results. (Every tile left partial, the kernel multiplying
    P = 0 by those values, gave NaN: session 77's review.)"""
    from attncc.passes.sparsity import EMPTY

    kern = attncc.compile(WINDOWED_RANGES)
    g = torch.Generator().manual_seed(11)
    B, H, Hkv, D = 3, 4, 2, 16
    kv_start, kv_end = torch.tensor([0, 37, 90]), torch.tensor([300, 251, 90])  # (the last: no key)
    for N, M in ((1, 300), (4, 300), (1, 2000)):
        q, k, v = (
            torch.randn(B, heads, rows, D, generator=g).to(dtype) for heads, rows in ((H, N), (Hkv, M), (Hkv, M))
        )
        ranges = dict(kv_start=kv_start, kv_end=torch.where(kv_end == 300, M, kv_end))
        tiles, classes = kern.forward_classes(q, k, **ranges)
        empty = (classes == EMPTY).all(2).all(1).expand(B, -1)  # [B, Tj]: tiles no row of the sequence sees
        hidden = empty.repeat_interleave(tiles.block_cols, 1)[:, :M].view(B, 1, M, 1)
        assert bool(hidden[2].all()) and bool(hidden[:2].any())
        keys, values = (t.double().repeat_interleave(H // Hkv, 1) for t in (k, v))
        i, j = torch.arange(N).view(-1, 1), torch.arange(M).view(1, -1)
        start, end = (t.view(B, 1, 1, 1) for t in ranges.values())
        visible = (j >= start) & (j < end) & (j <= i + (M - N)) & (j > i + (M - N) - 200)
        s = (q.double() @ keys.transpose(-1, -2) / D**0.5).masked_fill(~visible, float("-inf"))
        expected_lse = torch.logsumexp(s, -1)
        expected = torch.softmax(s, -1).nan_to_num() @ values
        k, v = k.masked_fill(hidden, float("nan")), v.masked_fill(hidden, float("inf"))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        with torch.no_grad():
            for _ in range(2):  # the call that keeps the launch, then one repeating it
                out, lse = kern(q, k, v, return_lse=True, **ranges)
                torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
                torch.testing.assert_close(lse.double(), expected_lse, atol=tol, rtol=tol)
                assert bool((out[2] == 0).all()) and bool(torch.isneginf(lse[2]).all())


def test_a_repeat_follows_v_s_strides_apart_from_k_s() -> None:
    """The same q, k and v's values, v alone in another layout ([B, M, H, D] memory, k's
    unchanged): each call reads v by its own strides, whichever launch it repeats; against
    float64 torch."""
    kern = kernel("vanilla")
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 37, 24, generator=g) for _ in range(3))
    moved = v.transpose(1, 2).contiguous().transpose(1, 2)  # (the same values, other strides)
    assert moved.stride() != v.stride() and k.stride() == v.stride()
    s = q.double() @ k.double().transpose(-1, -2) / 24**0.5
    want = torch.softmax(s, -1) @ v.double()
    for values in (v, moved, moved, v):
        torch.testing.assert_close(kern(q, k, values).double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_repeated_calls_with_runtime_tensors_reuse_the_checked_launch(
    monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """A plain call with runtime tensors that repeats a checked call's sizes, strides, dtypes and
    the values of the tensors the host reads (a padding mask's: they decide the tile classes)
    runs the launch packed then, pointed at its own tensors (`_tensors_signature`): another
    mask of the same values or other ALiBi slopes repeat; a mask changed in place, another
    mask's strides, a graph to record take the full path. CPU and emulated CUDA kernels (GQA
    decoding there folds the group's heads into rows), every result against float64 torch."""
    program = (
        "attention padded_alibi\ninput valid: bool[B, M]\ninput slopes: float[H]\ns = q @ k.T * scale\n"
        "s = s + slopes[h] * (j - i)\nmask valid[b, j] and j <= i + (M - N)\np = softmax(s)\no = p @ v\noutput o\n"
    )
    from torch.multiprocessing.reductions import StorageWeakRef

    kern = attncc.compile(program) if target == "cpu" else attncc.compile(program, target=target, emulate=True)
    dtype, tol = (torch.float32, 1e-5) if target == "cpu" else (torch.bfloat16, 2e-2)
    g = torch.Generator().manual_seed(3)
    B, H, Hkv, N, M = 2, 4, 2, 5, 300
    q, k, v = (torch.randn(B, heads, rows, 16, generator=g).to(dtype) for heads, rows in ((H, N), (Hkv, M), (Hkv, M)))

    def expected(valid: torch.Tensor, slopes: torch.Tensor) -> torch.Tensor:
        keys, values = (t.double().repeat_interleave(H // Hkv, 1) for t in (k, v))
        s = q.double() @ keys.transpose(-1, -2) / 4
        i, j = torch.arange(N).view(-1, 1), torch.arange(M).view(1, -1)
        s = s + slopes.double().view(1, H, 1, 1) * (j - i)
        s = s.masked_fill(~(valid.view(B, 1, 1, M) & (j <= i + (M - N))), float("-inf"))
        return torch.softmax(s, -1).nan_to_num() @ values

    def agrees(valid: torch.Tensor, slopes: torch.Tensor) -> None:
        out = kern(q, k, v, valid=valid, slopes=slopes)
        torch.testing.assert_close(out.double(), expected(valid, slopes), atol=tol, rtol=tol)

    checked = counted_checks(monkeypatch)
    valid = torch.ones(B, M, dtype=torch.bool)
    slopes = torch.tensor([0.05, 0.02, 0.01, 0.03])
    agrees(valid, slopes)
    agrees(valid, slopes)
    agrees(valid.clone(), slopes * 2)  # other tensors, other slopes: the same launch
    assert len(checked) == 1
    slopes.mul_(-1)  # (the slopes' values are read by the kernel, whatever the call)
    agrees(valid, slopes)
    assert len(checked) == 1
    valid[0, :200] = False  # in place: key tiles of sequence 0 full before, empty or partial now
    valid[1, 299] = False
    agrees(valid, slopes)
    agrees(valid, slopes)
    assert len(checked) == 2
    agrees(valid.t().contiguous().t(), slopes)  # another mask's strides: checked again
    assert len(checked) == 3
    wide = torch.tensor([0.1, -0.02, 0.03, 0.0], dtype=torch.float64)  # converted per call, as the full path does
    agrees(valid, wide)
    agrees(valid, wide + 0.01)
    assert len(checked) == 4
    learnable = slopes.clone().requires_grad_()
    assert kern(q, k, v, valid=valid, slopes=learnable).grad_fn is not None
    assert len(checked) == 5
    # a kept launch holds none of the tensors of the call it was kept from
    dropped = {"valid": valid.clone(), "slopes": slopes.clone()}
    dropped["valid"][1, :7] = False  # (values not seen yet: a launch kept from this call)
    agrees(**dropped)
    assert len(checked) == 6
    gone = [StorageWeakRef(t.untyped_storage()) for t in dropped.values()]  # (detached aliases share it)
    del dropped
    gc.collect()
    assert all(ref.expired() for ref in gone)
    with pytest.raises(InputError, match="valid: expected shape"):
        kern(q, k, v, valid=valid[:, :60], slopes=slopes)
    with pytest.raises(InputError, match="slopes: expected a float tensor"):
        kern(q, k, v, valid=valid, slopes=slopes.int())


def test_torch_func_and_forward_ad_are_clear_errors() -> None:
    import torch.autograd.forward_ad as fwad

    vanilla = kernel("vanilla")
    q = torch.randn(1, 1, 8, 8)
    with pytest.raises(InputError, match=r"do not support torch\.func transforms"):
        torch.func.grad(lambda x: vanilla(x, q, q).sum())(q)
    with pytest.raises(InputError, match=r"do not support torch\.func transforms"):
        torch.func.vmap(lambda x: vanilla(x, q, q))(q.unsqueeze(0))
    with pytest.raises(InputError, match="no forward-mode derivative"), fwad.dual_level():
        vanilla(fwad.make_dual(q, torch.ones_like(q)), q, q)


def test_a_kernel_on_tensors_a_transform_captured_is_a_constant_to_it() -> None:
    """Inside torch.func.grad / vjp / jacrev / jvp of w, a kernel called on tensors the function
    captured (not transformed) is a constant, as torch's SDPA is there: its allocations came
    back wrapped, without storage, and every such call failed reading their addresses (session
    65's review); fresh, repeated (a kept launch), a runtime input and the SDPA drop-in. A
    captured tensor that requires grad is a clear error (torch refuses autograd.Functions in
    transforms)."""
    from attncc.integrations.sdpa import scaled_dot_product_attention

    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 9, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)
    w = torch.tensor(2.0, dtype=torch.float64)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = sdpa(q, k, v).sum()
    i, j = torch.arange(9.0).view(-1, 1), torch.arange(9.0).view(1, -1)
    bias = torch.where(j <= i, -slopes.view(-1, 1, 1) * (i - j), -torch.inf)
    want_alibi = sdpa(q, k, v, attn_mask=bias.to(torch.float64)).sum()
    vanilla, alibi = kernel("vanilla"), kernel("alibi")
    for _ in range(2):  # (the second: a kept launch)
        assert (torch.func.grad(lambda w: (w * vanilla(q, k, v)).sum())(w) - want).abs() < 1e-12
    assert (torch.func.jacrev(lambda w: (w * vanilla(q, k, v)).sum())(w) - want).abs() < 1e-12
    assert (torch.func.vjp(lambda w: w * vanilla(q, k, v), w)[0].sum() - 2 * want).abs() < 1e-12
    tangent = torch.func.jvp(lambda w: w * vanilla(q, k, v), (w,), (torch.ones_like(w),))[1]
    assert (tangent.sum() - want).abs() < 1e-12
    assert (torch.func.grad(lambda w: (w * alibi(q, k, v, slopes=slopes)).sum())(w) - want_alibi).abs() < 1e-12
    drop_in = torch.func.grad(lambda w: (w * scaled_dot_product_attention(q, k, v, is_causal=True)).sum())(w)
    assert (drop_in - sdpa(q, k, v, is_causal=True).sum()).abs() < 1e-12
    leaf, learnable = q.clone().requires_grad_(), slopes.clone().requires_grad_()
    for call in (lambda: vanilla(leaf, k, v), lambda: alibi(q, k, v, slopes=learnable)):
        with pytest.raises(InputError, match=r"^a tensor requiring grad inside a torch\.func transform"):
            torch.func.grad(lambda w, call=call: (w * call()).sum())(w)


@pytest.mark.parametrize("seed", [-1, 1.5, 2**64, True])
def test_bad_seeds_are_input_errors(seed: object) -> None:
    q = torch.randn(1, 1, 8, 8)
    with pytest.raises(InputError, match=r"seed: expected an int in \[0, 2\^63\)"):
        kernel("gpt2")(q, q, q, seed=seed)


def test_non_finite_scale_is_an_input_error() -> None:
    q = torch.randn(1, 1, 8, 8)
    with pytest.raises(InputError, match="scale: expected a finite number"):
        kernel("vanilla")(q, q, q, scale=float("nan"))


@pytest.mark.parametrize("emulate", [False, True])
def test_nan_propagates_like_eager(emulate: bool) -> None:
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="sm80" if emulate else "cpu", emulate=emulate)
    x = torch.randn(1, 2, 9, 16)
    x[0, 0, 0, 0] = float("nan")  # query 0 and key 0 of head 0
    x = x.half() if emulate else x
    out, lse = kern(x, x, x, return_lse=True)
    ref, ref_lse = kern.reference(x.double(), x.double(), x.double())
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(lse.isnan(), ref_lse.isnan())
    assert torch.isfinite(out[0, 1]).all()


def test_fake_tensors_give_every_calls_output_shapes() -> None:
    """Under FakeTensorMode (shape propagation, outside torch.compile) a program with a sink, a
    packed and a paged call ended in torch's DataDependentOutputException /
    DynamicOutputShapeException (their checks read values on the host; session 61's review):
    they take the op's path, whose fake implementation gives the shapes, as while traced."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sink = attncc.compile(ROOT / "examples" / "gpt_oss.attn")
    vanilla = attncc.compile(ROOT / "examples" / "vanilla.attn")
    mode = FakeTensorMode()
    real = dict(
        q=torch.randn(2, 4, 8, 16), k=torch.randn(2, 2, 12, 16), v=torch.randn(2, 2, 12, 8), sinks=torch.randn(4),
        packed_q=torch.randn(8, 4, 16), packed_k=torch.randn(12, 2, 16), packed_v=torch.randn(12, 2, 8),
        cu_q=torch.tensor([0, 3, 8], dtype=torch.int32), cu_k=torch.tensor([0, 5, 12], dtype=torch.int32),
        step=torch.randn(2, 1, 4, 16), k_cache=torch.randn(6, 4, 2, 16), v_cache=torch.randn(6, 4, 2, 8),
        table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32), lengths=torch.tensor([5, 9], dtype=torch.int32),
        k_new=torch.randn(2, 1, 2, 16), v_new=torch.randn(2, 1, 2, 8),
    )  # fmt: skip
    f = {name: mode.from_tensor(t) for name, t in real.items()}
    with mode:
        out, lse = sink(f["q"], f["k"], f["v"], sinks=f["sinks"], window=4, return_lse=True)
        assert (out.shape, lse.shape) == ((2, 4, 8, 8), (2, 4, 8))
        packed = vanilla.varlen(f["packed_q"], f["packed_k"], f["packed_v"], f["cu_q"], f["cu_k"], 5, 7)
        assert packed.shape == (8, 4, 8)
        paged = vanilla.paged(
            f["step"], f["k_cache"], f["v_cache"], f["table"], f["lengths"], k_new=f["k_new"], v_new=f["v_new"]
        )
        assert paged.shape == (2, 1, 4, 8)


def test_meta_tensors_give_every_calls_output_shapes_and_gradients() -> None:
    """Meta tensors (a model built on the meta device, shape and FLOP counting) were refused
    ("runs on cpu tensors, got device meta"; the packed and paged calls failed copying values
    out of them): every call gives its outputs' shapes and dtypes through the ops' fake
    implementations, gradients too, and leaves no kept launch behind for a real call."""
    from attncc.integrations.flash_attn import flash_attn_func

    def meta(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = False) -> torch.Tensor:
        return torch.empty(shape, device="meta", dtype=dtype, requires_grad=grad)

    alibi, sink = kernel("alibi"), kernel("gpt_oss")
    q, k, v, slopes = (
        meta(2, 4, 5, 16, grad=True),
        meta(2, 2, 7, 16, grad=True),
        meta(2, 2, 7, 24, grad=True),
        meta(4, grad=True),
    )
    out, lse = alibi(q, k, v, slopes=slopes, return_lse=True)
    assert (out.shape, out.device.type, lse.shape, lse.dtype) == ((2, 4, 5, 24), "meta", (2, 4, 5), torch.float32)
    (out.sum() + lse.sum()).backward()
    assert [t.grad.shape for t in (q, k, v, slopes)] == [q.shape, k.shape, v.shape, slopes.shape]
    bf16 = meta(2, 4, 5, 16, dtype=torch.bfloat16)
    assert sink(bf16, bf16[:, :2], bf16[:, :2], sinks=meta(4), window=3).dtype == torch.bfloat16
    vanilla = kernel("vanilla")
    cu = meta(3, dtype=torch.int32)
    assert vanilla.varlen(meta(8, 4, 16), meta(12, 2, 16), meta(12, 2, 8), cu, cu, 5, 7).shape == (8, 4, 8)
    step, cache = meta(2, 1, 4, 16), meta(6, 4, 2, 16)
    table, lengths = meta(2, 3, dtype=torch.int32), meta(2, dtype=torch.int32)
    assert vanilla.paged(step, cache, cache, table, lengths).shape == (2, 1, 4, 16)
    assert flash_attn_func(meta(2, 5, 4, 16), meta(2, 7, 2, 16), meta(2, 7, 2, 16), causal=True).shape == (2, 5, 4, 16)
    with pytest.raises(InputError, match=r"k: expected device meta \(that of q\), got cpu"):
        alibi(q, torch.randn(2, 2, 7, 16), v, slopes=slopes)
    # a real call of the same sizes after the meta calls: computed, not a kept launch of meta tensors
    gen = torch.Generator().manual_seed(5)
    qr, kr, vr = (torch.randn(*t.shape, generator=gen, dtype=torch.float64) for t in (q, k, v))
    slope_values = torch.rand(4, generator=gen, dtype=torch.float64)
    got = alibi(qr, kr, vr, slopes=slope_values)
    i, j = torch.arange(5).view(-1, 1), torch.arange(7)
    scores = qr @ kr.repeat_interleave(2, 1).transpose(-1, -2) / 4.0 - slope_values.view(1, 4, 1, 1) * (i - j)
    want = scores.masked_fill(j > i, float("-inf")).softmax(-1) @ vr.repeat_interleave(2, 1)
    torch.testing.assert_close(got, want)


def test_an_exported_program_runs_on_the_live_kernel_of_its_program(tmp_path) -> None:
    """A torch.export'ed (or saved and loaded) graph names its kernel by `call_key`, whose `#n`
    counts the kernels made before it in the exporting process: once that kernel was freed, or
    in another process, the graph raised KeyError('vanilla_...#0') (session 61's review). The
    one live kernel of the same program serves it now; with none, an error says what to do."""
    source = (ROOT / "examples" / "vanilla.attn").read_text().replace("attention vanilla", "attention exported")

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.kern = attncc.compile(source)

        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self.kern(q, k, v)

    q, k, v = (torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(n)) for n in range(3))
    module = Attention()
    want = module(q, k, v)
    torch.export.save(torch.export.export(module, (q, k, v)), tmp_path / "attention.pt2")
    del module
    gc.collect()
    loaded = torch.export.load(tmp_path / "attention.pt2").module()
    with pytest.raises(
        attncc.AttnccError, match=r"calls kernel exported_\w+ \(a Kernel\), and none is alive in this process"
    ):
        loaded(q, k, v)
    kern = attncc.compile(source)  # (another `#n`)
    torch.testing.assert_close(loaded(q, k, v), want, atol=0, rtol=0)
    twin = attncc.compile(source)
    with pytest.raises(attncc.AttnccError, match="and 2 are, and which one this graph was made with is not known"):
        loaded(q, k, v)
    del kern, twin


def test_kernels_pickle_deepcopy_and_are_freed() -> None:
    kern = attncc.compile(ROOT / "examples" / "alibi.attn")
    q = torch.randn(1, 2, 9, 8)
    slopes = torch.rand(2)
    expected = kern(q, q, q, slopes=slopes)
    for copied in (copy.deepcopy(kern), pickle.loads(pickle.dumps(kern))):
        assert copied.call_key != kern.call_key
        assert torch.equal(copied(q, q, q, slopes=slopes), expected)
    alive = weakref.ref(kern)
    out = kern(q.requires_grad_(), q, q, slopes=slopes)
    del kern
    gc.collect()
    assert alive() is not None  # the autograd graph still needs it
    out.sum().backward()
    del out
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("call", ["padded", "varlen"])
def test_autocast_runs_q_k_v_in_its_dtype_as_sdpa_does(call: str) -> None:
    """Under torch.autocast a call casts float32 / float16 / bfloat16 q, k, v to the autocast
    dtype (as SDPA, a lower-precision op there), whatever mix they come in, and runs as the
    call on the cast tensors would: the same out and lse, gradients back in each leaf's dtype,
    learnable inputs' included. float64 operands stay float64, as autocast leaves them."""
    kern = kernel("alibi")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 32, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 45, 32, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 45, 32, generator=gen).bfloat16().requires_grad_()
    slopes = torch.rand(4, generator=gen, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 37, 74]), torch.tensor([0, 45, 90])

    def run(a, b, c):
        if call == "varlen":
            flat = [t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (a, b, c)]
            return kern.varlen(*flat, cu_q, cu_k, return_lse=True, slopes=slopes)
        return kern(a, b, c, return_lse=True, slopes=slopes)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = run(q, k, v)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    got = torch.autograd.grad((out.float().square().sum() + lse.sum()), [q, k, v, slopes])
    expected_out, expected_lse = run(q.bfloat16(), k.bfloat16(), v)
    expected = torch.autograd.grad((expected_out.float().square().sum() + expected_lse.sum()), [q, k, v, slopes])
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    for a, b, leaf in zip(got, expected, (q, k, v, slopes)):
        assert a.dtype == leaf.dtype and torch.equal(a, b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q64, k64, v64 = (t.detach().double() for t in (q, k, v))
        assert run(q64, k64, v64)[0].dtype == torch.float64


def negative_view(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A float32 view with the negative bit set (its values are minus the stored ones)."""
    view = torch.randn(*shape, dtype=torch.cfloat, generator=torch.Generator().manual_seed(seed)).conj().imag
    assert view.is_neg()
    return view


def test_negative_bit_views_are_read_as_their_values() -> None:
    """x.conj().imag keeps its sign in a flag over the stored values, which kernels read: q, k,
    v (padded, twice: the second call could repeat the first's kept launch), packed q and
    paged q give what their resolved copies give, gradients included; a paged cache with the
    flag (read and written in place) is a clear error."""
    kern = kernel("causal")
    q, k, v = negative_view((1, 2, 10, 16), 0), negative_view((1, 2, 12, 16), 1), negative_view((1, 2, 12, 16), 2)
    for _ in range(2):
        assert torch.equal(kern(q, k, v), kern(q.resolve_neg(), k.resolve_neg(), v.resolve_neg()))
    leaf = torch.randn(1, 2, 10, 16, dtype=torch.cfloat, requires_grad=True)
    (grad,) = torch.autograd.grad(kern(leaf.conj().imag, k, v).sum(), leaf)
    resolved = leaf.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(kern(resolved.conj().imag.resolve_neg(), k, v).sum(), resolved)
    assert torch.equal(grad, want)
    packed = q[0].transpose(0, 1)  # [10, 2, 16], still negative
    cu = torch.tensor([0, 4, 10])
    got = kern.varlen(packed, packed, packed, cu, cu)
    assert torch.equal(got, kern.varlen(*(packed.resolve_neg(),) * 3, cu, cu))
    cache = torch.randn(2, 8, 2, 16)
    table, lengths = torch.tensor([[0, 1]]), torch.tensor([12])
    q_paged = negative_view((1, 1, 2, 16), 3)
    got = kern.paged(q_paged, cache, cache, table, lengths)
    assert torch.equal(got, kern.paged(q_paged.resolve_neg(), cache, cache, table, lengths))
    with pytest.raises(InputError, match=r"^k_cache: a negative-bit view"):
        kern.paged(q_paged, negative_view((2, 8, 2, 16), 4), cache, table, lengths)


def as_negative_view(t: torch.Tensor) -> torch.Tensor:
    """`t`'s values as a contiguous view with the negative bit set (minus its stored values; a
    strided one, x.conj().imag, was resolved by the copy that made it contiguous)."""
    view = torch._neg_view(-t)
    assert view.is_neg() and torch.equal(view, t)
    return view


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_runtime_tensors_and_descales_of_negative_bit_views_are_read_as_their_values(target: str) -> None:
    """ALiBi slopes, a bias table and fp8 descale factors given as negative-bit views: the
    kernels took their stored values, unnegated (ALiBi's output 1.36 off until session 57).
    Each twice: the second call could repeat the first's kept launch."""
    dtype = torch.float32 if target == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 4, rows, 16, generator=gen).to(dtype) for rows in (9, 11, 11))
    for name in ("alibi", "relative_bias"):
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target=target, emulate=target != "cpu")
        runtime = make_inputs(kern, Shape(1, 4, 4, 9, 11, 16), torch.float32, requires_grad=False)[3]
        views = {n: as_negative_view(t.float()) if t.is_floating_point() else t for n, t in runtime.items()}
        assert any(isinstance(t, torch.Tensor) and t.is_neg() for t in views.values())
        resolved = {n: t.resolve_neg() if isinstance(t, torch.Tensor) else t for n, t in views.items()}
        for _ in range(2):
            assert torch.equal(kern(q, k, v, **views), kern(q, k, v, **resolved)), name
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target=target, emulate=target != "cpu")
    k8, v8 = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    descale = as_negative_view(torch.rand(1, 4, 11, 1, generator=gen) + 0.5)
    for _ in range(2):
        got = kern(q, k8, v8, k_descale=descale, v_descale=descale)
        assert torch.equal(got, kern(q, k8, v8, k_descale=descale.resolve_neg(), v_descale=descale.resolve_neg()))


def offloaded(t: torch.Tensor) -> torch.Tensor:
    """A saved-tensor hook's pack as activation offloading does it: a fresh contiguous copy."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def lse_transposed(t: torch.Tensor) -> torch.Tensor:
    """A pack keeping the layout of all but 3-D tensors (lse [B, H, N]), saved transposed."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() == 3 else t


@pytest.mark.parametrize("pack", [offloaded, lse_transposed])
def test_saved_tensors_coming_back_in_another_layout(pack) -> None:
    """Calls repeating a kept launch whose saved q, k, v or lse a saved_tensors_hooks pair hands
    back in another layout (offloading some layers, or from some step on): gradients as without
    the hook, padded and packed. (The kept backward read them with the strides of the call it
    was kept from: dq off by 8.1, or NaN.)"""
    causal = kernel("causal")
    B, N, H, D = 2, 17, 2, 8
    upper = torch.ones(N, N, dtype=torch.bool).triu(1)
    for step in range(4):
        x = [torch.randn(B, N, H, D, requires_grad=True) for _ in range(3)]  # views [B, H, N, D] of these
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks if step >= 2 else torch.enable_grad():
            out = causal(*(t.transpose(1, 2) for t in x))
        got = torch.autograd.grad(out.sum(), x)
        ref_leaves = [t.detach().double().requires_grad_() for t in x]
        q, k, v = (t.transpose(1, 2) for t in ref_leaves)
        s = (q @ k.transpose(-1, -2) / D**0.5).masked_fill(upper, float("-inf"))
        want = torch.autograd.grad((torch.softmax(s, -1) @ v).sum(), ref_leaves)
        for g, w in zip(got, want):
            assert (g.double() - w).abs().max() < 1e-5, step
    cu = torch.tensor([0, 7, 20, 33], dtype=torch.int32)
    plan = attncc.plan_varlen(cu, cu)
    for step in range(4):
        qkv = torch.randn(33, 3, H, D, requires_grad=True)
        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with hooks if step >= 2 else torch.enable_grad():
            out = causal.varlen(*qkv.unbind(1), plan=plan)
        (got,) = torch.autograd.grad(out.sum(), qkv)
        ref = qkv.detach().double().requires_grad_()
        total = 0.0
        for b in range(3):
            q, k, v = (t[int(cu[b]) : int(cu[b + 1])].transpose(0, 1) for t in ref.unbind(1))
            n = q.shape[1]
            s = (q @ k.transpose(-1, -2) / D**0.5).masked_fill(
                torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")
            )
            total = total + (torch.softmax(s, -1) @ v).sum()
        (want,) = torch.autograd.grad(total, ref)
        assert (got.double() - want).abs().max() < 1e-5, step


def test_batched_gradients_are_a_clear_error() -> None:
    x = torch.randn(1, 2, 8, 8, requires_grad=True)
    out = kernel("causal")(x, x, x)
    with pytest.raises(InputError, match="is_grads_batched=True"):
        torch.autograd.grad(out, x, torch.randn(3, *out.shape), is_grads_batched=True)


@pytest.mark.parametrize("context", ["with torch.device", "set_default_device"])
def test_calls_on_cpu_tensors_ignore_torch_s_default_device(context: str) -> None:
    """torch's ops follow their operands, not the default device: attncc's calls on CPU
    tensors under `with torch.device("meta")` or `torch.set_default_device("meta")` returned
    uninitialised memory (1.7 to 1e294 off, session 65's review): the dropout seed, made
    without a device, was a meta tensor and sent the op to its fake implementation. Padded
    (fresh and repeated, forward and backward), dropout, the SDPA drop-in and a planned paged
    call, each against torch's own attention computed outside the context."""
    from attncc.integrations.sdpa import scaled_dot_product_attention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 17, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    want_causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    leaf = q.clone().requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(leaf, k, v).sum().backward()
    vanilla, gpt2 = kernel("vanilla"), kernel("gpt2")
    cache = k.transpose(1, 2).reshape(17, 1, 2, 8)  # one key per page, pages in order
    table, lengths = torch.arange(17, dtype=torch.int32).view(1, 17), torch.tensor([17], dtype=torch.int32)
    plan = attncc.plan_paged(cache, table, lengths)
    values = cache.new_empty(17, 1, 2, 8).copy_(v.transpose(1, 2).reshape(17, 1, 2, 8))
    outputs = {}
    if context == "with torch.device":
        device_context = torch.device("meta")
        device_context.__enter__()
    else:
        torch.set_default_device("meta")
    try:
        q_grad = q.clone().requires_grad_()
        outputs["fresh"], outputs["repeated"] = vanilla(q_grad, k, v), vanilla(q, k, v)
        outputs["fresh"].sum().backward()
        outputs["dropout"] = gpt2(q, k, v, train=True, seed=4)
        outputs["drop-in"] = scaled_dot_product_attention(q, k, v, is_causal=True)
        with torch.no_grad():
            outputs["paged"] = vanilla.paged(q[:, :, -1:].transpose(1, 2), cache, values, plan=plan).transpose(1, 2)
    finally:
        if context == "with torch.device":
            device_context.__exit__(None, None, None)
        else:
            torch.set_default_device(None)
    assert all(out.device.type == "cpu" for out in outputs.values())
    assert (outputs["fresh"] - want).abs().max() < 1e-12 and (outputs["repeated"] - want).abs().max() < 1e-12
    assert (q_grad.grad - leaf.grad).abs().max() < 1e-12
    assert (outputs["drop-in"] - want_causal).abs().max() < 1e-12
    assert (outputs["paged"] - want[:, :, -1:]).abs().max() < 1e-12
    assert (outputs["dropout"] - gpt2(q, k, v, train=True, seed=4)).abs().max() == 0  # (the same seed's mask)


def test_constant_sinks_block_masks_and_packed_plans_ignore_torch_s_global_state() -> None:
    """Session 67's review: under `with torch.device("meta")` a sink of numbers alone (`sink=0.5`)
    was made on the meta device and sent padded, packed and paged calls to the op's fake
    (uninitialised outputs, 1.7 to 1e37 off); a Flex BlockMask's classes failed on meta tensors;
    and a packed call's plan made under torch.inference_mode, kept for the next call on the same
    offsets, failed a training call's backward ("Inference tensors cannot be saved")."""
    from torch.nn.attention.flex_attention import create_block_mask

    from attncc.integrations.flex import flex_attention

    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 17, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    scores = q @ k.transpose(-1, -2) / 8**0.5
    with_sink = torch.cat([scores, torch.full((1, 2, 17, 1), 0.5, dtype=torch.float64)], -1)
    want = torch.softmax(with_sink, -1)[..., :17] @ v
    kern = attncc.compile(
        "attention constant_sink\ns = q @ k.T * scale\np = softmax(s, sink=0.5)\no = p @ v\noutput o\n"
    )
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    offsets = torch.tensor([0, 17], dtype=torch.int32)
    cache = packed[1].view(17, 1, 2, 8)
    values = packed[2].view(17, 1, 2, 8)
    table, lengths = torch.arange(17, dtype=torch.int32).view(1, 17), torch.tensor([17], dtype=torch.int32)
    causal = create_block_mask(lambda b, h, i, j: j <= i, 1, 2, 17, 17, device="cpu")
    want_causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.device("meta"):
        padded = kern(q, k, v)
        varlen = kern.varlen(*packed, offsets, offsets)
        paged = kern.paged(q.transpose(1, 2), cache, values, table, lengths)
        flex = flex_attention(q, k, v, block_mask=causal)
    for out in (padded, varlen.transpose(0, 1)[None], paged.transpose(1, 2), flex):
        assert out.device.type == "cpu"
    for got, wanted in ((padded, want), (varlen.transpose(0, 1)[None], want), (paged.transpose(1, 2), want)):
        torch.testing.assert_close(got, wanted, atol=1e-12, rtol=0)
    torch.testing.assert_close(flex, want_causal, atol=1e-12, rtol=0)
    vanilla = attncc.compile(
        "attention inference_then_train\ns = q @ k.T * scale\np = softmax(s)\no = p @ v\noutput o\n"
    )
    with torch.inference_mode():
        vanilla.varlen(*packed, offsets, offsets)
    leaves = [t.clone().requires_grad_() for t in packed]
    vanilla.varlen(*leaves, offsets, offsets).sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)


def test_attncc_first_imported_under_inference_mode_trains() -> None:
    """The seed every repeated call saves for its backward was made at import: an inference
    tensor where attncc was first imported under torch.inference_mode, and each training call
    repeating a kept launch then failed ("Inference tensors cannot be saved for backward")."""
    script = (
        "import torch\nwith torch.inference_mode():\n    import attncc\n"
        f"kern = attncc.compile({str(ROOT / 'examples' / 'vanilla.attn')!r})\n"
        "q = torch.randn(1, 2, 9, 8, dtype=torch.float64, requires_grad=True)\n"
        "for _ in range(3):\n    q.grad = None\n    kern(q, q, q).sum().backward()\n"
        "leaf = q.detach().clone().requires_grad_()\n"
        "torch.nn.functional.scaled_dot_product_attention(leaf, leaf, leaf).sum().backward()\n"
        "assert (q.grad - leaf.grad).abs().max() < 1e-12\nprint('trained')\n"
    )
    env = {**os.environ, "PYTHONPATH": ROOT_FIRST_PYTHONPATH}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "trained", done.stderr[-2000:]


@pytest.fixture
def default_dtype() -> object:
    """torch's default dtype, set by the test and restored after it."""
    before = torch.get_default_dtype()
    yield torch.set_default_dtype
    torch.set_default_dtype(before)


def test_torchs_default_dtype_changes_no_result(default_dtype) -> None:
    """Under `torch.set_default_dtype(torch.bfloat16)` (LLM scripts set it) the tile classes
    rounded the last query row and key column to bf16, so visible tiles were classified empty:
    causal N = M = 515, rows 512-513 4e-3 off; a mask `j >= M - 1` at M = 1002, every row (out
    2.4 off, lse -inf). The emulated CUDA path's split-KV partials were allocated in the default
    dtype, half the size the kernel writes under fp16: heap corruption (session 67's review).
    Each call is its kernel's first (a kept launch repeats the classes of an earlier call)."""
    gen = torch.Generator().manual_seed(0)
    for dtype, (n, m), mask in (
        (torch.bfloat16, (515, 515), "j <= i"),
        (torch.float16, (515, 515), "j <= i"),
        (torch.bfloat16, (70, 1002), "j >= M - 1"),
    ):
        q, k, v = (
            torch.randn(1, 2, rows, 16, generator=gen, dtype=torch.float64, requires_grad=True) for rows in (n, m, m)
        )
        i, j = torch.arange(n).view(-1, 1), torch.arange(m).view(1, -1)
        kept = j <= i if mask == "j <= i" else j >= m - 1
        scores = (q @ k.transpose(-1, -2) / 4).masked_fill(~kept, -torch.inf)
        want = [torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)]
        want += torch.autograd.grad(want[0].sum() + want[1].sum(), (q, k, v))
        name = f"default_dtype_{str(dtype)[6:]}_{m}"
        kern = attncc.compile(
            f"attention {name}\ns = q @ k.T * scale\nmask {mask}\np = softmax(s)\no = p @ v\noutput o\n"
        )
        operands = [t.detach().float().requires_grad_() for t in (q, k, v)]
        default_dtype(dtype)
        out, lse = kern(*operands, return_lse=True)
        got = [out, lse, *torch.autograd.grad(out.sum() + lse.sum(), operands)]
        default_dtype(torch.float32)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, atol=5e-5, rtol=0, msg=lambda said, name=name: f"{name}: {said}")
    emulated = attncc.compile(ROOT / "examples" / "alibi.attn", target="sm80", emulate=True)
    emulated.kv_splits = 3
    q, k = torch.randn(1, 4, 1, 64, generator=gen).bfloat16(), torch.randn(1, 2, 700, 64, generator=gen).bfloat16()
    slopes = torch.rand(4, generator=gen)
    default_dtype(torch.float16)
    out = emulated(q, k, k, slopes=slopes)
    default_dtype(torch.float32)
    torch.testing.assert_close(out, emulated(q, k, k, slopes=slopes), atol=0, rtol=0)
