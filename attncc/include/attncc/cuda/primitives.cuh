// attncc CUDA device primitives: the only architecture-specific code generated kernels call.
//
// Compiled by nvcc these are PTX instructions: mma.sync m16n8k16, ldmatrix (.trans), cp.async,
// warp shuffles, ex2. Compiled by the host C++ compiler with ATTNCC_EMULATE defined they run on
// attncc's CUDA emulator (emulator.h), so the exact same kernel text is tested on machines
// without a GPU. Fragment layouts follow the PTX ISA "Matrix Fragments for mma.m16n8k16"
// (g = lane >> 2, t = lane % 4).
//
// ATTNCC_ARCH (75, 80, 86, 89, 90; set by the generated kernel) selects the instructions: sm_75
// (Turing) has no m16n8k16, no bf16 mma and no cp.async, so there an m16n8k16 is two m16n8k8
// and a 16-byte async copy is a synchronous one; fp8 mma (m16n8k32) and cvt to e4m3 start with
// sm_89. The emulator follows the same choice, so the Turing decomposition is tested like the rest.
#pragma once

#ifndef ATTNCC_ARCH
#define ATTNCC_ARCH 80
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < ATTNCC_ARCH * 10
#error "attncc: this kernel was generated for a newer GPU architecture than the one nvcc compiles for"
#endif

#include <cstdint>
#include <type_traits>

#include "attncc/fp8bits.h"

#if defined(ATTNCC_EMULATE)
#include <cmath>
#include <cstring>
#include "attncc/cuda/emulator.h"
#include "attncc/halfbits.h"
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define threadIdx (attncc_emu::thread_idx())
#define blockIdx (attncc_emu::tls_block->block_idx)
#define blockDim (attncc_emu::tls_block->block_dim)
#define gridDim (attncc_emu::tls_block->grid_dim)
using attncc_emu::dim3;
typedef void* cudaStream_t;
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#endif

// The emulator's performance counters attribute each operation to the kernel source line that
// issued it: under ATTNCC_EMULATE every primitive takes that line as a defaulted last argument
// (ATTNCC_SITE; a primitive calling another passes it on with ATTNCC_AT_SITE). nvcc sees neither.
#if defined(ATTNCC_EMULATE)
#define ATTNCC_SITE , int line = __builtin_LINE()
#define ATTNCC_AT_SITE , line
#else
#define ATTNCC_SITE
#define ATTNCC_AT_SITE
#endif

namespace attncc {

// ------------------------------------------------------------------------------ types
#if defined(ATTNCC_EMULATE)
struct f16 { uint16_t bits; };
struct bf16 { uint16_t bits; };

inline float to_float(bf16 x) { return bf16_bits_to_float(x.bits); }
inline float to_float(f16 x) { return fp16_bits_to_float(x.bits); }
inline float to_float(float x) { return x; }

template <typename T> inline T from_float(float f);
template <> inline bf16 from_float<bf16>(float f) { return bf16{float_to_bf16_bits(f)}; }
template <> inline f16 from_float<f16>(float f) { return f16{float_to_fp16_bits(f)}; }
template <> inline float from_float<float>(float f) { return f; }
inline uint16_t bits_of(f16 x) { return x.bits; }
inline uint16_t bits_of(bf16 x) { return x.bits; }
inline float float_of_bits(uint32_t u) { return bits_to_float(u); }
struct alignas(8) f32x2 { float x, y; };  // CUDA's float2
#else
using f16 = __half;
using bf16 = __nv_bfloat16;
__device__ __forceinline__ float to_float(f16 x) { return __half2float(x); }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }
template <typename T> __device__ __forceinline__ T from_float(float f);
template <> __device__ __forceinline__ f16 from_float<f16>(float f) { return __float2half_rn(f); }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float f) { return __float2bfloat16_rn(f); }
template <> __device__ __forceinline__ float from_float<float>(float f) { return f; }
__device__ __forceinline__ uint16_t bits_of(f16 x) { return __half_as_ushort(x); }
__device__ __forceinline__ uint16_t bits_of(bf16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ float float_of_bits(uint32_t u) { return __uint_as_float(u); }
using f32x2 = float2;
#endif

// An fp8 byte (e4m3fn, or e5m2 with kE5M2; include/attncc/fp8bits.h) as float: exact.
template <bool kE5M2>
__device__ __forceinline__ float fp8_to_float(uint8_t byte) {
  return float_of_bits(kE5M2 ? fp8_e5m2_float_bits(byte) : fp8_e4m3_float_bits(byte));
}

// Two floats rounded to T and packed low-first into one 32-bit register (an mma operand pair).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  return uint32_t(bits_of(from_float<T>(lo))) | (uint32_t(bits_of(from_float<T>(hi))) << 16);
}

