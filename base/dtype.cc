#include "base/dtype.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace wsync {

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kF8E4M3:
    case DType::kU8:
      return 1;
    case DType::kI64:
    case DType::kF64:
      return 8;
    case DType::kInvalid:
      break;
  }
  return 0;
}

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kF32: return "float32";
    case DType::kF8E4M3: return "float8_e4m3fn";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kU8: return "uint8";
    case DType::kF64: return "float64";
    case DType::kInvalid: break;
  }
  return "invalid";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  std::string n = absl::AsciiStrToLower(name);
  if (absl::StartsWith(n, "torch.")) n = n.substr(6);
  if (n == "bfloat16" || n == "bf16") return DType::kBF16;
  if (n == "float16" || n == "f16" || n == "half" || n == "fp16") return DType::kF16;
  if (n == "float32" || n == "f32" || n == "float" || n == "fp32") return DType::kF32;
  if (n == "float8_e4m3fn" || n == "f8_e4m3" || n == "fp8" || n == "e4m3") return DType::kF8E4M3;
  if (n == "int32" || n == "i32") return DType::kI32;
  if (n == "int64" || n == "i64") return DType::kI64;
  if (n == "uint8" || n == "u8") return DType::kU8;
  if (n == "float64" || n == "f64" || n == "double") return DType::kF64;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

}  // namespace wsync
