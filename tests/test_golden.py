"""Golden tests: every example, forward and backward, against the float64 eager reference."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch

import attncc
from attncc.passes.tiling import (
    CPU_BF16_BLOCK,
    CPU_FUSED_SWEEP_ROWS,
    CPU_SIDE_BY_SIDE_DECODING_BC,
    CPU_STREAMING_BR,
    TilePlan,
    cpu_key_side_bytes,
)
from attncc.runtime.check import check
from attncc.runtime.inputs import AWKWARD_SHAPES, Shape, adapt, make_inputs
from attncc.targets import cpu
from tests.conftest import EXAMPLES, ROOT, kernel

LOW_PRECISION_SHAPES = (AWKWARD_SHAPES[1], AWKWARD_SHAPES[4])
#: Long enough for every example's mask and layout to take effect: N, M >= 2x sliding_window's
#: window (256) and strided's span (32 x 4), blocks beyond local(width=2) and butterfly
#: partners 4+ blocks apart, |i - j| > relative_bias's max_distance (128); every row crosses
#: at least 3 key tiles (Bc <= 128 on the CPU). B = 2: per-batch lengths include 0.
MASK_SPAN_SHAPE = Shape(2, 2, 1, 600, 600, 40)
#: Few query rows per kv head, which the CPU forward reads K and V for by rows (TilePlan
#: reads_by_rows): decoding (N < 4); D = 40 widens K and V into tiles, D = 64 reads them where they
#: are stored, with 2 rows per kv head (dot products one row at a time, axpys) and 8 (four rows per
#: dot product, the gemm for P V); N = 4 with 16 rows per kv head (by rows of a tile widened once,
#: more than kWidenInPlaceRows rows, at every dtype but bf16 and fp16 on AMX); N = 9 with 18 and 36
#: rows per kv head (fp32 by rows in place; bf16 and fp16 by rows of a tile widened once, except
#: bf16 and fp16 on AMX: by panels, a task taking 2 query heads of the group: all of it, or half
#: where two threads would lack tasks) and N = 6 MHA (by rows at every dtype).
#: From 48 rows per kv head (N = 13 and 16 with groups of 4 and 8) the AVX-512 levels transpose
#: each key tile for gemm (passes/tiling.py cpu_transposed_key_rows): 52 rows with D = 40 (a
#: transposed tile's edge columns and rows, gemm's row tails), 128 rows with D = 64 (panels
#: below AVX-512 and for bf16 on AMX); bf16 on `vdpbf16ps` packs each key tile as panels from
#: 9 rows but at the bf16 dot blocks' 16 (12 rows with N = 2, the N = 9 shapes, 52 and 128 rows). 640 rows (N = 40, a group of 16) take panels
#: everywhere, bf16 on a bf16 unit with 2 query heads a task (`heads_per_task`).
DECODING_SHAPES = (
    Shape(2, 4, 2, 3, 300, 40),
    Shape(1, 2, 1, 1, 513, 64),
    Shape(2, 8, 2, 2, 300, 64),
    Shape(1, 8, 2, 4, 300, 64),
    Shape(2, 4, 2, 9, 300, 64),
    Shape(1, 8, 2, 9, 300, 64),
    Shape(2, 2, 2, 6, 300, 64),
    Shape(1, 8, 2, 4, 300, 48),  # 16 rows a kv head: 4 x 4 dot blocks; bf16 pairs with a half-vector tail
    Shape(1, 12, 2, 2, 300, 64),  # 12 rows a kv head: bf16 on vdpbf16ps packs key tiles (from 9 rows but 16)
    Shape(2, 8, 2, 13, 300, 40),  # 52 rows a kv head: K^T tiles (AVX-512), transposes' and gemm's tails
    Shape(1, 16, 2, 16, 200, 64),  # 128 rows a kv head: by rows on AVX-512 (K^T tiles), panels elsewhere
    Shape(1, 32, 2, 40, 150, 48),  # 640 rows a kv head: panels; bf16 on a bf16 unit 2 query heads a task
)
LARGE_SCORES = (30.0, 100.0)

#: (shape, dtype, q scale) of every configuration the tests below run on every example
#: (tests/test_mutants.py checks that planted mistakes are caught by one of them).
GOLDEN_CONFIGS = (
    [(s, torch.float32, 1.0) for s in (*AWKWARD_SHAPES, MASK_SPAN_SHAPE, *DECODING_SHAPES)]
    + [(AWKWARD_SHAPES[1], torch.float32, q_scale) for q_scale in LARGE_SCORES]
    + [(s, d, 1.0) for s in LOW_PRECISION_SHAPES for d in (torch.bfloat16, torch.float16)]
    + [(s, torch.bfloat16, 1.0) for s in (MASK_SPAN_SHAPE, *DECODING_SHAPES)]
    + [(s, torch.float16, 1.0) for s in DECODING_SHAPES]
)


@pytest.mark.parametrize("shape", AWKWARD_SHAPES, ids=str)
def test_fp32_forward_backward(example: attncc.Kernel, shape: Shape) -> None:
    result = check(example, adapt(shape, example), torch.float32)
    assert result.ok, result.describe()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", LOW_PRECISION_SHAPES, ids=str)
def test_low_precision_within_eager_error(example: attncc.Kernel, shape: Shape, dtype: torch.dtype) -> None:
    result = check(example, adapt(shape, example), dtype)
    assert result.ok, result.describe()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_learnable_gradient_s_limit_is_not_eager_s_error(dtype: torch.dtype) -> None:
    """Eager autograd in bf16 sums alibi's dslopes over N x M terms in bf16 (off by ~5): twice
    that was the limit, which no wrong gradient could fail; the kernels sum in fp32 or double."""
    alibi = kernel("alibi")
    result = check(alibi, adapt(LOW_PRECISION_SHAPES[1], alibi), dtype)
    assert result.ok, result.describe()
    assert result.limits["dslopes"] <= 16 * torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_masks_take_effect(example: attncc.Kernel, dtype: torch.dtype) -> None:
    q = torch.empty(MASK_SPAN_SHAPE.B, MASK_SPAN_SHAPE.H, MASK_SPAN_SHAPE.N, MASK_SPAN_SHAPE.D)
    assert MASK_SPAN_SHAPE.M >= 3 * example.plan(q, q, None).tiles.block_cols  # rows cross 3+ key tiles
    result = check(example, adapt(MASK_SPAN_SHAPE, example), dtype)
    assert result.ok, result.describe()


@pytest.mark.parametrize("name", ["vanilla", "relative_bias", "padding", "causal", "gpt2"])
def test_long_keys_take_more_rows_per_task(name: str) -> None:
    """Where a query tile sees enough keys that a kv head's K/V panels outgrow L2 the forward
    takes CPU_STREAMING_BR query rows per task (a tail tile here), the backward keeps its tiles;
    a mask that shows each query fewer keys (causal with 300 queries) keeps the forward's tiles."""
    kern = kernel(name)
    # M past the threshold of this machine's L2 (4097 keys at d = 64 with 2 MiB, 1025 with 512 KiB)
    keys = kern.op.tiling.for_head_dim(64).streaming_keys
    shape = adapt(Shape(2, 2, 1, 300, keys + 75, 64), kern)
    q = torch.empty(shape.B, shape.H, shape.N, shape.D)
    k = torch.empty(shape.B, shape.Hkv, shape.M, shape.D)
    runtime = make_inputs(kern, shape, requires_grad=False)[3]
    forward, backward = kern.forward_classes(q, k, **runtime)[0], kern.plan(q, k, None, backward=True).tiles
    # the most keys one query sees, from the masks' meaning: j <= i shows at most N of them
    seen = {"causal": shape.N, "gpt2": shape.N}.get(name, shape.M)
    if name == "padding":
        seen = int(runtime["lengths"].max())
    streams = seen >= keys
    assert forward.block_rows == (CPU_STREAMING_BR if streams else kern.plan(q, k, None).tiles.block_rows)
    assert backward.block_rows < CPU_STREAMING_BR
    for dtype in (torch.float32, torch.bfloat16):
        result = check(kern, shape, dtype)
        assert result.ok, result.describe()


