// attncc CPU primitives: the small, separately tested building blocks every generated CPU
// kernel calls. Plain C++17 with GCC vector extensions; no torch headers, so a variant's
// translation unit compiles in seconds.
//
// The including file defines ATTNCC_ACC_T (float or double) and ATTNCC_STORAGE_T (the
// q/k/v element type: float, double, attncc::bf16_t or attncc::fp16_t). A generated kernel also
// defines the micro-kernel the tiling pass chose for the target's ISA (passes/tiling.py
// `choose_micro_kernel`): ATTNCC_VECTOR_BYTES (the SIMD width it is compiled for) and
// ATTNCC_GEMM_ROWS x ATTNCC_GEMM_VECS (gemm's register block). Other includers get the widest
// vector the compiler targets and a block that fits 16 registers.
#pragma once

#ifndef ATTNCC_VECTOR_BYTES
#if defined(__AVX512F__)
#define ATTNCC_VECTOR_BYTES 64
#elif defined(__AVX2__)
#define ATTNCC_VECTOR_BYTES 32
#else
#define ATTNCC_VECTOR_BYTES 16
#endif
#endif
#ifndef ATTNCC_GEMM_ROWS
#define ATTNCC_GEMM_ROWS 6
#define ATTNCC_GEMM_VECS 2
#endif

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#include "attncc/fp8bits.h"
#include "attncc/halfbits.h"
#include "attncc/philox.h"

namespace attncc {

// ---------------------------------------------------------------------------------- types
struct bf16_t { uint16_t bits; };
struct fp16_t { uint16_t bits; };

using acc_t = ATTNCC_ACC_T;
// Learnable-input gradients sum one term per score into one entry (ALiBi: N x M terms per
// slope): in double, an fp32 sum of ~1e6 terms would lose ~1e-3 relative.
using grad_t = double;
using storage_t = ATTNCC_STORAGE_T;
// One SIMD register of acc_t. Wider GCC vectors than the ISA has are split into several
// registers and, in a register-blocked loop, spill: 64-byte vectors on an AVX2 machine ran gemm
// at 3 GFLOP/s instead of 45.
typedef acc_t vec_t __attribute__((vector_size(ATTNCC_VECTOR_BYTES)));
constexpr int VL = ATTNCC_VECTOR_BYTES / sizeof(acc_t);  // lanes per vector
constexpr acc_t kInf = std::numeric_limits<acc_t>::infinity();

inline float to_acc_float(bf16_t x) { return bf16_bits_to_float(x.bits); }
inline float to_acc_float(fp16_t x) { return fp16_bits_to_float(x.bits); }
inline bf16_t from_float_bf16(float f) { return bf16_t{float_to_bf16_bits(f)}; }
inline fp16_t from_float_fp16(float f) { return fp16_t{float_to_fp16_bits(f)}; }

inline acc_t to_acc(float x) { return x; }
inline acc_t to_acc(double x) { return acc_t(x); }
inline acc_t to_acc(bf16_t x) { return to_acc_float(x); }
inline acc_t to_acc(fp16_t x) { return to_acc_float(x); }

template <typename T> inline T from_acc(acc_t x);
template <> inline float from_acc<float>(acc_t x) { return float(x); }
template <> inline double from_acc<double>(acc_t x) { return double(x); }
template <> inline bf16_t from_acc<bf16_t>(acc_t x) { return from_float_bf16(float(x)); }
template <> inline fp16_t from_acc<fp16_t>(acc_t x) { return from_float_fp16(float(x)); }

// ---------------------------------------------------------------------------------- scalars
// b == 0 and INT64_MIN / -1 would trap; the runtime rejects divisors whose range holds 0, and
// these guards keep a missed case from killing the process.
inline int64_t floordiv(int64_t a, int64_t b) {
  if (b == 0) return 0;
  if (b == -1) return static_cast<int64_t>(uint64_t(0) - static_cast<uint64_t>(a));  // wraps, no trap
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
inline int64_t pymod(int64_t a, int64_t b) {
  if (b == 0 || b == -1) return 0;
  int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
// Math used by generated expressions (the CUDA header defines the same names for devices).
// min and max give NaN where either operand is (torch.minimum / maximum's rule; `a < b ? a : b`
// gave b for min(NaN, b), so a NaN score capped by min(s, 0.5) came out finite); `a != a` is
// false for integers.
template <typename T> inline T min_of(T a, T b) { return (a < b || a != a) ? a : b; }
template <typename T> inline T max_of(T a, T b) { return (b < a || a != a) ? a : b; }
// |INT64_MIN| wraps to itself as in torch, through uint64 (-x overflowed: undefined, and GCC
// folded abs(x) > 0 to x != 0)
inline int64_t math_abs(int64_t x) { return x < 0 ? int64_t(uint64_t(0) - uint64_t(x)) : x; }
inline acc_t math_abs(acc_t x) { return std::abs(x); }
// exp for a float or a vector of floats: Cody-Waite range reduction and a degree-6 polynomial
// for 2^f (relative error < 2e-7), exactly 0 below the underflow threshold (so for -inf).
// Branch- and call-free, so scalar loops over score maps vectorise too.
typedef float vfloat_t __attribute__((vector_size(ATTNCC_VECTOR_BYTES)));
typedef int32_t vint_t __attribute__((vector_size(ATTNCC_VECTOR_BYTES)));
typedef double vdouble_t __attribute__((vector_size(ATTNCC_VECTOR_BYTES)));
inline int32_t to_int_lanes(float n) { return int32_t(n); }
inline vint_t to_int_lanes(vfloat_t n) { return __builtin_convertvector(n, vint_t); }

// e^x for x in [-87.34, 88.72] (the float range of e^x): n = round(x / ln2), f = x - n ln2,
// e^x = 2^n p(f).
template <typename F>
inline F exp_in_range(F x) {
  const F n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round (1.5 * 2^23 trick)
  const F f = (x - n * 0.693359375f) + n * 2.12194440e-4f;             // x - n ln2 in two parts
  F p = F{} + 1.9875691500e-4f;
  p = p * f + 1.3981999507e-3f;
  p = p * f + 8.3334519073e-3f;
  p = p * f + 4.1665795894e-2f;
  p = p * f + 1.6666665459e-1f;
  p = p * f + 5.0000001201e-1f;
  p = p * f * f + f + 1.0f;
  decltype(to_int_lanes(n)) bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += to_int_lanes(n) << 23;  // times 2^n
  F r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

template <typename F>
inline F exp_cody_waite(F x) {
  const F lo = F{} - 87.3365f, hi = F{} + 88.7228f;
  F xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const F r = exp_in_range(xc);
  return x < lo ? F{} : (x > hi ? F{} + __builtin_huge_valf() : r);  // overflow: inf, as libm
}

// e^x for softmax arguments x = s - max <= 0 (or NaN, which stays NaN): no overflow path.
template <typename F>
inline F exp_nonpositive(F x) {
  const F lo = F{} - 87.3365f;
  const auto underflow = x < lo;
  const F r = exp_in_range(underflow ? lo : x);
  return underflow ? F{} : r;
}
inline float exp_poly(float x) { return exp_cody_waite(x); }

// tanh from exp_poly: tanh|x| = (1 - e) / (1 + e), e = exp(-2|x|), with the odd Taylor series
// near 0 where 1 - e cancels; |error| < 2e-7.
inline float tanh_poly(float x) {
  const float a = std::abs(x), e = exp_poly(-2.0f * a);
  const float x2 = x * x;
  const float small = x * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f + x2 * (-17.0f / 315.0f))));
  const float large = std::copysign((1.0f - e) / (1.0f + e), x);
  return a < 0.125f ? small : large;
}
inline float math_exp(float x) { return exp_poly(x); }
inline double math_exp(double x) { return std::exp(x); }
inline acc_t math_log(acc_t x) { return std::log(x); }
inline float math_tanh(float x) { return tanh_poly(x); }
inline double math_tanh(double x) { return std::tanh(x); }
inline acc_t math_sqrt(acc_t x) { return std::sqrt(x); }
inline double pymod(double a, double b) { double r = std::fmod(a, b); return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }

// ---------------------------------------------------------------------------------- buffers
// Memory blocks recycled across kernel calls. A call's K/V panels (up to 4 MiB) and per-thread
// tiles come from here and go back here, not to the C heap: glibc returns large blocks to the
// kernel, and the next call's first touch of every 4 KiB page faulted (~1-2 us each under
// KVM: the panels of a bf16 call at N = 512, 1 MiB, faulted ~120 times per call). One pool per
// thread (the OpenMP workers persist between calls), so a block comes back to the core whose
// cache last held it, and takes and gives need no lock. A pool keeps at most kPoolBlocks free
// blocks and kPoolBytes in them; what would exceed that goes back to the heap. A request takes
// the smallest free block that fits, but none over kPoolSlack times its size: a small buffer
// that took a large block left the large buffer after it to fault in a fresh one (the fused
// backward's four key-tile workspaces, 17 buffers each, took the 2 MiB query-side blocks when
// the pool held 32 blocks: +14 MiB of page faults per call at N = 8K).
// The pool's take and give are compiled once per preamble: in the shared instances object
// (runtime/build.py `_shared_instances`) where the object is a generated kernel's
// (ATTNCC_SHARED_INSTANCES), each library's own and called directly (hidden); inline in every other
// includer. Inlined, the buffers of a backward's workspaces were 19 KB of its object's 69 KB of
// code, and ~20% of its compile time. The free lists stay one per thread and process: free_list()
// is inline, so the dynamic linker makes its thread_local one object for every library.
#if defined(ATTNCC_SHARED_INSTANCES)
#define ATTNCC_CPU_RUNTIME __attribute__((visibility("hidden")))
#else
#define ATTNCC_CPU_RUNTIME inline
#endif
class BlockPool {
 public:
  static constexpr int kPoolBlocks = 128;
  static constexpr size_t kPoolBytes = size_t(32) << 20;
  static constexpr size_t kPoolSlack = 4;

  // A 64-byte aligned block of at least `bytes` (give it back on this thread); `capacity`
  // receives its size.
  ATTNCC_CPU_RUNTIME static void* take(size_t bytes, size_t& capacity);
  ATTNCC_CPU_RUNTIME static void give(void* block, size_t capacity);

