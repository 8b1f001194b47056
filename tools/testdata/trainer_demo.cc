// wsync-trainer-demo: stands in for one trainer rank. Each update it pushes the HF tensors its daemon asks for,
// generated deterministically from (tensor name, step) — the same tensors the reference engine derives its
// expectation from. The rank started with --drive also opens and commits each update on the coordinator (the calls
// a `trainer` certificate may make), asks every engine to verify what it holds, and prints the summary. Under a
// shard-aware plan (coordinator --strategy local) the daemon also asks for slices (the rank's TP shard of a tensor);
// the demo cuts them from the generated tensor and pushes only them.

#include <unistd.h>
#ifdef WSYNC_DEMO_CUDA
#include <cuda_runtime.h>
#endif

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/cli.h"
#include "base/logging.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "proto/status_convert.h"
#include "proto/tls.h"
#include "replica/fp8.h"
#include "replica/model_config.h"
#include "spdlog/spdlog.h"
#include "tools/testdata/step_files.h"
#include "tools/testdata/weight_gen.h"
#include "wsync/v1/engine.grpc.pb.h"

using namespace wsync;

namespace {

absl::StatusOr<v1::VerifyReply> VerifyEngine(const std::string& addr, int64_t step) {
  auto channel = tls::Dial(addr);
  if (!channel.ok()) return channel.status();
  auto stub = v1::EngineControl::NewStub(*std::move(channel));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
  v1::VerifyRequest req;
  req.set_step(step);
  v1::VerifyReply rep;
  grpc::Status s = stub->Verify(&ctx, req, &rep);
  if (!s.ok()) return FromGrpcStatus(s);
  return rep;
}

// Device copies of the tensors a `--prequantize gpu` rank pushes from CUDA memory: alive until the update's EndPush
// returned (the client copies them asynchronously).
class DeviceTensors {
 public:
  ~DeviceTensors() { Clear(); }
  absl::StatusOr<const void*> Upload(const std::vector<uint8_t>& host) {
#ifdef WSYNC_DEMO_CUDA
    void* d = nullptr;
    if (cudaError_t e = cudaMalloc(&d, host.size()); e != cudaSuccess)
      return absl::InternalError(absl::StrCat("cudaMalloc(", host.size(), "): ", cudaGetErrorString(e)));
    buffers_.push_back(d);
    if (cudaError_t e = cudaMemcpy(d, host.data(), host.size(), cudaMemcpyHostToDevice); e != cudaSuccess)
      return absl::InternalError(absl::StrCat("cudaMemcpy H2D of ", host.size(), " bytes: ", cudaGetErrorString(e)));
    return static_cast<const void*>(d);
#else
    (void)host;
    return absl::UnimplementedError("--prequantize gpu: this build has no CUDA (WSYNC_WITH_CUDA=OFF)");
#endif
  }
  void Clear() {
#ifdef WSYNC_DEMO_CUDA
    for (void* d : buffers_) cudaFree(d);
#endif
    buffers_.clear();
  }

 private:
  std::vector<void*> buffers_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"wsync-trainer-demo: one synthetic trainer rank pushing deterministic weights"};
  std::string daemon_addr, model, coordinator, log_level;
  cli::AddCommonFlags(app, "wsync-trainer-demo", &log_level);
  std::vector<std::string> verify_engines;
  int local_rank = 0, global_rank = 0, updates = 3;
  int64_t first_version = 1;
  bool drive = false;
  uint64_t bucket_mib = 0;
  int64_t crash_after = -1;
  app.add_option("--daemon", daemon_addr, "the local source wsyncd's trainer socket (its --trainer-socket path)")
      ->required();
  double connect_timeout_s = 30;
  app.add_option("--connect-timeout", connect_timeout_s, "seconds to wait for the daemon's trainer socket")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--model", model, "HF config.json")->required()->check(CLI::ExistingFile);
  app.add_option("--local-rank", local_rank, "rank index on this node");
  app.add_option("--global-rank", global_rank, "global trainer rank");
  app.add_option("--updates", updates, "number of consecutive updates")->check(CLI::Range(1, 1000000));
  app.add_option("--first-version", first_version, "version (and generation step) of the first update");
  app.add_option("--bucket-mib", bucket_mib, "bucket size in MiB (0: half the ring)");
  app.add_flag("--drive", drive, "open and commit every update on the coordinator");
  app.add_option("--coordinator", coordinator, "coordinator host:port (with --drive)")->envname("WSYNC_COORDINATOR");
  app.add_option("--verify-engine", verify_engines, "engine control address to verify after each update (--drive)");
  std::string prequantize = "none";
  app.add_option("--prequantize", prequantize,
                 "push the tensors the daemon offers for FP8 already quantized: host (CPU quantizer, replica/fp8.h) or "
                 "gpu (from CUDA memory with the client's GPU quantizer, TrainerOptions::gpu_fp8); fails when an FP8 "
                 "update offers none")
      ->check(CLI::IsMember({"none", "host", "gpu"}))
      ->capture_default_str();
  app.add_option("--crash-after-bytes", crash_after,
                 "testing: die (exit 3) half-way through writing the tensor that crosses this many pushed bytes");
  std::string steps_dir;
  app.add_option("--steps-dir", steps_dir,
                 "push step v of the RL-like steps `wsync-rl-steps --out DIR` wrote (DIR/step_NNNNNN.safetensors) at "
                 "update v, instead of the generated weights")
      ->check(CLI::ExistingDirectory);
  std::vector<std::string> delta_modes;
  app.add_option("--delta", delta_modes,
                 "delta mode of each update (--drive): auto, off or always; several (comma-separated) are used in "
                 "turn, update i taking the (i mod n)th")
      ->delimiter(',')
      ->check(CLI::IsMember({"auto", "off", "always"}));
  tls::Options tls_opts;  // a trainer certificate (CN "trainer:NAME")
  tls::AddFlags(app, &tls_opts);
  if (int rc = cli::Parse(app, argc, argv); rc >= 0) return rc;
  InitLogging(absl::StrCat("trainer", global_rank), log_level);
  {
    std::vector<std::string> addresses = {daemon_addr, coordinator};
    addresses.insert(addresses.end(), verify_engines.begin(), verify_engines.end());
    if (auto st = tls::Configure(tls_opts, addresses, {"wsync-trainer-demo", {tls::kTrainer}, ""}); !st.ok()) {
      spdlog::error("{}", st.ToString());
      return 2;
    }
  }
  if (drive && coordinator.empty()) {
    spdlog::error("--drive needs --coordinator");
    return 2;
  }