@pytest.mark.parametrize("q_scale", LARGE_SCORES)
def test_large_scores(example: attncc.Kernel, q_scale: float) -> None:
    """|s| up to ~100 x typical: the running max must be subtracted right, softcap saturates."""
    result = check(example, adapt(AWKWARD_SHAPES[1], example), torch.float32, q_scale=q_scale)
    assert result.ok, result.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_running_max_follows_scores_rising_along_the_keys(dtype: torch.dtype) -> None:
    """Scores rising by ~250 from the first key tile to the last: the forward keeps a row's max
    until a tile exceeds it by ln 256 (lazy rescaling), so it must still move here, where
    exp(s - stale max) would overflow fp32."""
    kern = kernel("vanilla")
    N, M, D = 40, 700, 16
    q = torch.ones(1, 2, N, D)
    ramp = torch.linspace(0, 1, M)[:, None] * torch.linspace(0.5, 1.5, D)  # s_j rises with j
    k = (ramp * 62.5).expand(1, 2, M, D).contiguous()
    v = torch.randn(1, 2, M, D, generator=torch.Generator().manual_seed(3))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    out, lse = kern(q, k, v, return_lse=True)
    ref, ref_lse = kern.reference(q, k, v)
    assert ref_lse.max() > 240
    assert (out.double() - ref).abs().max() < (1e-4 if dtype == torch.float32 else 3e-2)
    assert ((lse.double() - ref_lse).abs() / ref_lse.abs()).max() < 1e-4


