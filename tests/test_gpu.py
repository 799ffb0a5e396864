"""Golden tests on a real GPU (run wherever torch sees one; skipped on CPU-only machines).

`ATTNCC_GPU_DRY_RUN=1 pytest tests/test_gpu.py` on a machine without a GPU runs them on the sm90
emulator instead (target "cuda" compiled as sm90 emulated, device "cuda" mapped to the CPU):
what it checks is the tests' own code and tolerances, before a short GPU lease spends its
minutes on them (it found the fp8 products' bound too tight for a rounding flip)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import attncc
from attncc.errors import InputError
from attncc.passes.positions import GLOBAL_M, GLOBAL_N, KEY_POSITION0, QUERY_POSITION0
from attncc.runtime.check import _error, check
from attncc.runtime.inputs import Shape, adapt
from attncc.targets import GPUS
from tests.conftest import EXAMPLES, ROOT
from tests.test_context_parallel import DOCUMENT_SINK_DROPOUT, compare, job, run_ranks
from tests.test_fp8 import EMULATED_SHAPES as FP8_SHAPES
from tests.test_fp8 import FORMATS, dequantised, fp8_product_model, model_mismatch, quantised
from tests.test_independent_references import CASES, assert_within, draw, learnable
from tests.test_rope import CASES as ROPE_CASES
from tests.test_rope import program
from tests.test_serving import (
    BOTTOM_RIGHT_CAUSAL,
    four_sequences,
    grads_of,
    offsets,
    packed_leaves,
    packed_lengths,
    packed_reference,
)
from tests.test_value_head_dim import EMULATED_SHAPES as VALUE_DIM_SHAPES

DRY_RUN = os.environ.get("ATTNCC_GPU_DRY_RUN") == "1" and not torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and not DRY_RUN, reason="needs a CUDA GPU and a CUDA build of torch"
)


class _OnTheHost(torch.overrides.TorchFunctionMode):
    """The dry run's device mapping: "cuda" in factories' device=, .cuda() and .to() is the CPU."""

    @staticmethod
    def host(device: object) -> object:
        if isinstance(device, torch.device) and device.type == "cuda":
            return torch.device("cpu")
        return "cpu" if isinstance(device, str) and device.startswith("cuda") else device

    def __torch_function__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = self.host(kwargs["device"])
        if getattr(func, "__name__", "") == "cuda":
            return args[0]
        if getattr(func, "__name__", "") == "to":
            args = tuple(self.host(a) for a in args)
        return func(*args, **kwargs)


@pytest.fixture(autouse=True)
def _dry_run(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if not DRY_RUN:
        yield
        return
    import attncc.runtime.check as checking

    compile_ = attncc.compile

    def emulated(source: object, target: str = "cpu", *args: object, **kwargs: object) -> attncc.Kernel:
        if target == "cuda":  # as a GpuKernel: short query calls run the key-split or 64-row forward
            kern = compile_(source, "sm90", *args, emulate=True, **kwargs)  # type: ignore[arg-type]
            kern.short_query_tiles = kern.key_split_warps = True
            return kern
        return compile_(source, target, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attncc, "compile", emulated)
    on_device = checking._on
    monkeypatch.setattr(checking, "_on", lambda device, t: on_device("cpu", t))
    with _OnTheHost():
        yield


@pytest.mark.parametrize("name", EXAMPLES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_forward_backward_match_fp64(name: str, dtype: torch.dtype) -> None:
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="cuda")
    for shape in (Shape(2, 4, 2, 77, 130, 64), Shape(1, 2, 1, 257, 300, 128), Shape(1, 1, 1, 1, 1, 256)):
        result = check(kern, adapt(shape, kern), dtype, device="cuda")
        assert result.ok, result.describe()


@pytest.mark.parametrize("name", EXAMPLES)
def test_gpu_32_row_warps_match_fp64(name: str) -> None:
    """Warps of 32 query rows (`warp_rows=32`; dense d = 128 forwards 12-14% faster on the H100
    of session 35) on the GPU for every example: the golden test's shapes at d = 64 and 128,
    forward and backward against float64."""
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="cuda", warp_rows=32)
    for shape in (Shape(2, 4, 2, 77, 130, 64), Shape(1, 2, 1, 257, 300, 128)):
        result = check(kern, adapt(shape, kern), torch.bfloat16, device="cuda")
        assert result.ok, result.describe()


@pytest.mark.parametrize("name", ["alibi", "dropout", "gpt_oss", "padding"])
def test_gpu_key_split_decoding_matches_fp64(name: str) -> None:
    """The forward whose warps split each key tile (`kern.key_split_warps`, a GPU's default for
    calls of at most 32 rows) on the GPU: tests/test_cuda.py's programs and shapes (one query, GQA folded,
    16 rows, forced splits, fully masked rows, d = 64 and 128), forward and lse against float64
    (and the plan's backward)."""
    from tests.test_cuda import DECODING_PROGRAMS, KEY_SPLIT_SHAPES

    kern = attncc.compile(DECODING_PROGRAMS.get(name) or ROOT / "examples" / f"{name}.attn", target="cuda")
    kern.key_split_warps = True
    for shape, splits in KEY_SPLIT_SHAPES:
        kern.kv_splits = splits
        result = check(kern, adapt(shape, kern), torch.bfloat16, device="cuda")
        assert result.ok, result.describe()


def test_gpu_dropout_bits_equal_the_cpu_mask() -> None:
    kern = attncc.compile(ROOT / "examples" / "gpt2.attn", target="cuda")
    N = 64
    q, k = torch.randn(1, 2, N, 64, device="cuda").half(), torch.randn(1, 2, N, 64, device="cuda").half()
    v = torch.eye(N, 64, device="cuda").expand(1, 2, N, 64).contiguous().half()
    keep = attncc.dropout_mask(77, 0, 1, 2, N, N, 0.1)
    probs = kern(q, k, v, seed=77).cpu()
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert torch.equal(probs[..., causal] != 0, keep[..., causal])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_kernel_runs_on_the_device_of_its_inputs() -> None:
    kern = attncc.compile(ROOT / "examples" / "alibi.attn", target="cuda")
    q = torch.randn(1, 2, 40, 64, device="cuda:1", dtype=torch.float16, requires_grad=True)
    slopes = torch.rand(2, device="cuda:1")
    with torch.cuda.device(0):  # the current device is another one
        out = kern(q, q, q, slopes=slopes)
        out.sum().backward()
    expected, _ = kern.reference(q.detach().cpu(), q.detach().cpu(), q.detach().cpu(), slopes=slopes.cpu())
    assert out.device == q.grad.device == torch.device("cuda:1")
    assert torch.allclose(out.cpu().double(), expected, atol=2e-2)
    with pytest.raises(
        attncc.InputError, match=r"slopes: expected a tensor on cuda:1 \(that of q\), got device cuda:0"
    ):
        kern(q, q, q, slopes=slopes.to("cuda:0"))


def test_gpu_deterministic_mode_gives_the_same_bits_every_run() -> None:
    """dq by its own kernel and learnable-input gradients as exact fixed-point sums: repeated
    runs give identical bits (the float atomics of the default mode need not)."""
    kern = attncc.compile(ROOT / "examples" / "relative_bias.attn", target="cuda")
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bias = torch.randn(4, 257, device="cuda", requires_grad=True)
    kern.deterministic = True
    try:
        runs = []
        for _ in range(3):
            out = kern(q, k, v, bias=bias)
            runs.append(torch.autograd.grad(out, [q, k, v, bias], torch.ones_like(out)))
        result = check(kern, Shape(1, 2, 1, 100, 120, 64), torch.bfloat16, device="cuda")  # and still exact
    finally:
        kern.deterministic = False
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    assert result.ok, result.describe()


@pytest.mark.parametrize("name", ["alibi", "document", "gpt_oss", "sliding_window"])
def test_gpu_varlen_matches_hand_written_reference_per_sequence(name: str) -> None:
    """A packed batch of four ragged sequences (lengths 0 and 1 among them) on the GPU, forward
    and backward, against the hand-written float64 reference of each sequence on the CPU."""
    case = CASES[name]
    lens_q, lens_k = packed_lengths(case.shape)
    q, k, v, dout = (t.detach().bfloat16() for t in packed_leaves(case.shape, lens_q, lens_k))
    inputs = four_sequences(case.inputs(torch.Generator().manual_seed(1000), replace(case.shape, B=4)))
    names = ["dq", "dk", "dv"] + [f"d{n}" for n in learnable(inputs)]
    on_gpu = {n: t.detach().cuda().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for n, t in inputs.items()}  # fmt: skip
    leaves = [t.cuda().requires_grad_() for t in (q, k, v)]
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="cuda")
    cu_q, cu_k = offsets(lens_q).cuda(), offsets(lens_k).cuda()
    out, lse = kern.varlen(*leaves, cu_q, cu_k, return_lse=True, **case.call, **on_gpu)
    got = grads_of(out, lse, [*leaves, *(on_gpu[n] for n in learnable(inputs))], names, dout.cuda())
    got = {n: t.cpu() if t is not None else None for n, t in got.items()}
    ref = packed_reference(case.reference, q, k, v, inputs, names, dout, lens_q, lens_k)
    assert_within(got, ref, {n: 2e-2 if n in ("out", "lse") else 6e-2 for n in ref})


