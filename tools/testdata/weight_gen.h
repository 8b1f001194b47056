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
// Steps from kSparseStepBase on model consecutive training steps for delta updates: kSparseStepBase is a dense
// random checkpoint like any other step, and each later step gives about kSparseChangePerMille / 1000 of every
// tensor's elements a new value (drawn as that step's dense value), the others keeping the previous step's. Up to
// kSparseStepBase + kSparseMaxSteps.
inline constexpr int64_t kSparseStepBase = 1000000;
inline constexpr int64_t kSparseMaxSteps = 64;
inline constexpr uint64_t kSparseChangePerMille = 20;
void GenerateTensor(absl::string_view name, int64_t step, DType dtype, uint64_t num_elems, uint8_t* out);

}  // namespace wsync::tools
