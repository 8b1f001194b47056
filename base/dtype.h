#pragma once
// Element types of weights as they travel (HF checkpoint dtypes and SGLang parameter dtypes).

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wsync {

enum class DType : uint8_t {
  kInvalid = 0,
  kBF16 = 1,
  kF16 = 2,
  kF32 = 3,
  kF8E4M3 = 4,  // float8_e4m3fn, as used by DeepSeek/SGLang block FP8
  kI32 = 5,
  kI64 = 6,
  kU8 = 7,
  kF64 = 8,
};

// Bytes per element; 0 for kInvalid.
size_t DTypeSize(DType t);
// Canonical (torch-style) name: "bfloat16", "float16", "float32", "float8_e4m3fn", "int32", "int64", "uint8", "float64".
absl::string_view DTypeName(DType t);
// Accepts torch names ("bfloat16", "torch.bfloat16"), safetensors names ("BF16", "F8_E4M3") and numpy names.
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace wsync
