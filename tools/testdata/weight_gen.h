#pragma once
// Deterministic synthetic weights for demos and tests: the value of every element depends only on
// (tensor name, step, element index), so a trainer and an engine can produce the same HF tensor independently.

#include <cstdint>

#include "absl/strings/string_view.h"
#include "base/dtype.h"

namespace wsync::tools {

// Seed of one tensor at one step.
uint64_t TensorSeed(absl::string_view name, int64_t step);

// Fills `num_elems` elements of `dtype` (bf16, f16, f32) at `out` with finite values in roughly ±[2^-8, 2).
// f32 values are bf16-representable so conversions in either direction are exact.
void GenerateTensor(absl::string_view name, int64_t step, DType dtype, uint64_t num_elems, uint8_t* out);

}  // namespace wsync::tools