// ------------------------------------------------------------------------------ threads
__device__ __forceinline__ int thread_id() { return int(threadIdx.x); }
__device__ __forceinline__ int lane_id() { return int(threadIdx.x) & 31; }
__device__ __forceinline__ int warp_id() { return int(threadIdx.x) >> 5; }

#if defined(ATTNCC_EMULATE)
template <typename T> inline T* shared_memory() { return reinterpret_cast<T*>(attncc_emu::tls_block->smem); }
inline void block_sync(int line = __builtin_LINE()) { attncc_emu::syncthreads(line); }
#else
template <typename T> __device__ __forceinline__ T* shared_memory() {
  extern __shared__ __align__(16) unsigned char attncc_shared[];
  return reinterpret_cast<T*>(attncc_shared);
}
__device__ __forceinline__ void block_sync() { __syncthreads(); }
#endif

// ------------------------------------------------------------------------------ memory
// Plain loads and stores of shared and global memory (1 to 16 bytes per lane). On a GPU they
// are ordinary accesses; on the emulator they are also counted (bank conflicts, sectors).
#if defined(ATTNCC_EMULATE)
#define ATTNCC_COUNT(op, address) attncc_emu::record(attncc_emu::op, address, int(sizeof(*(address))), line)
#else
#define ATTNCC_COUNT(op, address)
#endif
template <typename T> __device__ __forceinline__ T ld_shared(const T* address ATTNCC_SITE) {
  ATTNCC_COUNT(kOpLdShared, address);
  return *address;
}
template <typename T> __device__ __forceinline__ void st_shared(T* address, T value ATTNCC_SITE) {
  ATTNCC_COUNT(kOpStShared, address);
  *address = value;
}
template <typename T> __device__ __forceinline__ T ld_global(const T* address ATTNCC_SITE) {
  ATTNCC_COUNT(kOpLdGlobal, address);
  return *address;
}
template <typename T> __device__ __forceinline__ void st_global(T* address, T value ATTNCC_SITE) {
  ATTNCC_COUNT(kOpStGlobal, address);
  *address = value;
}

// ------------------------------------------------------------------------------ emulated collectives
#if defined(ATTNCC_EMULATE)
namespace emu_ops {
using namespace attncc_emu;  // the CollectiveOp ids

// One mma.m16n8kK for the warp: lane l's inputs are K/4 A registers, K/8 B registers and 4 C
// floats (as bits); A a_i: row g (+8 if bit 1 of i), col 2t + (i & 1) (+8 if i >= 4);
// B b_i: row 2t + (i & 1) (+8 if i >= 2), col g; C c_i: row g (+8 if i >= 2), col 2t + (i & 1).
template <typename T, int K>
inline void mma_compute(attncc_emu::WarpSlot& s, unsigned) {
  constexpr int kARegs = K / 4, kBRegs = K / 8;
  float A[16][K], B[K][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int i = 0; i < 2 * kARegs; ++i) {
      const uint16_t h = uint16_t(s.in[l][i / 2] >> (16 * (i & 1)));
      A[g + 8 * ((i >> 1) & 1)][2 * t + (i & 1) + 8 * (i >= 4)] = to_float(T{h});
    }
    for (int i = 0; i < 2 * kBRegs; ++i) {
      const uint16_t h = uint16_t(s.in[l][kARegs + i / 2] >> (16 * (i & 1)));
      B[2 * t + (i & 1) + 8 * (i >= 2)][g] = to_float(T{h});
    }
    for (int i = 0; i < 4; ++i) C[g + 8 * (i >= 2)][2 * t + (i & 1)] = bits_to_float(s.in[l][kARegs + kBRegs + i]);
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i >= 2), col = 2 * t + (i & 1);
      float acc = C[row][col];
      for (int k = 0; k < K; ++k) acc += A[row][k] * B[k][col];
      s.out[l][i] = float_to_bits(acc);
    }
  }
}

