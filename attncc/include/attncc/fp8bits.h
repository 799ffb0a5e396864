// fp8 (OCP FP8: e4m3fn and e5m2, torch.float8_e4m3fn / float8_e5m2) -> fp32 bit patterns by
// integer arithmetic alone, so the CPU kernels, the CUDA kernels and the CUDA emulator widen fp8
// K/V with one decoder. Every fp8 value is exact in fp32.
#pragma once

#include <cmath>
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

#if !defined(__CUDACC__)  // host compilers (the CUDA emulator); a GPU converts with cvt
// fp32 -> e4m3fn rounded to nearest even, saturating to +-448 (PTX cvt.rn.satfinite.e4m3x2.f32,
// which the CUDA emulator runs through this); NaN stays NaN. Scaling by powers of two is exact,
// so the rounding is that of nearbyint on the value in units of its e4m3 step.
ATTNCC_FP8_FN uint8_t fp8_e4m3_from_float(float x) {
  const uint8_t sign = x < 0.0f || (x == 0.0f && std::signbit(x)) ? 0x80u : 0u;
  const float magnitude = std::fabs(x);
  if (magnitude != magnitude) return uint8_t(0x7fu | sign);
  if (magnitude >= 464.0f) return uint8_t(0x7eu | sign);  // 448 + half a step and up (ties go to 448)
  if (magnitude < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 steps reach 2^-6, byte 0x08)
    return uint8_t(sign | uint8_t(std::nearbyint(std::ldexp(magnitude, 9))));
  }
  int exponent = 0;
  std::frexp(magnitude, &exponent);  // magnitude = f 2^exponent, f in [0.5, 1)
  exponent -= 1;                     // magnitude in [2^exponent, 2^(exponent + 1))
  int steps = int(std::nearbyint(std::ldexp(magnitude, 3 - exponent)));  // 8 .. 16
  if (steps == 16) steps = 8, exponent += 1;
  return uint8_t(sign | uint8_t((exponent + 7) << 3) | uint8_t(steps - 8));
}
#endif

}  // namespace attncc
