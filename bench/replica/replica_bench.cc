// Replica load rate: HF tensors of one real model layer (Qwen3-30B-A3B MoE layer, DeepSeek-V3 MoE layer) pushed
// through Replica::Ingest into one engine rank's layout, at several tp/ep, next to memcpy of the same bytes measured
// in the same run; once on one thread and once on every thread (each thread loading its own replica from the same
// HF tensors, as a daemon loading several layouts at once would). Then FP8 block quantization (QuantizeFp8Block,
// bf16 → e4m3 + scales) next to memcpy of the same source bytes.
//
// Bytes counted for the replica are the bytes of the engine parameters that became ready (what the daemon then
// sends); HF bytes read are printed beside them. The configs are the real ones with three cuts so that one layer
// fits a build machine: one layer (MoE, first_k_dense_replace 0), a small vocabulary (embedding and lm_head are not
// part of the layer and are not fed), and the routed experts capped at --experts (each expert keeps its real size).
// HF tensor contents come from one random bf16 pool that every tensor points into.
// Each measurement is the best of --reps rounds. Last line: one JSON object.
//   bench_replica [--models DIR] [--experts N] [--reps N] [--threads N]

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "replica/fp8.h"
#include "replica/model_config.h"
#include "replica/replica.h"

namespace wsync::replica {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;  // keeps "bench","value","baseline","ratio" first

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

struct Case {
  std::string model;  // directory under --models
  int tp, ep;
  QuantSpec quant;
  std::string label;
};

struct Input {
  std::vector<TensorSpec> tensors;  // of the one layer, in checkpoint order
  uint64_t max_bytes = 0;
};

// Runs `fn(t)` on `threads` threads at once; returns the wall time.
template <typename Fn>
double RunOnThreads(int threads, Fn fn) {
  std::vector<std::thread> pool;
  std::atomic<int> ready{0};
  std::atomic<bool> go{false};
  Clock::time_point start;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      ready.fetch_add(1);
      while (!go.load(std::memory_order_acquire)) {
      }
      fn(t);
    });
  }
  while (ready.load() != threads) {
  }
  start = Clock::now();
  go.store(true, std::memory_order_release);
  for (auto& th : pool) th.join();
  return Seconds(start, Clock::now());
}

class Bench {
 public:
  Bench(std::string models_dir, int experts, int reps, int threads)
      : models_dir_(std::move(models_dir)), experts_(experts), reps_(reps), threads_(threads) {}

  absl::StatusOr<ModelConfig> LayerConfig(const std::string& model) const {
    const std::string path = models_dir_ + "/" + model + "/config.json";
    FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot open ", path, " (pass --models DIR)"));
    std::string text;
    char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
    std::fclose(f);
    json j = json::parse(text);
    j["num_hidden_layers"] = 1;
    j["first_k_dense_replace"] = 0;
    j["num_nextn_predict_layers"] = 0;
    j["vocab_size"] = 1024;
    for (const char* key : {"num_experts", "n_routed_experts"}) {
      if (j.contains(key) && j[key].is_number() && j[key].get<int>() > experts_) j[key] = experts_;
    }
    return ModelConfig::FromJson(j.dump());
  }

  // The tensors of layer 0 and the pool they read from.
  absl::StatusOr<Input> LayerInput(const ModelConfig& config) {
    auto all = CheckpointTensors(config);
    if (!all.ok()) return all.status();
    Input in;
    for (TensorSpec& t : *all) {
      if (t.name.rfind("model.layers.0.", 0) != 0) continue;
      in.max_bytes = std::max<uint64_t>(in.max_bytes, t.bytes());
      in.tensors.push_back(std::move(t));
    }
    if (pool_.size() < in.max_bytes) {
      pool_.resize(in.max_bytes);
      std::mt19937 rng(1);
      std::normal_distribution<float> normal(0.0f, 0.02f);
      uint16_t* p = reinterpret_cast<uint16_t*>(pool_.data());
      for (size_t i = 0; i < pool_.size() / 2; ++i) p[i] = FloatToBf16(normal(rng));
    }
    return in;
  }

  // One round: BeginUpdate and ingest every tensor this layout needs; returns (ready bytes, HF bytes read).
  absl::Status Round(Replica& rep, const Input& in, uint64_t* ready_bytes, uint64_t* hf_bytes) {
    rep.BeginUpdate();
    *ready_bytes = 0;
    *hf_bytes = 0;
    for (const TensorSpec& t : in.tensors) {
      if (!rep.Needs(t.name)) continue;
      HfTensor h;
      h.name = t.name;
      h.dtype = t.dtype;
      h.shape = t.shape;
      h.data = pool_.data();
      h.bytes = t.bytes();
      auto ready = rep.Ingest(h);
      if (!ready.ok()) return ready.status();
      *hf_bytes += t.bytes();
      for (const ReadyParam& p : *ready) *ready_bytes += rep.table(p.layout).params()[p.param].bytes;
    }
    return absl::OkStatus();
  }

