// Philox4x32-10 (Salmon et al., SC'11), shared by every attncc backend so dropout masks are
// bit-identical across them. Dropout counter for score (b, h, i, j):
//   counter = (j / 4, i, b * H + h, offset), key = (seed low 32 bits, seed high 32 bits),
//   element j keeps iff output word (j % 4) < keep_threshold = floor((1 - p) * 2^32).
#pragma once

#include <cstdint>

#if defined(__CUDACC__) && !defined(ATTNCC_EMULATE)
#define ATTNCC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ATTNCC_HOST_DEVICE inline
#endif

namespace attncc {

struct Philox4 {
  uint32_t x[4];
};

ATTNCC_HOST_DEVICE Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    const uint32_t hi0 = uint32_t(p0 >> 32), lo0 = uint32_t(p0), hi1 = uint32_t(p1 >> 32), lo1 = uint32_t(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The four keep decisions for columns 4 * (j / 4) .. + 3 of row i.
ATTNCC_HOST_DEVICE Philox4 dropout_words(uint64_t seed, uint64_t offset, int64_t bh, int64_t i, int64_t j) {
  return philox4x32_10(uint32_t(j >> 2), uint32_t(i), uint32_t(bh), uint32_t(offset), uint32_t(seed), uint32_t(seed >> 32));
}

}  // namespace attncc
