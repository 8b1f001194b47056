// Staged vs classic updates in one run (docs/operations.md, "Staged updates"): a local cluster of reference engines
// started with --staging (separate processes, tests/daemon/cluster.h), the same updates pushed in each mode, and per
// engine the time it reported itself paused (GetInfo polled every --poll-ms) divided by the update's wall time
// (BeginUpdate call to CommitUpdate return), and each update's configure phase (0 when no source was configured).
// Ends with one JSON line.
//
//   bench_staged --bin build/bin --model tests/data/tiny/qwen3-tiny.json [--engines 2 --tp 2 --updates 5]

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"
#include "nlohmann/json.hpp"
#include "replica/model_config.h"
#include "tests/daemon/cluster.h"
#include "tools/testdata/weight_gen.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace {

using namespace wsync;
using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Polls every engine's paused flag until stopped; adds up, per engine, the time between polls that saw it paused.
class PauseMeter {
 public:
  PauseMeter(const std::vector<std::string>& engines, int poll_ms) : paused_(engines.size(), 0) {
    for (const auto& e : engines)
      stubs_.push_back(v1::EngineControl::NewStub(grpc::CreateChannel(e, grpc::InsecureChannelCredentials())));
    thread_ = std::thread([this, poll_ms] {
      std::vector<Clock::time_point> last(stubs_.size(), Clock::now());
      while (!stop_) {
        for (size_t i = 0; i < stubs_.size(); ++i) {
          grpc::ClientContext ctx;
          v1::EngineInfo info;
          const bool ok = stubs_[i]->GetInfo(&ctx, v1::GetEngineInfoRequest(), &info).ok();
          const auto now = Clock::now();
          if (ok && info.paused()) paused_[i] += Seconds(now - last[i]);
          last[i] = now;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
      }
    });
  }
  ~PauseMeter() { Stop(); }
  std::vector<double> Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    return paused_;
  }

 private:
  std::vector<std::unique_ptr<v1::EngineControl::Stub>> stubs_;
  std::vector<double> paused_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_staged: paused time per update, classic vs staged, on reference engines"};
  std::string bin, model;
  int engines = 2, tp = 2, updates = 5, poll_ms = 1, ring_mib = 256;
  app.add_option("--bin", bin, "directory of the built binaries")->required();
  app.add_option("--model", model, "HF config.json")->required();
  app.add_option("--engines", engines, "reference engines")->capture_default_str();
  app.add_option("--tp", tp, "ranks per engine")->capture_default_str();
  app.add_option("--updates", updates, "updates per mode")->capture_default_str();
  app.add_option("--poll-ms", poll_ms, "how often each engine's paused flag is read")->capture_default_str();
  app.add_option("--ring-mib", ring_mib, "source ring size (the largest tensor must fit)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  auto cfg = replica::ModelConfig::FromFile(model);
  if (!cfg.ok()) return std::fprintf(stderr, "%s\n", cfg.status().ToString().c_str()), 2;
  auto specs = replica::CheckpointTensors(*cfg);
  if (!specs.ok()) return std::fprintf(stderr, "%s\n", specs.status().ToString().c_str()), 2;
  std::map<std::string, replica::TensorSpec> by_name;
  for (const auto& s : *specs) by_name[s.name] = s;

  testing::ClusterOptions o;
  o.bin_dir = bin;
  o.model = model;
  o.engines = engines;
  o.tp = tp;
  o.engine_args = {"--staging"};
  o.ring_mib = ring_mib;
  testing::Cluster cl(o);
  client::TrainerOptions to;
  to.daemon = cl.trainer_sockets[0];
  to.timeout = absl::Seconds(60);
  auto trainer = client::TrainerClient::Connect(to);
  if (!trainer.ok()) return std::fprintf(stderr, "%s\n", trainer.status().ToString().c_str()), 1;
  client::CoordinatorClient coord(cl.coordinator);

  int64_t version = 0;
  nlohmann::json result = {{"bench", "staged"}, {"engines", engines}, {"tp", tp}, {"updates", updates}};
  std::printf("%-8s %8s %12s %14s %14s\n", "MODE", "UPDATE", "WALL_S", "PAUSED_MAX_S", "PAUSED_RATIO");
  for (const std::string mode : {"classic", "staged"}) {
    double wall_sum = 0, ratio_sum = 0, ratio_max = 0;
    std::vector<double> configure;  // per update: its configure phase (0: none ran)
    for (int u = 0; u < updates; ++u) {
      const int64_t v = ++version;
      PauseMeter meter(cl.engines, poll_ms);
      const auto t0 = Clock::now();
      auto b = coord.BeginUpdate(v, "", mode);
      if (!b.ok()) return std::fprintf(stderr, "begin %ld: %s\n", v, b.status().ToString().c_str()), 1;
      auto names = (*trainer)->BeginPush(v);
      if (!names.ok()) return std::fprintf(stderr, "push %ld: %s\n", v, names.status().ToString().c_str()), 1;
      for (const auto& n : *names) {
        const replica::TensorSpec& s = by_name.at(n);
        auto st = (*trainer)->PushWith(s.name, s.dtype, s.shape, s.bytes(), [&](uint8_t* dst) {
          tools::GenerateTensor(s.name, v, s.dtype, s.bytes() / DTypeSize(s.dtype), dst);
        });
        if (!st.ok()) return std::fprintf(stderr, "push %s: %s\n", n.c_str(), st.ToString().c_str()), 1;
      }
      if (auto st = (*trainer)->EndPush(v); !st.ok()) return std::fprintf(stderr, "%s\n", st.ToString().c_str()), 1;
      auto rec = coord.CommitUpdate(v, 60);
      const double wall = Seconds(Clock::now() - t0);
      const std::vector<double> paused = meter.Stop();
      if (!rec.ok() || !rec->success())
        return std::fprintf(stderr, "commit %ld: %s\n", v,
                            rec.ok() ? rec->error().c_str() : rec.status().ToString().c_str()),
               1;
      double worst = 0;
      for (double p : paused) worst = std::max(worst, p);
      std::printf("%-8s %8ld %12.3f %14.4f %14.4f\n", mode.c_str(), v, wall, worst, worst / wall);
      // Where the commit's time went (the staged switch's phases show what lies inside the paused window).
      std::string phases;
      configure.push_back(0);
      for (const auto& p : rec->phases()) {
        phases += absl::StrFormat(" %s %.1fms", p.phase(), 1e3 * p.seconds());
        if (p.phase() == "configure") configure.back() += p.seconds();
      }
      std::printf("         phases:%s\n", phases.c_str());
      wall_sum += wall;
      ratio_sum += worst / wall;
      ratio_max = std::max(ratio_max, worst / wall);
    }
    result[mode + "_update_seconds_mean"] = wall_sum / updates;
    result[mode + "_paused_ratio_mean"] = ratio_sum / updates;
    result[mode + "_paused_ratio_max"] = ratio_max;
    result[mode + "_configure_seconds"] = configure;
  }
  std::printf("%s\n", result.dump().c_str());
  return 0;
}
