"""fp8 K and V with descale factors (forward only): k, v of float8_e4m3fn / float8_e5m2, q of
float32, bfloat16 or float16, the kernels widening each row times its factor as they load it.

References are eager code that dequantises first (k.float() * k_descale, rounded to q's dtype,
then the hand-written float64 attention of test_independent_references.py); the decoders are
checked on every one of the 256 byte patterns of each format, exactly.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import attncc
from attncc.errors import AttnccError, InputError
from attncc.runtime.check import _error
from attncc.runtime.inputs import Shape
from attncc.runtime.nvcc import compile_cuda
from tests.conftest import EXAMPLES, ROOT, kernel
from tests.test_cuda import HAVE_NVCC
from tests.test_independent_references import CASES, FWD_TOL, draw, runtime_inputs
from tests.test_serving import BOTTOM_RIGHT_CAUSAL, offsets, packed_lengths, per_sequence_reference

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: Half-precision kernels against the float64 reference on the same (rounded) inputs: P and the
#: output rounded to 8 (bf16) or 11 (fp16) bits.
HALF_TOL = {torch.float32: FWD_TOL, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def emulated(name: str, target: str) -> attncc.Kernel:
    return attncc.compile(ROOT / "examples" / f"{name}.attn", target=target, emulate=True)


def quantised(x: torch.Tensor, descale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """x / descale in fp8 (the factors broadcast over x's rows)."""
    return (x.detach() / descale.unsqueeze(-1)).to(fmt)


def dequantised(x8: torch.Tensor, descale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """What the kernels compute with: x8 widened, times its factor in fp32, rounded to `dtype`, as float64."""
    factor = descale.unsqueeze(-1) if isinstance(descale, torch.Tensor) else descale
    return (x8.float() * factor).to(dtype).double()


def every_byte(fmt: torch.dtype) -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt)


# ----------------------------------------------------------------------- decoders, exactly
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(
    ("backend", "dtype"), [("cpu", torch.float32), ("sm80", torch.bfloat16), ("sm75", torch.float16)]
)
def test_every_byte_decodes_exactly(fmt: str, backend: str, dtype: torch.dtype) -> None:
    """One key: out is v's row as the kernel widened it (every byte of the format, NaN and
    infinities too), and with q = 16 e_d (scale 1/16) the lse of query d is k's element d."""
    values = every_byte(FORMATS[fmt])
    v8 = values.view(1, 1, 1, 256)
    finite = values.float().isfinite()
    k8 = torch.where(finite, values.float(), 0.0).to(FORMATS[fmt]).view(1, 1, 1, 256)
    q = (torch.eye(256) * 16).view(1, 1, 256, 256).to(dtype)
    kern = kernel("vanilla") if backend == "cpu" else emulated("vanilla", backend)
    out, lse = kern(q, k8, v8, return_lse=True)
    expected = values.float()
    assert torch.equal(out[0, 0, 0].float().isnan(), expected.isnan())
    assert torch.equal(out[0, 0, 0].float().nan_to_num(), expected.nan_to_num()), "v decoded"
    assert torch.allclose(lse[0, 0].float(), k8.float().view(256), rtol=1e-6, atol=0), "k decoded"


# ----------------------------------------------------------------------- every example
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_with_fp8_k_and_v(name: str, dtype: torch.dtype) -> None:
    """e4m3 k with a factor per token and head, e5m2-free v with one per (sequence, head): out and
    lse against the hand-written reference on the dequantised operands."""
    case = CASES[name]
    q, k, v, _ = draw(case)
    inputs = {n: t.detach() if isinstance(t, torch.Tensor) else t for n, t in runtime_inputs(case).items()}
    s = case.shape
    gen = torch.Generator().manual_seed(7)
    k_descale = torch.rand(s.B, s.Hkv, s.M, generator=gen) * 0.02 + 0.005
    v_descale = torch.rand(s.B, s.Hkv, 1, generator=gen) * 0.02 + 0.005
    k8, v8 = quantised(k, k_descale, torch.float8_e4m3fn), quantised(v, v_descale, torch.float8_e4m3fn)
    q = q.detach().to(dtype)
    with torch.no_grad():
        out, lse = kernel(name)(
            q, k8, v8, k_descale=k_descale, v_descale=v_descale, return_lse=True, **case.call, **inputs
        )
        ref_inputs = {
            n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in inputs.items()
        }
        k64, v64 = dequantised(k8, k_descale, dtype), dequantised(v8, v_descale, dtype)
        ref_out, ref_lse = case.reference(q.double(), k64, v64, ref_inputs)
    assert out.dtype == dtype and out.shape == (s.B, s.H, s.N, s.Dv)
    assert _error(out, ref_out) <= HALF_TOL[dtype], _error(out, ref_out)
    assert _error(lse, ref_lse) <= (FWD_TOL if dtype == torch.float32 else 2e-4), _error(lse, ref_lse)
    # the factors matter: the same bytes without them are another answer
    assert _error(kernel(name)(q, k8, v8, **case.call, **inputs), ref_out) > 0.1


EMULATED_SHAPES = (
    Shape(2, 4, 2, 77, 130, 48, Dv=24),  # tails, GQA, Dv != D
    Shape(1, 2, 1, 3, 300, 64),  # decoding: split-KV
    Shape(1, 2, 2, 40, 45, 192, Dv=128),
)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("target", "dtype"), [("sm80", torch.bfloat16), ("sm75", torch.float16)])
@pytest.mark.parametrize("name", ["alibi", "gpt_oss"])
def test_cuda_kernels_on_the_emulator(name: str, target: str, dtype: torch.dtype, fmt: str) -> None:
    """The CUDA forward widening fp8 K/V into shared memory (per-token k factors, per-tensor v
    factor), split-KV forced on, against float64 code on the dequantised operands."""
    kern = emulated(name, target)
    kern.kv_splits = 3
    case = CASES[name]
    for shape in EMULATED_SHAPES:
        case_here = replace(case, shape=shape)
        q, k, v, _ = draw(case_here)
        inputs = {
            n: t.detach() if isinstance(t, torch.Tensor) else t
            for n, t in case.inputs(torch.Generator().manual_seed(3), shape).items()
        }
        k_descale = torch.rand(shape.B, shape.Hkv, shape.M) * 0.02 + 0.005
        v_descale = 0.01
        k8 = quantised(k, k_descale, FORMATS[fmt])
        v8 = (v.detach() / v_descale).to(FORMATS[fmt])
        q = q.detach().to(dtype)
        with torch.no_grad():
            out, lse = kern(q, k8, v8, k_descale=k_descale, v_descale=v_descale, return_lse=True, **inputs)
            ref_inputs = {
                n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in inputs.items()
            }
            ref_out, ref_lse = case.reference(
                q.double(), dequantised(k8, k_descale, dtype), dequantised(v8, v_descale, dtype), ref_inputs
            )
        assert _error(out, ref_out) <= 2e-2, (shape, _error(out, ref_out))
        assert _error(lse, ref_lse) <= 2e-3, (shape, _error(lse, ref_lse))


