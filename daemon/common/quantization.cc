#include "daemon/common/quantization.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"

namespace wsync::daemon {

namespace {
constexpr char kFp8Block[] = "fp8_block";
constexpr char kUe8m0[] = "ue8m0";
}  // namespace

absl::Status CheckQuantization(const v1::WeightQuantization& q) {
  if (q.method().empty()) {
    if (q.block_size_size() != 0 || !q.scale_format().empty())
      return absl::InvalidArgumentError(
          "quantization: block_size and scale_format are only meaningful with method fp8_block");
    return absl::OkStatus();
  }
  if (q.method() != kFp8Block)
    return absl::InvalidArgumentError(
        absl::StrCat("quantization: unknown method '", q.method().substr(0, 64), "' (\"\" or \"fp8_block\")"));
  if (q.block_size_size() != 2 || q.block_size(0) <= 0 || q.block_size(1) <= 0)
    return absl::InvalidArgumentError(
        absl::StrCat("quantization: fp8_block needs block_size [block_n, block_k], "
                     "both positive; got [",
                     absl::StrJoin(q.block_size(), ", "), "]"));
  if (!q.scale_format().empty() && q.scale_format() != kUe8m0)
    return absl::InvalidArgumentError(
        absl::StrCat("quantization: unknown scale_format '", q.scale_format().substr(0, 64), "' (\"\" or \"ue8m0\")"));
  return absl::OkStatus();
}

replica::QuantSpec QuantSpecOf(const v1::WeightQuantization& q) {
  replica::QuantSpec out;
  if (q.method() != kFp8Block || q.block_size_size() != 2) return out;
  out.mode = replica::QuantSpec::Mode::kFp8Block;
  out.block_n = q.block_size(0);
  out.block_k = q.block_size(1);
  out.ue8m0 = q.scale_format() == kUe8m0;
  return out;
}

absl::StatusOr<replica::QuantSpec> QuantSpecOfLayout(const v1::RankLayout& layout, const std::string& who) {
  const v1::WeightQuantization& q = layout.quantization();
  if (absl::Status st = CheckQuantization(q); !st.ok())
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", st.message()));
  replica::QuantSpec out;
  if (q.method().empty()) {
    for (const auto& p : layout.params())
      if (absl::EndsWith(p.name(), "_scale_inv"))
        return absl::FailedPreconditionError(absl::StrCat(
            who, ": parameter ", p.name(),
            " is an FP8 block scale but the engine reports no quantization; it must "
            "report quantization {method fp8_block, block_size [n, k]} (docs/engines.md, \"Quantization\")"));
    return out;
  }
  return QuantSpecOf(q);
}

std::string QuantizationName(const v1::WeightQuantization& q) {
  if (q.method().empty()) return "none";
  std::string out = absl::StrCat(q.method(), " [", absl::StrJoin(q.block_size(), ", "), "]");
  if (!q.scale_format().empty()) absl::StrAppend(&out, " ", q.scale_format());
  return out;
}

bool SameQuantization(const v1::WeightQuantization& a, const v1::WeightQuantization& b) {
  return a.method() == b.method() && a.scale_format() == b.scale_format() &&
         std::equal(a.block_size().begin(), a.block_size().end(), b.block_size().begin(), b.block_size().end());
}

void SetSourceQuantization(const v1::WeightQuantization& q, v1::ConfigureSourceRequest* req) {
  req->clear_quantization();
  req->clear_weight_block_size();
  req->clear_scale_format();
  if (q.method().empty()) return;
  req->set_quantization(q.method());
  *req->mutable_weight_block_size() = q.block_size();
  req->set_scale_format(q.scale_format());
}

absl::StatusOr<v1::WeightQuantization> QuantizationFromModelConfig(const std::string& config_json) {
  const nlohmann::json j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("config.json is not a JSON object");
  v1::WeightQuantization out;
  auto it = j.find("quantization_config");
  if (it == j.end() || it->is_null()) return out;
  if (!it->is_object()) return absl::InvalidArgumentError("config.json: quantization_config is not an object");
  auto m = it->find("quant_method");
  const std::string method = m != it->end() && m->is_string() ? m->get<std::string>() : std::string();
  if (method != "fp8")
    return absl::UnimplementedError(absl::StrCat("config.json: quantization_config.quant_method '",
                                                 method.substr(0, 64),
                                                 "' is not supported (only fp8 with weight_block_size)"));
  auto b = it->find("weight_block_size");
  if (b == it->end() || b->is_null())
    return absl::UnimplementedError("config.json: fp8 without weight_block_size (per-tensor FP8) is not supported");
  if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() || !(*b)[1].is_number_integer())
    return absl::InvalidArgumentError("config.json: quantization_config.weight_block_size must be [n, k]");
  out.set_method(kFp8Block);
  for (const auto& e : *b) {
    const int64_t v = e.get<int64_t>();
    if (v <= 0 || v > (1 << 20))
      return absl::InvalidArgumentError("config.json: quantization_config.weight_block_size must be positive");
    out.add_block_size(static_cast<int32_t>(v));
  }
  auto f = it->find("scale_fmt");
  if (f != it->end() && !f->is_null() && !f->is_string())
    return absl::InvalidArgumentError("config.json: quantization_config.scale_fmt must be a string");
  const std::string fmt = f != it->end() && f->is_string() ? f->get<std::string>() : std::string();
  if (fmt == kUe8m0) {
    out.set_scale_format(kUe8m0);
  } else if (!fmt.empty() && fmt != "float32") {
    return absl::UnimplementedError(
        absl::StrCat("config.json: quantization_config.scale_fmt '", fmt.substr(0, 64), "' is not supported"));
  }
  return out;
}

}  // namespace wsync::daemon