@pytest.mark.parametrize(("page_size", "queries"), [(16, 1), (64, 7), (32, 70), (256, 1)])
def test_gpu_paged_decode_and_prefill_with_appended_keys(page_size: int, queries: int) -> None:
    """GQA 8/2 from shuffled pages on the GPU, new k/v appended in place at cache_seqlens (one
    sequence empty before), bottom-right causal: against float64 attention written here."""
    gen = torch.Generator().manual_seed(5)
    B, H, Hkv, D, held = 3, 8, 2, 128, [300, 0, 77]
    pages_per_seq = -(-(max(held) + queries) // page_size) + 1
    num_pages = B * pages_per_seq + 3
    k_cache, v_cache = (torch.randn(num_pages, page_size, Hkv, D, generator=gen).bfloat16() for _ in range(2))
    table = torch.randperm(num_pages, generator=gen)[: B * pages_per_seq].view(B, pages_per_seq).int()
    q = torch.randn(B, queries, H, D, generator=gen).bfloat16()
    k_new, v_new = (torch.randn(B, queries, Hkv, D, generator=gen).bfloat16() for _ in range(2))
    before = k_cache.clone(), v_cache.clone()
    kern = attncc.compile(
        BOTTOM_RIGHT_CAUSAL,
        target="cuda",
    )
    caches = [c.cuda() for c in (k_cache, v_cache)]
    out, lse = kern.paged(
        q.cuda(), *caches, table.cuda(), torch.tensor(held, dtype=torch.int32).cuda(),
        k_new=k_new.cuda(), v_new=v_new.cuda(), return_lse=True,
    )  # fmt: skip
    out, lse, caches = out.cpu(), lse.cpu(), [c.cpu() for c in caches]
    for b in range(B):
        m = held[b] + queries
        keys = [
            torch.cat([c[table[b].long()].flatten(0, 1)[: held[b]], new[b]]) for c, new in zip(before, (k_new, v_new))
        ]
        k, v = (t.transpose(0, 1).double().repeat_interleave(H // Hkv, 0) for t in keys)
        s = q[b].transpose(0, 1).double() @ k.transpose(1, 2) / math.sqrt(D)
        visible = torch.arange(m).view(1, -1) <= torch.arange(queries).view(-1, 1) + (m - queries)
        s = s.masked_fill(~visible, -math.inf)
        assert torch.allclose(out[b].transpose(0, 1).double(), torch.softmax(s, -1) @ v, atol=2e-2), b
        assert torch.allclose(lse[b].transpose(0, 1).double(), torch.logsumexp(s, -1), atol=1e-3), b
        rows = held[b] + torch.arange(queries)
        written = table[b].long()[rows // page_size], rows % page_size
        assert torch.equal(caches[0][written], k_new[b]) and torch.equal(caches[1][written], v_new[b])


def test_gpu_globalized_chunk_pair_draws_the_whole_calls_dropout_bits() -> None:
    """A context-parallel chunk pair on the GPU (query rows 64..127, keys 32..95 of a 128-token
    document-masked, dropout program with a position-dependent sink): with V the identity the
    output is the pair's probabilities, kept exactly where the whole call's dropout mask keeps."""
    gen = torch.Generator().manual_seed(9)
    q, k = (torch.randn(1, 2, 64, 64, generator=gen).bfloat16() for _ in range(2))
    v = torch.eye(64).expand(1, 2, 64, 64).bfloat16()
    doc = torch.tensor([[0] * 40 + [1] * 50 + [2] * 38])
    sinks = torch.randn(2, generator=gen)
    positions = {QUERY_POSITION0: 64, KEY_POSITION0: 32, GLOBAL_N: 128, GLOBAL_M: 128}
    glob = attncc.compile(DOCUMENT_SINK_DROPOUT, target="cuda").at_global_positions()
    out, lse = glob(
        q.cuda(), k.cuda(), v.cuda(), return_lse=True, seed=3, doc=doc.cuda(), sinks=sinks.cuda(), **positions
    )
    keep = attncc.dropout_mask(3, 0, 1, 2, 128, 128, 0.2)[:, :, 64:, 32:96]
    i, j = torch.arange(64, 128).view(-1, 1), torch.arange(32, 96).view(1, -1)
    visible = (doc[:, None, 64:, None] == doc[:, None, None, 32:96]) & (j <= i)
    scores = (q.double() @ k.double().transpose(-1, -2) / 8).masked_fill(~visible, -math.inf)
    sink = (sinks.double().view(1, -1, 1) - 0.01 * (128 - torch.arange(64, 128))).unsqueeze(-1)
    want_lse = torch.logsumexp(torch.cat([scores, sink.expand(1, 2, 64, 1)], dim=-1), dim=-1)
    probs = torch.exp(scores - want_lse.unsqueeze(-1)) * keep / 0.8
    out, lse = out.cpu().double(), lse.cpu().double()
    assert torch.equal(out != 0, (probs != 0))
    assert torch.allclose(out, probs, atol=1e-2) and torch.allclose(lse, want_lse, atol=1e-3)


@pytest.mark.parametrize("name", ["alibi", "gpt2", "document"])
def test_gpu_value_head_dim_differs_from_the_query_head_dim(name: str) -> None:
    """Dv != D (DeepSeek's 192/128 MLA prefill and 64/256) on the GPU: forward, backward with
    atomic dQ and the deterministic backward, split-KV forced in the former, within the eager
    low-precision error of float64."""
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="cuda")
    for shape in VALUE_DIM_SHAPES:
        for deterministic in (False, True):
            kern.deterministic, kern.kv_splits = deterministic, None if deterministic else 3
            result = check(kern, adapt(shape, kern), torch.bfloat16, device="cuda")
            assert result.ok, f"deterministic={deterministic}: {result.describe()}"


@pytest.mark.parametrize("case", [0, 1, 2])
def test_gpu_rope_inside_the_kernels(case: int) -> None:
    """Rotary embeddings applied to the Q and K tiles in shared memory (half-split, interleaved,
    partial; positions offset per sequence), forward and backward against float64."""
    label, q_args, k_args, _ = ROPE_CASES[case]
    kern = attncc.compile(program(label, q_args, k_args), target="cuda")
    for shape in (Shape(2, 4, 2, 77, 130, 64), Shape(2, 2, 1, 1, 300, 128)):
        result = check(kern, adapt(shape, kern), torch.bfloat16, device="cuda")
        # lse: the rotated rows are rounded to bf16 in the tiles, as in the emulator's rope tests
        assert all(result.errors[n] <= result.limits[n] for n in result.errors if n != "lse"), result.describe()
        assert result.errors["lse"] <= 1e-2, result.describe()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("name", ["alibi", "gpt_oss"])
def test_gpu_fp8_keys_and_values_with_descale_factors(name: str, fmt: str) -> None:
    """fp8 K/V (per-token k factors, a per-tensor v factor) widened into shared memory on the
    GPU, split-KV forced on, against float64 code on the dequantised operands."""
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="cuda")
    kern.kv_splits = 3
    case = CASES[name]
    for shape in FP8_SHAPES:
        q, k, v, _ = draw(replace(case, shape=shape))
        inputs = {
            n: t.detach() if isinstance(t, torch.Tensor) else t
            for n, t in case.inputs(torch.Generator().manual_seed(3), shape).items()
        }
        k_descale = torch.rand(shape.B, shape.Hkv, shape.M) * 0.02 + 0.005
        k8, v8 = quantised(k, k_descale, FORMATS[fmt]), (v.detach() / 0.01).to(FORMATS[fmt])
        q = q.detach().bfloat16()
        on_gpu = {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}
        with torch.no_grad():
            out, lse = kern(
                q.cuda(), k8.cuda(), v8.cuda(), k_descale=k_descale.cuda(), v_descale=0.01, return_lse=True, **on_gpu
            )
            exact = {
                n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in inputs.items()
            }
            ref_out, ref_lse = case.reference(
                q.double(), dequantised(k8, k_descale, q.dtype), dequantised(v8, 0.01, q.dtype), exact
            )
        assert _error(out.cpu(), ref_out) <= 2e-2, (shape, _error(out.cpu(), ref_out))
        assert _error(lse.cpu(), ref_lse) <= 2e-3, (shape, _error(lse.cpu(), ref_lse))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("name", ["vanilla", "causal"])
def test_gpu_fp8_products_follow_their_rounding_model(name: str, fmt: str) -> None:
    """`fp8_mma` on an sm89/sm90 GPU: mma m16n8k32 on e4m3 Q (rounded in the kernel) and the
    fp8 K/V bytes, e4m3 P: the output is the rounding model's (tests/test_fp8.py) within bf16
    rounding and the hardware's own accumulation order (fp32, or narrower: then this fails and
    says by how much), one split as the model's key order."""
    kern = attncc.compile(ROOT / "examples" / f"{name}.attn", target="cuda")
    if not GPUS[kern.target].fp8_mma:
        pytest.skip(f"{kern.target} has no fp8 tensor cores")
    kern.fp8_mma, kern.kv_splits = True, 1
    gen = torch.Generator().manual_seed(17)
    for B, H, Hkv, N, M, D in ((2, 4, 2, 77, 130, 64), (1, 2, 1, 33, 300, 128), (2, 8, 8, 256, 1024, 128)):
        q = torch.randn(B, H, N, D, generator=gen).bfloat16()
        k_descale = torch.rand(B, Hkv, M, generator=gen) * 0.02 + 0.005
        k8 = quantised(torch.randn(B, Hkv, M, D, generator=gen), k_descale, FORMATS[fmt])
        v8 = (torch.randn(B, Hkv, M, D, generator=gen) / 0.01).to(FORMATS[fmt])
        with torch.no_grad():
            out = kern(q.cuda(), k8.cuda(), v8.cuda(), k_descale=k_descale.cuda(), v_descale=0.01).cpu()
        plan = kern.plan(q, k8, None, value_dim=D)
        model = fp8_product_model(q, k8, v8, k_descale, 0.01, plan.tiles.block_cols, name == "causal")
        assert model_mismatch(out, model) is None, (N, M, D, model_mismatch(out, model))


@pytest.mark.skipif(DRY_RUN, reason="CUDA graphs need a GPU")
def test_gpu_decoding_steps_capture_into_a_cuda_graph() -> None:
    """Serving stacks capture a decoding step into a CUDA graph to take the host time out: after
    a warm-up call (which keeps the launch), padded GQA decoding and a planned paged call that
    appends a token are captured, and replays with new values in the captured buffers give the
    eager calls' outputs (the launches go to torch's current stream, the capture's)."""
    gen = torch.Generator().manual_seed(21)
    kern = attncc.compile(ROOT / "examples" / "causal.attn", target="cuda")
    paged_kern = attncc.compile(
        BOTTOM_RIGHT_CAUSAL,
        target="cuda",
    )
    B, H, Hkv, D, M, page = 4, 16, 4, 128, 1000, 16

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).bfloat16().cuda()

    q, k, v = bf16(B, H, 1, D), bf16(B, Hkv, M, D), bf16(B, Hkv, M, D)
    pages = B * (M // page + 2)
    k_cache, v_cache = bf16(pages, page, Hkv, D), bf16(pages, page, Hkv, D)
    table = torch.randperm(pages, generator=gen).view(B, -1).int().cuda()
    lengths = torch.tensor([M - 1 - 37 * b for b in range(B)], dtype=torch.int32).cuda()
    plan = attncc.plan_paged(k_cache, table, lengths, new_tokens=1)
    q_paged, k_new, v_new = bf16(B, 1, H, D), bf16(B, 1, Hkv, D), bf16(B, 1, Hkv, D)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        return kern(q, k, v), paged_kern.paged(q_paged, k_cache, v_cache, plan=plan, k_new=k_new, v_new=v_new)

    step()  # warm-up: plans, prepared calls and kept launches
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(2):
        for t in (q, q_paged, k_new, v_new):
            t.copy_(bf16(*t.shape))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        assert all(torch.equal(c, e) for c, e in zip(captured, eager))


@pytest.mark.skipif(not DRY_RUN, reason="on a GPU the lease runs the benchmark itself")
def test_gpu_benchmark_sections_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/bench_cuda.py's decoding (padded, paged, CUDA graphs), fp8 and packed-batch
    sections and bench/sweep_tiles_cuda.py's sweeps at tiny sizes, their timers stubbed: a lease must not lose its minutes to a fault in
    the benchmark's own code (each section ran first on a GPU after it was written)."""
    import bench.bench_cuda as bench

    monkeypatch.setattr(bench, "median_ms", lambda fn, repeats, calls=1: (fn(), 1.0)[1])
    monkeypatch.setattr(bench, "graph_ms", lambda fn, repeats: (fn(), 0.5)[1])
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn", target="cuda")
    rows = bench.decode_cases(kern, None, 1, batches=(2,), lengths=(48,))  # (M: whole pages)
    rows += bench.fp8_cases(1, sizes=(48,), batch=1)
    rows += bench.serving_cases(1, batch=2, longest=32, warp_rows=(16, 32))
    assert len(rows) == 2 + 1 + 16 and all(row.get("attncc_ms", 1.0) == 1.0 for row in rows)
    assert rows[0]["attncc_graph_ms"] == 0.5 and rows[1]["attncc_planned_graph_ms"] == 0.5
    import bench.sweep_tiles_cuda as sweep

    monkeypatch.setattr(sweep, "median_ms", lambda fn, repeats, calls=1: (fn(), 1.0)[1])
    sweep.decode_splits([((8, 2), 1, 48, 1), ((8, 2), 1, 48, 8)], splits_tried=(1, 2), pages=(16, 48))
    sweep.forward_tiles([64], B=1, H=1, N=64)
    sweep.backward_tiles([64], B=1, H=1, N=64, top=2, masks=("vanilla",))  # (the first: the default's library)
    # the grid of bench_cuda.main as the lease runs it (dense and causal, warps of 16 and 32 rows)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "no GPU (dry run)")
    argv = ["bench_cuda.py", "--dims", "64", "--sizes", "64", "--tokens", "64", "--width", "128", "--no-flex"]
    argv += ["--warp-rows", "16", "32", "--repeats", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()


#: Context-parallel jobs on the GPU kernels (fp32 inputs in bf16 tiles: each pair's output is
#: rounded to bf16 before the merge, hence the bf16 tolerance).
GPU_CONTEXT_PARALLEL_JOBS = [
    dict(job(name, layout, **sizes), target="cuda", device="cuda", tol=2e-2)
    for name, layout, sizes in (
        ("document_sink_dropout", "zigzag", {"N": 128, "B": 1, "D": 64}),
        ("causal", "zigzag", {"D": 64}),
        ("gqa", "contiguous", {"D": 128}),
        ("gpt_oss", "zigzag", {"N": 160, "M": 224, "D": 64}),
    )
]


@pytest.mark.skipif(
    DRY_RUN, reason="its ranks are processes of their own (tests/test_context_parallel.py runs the ring on the CPU)"
)
def test_gpu_context_parallel_two_ranks_share_one_gpu_over_gloo(tmp_path: Path) -> None:
    """Two ranks on one GPU (NCCL refuses two ranks per device; gloo moves device tensors
    through host copies): the ring's forward and backward against the single-process call."""
    run_ranks(2, GPU_CONTEXT_PARALLEL_JOBS, tmp_path)
    compare(GPU_CONTEXT_PARALLEL_JOBS, 2, tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank")
def test_gpu_context_parallel_over_nccl(tmp_path: Path) -> None:
    """The ring over NCCL, a GPU per rank (device tensors sent directly)."""
    world = min(torch.cuda.device_count(), 4)
    run_ranks(world, GPU_CONTEXT_PARALLEL_JOBS, tmp_path, backend="nccl")
    compare(GPU_CONTEXT_PARALLEL_JOBS, world, tmp_path)


def test_gpu_host_read_inputs_may_be_given_on_the_host() -> None:
    """A runtime tensor whose values the host reads (a padding mask's lengths) may be given on
    the CPU to a GPU kernel: the same result as on the GPU, the first call's values not reused
    for a later call's; a tensor the host does not read (ALiBi's slopes) must be on q's device."""
    kern = attncc.compile(ROOT / "examples" / "padding.attn", target="cuda")
    q, k, v = (torch.randn(3, 4, 70, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for lengths in ([70, 1, 33], [5, 64, 0]):
        on_gpu = kern(q, k, v, lengths=torch.tensor(lengths, device="cuda"))
        on_host = kern(q, k, v, lengths=torch.tensor(lengths))
        assert torch.equal(on_host, on_gpu)
    if DRY_RUN:  # (one device: nothing is off q's)
        return
    alibi = attncc.compile(ROOT / "examples" / "alibi.attn", target="cuda")
    with pytest.raises(InputError, match=r"slopes: expected a tensor on cuda:0 \(that of q\), got device cpu"):
        alibi(q, k, v, slopes=torch.ones(4))


def test_gpu_transformers_model_with_padding_and_cache_matches_sdpa() -> None:
    """The transformers integration on the GPU kernels (bf16): a tiny Llama (GQA 4/2, d = 128)
    on a left- and right-padded batch, prefill logits and a decoding step through the KV cache
    against the same weights on sdpa. The key ranges from the padding mask reach the kernels on
    the host (read once per forward; the kernels copy them to the GPU with their tile classes:
    session 36; before session 35's fix GPU kernels refused ranges off q's device)."""
    transformers = pytest.importorskip("transformers")
    from attncc.integrations import transformers as integration

    name = "attncc-gpu-test"
    integration.register(name)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=512, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=128, initializer_range=0.1,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ours = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=name)
    ours.load_state_dict(reference.state_dict())
    reference, ours = (m.to("cuda", torch.bfloat16).eval() for m in (reference, ours))
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(1)).cuda()
    left = torch.ones_like(ids)
    left[1, :5] = 0  # left padding, as generation pads
    both = left.clone()
    both[0, 17:] = 0  # and right padding
    with torch.no_grad():
        prefill = [m(ids, attention_mask=both).logits for m in (reference, ours)]
        assert _error(prefill[1][both.bool()].float(), prefill[0][both.bool()].float()) < 2e-2
        cached = [m(ids, attention_mask=left, use_cache=True) for m in (reference, ours)]
        step = torch.randint(0, 96, (2, 1), generator=torch.Generator().manual_seed(2)).cuda()
        step_mask = torch.cat([left, torch.ones_like(step)], 1)
        steps = [
            m(step, attention_mask=step_mask, past_key_values=out.past_key_values).logits
            for m, out in zip((reference, ours), cached)
        ]
    assert _error(steps[1].float(), steps[0].float()) < 2e-2