 private:
  struct Free {
    void* blocks[kPoolBlocks];
    size_t sizes[kPoolBlocks];
    int count = 0;
    size_t bytes = 0;
    ~Free() {
      for (int i = 0; i < count; ++i) std::free(blocks[i]);
    }
  };
  static Free& free_list() {
    static thread_local Free f;
    return f;
  }
};

#if !defined(ATTNCC_SHARED_INSTANCES) || defined(ATTNCC_INSTANCES_SOURCE)
ATTNCC_CPU_RUNTIME void* BlockPool::take(size_t bytes, size_t& capacity) {
  bytes = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  Free& f = free_list();
  int best = -1;
  for (int i = 0; i < f.count; ++i)  // the smallest block that fits, up to kPoolSlack x bytes
    if (f.sizes[i] >= bytes && f.sizes[i] <= kPoolSlack * bytes && (best < 0 || f.sizes[i] < f.sizes[best])) best = i;
  if (best < 0) {
    capacity = bytes;
    return std::aligned_alloc(64, bytes);
  }
  void* block = f.blocks[best];
  capacity = f.sizes[best];
  f.bytes -= capacity;
  --f.count;
  f.blocks[best] = f.blocks[f.count];
  f.sizes[best] = f.sizes[f.count];
  return block;
}

ATTNCC_CPU_RUNTIME void BlockPool::give(void* block, size_t capacity) {
  Free& f = free_list();
  if (f.count == kPoolBlocks || f.bytes + capacity > kPoolBytes) return std::free(block);
  f.blocks[f.count] = block;
  f.sizes[f.count] = capacity;
  ++f.count;
  f.bytes += capacity;
}
#endif

// A block the calling thread keeps from one kernel call to its next (grow-only), for buffers too
// large for the BlockPool that a call fills before reading (the fused backward's per-chunk dQ
// rows: 8-32 MiB, whose first touch faulted ~1.3 us a 4 KiB page under KVM, 9 ms of a 43 ms
// backward). Blocks above kKeptBlockBytes are the call's own, freed after it. Each kernel library
// keeps its own (up to kKeptBlockBytes per library and calling thread, until the thread ends).
class KeptBlock {
 public:
  static constexpr size_t kKeptBlockBytes = size_t(64) << 20;
  explicit KeptBlock(size_t bytes) : bytes_(std::max<size_t>(64, (bytes + 63) / 64 * 64)) {
    Kept& kept = kept_block();
    if (bytes_ > kKeptBlockBytes) {
      data = std::aligned_alloc(64, bytes_);
    } else {
      if (kept.bytes < bytes_) {
        std::free(kept.data);
        kept.data = std::aligned_alloc(64, bytes_);
        kept.bytes = kept.data != nullptr ? bytes_ : 0;
      }
      data = kept.data;
    }
    if (data == nullptr) throw std::bad_alloc();  // (the entry points turn it into an error status)
  }
  ~KeptBlock() {
    if (bytes_ > kKeptBlockBytes) std::free(data);
  }
  KeptBlock(const KeptBlock&) = delete;
  KeptBlock& operator=(const KeptBlock&) = delete;
  void* data = nullptr;

 private:
  struct Kept {
    void* data = nullptr;
    size_t bytes = 0;
    ~Kept() { std::free(data); }
  };
  static Kept& kept_block() {
    static thread_local Kept kept;
    return kept;
  }
  size_t bytes_;
};

// A 64-byte aligned, zeroed scratch array owned by one thread (from the BlockPool).
template <typename T>
struct Buffer {
  T* data = nullptr;
  size_t capacity = 0;
  explicit Buffer(size_t n) {
    const size_t bytes = std::max<size_t>(64, n * sizeof(T));
    data = static_cast<T*>(BlockPool::take(bytes, capacity));
    std::memset(data, 0, bytes);
  }
  ~Buffer() { BlockPool::give(data, capacity); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};
using Scratch = Buffer<acc_t>;

// MXCSR's flush-to-zero and denormals-are-zero while a kernel's thread runs, restored after (the
// OpenMP threads go back to torch): a denormal result or operand of an SSE/AVX instruction
// otherwise takes a microcode assist (~60 ns a vector), which scores far below their row's max
// and products of tiny probabilities make often. Values below 2^-126 (1.2e-38) read as 0.
struct FlushDenormals {
#if defined(__SSE__)
  const unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040u); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Tasks 0..n-1 of a parallel loop: each thread owns the contiguous range that OpenMP's static
// schedule would give it (so a thread computes with the K/V panels that its own static share of
// the packing loop put in its cache) and, once its range is done, takes the other threads'
// remaining tasks one at a time (work that varies per task: causal, ragged lengths). With
// `schedule(dynamic, 1)` both cores read every kv head's panels, half of them from the other
// core's cache: a bf16 forward at N = 1K ran 6-10% slower.
class OwnedTasks {
 public:
  OwnedTasks(int64_t n, int threads) : threads_(std::max(1, threads)), ranges_(new Range[threads_]) {
    const int64_t share = n / threads_, extra = n % threads_;  // libgomp's static split
    for (int t = 0; t < threads_; ++t) {
      const int64_t begin = t * share + std::min<int64_t>(t, extra);
      ranges_[t].next.store(begin, std::memory_order_relaxed);
      ranges_[t].end = begin + share + (t < extra ? 1 : 0);
    }
  }
  // The calling thread's next task in `task`; false when no thread has one left.
  bool take(int thread, int64_t& task) {
    for (int k = 0; k < threads_; ++k) {
      Range& r = ranges_[(thread + k) % threads_];
      if (r.next.load(std::memory_order_relaxed) >= r.end) continue;
      task = r.next.fetch_add(1, std::memory_order_relaxed);
      if (task < r.end) return true;
    }
    return false;
  }

 private:
  struct alignas(64) Range {  // one cache line each: threads take from their own without sharing
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };
  int threads_;
  std::unique_ptr<Range[]> ranges_;
};

// `n` fp8 bytes (e4m3fn, or e5m2 with kE5M2: fp8bits.h) widened to float, times `factor`, into
// dst. AVX-512: 16 at a time through fp16, which holds every fp8 value: e5m2 is fp16's upper
// byte; an e4m3 magnitude shifted into fp16's fields reads as 2^-8 of its value (its subnormals
// as fp16 subnormals, which vcvtph2ps converts whatever DAZ says), and S.1111.111 is made NaN.
// Exact, like fp8bits.h.
template <bool kE5M2>
inline void widen_fp8(float* __restrict dst, const uint8_t* __restrict src, int n, float factor) {
  int c = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m512 scale = _mm512_set1_ps(kE5M2 ? factor : factor * 256.0f);
  for (; c + 16 <= n; c += 16) {
    const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c)));
    if constexpr (kE5M2) {
      _mm512_storeu_ps(dst + c, _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(x, 8)), scale));
    } else {
      const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(x, 8), _mm256_set1_epi16(int16_t(0x8000)));
      const __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
      const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(sign, _mm256_slli_epi16(magnitude, 7))), scale);
      const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7f));
      _mm512_storeu_ps(dst + c, _mm512_mask_mov_ps(v, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN())));
    }
  }
#endif
  for (; c < n; ++c) dst[c] = bits_to_float(kE5M2 ? fp8_e5m2_float_bits(src[c]) : fp8_e4m3_float_bits(src[c])) * factor;
}

inline vec_t vload_widened(const acc_t* p);
inline vec_t vload_widened(const bf16_t* p);
inline vec_t vload_widened(const fp16_t* p);
inline vec_t vbroadcast(acc_t x);
inline void vstore(acc_t* p, vec_t v);

// rows x cols of src (row stride `stride`, unit column stride) -> dst[r * ld + c], zero padded
// to pad_rows x pad_cols, converted to acc_t.
template <typename T>
inline void load_tile(acc_t* dst, int64_t ld, const T* src, int64_t row_stride, int64_t col_stride,
                      int rows, int cols, int pad_rows, int pad_cols, acc_t scale = acc_t(1)) {
  constexpr bool widened_in_registers = std::is_same_v<T, acc_t> || std::is_same_v<T, bf16_t> || std::is_same_v<T, fp16_t>;
  for (int r = 0; r < pad_rows; ++r) {
    acc_t* d = dst + r * ld;
    if (r < rows) {
      const T* s = src + r * row_stride;
      if (col_stride == 1) {  // the common layout: whole vectors widened in registers, the rest value by value
        int c = 0;
        if constexpr (widened_in_registers) {  // (GCC leaves fp16's conversion scalar: 5.3x slower tiles)
          const vec_t factor = vbroadcast(scale);
          for (; c + VL <= cols; c += VL) vstore(d + c, vload_widened(s + c) * factor);
        }
        for (; c < cols; ++c) d[c] = to_acc(s[c]) * scale;
      } else {
        for (int c = 0; c < cols; ++c) d[c] = to_acc(s[c * col_stride]) * scale;
      }
      for (int c = cols; c < pad_cols; ++c) d[c] = 0;
    } else {
      for (int c = 0; c < pad_cols; ++c) d[c] = 0;
    }
  }
}

