// attncc CPU primitives: the small, separately tested building blocks every generated CPU
// kernel calls. Plain C++17 with GCC vector extensions; no torch headers, so a variant's
// translation unit compiles in seconds.
//
// The including file defines ATTNCC_ACC_T (float or double) and ATTNCC_STORAGE_T (the
// q/k/v element type: float, double, attncc::bf16_t or attncc::fp16_t).
#pragma once

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
using storage_t = ATTNCC_STORAGE_T;
typedef acc_t vec_t __attribute__((vector_size(64)));
constexpr int VL = 64 / sizeof(acc_t);  // lanes per vector
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
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef double v8d __attribute__((vector_size(64)));
inline int32_t to_int_lanes(float n) { return int32_t(n); }
inline v16i to_int_lanes(v16f n) { return __builtin_convertvector(n, v16i); }

template <typename F>
inline F exp_cody_waite(F x) {
  const F lo = F{} - 87.3365f, hi = F{} + 88.7228f;
  const auto underflow = x < lo;
  F xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const F n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round (1.5 * 2^23 trick)
  const F f = (xc - n * 0.693359375f) + n * 2.12194440e-4f;            // x - n ln2 in two parts
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
  return underflow ? F{} : (x > hi ? F{} + __builtin_huge_valf() : r);  // overflow: inf, as libm
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

inline void transpose(acc_t* dst, int64_t ld_dst, const acc_t* src, int64_t ld_src, int rows, int cols) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) dst[c * ld_dst + r] = src[r * ld_src + c];
}

// ---------------------------------------------------------------------------------- vectors
inline vec_t vload(const acc_t* p) { vec_t v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(acc_t* p, vec_t v) { std::memcpy(p, &v, sizeof v); }
inline vec_t vbroadcast(acc_t x) { return vec_t{} + x; }

// C[R x Cn] (+)= A[R x K] . B[K x Cn]; R a multiple of 4, Cn a multiple of VL; row-major with
// leading dimensions lda, ldb, ldc. Register-blocked 4 rows x 2 vectors (8 accumulators).
template <bool Accumulate>
inline void gemm(acc_t* __restrict C, int64_t ldc, const acc_t* __restrict A, int64_t lda,
                 const acc_t* __restrict B, int64_t ldb, int R, int Cn, int K) {
  for (int r = 0; r < R; r += 4) {
    const acc_t* a0 = A + (r + 0) * lda;
    const acc_t* a1 = A + (r + 1) * lda;
    const acc_t* a2 = A + (r + 2) * lda;
    const acc_t* a3 = A + (r + 3) * lda;
    int c = 0;
    for (; c + 2 * VL <= Cn; c += 2 * VL) {
      vec_t acc[4][2];
      for (int x = 0; x < 4; ++x)
        for (int y = 0; y < 2; ++y)
          acc[x][y] = Accumulate ? vload(C + (r + x) * ldc + c + y * VL) : vec_t{};
      for (int k = 0; k < K; ++k) {
        const vec_t b0 = vload(B + k * ldb + c), b1 = vload(B + k * ldb + c + VL);
        const vec_t x0 = vbroadcast(a0[k]), x1 = vbroadcast(a1[k]), x2 = vbroadcast(a2[k]), x3 = vbroadcast(a3[k]);
        acc[0][0] += x0 * b0; acc[0][1] += x0 * b1;
        acc[1][0] += x1 * b0; acc[1][1] += x1 * b1;
        acc[2][0] += x2 * b0; acc[2][1] += x2 * b1;
        acc[3][0] += x3 * b0; acc[3][1] += x3 * b1;
      }
      for (int x = 0; x < 4; ++x)
        for (int y = 0; y < 2; ++y) vstore(C + (r + x) * ldc + c + y * VL, acc[x][y]);
    }
    for (; c < Cn; c += VL) {
      vec_t acc[4];
      for (int x = 0; x < 4; ++x) acc[x] = Accumulate ? vload(C + (r + x) * ldc + c) : vec_t{};
      for (int k = 0; k < K; ++k) {
        const vec_t b0 = vload(B + k * ldb + c);
        acc[0] += vbroadcast(a0[k]) * b0;
        acc[1] += vbroadcast(a1[k]) * b0;
        acc[2] += vbroadcast(a2[k]) * b0;
        acc[3] += vbroadcast(a3[k]) * b0;
      }
      for (int x = 0; x < 4; ++x) vstore(C + (r + x) * ldc + c, acc[x]);
    }
  }
}

inline v16f vexp_impl(v16f x) { return exp_cody_waite(x); }

inline v8d vexp_impl(v8d x) {  // double builds (gradcheck): exact libm exp per lane
  v8d r;
  for (int l = 0; l < 8; ++l) r[l] = std::exp(x[l]);
  return r;
}

inline vec_t vexp(vec_t x) { return vexp_impl(x); }

// max that keeps NaN (std::max and a plain compare drop it): a NaN score makes its row NaN,
// as in eager softmax, instead of looking fully masked
inline acc_t nan_max(acc_t a, acc_t b) { return (b > a || b != b) ? b : a; }

inline acc_t row_max(const acc_t* x, int n) {
  vec_t m = vbroadcast(-kInf);
  for (int c = 0; c < n; c += VL) { vec_t v = vload(x + c); m = (v > m) | (v != v) ? v : m; }
  acc_t r = -kInf;
  for (int l = 0; l < VL; ++l) r = nan_max(r, acc_t(m[l]));
  return r;
}

// x[c] = exp(x[c] - shift) in place; returns the row sum. n a multiple of VL.
inline acc_t exp_shift_sum(acc_t* x, int n, acc_t shift) {
  vec_t sum{};
  const vec_t s = vbroadcast(shift);
  for (int c = 0; c < n; c += VL) { vec_t v = vexp(vload(x + c) - s); vstore(x + c, v); sum += v; }
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
inline void atomic_add(acc_t* target, acc_t value) {
  acc_t expected, desired;
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
