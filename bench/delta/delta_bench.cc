// Delta updates on realistic RL steps (tools/testdata/rl_steps.h): for each model, learning rate and target kind
// (bf16 as pushed, or FP8 128×128 block-quantized linear weights + fp32 scales, the rest bf16), every parameter of
// every step is encoded against the previous step with replica/delta.h, the source's way: CopyAndEncode into the
// replica (compare + encode + the copy the load does anyway; the base checksum the source kept from the previous
// encoding, unless --hash-base), falling back to dense where the delta is not smaller.
// Printed per case: encoded bytes ÷ dense bytes, the CopyAndEncode rate ÷ memcpy of the same bytes, the Apply rate
// (validation, base checksum, scatter) ÷ memcpy; each timed as one pass over the whole model (larger than the last
// level cache) on one thread, memcpy of the same bytes in the same run; each the best of --reps rounds. Every applied
// delta is checked byte for byte against the new step.
//
// Models are cut so that a run takes well under a minute on a small machine: Qwen3-0.6B keeps 2 of its 28 layers and
// 16384 of its 151936 vocabulary rows; qwen3-moe-2l keeps 1 of its 2 layers (--layers-06b, --vocab-06b,
// --layers-moe). Per-kind fractions (wsync-rl-steps) do not depend on the cut; only the mix of kinds does.
// Last line: one JSON object.
//   bench_delta [--steps N] [--lrs 1e-6,1e-5]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"
#include "replica/delta.h"
#include "tools/testdata/rl_steps.h"