  auto cfg = replica::ModelConfig::FromFile(model);
  if (!cfg.ok()) {
    spdlog::error("{}", cfg.status().ToString());
    return 2;
  }
  auto specs = replica::CheckpointTensors(*cfg);
  if (!specs.ok()) {
    spdlog::error("{}", specs.status().ToString());
    return 2;
  }
  std::map<std::string, const replica::TensorSpec*> by_name;
  for (const auto& s : *specs) by_name[s.name] = &s;
  // Tensor `name` of step `step`: generated, or read from --steps-dir (which the tensor must be in).
  tools::StepFiles step_files(steps_dir);
  auto fill = [&](const std::string& name, int64_t step, DType dtype, uint64_t elems, uint8_t* dst) -> absl::Status {
    if (steps_dir.empty()) {
      tools::GenerateTensor(name, step, dtype, elems, dst);
      return absl::OkStatus();
    }
    const uint64_t bytes = elems * DTypeSize(dtype);
    auto src = step_files.Tensor(step, name, dtype, bytes);
    if (!src.ok()) return src.status();
    std::memcpy(dst, *src, bytes);
    return absl::OkStatus();
  };

  client::TrainerOptions o;
  o.daemon = daemon_addr;
  o.local_rank = local_rank;
  o.global_rank = global_rank;
  o.bucket_bytes = bucket_mib << 20;
  o.connect_timeout = absl::Seconds(connect_timeout_s);
  o.gpu_fp8 = prequantize == "gpu";
  auto c = client::TrainerClient::Connect(o);
  if (!c.ok()) {
    spdlog::error("{}", c.status().ToString());
    return 1;
  }
  std::unique_ptr<client::CoordinatorClient> coord;
  if (drive) coord = std::make_unique<client::CoordinatorClient>(coordinator);