@pytest.mark.parametrize("shape", DECODING_SHAPES, ids=str)
def test_decoding_shapes(example: attncc.Kernel, shape: Shape) -> None:
    """Few query rows per kv head: the forward's row-by-row path (dot products, rows of P V) instead
    of panels and tile products, K and V read where they are stored (D = 64 and 48, widened in
    registers from bf16/fp16, or bf16 multiplied as stored on a bf16 unit) or widened into tiles
    (D = 40, not a whole number of vectors)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        result = check(example, adapt(shape, example), dtype)
        assert result.ok, result.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("D", "Dv"),
    [(16, 16), (24, 24), (32, 32), (48, 40), (64, 64), (80, 80), (64, 96), (112, 112), (96, 144), (256, 256)],
)
def test_decoding_value_rows_of_every_width(D: int, Dv: int, dtype: torch.dtype) -> None:
    """Decoding's P V a query row at a time (primitives.h `row_times_rows`: O's row held in
    registers, up to 8 vectors at once, keys in pairs and an odd last one) at every vector count
    of Dv from 1 to 9 and 16 on AVX-512 and 1 to 4 (and chunks of 4) on AVX2 (Dv = 40: tiles
    widened to 48), 1 and 3 query rows per kv head, odd and even key counts, one key; against
    softmax(q k^T / sqrt(D)) v in float64."""
    kern = kernel("vanilla")
    gen = torch.Generator().manual_seed(D + Dv)
    for heads, N, M in ((4, 1, 301), (2, 3, 64), (4, 1, 1)):
        q = torch.randn(2, heads, N, D, generator=gen).to(dtype)
        k = torch.randn(2, heads, M, D, generator=gen).to(dtype)
        v = torch.randn(2, heads, M, Dv, generator=gen).to(dtype)
        out = kern(q, k, v)
        expected = torch.softmax(q.double() @ k.double().transpose(-1, -2) / D**0.5, -1) @ v.double()
        tolerance = 2e-5 if dtype == torch.float32 else 2e-2
        assert out.shape == expected.shape and (out.double() - expected).abs().max() <= tolerance, (heads, N, M)


@pytest.mark.parametrize("mode", ["fused", "fused, 2 key tiles a sweep", "fused, 3 key chunks", "two-pass"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_both_backward_schedules(name: str, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-pass backward (dQ in a per-task buffer) and the two passes, forced either way; in
    bf16 on a shape whose rows and keys cross 3+ backward tiles with tails (the bf16 backward's
    own tiles on AMX: TilePlan.for_bf16_backward). The one pass also with two key tiles per sweep
    over the query tiles (long sequences' schedule: TilePlan.key_tiles_per_sweep; an odd number
    of key tiles leaves a last sweep of one), and with each (b, kv head)'s key tiles cut into 3
    chunks, a task each, their dQ rows summed after (templates/cpu `chunk_key_tiles`; one key
    tile leaves two chunks empty)."""
    if "sweep" in mode:
        monkeypatch.setattr(TilePlan, "key_tiles_per_sweep", lambda plan, rows: 2)
    if "chunks" in mode:
        monkeypatch.setattr(attncc.Kernel, "backward_passes", lambda *args, **kwargs: (("attncc_backward_fused",), 3))
    kern = kernel(name)
    kern.backward = mode.partition(",")[0]
    long_shape = adapt(Shape(2, 4, 2, 300, 270, 48), kern)
    s = long_shape
    q, k = (torch.empty(s.B, heads, n, s.D, dtype=torch.bfloat16) for heads, n in ((s.H, s.N), (s.Hkv, s.M)))
    tiles = kern.plan(q, k, None, backward=True).tiles
    assert long_shape.N > 2 * tiles.block_rows and long_shape.M > 2 * tiles.block_cols
    try:
        for shape in (Shape(2, 4, 2, 77, 130, 48), Shape(1, 3, 1, 1, 1, 16), Shape(3, 2, 2, 40, 33, 8)):
            result = check(kern, adapt(shape, kern), torch.float32)
            assert result.ok, f"{mode}: {result.describe()}"
        result = check(kern, long_shape, torch.bfloat16)
        assert result.ok, f"{mode}: {result.describe()}"
    finally:
        kern.backward = "auto"


@pytest.mark.parametrize("name", ["vanilla", "causal", "alibi", "sliding_window", "document", "gpt2"])
@pytest.mark.usefixtures("two_threads")
def test_few_kv_heads_cut_the_fused_backward_into_key_chunks(name: str) -> None:
    """One (b, kv head) task or three for two threads: the fused backward cuts each into key
    chunks of about equal visible tiles (a causal mask's and a sliding window's last key tiles
    see few query tiles), fp32 and bf16, against the float64 reference."""
    kern = kernel(name)
    for shape, dtype in ((Shape(1, 4, 1, 300, 390, 48), torch.float32), (Shape(3, 2, 1, 259, 259, 64), torch.bfloat16)):
        shape = adapt(shape, kern)
        q, k = (
            torch.empty(shape.B, heads, n, shape.D, dtype=dtype)
            for heads, n in ((shape.H, shape.N), (shape.Hkv, shape.M))
        )
        passes, chunks = kern.backward_passes(kern.plan(q, k, None, backward=True))
        assert passes == ("attncc_backward_fused",) and chunks == 2, (shape, passes, chunks)
        result = check(kern, shape, dtype)
        assert result.ok, f"{shape} {dtype}: {result.describe()}"


