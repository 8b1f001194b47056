#include "tools/testdata/rl_steps.h"

#include <cmath>
#include <cstring>
#include <fstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "replica/fp8.h"

namespace wsync::tools {
namespace {

inline uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A standard normal approximated by the sum of four 16-bit uniforms of one 64-bit hash (Irwin-Hall, mean 0, std 1,
// tails cut at ±3.46): cheap enough to draw one per element per step.
inline float Normal(uint64_t h) {
  const uint32_t s = static_cast<uint32_t>(h & 0xFFFF) + static_cast<uint32_t>((h >> 16) & 0xFFFF) +
                     static_cast<uint32_t>((h >> 32) & 0xFFFF) + static_cast<uint32_t>(h >> 48);
  constexpr float kMean = 4 * 32767.5f;
  constexpr float kInvStd = 1.0f / 37837.23f;  // sqrt(4 * (65536^2 - 1) / 12)
  return (static_cast<float>(s) - kMean) * kInvStd;
}

uint64_t NameSeed(absl::string_view name, uint64_t seed) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return SplitMix(h ^ SplitMix(seed));
}

// Streams of per-element draws: the gradient's fixed mean, each step's noise, the initial weights and momentum.
constexpr uint64_t kMuStream = 0x1000000000000000ull;
constexpr uint64_t kInitStream = 0x2000000000000000ull;
constexpr uint64_t kMomentumStream = 0x3000000000000000ull;
inline uint64_t Draw(uint64_t tensor_seed, uint64_t stream, uint64_t step, uint64_t i) {
  return SplitMix(tensor_seed ^ stream ^ SplitMix(step) ^ (i * 0xD1B54A32D192ED03ull));
}

}  // namespace

std::string TensorKind(absl::string_view name) {
  if (absl::StrContains(name, "embed_tokens")) return "embed";
  if (absl::StrContains(name, "lm_head")) return "lm_head";
  if (absl::StrContains(name, "norm.weight") || absl::StrContains(name, "layernorm")) return "norm";
  if (absl::EndsWith(name, ".bias")) return "bias";
  if (absl::StrContains(name, "mlp.experts.")) return "experts";
  if (absl::StrContains(name, "mlp.gate.")) return "router";
  if (absl::StrContains(name, "self_attn.")) return "attn";
  if (absl::StrContains(name, "mlp.")) return "mlp";
  return "other";
}

absl::StatusOr<std::unique_ptr<RlStepModel>> RlStepModel::Create(const std::string& config_path, RlStepOptions options,
                                                                 int64_t max_layers, int64_t max_vocab) {
  std::ifstream in(config_path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", config_path));
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  WSYNC_ASSIGN_OR_RETURN(replica::ModelConfig config, replica::ModelConfig::FromJson(text));
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("initializer_range") && j["initializer_range"].is_number()) {
    options.initializer_range = j["initializer_range"].get<double>();
  }
  if (max_layers > 0 && max_layers < config.num_layers) config.num_layers = max_layers;
  if (max_vocab > 0 && max_vocab < config.vocab_size) config.vocab_size = max_vocab;

  std::unique_ptr<RlStepModel> m(new RlStepModel());
  m->config_ = config;
  m->options_ = options;
  WSYNC_ASSIGN_OR_RETURN(m->tensors_, replica::CheckpointTensors(config));
  const size_t n = m->tensors_.size();
  m->seeds_.resize(n);
  m->master_.resize(n);
  m->m_.resize(n);
  m->v_.resize(n);
  m->cast_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const DType dt = m->tensors_[i].dtype;
    if (dt != DType::kBF16 && dt != DType::kF32) {
      return absl::UnimplementedError(absl::StrCat(m->tensors_[i].name, ": trainer dtype ", DTypeName(dt)));
    }
    m->InitTensor(i);
  }
  return m;
}

uint64_t RlStepModel::num_elements() const {
  uint64_t n = 0;
  for (const auto& w : master_) n += w.size();
  return n;
}

void RlStepModel::InitTensor(size_t t) {
  const replica::TensorSpec& spec = tensors_[t];
  const uint64_t elems = spec.bytes() / DTypeSize(spec.dtype);
  const uint64_t seed = seeds_[t] = NameSeed(spec.name, options_.seed);
  const std::string kind = TensorKind(spec.name);
  const bool is_norm = kind == "norm", is_bias = kind == "bias";
  const float init_std = static_cast<float>(options_.initializer_range);
  const float signal = static_cast<float>(options_.signal);
  const float m_std = static_cast<float>(std::sqrt((1 - options_.beta1) / (1 + options_.beta1)));
  std::vector<float>& w = master_[t];
  w.resize(elems);
  m_[t].resize(elems);
  v_[t].resize(elems);
  for (uint64_t i = 0; i < elems; ++i) {
    if (is_norm) {
      w[i] = 1.0f;
    } else if (is_bias) {
      w[i] = 0.0f;
    } else {
      w[i] = init_std * Normal(Draw(seed, kInitStream, 0, i));
    }
    const float mu = signal * Normal(Draw(seed, kMuStream, 0, i));
    m_[t][i] = mu + m_std * Normal(Draw(seed, kMomentumStream, 0, i));
    v_[t][i] = mu * mu + 1.0f;
  }
  cast_[t].resize(spec.bytes());
  if (spec.dtype == DType::kF32) {
    std::memcpy(cast_[t].data(), w.data(), spec.bytes());
  } else {
    for (uint64_t i = 0; i < elems; ++i) {
      const uint16_t b = replica::FloatToBf16(w[i]);
      std::memcpy(cast_[t].data() + 2 * i, &b, 2);
    }
  }
}

