"""The CPU's own peak arithmetic rates, measured: the ceiling that "at the machine's limit" means.

torch.mm is a poor yardstick on some machines (fp32 mm reached 203 GFLOP/s on the Zen 5 test
machine, where attncc's fp32 forward reached 460), so bench_cpu.py also divides by these: every
core (OpenMP, one thread per core) issues independent vector FMAs (fp32, `vfmadd`) or bf16 pair
dot products (`vdpbf16ps`, where the machine has avx512_bf16) on accumulators that never leave
the registers, at the vector width of the kernel level attncc chose (targets.cpu()). Enough
independent accumulators (16) cover the FMA latency (4 cycles) on two ports. AMX tile products
are not probed (no AMX machine at hand when written): on `amx` levels torch's bf16 mm (oneDNN on
AMX) stays the bf16 yardstick.

    python bench/peak_cpu.py     # prints GFLOP/s per kind
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attncc.runtime.build import build_library, load_library  # noqa: E402
from attncc.targets import CPU_ISAS, cpu  # noqa: E402

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>

namespace {
constexpr int kAccumulators = 16;

// Seconds for `rounds` x kAccumulators independent FMAs per thread; `sink` keeps the results live.
template <typename Vec, typename Step>
double timed(int64_t rounds, int threads, Step step, Vec seed, float* sink) {
  double seconds = 0;
#pragma omp parallel num_threads(threads) reduction(max : seconds)
  {
    Vec acc[kAccumulators];
    for (int i = 0; i < kAccumulators; ++i) acc[i] = seed;
    const Vec a = seed, b = seed;
#pragma omp barrier
    const auto start = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < rounds; ++r) {
#pragma GCC unroll 16
      for (int i = 0; i < kAccumulators; ++i) acc[i] = step(acc[i], a, b);
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    Vec total = acc[0];
    for (int i = 1; i < kAccumulators; ++i) total = total + acc[i];
    sink[omp_get_thread_num()] = reinterpret_cast<const float*>(&total)[0];
  }
  return seconds;
}
}  // namespace

// FLOP/s of fp32 FMAs at the compiled vector width (2 FLOPs per lane and FMA).
extern "C" double attncc_peak_fp32(int64_t rounds, int threads, float* sink) {
#if defined(__AVX512F__)
  using Vec = __m512;
  auto step = [](Vec c, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, c); };
  const Vec seed = _mm512_set1_ps(1e-7f);
#elif defined(__FMA__)
  using Vec = __m256;
  auto step = [](Vec c, Vec a, Vec b) { return _mm256_fmadd_ps(a, b, c); };
  const Vec seed = _mm256_set1_ps(1e-7f);
#else
  using Vec = __m128;
  auto step = [](Vec c, Vec a, Vec b) { return _mm_add_ps(_mm_mul_ps(a, b), c); };
  const Vec seed = _mm_set1_ps(1e-7f);
#endif
  const double seconds = timed(rounds, threads, step, seed, sink);
  return 2.0 * (sizeof(Vec) / 4) * kAccumulators * double(rounds) * threads / seconds;
}

// FLOP/s of vdpbf16ps (2 products and 2 sums per fp32 lane), 0 where the level lacks it.
extern "C" double attncc_peak_dpbf16(int64_t rounds, int threads, float* sink) {
#if defined(__AVX512BF16__)
  using Vec = __m512;
  auto step = [](Vec c, Vec a, Vec b) {
    return _mm512_dpbf16_ps(c, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
  };
  const double seconds = timed(rounds, threads, step, _mm512_set1_ps(1e-7f), sink);
  return 4.0 * 16 * kAccumulators * double(rounds) * threads / seconds;
#else
  (void)rounds, (void)threads, (void)sink;
  return 0.0;
#endif
}
"""


def peak_rates(rounds: int = 20_000_000, repeats: int = 5) -> dict[str, float]:
    """GFLOP/s of the unit attncc's chosen level multiplies each input dtype on, all cores, best
    of `repeats`: "float32" the fp32 FMAs; "bfloat16" vdpbf16ps on avx512bf16, the fp32 FMAs where
    bf16 is widened (avx512, avx2, generic), left out on amx (not probed)."""
    target = cpu()
    lib = load_library(build_library(SOURCE, "peak-cpu", isa_flags=target.compile_flags))
    sink = (ctypes.c_float * max(256, target.cores))()

    def measured(probe: ctypes._CFuncPtr) -> float:
        probe.restype = ctypes.c_double
        probe.argtypes = (ctypes.c_int64, ctypes.c_int, ctypes.c_void_p)
        probe(rounds // 10, target.cores, sink)  # warm-up: clocks up, threads started
        return max(probe(rounds, target.cores, sink) for _ in range(repeats)) / 1e9

    rates = {"float32": measured(lib.attncc_peak_fp32)}
    bf16_products = CPU_ISAS[target.isa].bf16_products
    if bf16_products == "dpbf16":
        rates["bfloat16"] = measured(lib.attncc_peak_dpbf16)
    elif not bf16_products:
        rates["bfloat16"] = rates["float32"]
    return rates


if __name__ == "__main__":
    target = cpu()
    print(
        f"level {target.isa}, {target.cores} cores: "
        + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peak_rates().items())
    )
