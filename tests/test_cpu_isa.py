"""CPU kernel ISAs: the level chosen from the machine's features and vendor, forced levels, the
micro-kernel's register blocks, K/V panel batches, and golden tests on every level this machine
runs (ATTNCC_CPU_ISA forces each one besides the best)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import attncc
import attncc.codegen.cpu as cpu_codegen
from attncc.errors import AttnccError
from attncc.passes.tiling import CPU_AMX_BACKWARD_BLOCK, choose_micro_kernel
from attncc.runtime.build import build_library, load_library
from attncc.runtime.check import check
from attncc.runtime.inputs import Shape, adapt, make_inputs
from attncc.runtime.kernel import PackedSequences
from attncc.targets import CPU_ISAS, ISA_ENV, best_cpu_isa, cpu, cpu_features, runs_cpu_isa, select_cpu_isa
from tests.conftest import ROOT, ROOT_FIRST_PYTHONPATH
from tests.test_edge_programs import check_huge_fill_gradients, masked_attention

ZEN3 = frozenset("fma avx f16c avx2 bmi2 sse4_2".split())
ZEN4 = ZEN3 | frozenset("avx512f avx512bw avx512dq avx512vl avx512_bf16".split())
SAPPHIRE_RAPIDS = ZEN4 | frozenset("avx512_fp16 amx_bf16 amx_tile amx_int8".split())
BEST_HERE = best_cpu_isa(cpu_features())
LEVELS_HERE = [name for name in CPU_ISAS if runs_cpu_isa(name, cpu_features())]  # the best and any slower


def test_best_isa_from_the_machine_features() -> None:
    amd, intel = "AuthenticAMD", "GenuineIntel"
    assert best_cpu_isa(SAPPHIRE_RAPIDS, "x86_64", intel) == "amx"
    assert best_cpu_isa(ZEN4, "x86_64", amd) == "avx512bf16"
    assert best_cpu_isa(ZEN4 - {"avx512_bf16"}, "x86_64", amd) == "avx512"
    # Intel's vdpbf16ps runs at half its FMAs' rate: without AMX (hidden by a VM) bf16 is widened
    assert best_cpu_isa(SAPPHIRE_RAPIDS - {"amx_tile"}, "x86_64", intel) == "avx512"
    assert best_cpu_isa(SAPPHIRE_RAPIDS - {"amx_tile"}, "x86_64", amd) == "avx512bf16"
    assert best_cpu_isa(SAPPHIRE_RAPIDS - {"amx_tile"}, "x86_64", "") == "avx512bf16"  # unknown: as AMD
    assert best_cpu_isa(ZEN3, "x86_64", amd) == "avx2"
    assert best_cpu_isa(ZEN3 - {"fma"}, "x86_64", amd) == "generic"  # AVX2 without FMA: no avx2 kernel
    assert best_cpu_isa(frozenset(), "x86_64", amd) == "generic"
    assert best_cpu_isa(SAPPHIRE_RAPIDS, "aarch64", intel) == "generic"


def test_forcing_any_level_the_machine_runs() -> None:
    assert select_cpu_isa(ZEN4, None, "AuthenticAMD") == "avx512bf16"
    assert select_cpu_isa(SAPPHIRE_RAPIDS, "avx512", "GenuineIntel") == "avx512"
    assert select_cpu_isa(ZEN4, "avx2", "AuthenticAMD") == "avx2"
    assert select_cpu_isa(ZEN4, "generic", "AuthenticAMD") == "generic"
    # a level slower than the best but run by the machine: forced to test or measure it
    assert select_cpu_isa(ZEN4 | {"avx512_fp16"}, None, "GenuineIntel") == "avx512"
    assert select_cpu_isa(ZEN4 | {"avx512_fp16"}, "avx512bf16", "GenuineIntel") == "avx512bf16"
    with pytest.raises(
        AttnccError,
        match=r"ATTNCC_CPU_ISA='avx512': this machine lacks avx512bw, avx512dq, avx512f, avx512vl; "
        r"its best CPU kernel ISA is avx2",
    ):
        select_cpu_isa(ZEN3, "avx512", "AuthenticAMD")
    with pytest.raises(
        AttnccError, match=r"'amx': this machine lacks amx_bf16, amx_tile; its best CPU kernel ISA is avx512bf16"
    ):
        select_cpu_isa(ZEN4, "amx", "AuthenticAMD")
    with pytest.raises(AttnccError, match=r"'sse9': expected one of amx, avx512bf16, avx512, avx2, generic"):
        select_cpu_isa(ZEN3, "sse9", "AuthenticAMD")


INTEL_CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 207
flags\t\t: fpu sse2 avx2 fma f16c bmi2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_fp16
vmx flags\t: vnmi ept
"""


def test_the_vendor_and_flags_read_from_cpuinfo_choose_the_level(monkeypatch) -> None:
    """/proc/cpuinfo's vendor_id and flags, as Linux writes them (tabs before the colon, a `vmx
    flags` line after `flags`): an Intel machine without AMX widens bf16 (avx512), the same flags
    from AMD multiply on vdpbf16ps."""
    import attncc.targets as targets

    assert targets.cpu_vendor(INTEL_CPUINFO) == "GenuineIntel"
    features = targets.cpu_features(INTEL_CPUINFO)
    assert {"avx512_bf16", "avx512_fp16"} <= features and "ept" not in features
    assert best_cpu_isa(features, "x86_64", targets.cpu_vendor(INTEL_CPUINFO)) == "avx512"
    amd = INTEL_CPUINFO.replace("GenuineIntel", "AuthenticAMD")
    assert best_cpu_isa(targets.cpu_features(amd), "x86_64", targets.cpu_vendor(amd)) == "avx512bf16"
    monkeypatch.setattr(targets.platform, "machine", lambda: "aarch64")
    with pytest.raises(AttnccError, match=r"'avx2': this machine is not x86-64; its only CPU kernel ISA is generic"):
        select_cpu_isa(features, "avx2", "GenuineIntel")
    assert select_cpu_isa(features, "generic", "GenuineIntel") == "generic"