  // Best GB/s of memcpy of `bytes` (from the pool, cycling) on `threads` threads, each into its own buffer.
  double MemcpyGbps(uint64_t bytes, int threads, std::vector<std::vector<uint8_t>>& dst) {
    dst.resize(threads);
    for (auto& d : dst) {
      if (d.size() < bytes) d.assign(bytes, 1);  // touched once, outside the timing
    }
    double best = 0;
    for (int r = 0; r < reps_; ++r) {
      const double s = RunOnThreads(threads, [&](int t) {
        for (uint64_t off = 0; off < bytes;) {
          const uint64_t n = std::min<uint64_t>({bytes - off, pool_.size(), uint64_t{64} << 20});
          std::memcpy(dst[t].data() + off, pool_.data(), n);
          off += n;
        }
      });
      best = std::max(best, threads * bytes / s / 1e9);
    }
    return best;
  }

  absl::StatusOr<json> RunCase(const Case& c) {
    auto config = LayerConfig(c.model);
    if (!config.ok()) return config.status();
    auto in = LayerInput(*config);
    if (!in.ok()) return in.status();
    const RankParallelism rank = RankParallelism::ForTp(c.tp, 0, c.ep);
    std::vector<std::unique_ptr<Replica>> reps;
    for (int t = 0; t < threads_; ++t) {
      auto r = Replica::Create(*config, {rank}, c.quant);
      if (!r.ok()) return r.status();
      reps.push_back(std::move(*r));
    }
    uint64_t ready = 0, hf = 0;
    // Warm-up round: first touch of the replica pages, outside the timing.
    for (auto& r : reps) {
      auto s = Round(*r, *in, &ready, &hf);
      if (!s.ok()) return s;
    }
    json out = {{"case", c.label}, {"ready_mib", ready / 1048576.0}, {"hf_read_mib", hf / 1048576.0}};
    for (int threads : {1, threads_}) {
      double best = 0;
      absl::Status err;
      for (int r = 0; r < reps_; ++r) {
        std::vector<absl::Status> st(threads);
        const double s = RunOnThreads(threads, [&](int t) {
          uint64_t a, b;
          st[t] = Round(*reps[t], *in, &a, &b);
        });
        for (auto& x : st) {
          if (!x.ok()) return x;
        }
        best = std::max(best, threads * ready / s / 1e9);
      }
      const double base = MemcpyGbps(ready, threads, memcpy_dst_);
      const std::string sfx = threads == 1 ? "_1t" : "_mt";
      out["replica_gbps" + sfx] = best;
      out["memcpy_gbps" + sfx] = base;
      std::printf(
          "%-44s %2d thr  replica %7.2f GB/s  memcpy %7.2f GB/s  ratio %.2f  (%.1f MiB ready, %.1f MiB HF)%s\n",
          c.label.c_str(), threads, best, base, best / base, ready / 1048576.0, hf / 1048576.0,
          c.quant.mode == QuantSpec::Mode::kFp8Block ? " [ready = fp8 + scales, about half the bf16 bytes]" : "");
      std::fflush(stdout);
      if (threads_ == 1) {
        out["replica_gbps_mt"] = best;
        out["memcpy_gbps_mt"] = base;
        break;
      }
    }
    return out;
  }

  // QuantizeFp8Block on a DeepSeek-V3 expert gate_proj-sized bf16 matrix [2048, 7168], 128x128 blocks.
  json Fp8(int threads) {
    const int64_t rows = 2048, cols = 7168, bn = 128, bk = 128;
    const uint64_t src_bytes = rows * cols * 2;
    std::vector<uint8_t> src(src_bytes);
    {
      std::mt19937 rng(2);
      std::normal_distribution<float> normal(0.0f, 0.02f);
      uint16_t* p = reinterpret_cast<uint16_t*>(src.data());
      for (int64_t i = 0; i < rows * cols; ++i) p[i] = FloatToBf16(normal(rng));
    }
    std::vector<std::vector<uint8_t>> q(threads, std::vector<uint8_t>(rows * cols, 1));
    std::vector<std::vector<float>> s(threads, std::vector<float>((rows / bn) * (cols / bk), 1.0f));
    double best = 0;
    for (int r = 0; r < reps_ + 1; ++r) {
      const double sec = RunOnThreads(threads, [&](int t) {
        (void)QuantizeFp8Block(DType::kBF16, src.data(), rows, cols, cols, bn, bk, q[t].data(), cols, s[t].data(),
                               cols / bk);
      });
      if (r > 0) best = std::max(best, threads * src_bytes / sec / 1e9);
    }
    std::vector<std::vector<uint8_t>> dst;
    std::vector<uint8_t> saved_pool;
    saved_pool.swap(pool_);
    pool_ = src;
    const double base = MemcpyGbps(src_bytes, threads, dst);
    pool_.swap(saved_pool);
    std::printf("%-44s %2d thr  quant   %7.2f GB/s  memcpy %7.2f GB/s  ratio %.2f  (bf16 source bytes)\n",
                "fp8 QuantizeFp8Block [2048,7168] 128x128", threads, best, base, best / base);
    std::fflush(stdout);
    return {{"threads", threads}, {"quant_gbps", best}, {"memcpy_gbps", base}};
  }