#if defined(__AVX512F__)
// dst[w * ld_dst + r] = word w of row r for r < rows16, w < words16 (multiples of 16), in 16 x 16
// blocks in registers: load(r, w) gives words w .. w + 15 of row r; unpack 32- and 64-bit
// neighbours, then a 4 x 4 transpose of 128-bit lanes.
template <typename Load>
inline void transpose_blocks16(uint32_t* __restrict dst, int64_t ld_dst, int rows16, int words16, Load load) {
  for (int r0 = 0; r0 < rows16; r0 += 16)
    for (int w0 = 0; w0 < words16; w0 += 16) {
      __m512i a[16], b[16];
      for (int i = 0; i < 16; ++i) a[i] = load(r0 + i, w0);
      for (int i = 0; i < 16; i += 2) {  // per 128-bit lane k: rows i, i + 1 at words 4k, 4k + 1 / 4k + 2, 4k + 3
        b[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
        b[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
      }
      for (int g = 0; g < 4; ++g) {  // a[4 j + g], lane k: rows 4g .. 4g + 3 at word 4k + j
        a[g] = _mm512_unpacklo_epi64(b[4 * g], b[4 * g + 2]);
        a[4 + g] = _mm512_unpackhi_epi64(b[4 * g], b[4 * g + 2]);
        a[8 + g] = _mm512_unpacklo_epi64(b[4 * g + 1], b[4 * g + 3]);
        a[12 + g] = _mm512_unpackhi_epi64(b[4 * g + 1], b[4 * g + 3]);
      }
      for (int j = 0; j < 4; ++j) {  // word 4k + j gathers lane k of a[4 j + 0 .. 3]
        const __m512i lo01 = _mm512_shuffle_i32x4(a[4 * j], a[4 * j + 1], 0x44);
        const __m512i hi01 = _mm512_shuffle_i32x4(a[4 * j], a[4 * j + 1], 0xEE);
        const __m512i lo23 = _mm512_shuffle_i32x4(a[4 * j + 2], a[4 * j + 3], 0x44);
        const __m512i hi23 = _mm512_shuffle_i32x4(a[4 * j + 2], a[4 * j + 3], 0xEE);
        _mm512_storeu_si512(dst + (w0 + j) * ld_dst + r0, _mm512_shuffle_i32x4(lo01, lo23, 0x88));
        _mm512_storeu_si512(dst + (w0 + 4 + j) * ld_dst + r0, _mm512_shuffle_i32x4(lo01, lo23, 0xDD));
        _mm512_storeu_si512(dst + (w0 + 8 + j) * ld_dst + r0, _mm512_shuffle_i32x4(hi01, hi23, 0x88));
        _mm512_storeu_si512(dst + (w0 + 12 + j) * ld_dst + r0, _mm512_shuffle_i32x4(hi01, hi23, 0xDD));
      }
    }
}
#elif defined(__AVX2__)
// The same in 8 x 8 blocks (AVX2): load(r, w) gives words w .. w + 7 of row r.
template <typename Load>
inline void transpose_blocks8(uint32_t* __restrict dst, int64_t ld_dst, int rows8, int words8, Load load) {
  for (int r0 = 0; r0 < rows8; r0 += 8)
    for (int w0 = 0; w0 < words8; w0 += 8) {
      __m256 a[8], b[8];
      for (int i = 0; i < 8; ++i) a[i] = _mm256_castsi256_ps(load(r0 + i, w0));
      for (int i = 0; i < 8; i += 2) {  // per 128-bit lane: rows i, i + 1 at words 0, 1 / 2, 3
        b[i] = _mm256_unpacklo_ps(a[i], a[i + 1]);
        b[i + 1] = _mm256_unpackhi_ps(a[i], a[i + 1]);
      }
      for (int g = 0; g < 2; ++g) {  // per 128-bit lane: rows 4g .. 4g + 3 at one word each
        a[4 * g] = _mm256_shuffle_ps(b[4 * g], b[4 * g + 2], 0x44);
        a[4 * g + 1] = _mm256_shuffle_ps(b[4 * g], b[4 * g + 2], 0xEE);
        a[4 * g + 2] = _mm256_shuffle_ps(b[4 * g + 1], b[4 * g + 3], 0x44);
        a[4 * g + 3] = _mm256_shuffle_ps(b[4 * g + 1], b[4 * g + 3], 0xEE);
      }
      for (int j = 0; j < 4; ++j) {  // word j: low lanes of rows 0..3 and 4..7; word 4 + j: high lanes
        _mm256_storeu_ps(reinterpret_cast<float*>(dst + (w0 + j) * ld_dst + r0), _mm256_permute2f128_ps(a[j], a[4 + j], 0x20));
        _mm256_storeu_ps(reinterpret_cast<float*>(dst + (w0 + 4 + j) * ld_dst + r0), _mm256_permute2f128_ps(a[j], a[4 + j], 0x31));
      }
    }
}
#endif

// dst[w * ld_dst + r] = src[r * ld_src + w] for r < rows, w < words: the transpose of a tile of
// 32-bit words (fp32 K^T panels, bf16 pairs: pair-packed K^T panels, from K's rows), on AVX-512
// by 16 x 16 blocks in registers (AVX2: 8 x 8), the edges (and everything elsewhere) word by word.
inline void transpose_words(uint32_t* __restrict dst, int64_t ld_dst, const uint32_t* __restrict src, int64_t ld_src,
                            int rows, int words) {
#if defined(__AVX512F__)
  const int rows_b = rows / 16 * 16, words_b = words / 16 * 16;  // (whole blocks)
  transpose_blocks16(dst, ld_dst, rows_b, words_b, [&](int r, int w) { return _mm512_loadu_si512(src + r * ld_src + w); });
#elif defined(__AVX2__)
  const int rows_b = rows / 8 * 8, words_b = words / 8 * 8;
  transpose_blocks8(dst, ld_dst, rows_b, words_b, [&](int r, int w) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + r * ld_src + w));
  });
#else
  const int rows_b = 0, words_b = 0;
#endif
  for (int r = 0; r < rows; ++r)
    for (int w = r < rows_b ? words_b : 0; w < words; ++w) std::memcpy(dst + w * ld_dst + r, src + r * ld_src + w, 4);
}
// bf16 pairs as 32-bit words (transpose_words' operands)
template <typename T> inline uint32_t* as_words(T* p) { return reinterpret_cast<uint32_t*>(p); }
template <typename T> inline const uint32_t* as_words(const T* p) { return reinterpret_cast<const uint32_t*>(p); }

// Same, transposed: dst[c * ld + r] = src[r, c]. fp32 rows of unit stride go by transpose_words
// (fp32 K^T at d = 128 N = 1024 B=1 H=8: the forward 14.7 -> 12.3 ms on the Sapphire Rapids-class
// Xeon; the element loop wrote a column of the panel per element and zeroed it all first).
template <typename T>
inline void load_tile_transposed(acc_t* dst, int64_t ld, const T* src, int64_t row_stride, int64_t col_stride,
                                 int rows, int cols, int pad_rows, int pad_cols) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<acc_t, float>) {
    if (col_stride == 1) {
      if (rows < pad_rows || cols < pad_cols)
        for (int c = 0; c < pad_cols; ++c) std::fill(dst + c * ld, dst + c * ld + pad_rows, 0.0f);
      transpose_words(as_words(dst), ld, as_words(src), row_stride, rows, cols);
      return;
    }
  }
#if (ATTNCC_VECTOR_BYTES == 64 && defined(__AVX512F__)) || (ATTNCC_VECTOR_BYTES == 32 && defined(__AVX2__))
  // bf16/fp16 rows: each VL x VL block widened as it is loaded (vload_widened), then transposed
  if constexpr ((std::is_same_v<T, bf16_t> || std::is_same_v<T, fp16_t>) && std::is_same_v<acc_t, float>) {
    if (col_stride == 1) {
      if (rows < pad_rows || cols < pad_cols)
        for (int c = 0; c < pad_cols; ++c) std::fill(dst + c * ld, dst + c * ld + pad_rows, 0.0f);
      const int rows_v = rows / VL * VL, cols_v = cols / VL * VL;
      const auto widened = [&](int r, int c) { return vload_widened(src + r * row_stride + c); };
#if ATTNCC_VECTOR_BYTES == 64
      transpose_blocks16(as_words(dst), ld, rows_v, cols_v, [&](int r, int c) { return _mm512_castps_si512((__m512)widened(r, c)); });
#else
      transpose_blocks8(as_words(dst), ld, rows_v, cols_v, [&](int r, int c) { return _mm256_castps_si256((__m256)widened(r, c)); });
#endif
      for (int r = 0; r < rows; ++r)
        for (int c = r < rows_v ? cols_v : 0; c < cols; ++c) dst[c * ld + r] = to_acc(src[r * row_stride + c]);
      return;
    }
  }
#endif
  for (int c = 0; c < pad_cols; ++c)
    for (int r = 0; r < pad_rows; ++r) dst[c * ld + r] = 0;
  for (int r = 0; r < rows; ++r) {
    const T* s = src + r * row_stride;
    for (int c = 0; c < cols; ++c) dst[c * ld + r] = to_acc(s[c * col_stride]);
  }
}

// gemm's B operand in strips: `strip` columns each, a strip's rows one after the other, so that
// a register block's columns are one run of lines (gemm). The strip is one register block wide
// (kGemmStrip) where the columns are whole blocks, else all columns (rows as usual).
constexpr int kGemmStrip = ATTNCC_GEMM_VECS * VL;
inline int gemm_strip(int64_t columns) { return columns % kGemmStrip == 0 ? kGemmStrip : int(columns); }

// load_tile into strips (gemm_strip(pad_cols)): element (r, c) at dst[c / W pad_rows W + r W + c % W].
template <typename T>
inline void load_tile_strips(acc_t* dst, const T* src, int64_t row_stride, int64_t col_stride, int rows, int cols,
                             int pad_rows, int pad_cols) {
  const int strip = gemm_strip(pad_cols);
  for (int c0 = 0; c0 < pad_cols; c0 += strip)
    load_tile(dst + int64_t(c0) * pad_rows, strip, src + c0 * col_stride, row_stride, col_stride, rows,
              std::clamp(cols - c0, 0, strip), pad_rows, strip);
}

// load_tile_transposed into strips (gemm_strip(pad_rows)): src (r, c) at dst[r / W pad_cols W + c W + r % W].
template <typename T>
inline void load_tile_transposed_strips(acc_t* dst, const T* src, int64_t row_stride, int64_t col_stride, int rows,
                                        int cols, int pad_rows, int pad_cols) {
  const int strip = gemm_strip(pad_rows);
  for (int r0 = 0; r0 < pad_rows; r0 += strip)
    load_tile_transposed(dst + int64_t(r0) * pad_cols, strip, src + r0 * row_stride, row_stride, col_stride,
                         std::clamp(rows - r0, 0, strip), cols, strip, pad_cols);
}