def test_a_kernel_refused_amx_names_the_level_to_force(monkeypatch) -> None:
    """A library built for AMX whose process Linux refused the tile state: the error names
    ATTNCC_CPU_ISA's level without AMX, by vendor (widened bf16 on Intel)."""
    import attncc.targets as targets
    from attncc.runtime.kernel import AMX_REFUSED, _check_status

    monkeypatch.setattr(targets, "cpu_features", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setattr(targets.platform, "machine", lambda: "x86_64")
    for vendor, level in (("GenuineIntel", "avx512"), ("AuthenticAMD", "avx512bf16")):
        monkeypatch.setattr(targets, "cpu_vendor", lambda vendor=vendor: vendor)
        with pytest.raises(
            AttnccError, match=f"refused this process the AMX tile state .*; set ATTNCC_CPU_ISA={level} to"
        ):
            _check_status(AMX_REFUSED, "attncc_forward", "causal")


def test_the_default_kernel_runs_on_the_best_level_the_machine_has(monkeypatch) -> None:
    """The chosen path is the machine's best: in the target, the generated source and the
    compiler command that built the library."""
    monkeypatch.delenv(ISA_ENV, raising=False)
    best = BEST_HERE
    assert cpu().isa == best and cpu().vector_bytes == CPU_ISAS[best].vector_bytes
    kern = attncc.compile(ROOT / "examples" / "causal.attn")
    source = kern.source("float32")
    assert f"#define ATTNCC_VECTOR_BYTES {CPU_ISAS[best].vector_bytes}\n" in source
    assert f"ISA {best} ({8 * CPU_ISAS[best].vector_bytes}-bit vectors" in kern.op.tiling.describe(64)
    flags = kern.op.tiling.micro_kernel.compile_flags
    library = build_library(source, f"{kern.name}-float32", isa_flags=flags)
    assert " ".join(flags) in (library.parent / "build.ninja").read_text()
    # bf16 kernels multiply on the machine's bf16 unit (AMX tiles, vdpbf16ps) where it has one,
    # fp16 kernels on AMX tiles (as bf16 terms)
    products = {"amx": 1, "dpbf16": 2}.get(CPU_ISAS[best].bf16_products, 0)
    assert "#define ATTNCC_BF16_PRODUCTS 0\n" in source
    assert f"#define ATTNCC_BF16_PRODUCTS {products}\n" in kern.source("bfloat16")
    assert f"#define ATTNCC_BF16_PRODUCTS {1 if best == 'amx' else 0}\n" in kern.source("float16")
    if best == "amx":
        assert "-mamx-bf16" in flags and "bf16 products on AMX tiles" in kern.op.tiling.describe(64)


def test_amx_refused_by_the_os_falls_back_to_dot_products(monkeypatch) -> None:
    """Linux may refuse the AMX tile state (arch_prctl): the target falls back a level, with a
    one-line warning, instead of building kernels that would fault."""
    import attncc.targets as targets

    monkeypatch.delenv(ISA_ENV, raising=False)
    monkeypatch.setattr(targets, "cpu_features", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setattr(targets, "amx_permitted", lambda: False)
    monkeypatch.setattr(targets.platform, "machine", lambda: "x86_64")
    for vendor, fallback in (("AuthenticAMD", "avx512bf16"), ("GenuineIntel", "avx512")):
        monkeypatch.setattr(targets, "cpu_vendor", lambda vendor=vendor: vendor)
        with pytest.warns(UserWarning, match=f"refused this process AMX tile data .*; CPU kernels use {fallback}$"):
            assert targets.cpu().isa == fallback
    monkeypatch.setattr(targets, "amx_permitted", lambda: True)
    assert targets.cpu().isa == "amx"


@pytest.mark.parametrize("isa", [name for name in CPU_ISAS if name not in LEVELS_HERE] or ["none"])
def test_levels_this_machine_cannot_run_still_build(isa: str, monkeypatch) -> None:
    """The kernels of a level above this machine's (AMX on a machine without it) are generated
    and compiled, not loaded (they would fault), so a template change that breaks a level fails
    here rather than first on a machine that has it: fp32, bf16, fp16 and fp8 K/V sources,
    forward and backward (one translation unit), for a program with sinks, a sliding window
    and the sequence's own lengths and one with a learnable runtime tensor."""
    import attncc.targets as targets

    if isa == "none":
        pytest.skip("this machine runs every CPU level: each is built and run by the golden tests")
    monkeypatch.setenv(ISA_ENV, isa)
    monkeypatch.setattr(targets, "cpu_features", lambda: CPU_ISAS[isa].requires)
    monkeypatch.setattr(targets, "amx_permitted", lambda: True)
    monkeypatch.setattr(targets.platform, "machine", lambda: "x86_64")
    for name in ("gpt_oss", "alibi"):
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn")
        micro_kernel = kern.op.tiling.micro_kernel
        assert micro_kernel.isa == isa
        for dtype in ("float32", "bfloat16", "float16", "bfloat16+float8_e4m3fn"):
            source = kern.source(dtype)
            assert f"#define ATTNCC_VECTOR_BYTES {CPU_ISAS[isa].vector_bytes}\n" in source
            library = build_library(
                source, f"{kern.name}-{dtype}-{isa}-build-only", isa_flags=micro_kernel.compile_flags
            )
            assert library.exists()


def test_micro_kernel_blocks_follow_the_register_count() -> None:
    """16 registers (AVX2, SSE): 12 accumulators, 2 B vectors and a broadcast, 6 rows x 2 vectors;
    32 registers (AVX-512): 24 accumulators as 6 x 4."""
    for name, rows, vecs in (("avx2", 6, 2), ("generic", 6, 2), ("avx512", 6, 4), ("avx512bf16", 6, 4), ("amx", 6, 4)):
        isa = CPU_ISAS[name]
        target = replace(cpu(), isa=name, vector_bytes=isa.vector_bytes, vector_registers=isa.vector_registers)
        block = choose_micro_kernel(target)
        assert (block.rows, block.vecs, block.vector_bytes) == (rows, vecs, isa.vector_bytes)
        assert block.rows * block.vecs >= 4 * target.fma_ports  # FMA latency x ports in flight


GEMM_HARNESS = """
#define ATTNCC_ACC_T float
#define ATTNCC_STORAGE_T float
#define ATTNCC_VECTOR_BYTES {vector_bytes}
#define ATTNCC_GEMM_ROWS {rows}
#define ATTNCC_GEMM_VECS {vecs}
#include "attncc/cpu/primitives.h"
using namespace attncc;
extern "C" int lanes() {{ return VL; }}
extern "C" void matmul(float* c, const float* a, const float* b, int r, int n, int k, int accumulate, int trans_a) {{
  const int64_t lda = trans_a ? r : k;
  if (accumulate) trans_a ? gemm<true, true>(c, n, a, lda, b, n, r, n, k) : gemm<true>(c, n, a, lda, b, n, r, n, k);
  else trans_a ? gemm<false, true>(c, n, a, lda, b, n, r, n, k) : gemm<false>(c, n, a, lda, b, n, r, n, k);
}}
// B packed into gemm's strips first, from its rows (b: k x n) or from B^T's rows (b: n x k, as the
// forward packs K^T from K); returns the strip width
extern "C" int matmul_strips(float* c, const float* a, const float* b, int r, int n, int k, int accumulate,
                             int trans_a, int from_transpose) {{
  const int64_t lda = trans_a ? r : k, strip = gemm_strip(n);
  Scratch strips(int64_t(k) * n);
  if (from_transpose) load_tile_transposed_strips(strips.data, b, k, 1, n, k, n, k);
  else load_tile_strips(strips.data, b, n, 1, k, n, k, n);
  const float* s = strips.data;
  if (accumulate) trans_a ? gemm<true, true>(c, n, a, lda, s, strip, r, n, k, strip) : gemm<true>(c, n, a, lda, s, strip, r, n, k, strip);
  else trans_a ? gemm<false, true>(c, n, a, lda, s, strip, r, n, k, strip) : gemm<false>(c, n, a, lda, s, strip, r, n, k, strip);
  return int(strip);
}}
"""


@pytest.mark.parametrize("vector_bytes,rows,vecs", [(16, 6, 2), (32, 6, 2), (32, 3, 4), (64, 6, 4), (64, 1, 1)])
def test_gemm_register_blocks_with_row_and_column_tails(vector_bytes: int, rows: int, vecs: int) -> None:
    """Every block shape the planner can pick, on row counts with every tail and column counts
    that leave single vectors, plain and A-transposed, overwriting and accumulating. (Vectors
    wider than the machine's are split by the compiler: slow, still exact.)"""
    source = GEMM_HARNESS.format(vector_bytes=vector_bytes, rows=rows, vecs=vecs)
    lib = load_library(build_library(source, f"gemm-{vector_bytes}-{rows}x{vecs}"))
    lanes = lib.lanes()
    assert lanes == vector_bytes // 4
    gen = torch.Generator().manual_seed(0)
    for r in (1, 2, 3, 4, 7, 8, 13, 64):
        for n in (lanes, 3 * lanes, 4 * vecs * lanes + lanes):
            for trans_a in (0, 1):
                k = 37
                a = torch.randn(k, r, generator=gen) if trans_a else torch.randn(r, k, generator=gen)
                b, c = torch.randn(k, n, generator=gen), torch.randn(r, n, generator=gen)
                want = (a.t() if trans_a else a).double() @ b.double()
                for accumulate in (0, 1):
                    out = c.clone()
                    ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (out, a, b)]
                    lib.matmul(*ptrs, r, n, k, accumulate, trans_a)
                    expected = want + c.double() if accumulate else want
                    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("vector_bytes,rows,vecs", [(32, 6, 2), (32, 3, 4), (64, 6, 4)])
def test_gemm_on_b_in_strips(vector_bytes: int, rows: int, vecs: int) -> None:
    """The forward's K^T and V panels in strips one register block wide (packed from B's rows and
    from B^T's, as K^T from K), whole strips and partial ones, against float64; where the columns
    are not whole register blocks the packing keeps one strip (rows as usual)."""
    source = GEMM_HARNESS.format(vector_bytes=vector_bytes, rows=rows, vecs=vecs)
    lib = load_library(build_library(source, f"gemm-{vector_bytes}-{rows}x{vecs}"))
    lanes, block = lib.lanes(), vecs * lib.lanes()
    gen = torch.Generator().manual_seed(1)
    for r in (1, 7, 13, 64):
        for n, strip in ((block, block), (3 * block, block), (block + lanes, block + lanes)):
            for k in (1, 37, 64):
                for trans_a in (0, 1):
                    a = torch.randn(k, r, generator=gen) if trans_a else torch.randn(r, k, generator=gen)
                    b, c = torch.randn(k, n, generator=gen), torch.randn(r, n, generator=gen)
                    want = (a.t() if trans_a else a).double() @ b.double()
                    for from_transpose, source_b in ((0, b), (1, b.t().contiguous())):
                        for accumulate in (0, 1):
                            out = c.clone()
                            ptrs = [ctypes.c_void_p(t.data_ptr()) for t in (out, a, source_b)]
                            assert lib.matmul_strips(*ptrs, r, n, k, accumulate, trans_a, from_transpose) == strip
                            expected = want + c.double() if accumulate else want
                            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


# Odd shapes on each level below the machine's best (the best level is what every other test
# runs on). A level changes the primitives every variant calls (vector width, exp, row max, the
# gemm register block), not the variant code, so the examples are one per kind of caller: a mask
# (causal), a score map with a learnable input (alibi), runtime-tensor reads (document), dropout
# (gpt2) and tanh (softcap); fp32 at N = 1 and at tails with several key tiles per row and GQA;
# a score map, a runtime mask and plain causal also in bf16/fp16 and at D = 16 and 256. Two
# shapes give v a head dim of its own (Dv below and above D: the V panels, O, dO and dV tiles).
ISA_EXAMPLES = ("causal", "alibi", "document", "gpt2", "softcap")
# (52 query rows per kv head: by rows on K^T tiles from 8 x 8 / 16 x 16 transposes with edges)
ISA_SHAPES = (Shape(1, 2, 1, 1, 1, 16), Shape(2, 4, 2, 67, 201, 80, Dv=48), Shape(1, 8, 2, 13, 150, 40))
ISA_LOW_PRECISION = ("alibi", "causal", "document")
ISA_LOW_PRECISION_SHAPES = (
    Shape(2, 4, 2, 150, 300, 48, Dv=80),
    Shape(1, 1, 1, 40, 70, 256),
    Shape(1, 2, 2, 3, 90, 16),
    Shape(1, 4, 1, 20, 70, 576, Dv=512),  # DeepSeek's absorbed MLA (one kv head for the query heads)
)


BF16_HARNESS = """
#define ATTNCC_ACC_T float
#define ATTNCC_STORAGE_T attncc::bf16_t
#define ATTNCC_VECTOR_BYTES 64
#define ATTNCC_GEMM_ROWS 6
#define ATTNCC_GEMM_VECS 4
#define ATTNCC_BF16_PRODUCTS {products}
#include "attncc/cpu/primitives.h"
using namespace attncc;
extern "C" int matmul(float* c, const uint16_t* a, const uint16_t* b_pairs, int r, int n, int k, int accumulate) {{
#if ATTNCC_BF16_PRODUCTS == 1
  if (!amx_permitted()) return 1;
#endif
  const KernelThread kernel_thread;  // (the tile configuration)
  if (accumulate) gemm_bf16<true>(c, n, a, k, b_pairs, 2 * n, r, n, k);
  else gemm_bf16<false>(c, n, a, k, b_pairs, 2 * n, r, n, k);
  return 0;
}}
// the backward's products: C (+)= A^T B with A [k x r] pair-packed by its rows (P, dS), on vdpbf16ps
extern "C" int matmul_transposed_a(float* c, const uint16_t* a_pairs, const uint16_t* b_pairs, int r, int n, int k) {{
  gemm_dpbf16<true, true>(c, n, a_pairs, 2 * r, b_pairs, 2 * n, r, n, k);
  return 0;
}}
"""
BF16_LEVELS = [name for name, isa in CPU_ISAS.items() if isa.bf16_products]


def skip_unless_the_machine_runs(isa: str) -> None:
    missing = CPU_ISAS[isa].requires - cpu_features()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}: the {isa} kernels cannot run here")