// One mma.m16n8k32 with fp8 inputs ("Matrix Fragments for mma.m16n8k32", 8-bit types): lane
// l's inputs are 4 A registers of four e4m3 bytes, 2 B registers of four bytes (e5m2 with
// kBE5M2, else e4m3) and 4 C floats; A register r byte e: row g (+8 for odd r), col 4t + e (+16
// for r >= 2); B register r byte e: row 4t + e (+16 for r = 1), col g. Each product of two fp8
// values is exact in fp32; the sum runs in fp32 in k order (the hardware's accumulation order
// and width are its own: results agree to rounding).
template <bool kBE5M2>
inline void mma_fp8_compute(attncc_emu::WarpSlot& s, unsigned) {
  float A[16][32], B[32][8], C[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int r = 0; r < 4; ++r) {
      for (int e = 0; e < 4; ++e) {
        A[g + 8 * (r & 1)][4 * t + e + 16 * (r >> 1)] = float_of_bits(fp8_e4m3_float_bits(uint8_t(s.in[l][r] >> (8 * e))));
      }
    }
    for (int r = 0; r < 2; ++r) {
      for (int e = 0; e < 4; ++e) {
        const uint8_t byte = uint8_t(s.in[l][4 + r] >> (8 * e));
        B[4 * t + e + 16 * r][g] = float_of_bits(kBE5M2 ? fp8_e5m2_float_bits(byte) : fp8_e4m3_float_bits(byte));
      }
    }
    for (int i = 0; i < 4; ++i) C[g + 8 * (i >= 2)][2 * t + (i & 1)] = bits_to_float(s.in[l][6 + i]);
  }
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i >= 2), col = 2 * t + (i & 1);
      float acc = C[row][col];
      for (int k = 0; k < 32; ++k) acc += A[row][k] * B[k][col];
      s.out[l][i] = float_to_bits(acc);
    }
  }
}

template <bool Trans>
inline void ldmatrix_compute(attncc_emu::WarpSlot& s, unsigned) {
  for (int l = 0; l < 32; ++l) {
    if (reinterpret_cast<uintptr_t>(s.addr[l]) % 16 != 0) {
      attncc_emu::fail("ldmatrix: lane " + std::to_string(l) + " row address is not 16-byte aligned");
    }
  }
  for (int l = 0; l < 32; ++l) {
    for (int m = 0; m < 4; ++m) {
      uint16_t lo, hi;
      if (!Trans) {
        const uint16_t* row = static_cast<const uint16_t*>(s.addr[8 * m + (l >> 2)]);
        lo = row[2 * (l & 3)];
        hi = row[2 * (l & 3) + 1];
      } else {
        lo = static_cast<const uint16_t*>(s.addr[8 * m + 2 * (l & 3)])[l >> 2];
        hi = static_cast<const uint16_t*>(s.addr[8 * m + 2 * (l & 3) + 1])[l >> 2];
      }
      s.out[l][m] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
  }
}

inline void shfl_xor_compute(attncc_emu::WarpSlot& s, unsigned) {
  for (int l = 0; l < 32; ++l) s.out[l][0] = s.in[l ^ int(s.in[l][1])][0];
}
}  // namespace emu_ops
#endif

