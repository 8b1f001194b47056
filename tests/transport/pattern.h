#pragma once
// The test byte pattern shared by the transport tests: byte `offset` of pattern `seed` (splitmix64) is a function of
// (seed, offset) alone, so expected contents and checksums are computed independently of the memory a transport read.

#include <cstdint>

namespace wsync::transport::testing {

inline uint8_t PatternByte(uint64_t seed, uint64_t offset) {
  uint64_t z = seed * 0x9E3779B97F4A7C15ull + (offset >> 3) + 1;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint8_t>(z >> ((offset & 7) * 8));
}

}  // namespace wsync::transport::testing