@pytest.mark.parametrize("isa", BF16_LEVELS)
def test_bf16_tile_products_against_float64(isa: str) -> None:
    """gemm_bf16 on AMX tiles and by vdpbf16ps, and the backward's gemm_dpbf16 with A^T: every row/column block edge (16-row and
    16-column remainders of the 32 x 32 AMX block and of the 6 x 4 register block), K of one and
    several steps, overwriting and accumulating, against the exact product of the bf16 inputs.
    B is pair-packed here from its definition (B[k][n] -> Bp[k // 2][2 n + k % 2])."""
    skip_unless_the_machine_runs(isa)
    products = {"amx": 1, "dpbf16": 2}[CPU_ISAS[isa].bf16_products]
    flags = ("-march=" + CPU_ISAS[isa].march, *CPU_ISAS[isa].extra_flags)
    lib = load_library(build_library(BF16_HARNESS.format(products=products), f"gemm-bf16-{isa}", isa_flags=flags))
    gen = torch.Generator().manual_seed(1)
    for r, n, k in ((16, 16, 32), (32, 48, 64), (48, 128, 96), (96, 80, 32)):
        a, b = torch.randn(r, k, generator=gen).bfloat16(), torch.randn(k, n, generator=gen).bfloat16()
        pairs = b.view(k // 2, 2, n).transpose(1, 2).contiguous()  # [k/2][n][2]
        want = a.double() @ b.double()
        for accumulate in (0, 1):
            c = torch.randn(r, n, generator=gen)
            out = c.clone()
            bits = [ctypes.c_void_p(t.data_ptr()) for t in (out, a, pairs)]
            assert lib.matmul(*bits, r, n, k, accumulate) == 0
            expected = want + c.double() if accumulate else want
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)
    # A^T B from A [k x r] pair-packed by rows (r of 1 to 6 rows past the 6-row blocks: tails)
    for r, n, k in ((6, 16, 2), (13, 64, 40), (128, 80, 64)):
        a, b = torch.randn(k, r, generator=gen).bfloat16(), torch.randn(k, n, generator=gen).bfloat16()
        a_pairs = a.view(k // 2, 2, r).transpose(1, 2).contiguous()
        b_pairs = b.view(k // 2, 2, n).transpose(1, 2).contiguous()
        c = torch.randn(r, n, generator=gen)
        out = c.clone()
        assert lib.matmul_transposed_a(*[ctypes.c_void_p(t.data_ptr()) for t in (out, a_pairs, b_pairs)], r, n, k) == 0
        torch.testing.assert_close(out.double(), a.double().T @ b.double() + c.double(), rtol=1e-5, atol=1e-4)


# Every example with bf16 inputs on each bf16-product level (the best level also runs the whole
# golden suite): masks, score maps before the folded scale, runtime tensors, dropout (P rounded
# after the keep bits), tanh; decoding (N = 1, 3), tails, GQA, D from 16 to 256.
# (Decoding as the golden tests decode, Shape(1, 2, 1, 1, 513, 64): at N = 1 with H = 4, Hkv = 2,
# or M <= 37, D = 16, gpt2's bf16 dq is 1.5-2x check()'s floor of 2^-8 at every level, the
# fp32-widened one included, measured before and after the bf16 products.)
BF16_SHAPES = (Shape(1, 2, 1, 1, 513, 64), ISA_SHAPES[1], *ISA_LOW_PRECISION_SHAPES)


@pytest.mark.parametrize("isa", BF16_LEVELS)
def test_examples_with_bf16_products(isa: str, monkeypatch) -> None:
    skip_unless_the_machine_runs(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    for name in ISA_EXAMPLES:
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn")
        assert kern.op.tiling.micro_kernel.bf16_products == CPU_ISAS[isa].bf16_products
        for shape in BF16_SHAPES:
            result = check(kern, adapt(shape, kern), torch.bfloat16)
            assert result.ok, f"{isa} {name} {shape}: {result.describe()}"


def attention_in_float64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), keys j <= i where causal) v in float64, kv heads repeated per group."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    keep = torch.arange(k.shape[2])[None, :] <= torch.arange(q.shape[2])[:, None] if causal else torch.tensor(True)
    return masked_attention(q.double(), k, v, keep)


def test_fp16_forward_on_amx_tiles_keeps_fp16_precision(monkeypatch) -> None:
    """fp16 kernels on the amx level multiply each value as two bf16 terms (hi + lo, exact for
    fp16), three products per tile product: the forward keeps what fp16 inputs hold. Against
    float64 on the same fp16 inputs the error is the output's rounding to fp16; K, V or P rounded
    to bf16 (one term, or a term left out) is 5-40x that. Shapes: a query tile's tail, few
    keys (key tiles fitted to M), head dims that pad to the K step (80) and D = 256, GQA. (On
    avx512bf16 fp16 stays widened: three vdpbf16ps products would be slower than fp32 FMAs.)"""
    skip_unless_the_machine_runs("amx")
    monkeypatch.setenv(ISA_ENV, "avx512bf16")
    assert "#define ATTNCC_BF16_PRODUCTS 0\n" in attncc.compile(ROOT / "examples" / "causal.attn").source("float16")
    monkeypatch.setenv(ISA_ENV, "amx")
    torch.manual_seed(0)
    for name in ("vanilla", "causal"):
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn")
        assert "#define ATTNCC_BF16_PRODUCTS 1\n" in kern.source("float16")
        for B, H, Hkv, N, M, D in ((1, 4, 2, 77, 300, 128), (2, 2, 1, 130, 70, 80), (1, 2, 2, 40, 600, 256)):
            q = torch.randn(B, H, N, D).half()
            k, v = (torch.randn(B, Hkv, M, D).half() for _ in range(2))
            out = kern(q, k, v).double()
            expected = attention_in_float64(q, k, v, causal=name == "causal")
            rounding = expected.half().double().sub(expected).abs()  # the output's own rounding
            excess = (out - expected).abs() - rounding
            limit = 2.0**-12 * expected.abs() + 2.0**-16  # half an fp16 ulp, a floor for zeros
            assert (excess <= limit).all(), f"{name} {(B, H, Hkv, N, M, D)}: excess {excess.max():.2e}"


def test_bf16_backward_takes_its_own_tiles_on_amx_only(monkeypatch) -> None:
    """On AMX a bf16 backward takes CPU_AMX_BACKWARD_BLOCK square tiles (its accumulating
    products have Br or Bc as their K); fp32, fp16 (widened) and the vdpbf16ps level keep the
    fp32 backward's tiles. (Its golden tests: test_golden.py test_both_backward_schedules.)"""
    skip_unless_the_machine_runs("amx")
    for isa in ("amx", "avx512bf16"):
        monkeypatch.setenv(ISA_ENV, isa)
        kern = attncc.compile(ROOT / "examples" / "vanilla.attn")
        for d in (64, 128):
            q = torch.empty(1, 8, 1024, d)
            fp32 = kern.plan(q, q, None, backward=True).tiles
            for dtype in (torch.bfloat16, torch.float16):
                low = q.to(dtype)
                tiles = kern.plan(low, low, None, backward=True).tiles
                square = isa == "amx" and dtype == torch.bfloat16
                expected = (CPU_AMX_BACKWARD_BLOCK,) * 2 if square else (fp32.block_rows, fp32.block_cols)
                assert (tiles.block_rows, tiles.block_cols) == expected, f"{isa} {dtype} d={d}"
            assert (fp32.block_rows, fp32.block_cols) != (CPU_AMX_BACKWARD_BLOCK,) * 2


@pytest.mark.parametrize("isa", LEVELS_HERE)
def test_few_query_rows_per_kv_head_read_k_and_v_by_rows(isa: str, monkeypatch) -> None:
    """The forward reads K and V by rows (TilePlan.reads_by_rows: no panels) below 4 queries and
    up to 64 query rows per kv head (N x group) where it multiplies in fp32, 512 on AVX-512
    levels and 256 on AVX2, up to 8 where its tile products run on AMX, 512 on `vdpbf16ps`;
    never past one query tile's rows, nor for a packed batch's queries. A paged call's key tiles
    are pages of 16 keys where the rows take dot products, not with panels, nor from 48 rows
    per kv head on AVX-512 and AVX2 (K^T tiles for gemm: the plan's keys, copied page by page)
    or 9 with bf16 on `vdpbf16ps` (each key tile packed for the bf16 products; 16 rows, the bf16
    dot blocks' own, keep dot products)."""
    monkeypatch.setenv(ISA_ENV, isa)
    kern = attncc.compile(ROOT / "examples" / "vanilla.attn")
    vector_bytes = CPU_ISAS[isa].vector_bytes
    fp32_rows = {64: 512, 32: 256}.get(vector_bytes, 64)
    unit = CPU_ISAS[isa].bf16_products
    bf16_rows = {"amx": 8, "dpbf16": 512, "": fp32_rows}[unit]
    transposed_from = 48 if vector_bytes >= 32 else None  # (K^T tiles)
    tiles_from = {
        torch.float32: transposed_from,
        torch.bfloat16: {"amx": None, "dpbf16": 9, "": transposed_from}[unit],
    }
    cases = {  # (dtype, N, H, Hkv): by rows
        (torch.float32, 2, 32, 1): True,
        (torch.float32, 16, 8, 2): True,
        (torch.float32, 64, 4, 4): True,
        (torch.float32, 32, 8, 2): fp32_rows >= 128,
        (torch.float32, 64, 32, 8): fp32_rows >= 256,
        (torch.float32, 64, 64, 8): fp32_rows >= 512,
        (torch.float32, 33, 64, 4): False,  # 528 rows
        (torch.bfloat16, 3, 32, 4): True,
        (torch.bfloat16, 2, 12, 2): True,  # 12 rows
        (torch.bfloat16, 8, 4, 4): True,
        (torch.bfloat16, 4, 8, 2): bf16_rows >= 16,
        (torch.bfloat16, 16, 4, 4): bf16_rows >= 16,
        (torch.bfloat16, 9, 8, 4): bf16_rows >= 18,
        (torch.bfloat16, 32, 4, 4): bf16_rows >= 32,
        (torch.bfloat16, 64, 64, 8): bf16_rows >= 512,
    }
    for (dtype, N, H, Hkv), by_rows in cases.items():
        q, k = torch.zeros(2, H, N, 64, dtype=dtype), torch.zeros(2, Hkv, 300, 64, dtype=dtype)
        _, call = kern._forward_call(q, k, None, [], [])
        assert call["by_rows"] == by_rows, f"{isa} {dtype} N={N} H={H} Hkv={Hkv}"
        paged, _ = kern._forward_call(q, k, None, [], [], page_size=16)
        rows = N * H // Hkv
        kept = unit == "dpbf16" and dtype == torch.bfloat16 and rows == 16
        dot_products = by_rows and (kept or not (tiles_from[dtype] and rows >= tiles_from[dtype]))
        assert (paged.tiles.block_cols == 16) == dot_products, f"{isa} {dtype} N={N} H={H} Hkv={Hkv}"
    small = attncc.compile(ROOT / "examples" / "vanilla.attn", tiles=(4, 32))
    for N, by_rows in ((3, True), (5, False)):  # Br = 4
        q = torch.zeros(1, 2, N, 64)
        assert small._forward_call(q, q, None, [], [])[1]["by_rows"] == by_rows
    # a packed batch of short sequences reads by rows too, by its longest (session 54: it packed panels)
    packed = PackedSequences.of([0, 2, 5], [0, 2, 5], torch.device("cpu"))  # sequences of 2 and 3 rows
    q = packed.as_batch(torch.zeros(5, 2, 64), False)
    assert kern._forward_call(q, packed.as_batch(torch.zeros(5, 2, 64), True), None, [], [], lengths=packed.lengths)[1][
        "by_rows"
    ]


# (The bf16-product levels differ from avx512 only in bf16 kernels: the test above runs them.)
LOWER_LEVELS = [name for name in LEVELS_HERE if name != BEST_HERE and not CPU_ISAS[name].bf16_products]


@pytest.mark.parametrize("isa", LEVELS_HERE)
def test_rows_of_huge_fills_get_their_gradients_on_each_level(isa: str, monkeypatch) -> None:
    """The delta pass's lse residuals (tests/test_edge_programs.py) through each level's tile
    products (the scores it recomputes must be the passes' own), fp32 and bf16, both backwards."""
    skip_unless_the_machine_runs(isa)
    monkeypatch.setenv(ISA_ENV, isa)
    for dtype in (torch.float32, torch.bfloat16):
        for backward in ("fused", "two-pass"):
            check_huge_fill_gradients(dtype, backward)


@pytest.mark.parametrize("isa", LOWER_LEVELS or ["none"])
def test_examples_on_each_forced_lower_level(isa: str, monkeypatch) -> None:
    if isa == "none":
        pytest.skip("this machine's best CPU level is the portable one: no lower level to force")
    monkeypatch.setenv(ISA_ENV, isa)
    for name in ISA_EXAMPLES:
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn")
        assert kern.op.tiling.micro_kernel.isa == isa
        runs = [(shape, torch.float32) for shape in ISA_SHAPES]
        if name in ISA_LOW_PRECISION:
            runs += [(shape, dtype) for shape in ISA_LOW_PRECISION_SHAPES for dtype in (torch.bfloat16, torch.float16)]
        for shape, dtype in runs:
            result = check(kern, adapt(shape, kern), dtype)
            assert result.ok, f"{isa} {name} {dtype} {shape}: {result.describe()}"


@pytest.mark.parametrize("isa", LEVELS_HERE)
def test_small_tiles_and_panel_batches(isa: str, monkeypatch) -> None:
    """Many key tiles per row (8 x 32 tiles) and K/V panels packed a kv head at a time (a budget
    of one byte), with GQA heads sharing a kv head's panels, on each level."""
    monkeypatch.setenv(ISA_ENV, isa)
    monkeypatch.setattr(cpu_codegen, "PANEL_BUDGET_BYTES", 1)
    for name, dtypes in (("causal", (torch.float32, torch.bfloat16)), ("alibi", (torch.float32,))):
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn", tiles=(8, 32))
        for dtype in dtypes:
            result = check(kern, adapt(Shape(3, 4, 2, 45, 110, 24), kern), dtype)
            assert result.ok, f"{isa} {name} {dtype}: {result.describe()}"


@pytest.mark.parametrize("isa", LEVELS_HERE)
@pytest.mark.usefixtures("two_threads")
def test_kv_heads_side_by_side_in_segments_on_each_level(isa: str, monkeypatch) -> None:
    """Chunks of queries against K/V whose kv heads lie side by side in each key row (a paged
    cache's layout, here a [B, M, Hkv, D] view): from 48 rows a kv head (52, 64) a task takes
    every kv head of a sequence as segments, fp32 on K^T tiles on the vector levels (AVX2's 8 x 8
    transposes too), bf16 on packed tiles where the level has vdpbf16ps; against float64."""
    monkeypatch.setenv(ISA_ENV, isa)
    kern = attncc.compile(ROOT / "examples" / "alibi.attn")
    for B, H, Hkv, N in ((2, 8, 2, 13), (2, 12, 3, 16)):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, runtime = make_inputs(kern, adapt(Shape(B, H, Hkv, N, 300, 40), kern), dtype, requires_grad=False)
            k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
            ref, _ = kern.reference(q.double(), k.double(), v.double(), **runtime)
            error = (kern(q, k, v, **runtime).double() - ref).abs().max().item()
            assert error < (1e-4 if dtype == torch.float32 else 3e-2), (isa, B, H, Hkv, N, dtype, error)


@pytest.mark.parametrize("isa", LEVELS_HERE)
@pytest.mark.usefixtures("two_threads")
def test_fused_backward_key_chunks_on_each_level(isa: str, monkeypatch) -> None:
    """One (b, kv head) task for two threads: the fused backward cuts it into key chunks (their
    dQ rows summed after), causal (chunks of unequal key counts) fp32 and bf16 on each level
    (the AMX backward's own tiles on `amx`), against float64."""
    monkeypatch.setenv(ISA_ENV, isa)
    kern = attncc.compile(ROOT / "examples" / "causal.attn")
    for dtype in (torch.float32, torch.bfloat16):
        shape = Shape(1, 4, 1, 300, 300, 40)
        q = torch.empty(1, 4, 300, 40, dtype=dtype)
        assert kern.backward_passes(kern.plan(q, q[:, :1], None, backward=True)) == (("attncc_backward_fused",), 2)
        result = check(kern, shape, dtype)
        assert result.ok, f"{isa} {dtype}: {result.describe()}"


CACHED_RUN = """
import sys, warnings, torch, attncc
warnings.simplefilter("always")
program = "attention corrupt_cache_test\\ns = q @ k.T * scale\\ns = s * 0.5\\np = softmax(s)\\no = p @ v\\noutput o\\n"
q = torch.randn(1, 2, 9, 16, generator=torch.Generator().manual_seed(0))
torch.save(attncc.compile(program)(q, q, q), sys.argv[1])
"""


def test_a_corrupted_cached_library_is_rebuilt_once_with_a_warning(tmp_path) -> None:
    """Truncated and foreign (no attncc entry points) libraries in the cache, a truncated one
    beside a truncated object, and one beside a truncated source: a new process rebuilds each
    once with a one-line warning, and the kernel's answer is unchanged.
    (Processes of their own: overwriting a library this process has mapped would fault.)"""
    # debug builds (-O0, seconds less each): the cache's recovery is under test, not the code
    env = dict(
        os.environ, ATTNCC_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=ROOT_FIRST_PYTHONPATH, ATTNCC_DEBUG_BUILD="1"
    )

    def run(out: str) -> tuple[torch.Tensor, str]:
        proc = subprocess.run(
            [sys.executable, "-c", CACHED_RUN, str(tmp_path / out)], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return torch.load(tmp_path / out), proc.stderr

    want, stderr = run("want.pt")
    assert "rebuilding" not in stderr
    (library,) = (tmp_path / "cache").glob("*/kernel.so")
    good = library.read_bytes()
    foreign = build_library('extern "C" int other() { return 1; }', "foreign").read_bytes()
    source = library.parent / "kernel.cpp"
    for damaged, beside in (
        (good[:1000], None),
        (foreign, None),
        (good[:1000], "part1.o"),
        (good[:1000], "kernel.cpp"),
    ):
        library.write_bytes(damaged)
        if beside is not None:  # (an object was relinked as it was, a source recompiled: failed)
            other = library.parent / beside
            other.write_bytes(other.read_bytes()[:1000])
        got, stderr = run("got.pt")
        warned = [line for line in stderr.splitlines() if "failed to load" in line]
        assert len(warned) == 1 and "rebuilding it" in warned[0], stderr
        assert "Traceback" not in stderr and library.read_bytes() != damaged
        assert torch.equal(got, want)
    assert len(source.read_text()) > 1000  # (rewritten)
    # a damaged library whose build.ninja is lost: refused in every process ("its contents
    # differ"; session 65's review), where the process had just made its source
    library.parent.joinpath("build.ninja").unlink()
    library.write_bytes(good[:1000])
    got, stderr = run("got.pt")
    assert sum("failed to load" in line for line in stderr.splitlines()) == 1 and torch.equal(got, want)
    # a truncated library without its digest: ninja took it as up to date and its digest was
    # recorded, so dlopen died of SIGBUS; a library without its digest is rebuilt now
    library.parent.joinpath("kernel.so.sha256").unlink()
    library.write_bytes(good[:50000])
    got, stderr = run("got.pt")
    assert torch.equal(got, want) and library.read_bytes() != good[:50000]


@pytest.mark.parametrize("isa", LEVELS_HERE)
def test_key_tiles_fitted_to_few_keys(isa: str, monkeypatch) -> None:
    """A call with fewer keys than Bc takes key tiles of its key count rounded up to 16 (32
    for AMX's bf16 products), one tile per row: M = 5, 16, 17 and 40 with N above and below M,
    causal, padding (rows without keys), ALiBi's learnable slopes, GQA, odd head dims; fp32 and
    bf16, forward and backward, against float64, on each level."""
    from attncc.runtime.inputs import make_inputs

    monkeypatch.setenv(ISA_ENV, isa)
    for name in ("causal", "padding", "alibi"):
        kern = attncc.compile(ROOT / "examples" / f"{name}.attn")
        for shape in (
            Shape(3, 4, 2, 16, 16, 64),
            Shape(2, 2, 1, 7, 5, 40),
            Shape(2, 4, 2, 33, 17, 24),
            Shape(1, 2, 2, 9, 40, 80),
        ):
            shape = adapt(shape, kern)
            for dtype in (torch.float32, torch.bfloat16):
                q, k, _, runtime = make_inputs(kern, shape, dtype, requires_grad=False)
                step = 32 if dtype == torch.bfloat16 and CPU_ISAS[isa].bf16_products == "amx" else 16
                tiles, _ = kern.forward_classes(q, k, **runtime)
                assert tiles.block_cols == max(step, -(-shape.M // step) * step), (isa, name, shape, dtype)
                result = check(kern, shape, dtype)
                assert result.ok, f"{isa} {name} {dtype} {shape}: {result.describe()}"


@pytest.mark.parametrize("isa", [level for level in ("avx512bf16", "avx512", "avx2") if level in LEVELS_HERE])
def test_the_peak_probe_times_the_unit_each_dtype_runs_on(isa: str, monkeypatch) -> None:
    """bench/peak_cpu.py (bench_cpu.py's "% of the peak"): the fp32 FMAs at every level; bf16 on
    vdpbf16ps where the level has it, else the same FMAs as fp32 (widened). Bounds, not speed: a
    probe that measured no work (its loop optimised away) reads far beyond any x86 core's rate."""
    sys.path.insert(0, str(ROOT))
    from bench.peak_cpu import peak_rates

    monkeypatch.setenv(ISA_ENV, isa)
    rates = peak_rates(rounds=2_000_000, repeats=1)
    fma_bound = 2 * 16 * 2 * 6.0 * cpu().cores  # 2 ports x 16 lanes x 2 FLOPs at 6 GHz: above any x86 core
    assert set(rates) == {"float32", "bfloat16"}
    assert 0 < rates["float32"] < fma_bound
    assert 0 < rates["bfloat16"] < 2 * fma_bound  # vdpbf16ps: 4 FLOPs per lane
    if isa != "avx512bf16":  # (no speed ratio asserted: a timed test fails on a busy machine)
        assert rates["bfloat16"] == rates["float32"]