// ---------------------------------------------------------------------------------- vectors
// Sum and max of a vector's lanes by halving (log2 lanes dependent steps, not lanes - 1; the
// compiler turns each step into one shuffle and one vector op).
inline acc_t lanes_sum(vec_t v) {
#if ATTNCC_VECTOR_BYTES == 64 && defined(__AVX512F__)
  // in registers: the array below made the compiler store and reload the vector on every row
  if constexpr (std::is_same_v<acc_t, float>) return _mm512_reduce_add_ps((__m512)v);
#endif
  acc_t a[VL];
  std::memcpy(a, &v, sizeof a);
#pragma GCC unroll 8
  for (int w = VL / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) a[l] += a[l + w];
  return a[0];
}
inline acc_t lanes_max(vec_t v) {
#if ATTNCC_VECTOR_BYTES == 64 && defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float>) return _mm512_reduce_max_ps((__m512)v);
#endif
  acc_t a[VL];
  std::memcpy(a, &v, sizeof a);
#pragma GCC unroll 8
  for (int w = VL / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) a[l] = a[l + w] > a[l] ? a[l + w] : a[l];
  return a[0];
}

inline vec_t vload(const acc_t* p) { vec_t v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(acc_t* p, vec_t v) { std::memcpy(p, &v, sizeof v); }
// VL values as stored, widened to acc_t in registers: decoding reads a cache's bf16/fp16 rows in
// place (a widened copy of each tile was a store and a reload per value, and its loads did not
// overlap the products).
inline vec_t vload_widened(const acc_t* p) { return vload(p); }
inline vec_t vload_widened(const bf16_t* p) {
  if constexpr (std::is_same_v<acc_t, float>) {  // bf16 is fp32's upper half
    // (zero-extending loads by intrinsics: GCC 12 at -mtune=sapphirerapids splits the generic
    // conversion below into five instructions a vector, two 256-bit halves put together, where
    // these take two; bf16 decoding from a warm cache on the Emerald Rapids-class Xeon ran at
    // ~60% of SDPA's pace on that)
#if ATTNCC_VECTOR_BYTES == 64 && defined(__AVX512F__)
    return vec_t(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16)));
#elif ATTNCC_VECTOR_BYTES == 32 && defined(__AVX2__)
    return vec_t(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16)));