namespace wsync {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;
namespace delta = replica::delta;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// One engine-side byte range of one parameter: bf16 weights, FP8 codes or FP8 scales.
struct Range {
  uint32_t elem_size;
  std::vector<uint8_t> replica;  // the source's copy: the previous version, then the new one
  std::vector<uint8_t> target;   // the engine's copy
  std::vector<uint8_t> scratch;  // memcpy's destination
  const uint8_t* neu = nullptr;  // this step's bytes
  // The replica's checksum as a source keeps it: the new_checksum of the range's previous encoding (hashed only
  // after a dense write). Unset with --hash-base: the encoder hashes the base itself.
  std::optional<uint64_t> base_sum;
};

struct Figures {
  uint64_t dense = 0, sent = 0, ranges = 0, dense_ranges = 0;
  double t_memcpy = 0, t_encode = 0, t_apply = 0;
  uint64_t formats[4] = {0, 0, 0, 0};
};

// Times memcpy, CopyAndEncode and Apply over all ranges (each a full pass); checks every result.
bool MeasureStep(std::vector<Range>& ranges, int reps, bool verbose, Figures* f) {
  std::vector<std::string> enc(ranges.size());
  std::vector<uint8_t> dense_flag(ranges.size());
  std::vector<uint64_t> new_sum(ranges.size());
  std::vector<std::vector<uint8_t>> base(ranges.size());
  for (size_t i = 0; i < ranges.size(); ++i) base[i] = ranges[i].replica;
  double best_memcpy = 1e30, best_encode = 1e30, best_apply = 1e30;
  for (int rep = 0; rep < reps; ++rep) {
    auto t0 = Clock::now();
    for (Range& r : ranges) std::memcpy(r.scratch.data(), r.neu, r.scratch.size());
    best_memcpy = std::min(best_memcpy, Seconds(t0, Clock::now()));

    for (size_t i = 0; i < ranges.size(); ++i) {
      if (rep > 0) std::memcpy(ranges[i].replica.data(), base[i].data(), base[i].size());
      enc[i].clear();
    }
    t0 = Clock::now();
    for (size_t i = 0; i < ranges.size(); ++i) {
      Range& r = ranges[i];
      const uint64_t bytes = r.replica.size();
      delta::EncodeOptions options;
      options.base_checksum = r.base_sum;
      const delta::EncodeResult e =
          delta::CopyAndEncode(r.replica.data(), r.neu, bytes, r.elem_size, bytes, options, &enc[i]);
      dense_flag[i] = e.dense_smaller;
      new_sum[i] = e.new_checksum;
    }
    best_encode = std::min(best_encode, Seconds(t0, Clock::now()));

    for (size_t i = 0; i < ranges.size(); ++i) {
      std::memcpy(ranges[i].target.data(), base[i].data(), base[i].size());
    }
    t0 = Clock::now();
    for (size_t i = 0; i < ranges.size(); ++i) {
      Range& r = ranges[i];
      if (dense_flag[i]) {
        std::memcpy(r.target.data(), r.neu, r.target.size());
        continue;
      }
      uint64_t consumed = 0;
      const absl::Status s = delta::Apply(r.target.data(), r.target.size(),
                                          reinterpret_cast<const uint8_t*>(enc[i].data()), enc[i].size(), &consumed);
      if (!s.ok()) {
        std::fprintf(stderr, "apply failed: %s\n", s.ToString().c_str());
        return false;
      }
    }
    best_apply = std::min(best_apply, Seconds(t0, Clock::now()));
  }
  if (verbose) {
    std::fprintf(stderr, "  %zu ranges: memcpy %.1f ms, CopyAndEncode %.1f ms, Apply %.1f ms\n", ranges.size(),
                 best_memcpy * 1e3, best_encode * 1e3, best_apply * 1e3);
  }
  f->t_memcpy += best_memcpy;
  f->t_encode += best_encode;
  f->t_apply += best_apply;
  for (size_t i = 0; i < ranges.size(); ++i) {
    Range& r = ranges[i];
    if (r.base_sum.has_value()) r.base_sum = dense_flag[i] ? delta::Checksum(r.neu, r.replica.size()) : new_sum[i];
    if (std::memcmp(r.replica.data(), r.neu, r.replica.size()) != 0 ||
        std::memcmp(r.target.data(), r.neu, r.target.size()) != 0) {
      std::fprintf(stderr, "range %zu: replica or target differs from the new step\n", i);
      return false;
    }
    f->dense += r.replica.size();
    f->sent += dense_flag[i] ? r.replica.size() : enc[i].size();
    ++f->ranges;
    if (dense_flag[i]) {
      ++f->dense_ranges;
    } else {
      ++f->formats[static_cast<int>(
          delta::Inspect(reinterpret_cast<const uint8_t*>(enc[i].data()), enc[i].size())->format)];
    }
  }
  return true;
}

struct CaseResult {
  std::string model, target;
  double lr;
  Figures f;
};

bool RunModel(const std::string& label, const std::string& config, int64_t layers, int64_t vocab, double lr, int steps,
              int reps, bool verbose, bool hash_base, std::vector<CaseResult>* results) {
  tools::RlStepOptions opt;
  opt.lr = lr;
  auto made = tools::RlStepModel::Create(config, opt, layers, vocab);
  if (!made.ok()) {
    std::fprintf(stderr, "%s: %s\n", config.c_str(), made.status().ToString().c_str());
    return false;
  }
  tools::RlStepModel& m = **made;
  auto quantized = tools::Fp8Quantized(m.config(), m.tensors());
  if (!quantized.ok()) return false;
  const size_t n = m.tensors().size();

  // bf16 target: one range per tensor. FP8 target: codes + scales for quantized tensors, bf16 for the rest.
  std::vector<Range> bf16(n);
  std::vector<Range> fp8;
  std::vector<tools::Fp8Tensor> q(n);
  std::vector<size_t> fp8_src;  // for each fp8 range: tensor index, and whether codes (even) or scales
  auto init_range = [hash_base](Range* r, const uint8_t* data, uint64_t bytes, uint32_t es) {
    r->elem_size = es;
    if (!hash_base) r->base_sum = delta::Checksum(data, bytes);
    r->replica.assign(data, data + bytes);
    r->target = r->replica;
    r->scratch.assign(bytes, 0);
  };
  for (size_t i = 0; i < n; ++i) {
    const auto& t = m.tensors()[i];
    init_range(&bf16[i], m.bytes(i).data(), m.bytes(i).size(), static_cast<uint32_t>(DTypeSize(t.dtype)));
    if ((*quantized)[i]) {
      if (!tools::QuantizeBf16Fp8(m.bytes(i).data(), t.shape[0], t.shape[1], 128, &q[i]).ok()) return false;
      fp8.emplace_back();
      init_range(&fp8.back(), q[i].codes.data(), q[i].codes.size(), 1);
      fp8.emplace_back();
      init_range(&fp8.back(), reinterpret_cast<const uint8_t*>(q[i].scales.data()), q[i].scales.size() * 4, 4);
    } else {
      fp8.emplace_back();
      init_range(&fp8.back(), m.bytes(i).data(), m.bytes(i).size(), static_cast<uint32_t>(DTypeSize(t.dtype)));
    }
  }
  CaseResult rb{label, "bf16", lr, {}}, rf{label, "fp8", lr, {}};
  for (int s = 0; s < steps; ++s) {
    m.Step();
    size_t k = 0;
    for (size_t i = 0; i < n; ++i) {
      bf16[i].neu = m.bytes(i).data();
      if ((*quantized)[i]) {
        const auto& t = m.tensors()[i];
        if (!tools::QuantizeBf16Fp8(m.bytes(i).data(), t.shape[0], t.shape[1], 128, &q[i]).ok()) return false;
        fp8[k++].neu = q[i].codes.data();
        fp8[k++].neu = reinterpret_cast<const uint8_t*>(q[i].scales.data());
      } else {
        fp8[k++].neu = m.bytes(i).data();
      }
    }
    if (!MeasureStep(bf16, reps, verbose, &rb.f) || !MeasureStep(fp8, reps, verbose, &rf.f)) return false;
  }
  results->push_back(rb);
  results->push_back(rf);
  return true;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) {
  using namespace wsync;
  CLI::App app{"delta updates on RL-like steps: bytes and rates vs dense"};
  int steps = 2, reps = 5;
  bool verbose = false, hash_base = false;
  std::vector<double> lrs = {1e-6, 1e-5};
  int64_t layers_06b = 2, vocab_06b = 16384, layers_moe = 1;
  std::string models = WSYNC_BENCH_MODELS_DIR, moe = WSYNC_BENCH_MOE_CONFIG;
  app.add_option("--steps", steps, "steps measured per case")->check(CLI::PositiveNumber);
  app.add_option("--reps", reps, "timed rounds per step (the best counts)")->check(CLI::PositiveNumber);
  app.add_flag("--hash-base", hash_base, "the encoder hashes the base instead of taking the checksum the source kept");
  app.add_flag("--verbose", verbose, "print each timed pass (stderr)");
  app.add_option("--lrs", lrs, "learning rates")->delimiter(',');
  app.add_option("--layers-06b", layers_06b, "Qwen3-0.6B layers kept");
  app.add_option("--vocab-06b", vocab_06b, "Qwen3-0.6B vocabulary rows kept");
  app.add_option("--layers-moe", layers_moe, "qwen3-moe-2l layers kept");
  app.add_option("--models", models, "directory of model configs (Qwen__Qwen3-0.6B/config.json)");
  app.add_option("--moe-config", moe, "config.json of qwen3-moe-2l");
  CLI11_PARSE(app, argc, argv);

  std::vector<CaseResult> results;
  for (double lr : lrs) {
    if (!RunModel("Qwen3-0.6B", models + "/Qwen__Qwen3-0.6B/config.json", layers_06b, vocab_06b, lr, steps, reps,
                  verbose, hash_base, &results) ||
        !RunModel("qwen3-moe-2l", moe, layers_moe, 0, lr, steps, reps, verbose, hash_base, &results)) {
      return 1;
    }
  }
  std::printf("%-13s %-6s %-5s %10s %10s %8s %9s %9s %9s  %s\n", "model", "lr", "tgt", "dense MB", "sent MB", "sent/dn",
              "enc/mcpy", "apl/mcpy", "dense/all", "formats bitmap/gaps/runs");
  json j = {{"bench", "delta"}, {"value", 0.0}, {"baseline", "dense bytes"}, {"ratio", 0.0}};
  for (const CaseResult& r : results) {
    const Figures& f = r.f;
    const double sent_ratio = static_cast<double>(f.sent) / f.dense;
    const double enc_ratio = f.t_memcpy / f.t_encode, apply_ratio = f.t_memcpy / f.t_apply;
    std::printf("%-13s %-6g %-5s %10.2f %10.2f %8.4f %9.2f %9.2f %4llu/%-4llu  %llu/%llu/%llu\n", r.model.c_str(), r.lr,
                r.target.c_str(), f.dense / 1e6 / steps, f.sent / 1e6 / steps, sent_ratio, enc_ratio, apply_ratio,
                static_cast<unsigned long long>(f.dense_ranges), static_cast<unsigned long long>(f.ranges),
                static_cast<unsigned long long>(f.formats[1]), static_cast<unsigned long long>(f.formats[2]),
                static_cast<unsigned long long>(f.formats[3]));
    const std::string key = absl::StrFormat("%s_%s_lr%g", r.model, r.target, r.lr);
    j[key + "_bytes_ratio"] = sent_ratio;
    j[key + "_encode_vs_memcpy"] = enc_ratio;
    j[key + "_apply_vs_memcpy"] = apply_ratio;
    if (r.model == "Qwen3-0.6B" && r.target == "bf16" && r.lr == 1e-6) j["value"] = j["ratio"] = sent_ratio;
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}