void RlStepModel::StepTensor(size_t t) {
  const uint64_t seed = seeds_[t];
  const float signal = static_cast<float>(options_.signal);
  const float b1 = static_cast<float>(options_.beta1), b2 = static_cast<float>(options_.beta2);
  const float lr = static_cast<float>(options_.lr), eps = static_cast<float>(options_.eps);
  const float wd = static_cast<float>(options_.weight_decay);
  std::vector<float>& w = master_[t];
  float* m = m_[t].data();
  float* v = v_[t].data();
  uint8_t* out = cast_[t].data();
  const bool bf16 = tensors_[t].dtype == DType::kBF16;
  for (uint64_t i = 0; i < w.size(); ++i) {
    const float mu = Normal(Draw(seed, kMuStream, 0, i));
    const float g = signal * mu + Normal(Draw(seed, 0, static_cast<uint64_t>(step_) + 1, i));
    m[i] = b1 * m[i] + (1 - b1) * g;
    v[i] = b2 * v[i] + (1 - b2) * g * g;
    w[i] -= lr * (m[i] / (std::sqrt(v[i]) + eps) + wd * w[i]);
    if (bf16) {
      const uint16_t b = replica::FloatToBf16(w[i]);
      std::memcpy(out + 2 * i, &b, 2);
    } else {
      std::memcpy(out + 4 * i, &w[i], 4);
    }
  }
}

void RlStepModel::Step() {
  for (size_t t = 0; t < tensors_.size(); ++t) StepTensor(t);
  ++step_;
}

absl::Status QuantizeBf16Fp8(const uint8_t* bf16, int64_t rows, int64_t cols, int block, Fp8Tensor* out) {
  out->rows = rows;
  out->cols = cols;
  out->block = block;
  const int64_t srows = (rows + block - 1) / block, scols = (cols + block - 1) / block;
  out->codes.resize(static_cast<size_t>(rows * cols));
  out->scales.resize(static_cast<size_t>(srows * scols));
  return replica::QuantizeFp8Block(DType::kBF16, bf16, rows, cols, cols, block, block, out->codes.data(), cols,
                                   out->scales.data(), scols);
}

Fp8Change& Fp8Change::operator+=(const Fp8Change& o) {
  codes += o.codes;
  codes_changed += o.codes_changed;
  blocks += o.blocks;
  blocks_rescaled += o.blocks_rescaled;
  codes_in_rescaled += o.codes_in_rescaled;
  codes_changed_in_rescaled += o.codes_changed_in_rescaled;
  codes_in_kept += o.codes_in_kept;
  codes_changed_in_kept += o.codes_changed_in_kept;
  return *this;
}

Fp8Change CompareFp8(const Fp8Tensor& a, const Fp8Tensor& b) {
  Fp8Change c;
  const int64_t bs = a.block;
  const int64_t scols = (a.cols + bs - 1) / bs;
  c.codes = a.codes.size();
  c.blocks = a.scales.size();
  for (int64_t br = 0; br * bs < a.rows; ++br) {
    for (int64_t bc = 0; bc < scols; ++bc) {
      const size_t s = static_cast<size_t>(br * scols + bc);
      const bool rescaled = std::memcmp(&a.scales[s], &b.scales[s], sizeof(float)) != 0;
      c.blocks_rescaled += rescaled;
      uint64_t n = 0, changed = 0;
      for (int64_t r = br * bs; r < std::min(a.rows, (br + 1) * bs); ++r) {
        for (int64_t col = bc * bs; col < std::min(a.cols, (bc + 1) * bs); ++col) {
          const size_t k = static_cast<size_t>(r * a.cols + col);
          ++n;
          changed += a.codes[k] != b.codes[k];
        }
      }
      c.codes_changed += changed;
      (rescaled ? c.codes_in_rescaled : c.codes_in_kept) += n;
      (rescaled ? c.codes_changed_in_rescaled : c.codes_changed_in_kept) += changed;
    }
  }
  return c;
}

absl::StatusOr<std::vector<bool>> Fp8Quantized(const replica::ModelConfig& config,
                                               const std::vector<replica::TensorSpec>& tensors) {
  WSYNC_ASSIGN_OR_RETURN(auto fp8, replica::CheckpointTensors(config, replica::CheckpointFormat::kFp8PassThrough));
  absl::flat_hash_set<std::string> quantized;
  for (const auto& t : fp8) {
    if (t.dtype == DType::kF8E4M3) quantized.insert(t.name);
  }
  std::vector<bool> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(quantized.contains(t.name) && t.shape.size() == 2);
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const RlStepModel& model) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (size_t i = 0; i < model.tensors().size(); ++i) {
    const replica::TensorSpec& t = model.tensors()[i];
    const uint64_t n = model.bytes(i).size();
    header[t.name] = {{"dtype", t.dtype == DType::kBF16 ? "BF16" : "F32"},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  header["__metadata__"] = {{"format", "pt"}, {"step", std::to_string(model.step())}};
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // the format pads the header to 8 bytes with spaces
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write ", path));
  const uint64_t len = h.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(h.data(), static_cast<std::streamsize>(h.size()));
  for (size_t i = 0; i < model.tensors().size(); ++i) {
    out.write(reinterpret_cast<const char*>(model.bytes(i).data()),
              static_cast<std::streamsize>(model.bytes(i).size()));
  }
  out.close();
  if (!out) return absl::DataLossError(absl::StrCat("short write to ", path));
  return absl::OkStatus();
}

}  // namespace wsync::tools