// ------------------------------------------------------------------------------ warp primitives
// Butterfly exchange over the full warp: lane l gets lane (l ^ lane_mask)'s value.
__device__ __forceinline__ float shfl_xor(float v, int lane_mask ATTNCC_SITE) {
#if defined(ATTNCC_EMULATE)
  uint32_t in[2] = {float_to_bits(v), uint32_t(lane_mask)}, out;
  attncc_emu::warp_collective(emu_ops::kShflXor, 0xffffffffu, in, 2, nullptr, &out, 1, emu_ops::shfl_xor_compute, line);
  return bits_to_float(out);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

// The same for 32-bit integers (moved bit for bit).
__device__ __forceinline__ uint32_t shfl_xor(uint32_t v, int lane_mask ATTNCC_SITE) {
#if defined(ATTNCC_EMULATE)
  uint32_t in[2] = {v, uint32_t(lane_mask)}, out;
  attncc_emu::warp_collective(emu_ops::kShflXor, 0xffffffffu, in, 2, nullptr, &out, 1, emu_ops::shfl_xor_compute, line);
  return out;
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

// c[0..3] += A (16x8, 2 regs) . B (8x8, 1 reg): fp16 inputs, fp32 accumulation (sm_75+).
__device__ __forceinline__ void mma_m16n8k8_f16(float c[4], const uint32_t a[2], uint32_t b ATTNCC_SITE) {
#if defined(ATTNCC_EMULATE)
  uint32_t in[7] = {a[0], a[1], b, float_to_bits(c[0]), float_to_bits(c[1]), float_to_bits(c[2]), float_to_bits(c[3])};
  uint32_t out[4];
  attncc_emu::warp_collective(emu_ops::kMmaF16K8, 0xffffffffu, in, 7, nullptr, out, 4, emu_ops::mma_compute<f16, 8>, line);
  for (int i = 0; i < 4; ++i) c[i] = bits_to_float(out[i]);
#else
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(b));
#endif
}

// c[0..3] += A (16x16, 4 regs) . B (16x8, 2 regs): fp16/bf16 inputs, fp32 accumulation.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float c[4], const uint32_t a[4], const uint32_t b[2] ATTNCC_SITE) {
#if ATTNCC_ARCH < 80
  // Turing: k = 0..7 are A registers 0, 1 and B register 0; k = 8..15 are A 2, 3 and B 1.
  static_assert(std::is_same<T, f16>::value, "sm_75 tensor cores take fp16, not bf16");
  mma_m16n8k8_f16(c, a, b[0] ATTNCC_AT_SITE);
  mma_m16n8k8_f16(c, a + 2, b[1] ATTNCC_AT_SITE);
#elif defined(ATTNCC_EMULATE)
  uint32_t in[10] = {a[0], a[1], a[2], a[3], b[0], b[1], float_to_bits(c[0]), float_to_bits(c[1]), float_to_bits(c[2]), float_to_bits(c[3])};
  uint32_t out[4];
  if constexpr (std::is_same<T, bf16>::value) {
    attncc_emu::warp_collective(emu_ops::kMmaBf16, 0xffffffffu, in, 10, nullptr, out, 4, emu_ops::mma_compute<bf16, 16>, line);
  } else {
    attncc_emu::warp_collective(emu_ops::kMmaF16, 0xffffffffu, in, 10, nullptr, out, 4, emu_ops::mma_compute<f16, 16>, line);
  }
  for (int i = 0; i < 4; ++i) c[i] = bits_to_float(out[i]);
#else
  if constexpr (std::is_same<T, bf16>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// c[0..3] += A (16x32, 4 regs of e4m3 bytes) . B (32x8, 2 regs of bytes: e5m2 with kBE5M2, else
// e4m3): fp8 inputs, fp32 accumulation (sm_89+; fragments as emu_ops::mma_fp8_compute says).
// Only kernels generated for sm_89 and newer call it.
template <bool kBE5M2>
__device__ __forceinline__ void mma_m16n8k32_fp8(float c[4], const uint32_t a[4], const uint32_t b[2] ATTNCC_SITE) {
#if defined(ATTNCC_EMULATE)
  uint32_t in[10] = {a[0], a[1], a[2], a[3], b[0], b[1], float_to_bits(c[0]), float_to_bits(c[1]), float_to_bits(c[2]), float_to_bits(c[3])};
  uint32_t out[4];
  attncc_emu::warp_collective(kBE5M2 ? emu_ops::kMmaFp8E5M2 : emu_ops::kMmaFp8, 0xffffffffu, in, 10, nullptr, out, 4,
                              emu_ops::mma_fp8_compute<kBE5M2>, line);
  for (int i = 0; i < 4; ++i) c[i] = bits_to_float(out[i]);
#elif ATTNCC_ARCH >= 89
  if constexpr (kBE5M2) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e5m2.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  __trap();
#endif
}

// Four floats rounded to e4m3 (nearest even, saturating to +-448) and packed low-first into one
// 32-bit register: x0 in the lowest byte (an fp8 mma operand register).
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
#if defined(ATTNCC_EMULATE)
  return uint32_t(fp8_e4m3_from_float(x0)) | (uint32_t(fp8_e4m3_from_float(x1)) << 8) |
         (uint32_t(fp8_e4m3_from_float(x2)) << 16) | (uint32_t(fp8_e4m3_from_float(x3)) << 24);
#elif ATTNCC_ARCH >= 89
  uint16_t low, high;  // cvt puts its first operand in the upper byte
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(low) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(high) : "f"(x3), "f"(x2));
  return uint32_t(low) | (uint32_t(high) << 16);
#else
  __trap();
  return 0;
#endif
}

