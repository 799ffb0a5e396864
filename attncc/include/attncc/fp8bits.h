// fp8 (OCP FP8: e4m3fn and e5m2, torch.float8_e4m3fn / float8_e5m2) -> fp32 bit patterns by
// integer arithmetic alone, so the CPU kernels, the CUDA kernels and the CUDA emulator widen fp8
// K/V with one decoder. Every fp8 value is exact in fp32.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ATTNCC_FP8_FN __host__ __device__ __forceinline__
#else
#define ATTNCC_FP8_FN inline
#endif

namespace attncc {

// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
ATTNCC_FP8_FN uint32_t fp8_e4m3_float_bits(uint8_t byte) {
  const uint32_t sign = uint32_t(byte & 0x80u) << 24, exponent = (byte >> 3) & 0xfu, mantissa = byte & 7u;
  if (exponent == 0xfu && mantissa == 7u) return sign | 0x7fc00000u;
  if (exponent != 0) return sign | ((exponent + 120u) << 23) | (mantissa << 20);
  if (mantissa == 0) return sign;
  // subnormal: mantissa x 2^-9 = 2^(p - 9) x 1.f, p the mantissa's leading bit
  const uint32_t p = mantissa >= 4 ? 2u : mantissa >= 2 ? 1u : 0u;
  return sign | ((p + 118u) << 23) | (((mantissa << (3 - p)) & 7u) << 20);
}

// e5m2: sign, 5 exponent bits (bias 15), 2 mantissa bits (fp16's upper byte): infinities and NaNs.
ATTNCC_FP8_FN uint32_t fp8_e5m2_float_bits(uint8_t byte) {
  const uint32_t sign = uint32_t(byte & 0x80u) << 24, exponent = (byte >> 2) & 0x1fu, mantissa = byte & 3u;
  if (exponent == 0x1fu) return sign | 0x7f800000u | (mantissa << 21);
  if (exponent != 0) return sign | ((exponent + 112u) << 23) | (mantissa << 21);
  if (mantissa == 0) return sign;
  // subnormal: mantissa x 2^-16
  const uint32_t p = mantissa >= 2 ? 1u : 0u;
  return sign | ((p + 111u) << 23) | (((mantissa << (2 - p)) & 3u) << 21);
}

}  // namespace attncc