#endif
    typedef uint16_t halves_t __attribute__((vector_size(ATTNCC_VECTOR_BYTES / 2)));
    typedef uint32_t words_t __attribute__((vector_size(ATTNCC_VECTOR_BYTES)));
    halves_t h;
    std::memcpy(&h, p, sizeof h);
    const words_t w = __builtin_convertvector(h, words_t) << 16;
    vec_t v;
    std::memcpy(&v, &w, sizeof v);
    return v;
  }
  acc_t a[VL];
  for (int l = 0; l < VL; ++l) a[l] = to_acc(p[l]);
  return vload(a);
}
inline vec_t vload_widened(const fp16_t* p) {
  if constexpr (std::is_same_v<acc_t, float>) {
#if ATTNCC_VECTOR_BYTES == 64 && defined(__AVX512F__)
    return vec_t(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif ATTNCC_VECTOR_BYTES == 32 && defined(__F16C__)
    return vec_t(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
  }
  acc_t a[VL];
  for (int l = 0; l < VL; ++l) a[l] = to_acc(p[l]);
  return vload(a);
}
// x - (+0) is x for every x (0 + x is not: -0 becomes +0), so the compiler drops it and
// broadcasts straight from memory
inline vec_t vbroadcast(acc_t x) { return x - vec_t{}; }

// Whether some lane of v exceeds t (NaN lanes do not), without reducing the lanes to a scalar.
inline bool any_lane_above(vec_t v, acc_t t) {
#if ATTNCC_VECTOR_BYTES == 64 && defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float>) return _mm512_cmp_ps_mask((__m512)v, _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#endif
  return lanes_max(v) > t;
}

// One register block of gemm: C[Rows x Vecs*VL] (+)= op(A)[Rows x K] . B[K x Vecs*VL], where
// op(A) is A (stored Rows x K, row stride lda) or, with TransA, A^T (A stored K x Rows): the
// backward's P^T dO and dS^T Q products read P and dS as they are, with no transposed copy.
// The Rows x Vecs accumulators, Vecs B vectors and a broadcast must fit the vector registers
// (the tiling pass sizes ATTNCC_GEMM_ROWS/VECS from the target's register count and FMA ports).
// Never inlined: GCC inlined the backward's dQ += dS0 K blocks into backward_fused, whose live
// registers around them sent copies of the accumulators to the stack and the rows' offsets to
// memory, reloaded in the k loop (avx2, d = 128: fwd+bwd fp32 N = 2048 1.055-1.085x with the
// block a function of its own, bench/ab_templates.py). Hidden: called directly, not through the
// kernel library's PLT. Objects compiled with ATTNCC_SHARED_INSTANCES (runtime/build.py: a
// generated kernel's) declare it only: its instances are compiled once per preamble (the end of
// this file) into the object every kernel library of that preamble links (`_shared_instances`),
// which took a kernel's own forward / backward objects from 2.1 / 2.6 to 1.7 / 1.8 s (fp32
// causal, GCC 12, a precompiled preamble): they had compiled the same 36 and 54 instances each.
template <bool Accumulate, bool TransA, int Rows, int Vecs, typename BT>
[[gnu::noinline, gnu::visibility("hidden")]] void gemm_block(acc_t* __restrict C, int64_t ldc, const acc_t* __restrict A, int64_t lda,
                       const BT* __restrict B, int64_t ldb, int K)
#if defined(ATTNCC_SHARED_INSTANCES) && !defined(ATTNCC_INSTANCES_SOURCE)
    ;
#else
{
  vec_t acc[Rows][Vecs];
#pragma GCC unroll 16
  for (int x = 0; x < Rows; ++x)
#pragma GCC unroll 4
    for (int y = 0; y < Vecs; ++y) acc[x][y] = Accumulate ? vload(C + x * ldc + y * VL) : vec_t{};
  for (int k = 0; k < K; ++k) {
    vec_t b[Vecs];
#pragma GCC unroll 4
    for (int y = 0; y < Vecs; ++y) b[y] = vload_widened(B + k * ldb + y * VL);
#pragma GCC unroll 16
    for (int x = 0; x < Rows; ++x) {
      const vec_t a = vbroadcast(TransA ? A[k * lda + x] : A[x * lda + k]);
#pragma GCC unroll 4
      for (int y = 0; y < Vecs; ++y) acc[x][y] += a * b[y];
    }
  }
#pragma GCC unroll 16
  for (int x = 0; x < Rows; ++x)
#pragma GCC unroll 4
    for (int y = 0; y < Vecs; ++y) vstore(C + x * ldc + y * VL, acc[x][y]);
}
#endif

// Row tails (R % ATTNCC_GEMM_ROWS rows) of one column block: each count is its own register block.
template <bool Accumulate, bool TransA, int Vecs, int Rows = ATTNCC_GEMM_ROWS - 1, typename BT>
inline void gemm_tail(int rows, acc_t* __restrict C, int64_t ldc, const acc_t* __restrict A, int64_t lda,
                      const BT* __restrict B, int64_t ldb, int K) {
  if constexpr (Rows > 0) {
    if (rows == Rows) return gemm_block<Accumulate, TransA, Rows, Vecs>(C, ldc, A, lda, B, ldb, K);
    gemm_tail<Accumulate, TransA, Vecs, Rows - 1>(rows, C, ldc, A, lda, B, ldb, K);
  }
}

// One column block (Vecs vectors wide) down all R rows: the block's B columns stay in L1 while
// the rows of op(A) stream past them.
template <bool Accumulate, bool TransA, int Vecs, typename BT>
inline void gemm_columns(acc_t* __restrict C, int64_t ldc, const acc_t* __restrict A, int64_t lda,
                         const BT* __restrict B, int64_t ldb, int R, int K) {
  constexpr int Rows = ATTNCC_GEMM_ROWS;
  const int64_t a_step = TransA ? 1 : lda;  // A offset of the next row of op(A)
  int r = 0;
  for (; r + Rows <= R; r += Rows) gemm_block<Accumulate, TransA, Rows, Vecs>(C + r * ldc, ldc, A + r * a_step, lda, B, ldb, K);
  if (r < R) gemm_tail<Accumulate, TransA, Vecs>(R - r, C + r * ldc, ldc, A + r * a_step, lda, B, ldb, K);
}

// C[R x Cn] (+)= op(A)[R x K] . B[K x Cn]; Cn a multiple of VL; row-major with leading
// dimensions lda, ldb, ldc; op(A) = A (R x K) or, with TransA, A^T (A stored K x R); B of acc_t
// or, widened as it is loaded, of a storage type (decoding's V rows in place). With `strip`
// (gemm_strip(Cn), and ldb == strip), B comes in strips of `strip` columns, each
// strip's K rows one after the other: column c of row k at B[(c / strip) K strip + k strip +
// c % strip]. A column block then reads K x 64 B in one run of lines instead of K rows ldb
// apart, which at ldb = 64 or 128 floats fall in 16 or 8 of L1's 64 sets and evict each other
// (the forward's K^T and V panels at d = 128: 256 and 512 B rows).
// Register-blocked ATTNCC_GEMM_ROWS rows x ATTNCC_GEMM_VECS vectors, column blocks outermost.
// Stays inline, not among the shared instances: compiled there and called, it took the fp32
// forward at d = 64, N = 512 to 1.05x the time (Zen 5, three alternating runs in one process).
template <bool Accumulate, bool TransA = false, typename BT>
inline void gemm(acc_t* __restrict C, int64_t ldc, const acc_t* __restrict A, int64_t lda,
                 const BT* __restrict B, int64_t ldb, int R, int Cn, int K, int strip = 0) {
  constexpr int Vecs = ATTNCC_GEMM_VECS;
  const auto columns = [&](int c) { return strip ? B + int64_t(c / strip) * K * strip + c % strip : B + c; };
  int c = 0;
  for (; c + Vecs * VL <= Cn; c += Vecs * VL) gemm_columns<Accumulate, TransA, Vecs>(C + c, ldc, A, lda, columns(c), ldb, R, K);
  // column tails two vectors wide where they can be: a Rows x 1 block has fewer accumulators than
  // FMA latency x ports (Bc = 96 at D = 128 left a third of S = Q K^T to it)
  if constexpr (Vecs > 2)
    for (; c + 2 * VL <= Cn; c += 2 * VL) gemm_columns<Accumulate, TransA, 2>(C + c, ldc, A, lda, columns(c), ldb, R, K);
  for (; c < Cn; c += VL) gemm_columns<Accumulate, TransA, 1>(C + c, ldc, A, lda, columns(c), ldb, R, K);
}

// 2^t lane by lane for t <= 0 (softmax's exponent, in base 2: the scale and the row max are
// multiplied by log2(e) once per row, so a score costs one FMA before the exponential).
// AVX-512: f = t - floor(t) in [0, 1), 2^f by a minimax polynomial (degree 6, relative error
// < 1e-7 in fp32 on [0, 1)), times 2^floor(t) by one vscalefps, which floors its exponent
// operand itself (so t goes in as it is: rounding to nearest needed a subtraction for n, one
// uop in the ten of a vector's bf16 exponential): exactly 0 for -inf (a masked score), NaN for NaN.
// Below t = -126 the result is denormal, whose microcode assist costs ~60 ns a vector unless
// the thread flushes denormals (KernelThread, which every kernel's threads hold: scores a
// hundred below the row's max made a bf16 forward 10x slower without it).
// Elsewhere n = round(t) and 2^(t - n) on [-1/2, 1/2] (the same accuracy), e^(t ln 2) by the
// Cody-Waite polynomial; double builds (gradcheck) call libm.
// `ForBf16`: for the forward's P when it is rounded to bf16 (steps of 2^-8 relative), degree 4
// (relative error < 2.7e-6; the row sum, so lse, keeps that accuracy: degree 3's 7.5e-5 put
// lse outside bf16 eager's error), two FMAs fewer per vector. Polynomials fitted by Lawson's
// iteration, evaluated by Horner's rule in fp32.
#if ATTNCC_VECTOR_BYTES == 64 && defined(__AVX512F__)
template <bool ForBf16 = false>
inline vfloat_t vexp2_nonpositive(vfloat_t t) {
  // f = t - floor(t) by one vreduceps (vrndscaleps is two uops). No clamp: vreduceps gives f = 0
  // for -inf and for every t below -2^23, and vscalefps returns exactly 0 for -inf (a masked
  // score) and any t below -149; NaN stays NaN.
  const __m512 f = _mm512_reduce_ps((__m512)t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p;
  if constexpr (ForBf16) {
    p = _mm512_fmadd_ps(_mm512_set1_ps(1.3534137e-2f), f, _mm512_set1_ps(5.2011464e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4144280e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9300383e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026f));
  } else {
    p = _mm512_fmadd_ps(_mm512_set1_ps(2.1702236e-4f), f, _mm512_set1_ps(1.2439691e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6788406e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5483341e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022983e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314700e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  }
  return (vfloat_t)_mm512_scalef_ps(p, (__m512)t);
}
#else
// n = round(t), 2^(t - n) by polynomials for [-1/2, 1/2] (degree 6: the Taylor series), 2^n by
// adding n to the exponent bits; exactly 0 below 2^-126.
template <bool ForBf16 = false>
inline vfloat_t vexp2_nonpositive(vfloat_t t) {
  const vint_t underflow = t < -126.0f;  // and -inf; false for NaN, which stays NaN
  const vfloat_t tc = underflow ? vfloat_t{} - 126.0f : t;
  const vfloat_t n = (tc + 12582912.0f) - 12582912.0f;  // round (1.5 * 2^23 trick)
  const vfloat_t f = tc - n;
  vfloat_t p;
  if constexpr (ForBf16) {
    p = f * 9.5700799e-3f + 5.5917837e-2f;
    p = p * f + 2.4024744e-1f;
    p = p * f + 6.9312179e-1f;
    p = p * f + 9.9999928e-1f;
  } else {
    p = f * 1.5403530393e-4f + 1.3333558146e-3f;
    p = p * f + 9.6181291076e-3f;
    p = p * f + 5.5504108665e-2f;
    p = p * f + 2.4022650696e-1f;
    p = p * f + 6.9314718056e-1f;
    p = p * f + 1.0f;
  }
  vint_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += to_int_lanes(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return underflow ? vfloat_t{} : p;
}
#endif

inline vdouble_t vexp2_nonpositive(vdouble_t t) {
  vdouble_t r;
  for (int l = 0; l < int(ATTNCC_VECTOR_BYTES / sizeof(double)); ++l) r[l] = std::exp2(t[l]);
  return r;
}
constexpr acc_t kLog2e = acc_t(1.44269504088896340736);

// The row's largest value per lane (of lane l: x[l], x[VL + l], ...), NaN lanes ignored (the max
// instruction keeps the running max when a lane is NaN); a NaN still reaches the softmax through
// exp(NaN - max) in its row sum. The forward reduces the lanes only when a row's max moves.
// Four chains of maxima: one chain waits out the max's latency (4 cycles) at every vector.
inline vec_t max_lanes(const acc_t* x, int n) {
  // (four named chains, not an array: GCC kept an array of them in memory, a store and a reload
  // per vector, measured as 11% of the bf16 forward's row work on the Sapphire Rapids-class Xeon)
  vec_t m0 = vbroadcast(-kInf), m1 = m0, m2 = m0, m3 = m0;
  int c = 0;
  for (; c + 4 * VL <= n; c += 4 * VL) {
    const vec_t v0 = vload(x + c), v1 = vload(x + c + VL), v2 = vload(x + c + 2 * VL), v3 = vload(x + c + 3 * VL);
    m0 = v0 > m0 ? v0 : m0;
    m1 = v1 > m1 ? v1 : m1;
    m2 = v2 > m2 ? v2 : m2;
    m3 = v3 > m3 ? v3 : m3;
  }
  for (; c < n; c += VL) { const vec_t v = vload(x + c); m0 = v > m0 ? v : m0; }
  m0 = m1 > m0 ? m1 : m0;  // (m lanes are never NaN: no NaN survives `v > m ? v : m`)
  m2 = m3 > m2 ? m3 : m2;
  return m2 > m0 ? m2 : m0;
}

inline bool has_nan(const acc_t* x, int n) {
  for (int c = 0; c < n; ++c)
    if (x[c] != x[c]) return true;
  return false;
}

// The exponent of exp(scale x - shift) is one FMA per score, x (scale log2 e) - shift log2 e,
// whose two products are rounded apart: an error of ~3 * 2^-24 |shift log2 e| in the exponent.
// Up to |shift| = kExactShiftAbove that is at most 2^(3 * 2^-24 * 2955) - 1 = 5e-4 of P (fp32
// scores of that size carry more error of their own); beyond, it grows with the shift until it
// leaves the exponential's range: rows of -1e30 fills came out NaN, a score of +1e10 took its
// row to 0 and lse -inf (session 52). Rows past it take the exact form, (scale x - shift) log2 e,
// whose difference is 0 at the row's max (shift is that max, computed as scale x is here).
constexpr acc_t kExactShiftAbove = 2048;

// v as rounded: GCC may not fuse the product it holds into a later FMA (-ffp-contract=fast).
// Through memory ("+m"; a store and a load, on rows past kExactShiftAbove only): a register
// constraint has no register class for a 64-byte vector where the source is built without
// AVX-512 (`attncc compile` sources built standalone at the baseline ISA).
template <typename V>
inline V rounded(V v) {
  asm("" : "+m"(v));
  return v;
}

// 2^((scale x - shift - residual) log2 e) for every vector of a row past kExactShiftAbove
// (exp_shift_lanes). residual: what the shift could not hold (the backward's lse residual).
template <bool ForBf16 = false, typename V>
inline V exp_exact_shift(V x, V scale, V shift, V residual) {
  const V t = ((rounded(x * scale) - shift) - residual) * vbroadcast(kLog2e);
  if constexpr (ForBf16) return vexp2_nonpositive<true>(t);
  else return vexp2_nonpositive(t);
}

// x[c] = exp(scale x[c] - shift) in place for shift >= max scale x - ln 256 (the forward's lazy
// rescaling: 2^t for t up to 8 is as exact as below 0); n a multiple of VL. (The forward folds
// the softmax scale in here where nothing else reads it.) Returns the row sum in lanes: the
// forward adds it to its lanes of l and reduces them once per row, not once per tile. Past
// kExactShiftAbove the exponent is scale x - shift - residual: the backward's shift is a row's lse
// (m + log l rounded to fp32, which past |m| ~ 1e5 loses log l) and its residual what the
// rounding lost (`lse_residual`); below, residual is under the rounding of the one-FMA exponent.
inline vec_t exp_shift_lanes(acc_t* x, int n, acc_t shift, acc_t scale = 1, acc_t residual = 0) {
  vec_t sum{};
  if (std::fabs(shift) > kExactShiftAbove) [[unlikely]] {
    const vec_t m = vbroadcast(shift), a = vbroadcast(scale), rest = vbroadcast(residual);
    for (int c = 0; c < n; c += VL) { vec_t v = exp_exact_shift(vload(x + c), a, m, rest); vstore(x + c, v); sum += v; }
    return sum;
  }
  const vec_t s = vbroadcast(shift * kLog2e), a = vbroadcast(scale * kLog2e);
  for (int c = 0; c < n; c += VL) { vec_t v = vexp2_nonpositive(vload(x + c) * a - s); vstore(x + c, v); sum += v; }
  return sum;
}

// The cache line at p, fetched into L1 (and L2): K/V rows read soon after, which the hardware
// prefetchers do not fetch in time (decoding's next key tile, the by-rows forward's next rows).
// prefetcht0, not prefetcht1 (into L2): more of t1's lines were still missing when read (Zen 5:
// paged decoding B=8 GQA 32/8 M=4096 D=128 fp32 1.07-1.08x, bf16 1.24-1.30x; contiguous bf16
// decoding 1.01-1.17x; an fp32 chunk of 16 queries from kv heads side by side 1.06x). An asm
// statement, not __builtin_prefetch: GCC deletes a loop whose body is only that builtin (it
// has no side effects), and with it the prefetches.
inline void prefetch_l1(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

inline void prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// sum a[k] b[k] over n (a multiple of VL).
inline acc_t dot(const acc_t* __restrict a, const acc_t* __restrict b, int n) {
  vec_t even{}, odd{};  // two chains: the FMA latency, not the loads, would bound one
  int k = 0;
  for (; k + 2 * VL <= n; k += 2 * VL) {
    even += vload(a + k) * vload(b + k);
    odd += vload(a + k + VL) * vload(b + k + VL);
  }
  for (; k < n; k += VL) even += vload(a + k) * vload(b + k);
  return lanes_sum(even + odd);
}

// out[j] = the sum of v[j]'s lanes, j < 4: the four vectors transposed as they are summed (9
// shuffles and adds for all four on AVX-512, against ~8 each for lanes_sum). (Not a template:
// the fp32 branches must compile where acc_t is double too, hence the casts.)
inline void lanes_sums4(const vec_t (&v)[4], acc_t* __restrict out) {
#if ATTNCC_VECTOR_BYTES == 64 && defined(__AVX512F__)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m512 a = (__m512)v[0], b = (__m512)v[1], c = (__m512)v[2], d = (__m512)v[3];
    // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3), the same of c and d
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    // per 128-bit lane: a's, b's, c's and d's partial sums
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    const __m512 sums = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                      _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(sums),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1)));
    _mm_storeu_ps(reinterpret_cast<float*>(out), _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
    return;
  }
#elif ATTNCC_VECTOR_BYTES == 32 && defined(__AVX2__)
  if constexpr (std::is_same_v<acc_t, float>) {
    const __m256 a = (__m256)v[0], b = (__m256)v[1], c = (__m256)v[2], d = (__m256)v[3];
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    const __m256d abd = _mm256_castps_pd(ab), cdd = _mm256_castps_pd(cd);
    const __m256 sums = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(abd, cdd)),
                                      _mm256_castpd_ps(_mm256_unpackhi_pd(abd, cdd)));
    _mm_storeu_ps(reinterpret_cast<float*>(out), _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
    return;
  }
#endif
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) out[j] = lanes_sum(v[j]);
}

// S[x * s_ld + y] = the sum of acc[x][y]'s lanes: a dot block's Rows x Keys sums.
template <int Rows, int Keys>
inline void store_block_sums(const vec_t (&acc)[Rows][Keys], acc_t* __restrict S, int64_t s_ld) {
#pragma GCC unroll 4
  for (int x = 0; x < Rows; ++x) {
    if constexpr (Keys == 4) lanes_sums4(acc[x], S + x * s_ld);
    else
      for (int y = 0; y < Keys; ++y) S[x * s_ld + y] = lanes_sum(acc[x][y]);
  }
}

// S[r * s_ld + c] = Q_r . K_c for Rows query rows (q_ld apart) and Keys key rows (k_ld apart)
// from k, over n (a multiple of VL): each vector of K, widened once, serves every row, and each
// vector of Q every key; the Rows x Keys sums are independent chains the core overlaps.
template <int Rows, int Keys, typename T>
inline void dot_block(acc_t* __restrict S, int64_t s_ld, const acc_t* __restrict Q, int64_t q_ld,
                      const T* __restrict k, int64_t k_ld, int n) {
  vec_t acc[Rows][Keys] = {};
  for (int d = 0; d < n; d += VL) {
    vec_t key[Keys];
#pragma GCC unroll 4
    for (int y = 0; y < Keys; ++y) key[y] = vload_widened(k + y * k_ld + d);
#pragma GCC unroll 4
    for (int x = 0; x < Rows; ++x) {
      const vec_t query = vload(Q + x * q_ld + d);
#pragma GCC unroll 4
      for (int y = 0; y < Keys; ++y) acc[x][y] += query * key[y];
    }
  }
  store_block_sums<Rows, Keys>(acc, S, s_ld);
}

// Query rows per dot_block: 4 x 4 keys take 16 accumulators, 4 keys and a query vector (21 of
// AVX-512's 32 registers); 2 x 4 on 16 registers. dot_rows takes blocks of keys from
// kDotBlockRows rows on (4 blocks: the next tile's prefetches spread over them).
constexpr int kDotRows = ATTNCC_VECTOR_BYTES == 64 ? 4 : 2;
constexpr int kDotKeys = 4;
constexpr int kDotBlockRows = 4 * kDotRows;

// S[r * s_ld + c] = Q_r . K_c for r < rows, c < cols: the query rows against key rows where they
// are stored (k_ld apart, of acc_t or a storage type widened in registers), n a multiple of VL;
// bf16 query rows (zero padded to whole 32-element pairs) against bf16 keys on vdpbf16ps.
// Decoding's scores, where a tile has fewer rows than packing K^T would pay for. From
// kDotBlockRows rows on, blocks of kDotRows rows x kDotKeys keys share their loads and reduce four
// keys' sums together; below, the products are few beside the loads of K (memory-bound decoding),
// and a key at a time keeps before_key's prefetches spread out. before_key(c) runs before key c's
// products (decoding prefetches the next tile's rows there: all lines of a row each; four rows'
// at once, before one block, stalled the loads: fp32 decoding 0.82x, N = 4 x 4 heads 0.75x).
template <typename TQ, typename T, typename BeforeKey>
inline void dot_rows(acc_t* __restrict S, int64_t s_ld, const TQ* __restrict Q, int64_t q_ld, int rows,
                     const T* __restrict K, int64_t k_ld, int cols, int n, BeforeKey&& before_key) {
  const int blocks = rows / kDotRows;
  int c = 0;
  if (rows >= kDotBlockRows) {
    for (; c + kDotKeys <= cols; c += kDotKeys) {
      const T* k = K + c * k_ld;
      int prefetched = 0;  // keys of this block whose next rows are asked for, spread over the row blocks
      for (int block = 0; block < blocks; ++block) {
        for (; prefetched < kDotKeys && prefetched * blocks <= block * kDotKeys; ++prefetched) before_key(c + prefetched);
        const int r = block * kDotRows;
        dot_block<kDotRows, kDotKeys>(S + r * s_ld + c, s_ld, Q + r * q_ld, q_ld, k, k_ld, n);
      }
      for (; prefetched < kDotKeys; ++prefetched) before_key(c + prefetched);
      for (int r = blocks * kDotRows; r < rows; ++r) dot_block<1, kDotKeys>(S + r * s_ld + c, s_ld, Q + r * q_ld, q_ld, k, k_ld, n);
    }
  }
  for (; c < cols; ++c) {
    before_key(c);
    const T* k = K + c * k_ld;
    int r = 0;
    for (; r + 4 <= rows; r += 4) dot_block<4, 1>(S + r * s_ld + c, s_ld, Q + r * q_ld, q_ld, k, k_ld, n);
    for (; r < rows; ++r) dot_block<1, 1>(S + r * s_ld + c, s_ld, Q + r * q_ld, q_ld, k, k_ld, n);
  }
}

// o[0..n) += sum over c < cols of p[c] rows[c ld + 0..n) (n a multiple of VL, rows of acc_t or
// a storage type widened in registers): one query row's P V against value rows as stored. O's
// row stays in registers, in two sets of accumulators (even and odd keys) so the FMAs of
// consecutive keys do not wait on each other. (A y += p x per key, which stored O's row and
// loaded it back key after key, took ~30% of fp32 MHA decoding's kernel time on cache-resident
// K/V; Zen 5, B=1 H=8 N=1 D=64: M=1024 1.28x, M=16384 1.11x, N=3 1.74x.)
template <int Vectors, typename T>
inline void row_times_rows_fixed(acc_t* __restrict o, const acc_t* __restrict p, const T* __restrict rows, int64_t ld,
                                 int cols) {
  vec_t even[Vectors], odd[Vectors];
#pragma GCC unroll 8
  for (int u = 0; u < Vectors; ++u) {
    even[u] = vload(o + u * VL);
    odd[u] = vec_t{};
  }
  int c = 0;
  for (; c + 2 <= cols; c += 2) {
    const vec_t w0 = vbroadcast(p[c]), w1 = vbroadcast(p[c + 1]);
    const T *r0 = rows + c * ld, *r1 = r0 + ld;
#pragma GCC unroll 8
    for (int u = 0; u < Vectors; ++u) {
      even[u] += w0 * vload_widened(r0 + u * VL);
      odd[u] += w1 * vload_widened(r1 + u * VL);
    }
  }
  if (c < cols) {
    const vec_t w = vbroadcast(p[c]);
#pragma GCC unroll 8
    for (int u = 0; u < Vectors; ++u) even[u] += w * vload_widened(rows + c * ld + u * VL);
  }
#pragma GCC unroll 8
  for (int u = 0; u < Vectors; ++u) vstore(o + u * VL, even[u] + odd[u]);
}

// Vectors of O's row held at once: two sets of them, the weights and a loaded vector fit the
// registers (32 on AVX-512, 16 below).
constexpr int kRowTimesRowsVectors = ATTNCC_VECTOR_BYTES == 64 ? 8 : 4;

template <typename T>
inline void row_times_rows(acc_t* o, const acc_t* p, const T* rows, int64_t ld, int cols, int n) {
  for (int d = 0; d < n; d += kRowTimesRowsVectors * VL) {
    switch (std::min(kRowTimesRowsVectors, (n - d) / VL)) {
      case 1: row_times_rows_fixed<1>(o + d, p, rows + d, ld, cols); break;
      case 2: row_times_rows_fixed<2>(o + d, p, rows + d, ld, cols); break;
      case 3: row_times_rows_fixed<3>(o + d, p, rows + d, ld, cols); break;
      case 4: row_times_rows_fixed<4>(o + d, p, rows + d, ld, cols); break;
#if ATTNCC_VECTOR_BYTES == 64
      case 5: row_times_rows_fixed<5>(o + d, p, rows + d, ld, cols); break;
      case 6: row_times_rows_fixed<6>(o + d, p, rows + d, ld, cols); break;
      case 7: row_times_rows_fixed<7>(o + d, p, rows + d, ld, cols); break;
      case 8: row_times_rows_fixed<8>(o + d, p, rows + d, ld, cols); break;
#endif
      default: break;
    }
  }
}

inline void scale_row(acc_t* x, int n, acc_t a) {
  const vec_t s = vbroadcast(a);
  for (int c = 0; c < n; c += VL) vstore(x + c, vload(x + c) * s);
}

// ---------------------------------------------------------------------------------- bf16 products
// ATTNCC_BF16_PRODUCTS says how a bf16 kernel multiplies its tiles: 0 widened to fp32 (gemm
// above), 1 on AMX tiles (tdpbf16ps: a 16 x 16 fp32 tile += 16 x 32 bf16 . 32 x 16 bf16), 2 with
// AVX512-BF16 dot products (vdpbf16ps: 16 fp32 lanes += 16 pairs of bf16 products). Both read
// the B operand pair-packed (Intel's "VNNI" layout): K/2 rows of N pairs, Bp[kp * ldb + 2 n + t]
// = B[2 kp + t][n], so one 32-bit word holds the two K-neighbours a dot-product step multiplies;
// A is row-major bf16. Products of bf16 are exact in fp32, and both units accumulate in fp32.
#ifndef ATTNCC_BF16_PRODUCTS
#define ATTNCC_BF16_PRODUCTS 0
#endif
constexpr int kBf16K = 32;  // every K of a bf16 product is padded to this (one AMX tile row)
constexpr int kBf16Rows = 16;  // ... and every row count (one AMX tile's rows)
constexpr int kBf16Block = 32;  // rows and columns of the AMX gemm_bf16's blocks of C (2 x 2 tiles)

#if ATTNCC_BF16_PRODUCTS == 1
}  // namespace attncc
#include <sys/syscall.h>
#include <unistd.h>
namespace attncc {
#endif
#if ATTNCC_BF16_PRODUCTS

// dot_block (above) of bf16 query rows, zero padded to a multiple of 32 elements, against bf16
// key rows as stored, on vdpbf16ps: 32 products a vector (16 with fp32 FMAs), none widened. The
// products of bf16 are exact in fp32; n is a multiple of 16 (a last 16 read as a half vector).
template <int Rows, int Keys>
inline void dot_block(float* __restrict S, int64_t s_ld, const bf16_t* __restrict Q, int64_t q_ld,
                      const bf16_t* __restrict k, int64_t k_ld, int n) {
  vec_t acc[Rows][Keys] = {};
  const auto pairs = [](const bf16_t* p, bool half) {
    return half ? (__m512bh)_mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
                : (__m512bh)_mm512_loadu_si512(p);
  };
  for (int d = 0; d < n; d += 32) {
    const bool half = n - d < 32;
    __m512bh key[Keys];
#pragma GCC unroll 4
    for (int y = 0; y < Keys; ++y) key[y] = pairs(k + y * k_ld + d, half);
#pragma GCC unroll 4
    for (int x = 0; x < Rows; ++x) {
      const __m512bh query = pairs(Q + x * q_ld + d, half);
#pragma GCC unroll 4
      for (int y = 0; y < Keys; ++y) acc[x][y] = vec_t(_mm512_dpbf16_ps(__m512(acc[x][y]), query, key[y]));
    }
  }
  store_block_sums<Rows, Keys>(acc, S, s_ld);
}

// n floats (a multiple of 16) -> bf16 bits, rounding to nearest even (vcvtneps2bf16).
inline void store_bf16(uint16_t* dst, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void to_bf16_row(uint16_t* __restrict dst, const float* __restrict src, int n) {
  for (int c = 0; c < n; c += 16) store_bf16(dst + c, _mm512_loadu_ps(src + c));
}

// x[c] (n a multiple of 16) as two bf16 terms, hi[c] = bf16(x[c]) and lo[c] = bf16(x[c] - hi[c]):
// hi + lo is x exactly where x has at most 16 significant bits (fp16 values), else within 2^-16.
inline void split_bf16(uint16_t* __restrict hi, uint16_t* __restrict lo, const float* __restrict x, int n) {
  for (int c = 0; c < n; c += 16) {
    const __m512 v = _mm512_loadu_ps(x + c);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 h_value = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + c), h);
    store_bf16(lo + c, _mm512_sub_ps(v, h_value));
  }
}

// dst[c] = bf16(a src[c]) for c < n, any n (the forward's output rows).
inline void to_bf16_scaled(uint16_t* __restrict dst, const float* __restrict src, int n, float a) {
  const __m512 s = _mm512_set1_ps(a);
  int c = 0;
  for (; c + 16 <= n; c += 16) store_bf16(dst + c, _mm512_mul_ps(_mm512_loadu_ps(src + c), s));
  if (c < n) {
    const __mmask16 tail = __mmask16((1u << (n - c)) - 1);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, src + c), s);
    _mm256_mask_storeu_epi16(dst + c, tail, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// Two bf16 rows (n a multiple of 16) as one row of n pairs: dst[2 c + t] = row t's element c,
// the pair-packed layout of a product's B operand (or TransA's A) along these rows.
inline void interleave_rows(uint16_t* __restrict dst, const uint16_t* __restrict row0, const uint16_t* __restrict row1,
                            int n) {
  for (int c = 0; c < n; c += 16) {
    const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0 + c)));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row1 + c)));
    _mm512_storeu_si512(dst + 2 * c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
  }
}
// rows (even) x n bf16, row-major with leading dimension ld, pair-packed by rows: rows / 2 rows of
// n pairs (2 n elements each).
inline void pack_row_pairs(uint16_t* __restrict dst, const uint16_t* __restrict src, int64_t ld, int rows, int n) {
  for (int r = 0; r < rows; r += 2) interleave_rows(dst + r * n, src + r * ld, src + (r + 1) * ld, n);
}