// Four 8x8 b16 matrices from shared memory; lanes 8m..8m+7 give the row addresses of matrix m.
template <bool Trans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row_address ATTNCC_SITE) {
#if defined(ATTNCC_EMULATE)
  attncc_emu::warp_collective(Trans ? emu_ops::kLdmatrixTrans : emu_ops::kLdmatrix, 0xffffffffu, nullptr, 0, row_address, r, 4,
                              emu_ops::ldmatrix_compute<Trans>, line);
#else
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(row_address));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
  }
#endif
}

// ------------------------------------------------------------------------------ async copies
// 16 bytes global -> shared without registers; lands at cp_async_wait. sm_75 has no cp.async:
// there the copy is synchronous and commit/wait do nothing (the barrier after them remains).
__device__ __forceinline__ void cp_async_16(void* shared_dst, const void* global_src ATTNCC_SITE) {
#if ATTNCC_ARCH < 80 && defined(ATTNCC_EMULATE)
  attncc_emu::record(attncc_emu::kOpLdGlobal, global_src, 16, line);  // a load and a store on Turing
  attncc_emu::record(attncc_emu::kOpStShared, shared_dst, 16, line);
  std::memcpy(shared_dst, global_src, 16);
#elif ATTNCC_ARCH < 80
  *static_cast<uint4*>(shared_dst) = *static_cast<const uint4*>(global_src);
#elif defined(ATTNCC_EMULATE)
  attncc_emu::cp_async(shared_dst, global_src, 16, line);
#else
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global_src));
#endif
}
// The same where `copy`, else 16 zero bytes, global_src unread: one instruction either way
// (cp.async's source size 0 zero-fills), so that a tile's last rows need no branch.
__device__ __forceinline__ void cp_async_16_or_zeros(void* shared_dst, const void* global_src, bool copy ATTNCC_SITE) {
#if ATTNCC_ARCH < 80 || defined(ATTNCC_EMULATE)
  if (copy) {
    cp_async_16(shared_dst, global_src ATTNCC_AT_SITE);
  } else {
    for (int e = 0; e < 4; ++e) st_shared(static_cast<uint32_t*>(shared_dst) + e, 0u ATTNCC_AT_SITE);
  }
#else
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global_src), "r"(copy ? 16 : 0));
#endif
}
// 4 bytes global -> shared where `copy`, else 4 zero bytes (global_src unread), in the current
// group: a row statistic (lse, delta) fetched with its tile instead of by a load each thread
// waits for.
__device__ __forceinline__ void cp_async_4_or_zero(float* shared_dst, const float* global_src, bool copy ATTNCC_SITE) {
#if ATTNCC_ARCH < 80
  st_shared(shared_dst, copy ? ld_global(global_src ATTNCC_AT_SITE) : 0.0f ATTNCC_AT_SITE);
#elif defined(ATTNCC_EMULATE)
  if (copy) {
    attncc_emu::cp_async(shared_dst, global_src, 4, line);
  } else {
    st_shared(shared_dst, 0.0f ATTNCC_AT_SITE);
  }
#else
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address), "l"(global_src), "r"(copy ? 4 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if ATTNCC_ARCH < 80
#elif defined(ATTNCC_EMULATE)
  attncc_emu::cp_async_commit();
#else
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Wait until at most `Pending` committed groups are still in flight.
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
#if ATTNCC_ARCH < 80
#elif defined(ATTNCC_EMULATE)
  attncc_emu::cp_async_wait(Pending);
#else
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
#endif
}

