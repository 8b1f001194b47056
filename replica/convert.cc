#include "replica/convert.h"

#include <cstring>

#include "absl/strings/str_cat.h"

namespace wsync::replica {
namespace {

inline uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

using RowFn = void (*)(const uint8_t* src, uint8_t* dst, int64_t n);

template <typename S, typename D, D (*Cvt)(S)>
void ConvertRow(const uint8_t* src, uint8_t* dst, int64_t n) {
  if (reinterpret_cast<uintptr_t>(src) % sizeof(S) == 0 && reinterpret_cast<uintptr_t>(dst) % sizeof(D) == 0) {
    // Element-aligned (the usual case: tensors and parameters start aligned): typed loop, which vectorizes.
    const S* __restrict in = reinterpret_cast<const S*>(src);
    D* __restrict out = reinterpret_cast<D*>(dst);
    for (int64_t i = 0; i < n; ++i) out[i] = Cvt(in[i]);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    S s;
    std::memcpy(&s, src + i * sizeof(S), sizeof(S));
    const D d = Cvt(s);
    std::memcpy(dst + i * sizeof(D), &d, sizeof(D));
  }
}

inline uint16_t Bf16FromF32Bits(uint32_t u) {
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}
inline uint32_t F32BitsFromBf16(uint16_t b) { return static_cast<uint32_t>(b) << 16; }
inline uint16_t F16FromF32Bits(uint32_t u) { return F32ToF16(FromBits(u)); }
inline uint32_t F32BitsFromF16(uint16_t h) { return Bits(F16ToF32(h)); }
inline uint16_t Bf16FromF16(uint16_t h) { return F32ToBf16(F16ToF32(h)); }
inline uint16_t F16FromBf16(uint16_t b) { return F32ToF16(Bf16ToF32(b)); }

RowFn PickConverter(DType from, DType to) {
  if (from == DType::kF32 && to == DType::kBF16) return &ConvertRow<uint32_t, uint16_t, Bf16FromF32Bits>;
  if (from == DType::kBF16 && to == DType::kF32) return &ConvertRow<uint16_t, uint32_t, F32BitsFromBf16>;
  if (from == DType::kF32 && to == DType::kF16) return &ConvertRow<uint32_t, uint16_t, F16FromF32Bits>;
  if (from == DType::kF16 && to == DType::kF32) return &ConvertRow<uint16_t, uint32_t, F32BitsFromF16>;
  if (from == DType::kF16 && to == DType::kBF16) return &ConvertRow<uint16_t, uint16_t, Bf16FromF16>;
  if (from == DType::kBF16 && to == DType::kF16) return &ConvertRow<uint16_t, uint16_t, F16FromBf16>;
  return nullptr;
}

}  // namespace

uint16_t F32ToBf16(float f) {
  // torch: every NaN becomes the canonical quiet NaN (a select, not a branch, so row loops vectorize).
  return Bf16FromF32Bits(Bits(f));
}

float Bf16ToF32(uint16_t b) { return FromBits(static_cast<uint32_t>(b) << 16); }

uint16_t F32ToF16(float f) {
  uint32_t x = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00;           // NaN
  if (x >= 0x477FF000u) return sign | 0x7C00;          // >= 65520 rounds to inf (and inf)
  if (x < 0x38800000u) {                               // below 2^-14: f16 subnormal or zero
    const uint32_t e = x >> 23;
    const int shift = 126 - static_cast<int>(e);       // value = m * 2^(e-150), f16 quantum 2^-24
    if (shift > 24) return sign;
    const uint32_t m = (x & 0x7FFFFFu) | 0x800000u;
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;  // may carry into the smallest normal: still correct
    return sign | static_cast<uint16_t>(r);
  }
  const uint32_t r = x - (112u << 23);                 // rebias 127 → 15
  return sign | static_cast<uint16_t>((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
}

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0) {
    // Subnormal/zero: man * 2^-24 is exact in float32.
    return FromBits(sign | Bits(static_cast<float>(man) * 5.9604644775390625e-8f));
  }
  if (exp == 31) return FromBits(sign | 0x7F800000u | (man << 13));
  return FromBits(sign | ((exp + 112u) << 23) | (man << 13));
}

bool CanConvert(DType from, DType to) { return from == to || PickConverter(from, to) != nullptr; }

absl::Status CopyRect(DType src_dtype, const uint8_t* src, int64_t src_stride, DType dst_dtype, uint8_t* dst,
                      int64_t dst_stride, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return absl::OkStatus();
  const size_t ss = DTypeSize(src_dtype), ds = DTypeSize(dst_dtype);
  const bool contiguous = src_stride == cols && dst_stride == cols;
  if (src_dtype == dst_dtype) {
    if (contiguous) {
      std::memcpy(dst, src, static_cast<size_t>(rows * cols) * ss);
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(dst + r * dst_stride * ds, src + r * src_stride * ss, static_cast<size_t>(cols) * ss);
      }
    }
    return absl::OkStatus();
  }
  RowFn fn = PickConverter(src_dtype, dst_dtype);
  if (fn == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("no conversion from ", DTypeName(src_dtype), " to ", DTypeName(dst_dtype)));
  }
  if (contiguous) {
    fn(src, dst, rows * cols);
  } else {
    for (int64_t r = 0; r < rows; ++r) fn(src + r * src_stride * ss, dst + r * dst_stride * ds, cols);
  }
  return absl::OkStatus();
}

}  // namespace wsync::replica
