#pragma once
// Weight quantization as engines report it (v1::WeightQuantization on each RankLayout): one place that checks a
// report, turns it into the replica's QuantSpec and into a source's configuration, and reads it from a model's
// config.json for engines whose layout wsync derives from that config (SGLang). Nothing here guesses a quantization
// from parameter names; a layout whose names say FP8 but whose report does not is refused.

#include <string>

#include "absl/status/statusor.h"
#include "replica/model_config.h"
#include "wsync/v1/common.pb.h"
#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon {

// The report itself is well formed: method "" or "fp8_block"; for fp8_block two positive block sizes and a scale
// format "" or "ue8m0"; for "" no block size or scale format. InvalidArgument naming the field otherwise. Pure.
absl::Status CheckQuantization(const v1::WeightQuantization& q);

// The replica's QuantSpec for a report that passed CheckQuantization. Pure.
replica::QuantSpec QuantSpecOf(const v1::WeightQuantization& q);

// The quantization `layout` reports, checked against its parameters: InvalidArgument when the report is malformed,
// FailedPrecondition when a parameter is an FP8 block scale (`*_scale_inv`) but the report says no quantization
// (the engine did not say how it holds its weights: no block size is assumed). `who` prefixes the errors. Pure.
absl::StatusOr<replica::QuantSpec> QuantSpecOfLayout(const v1::RankLayout& layout, const std::string& who);

// "none" | "fp8_block [128, 128]" | "fp8_block [128, 128] ue8m0": how logs and errors name a quantization. Pure.
std::string QuantizationName(const v1::WeightQuantization& q);

// Whether two reports describe the same quantization. Pure.
bool SameQuantization(const v1::WeightQuantization& a, const v1::WeightQuantization& b);

// Sets `req`'s quantization, weight_block_size and scale_format to what the engines hold (`q`, checked). Pure.
void SetSourceQuantization(const v1::WeightQuantization& q, v1::ConfigureSourceRequest* req);

// The quantization a Hugging Face config.json declares (quantization_config): none when absent; fp8_block for
// quant_method "fp8" with weight_block_size [n, k] (scale_fmt "ue8m0" → ue8m0). Unimplemented for any other
// quantization (another method, or FP8 without blocks); InvalidArgument for malformed JSON. Pure.
absl::StatusOr<v1::WeightQuantization> QuantizationFromModelConfig(const std::string& config_json);

}  // namespace wsync::daemon