// exp_shift_lanes writing P as bf16 to p only (the operand of the P V product): one pass over the
// scores instead of exp, store, reload, convert.
inline vec_t exp_shift_lanes_bf16(const float* __restrict x, uint16_t* __restrict p, int n, float shift, float scale) {
  vec_t sum{}, sum2{};  // two chains of adds: one would make each vector wait for the last
  if (std::fabs(shift) > kExactShiftAbove) [[unlikely]] {
    const vec_t m = vbroadcast(shift), a = vbroadcast(scale);
    for (int c = 0; c < n; c += VL) {
      const vec_t v = exp_exact_shift<true>(vload(x + c), a, m, vec_t{});
      store_bf16(p + c, (__m512)v);
      sum += v;
    }
    return sum;
  }
  const vec_t s = vbroadcast(shift * kLog2e), a = vbroadcast(scale * kLog2e);
  int c = 0;
  for (; c + 2 * VL <= n; c += 2 * VL) {
    const vec_t v = vexp2_nonpositive<true>(vload(x + c) * a - s);
    const vec_t w = vexp2_nonpositive<true>(vload(x + c + VL) * a - s);
    // both vectors by one vcvtne2ps2bf16 (two uops for 32 lanes; vcvtneps2bf16 takes two for 16)
    _mm512_storeu_si512(p + c, (__m512i)_mm512_cvtne2ps_pbh((__m512)w, (__m512)v));
    sum += v;
    sum2 += w;
  }
  for (; c < n; c += VL) {
    const vec_t v = vexp2_nonpositive<true>(vload(x + c) * a - s);
    store_bf16(p + c, (__m512)v);
    sum += v;
  }
  return sum + sum2;
}
#endif