  bool all_ok = true;
  int prequantized = 0;
  uint64_t total_bytes = 0;
  int engine_ranks = 0;
  for (int u = 0; u < updates; ++u) {
    const int64_t v = first_version + u;
    if (drive) {
      const std::string delta = delta_modes.empty() ? "" : delta_modes[u % delta_modes.size()];
      auto b = coord->BeginUpdate(v, "", "", delta);
      if (!b.ok()) {
        spdlog::error("begin update {}: {}", v, b.status().ToString());
        return 1;
      }
      // Progress as it goes (the demo shows this rank's output live): phase by phase, then the committed record.
      std::printf("update %lld: begun (engines paused in %.3fs, sources configured in %.3fs); pushing\n",
                  static_cast<long long>(v), b->pause_seconds(), b->configure_seconds());
      std::fflush(stdout);
    }
    // A driving rank whose push fails makes the update it opened fail, without AbortUpdate (an admin's call: the
    // trainer role may only begin and commit, docs/security.md): it closes its session, which its source daemon
    // counts as a lost rank once --rank-grace has passed, and commits; the commit then fails with that cause (or
    // with the coordinator's own, when the update had failed already), and the engines stay paused.
    auto give_up = [&](const std::string& why) {
      spdlog::error("{}", why);
      if (drive) {
        c->reset();  // closes the session: this rank will not finish pushing v
        std::string verdict = why;
        if (auto rec = coord->CommitUpdate(v); !rec.ok()) {
          verdict = absl::StrCat(why, "; the coordinator: ", rec.status().message());
        } else {
          spdlog::warn("update {} committed although this rank gave up on it", v);
        }
        std::printf("wsync demo: update %lld FAILED: %s\n", static_cast<long long>(v), verdict.c_str());
      }
      return 1;
    };
    auto names = (*c)->BeginPush(v);
    if (!names.ok()) return give_up(names.status().ToString());
    absl::Time t0 = absl::Now();
    const v1::Fp8PushHint& hint = (*c)->fp8_hint();
    const std::set<std::string> fp8_names(hint.tensor_names().begin(), hint.tensor_names().end());
    if (prequantize != "none" && fp8_names.empty() && !names->empty())
      return give_up(absl::StrCat("--prequantize ", prequantize, ": update ", v, " offers no tensor for FP8 "
                                  "pre-quantization (the node's replica is not FP8)"));
    DeviceTensors device;
    std::vector<uint8_t> host, codes;
    std::vector<float> scales;
    for (const auto& n : *names) {
      auto it = by_name.find(n);
      if (it == by_name.end()) {
        spdlog::error("daemon asked for tensor {} which this model does not have", n);
        return 1;
      }
      const replica::TensorSpec& s = *it->second;
      uint64_t elems = s.bytes() / DTypeSize(s.dtype);
      if (prequantize != "none" && fp8_names.count(n) && s.shape.size() == 2) {
        host.resize(s.bytes());
        absl::Status st = fill(s.name, v, s.dtype, elems, host.data());
        if (!st.ok()) return give_up(st.ToString());
        if (prequantize == "gpu") {
          auto d = device.Upload(host);
          st = d.ok() ? (*c)->PushDevice(s.name, s.dtype, s.shape, *d, s.bytes(), 0, 0) : d.status();
        } else {
          // The CPU quantizer with the hint's block and scale format: codes, then `<name>_scale_inv`.
          const int bn = hint.block_n(), bk = hint.block_k();
          const int64_t rows = s.shape[0], cols = s.shape[1], sr = (rows + bn - 1) / bn, sc = (cols + bk - 1) / bk;
          codes.resize(static_cast<size_t>(rows * cols));
          scales.resize(static_cast<size_t>(sr * sc));
          st = replica::QuantizeFp8Block(s.dtype, host.data(), rows, cols, cols, bn, bk, codes.data(), cols,
                                         scales.data(), sc,
                                         hint.ue8m0() ? replica::Fp8ScaleFormat::kUe8m0
                                                      : replica::Fp8ScaleFormat::kFloat32);
          if (st.ok()) st = (*c)->Push(s.name, DType::kF8E4M3, s.shape, codes.data(), codes.size());
          const int64_t sshape[2] = {sr, sc};
          if (st.ok())
            st = (*c)->Push(s.name + "_scale_inv", DType::kF32, sshape, scales.data(), scales.size() * sizeof(float));
        }
        if (!st.ok()) return give_up(absl::StrCat("push ", s.name, " pre-quantized (", prequantize, "): ", st.ToString()));
        ++prequantized;
        continue;
      }
      absl::Status filled;
      auto st = (*c)->PushWith(s.name, s.dtype, s.shape, s.bytes(), [&](uint8_t* dst) {
        if (crash_after >= 0 && (*c)->stats().bytes + s.bytes() > static_cast<uint64_t>(crash_after)) {
          // Simulates a trainer dying mid-tensor: half the bytes written, nothing committed.
          tools::GenerateTensor(s.name, v, s.dtype, elems / 2, dst);
          std::fflush(nullptr);
          _exit(3);
        }
        filled = fill(s.name, v, s.dtype, elems, dst);
      });
      if (st.ok()) st = filled;
      if (!st.ok()) return give_up(absl::StrCat("push ", s.name, ": ", st.ToString()));
    }
    std::vector<uint8_t> full;
    for (const TensorSlice& sl : (*c)->push_slices()) {
      auto it = by_name.find(sl.name);
      if (it == by_name.end()) {
        spdlog::error("daemon asked for a slice of tensor {} which this model does not have", sl.name);
        return 1;
      }
      const replica::TensorSpec& s = *it->second;
      const size_t es = DTypeSize(s.dtype);
      full.resize(s.bytes());
      if (auto st = fill(s.name, v, s.dtype, s.bytes() / es, full.data()); !st.ok()) return give_up(st.ToString());
      const uint64_t bytes = static_cast<uint64_t>(sl.rows * sl.cols) * es;
      auto st = (*c)->PushWith(EncodeSliceName(sl.name, sl.full_shape, sl.offsets), s.dtype, sl.extents, bytes,
                               [&](uint8_t* dst) {
                                 for (int64_t r = 0; r < sl.rows; ++r)
                                   std::memcpy(dst + r * sl.cols * es,
                                               full.data() + ((sl.row0 + r) * sl.full_cols + sl.col0) * es,
                                               sl.cols * es);
                               });
      if (!st.ok()) return give_up(absl::StrCat("push slice of ", sl.name, " (", sl.Describe(), "): ", st.ToString()));
    }
    if (auto st = (*c)->EndPush(v); !st.ok()) return give_up(st.ToString());
    device.Clear();
    if (prequantize != "none")
      std::printf("update %lld: %d tensors pushed pre-quantized to FP8 (%s; %d offered)\n", static_cast<long long>(v),
                  prequantized, prequantize.c_str(), static_cast<int>(fp8_names.size()));
    prequantized = 0;
    const auto& ps = (*c)->stats();
    spdlog::info(
        "update {}: pushed {} tensors, {:.1f} MiB in {} buckets ({:.2f}s); {} tensors, {:.1f} MiB placed "
        "straight into the replica",
        v, ps.tensors, ps.bytes / 1048576.0, ps.buckets, absl::ToDoubleSeconds(absl::Now() - t0), ps.placed,
        ps.placed_bytes / 1048576.0);
    if (!drive) continue;
    const double push_wall = absl::ToDoubleSeconds(absl::Now() - t0);
    std::printf(
        "update %lld: this rank pushed %.1f MiB in %.2fs (%.2f GB/s); committing (every rank's writes, then "
        "the engines' post-processing)\n",
        static_cast<long long>(v), ps.bytes / 1048576.0, push_wall, push_wall > 0 ? ps.bytes / push_wall / 1e9 : 0.0);
    std::fflush(stdout);
    auto rec = coord->CommitUpdate(v);
    if (!rec.ok()) {
      spdlog::error("commit update {}: {}", v, rec.status().ToString());
      std::printf("wsync demo: update %lld FAILED: %s\n", static_cast<long long>(v), rec.status().ToString().c_str());
      return 1;
    }
    std::string phases;
    for (const auto& p : rec->phases()) absl::StrAppendFormat(&phases, " %s=%.3fs", p.phase(), p.seconds());
    double push_s = 0;
    for (const auto& p : rec->phases())
      if (p.phase() == "push") push_s = p.seconds();
    std::printf("update %lld: %.1f MiB to %d engine ranks in %.3fs (%.2f GB/s over the push phase);%s\n",
                static_cast<long long>(v), rec->bytes() / 1048576.0, rec->engine_ranks(), rec->total_seconds(),
                push_s > 0 ? rec->bytes() / push_s / 1e9 : 0.0, phases.c_str());
    // What went over the wire: dense ranges plus delta records (docs/delta.md), and the ranks written dense.
    std::printf("update %lld: delta %s: %llu bytes sent for %llu dense (%.4f), %d ranks with deltas, %d dense\n",
                static_cast<long long>(v), rec->delta_mode().empty() ? "auto" : rec->delta_mode().c_str(),
                static_cast<unsigned long long>(rec->sent_bytes()), static_cast<unsigned long long>(rec->dense_bytes()),
                rec->dense_bytes() > 0 ? static_cast<double>(rec->sent_bytes()) / rec->dense_bytes() : 0.0,
                rec->delta_ranks_size(), rec->fallbacks_size());
    for (const auto& f : rec->fallbacks()) std::printf("  dense %s: %s\n", f.rank().c_str(), f.reason().c_str());
    total_bytes += rec->bytes();
    engine_ranks = rec->engine_ranks();
    for (const auto& e : verify_engines) {
      auto r = VerifyEngine(e, v);
      if (!r.ok()) {
        spdlog::error("verify {}: {}", e, r.status().ToString());
        all_ok = false;
        continue;
      }
      std::printf("  engine %s: %s, %lld params / %.1f MiB checked on %d ranks\n", e.c_str(),
                  r->ok() ? "verified bit-exact" : "MISMATCH", static_cast<long long>(r->params_checked()),
                  r->bytes_checked() / 1048576.0, r->ranks());
      for (const auto& m : r->mismatches()) std::printf("    %s\n", m.c_str());
      all_ok = all_ok && r->ok();
    }
    std::fflush(stdout);
  }
  if (drive) {
    std::printf("wsync demo: %d updates, %d engine ranks, %.2f GB written, %s\n", updates, engine_ranks,
                total_bytes / 1e9,
                verify_engines.empty() ? "not verified" : (all_ok ? "all verified bit-exact" : "VERIFICATION FAILED"));
  }
  return all_ok ? 0 : 1;
}