@pytest.mark.parametrize("mode", ["fused", "fused, key chunks", "two-pass"])
def test_learnable_input_grads_are_bit_reproducible_on_the_cpu(mode: str) -> None:
    """Per-thread gradient buffers, a static task schedule and a sum in thread order: the same
    bits on every run, also under torch.use_deterministic_algorithms(True); with one kv head the
    fused pass's task is cut into key chunks, whose dQ rows are summed in chunk order."""
    kern = kernel("relative_bias")
    shape = Shape(1, 4, 1, 150, 150, 32) if "chunks" in mode else Shape(2, 4, 2, 150, 150, 32)
    q, k, v, runtime = make_inputs(kern, shape, torch.float32)
    mode = mode.partition(",")[0]
    threads = torch.get_num_threads()
    kern.backward = mode
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    try:
        if shape.Hkv == 1:
            assert kern.backward_passes(kern.plan(q, k, None, backward=True))[1] == 2
        grads = []
        for _ in range(3):
            out = kern(q, k, v, **runtime)
            grads.append(torch.autograd.grad(out, [runtime["bias"], q], torch.ones_like(out)))
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
        kern.backward = "auto"
    assert all(torch.equal(a, b) for run in grads[1:] for a, b in zip(grads[0], run))


def test_gradient_buffers_beyond_the_budget_under_deterministic_mode(monkeypatch) -> None:
    """Per-thread gradient buffers beyond their budget: the threads share one buffer with float
    atomics, except under torch's deterministic mode, where the backward runs on fewer threads
    (a warning says so) and the sums stay reproducible and correct."""
    import attncc.runtime.kernel as kernel_module

    kern = kernel("alibi")
    q, k, v, runtime = make_inputs(kern, Shape(2, 2, 2, 70, 70, 16), torch.float32)
    monkeypatch.setattr(kernel_module, "PER_THREAD_GRAD_BUFFERS_MAX", 16)  # slopes: 2 doubles, one thread's
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            shared = torch.autograd.grad(kern(q, k, v, **runtime).sum(), [runtime["slopes"]])[0]
        torch.use_deterministic_algorithms(True)
        runs = []
        for _ in range(2):
            with pytest.warns(UserWarning, match=r"the backward runs on 1 of 2 threads"):
                runs.append(torch.autograd.grad(kern(q, k, v, **runtime).sum(), [runtime["slopes"]])[0])
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)
    assert torch.equal(runs[0], runs[1]) and torch.allclose(runs[0], shared, rtol=1e-5)
    ref, _ = kern.reference(q, k, v, **runtime)
    (expected,) = torch.autograd.grad(ref.sum(), [runtime["slopes"]])
    assert torch.allclose(runs[0].double(), expected.double(), rtol=1e-4, atol=1e-5)


