#include "tools/testdata/weight_gen.h"

#include <cstring>

namespace wsync::tools {
namespace {

inline uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// bf16 bits of a finite value: random sign and mantissa, exponent in [119, 126] → magnitude in [2^-8, 1).
inline uint16_t Bf16Bits(uint16_t r) { return static_cast<uint16_t>((r & 0x807F) | ((0x77 + ((r >> 7) & 7)) << 7)); }

// Same idea for IEEE half: exponent in [7, 14].
inline uint16_t F16Bits(uint16_t r) { return static_cast<uint16_t>((r & 0x83FF) | ((7 + ((r >> 10) & 7)) << 10)); }

// Element j of `dtype` at `out` from its 16-bit random lane.
inline void WriteElem(DType dtype, uint16_t lane, uint64_t j, uint8_t* out) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t b = Bf16Bits(lane);
      std::memcpy(out + 2 * j, &b, 2);
      break;
    }
    case DType::kF16: {
      uint16_t b = F16Bits(lane);
      std::memcpy(out + 2 * j, &b, 2);
      break;
    }
    case DType::kF32: {
      uint32_t b = static_cast<uint32_t>(Bf16Bits(lane)) << 16;
      std::memcpy(out + 4 * j, &b, 4);
      break;
    }
    default: {
      // Other dtypes: raw bytes (fp8 pass-through tests choose their own values).
      const size_t sz = DTypeSize(dtype);
      for (size_t k = 0; k < sz; ++k) out[sz * j + k] = static_cast<uint8_t>(lane >> (k % 2 * 8));
      break;
    }
  }
}

void GenerateDense(uint64_t seed, DType dtype, uint64_t num_elems, uint8_t* out) {
  // One 64-bit draw gives four 16-bit lanes.
  for (uint64_t i = 0; i < num_elems; i += 4) {
    uint64_t r = SplitMix(seed + i);
    for (uint64_t j = i; j < i + 4 && j < num_elems; ++j, r >>= 16) WriteElem(dtype, static_cast<uint16_t>(r), j, out);
  }
}

}  // namespace

uint64_t TensorSeed(absl::string_view name, int64_t step) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the name
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return SplitMix(h ^ SplitMix(static_cast<uint64_t>(step)));
}

void GenerateTensor(absl::string_view name, int64_t step, DType dtype, uint64_t num_elems, uint8_t* out) {
  if (step <= kSparseStepBase || step > kSparseStepBase + kSparseMaxSteps) {
    GenerateDense(TensorSeed(name, step), dtype, num_elems, out);
    return;
  }
  GenerateDense(TensorSeed(name, kSparseStepBase), dtype, num_elems, out);
  for (int64_t k = kSparseStepBase + 1; k <= step; ++k) {
    const uint64_t seed = TensorSeed(name, k);
    const uint64_t pick = SplitMix(seed ^ 0x5DEECE66Dull);
    for (uint64_t j = 0; j < num_elems; ++j) {
      if (SplitMix(pick + j) % 1000 >= kSparseChangePerMille) continue;
      const uint64_t r = SplitMix(seed + (j & ~3ull)) >> (16 * (j & 3));
      WriteElem(dtype, static_cast<uint16_t>(r), j, out);
    }
  }
}

}  // namespace wsync::tools