#if ATTNCC_BF16_PRODUCTS == 1
// Linux faults on AMX instructions until the process asks for the tile-data state; the runtime
// asks before it builds an AMX kernel (targets.amx_permitted), the kernel asks again (cheap, once).
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t column_bytes[16];
  uint8_t rows[16];
};

// Eight 16 x 64-byte tiles: 0-3 a 2 x 2 block of C, 4-5 two A row blocks, 6-7 two B column
// blocks. Loaded by each thread of a parallel region (KernelThread), not once per process:
// other code on the thread (oneDNN in torch) may load its own configuration between our calls.
inline void amx_configure() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.column_bytes[t] = 64;
  }
  _tile_loadconfig(&config);
}

// C[R x N] (+)= A[R x K] . B[K x N] (B pair-packed, leading dimension ldb elements of bf16, in
// strips of `strip` columns, each strip's K / 2 rows one after the other; 0: one strip); R, N
// multiples of 16, K a multiple of 32; 32 x 32 blocks of C, a 16-wide edge where needed. The
// thread holds a KernelThread (the tile configuration). After each block of C it calls
// between(): vector work of the caller's (the forward's softmax of rows whose scores are done)
// that the core runs while the tile unit finishes the block and stores it, instead of waiting;
// it must not touch the block's C, nor what A and B point to.
template <bool Accumulate, typename Between>
inline void gemm_bf16(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int R, int N,
                      int K, Between&& between, int strip = 0) {
  // GCC's tile loads are asm without a memory clobber: the stores before this call (A and B
  // written by the caller, between()'s in the call before) must not be moved past them.
  asm volatile("" ::: "memory");
  const int64_t sc = ldc * 4, sa = lda * 2, sb = ldb * 2;
  const auto b_at = [&](int k, int n) {
    return strip ? B + (int64_t(n / strip) * (K / 2) + k / 2) * ldb + 2 * (n % strip) : B + (k / 2) * ldb + 2 * n;
  };
  for (int r = 0; r < R; r += kBf16Block) {
    const bool two_rows = r + 16 < R;
    for (int n = 0; n < N; n += kBf16Block) {
      const bool two_cols = n + 16 < N;
      float* c = C + r * ldc + n;
      if (Accumulate) {
        _tile_loadd(0, c, sc);
        if (two_cols) _tile_loadd(1, c + 16, sc);
        if (two_rows) _tile_loadd(2, c + 16 * ldc, sc);
        if (two_rows && two_cols) _tile_loadd(3, c + 16 * ldc + 16, sc);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      for (int k = 0; k < K; k += kBf16K) {
        const uint16_t *a = A + r * lda + k, *b = b_at(k, n);
        _tile_loadd(4, a, sa);
        _tile_loadd(6, b, sb);
        _tile_dpbf16ps(0, 4, 6);
        if (two_cols) {
          _tile_loadd(7, b_at(k, n + 16), sb);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_rows) {
          _tile_loadd(5, a + 16 * lda, sa);
          _tile_dpbf16ps(2, 5, 6);
          if (two_cols) _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, c, sc);
      if (two_cols) _tile_stored(1, c + 16, sc);
      if (two_rows) _tile_stored(2, c + 16 * ldc, sc);
      if (two_rows && two_cols) _tile_stored(3, c + 16 * ldc + 16, sc);
      between();
    }
  }
}
#endif

#if ATTNCC_BF16_PRODUCTS
// Products by vdpbf16ps, on both bf16 levels (the amx level has avx512_bf16 too): the forward's
// on the avx512bf16 level, the backward's on both (its P^T and dS^T operands are read in place,
// TransA, which AMX tiles cannot). One register block: Rows x Vecs accumulators of 16 fp32, a
// pair of A broadcast per row. A is row-major (the pair of row x at kp is A[x lda + 2 kp ..]),
// or with TransA pair-packed like B (A^T's row x at kp is A[kp lda + 2 x ..]).
template <bool Accumulate, bool TransA, int Rows, int Vecs>
inline void gemm_dpbf16_block(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int K) {
  __m512 acc[Rows][Vecs];
#pragma GCC unroll 16
  for (int x = 0; x < Rows; ++x)
#pragma GCC unroll 4
    for (int y = 0; y < Vecs; ++y) acc[x][y] = Accumulate ? _mm512_loadu_ps(C + x * ldc + 16 * y) : _mm512_setzero_ps();
  for (int kp = 0; kp < K / 2; ++kp) {
    __m512bh b[Vecs];
#pragma GCC unroll 4
    for (int y = 0; y < Vecs; ++y) b[y] = (__m512bh)_mm512_loadu_si512(B + kp * ldb + 32 * y);
#pragma GCC unroll 16
    for (int x = 0; x < Rows; ++x) {
      int32_t pair;
      std::memcpy(&pair, TransA ? A + kp * lda + 2 * x : A + x * lda + 2 * kp, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int y = 0; y < Vecs; ++y) acc[x][y] = _mm512_dpbf16_ps(acc[x][y], a, b[y]);
    }
  }
#pragma GCC unroll 16
  for (int x = 0; x < Rows; ++x)
#pragma GCC unroll 4
    for (int y = 0; y < Vecs; ++y) _mm512_storeu_ps(C + x * ldc + 16 * y, acc[x][y]);
}
// The full-width blocks (ATTNCC_GEMM_VECS vectors), never inlined, hidden and compiled once per
// preamble, as gemm_block: each of a bf16 kernel's two objects compiled them before (with the
// one-vector tails, 14 instances, ~7 KB). The one-vector tails stay inline: shared too, the bf16
// fwd+bwd at d = 64, N = 256 took 1.025x the time (Zen 5, alternating runs in one process).
template <bool Accumulate, bool TransA, int Rows>
[[gnu::noinline, gnu::visibility("hidden")]] void gemm_dpbf16_wide_block(float* C, int64_t ldc, const uint16_t* A,
                                                                        int64_t lda, const uint16_t* B, int64_t ldb,
                                                                        int K)
#if defined(ATTNCC_SHARED_INSTANCES) && !defined(ATTNCC_INSTANCES_SOURCE)
    ;
#else
{
  gemm_dpbf16_block<Accumulate, TransA, Rows, ATTNCC_GEMM_VECS>(C, ldc, A, lda, B, ldb, K);
}
#endif

// The rows of one column block: blocks of ATTNCC_GEMM_ROWS, then the tail's own block size.
template <bool Accumulate, bool TransA, int Vecs, int Rows = ATTNCC_GEMM_ROWS>
inline void gemm_dpbf16_rows(int rows, float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B,
                             int64_t ldb, int K) {
  if constexpr (Rows > 0) {
    for (; rows >= Rows; rows -= Rows, C += Rows * ldc, A += TransA ? 2 * Rows : Rows * lda)
      if constexpr (Vecs == ATTNCC_GEMM_VECS) gemm_dpbf16_wide_block<Accumulate, TransA, Rows>(C, ldc, A, lda, B, ldb, K);
      else gemm_dpbf16_block<Accumulate, TransA, Rows, Vecs>(C, ldc, A, lda, B, ldb, K);
    if (rows > 0) gemm_dpbf16_rows<Accumulate, TransA, Vecs, Rows - 1>(rows, C, ldc, A, lda, B, ldb, K);
  }
}

// C[R x N] (+)= A[R x K] . B[K x N], B pair-packed (ldb elements of bf16 per pair row), N a
// multiple of 16, K of 2; any R.
template <bool Accumulate, bool TransA = false>
inline void gemm_dpbf16(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int R,
                        int N, int K) {
  constexpr int Vecs = ATTNCC_GEMM_VECS;
  int n = 0;
  for (; n + 16 * Vecs <= N; n += 16 * Vecs)
    gemm_dpbf16_rows<Accumulate, TransA, Vecs>(R, C + n, ldc, A, lda, B + 2 * n, ldb, K);
  for (; n < N; n += 16) gemm_dpbf16_rows<Accumulate, TransA, 1>(R, C + n, ldc, A, lda, B + 2 * n, ldb, K);
}
#endif

#if ATTNCC_BF16_PRODUCTS == 2
// The forward's products (same contract as the AMX gemm_bf16: R, N multiples of 16, K of 2;
// B in one strip; between() runs once, after the products: the same units do both here).
template <bool Accumulate, typename Between>
inline void gemm_bf16(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int R, int N,
                      int K, Between&& between, [[maybe_unused]] int strip = 0) {
  gemm_dpbf16<Accumulate>(C, ldc, A, lda, B, ldb, R, N, K);
  between();
}
#endif
#if ATTNCC_BF16_PRODUCTS
// ... with nothing between the blocks of C (the backward's products).
template <bool Accumulate>
inline void gemm_bf16(float* C, int64_t ldc, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, int R, int N,
                      int K) {
  gemm_bf16<Accumulate>(C, ldc, A, lda, B, ldb, R, N, K, [] {});
}
#endif

// What every kernel thread holds for the duration of a parallel region: denormals flushed and,
// on the amx level, the tile configuration gemm_bf16 multiplies with, released at the end.
// (ldtilecfg costs ~60 ns and waits for the tile unit: once per product it was ~1% of a bf16
// forward; a region's threads run nothing that could load another configuration.)
struct KernelThread {
  FlushDenormals flush_denormals;
#if ATTNCC_BF16_PRODUCTS == 1
  KernelThread() { amx_configure(); }
  ~KernelThread() { _tile_release(); }
#endif
};

// ---------------------------------------------------------------------------------- atomics
template <typename T>
inline void atomic_add(T* target, T value) {
  T expected, desired;
  __atomic_load(target, &expected, __ATOMIC_RELAXED);
  do { desired = expected + value; } while (!__atomic_compare_exchange(target, &expected, &desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
}

// ---------------------------------------------------------------------------------- dropout
// Keep flags for columns j0 .. j0 + n - 1 of row i (j0 a multiple of 4); out[c] = 1 keeps.
inline void dropout_keep_row(uint8_t* out, int n, uint64_t seed, uint64_t offset, int64_t bh, int64_t i, int64_t j0,
                             uint32_t threshold) {
  for (int c = 0; c < n; c += 4) {
    const Philox4 r = dropout_words(seed, offset, bh, i, j0 + c);
    for (int w = 0; w < 4 && c + w < n; ++w) out[c + w] = r.x[w] < threshold;
  }
}


// ---------------------------------------------------------------------------------- shared instances
// The shared instances object's source (runtime/build.py `_shared_instances`: the kernel's preamble
// after ATTNCC_INSTANCES_SOURCE): every gemm_block the kernel template's gemm calls can reach with
// this preamble's register block (gemm_columns' widths ATTNCC_GEMM_VECS, 2 and 1, each row count
// of gemm_tail): S = Q K^T and O = P V (accumulating or not), the backward's transposed products
// (dV += P^T dO, dK += dS^T Q) and decoding's O += P V on V rows as stored (B of the storage
// type, widened as it loads); on the bf16 levels the full-width vdpbf16ps blocks; and (above) the buffer
// pool's take and give. A form missing here fails the kernel's link, never its results.
#ifdef ATTNCC_INSTANCES_SOURCE
template <bool Accumulate, bool TransA, typename BT, int Vecs, int... Rows>
[[gnu::used]] void* const* gemm_block_rows(std::integer_sequence<int, Rows...>) {
  static void* const blocks[] = {reinterpret_cast<void*>(&gemm_block<Accumulate, TransA, Rows + 1, Vecs, BT>)...};
  return blocks;
}
template <bool Accumulate, bool TransA, typename BT>
void gemm_block_widths() {
  constexpr auto rows = std::make_integer_sequence<int, ATTNCC_GEMM_ROWS>{};
  gemm_block_rows<Accumulate, TransA, BT, ATTNCC_GEMM_VECS>(rows);
  if constexpr (ATTNCC_GEMM_VECS > 2) gemm_block_rows<Accumulate, TransA, BT, 2>(rows);
  gemm_block_rows<Accumulate, TransA, BT, 1>(rows);
}
[[gnu::used, gnu::visibility("hidden")]] void gemm_block_instances() {
  gemm_block_widths<false, false, acc_t>();
  gemm_block_widths<true, false, acc_t>();
  gemm_block_widths<true, true, acc_t>();
  gemm_block_widths<true, false, storage_t>();
}
#if ATTNCC_BF16_PRODUCTS
// The full-width vdpbf16ps blocks gemm_dpbf16 can reach: each row count of gemm_dpbf16_rows, in
// the forward's (accumulating or not) and the backward's transposed forms.
template <bool Accumulate, bool TransA, int... Rows>
[[gnu::used]] void* const* gemm_dpbf16_wide_block_rows(std::integer_sequence<int, Rows...>) {
  static void* const blocks[] = {reinterpret_cast<void*>(&gemm_dpbf16_wide_block<Accumulate, TransA, Rows + 1>)...};
  return blocks;
}
[[gnu::used, gnu::visibility("hidden")]] void gemm_dpbf16_wide_block_instances() {
  constexpr auto rows = std::make_integer_sequence<int, ATTNCC_GEMM_ROWS>{};
  gemm_dpbf16_wide_block_rows<false, false>(rows);
  gemm_dpbf16_wide_block_rows<true, false>(rows);
  gemm_dpbf16_wide_block_rows<true, true>(rows);
  gemm_dpbf16_wide_block_rows<false, true>(rows);
}
#endif
#endif

}  // namespace attncc