def test_backward_schedule_choice() -> None:
    """Fused or two passes by tasks per thread, the fused pass's tasks cut into key chunks where
    they are fewer; its key tiles per sweep by query rows per task, as many as fit L2."""
    kern = kernel("vanilla")
    q = torch.zeros(1, 8, 64, 64)
    tiles = kern.plan(q, q, None, backward=True).tiles
    sweep = tiles.sweep_key_tiles
    assert tiles.key_tiles_per_sweep(CPU_FUSED_SWEEP_ROWS - 1) == 1
    assert tiles.key_tiles_per_sweep(CPU_FUSED_SWEEP_ROWS) == sweep >= 1
    key_side = cpu_key_side_bytes(tiles.block_rows, tiles.block_cols, tiles.head_dim)
    assert sweep == 1 or sweep * key_side <= cpu().onchip_bytes
    fused, two_pass = ("attncc_backward_fused",), ("attncc_backward_dkdv", "attncc_backward_dq")
    long_q, one_kv_head = torch.zeros(1, 8, 1024, 64), torch.zeros(1, 1, 1024, 64)
    key_tiles = math.ceil(1024 / kern.plan(long_q, long_q, None, backward=True).tiles.block_cols)
    assert key_tiles >= 2

    def passes(q: torch.Tensor, k: torch.Tensor, lengths: list[int] | None = None) -> tuple[tuple[str, ...], int]:
        packed = None if lengths is None else (torch.tensor(lengths), torch.tensor(lengths))
        return kern.backward_passes(kern.plan(q, k, None, backward=True), lengths=packed)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert passes(q, q) == (fused, 1)  # 8 (b, kv head) tasks, 2 threads
        assert passes(long_q, one_kv_head) == (fused, 2)  # one task: two key chunks
        # a packed batch's tasks differ: cut where the largest would hold a thread too long
        packed_q, packed_kv = torch.zeros(4, 8, 1024, 64), torch.zeros(4, 1, 1024, 64)  # (its batch view)
        assert passes(packed_q, packed_kv, [1024, 64, 64, 64]) == (fused, 2)
        assert passes(packed_q, packed_kv, [1024, 1024, 1024, 1024]) == (fused, 1)
        assert passes(packed_q[:3], packed_kv[:3], [1024, 1024, 1024]) == (fused, 2)  # 3 on 2 threads
        assert passes(packed_q[:1], packed_kv[:1], [1024]) == (fused, 2)
        assert passes(q[:, :, :, :], one_kv_head[:, :, :64]) == (two_pass, 1)  # one key tile: no chunks
        torch.set_num_threads(8)
        assert passes(long_q, long_q) == (fused, 1)  # a task per thread: no chunks
        # 8 chunks would give each thread a task, but 8 query heads x 1024 rows take sweeps of
        # several key tiles: no more chunks than sweeps
        assert passes(long_q, one_kv_head) == (fused, min(8, key_tiles // sweep))
        assert passes(long_q, long_q[:, :2]) == (fused, min(4, key_tiles))  # 2 tasks x 4 chunks on 8 threads
        kern.backward = "fused"
        assert passes(q, one_kv_head[:, :, :64]) == (fused, 1)
        kern.backward = "two-pass"
        assert passes(long_q, one_kv_head) == (two_pass, 1)
    finally:
        kern.backward = "auto"
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", EXAMPLES)
def test_gradcheck_float64(name: str) -> None:
    kern = kernel(name)
    shape = adapt(Shape(1, 2, 1, 5, 7, 3), kern)
    q, k, v, runtime = make_inputs(kern, shape, torch.float64, seed=3)
    names = [n for n, t in runtime.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    for n in names:
        runtime[n] = runtime[n].detach().double().requires_grad_()
    fixed = {n: t for n, t in runtime.items() if n not in names}

    def fn(q, k, v, *learnable):
        return kern(q, k, v, seed=11, **fixed, **dict(zip(names, learnable)))

    assert torch.autograd.gradcheck(fn, (q, k, v, *[runtime[n] for n in names]), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_fully_masked_rows_give_zero_and_minus_inf() -> None:
    kern = kernel("padding")
    q, k, v, _ = make_inputs(kern, Shape(3, 2, 1, 20, 40, 16))
    lengths = torch.tensor([0, 7, 40])
    out, lse = kern(q, k, v, return_lse=True, lengths=lengths)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    assert torch.isfinite(out).all() and torch.isfinite(lse[1:]).all()
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.equal(q.grad[0], torch.zeros_like(q.grad[0]))
    assert torch.equal(k.grad[0], torch.zeros_like(k.grad[0]))
    assert torch.equal(k.grad[1, :, 7:], torch.zeros_like(k.grad[1, :, 7:]))  # padded keys get no gradient


def test_cross_attention_with_more_queries_than_keys_and_causal_offsets() -> None:
    kern = kernel("causal")
    result = check(kern, Shape(1, 2, 2, 300, 50, 32))
    assert result.ok, result.describe()  # rows i >= 50 see every key; row 0 sees one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [40, 64])
@pytest.mark.parametrize("name", ["alibi", "vanilla"])
def test_strided_and_noncontiguous_inputs(name: str, D: int, dtype: torch.dtype) -> None:
    """Views take the same path as their contiguous copies (bf16 K/V panels: K's rows read as
    32-bit words where their stride allows, V's rows interleaved where D fills whole vectors,
    element by element otherwise), so the results are equal bit for bit."""
    kern = kernel(name)
    gen = torch.Generator().manual_seed(0)
    B, H, N = 2, 4, 67
    runtime = {"slopes": torch.rand(H, generator=gen)} if name == "alibi" else {}
    q = torch.randn(B, N, H, D, generator=gen).transpose(1, 2).to(dtype)  # [B, H, N, D] view of BNHD
    keys = {
        "every other key": torch.randn(B, H, 2 * N, D, generator=gen).to(dtype)[:, :, ::2],
        "odd row stride": torch.randn(B, H, N, D + 1, generator=gen).to(dtype)[..., :D],
        "transposed": torch.randn(B, H, D, N, generator=gen).to(dtype).transpose(2, 3),
    }
    for layout, k in keys.items():
        for v in keys.values():
            out = kern(q, k, v, **runtime)
            ref = kern(q.contiguous(), k.contiguous(), v.contiguous(), **runtime)
            assert torch.equal(out, ref), (layout, v.stride())
    ref64, _ = kern.reference(q, k, v, **runtime)
    assert (out.double() - ref64).abs().max() < (2e-5 if dtype == torch.float32 else 2e-2)


def test_runtime_scale_and_lse() -> None:
    kern = kernel("vanilla")
    q, k, v, _ = make_inputs(kern, Shape(1, 2, 2, 33, 45, 24), requires_grad=False)
    out, lse = kern(q, k, v, return_lse=True, scale=0.3)
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3)
    assert (out.double() - ref).abs().max() < 1e-5
    ref_lse = torch.logsumexp(0.3 * q.double() @ k.double().transpose(-1, -2), -1)
    assert (lse.double() - ref_lse).abs().max() < 1e-5
    assert lse.dtype == torch.float32


def test_matches_sdpa_causal_and_gqa() -> None:
    kern = kernel("gqa")
    q, k, v, _ = make_inputs(kern, Shape(2, 8, 2, 130, 130, 64), requires_grad=False)
    out = kern(q, k, v)
    kk, vv = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    assert (out - ref).abs().max() < 1e-5


# ---------------------------------------------------------------------------- dropout
def test_dropout_mask_is_the_kernels_mask() -> None:
    """With v = identity the output is P after dropout: zero exactly where the mask drops."""
    kern = kernel("gpt2")
    B, H, N = 2, 3, 48
    q = torch.randn(B, H, N, N)
    k = torch.randn(B, H, N, N)
    v = torch.eye(N).expand(B, H, N, N).contiguous()
    seed = 1234
    probs = kern(q, k, v, seed=seed)
    keep = attncc.dropout_mask(seed, 0, B, H, N, N, 0.1)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert torch.equal(probs[..., causal] != 0, keep[..., causal])
    assert torch.equal(probs[..., ~causal], torch.zeros_like(probs[..., ~causal]))


def test_dropout_keep_rate_within_binomial_bounds() -> None:
    for p in (0.1, 0.5, 0.9):
        keep = attncc.dropout_mask(99, 0, 2, 4, 256, 256, p)
        n = keep.numel()
        sigma = (n * p * (1 - p)) ** 0.5
        assert abs(keep.sum().item() - n * (1 - p)) < 5 * sigma
        # rows and columns are not correlated with the counter layout: check per-(j % 4) lanes
        for lane in range(4):
            lane_keep = keep[..., lane::4]
            m = lane_keep.numel()
            assert abs(lane_keep.sum().item() - m * (1 - p)) < 5 * (m * p * (1 - p)) ** 0.5


def test_dropout_is_reproducible_and_train_false_disables_it() -> None:
    kern = kernel("gpt2")
    q, k, v, _ = make_inputs(kern, Shape(1, 2, 2, 40, 40, 16), requires_grad=False)
    assert torch.equal(kern(q, k, v, seed=5), kern(q, k, v, seed=5))
    assert not torch.equal(kern(q, k, v, seed=5), kern(q, k, v, seed=6))
    torch.manual_seed(0)
    a = kern(q, k, v)
    torch.manual_seed(0)
    assert torch.equal(a, kern(q, k, v))
    no_dropout = kern(q, k, v, train=False)
    assert torch.allclose(no_dropout, kernel("causal")(q, k, v), atol=1e-6)


def test_a_training_call_without_a_seed_drops_weights() -> None:
    """train on, no seed (the bits drawn from torch's generator): with v = identity each call's
    output is the causal softmax of float64 torch, every weight kept and scaled by 1 / (1 - 0.1)
    or dropped to 0, about a tenth dropped, and each call draws its own bits (the plain calls
    that repeat a launch must not take one kept without dropout)."""
    kern = kernel("gpt2")
    B, H, N = 2, 3, 48
    gen = torch.Generator().manual_seed(8)
    q, k = (torch.randn(B, H, N, N, generator=gen) for _ in range(2))
    v = torch.eye(N).expand(B, H, N, N).contiguous()
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    s = (q.double() @ k.double().transpose(-1, -2) / math.sqrt(N)).masked_fill(~causal, -math.inf)
    probs = torch.softmax(s, -1)
    torch.manual_seed(0)
    calls = [kern(q, k, v) for _ in range(3)]
    for out in calls:
        kept = out != 0
        assert not (kept & ~causal).any()
        torch.testing.assert_close(out.double()[kept], probs[kept] / 0.9, atol=1e-6, rtol=1e-5)
        dropped = (causal & ~kept).sum().item() / (B * H * causal.sum().item())
        assert 0.05 < dropped < 0.15, dropped
    assert not torch.equal(calls[1], calls[2])


def test_dropout_backward_matches_the_explicit_mask() -> None:
    kern = kernel("gpt2")
    q, k, v, _ = make_inputs(kern, Shape(1, 2, 1, 50, 60, 32), seed=4)
    out = kern(q, k, v, seed=77)
    keep = attncc.dropout_mask(77, 0, 1, 2, 50, 60, 0.1)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = (qd @ kd.transpose(-1, -2).repeat_interleave(2, 1)) / 32**0.5
    s = s.masked_fill(~torch.ones(50, 60, dtype=torch.bool).tril(), float("-inf"))
    ref = (torch.softmax(s, -1) * keep / 0.9) @ vd.repeat_interleave(2, 1)
    g = torch.randn_like(ref)
    out.backward(g.float())
    ref.backward(g)
    for got, want in ((out.detach(), ref.detach()), (q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        assert (got.double() - want).abs().max() < 1e-4


def explicit_dropout_reference(q, k, v, keep: torch.Tensor, rate: float) -> torch.Tensor:
    """Causal attention (N = M) in float64, the kept weights scaled by 1 / (1 - rate), GQA by
    repeated heads."""
    group = q.shape[1] // k.shape[1]
    s = q @ k.transpose(-1, -2).repeat_interleave(group, 1) / q.shape[-1] ** 0.5
    s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return (torch.softmax(s, -1) * keep / (1 - rate)) @ v.repeat_interleave(group, 1)


def test_a_calls_dropout_p_replaces_the_programs_rate() -> None:
    """`dropout_p=` (FlashAttention's per-call rate) takes the place of the program's: padded
    calls against the documented mask at that rate, forward and backward; packed calls each
    sequence's; the emulated CUDA kernels bit for bit as a program written with that rate;
    train=False still disables it; a program without dropout and a rate out of [0, 1) are
    errors naming dropout_p."""
    kern = kernel("gpt2")  # (written with 0.1)
    q, k, v, _ = make_inputs(kern, Shape(1, 4, 2, 50, 50, 32), seed=5)
    for rate in (0.35, 0.0):
        out = kern(q, k, v, seed=21, dropout_p=rate)
        keep = attncc.dropout_mask(21, 0, 1, 4, 50, 50, rate)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = explicit_dropout_reference(*leaves, keep, rate)
        g = torch.randn_like(ref)
        got = torch.autograd.grad(out, (q, k, v), g.float())
        want = torch.autograd.grad(ref, leaves, g)
        for a, b in ((out.detach(), ref.detach()), *zip(got, want)):
            assert (a.double() - b).abs().max() < 1e-4, rate
    assert torch.equal(kern(q, k, v, seed=3, dropout_p=0.35, train=False), kern(q, k, v, train=False))
    # packed: sequence b keeps dropout_mask(seed, b, 1, H, N_b, M_b, p)
    lengths = [17, 33]
    cu = torch.tensor([0, 17, 50])
    packed = [t.detach()[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    out = kern.varlen(*packed, cu, cu, seed=8, dropout_p=0.35)
    for b, (start, n) in enumerate(zip(cu.tolist(), lengths)):
        rows = slice(start, start + n)
        keep = attncc.dropout_mask(8, b, 1, 4, n, n, 0.35)
        ref = explicit_dropout_reference(*(t[rows].transpose(0, 1)[None].double() for t in packed), keep, 0.35)
        assert (out[rows].transpose(0, 1)[None].double() - ref).abs().max() < 1e-5
    emulated = attncc.compile(ROOT / "examples" / "gpt2.attn", target="sm80", emulate=True)
    written = attncc.compile(
        (ROOT / "examples" / "gpt2.attn").read_text().replace("0.1)", "0.35)"), target="sm80", emulate=True
    )
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    a, b = emulated(*low, seed=4, dropout_p=0.35), written(*low, seed=4)
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(torch.autograd.grad(a.sum(), low), torch.autograd.grad(b.sum(), low)))
    with pytest.raises(attncc.InputError, match=r"dropout_p: causal has no dropout; write `p = dropout\(p, rate\)`"):
        kernel("causal")(q, k, v, dropout_p=0.2)
    # (0 on a program without dropout is no dropout: `dropout_p=p if training else 0.0`)
    assert torch.equal(kernel("causal")(q, k, v, dropout_p=0.0), kernel("causal")(q, k, v))
    assert torch.equal(kern(q, k, v, seed=2, dropout_p=torch.tensor(0.35)), kern(q, k, v, seed=2, dropout_p=0.35))
    compiled = torch.compile(lambda q, rate: kern(q, q, q, dropout_p=rate * 0.5), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"dropout_p: a tensor under torch\.compile; pass a Python number"):
        compiled(q, torch.tensor(0.6))
    pages = torch.randn(4, 16, 2, 32)
    with pytest.raises(attncc.InputError, match=r"dropout_p: paged calls are inference and apply no dropout"):
        kern.paged(q[:, :, :1].transpose(1, 2), pages, pages, torch.arange(4).view(1, 4).int(), torch.tensor([20]),
                   train=False, dropout_p=0.0)  # fmt: skip
    for bad in (1.0, -0.1, "0.2", True, torch.tensor(0.2, requires_grad=True)):
        with pytest.raises(attncc.InputError, match=r"dropout_p: expected a number in \[0, 1\)"):
            kern(q, k, v, dropout_p=bad)


# ---------------------------------------------------------------------------- torch integration
def test_custom_op_passes_opcheck() -> None:
    kern = kernel("alibi")
    q, k, v, rt = make_inputs(kern, Shape(1, 2, 1, 9, 11, 8))
    args = (kern.call_key, q, k, v, [rt["slopes"]], [], 0.3, 0.0, torch.tensor([0]), None, None, None)
    torch.library.opcheck(torch.ops.attncc.attention.default, args)
    dropout = kernel("gpt2")
    args = (dropout.call_key, q, k, v, [], [], None, 0.1, torch.tensor([7]), None, None, None)
    torch.library.opcheck(torch.ops.attncc.attention.default, args)
    # fp8 k and v with descale factors shaped as k and v with a head dim of 1 (forward only)
    k8, v8 = (t.detach().to(torch.float8_e4m3fn) for t in (k, v))
    scales = [torch.rand(*t.shape[:-1], 1) + 0.5 for t in (k, v)]
    args = (kern.call_key, q.detach(), k8, v8, [rt["slopes"].detach()], [], None, 0.0, torch.tensor([0]), None, *scales)
    # (opcheck's schema test multiplies the inputs, which torch does not do for fp8 tensors)
    fp8_checks = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.attncc.attention.default, args, test_utils=fp8_checks)
    sinks = kernel("gpt_oss")  # the sink rows [B, H, N] as the op takes them, learnable
    q, k, v, rt = make_inputs(sinks, Shape(1, 2, 1, 9, 11, 8))
    rows = torch.randn(1, 2, 9, requires_grad=True)
    args = (sinks.call_key, q, k, v, [rt["sinks"]], [5.0], None, 0.0, torch.tensor([0]), rows, None, None)
    torch.library.opcheck(torch.ops.attncc.attention.default, args)


def test_torch_compile_forward_and_backward() -> None:
    kern = kernel("relative_bias")
    q, k, v, rt = make_inputs(kern, Shape(1, 2, 2, 33, 33, 16))
    bias = rt["bias"]

    @torch.compile(fullgraph=True, backend="aot_eager")
    def loss_fn(q, k, v, bias):
        return (kern(q, k, v, bias=bias) ** 2).sum()

    loss = loss_fn(q, k, v, bias)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v, bias)]
    for t in (q, k, v, bias):
        t.grad = None
    (kern(q, k, v, bias=bias) ** 2).sum().backward()
    for got, t in zip(grads, (q, k, v, bias)):
        assert torch.allclose(got, t.grad, atol=1e-5)


@pytest.mark.parametrize("name", ["vanilla", "alibi", "sliding_window", "padding", "softcap"])
@pytest.mark.usefixtures("two_threads")
def test_decoding_from_kv_heads_side_by_side(name: str) -> None:
    """K, V as [B, M, Hkv, D] (a paged cache's layout, a transposed view): a decoding task takes
    the query heads of several kv heads of a sequence (forward_decode), and each kv head's rows
    must meet its own K/V rows, score map and mask: groups of 3 rows (axpy tails), 12 (gemm
    blocks and a tail) and 1 query head per kv head, 1 to 3 sequences; and, from 48 rows a kv
    head, fp32's transposed K tiles, a segment per kv head (52 and 51 rows a kv head: gemm
    tails, axpy rows; 2 and 3 kv heads in a task on 2 threads, the K/V rows of the next segment
    fetched ahead). (bf16 on
    `vdpbf16ps` packs key tiles from 9 rows a kv head, in segments where a kv head's rows are
    whole blocks of 16: the 64 rows.) Where the scores come from dot products, key tiles of
    one vector."""
    kern = kernel(name)
    for B, H, Hkv, N in ((1, 12, 4, 1), (3, 8, 2, 3), (2, 6, 6, 2), (2, 8, 2, 13), (2, 6, 2, 17), (2, 12, 3, 16)):
        shape = adapt(Shape(B, H, Hkv, N, 300, 40), kern)
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, runtime = make_inputs(kern, shape, dtype, requires_grad=False)
            side_by_side = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v)]
            assert side_by_side[0].stride(1) < side_by_side[0].stride(2)
            tiles, group = kern.plan(q, side_by_side[0], None).tiles, H // Hkv
            if dtype == torch.float32 and tiles.transposed_key_rows:  # (bf16: by the bf16 unit; generic: none)
                assert tiles.reads_by_rows(N, group) and tiles.transposes_keys(N, group) == (N * group >= 48)
            dot_products = tiles.reads_by_rows(N, group) and not tiles.transposes_keys(N, group)
            key_tile = kern.forward_classes(q, side_by_side[0], **runtime)[0].block_cols
            assert (key_tile == CPU_SIDE_BY_SIDE_DECODING_BC) == dot_products, (B, H, Hkv, N, dtype)
            out = kern(q, *side_by_side, **runtime)
            ref, _ = kern.reference(q.double(), k.double(), v.double(), **runtime)
            tolerance = 1e-4 if dtype == torch.float32 else 3e-2
            assert (out.double() - ref).abs().max() < tolerance, (name, B, H, Hkv, N, dtype)


def test_partial_tiles_narrow_the_wide_bf16_key_tiles() -> None:
    """Where a tenth or more of a call's visible tiles are partial (masked edges), the AMX
    forward's 256-key tiles narrow to CPU_BF16_BLOCK, with at least as many rows
    (TilePlan.for_partial_tiles); a dense call keeps its tiles; masked bf16 calls still agree
    with float64 eager at odd N."""
    planned = kernel("vanilla").op.tiling.for_head_dim(64).for_bf16_products()
    wide = replace(planned, block_cols=2 * CPU_BF16_BLOCK)
    assert wide.for_partial_tiles(0.5).block_cols == CPU_BF16_BLOCK
    assert wide.for_partial_tiles(0.05) is wide
    # the wide heads' 64-row tiles (CPU_AMX_WIDE_HEAD_ROWS) take CPU_BF16_BLOCK rows when narrowed
    assert replace(wide, block_rows=64).for_partial_tiles(0.5).block_rows == CPU_BF16_BLOCK
    assert replace(wide, block_rows=256).for_partial_tiles(0.5).block_rows == 256
    narrow = replace(wide, block_cols=CPU_BF16_BLOCK)
    assert narrow.for_partial_tiles(1.0) is narrow
    q = torch.empty(1, 2, 1000, 64, dtype=torch.bfloat16)
    assert kernel("causal").forward_classes(q, q)[0].block_cols <= CPU_BF16_BLOCK
    assert kernel("vanilla").forward_classes(q, q)[0].block_cols == planned.block_cols
    for name in ("causal", "sliding_window"):
        kern = kernel(name)
        result = check(kern, adapt(Shape(1, 2, 1, 700, 700, 64), kern), torch.bfloat16, backward=False)
        assert result.ok, result.describe()
