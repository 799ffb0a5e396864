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
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

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
template <typename T> inline T min_of(T a, T b) { return a < b ? a : b; }
template <typename T> inline T max_of(T a, T b) { return a < b ? b : a; }
inline int64_t math_abs(int64_t x) { return x < 0 ? -x : x; }
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
// A 64-byte aligned scratch array owned by one thread.
struct Scratch {
  acc_t* data = nullptr;
  explicit Scratch(size_t n) {
    size_t bytes = ((n * sizeof(acc_t) + 63) / 64) * 64;
    data = static_cast<acc_t*>(std::aligned_alloc(64, bytes ? bytes : 64));
    std::memset(data, 0, bytes);
  }
  ~Scratch() { std::free(data); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// rows x cols of src (row stride `stride`, unit column stride) -> dst[r * ld + c], zero padded
// to pad_rows x pad_cols, converted to acc_t.
template <typename T>
inline void load_tile(acc_t* dst, int64_t ld, const T* src, int64_t row_stride, int64_t col_stride,
                      int rows, int cols, int pad_rows, int pad_cols, acc_t scale = acc_t(1)) {
  for (int r = 0; r < pad_rows; ++r) {
    acc_t* d = dst + r * ld;
    if (r < rows) {
      const T* s = src + r * row_stride;
      if (col_stride == 1) {  // the common layout: a loop the compiler vectorises
        for (int c = 0; c < cols; ++c) d[c] = to_acc(s[c]) * scale;
      } else {
        for (int c = 0; c < cols; ++c) d[c] = to_acc(s[c * col_stride]) * scale;
      }
      for (int c = cols; c < pad_cols; ++c) d[c] = 0;
    } else {
      for (int c = 0; c < pad_cols; ++c) d[c] = 0;
    }
  }
}

// Same, transposed: dst[c * ld + r] = src[r, c].
template <typename T>
inline void load_tile_transposed(acc_t* dst, int64_t ld, const T* src, int64_t row_stride, int64_t col_stride,
                                 int rows, int cols, int pad_rows, int pad_cols) {
  for (int c = 0; c < pad_cols; ++c)
    for (int r = 0; r < pad_rows; ++r) dst[c * ld + r] = 0;
  for (int r = 0; r < rows; ++r) {
    const T* s = src + r * row_stride;
    for (int c = 0; c < cols; ++c) dst[c * ld + r] = to_acc(s[c * col_stride]);
  }
}

// ---------------------------------------------------------------------------------- vectors
inline vec_t vload(const acc_t* p) { vec_t v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(acc_t* p, vec_t v) { std::memcpy(p, &v, sizeof v); }
// x - (+0) is x for every x (0 + x is not: -0 becomes +0), so the compiler drops it and
// broadcasts straight from memory
inline vec_t vbroadcast(acc_t x) { return x - vec_t{}; }

// One register block of gemm: C[Rows x Vecs*VL] (+)= op(A)[Rows x K] . B[K x Vecs*VL], where
// op(A) is A (stored Rows x K, row stride lda) or, with TransA, A^T (A stored K x Rows): the
// backward's P^T dO and dS^T Q products read P and dS as they are, with no transposed copy.
// The Rows x Vecs accumulators, Vecs B vectors and a broadcast must fit the vector registers
// (the tiling pass sizes ATTNCC_GEMM_ROWS/VECS from the target's register count and FMA ports).
template <bool Accumulate, bool TransA, int Rows, int Vecs>
inline void gemm_block(acc_t* __restrict C, int64_t ldc, const acc_t* __restrict A, int64_t lda,
                       const acc_t* __restrict B, int64_t ldb, int K) {
  vec_t acc[Rows][Vecs];
#pragma GCC unroll 16
  for (int x = 0; x < Rows; ++x)
#pragma GCC unroll 4
    for (int y = 0; y < Vecs; ++y) acc[x][y] = Accumulate ? vload(C + x * ldc + y * VL) : vec_t{};
  for (int k = 0; k < K; ++k) {
    vec_t b[Vecs];
#pragma GCC unroll 4
    for (int y = 0; y < Vecs; ++y) b[y] = vload(B + k * ldb + y * VL);
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

// Row tails (R % ATTNCC_GEMM_ROWS rows) of one column block: each count is its own register block.
template <bool Accumulate, bool TransA, int Vecs, int Rows = ATTNCC_GEMM_ROWS - 1>
inline void gemm_tail(int rows, acc_t* __restrict C, int64_t ldc, const acc_t* __restrict A, int64_t lda,
                      const acc_t* __restrict B, int64_t ldb, int K) {
  if constexpr (Rows > 0) {
    if (rows == Rows) return gemm_block<Accumulate, TransA, Rows, Vecs>(C, ldc, A, lda, B, ldb, K);
    gemm_tail<Accumulate, TransA, Vecs, Rows - 1>(rows, C, ldc, A, lda, B, ldb, K);
  }
}

// One column block (Vecs vectors wide) down all R rows: the block's B columns stay in L1 while
// the rows of op(A) stream past them.
template <bool Accumulate, bool TransA, int Vecs>
inline void gemm_columns(acc_t* __restrict C, int64_t ldc, const acc_t* __restrict A, int64_t lda,
                         const acc_t* __restrict B, int64_t ldb, int R, int K) {
  constexpr int Rows = ATTNCC_GEMM_ROWS;
  const int64_t a_step = TransA ? 1 : lda;  // A offset of the next row of op(A)
  int r = 0;
  for (; r + Rows <= R; r += Rows) gemm_block<Accumulate, TransA, Rows, Vecs>(C + r * ldc, ldc, A + r * a_step, lda, B, ldb, K);
  if (r < R) gemm_tail<Accumulate, TransA, Vecs>(R - r, C + r * ldc, ldc, A + r * a_step, lda, B, ldb, K);
}

// C[R x Cn] (+)= op(A)[R x K] . B[K x Cn]; Cn a multiple of VL; row-major with leading
// dimensions lda, ldb, ldc; op(A) = A (R x K) or, with TransA, A^T (A stored K x R).
// Register-blocked ATTNCC_GEMM_ROWS rows x ATTNCC_GEMM_VECS vectors, column blocks outermost.
template <bool Accumulate, bool TransA = false>
inline void gemm(acc_t* __restrict C, int64_t ldc, const acc_t* __restrict A, int64_t lda,
                 const acc_t* __restrict B, int64_t ldb, int R, int Cn, int K) {
  constexpr int Vecs = ATTNCC_GEMM_VECS;
  int c = 0;
  for (; c + Vecs * VL <= Cn; c += Vecs * VL) gemm_columns<Accumulate, TransA, Vecs>(C + c, ldc, A, lda, B + c, ldb, R, K);
  for (; c < Cn; c += VL) gemm_columns<Accumulate, TransA, 1>(C + c, ldc, A, lda, B + c, ldb, R, K);
}

// e^x lane by lane for x <= 0 (softmax's x = s - max): polynomial for float, libm for double
// builds (gradcheck).
inline vfloat_t vexp_nonpositive(vfloat_t x) { return exp_nonpositive(x); }

inline vdouble_t vexp_nonpositive(vdouble_t x) {
  vdouble_t r;
  for (int l = 0; l < int(ATTNCC_VECTOR_BYTES / sizeof(double)); ++l) r[l] = std::exp(x[l]);
  return r;
}

// The row's largest value, NaN lanes ignored (the max instruction keeps the running max when
// a lane is NaN); a NaN still reaches the softmax through exp(NaN - max) in its row sum.
inline acc_t row_max(const acc_t* x, int n) {
  vec_t m = vbroadcast(-kInf);
  for (int c = 0; c < n; c += VL) { const vec_t v = vload(x + c); m = v > m ? v : m; }
  acc_t r = -kInf;
  for (int l = 0; l < VL; ++l) r = m[l] > r ? acc_t(m[l]) : r;
  return r;
}

inline bool has_nan(const acc_t* x, int n) {
  for (int c = 0; c < n; ++c)
    if (x[c] != x[c]) return true;
  return false;
}

// x[c] = exp(x[c] - shift) in place for shift >= max x; returns the row sum. n a multiple of VL.
inline acc_t exp_shift_sum(acc_t* x, int n, acc_t shift) {
  vec_t sum{};
  const vec_t s = vbroadcast(shift);
  for (int c = 0; c < n; c += VL) { vec_t v = vexp_nonpositive(vload(x + c) - s); vstore(x + c, v); sum += v; }
  acc_t r = 0;
  for (int l = 0; l < VL; ++l) r += sum[l];
  return r;
}

// sum a[k] b[k] over n (a multiple of VL): one query row against one key row, where a tile has
// fewer rows than gemm's register block (decoding).
inline acc_t dot(const acc_t* __restrict a, const acc_t* __restrict b, int n) {
  vec_t even{}, odd{};  // two chains: the FMA latency, not the loads, would bound one
  int k = 0;
  for (; k + 2 * VL <= n; k += 2 * VL) {
    even += vload(a + k) * vload(b + k);
    odd += vload(a + k + VL) * vload(b + k + VL);
  }
  for (; k < n; k += VL) even += vload(a + k) * vload(b + k);
  const vec_t sum = even + odd;
  acc_t r = 0;
  for (int l = 0; l < VL; ++l) r += sum[l];
  return r;
}

// y += alpha x over n (a multiple of VL).
inline void axpy(acc_t* __restrict y, acc_t alpha, const acc_t* __restrict x, int n) {
  const vec_t a = vbroadcast(alpha);
  for (int k = 0; k < n; k += VL) vstore(y + k, vload(y + k) + a * vload(x + k));
}

inline void scale_row(acc_t* x, int n, acc_t a) {
  const vec_t s = vbroadcast(a);
  for (int c = 0; c < n; c += VL) vstore(x + c, vload(x + c) * s);
}

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

}  // namespace attncc
