// Probe kernels for the device primitives (attncc/cuda/primitives.cuh). The same text runs on
// a GPU (nvcc) and on the host emulator (ATTNCC_EMULATE); bench/probe_primitives.py diffs the
// two bit for bit, and tests/test_emulator.py checks the emulator against host references.
// Launchers take device pointers on a GPU and host pointers on the emulator. Define ATTNCC_ARCH
// (75, 80, 86, 90) before including this file to probe that architecture's instruction choice.
#include "attncc/cuda/primitives.cuh"

namespace probe {
using namespace attncc;

// A (16x16) and B^T (8x16), row-major halves -> C (16x8) fp32 through ldmatrix + mma.
template <typename T>
__global__ void mma_kernel(const T* a, const T* bt, float* c) {
  T* sa = shared_memory<T>();
  T* sb = sa + 16 * 16;
  for (int e = thread_id(); e < 16 * 16; e += 32) sa[e] = a[e];
  for (int e = thread_id(); e < 8 * 16; e += 32) sb[e] = bt[e];
  block_sync();
  const int lane = lane_id();
  uint32_t af[4], bf[4];
  ldmatrix_x4<false>(af, sa + ((lane & 7) + ((lane >> 3) & 1) * 8) * 16 + (lane >> 4) * 8);
  // B^T rows are the mma's columns: matrices 0, 1 = columns 0-7 / 8-15 of the 8 rows
  ldmatrix_x4<false>(bf, sb + (lane & 7) * 16 + ((lane >> 3) & 1) * 8);
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  mma_m16n8k16<T>(acc, af, bf);
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) c[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = acc[i];
}

// ldmatrix (.trans or not) of a 16x16 matrix: out[lane * 4 + m] = register m of the lane.
template <bool Trans>
__global__ void ldmatrix_kernel(const f16* src, uint32_t* out) {
  f16* sm = shared_memory<f16>();
  for (int e = thread_id(); e < 256; e += 32) sm[e] = src[e];
  block_sync();
  const int lane = lane_id();
  uint32_t r[4];
  ldmatrix_x4<Trans>(r, sm + ((lane & 7) + ((lane >> 3) & 1) * 8) * 16 + (lane >> 4) * 8);
  for (int m = 0; m < 4; ++m) out[lane * 4 + m] = r[m];
}

// out[k * 32 + lane] = in[lane ^ (1 << k)]
__global__ void shuffle_kernel(const float* in, float* out) {
  const int lane = lane_id();
  for (int k = 0; k < 5; ++k) out[k * 32 + lane] = shfl_xor(in[lane], 1 << k);
}
}  // namespace probe

// Launchers return 0, or 4 when the CUDA runtime refuses the launch (ATTNCC_LAUNCH returns it).
extern "C" int probe_mma_f16(const void* a, const void* bt, float* c) {
  ATTNCC_LAUNCH(probe::mma_kernel<attncc::f16>, dim3(1), dim3(32), 16 * 24 * 2, nullptr, static_cast<const attncc::f16*>(a), static_cast<const attncc::f16*>(bt), c);
  return 0;
}
#if ATTNCC_ARCH >= 80  // bf16 tensor cores start with sm_80
extern "C" int probe_mma_bf16(const void* a, const void* bt, float* c) {
  ATTNCC_LAUNCH(probe::mma_kernel<attncc::bf16>, dim3(1), dim3(32), 16 * 24 * 2, nullptr, static_cast<const attncc::bf16*>(a), static_cast<const attncc::bf16*>(bt), c);
  return 0;
}
#endif
extern "C" int probe_ldmatrix(const void* src, uint32_t* out, int trans) {
  if (trans) ATTNCC_LAUNCH(probe::ldmatrix_kernel<true>, dim3(1), dim3(32), 512, nullptr, static_cast<const attncc::f16*>(src), out);
  else ATTNCC_LAUNCH(probe::ldmatrix_kernel<false>, dim3(1), dim3(32), 512, nullptr, static_cast<const attncc::f16*>(src), out);
  return 0;
}
extern "C" int probe_shuffles(const float* in, float* out) {
  ATTNCC_LAUNCH(probe::shuffle_kernel, dim3(1), dim3(32), 0, nullptr, in, out);
  return 0;
}