@pytest.mark.skipif(not HAVE_NVCC, reason="nvcc is not installed on this machine")
@pytest.mark.parametrize(
    ("arch", "dtype"),
    [("sm80", "bfloat16+float8_e4m3fn"), ("sm90", "bfloat16+float8_e4m3fn"), ("sm89", "bfloat16+float8_e5m2+mma"),
     ("sm90", "bfloat16+float8_e4m3fn+mma")],
)  # fmt: skip
def test_fp8_forward_compiles_without_spills(arch: str, dtype: str) -> None:
    """nvcc's ptxas for the fp8 forward (alibi: a learnable input in the score map), widening
    or on the fp8 tensor cores (sm89, sm90), at d = 128 and the MLA 192/128: within the
    register file, no spills, no stack; but for the fp8 products on sm90, whose 128 x 64 tiles
    (the widening kernel's, at 254 registers there) spill a little: at most 16 B at d = 128 and
    128 B at 192/128 (measured 16 and 84/120 B, CUDA 13.0 after session 23's template: 16 and 0;
    a bound, so that growth is seen)."""
    kern = emulated("alibi", arch)
    for dims, spill_bound in (((128, 128), 16), ((192, 128), 128)):
        report = compile_cuda(kern.cuda_source(dtype, *dims), arch)
        bound = spill_bound if (arch, dtype.endswith("+mma")) == ("sm90", True) else 0
        assert max(report.spill_stores, report.spill_loads) <= bound, report.describe()
        assert report.stack_bytes <= (bound and 64), report.describe()