// ------------------------------------------------------------------------------ math
// Used by generated expressions (the CPU header defines the same names; NaN from either operand).
template <typename T> __device__ __forceinline__ T min_of(T a, T b) { return (a < b || a != a) ? a : b; }
template <typename T> __device__ __forceinline__ T max_of(T a, T b) { return (b < a || a != a) ? a : b; }
__device__ __forceinline__ int64_t math_abs(int64_t x) { return x < 0 ? int64_t(uint64_t(0) - uint64_t(x)) : x; }  // wraps, as torch
__device__ __forceinline__ float math_abs(float x) { return fabsf(x); }
__device__ __forceinline__ float math_exp(float x) { return expf(x); }
__device__ __forceinline__ float math_log(float x) { return logf(x); }
__device__ __forceinline__ float math_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ float math_sqrt(float x) { return sqrtf(x); }
// As the CPU header: guards against b == 0 and INT64_MIN / -1 (the runtime rejects divisors
// that can be 0; the emulator must not trap on a missed case).
__device__ __forceinline__ int64_t floordiv(int64_t a, int64_t b) {
  if (b == 0) return 0;
  if (b == -1) return static_cast<int64_t>(uint64_t(0) - static_cast<uint64_t>(a));
  const int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ int64_t pymod(int64_t a, int64_t b) {
  if (b == 0 || b == -1) return 0;
  const int64_t r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}

__device__ __forceinline__ float fast_exp2(float x ATTNCC_SITE) {
#if defined(ATTNCC_EMULATE)
  attncc_emu::record(attncc_emu::kOpExp2, nullptr, 0, line);
  return std::exp2(x);
#else
  return exp2f(x);
#endif
}

__device__ __forceinline__ void atomic_add(float* address, float value ATTNCC_SITE) {
#if defined(ATTNCC_EMULATE)
  ATTNCC_COUNT(kOpAtomicGlobal, address);
  *address += value;  // fibers of a block never run concurrently; blocks run one by one
#else
  atomicAdd(address, value);
#endif
}

// address[0] += lo, address[1] += hi (address 8-byte aligned): one vector atomic on sm_90
// (atomicAdd on float2, global memory), two scalar ones before.
__device__ __forceinline__ void atomic_add_pair(float* address, float lo, float hi ATTNCC_SITE) {
#if ATTNCC_ARCH >= 90 && defined(ATTNCC_EMULATE)
  attncc_emu::record(attncc_emu::kOpAtomicGlobal, address, 8, line);
  address[0] += lo;
  address[1] += hi;
#elif ATTNCC_ARCH >= 90
  atomicAdd(reinterpret_cast<float2*>(address), make_float2(lo, hi));
#else
  atomic_add(address, lo ATTNCC_AT_SITE);
  atomic_add(address + 1, hi ATTNCC_AT_SITE);
#endif
}

__device__ __forceinline__ void atomic_add(int64_t* address, int64_t value ATTNCC_SITE) {  // wraps as two's complement
#if defined(ATTNCC_EMULATE)
  ATTNCC_COUNT(kOpAtomicGlobal, address);
  *address = int64_t(uint64_t(*address) + uint64_t(value));
#else
  atomicAdd(reinterpret_cast<unsigned long long*>(address), static_cast<unsigned long long>(value));
#endif
}

__device__ __forceinline__ void atomic_max(int32_t* address, int32_t value ATTNCC_SITE) {
#if defined(ATTNCC_EMULATE)
  ATTNCC_COUNT(kOpAtomicGlobal, address);
  if (value > *address) *address = value;
#else
  atomicMax(address, value);
#endif
}

__device__ __forceinline__ void atomic_or(int32_t* address, int32_t value ATTNCC_SITE) {
#if defined(ATTNCC_EMULATE)
  ATTNCC_COUNT(kOpAtomicGlobal, address);
  *address |= value;
#else
  atomicOr(address, value);
#endif
}

// `value` * 2^shift rounded to the nearest integer (ties to even): a term on a fixed-point grid.
__device__ __forceinline__ int64_t to_fixed_point(float value, int shift) {
#if defined(ATTNCC_EMULATE)
  return static_cast<int64_t>(std::llrint(std::ldexp(double(value), shift)));
#else
  return static_cast<int64_t>(llrint(ldexp(double(value), shift)));
#endif
}

// The bits of a float as an int32 (non-negative floats order like their bits).
__device__ __forceinline__ int32_t float_bits(float value) {
#if defined(ATTNCC_EMULATE)
  int32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
#else
  return __float_as_int(value);
#endif
}

}  // namespace attncc

