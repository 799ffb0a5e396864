// fp16 and bf16 <-> fp32 on raw 16-bit patterns, rounding to nearest even like torch. Used by
// the CPU kernels and by the CUDA emulator's software half types (host code only).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace attncc {

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_bits_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

inline float fp16_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));  // inf/nan
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float value = float(mantissa) * 5.9604644775390625e-08f;
    return sign ? -value : value;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet nan
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline uint16_t float_to_fp16_bits(float f) {
  uint32_t u = float_to_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (u >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (u < 0x38800000u) {  // below the smallest normal: round in the subnormal grid (times 2^24, exact)
    return uint16_t(sign | uint16_t(std::nearbyint(bits_to_float(u) * 16777216.0f)));
  }
  const uint32_t rounded = u + 0xfffu + ((u >> 13) & 1u);
  return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

}  // namespace attncc