# ----------------------------------------------------------------------- fp8 tensor cores (sm89, sm90)
def e4m3_rounded_rows(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q as the fp8-product kernels take it (templates/cuda `e4m3_row_scale`), written from
    their documented rule: each row times the largest power of two 2^e with max |q_row| 2^e <=
    448, rounded to e4m3 (nearest even); returns the rounded rows as float64 and 2^-e."""
    q32 = q.float()
    amax = q32.abs().amax(-1, keepdim=True)
    power = torch.where(amax > 0, torch.exp2(torch.floor(torch.log2(448.0 / amax.double()))), 1.0).float()
    return (q32 * power).to(torch.float8_e4m3fn).double(), 1.0 / power.double()


def fp8_product_model(
    q: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, k_descale: torch.Tensor, v_descale: float, block_cols: int,
    causal: bool,
) -> torch.Tensor:  # fmt: skip
    """The output the fp8 products compute, in float64 but for their two roundings: q's rows
    (`e4m3_rounded_rows`) and P: key tiles of `block_cols` in order with the running row max m,
    each tile's P = exp(s - m) rounded to e4m3 after times 256, O and the row sum rescaled as
    the maximum grows (FlashAttention's online softmax), O = sum P8 v / (256 l) times v's factor."""
    q8, q_factor = e4m3_rounded_rows(q)
    group = q.shape[1] // k8.shape[1]
    k64, v64 = (t.double().repeat_interleave(group, 1) for t in (k8, v8))
    k_factor = k_descale.double().repeat_interleave(group, 1).unsqueeze(-2)
    s = (q8 @ k64.transpose(-1, -2)) * q_factor * k_factor / math.sqrt(q.shape[-1])
    N, M = s.shape[-2:]
    if causal:
        s = s.masked_fill(torch.arange(M).view(1, -1) > torch.arange(N).view(-1, 1), -math.inf)
    m = torch.full((*s.shape[:-1], 1), -math.inf, dtype=torch.float64)
    row_sum, acc = torch.zeros_like(m), torch.zeros(*s.shape[:-1], v8.shape[-1], dtype=torch.float64)
    for j0 in range(0, M, block_cols):
        tile = s[..., j0 : j0 + block_cols]
        m_new = torch.maximum(m, tile.amax(-1, keepdim=True))
        shift = torch.where(m_new == -math.inf, 0.0, m_new)
        alpha, p = torch.exp(m - shift), torch.exp(tile - shift)
        p8 = (p * 256).float().to(torch.float8_e4m3fn).double()
        acc = acc * alpha + p8 @ v64[..., j0 : j0 + block_cols, :]
        row_sum = row_sum * alpha + p.sum(-1, keepdim=True)
        m = m_new
    return acc * v_descale / (256 * row_sum)


def model_mismatch(out: torch.Tensor, model: torch.Tensor) -> str | None:
    """Why `out` does not follow the fp8 products' rounding model (`fp8_product_model`), or None.
    Within bf16 rounding: rms 3e-3 and each element 1e-2 of max(1, |model|); but the kernel's
    scores and exp (fp32, the hardware's approximate exp2 and accumulation order) can put a P
    element on the other side of an e4m3 rounding boundary than the float64 model (measured on
    the emulator: one row in 2x8x256 at M = 1024, e5m2, off by 0.025), which moves a row with
    few keys by up to one e4m3 step (2^-3) of that key's weight: at most 0.1% of elements may
    exceed 1e-2, none 2^-3."""
    err = (out.double() - model).abs() / model.abs().clamp(min=1.0)
    rms = rms_error(out, model)
    if rms > 3e-3 or float((err > 1e-2).double().mean()) > 1e-3 or float(err.max()) > 2**-3:
        return f"rms {rms:.2e}, elements beyond 1e-2: {int((err > 1e-2).sum())} of {err.numel()}, max {float(err.max()):.3f}"
    return None


def rms_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """|got - ref| / |ref| over all elements (root mean squares)."""
    return float((got.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


FP8_MMA_TARGETS = ("sm89", "sm90")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("target", FP8_MMA_TARGETS)
@pytest.mark.parametrize("name", ["vanilla", "causal"])
def test_fp8_products_follow_their_rounding_model(name: str, target: str, fmt: str) -> None:
    """With `fp8_mma` the emulated sm89/sm90 forward multiplies e4m3 Q (rounded per row in the
    kernel) by the fp8 K bytes and e4m3 P by the fp8 V bytes (V stored transposed, keys
    reordered for the P fragments): the output is `fp8_product_model`'s to bf16 rounding, at
    GQA with tails, D = 64 and 128, a single key tile and several, peaked rows; further from the exact
    answer than the widening kernels (the roundings are really there)."""
    kern = emulated(name, target)
    kern.fp8_mma, kern.kv_splits = True, 1  # one split: the model's order of key tiles
    gen = torch.Generator().manual_seed(17)
    # (the last: q near key 0, whose score is ~8 above the others: a tenth of each row's weight
    # is in P ~ e^-8, below e4m3's normal range unless P is scaled up first)
    for B, H, Hkv, N, M, D, peaked in (
        (2, 4, 2, 77, 130, 64, False),
        (1, 2, 1, 33, 300, 128, False),
        (1, 1, 1, 5, 300, 64, True),
    ):
        k = torch.randn(B, Hkv, M, D, generator=gen)
        q = torch.randn(B, H, N, D, generator=gen) * (0.3 if peaked else 1.0) + (k[:, :1, :1] if peaked else 0.0)
        q = q.to(torch.bfloat16)
        k_descale = torch.rand(B, Hkv, M, generator=gen) * 0.02 + 0.005
        k8 = quantised(k, k_descale, FORMATS[fmt])
        v8 = (torch.randn(B, Hkv, M, D, generator=gen) / 0.01).to(FORMATS[fmt])
        with torch.no_grad():
            out = kern(q, k8, v8, k_descale=k_descale, v_descale=0.01)
        plan = kern.plan(q, k8, None, value_dim=D)
        assert kern.takes_fp8_products(k8, torch.tensor(0.01).expand(B, Hkv, M, 1), (2,), plan)
        model = fp8_product_model(q, k8, v8, k_descale, 0.01, plan.tiles.block_cols, name == "causal")
        assert model_mismatch(out, model) is None, (B, N, M, D, model_mismatch(out, model))
        widened = dequantised(k8, k_descale, torch.bfloat16), dequantised(v8, 0.01, torch.bfloat16)
        s = q.double() @ widened[0].repeat_interleave(H // Hkv, 1).transpose(-1, -2) / math.sqrt(D)
        if name == "causal":
            s = s.masked_fill(torch.arange(M).view(1, -1) > torch.arange(N).view(-1, 1), -math.inf)
        reference = torch.softmax(s, -1) @ widened[1].repeat_interleave(H // Hkv, 1)
        assert rms_error(out, reference) <= 0.05
        assert peaked or rms_error(out, reference) > 2 * rms_error(out, model)  # (peaked: key 0 decides)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("target", FP8_MMA_TARGETS)
@pytest.mark.parametrize("name", ["alibi", "gpt_oss"])
def test_fp8_products_on_the_emulator(name: str, target: str, fmt: str) -> None:
    """Score maps with learnable inputs, sinks and windows on the fp8 tensor cores, split-KV
    as chosen per call, GQA decoding folded: against float64 code on the dequantised operands,
    within e4m3's precision (3% rms of the output here). D = 48 (not a multiple of 32) widens."""
    kern = emulated(name, target)
    kern.fp8_mma = True
    case = CASES[name]
    decoding = Shape(2, 8, 2, 1, 300, 128, Dv=64)
    for shape in (*EMULATED_SHAPES, decoding):
        q, k, v, _ = draw(replace(case, shape=shape))
        inputs = {
            n: t.detach() if isinstance(t, torch.Tensor) else t
            for n, t in case.inputs(torch.Generator().manual_seed(3), shape).items()
        }
        k_descale = torch.rand(shape.B, shape.Hkv, shape.M) * 0.02 + 0.005
        v_descale = torch.rand(shape.B, shape.Hkv, 1) * 0.02 + 0.005
        k8, v8 = quantised(k, k_descale, FORMATS[fmt]), quantised(v, v_descale, FORMATS[fmt])
        q = q.detach().to(torch.bfloat16)
        with torch.no_grad():
            out, lse = kern(q, k8, v8, k_descale=k_descale, v_descale=v_descale, return_lse=True, **inputs)
            ref_inputs = {
                n: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for n, t in inputs.items()
            }
            ref_out, ref_lse = case.reference(
                q.double(), dequantised(k8, k_descale, torch.bfloat16), dequantised(v8, v_descale, torch.bfloat16),
                ref_inputs,
            )  # fmt: skip
        plan = kern.plan(q, k8, None, value_dim=shape.Dv)
        products = kern.takes_fp8_products(k8, v_descale.expand(shape.B, shape.Hkv, shape.M).unsqueeze(-1), (2,), plan)
        assert products == (shape.D % 32 == 0), shape
        tol = (0.05, 0.15, 0.1) if products else (5e-3, 2e-2, 2e-3)  # rms and max of out, max of lse
        assert rms_error(out, ref_out) <= tol[0] and _error(out, ref_out) <= tol[1], (shape, _error(out, ref_out))
        assert _error(lse, ref_lse) <= tol[2], (shape, _error(lse, ref_lse))


@pytest.mark.parametrize("target", FP8_MMA_TARGETS)
def test_fp8_products_in_packed_and_paged_calls(target: str) -> None:
    """The same sequences padded, packed and in a paged cache (pages shuffled, GQA 4/2, one v
    factor per kv head, per-token k factors) give the same fp8-product outputs: the calls
    differ in how rows are found, not in what is multiplied."""
    kern = attncc.compile(BOTTOM_RIGHT_CAUSAL, target=target, emulate=True)
    kern.fp8_mma, kern.kv_splits = True, 1
    gen = torch.Generator().manual_seed(23)
    B, H, Hkv, N, M, D, page = 2, 4, 2, 3, 90, 64, 16
    q = torch.randn(B, H, N, D, generator=gen).to(torch.bfloat16)
    k_descale = torch.rand(B, Hkv, M, generator=gen) * 0.02 + 0.005
    k8 = quantised(torch.randn(B, Hkv, M, D, generator=gen), k_descale, torch.float8_e4m3fn)
    v8 = quantised(torch.randn(B, Hkv, M, D, generator=gen), torch.full((B, Hkv, M), 0.01), torch.float8_e4m3fn)
    with torch.no_grad():
        padded = kern(q, k8, v8, k_descale=k_descale, v_descale=0.01)
        packed = kern.varlen(
            q.transpose(1, 2).flatten(0, 1), k8.transpose(1, 2).flatten(0, 1), v8.transpose(1, 2).flatten(0, 1),
            offsets([N] * B), offsets([M] * B), k_descale=k_descale.transpose(1, 2).flatten(0, 1), v_descale=0.01,
        )  # fmt: skip
        pages = -(-M // page)
        table = torch.randperm(B * pages + 3, generator=gen)[: B * pages].view(B, pages).int()
        caches = []
        for t in (k8, v8, k_descale.unsqueeze(-1)):
            cache = torch.zeros(B * pages + 3, page, Hkv, t.shape[-1], dtype=t.dtype)
            rows = torch.zeros(B, pages * page, Hkv, t.shape[-1], dtype=t.dtype)
            rows[:, :M] = t.transpose(1, 2)
            cache[table.long()] = rows.view(B, pages, page, Hkv, t.shape[-1])
            caches.append(cache)
        paged = kern.paged(
            q.transpose(1, 2), caches[0], caches[1], table, torch.full((B,), M), k_descale=caches[2].squeeze(-1),
            v_descale=0.01,
        )  # fmt: skip
    assert torch.equal(packed.view(B, N, H, D).transpose(1, 2), padded)
    assert torch.equal(paged.transpose(1, 2), padded)


def test_fp8_products_are_taken_where_they_apply() -> None:
    """`takes_fp8_products`: asked for, on a target with fp8 tensor cores, fp8 k, one v factor
    per kv head, key tiles and q/k's head dim in steps of 32, K not rotated in the kernel;
    else the widening kernels (exact to the dequantised operands) run."""
    q = torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16)
    k8 = torch.zeros(1, 2, 40, 64, dtype=torch.float8_e4m3fn)
    per_head = torch.tensor(0.5).expand(1, 2, 40, 1)
    per_token = torch.rand(1, 2, 40, 1)
    kern = emulated("alibi", "sm90")
    plan = kern.plan(q, k8, None)
    assert not kern.takes_fp8_products(k8, per_head, (2,), plan)  # not asked for
    kern.fp8_mma = True
    assert kern.takes_fp8_products(k8, per_head, (2,), plan)
    assert not kern.takes_fp8_products(k8, per_token, (2,), plan)
    assert not kern.takes_fp8_products(k8.to(torch.bfloat16), None, (2,), plan)
    assert not kern.takes_fp8_products(k8[..., :48], per_head, (2,), kern.plan(q[..., :48], k8[..., :48], None))
    sm80 = emulated("alibi", "sm80")
    sm80.fp8_mma = True
    assert not sm80.takes_fp8_products(k8, per_head, (2,), sm80.plan(q, k8, None))
    rotated = attncc.compile(
        "attention r\nq = rope(q, theta=10000)\nk = rope(k, theta=10000)\ns = q @ k.T * scale\np = softmax(s)\no = p @ v\noutput o\n",
        target="sm90", emulate=True,
    )  # fmt: skip
    rotated.fp8_mma = True
    assert not rotated.takes_fp8_products(k8, per_head, (2,), rotated.plan(q, k8, None))
    with pytest.raises(AttnccError, match="no fp8 tensor cores"):
        sm80.cuda_source("bfloat16+float8_e4m3fn+mma", 64)


# ----------------------------------------------------------------------- packed and paged
@pytest.mark.parametrize("backend", ["cpu", "sm80"])
def test_varlen_with_fp8_k_and_v(backend: str) -> None:
    """A packed batch of ragged sequences (0 and 1 queries included), factors per packed key
    row and head [total_k, Hkv], against the float64 reference per sequence."""
    case = CASES["alibi"]
    shape = replace(case.shape, D=40)
    lens_q, lens_k = packed_lengths(shape)
    gen = torch.Generator().manual_seed(11)
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    q = torch.randn(sum(lens_q), shape.H, shape.D, generator=gen).to(dtype)
    k = torch.randn(sum(lens_k), shape.Hkv, shape.D, generator=gen)
    v = torch.randn(sum(lens_k), shape.Hkv, shape.D, generator=gen)
    k_descale = torch.rand(sum(lens_k), shape.Hkv, generator=gen) * 0.02 + 0.005
    v_descale = torch.rand(1, shape.Hkv, generator=gen) * 0.02 + 0.005
    k8, v8 = quantised(k, k_descale, torch.float8_e5m2), quantised(v, v_descale, torch.float8_e5m2)
    slopes = torch.rand(shape.H, generator=gen)
    kern = kernel("alibi") if backend == "cpu" else emulated("alibi", "sm80")
    out, lse = kern.varlen(
        q,
        k8,
        v8,
        offsets(lens_q),
        offsets(lens_k),
        return_lse=True,
        k_descale=k_descale,
        v_descale=v_descale,
        slopes=slopes,
    )
    ref_out, ref_lse = per_sequence_reference(
        case.reference,
        q.double(),
        dequantised(k8, k_descale, dtype),
        dequantised(v8, v_descale, dtype),
        {"slopes": slopes.double()},
        lens_q,
        lens_k,
    )
    tol = FWD_TOL if backend == "cpu" else 2e-2
    assert _error(out, ref_out) <= tol and _error(lse, ref_lse) <= max(tol / 10, FWD_TOL)


@pytest.mark.parametrize(
    ("backend", "page_size", "queries"),
    [("cpu", 16, 1), ("cpu", 32, 5), ("cpu", 5, 2), ("sm80", 5, 3)],
)
def test_paged_fp8_cache(backend: str, page_size: int, queries: int) -> None:
    """Decoding and chunked prefill over an fp8 cache with a factor per cached token and head
    ([num_pages, page_size, Hkv], the appended rows' written before the call), pages shuffled,
    fp8 k/v appended in place, GQA 6/2, bottom-right causal; pages of 5 keys on the CPU: key
    tiles that span pages, their rows and factors copied page by page (no key tile divides it)."""
    gen = torch.Generator().manual_seed(5)
    B, H, Hkv, D, Dv, held = 3, 6, 2, 72, 40, [130, 0, 47]
    pages_per_seq = -(-(max(held) + queries) // page_size)
    num_pages = B * pages_per_seq + 2
    fmt = torch.float8_e4m3fn
    k_descale = torch.rand(num_pages, page_size, Hkv, generator=gen) * 0.02 + 0.005
    v_descale = torch.rand(num_pages, page_size, Hkv, generator=gen) * 0.02 + 0.005
    k_cache = quantised(torch.randn(num_pages, page_size, Hkv, D, generator=gen), k_descale, fmt)
    v_cache = quantised(torch.randn(num_pages, page_size, Hkv, Dv, generator=gen), v_descale, fmt)
    table = torch.randperm(num_pages, generator=gen)[: B * pages_per_seq].view(B, pages_per_seq).int()
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    q = torch.randn(B, queries, H, D, generator=gen).to(dtype)
    k_new = torch.randn(B, queries, Hkv, D, generator=gen).to(fmt)
    v_new = torch.randn(B, queries, Hkv, Dv, generator=gen).to(fmt)
    before = k_cache.clone(), v_cache.clone()
    kern = (
        attncc.compile(BOTTOM_RIGHT_CAUSAL)
        if backend == "cpu"
        else attncc.compile(BOTTOM_RIGHT_CAUSAL, target="sm80", emulate=True)
    )
    out, lse = kern.paged(
        q, k_cache, v_cache, table, torch.tensor(held), k_new=k_new, v_new=v_new,
        k_descale=k_descale, v_descale=v_descale, return_lse=True,
    )  # fmt: skip
    tol = FWD_TOL if backend == "cpu" else 2e-2
    for b in range(B):
        m = held[b] + queries
        rows = held[b] + torch.arange(queries)
        written = table[b].long()[rows // page_size]
        assert torch.equal(k_cache[written, rows % page_size].view(torch.uint8), k_new[b].view(torch.uint8))
        kv = []
        for cache, new, descale in ((before[0], k_new, k_descale), (before[1], v_new, v_descale)):
            rows_of_b = cache[table[b].long()].flatten(0, 1)[: held[b]]
            factors = descale[table[b].long()].flatten(0, 1)[:m]
            widened = torch.cat([rows_of_b.float(), new[b].float()]) * factors.unsqueeze(-1)
            kv.append(widened.to(dtype).double().transpose(0, 1).repeat_interleave(H // Hkv, 0))
        s = q[b].transpose(0, 1).double() @ kv[0].transpose(1, 2) / math.sqrt(D)
        visible = torch.arange(m).view(1, -1) <= torch.arange(queries).view(-1, 1) + (m - queries)
        s = s.masked_fill(~visible, -math.inf)
        assert _error(out[b].transpose(0, 1), torch.softmax(s, -1).nan_to_num() @ kv[1]) <= tol, b
        assert _error(lse[b].transpose(0, 1), torch.logsumexp(s, -1)) <= max(tol / 10, FWD_TOL), b


# ----------------------------------------------------------------------- bad input
def _operands(fmt: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.randn(1, 2, 5, 16), torch.randn(1, 1, 7, 16).to(fmt), torch.randn(1, 1, 7, 16).to(fmt)


def test_the_reference_dequantises_fp8_operands_and_factors_are_read_by_value() -> None:
    """`Kernel.reference` (what `attncc check` compares with) reads fp8 k and v times their
    factors, as the kernels do, against causal attention written here in float64; a factor
    given as a negative-bit view (`torch._neg_view`) is read by its value (a review's mutants
    dropped each: the reference 2.25 off, the view's sign 9.0)."""
    kern = kernel("causal")
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 17, 32, generator=gen)
    k8, v8 = (torch.randn(1, 2, 17, 32, generator=gen).to(torch.float8_e4m3fn) for _ in range(2))
    k_descale, v_descale = torch.full((1, 2, 1), 0.3), torch.full((1, 2, 1), 2.0)
    s = q.double() @ (k8.double() * 0.3).transpose(-1, -2) / math.sqrt(32)
    s = s.masked_fill(~torch.ones(17, 17, dtype=torch.bool).tril(), -math.inf)
    want = torch.softmax(s, -1) @ (v8.double() * 2.0)
    with torch.no_grad():
        out = kern(q, k8, v8, k_descale=k_descale, v_descale=v_descale)
        reference, _ = kern.reference(q, k8, v8, k_descale=k_descale, v_descale=v_descale)
        negated = kern(q, k8, v8, k_descale=k_descale, v_descale=torch._neg_view(torch.full((1, 2, 1), -2.0)))
    assert (out.double() - want).abs().max() < 1e-5 and (reference - want).abs().max() < 1e-5
    assert torch.equal(negated, out)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q.requires_grad_(), k, v, {}), "fp8 K/V calls are forward only"),
        (lambda q, k, v: (q, k, v.float(), {}), "k, v: fp8 K/V take one dtype for both"),
        (lambda q, k, v: (q, k, v.to(torch.float8_e5m2), {}), "k, v: fp8 K/V take one dtype for both"),
        (lambda q, k, v: (q.double(), k, v, {}), "q: with fp8 k and v, expected dtype float32, bfloat16 or float16"),
        (
            lambda q, k, v: (q, k, v, {"k_descale": torch.ones(1, 1, 6)}),
            "k_descale: expected a shape broadcastable to [1, 1, 7]",
        ),
        (lambda q, k, v: (q, k, v, {"v_descale": torch.ones(2)}), "v_descale: expected a shape broadcastable"),
        (lambda q, k, v: (q, k, v, {"k_descale": torch.ones(7, dtype=torch.int32)}), "k_descale: expected a float32"),
        (lambda q, k, v: (q, k, v, {"k_descale": math.nan}), "k_descale: expected a finite number"),
        (
            lambda q, k, v: (q, k.float(), v.float(), {"k_descale": 2.0}),
            "k_descale: descale factors go with fp8 k and v",
        ),
    ],
)
def test_bad_fp8_calls_are_named(change, message: str) -> None:
    q, k, v, extra = change(*_operands())
    with pytest.raises(InputError) as error:
        kernel("causal")(q, k, v, **extra)
    assert message in str(error.value)


def test_a_padded_calls_factor_of_one_or_two_dims_never_broadcasts_over_the_keys() -> None:
    """[Hkv] (packed and paged calls' per kv head) and FlashAttention 3's per-sequence [B, Hkv]
    broadcast right-aligned over a padded call's [B, Hkv, M]: where M equalled Hkv they were
    taken as a factor per token, silently (an error at every other M). Refused at every M;
    [B, Hkv, 1] is the per-sequence form and matches the dequantised operands."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 3, 16, generator=generator)
    k, v = (torch.randn(2, 4, 4, 16, generator=generator).to(torch.float8_e4m3fn) for _ in range(2))
    factors = torch.tensor([0.1, 1.0, 2.0, 4.0])
    kern = kernel("causal")
    with pytest.raises(InputError, match=r"k_descale: expected a shape broadcastable to \[2, 4, 4\].*got \(4,\)"):
        kern(q, k, v, k_descale=factors)
    with pytest.raises(InputError, match=r"per sequence \[B, Hkv\] is \[B, Hkv, 1\] in padded calls.*got \(2, 4\)"):
        kern(q, k, v, v_descale=factors.expand(2, 4))
    per_sequence = factors.expand(2, 4).unsqueeze(-1)
    got = kern(q, k, v, k_descale=per_sequence, v_descale=per_sequence)
    scaled = [t.float() * per_sequence.unsqueeze(-1) for t in (k, v)]
    torch.testing.assert_close(got, kern(q, *scaled), atol=2e-6, rtol=2e-6)


def test_a_packed_calls_factor_per_token_is_never_read_per_sequence() -> None:
    """With as many keys as sequences, [total_k, Hkv] is also FlashAttention 3's per-sequence
    [B, Hkv]: it was taken per token, silently. Refused unless every sequence has one key (the
    meanings agree); k's shape with a head dim of 1 is per token in every layout."""
    generator = torch.Generator().manual_seed(1)
    kern = kernel("vanilla")
    q = torch.randn(3, 2, 16, generator=generator)
    k, v = (torch.randn(3, 2, 16, generator=generator).to(torch.float8_e4m3fn) for _ in range(2))
    factors = torch.tensor([[1.0, 2.0], [4.0, 4.0], [0.25, 0.5]])
    with pytest.raises(InputError, match=r"k_descale: \[3, 2\] is a factor per token .* per-sequence shape \[B, Hkv\]"):
        kern.varlen(q, k, v, offsets([1, 1, 1]), offsets([2, 1, 0]), k_descale=factors)
    per_token = kern.varlen(
        q, k, v, offsets([1, 1, 1]), offsets([2, 1, 0]), k_descale=factors[..., None], v_descale=factors[..., None]
    )
    widened = [t.float() * factors[..., None] for t in (k, v)]
    torch.testing.assert_close(
        per_token, kern.varlen(q, *widened, offsets([1, 1, 1]), offsets([2, 1, 0])), atol=2e-6, rtol=2e-6
    )
    one_key_each = kern.varlen(q, k, v, offsets([1, 1, 1]), offsets([1, 1, 1]), k_descale=factors, v_descale=factors)
    torch.testing.assert_close(
        one_key_each, kern.varlen(q, *widened, offsets([1, 1, 1]), offsets([1, 1, 1])), atol=2e-6, rtol=2e-6
    )
    padded_q = torch.randn(2, 2, 3, 16, generator=generator)
    padded_k, padded_v = (torch.randn(2, 2, 5, 16, generator=generator).to(torch.float8_e4m3fn) for _ in range(2))
    per_row = torch.rand(2, 2, 5, generator=generator) + 0.5
    # [Hkv, 1, 1] is per sequence of [B, Hkv, M] and per kv head of k: refused where B = Hkv (it was per sequence)
    with pytest.raises(InputError, match=r"k_descale: \[2, 1, 1\] is a factor per sequence .* B = Hkv = 2"):
        kern(padded_q, padded_k, padded_v, k_descale=per_row[:, :1, :1])
    per_head = per_row[:1, :, :1, None]  # [1, Hkv, 1, 1]: k's dims
    torch.testing.assert_close(
        kern(padded_q, padded_k, padded_v, k_descale=per_head, v_descale=per_head),
        kern(padded_q, *(t.float() * per_head for t in (padded_k, padded_v))),
        atol=2e-6,
        rtol=2e-6,
    )
    torch.testing.assert_close(
        kern(padded_q, padded_k, padded_v, k_descale=per_row[..., None], v_descale=per_row[..., None]),
        kern(padded_q, padded_k, padded_v, k_descale=per_row, v_descale=per_row),
    )


def test_a_padded_calls_per_kv_head_factor_is_refused_where_packed_and_paged_calls_read_it_otherwise() -> None:
    """[Hkv, 1] (a padded call's per kv head) is a packed call's per token [total_k, 1], and
    [1, Hkv, 1, 1] a paged call's per slot of each page [1, page_size, 1]: where total_k, or
    page_size, equalled Hkv they were taken so, silently (2.7 off). Refused there; the
    unambiguous forms ([Hkv] per kv head) match the dequantised operands."""
    kern = kernel("vanilla")
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 16, generator=generator)
    k, v = (torch.randn(4, 4, 16, generator=generator).to(torch.float8_e4m3fn) for _ in range(2))
    per_head = torch.tensor([[0.25], [1.0], [4.0], [16.0]])
    with pytest.raises(InputError, match=r"k_descale: \[4, 1\] is a factor per token .* total_k = Hkv = 4"):
        kern.varlen(q, k, v, offsets([2]), offsets([4]), k_descale=per_head)
    torch.testing.assert_close(
        kern.varlen(q, k, v, offsets([2]), offsets([4]), k_descale=per_head.view(4)),
        kern.varlen(q, k.float() * per_head.view(1, 4, 1), v.float(), offsets([2]), offsets([4])),
        atol=2e-6,
        rtol=2e-6,
    )
    k_cache, v_cache = (torch.randn(3, 4, 4, 16, generator=generator).to(torch.float8_e4m3fn) for _ in range(2))
    table, held, q1 = torch.tensor([[2, 0, 1]], dtype=torch.int32), torch.tensor([10]), q[:1, None]
    with pytest.raises(InputError, match=r"k_descale: \[1, 4, 1\] is a factor per slot of each page .* = Hkv = 4"):
        kern.paged(q1, k_cache, v_cache, table, held, k_descale=per_head.view(1, 4, 1, 1))
    torch.testing.assert_close(
        kern.paged(q1, k_cache, v_cache, table, held, k_descale=per_head.view(4)),
        kern.paged(q1, k_cache.float() * per_head.view(1, 1, 4, 1), v_cache.float(), table, held),
        atol=2e-6,
        rtol=2e-6,
    )


def test_bad_fp8_paged_and_varlen_calls_are_named() -> None:
    kern = attncc.compile(BOTTOM_RIGHT_CAUSAL)
    k_cache = torch.randn(4, 16, 1, 16).to(torch.float8_e4m3fn)
    table, held = torch.arange(4).view(1, 4).int(), torch.tensor([20])
    q = torch.randn(1, 1, 2, 16)
    with pytest.raises(InputError, match=r"k_new: expected torch.float8_e4m3fn \(as the cache\)"):
        kern.paged(
            q, k_cache, k_cache.clone(), table, held, k_new=torch.randn(1, 1, 1, 16), v_new=torch.randn(1, 1, 1, 16)
        )
    with pytest.raises(InputError, match=r"k_descale: expected a shape broadcastable to \[4, 16, 1\]"):
        kern.paged(q, k_cache, k_cache.clone(), table, held, k_descale=torch.ones(4, 1, 16))
    # FlashAttention 3's per-sequence [B, Hkv] would broadcast as a factor per cache slot
    with pytest.raises(InputError, match=r"per cache row \[num_pages, page_size, Hkv\].*got \(16, 1\)"):
        kern.paged(q, k_cache, k_cache.clone(), table, held, k_descale=torch.ones(16, 1))
    with pytest.raises(InputError, match="k_descale: the fp8 kernels are forward only, and this factor requires grad"):
        kern.paged(q, k_cache, k_cache.clone(), table, held, k_descale=torch.tensor(0.5, requires_grad=True))
    with pytest.raises(InputError, match="q, k_cache, v_cache must have one dtype"):
        kern.paged(q, k_cache.float(), k_cache.bfloat16(), table, held)
    packed = torch.randn(7, 1, 16)
    with pytest.raises(InputError, match="q, k, v must have one dtype"):
        kern.varlen(torch.randn(5, 2, 16), packed, packed.bfloat16(), offsets([5]), offsets([7]))


# ----------------------------------------------------------------------- IO report
def test_io_report_counts_fp8_and_in_kernel_rope_bytes() -> None:
    """fp8 K/V: the forward's K/V reads at one byte instead of four (dense causal tiles at
    N = M = 1024, D = 64); in-kernel rope: q and k read and written once more forward, dq and dk
    turned back once more backward, were they rotated in torch; nothing saved without rope."""
    rope = attncc.compile(
        "attention r\nq = rope(q, theta=10000)\nk = rope(k, theta=10000)\ns = q @ k.T * scale\np = softmax(s)\no = p @ v\noutput o\n"
    )
    for kern, rotated in ((rope, 2), (kernel("vanilla"), 0)):
        op = kern.op
        assert op.cost is not None
        report = op.cost.predict(1, 2, 1024, 1024, 64, 4, 64, 64)
        key_bytes = 2 * (1024 // 64) ** 2 * 64 * (64 + 64)  # B H x visible tiles x Bc x (D + Dv)
        assert report.fused_fwd_bytes - report.fp8_fwd_bytes == key_bytes * 3
        assert report.rope_saved_bytes == 2 * 4 * rotated * 1024 * 64 * 4
        assert ("in-kernel rope saves" in report.describe()) == bool(rotated)


@pytest.mark.parametrize(
    ("backend", "dtype"), [("cpu", torch.float32), ("cpu", torch.bfloat16), ("sm80", torch.bfloat16)]
)
def test_fp8_keys_with_rope(backend: str, dtype: torch.dtype) -> None:
    """rope(k) of fp8 keys rotates the dequantised rows (the CPU kernels widen, scale, then
    rotate as they load; the CUDA kernels widen and scale into shared memory, then rotate the
    tile there): the same as the kernel on the dequantised k and v, whose rope test_rope.py
    checks by hand."""
    program = (
        "attention rope_fp8\nq = rope(q, theta=10000, dims=32, interleaved=1)\nk = rope(k, theta=500, first=8)\n"
        "s = q @ k.T * scale\nmask j <= i\np = softmax(s)\no = p @ v\noutput o\n"
    )
    kern = attncc.compile(program) if backend == "cpu" else attncc.compile(program, target=backend, emulate=True)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 70, 48, generator=gen).to(dtype)
    k_descale = torch.rand(2, 2, 70, generator=gen) * 0.02 + 0.005
    k8 = quantised(torch.randn(2, 2, 70, 48, generator=gen), k_descale, torch.float8_e4m3fn)
    v8 = (torch.randn(2, 2, 70, 40, generator=gen) * 50).to(torch.float8_e4m3fn)
    out = kern(q, k8, v8, k_descale=k_descale, v_descale=0.02)
    plain = kern(q, dequantised(k8, k_descale, dtype).to(dtype), dequantised(v8, 0.02, dtype).to(dtype))
    assert _error(out, plain) <= (FWD_TOL if dtype == torch.float32 else 1e-2)


def test_fp8_kv_cache_example_runs() -> None:
    """examples/fp8_kv_cache.py: the fp8 cache decodes as the bf16 cache of the same values."""
    import runpy

    example = runpy.run_path(str(ROOT / "examples" / "fp8_kv_cache.py"))
    assert example["main"](batch=2, held=70, heads=4, kv_heads=2, head_dim=32) <= 1e-2