#if defined(ATTNCC_EMULATE)
#define ATTNCC_LAUNCH(kernel, grid, block, smem, stream, ...) \
  attncc_emu::launch(#kernel, grid, block, smem, [&]() { kernel(__VA_ARGS__); })
#else
namespace attncc {
// What the CUDA runtime said when it refused a launch (read through attncc_cuda_error()).
inline char* launch_error_text() {
  static char text[512];
  return text;
}
inline bool launch_failed(const char* kernel, cudaError_t error, int smem) {
  if (error == cudaSuccess) return false;
  snprintf(launch_error_text(), 512, "CUDA launch of %s (%d B dynamic shared memory) failed: %s (%s)", kernel, smem,
           cudaGetErrorString(error), cudaGetErrorName(error));
  return true;
}
}  // namespace attncc
// Why the last launch was refused. Weak: every kernel library defines it, and two generated
// kernels linked into one program must not clash.
extern "C" __attribute__((weak)) const char* attncc_cuda_error() { return attncc::launch_error_text(); }
// Launches on `stream`; returns 4 from the calling entry point if the runtime refuses the launch
// (shared memory above the device's limit, too many registers, a bad configuration): a
// refused launch must not leave outputs silently unwritten. The kernel's dynamic shared memory
// (a compile-time constant) is allowed once per device, not on every launch. Launches are
// asynchronous: with CUDA_LAUNCH_BLOCKING=1 a kernel's own failure surfaces at its call.
#define ATTNCC_LAUNCH(kernel, grid, block, smem, stream, ...)                                                  \
  do {                                                                                                         \
    static bool attncc_allowed[64] = {};                                                                       \
    int attncc_device = 0;                                                                                     \
    cudaError_t attncc_error = cudaGetDevice(&attncc_device);                                                  \
    if (attncc_error == cudaSuccess && (attncc_device >= 64 || !attncc_allowed[attncc_device])) {              \
      attncc_error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));     \
      if (attncc_error == cudaSuccess && attncc_device < 64) attncc_allowed[attncc_device] = true;              \
    }                                                                                                          \
    if (attncc_error == cudaSuccess) {                                                                         \
      kernel<<<grid, block, smem, static_cast<cudaStream_t>(stream)>>>(__VA_ARGS__);                           \
      attncc_error = cudaGetLastError();                                                                       \
    }                                                                                                          \
    if (attncc::launch_failed(#kernel, attncc_error, int(smem))) return 4;                                     \
  } while (0)
#endif
