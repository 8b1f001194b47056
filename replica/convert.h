#pragma once
// Element conversions and rectangle copies used when loading HF tensors into engine parameters.
// Rounding follows torch's CPU casts: float32 → bfloat16/float16 round to nearest even; NaN → canonical quiet NaN.

#include <cstdint>

#include "absl/status/status.h"
#include "base/dtype.h"

namespace wsync::replica {

uint16_t F32ToBf16(float f);
float Bf16ToF32(uint16_t b);
uint16_t F32ToF16(float f);
float F16ToF32(uint16_t h);

// Whether CopyRect can convert `from` into `to` (same dtype, or between bf16/f16/f32).
bool CanConvert(DType from, DType to);

// Copies a row-major [rows, cols] rectangle, converting elements; strides are in elements. Same dtype is memcpy
// (one call when both sides are contiguous). Thread-safe; no allocation.
absl::Status CopyRect(DType src_dtype, const uint8_t* src, int64_t src_stride, DType dst_dtype, uint8_t* dst,
                      int64_t dst_stride, int64_t rows, int64_t cols);

}  // namespace wsync::replica