 private:
  std::string models_dir_;
  int experts_, reps_, threads_;
  std::vector<uint8_t> pool_;
  std::vector<std::vector<uint8_t>> memcpy_dst_;
};

int Main(int argc, char** argv) {
  CLI::App app{"bench_replica: Replica::Ingest load rate vs memcpy, and FP8 block quantization vs memcpy"};
  std::string models = WSYNC_BENCH_MODELS_DIR;
  int experts = 16, reps = 3;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("--models", models, "directory of <org>__<name>/config.json")->capture_default_str();
  app.add_option("--experts", experts, "cap on routed experts per layer, at least 8 (each keeps its real size)")
      ->capture_default_str();
  app.add_option("--reps", reps, "rounds per measurement; the best is reported")->capture_default_str();
  app.add_option("--threads", threads, "threads for the all-threads runs")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  experts = std::max(experts, 8);  // the cases go up to ep 8
  threads = std::max(1, threads);
  reps = std::max(1, reps);

  QuantSpec fp8;
  fp8.mode = QuantSpec::Mode::kFp8Block;
  const std::vector<Case> cases = {
      {"Qwen__Qwen3-30B-A3B", 1, 1, {}, "Qwen3-30B-A3B layer, tp1"},
      {"Qwen__Qwen3-30B-A3B", 4, 1, {}, "Qwen3-30B-A3B layer, tp4 ep1 (moe_tp4)"},
      {"Qwen__Qwen3-30B-A3B", 4, 4, {}, "Qwen3-30B-A3B layer, tp4 ep4"},
      {"Qwen__Qwen3-30B-A3B", 8, 2, {}, "Qwen3-30B-A3B layer, tp8 ep2 (KV repl.)"},
      {"deepseek-ai__DeepSeek-V3", 8, 1, {}, "DeepSeek-V3 layer, tp8 ep1 (moe_tp8)"},
      {"deepseek-ai__DeepSeek-V3", 8, 8, {}, "DeepSeek-V3 layer, tp8 ep8"},
      {"deepseek-ai__DeepSeek-V3", 8, 8, fp8, "DeepSeek-V3 layer, tp8 ep8, bf16->fp8 128x128"},
  };
  std::printf("bench_replica: %d experts max per layer, best of %d, all-threads = %d\n", experts, reps, threads);
  Bench bench(models, experts, reps, threads);
  json results = json::array();
  double sum_bytes_over_rate_1t = 0, sum_bytes_over_base_1t = 0, sum_bytes_over_rate_mt = 0, sum_bytes_over_base_mt = 0,
         sum_bytes = 0;
  for (const Case& c : cases) {
    auto r = bench.RunCase(c);
    if (!r.ok()) {
      std::fprintf(stderr, "%s: %s\n", c.label.c_str(), r.status().ToString().c_str());
      return 1;
    }
    // Aggregate as total bytes / total time, so every case weighs by its bytes.
    const double mib = (*r)["ready_mib"].get<double>();
    sum_bytes += mib;
    sum_bytes_over_rate_1t += mib / (*r)["replica_gbps_1t"].get<double>();
    sum_bytes_over_base_1t += mib / (*r)["memcpy_gbps_1t"].get<double>();
    sum_bytes_over_rate_mt += mib / (*r)["replica_gbps_mt"].get<double>();
    sum_bytes_over_base_mt += mib / (*r)["memcpy_gbps_mt"].get<double>();
    results.push_back(*r);
  }
  const json q1 = bench.Fp8(1);
  const json qn = threads > 1 ? bench.Fp8(threads) : q1;

  const double value = sum_bytes / sum_bytes_over_rate_1t;
  const double baseline = sum_bytes / sum_bytes_over_base_1t;
  const double value_mt = sum_bytes / sum_bytes_over_rate_mt;
  const double baseline_mt = sum_bytes / sum_bytes_over_base_mt;
  json summary = {{"bench", "replica"},
                  {"value", value},
                  {"baseline", baseline},
                  {"ratio", value / baseline},
                  {"unit", "GB/s of engine-parameter bytes loaded, 1 thread, all cases"},
                  {"threads", threads},
                  {"value_mt", value_mt},
                  {"baseline_mt", baseline_mt},
                  {"ratio_mt", value_mt / baseline_mt},
                  {"fp8_quant_gbps", q1["quant_gbps"]},
                  {"fp8_memcpy_gbps", q1["memcpy_gbps"]},
                  {"fp8_ratio", q1["quant_gbps"].get<double>() / q1["memcpy_gbps"].get<double>()},
                  {"fp8_quant_gbps_mt", qn["quant_gbps"]},
                  {"fp8_memcpy_gbps_mt", qn["memcpy_gbps"]},
                  {"experts_cap", experts},
                  {"cases", results}};
  std::printf("%s\n", summary.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace wsync::replica

int main(int argc, char** argv) { return wsync::replica::Main(argc, argv); }
