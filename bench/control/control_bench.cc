// bench_control: the control plane at a thousand engine ranks, simulated. One process holds a real Coordinator (its
// gRPC peers, its state store) and N fake node daemons and engines: one gRPC server with mutual TLS (certificates
// from tools/cli/wsync-certs.sh) listening on one loopback port per fake, answering every NodeDaemon and
// EngineControl call the coordinator makes at once. Targets register Kimi-K2's real parameter tables (TP32/EP32
// engines, FP8 64x64 blocks, from the replica planner); every node renews its lease every heartbeat interval.
//
// The fakes run in a child process (forked before gRPC starts): this process is the coordinator (and the driver's
// copy of the registrations it sends), so its CPU and memory figures are the coordinator's; the fakes' memory is
// measured apart.
//
// Per size (target ranks : source nodes), measured per update with no data (sources finish at once):
//   control overhead   BeginUpdate → CommitUpdate returned, median of --updates steady updates
//   re-plan            BeginUpdate after a membership change (one target re-registers): plan + configure sources;
//                      and that RegisterNode's own time (it saves the membership in the state store)
//   CPU                the coordinator process's CPU seconds per steady update
//   RSS                the coordinator process's resident memory growth over the size's run; its peak during the
//                      first update and during the re-plan's update, its growth after the steady updates; the
//                      fakes' peak growth (and, once, each process's peak over every size)
//   CPU of the first update and of the re-plan's update: the load-independent share of those wall times
//   store bytes        bytes the state store wrote per steady update (SQLite; etcd with --etcd)
//   fail-over          etcd: the leader dies without resigning (lease TTL 1 s), until the standby has loaded the
//                      state and can serve (only at sizes up to --etcd-max-ranks)
// Baseline in the same run: one empty EngineControl round trip over the same TLS channels (median of 200), so
// overheads are also given as multiples of it. Prints a table, writes DIR/control_bench.svg (growth with N), and
// ends with one JSON line.
//
//   bench_control [--sizes 64:32,256:64,1024:256] [--updates 5] [--etcd auto|on|off] [--out DIR]

#include <arpa/inet.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <malloc.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "daemon/common/serve.h"
#include "daemon/common/window_assignments.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/etcd_store.h"
#include "daemon/coordinator/fanout.h"
#include "daemon/coordinator/state_store.h"
#include "nlohmann/json.hpp"
#include "proto/tls.h"
#include "replica/layout_plan.h"
#include "replica/model_config.h"
#include "spdlog/spdlog.h"
#include "tools/testdata/planned_layout.h"
#include "wsync/v1/daemon.grpc.pb.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync {
namespace {

namespace fs = std::filesystem;
using daemon::Coordinator;

// Every daemon call answered at once (sources "finish" with nothing written).
class FakeDaemon final : public v1::NodeDaemon::Service {
  grpc::Status ConfigureSource(grpc::ServerContext*, const v1::ConfigureSourceRequest*,
                               v1::ConfigureSourceReply*) override {
    return grpc::Status::OK;
  }
  grpc::Status StartUpdate(grpc::ServerContext*, const v1::StartUpdateRequest*, v1::StartUpdateReply*) override {
    return grpc::Status::OK;
  }
  grpc::Status FinishUpdate(grpc::ServerContext*, const v1::FinishUpdateRequest*, v1::FinishUpdateReply*) override {
    return grpc::Status::OK;
  }
  grpc::Status AbortSourceUpdate(grpc::ServerContext*, const v1::AbortSourceUpdateRequest*,
                                 v1::AbortSourceUpdateReply* r) override {
    r->set_quiescent(true);
    return grpc::Status::OK;
  }
  // As a target daemon keeps the plan's write-window assignments (docs/operations.md, "Write windows"): a request
  // that carries them is answered with their digest; one that names a digest received before is answered as kept.
  // Every fake shares this service, and each target's assignments (its own engine) have their own digest.
  grpc::Status SetWriteWindow(grpc::ServerContext*, const v1::SetWriteWindowRequest* req,
                              v1::SetWriteWindowReply* r) override {
    if (!req->open() || !req->assignments_given()) return grpc::Status::OK;
    std::lock_guard<std::mutex> l(mu_);
    if (req->assignments_held()) {
      if (held_.count(req->assignments_digest()))
        r->set_assignments_digest(req->assignments_digest());
      else
        r->set_assignments_missing(true);
      return grpc::Status::OK;
    }
    const std::string d = daemon::WindowAssignmentsDigest(req->assignments());
    held_.insert(d);
    r->set_assignments_digest(d);
    return grpc::Status::OK;
  }
  // Delta updates (the default, delta auto): the commit asks every target to apply what was staged (nothing here).
  grpc::Status ApplyDelta(grpc::ServerContext*, const v1::ApplyDeltaRequest*, v1::ApplyDeltaReply*) override {
    return grpc::Status::OK;
  }

 private:
  std::mutex mu_;
  std::set<std::string> held_;  // digests of the assignments sent so far
};

class FakeEngine final : public v1::EngineControl::Service {
 public:
  explicit FakeEngine(std::string config) : config_(std::move(config)) {}
  grpc::Status GetInfo(grpc::ServerContext*, const v1::GetEngineInfoRequest*, v1::EngineInfo* r) override {
    r->set_model_config_json(config_);
    return grpc::Status::OK;
  }
  grpc::Status Pause(grpc::ServerContext*, const v1::PauseRequest*, v1::EngineReply* r) override { return Ok(r); }
  grpc::Status PostProcess(grpc::ServerContext*, const v1::PostProcessRequest*, v1::EngineReply* r) override {
    return Ok(r);
  }
  grpc::Status SetWeightVersion(grpc::ServerContext*, const v1::SetWeightVersionRequest*, v1::EngineReply* r) override {
    return Ok(r);
  }
  grpc::Status Continue(grpc::ServerContext*, const v1::ContinueRequest*, v1::EngineReply* r) override { return Ok(r); }

 private:
  static grpc::Status Ok(v1::EngineReply* r) {
    r->set_success(true);
    return grpc::Status::OK;
  }
  const std::string config_;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// `field` of /proc/self/status in MiB: VmRSS (resident now) or VmHWM (the peak).
double StatusMiB(const std::string& field = "VmRSS:") {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::stod(line.substr(field.size())) / 1024.0;
  return 0;
}
double RssMiB() { return StatusMiB(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Resident memory of a process, from /proc/PID/status: now (VmRSS) and the peak since it started or since
// ResetPeak (VmHWM), in MiB.
struct ProcMemory {
  double rss_mib = 0, peak_mib = 0;
};

ProcMemory MemoryOf(const std::string& pid) {
  std::ifstream in("/proc/" + pid + "/status");
  ProcMemory m;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) m.rss_mib = std::stod(line.substr(6)) / 1024.0;
    if (line.rfind("VmHWM:", 0) == 0) m.peak_mib = std::stod(line.substr(6)) / 1024.0;
  }
  return m;
}

// Sets VmHWM back to the resident size now (Linux: "5" to clear_refs), so that the next peak read is a phase's own.
void ResetPeakOf(const std::string& pid) { std::ofstream("/proc/" + pid + "/clear_refs") << "5"; }

// The peak resident memory of this process over the whole run: VmHWM is reset per phase (ResetSelfPeak), so each
// phase's peak is kept here before the reset.
double g_self_peak_mib = 0;
double SelfPeakMiB() { return g_self_peak_mib = std::max(g_self_peak_mib, StatusMiB("VmHWM:")); }
void ResetSelfPeak() {
  SelfPeakMiB();
  ResetPeakOf("self");
}

// The fake daemons and engines, in a child process forked before this process starts gRPC (or any thread): one
// server listening on `ports` loopback ports. The parent is then the coordinator (and this driver) alone, and the
// fakes' memory, mostly the ConfigureSource requests they parse, is measured apart.
class FakesChild {
 public:
  ~FakesChild() { Stop(); }

  bool Start(int ports, const std::string& config, const tls::Options& to) {
    // Close-on-exec: a child this process execs later (etcd) must not hold the stop pipe open, or the fakes never
    // see it close.
    int up[2], down[2];
    if (pipe2(up, O_CLOEXEC) != 0) return false;
    if (pipe2(down, O_CLOEXEC) != 0) return false;
    std::fflush(stdout);
    std::fflush(stderr);
    pid_ = fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) {
      close(up[0]);
      close(down[1]);
      _exit(Serve(ports, config, to, up[1], down[0]));
    }
    close(up[1]);
    close(down[0]);
    stop_fd_ = down[1];
    std::vector<int> bound(ports, 0);
    char* p = reinterpret_cast<char*>(bound.data());
    size_t want = bound.size() * sizeof(int);
    while (want > 0) {
      const ssize_t n = read(up[0], p, want);
      if (n <= 0) break;
      p += n;
      want -= static_cast<size_t>(n);
    }
    close(up[0]);
    if (want > 0) return false;
    for (int b : bound) addrs.push_back(absl::StrCat("127.0.0.1:", b));
    return true;
  }

  ProcMemory Memory() const { return pid_ > 0 ? MemoryOf(std::to_string(pid_)) : ProcMemory{}; }
  // As ResetSelfPeak, for the child: PeakMiB is its peak over the whole run.
  void ResetPeak() {
    if (pid_ <= 0) return;
    PeakMiB();
    ResetPeakOf(std::to_string(pid_));
  }
  double PeakMiB() { return peak_mib_ = std::max(peak_mib_, Memory().peak_mib); }

  // Closing the pipe tells the child to stop (it also stops when this process dies).
  void Stop() {
    if (pid_ <= 0) return;
    close(stop_fd_);
    waitpid(pid_, nullptr, 0);
    pid_ = 0;
  }

  std::vector<std::string> addrs;

 private:
  static int Serve(int ports, const std::string& config, const tls::Options& to, int up, int down) {
    if (!tls::Configure(to, {"127.0.0.1:0"}).ok()) return 1;
    FakeDaemon daemon_svc;
    FakeEngine engine_svc(config);
    grpc::ServerBuilder builder;
    std::vector<int> bound(ports, 0);
    for (int i = 0; i < ports; ++i) builder.AddListeningPort("127.0.0.1:0", tls::ServerCredentials(), &bound[i]);
    builder.RegisterService(&daemon_svc);
    builder.RegisterService(&engine_svc);
    builder.SetMaxReceiveMessageSize(daemon::kMaxControlMessageBytes);
    std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
    if (!server) return 1;
    if (write(up, bound.data(), bound.size() * sizeof(int)) != static_cast<ssize_t>(bound.size() * sizeof(int)))
      return 1;
    close(up);
    char c;
    while (read(down, &c, 1) > 0) {
    }
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    return 0;
  }

  pid_t pid_ = 0;
  int stop_fd_ = -1;
  double peak_mib_ = 0;
};

// The 32 rank tables of a Kimi-K2 TP32/EP32 engine (FP8, 64x64 blocks) as the replica planner lays them out.
std::vector<v1::RankLayout> KimiRanks(const replica::ModelConfig& cfg) {
  replica::QuantSpec q;
  q.mode = replica::QuantSpec::Mode::kFp8Block;
  q.block_n = q.block_k = 64;
  std::vector<v1::RankLayout> out;
  for (int rank = 0; rank < 32; ++rank) {
    const auto par = replica::RankParallelism::ForTp(32, rank, 32);
    auto l = testdata::PlannedRankLayout(cfg, par, q);
    if (!l.ok()) {
      spdlog::critical("layout: {}", l.status().ToString());
      std::exit(1);
    }
    out.push_back(*std::move(l));
  }
  return out;
}

struct Size {
  int target_ranks = 0;
  int sources = 0;
};

struct Result {
  Size size;
  double overhead_ms = 0, begin_ms = 0, commit_ms = 0, first_update_ms = 0, replan_ms = 0;
  double cpu_s = 0, rss_mib = 0;
  // Resident memory above the size's start (MiB), of this process (the coordinator, and the driver's copy of the
  // registrations: registrations_mib) and of the fakes' process apart: the peak of the first update, of the re-plan's
  // update, and the coordinator's resident growth after the steady updates.
  double coord_first_peak_mib = 0, coord_replan_peak_mib = 0, coord_steady_mib = 0, fakes_peak_mib = 0;
  double registrations_mib = 0;
  double first_update_cpu_s = 0, replan_cpu_s = 0;  // process CPU of the first update and of the re-plan's begin
  double reregister_ms = 0, reregister_cpu_s = 0;   // the membership change's RegisterNode (before that begin)
  uint64_t sqlite_bytes = 0;
  int64_t etcd_bytes = -1;
  double failover_s = -1, failover_load_s = -1;
  // Status() answered from another thread every 5 ms during the steady updates: p99 and the longest (ms).
  double status_p99_ms = 0, status_max_ms = 0;
};

// A run at one size with its history prefilled, or its store slowed: what a steady update costs then.
struct SideResult {
  std::string what;  // "history 1000", "store +100 ms per save"
  double overhead_ms = 0, cpu_s = 0, status_p99_ms = 0, status_max_ms = 0;
  int failed = 0;  // updates that failed (a slow store must not fail healthy updates)
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

// Status() from its own thread every 5 ms while it lives; its latencies (ms).
class StatusProbe {
 public:
  explicit StatusProbe(Coordinator* c)
      : thread_([this, c] {
          while (!stop_) {
            const absl::Time t0 = absl::Now();
            c->Status();
            const double ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
            {
              std::lock_guard<std::mutex> l(mu_);
              ms_.push_back(ms);
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
        }) {}
  ~StatusProbe() { Stop(); }
  std::vector<double> Stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> l(mu_);
    return ms_;
  }

 private:
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<double> ms_;
  std::thread thread_;
};

// A state store that takes `delay` longer per save (a slow disk, an etcd leader election in progress).
class SlowStore : public daemon::StateStore {
 public:
  SlowStore(std::unique_ptr<daemon::StateStore> inner, absl::Duration delay) : inner_(std::move(inner)), delay_(delay) {}
  absl::StatusOr<v1::CoordinatorState> Load() override { return inner_->Load(); }
  absl::Status SaveChanges(const v1::CoordinatorState& state, bool nodes_changed) override {
    absl::SleepFor(delay_);
    return inner_->SaveChanges(state, nodes_changed);
  }
  const std::string& path() const override { return inner_->path(); }
  daemon::StateStoreStats stats() const override { return inner_->stats(); }

 private:
  std::unique_ptr<daemon::StateStore> inner_;
  absl::Duration delay_;
};

// A child etcd on loopback in `dir` (the tests' etcd_harness.py does the same); pid 0 when none could start.
struct EtcdChild {
  pid_t pid = 0;
  std::string endpoint;
  ~EtcdChild() {
    if (pid > 0) {
      kill(pid, SIGTERM);
      waitpid(pid, nullptr, 0);
    }
  }
};

int FreePort() {
  int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  close(s);
  return ntohs(a.sin_port);
}

bool StartEtcd(const std::string& dir, EtcdChild* e) {
  const int client = FreePort(), peer = FreePort();
  e->endpoint = absl::StrCat("127.0.0.1:", client);
  const std::string cu = "http://" + e->endpoint, pu = absl::StrCat("http://127.0.0.1:", peer);
  const std::string data = dir + "/etcd", log = dir + "/etcd.log";
  std::fflush(stdout);  // the child's freopen would print what is buffered again
  e->pid = fork();
  if (e->pid == 0) {
    FILE* f = freopen(log.c_str(), "w", stdout);
    (void)f;
    dup2(fileno(stdout), 2);
    execlp("etcd", "etcd", "--name", "bench", "--data-dir", data.c_str(), "--listen-client-urls", cu.c_str(),
           "--advertise-client-urls", cu.c_str(), "--listen-peer-urls", pu.c_str(), "--initial-advertise-peer-urls",
           pu.c_str(), "--initial-cluster", ("bench=" + pu).c_str(), "--log-level", "warn", nullptr);
    _exit(127);
  }
  for (int i = 0; i < 300; ++i) {
    daemon::EtcdOptions o;
    o.endpoints = {e->endpoint};
    o.prefix = "probe";
    o.request_timeout = absl::Milliseconds(200);
    if (daemon::EtcdStateStore::Open(o).ok()) return true;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return false;
}

class Bench {
 public:
  Bench(std::string config, std::vector<v1::RankLayout> ranks, std::vector<std::string> addrs,
        FakesChild* fakes)
      : config_(std::move(config)), ranks_(std::move(ranks)), addrs_(std::move(addrs)), fakes_(fakes) {}

  // Registers the cluster of `sz` with `c`, node addresses taken from the fake server's ports.
  std::vector<v1::RegisterNodeRequest> Cluster(const Size& sz) const {
    std::vector<v1::RegisterNodeRequest> out;
    size_t next = 0;
    for (int s = 0; s < sz.sources; ++s) {
      v1::RegisterNodeRequest r;
      r.set_node_id(absl::StrCat("train", s));
      r.set_role("source");
      r.set_address(addrs_[next++]);
      r.set_transport("verbs");
      r.set_trainer_ranks(8);
      out.push_back(std::move(r));
    }
    for (int t = 0; t < sz.target_ranks / 32; ++t) {
      v1::RegisterNodeRequest r;
      r.set_node_id(absl::StrCat("infer", t));
      r.set_role("target");
      r.set_address(addrs_[next++]);
      r.set_transport("verbs");
      auto* e = r.add_engines();
      e->set_engine_id(absl::StrCat("kimi-", t));
      e->set_control_address(addrs_[next++]);
      e->set_kind("reference");
      for (const auto& l : ranks_) {
        auto* rl = e->add_ranks();
        *rl = l;
        auto* seg = rl->add_segments();
        seg->set_id(0);
        seg->set_kind("cuda");
        seg->set_bytes(l.region_bytes());
        seg->set_region_descriptor(absl::StrCat(std::string(480, 'd'), r.node_id(), "/", l.rank()));
      }
      out.push_back(std::move(r));
    }
    return out;
  }

  // Heartbeats every node of `nodes` to `c` every `interval` until stopped.
  class Heartbeats {
   public:
    Heartbeats(Coordinator* c, const std::vector<v1::RegisterNodeRequest>& nodes, double interval) {
      // The heartbeats only name the nodes: a copy of the registrations (their tables) would be the driver's
      // memory counted as the coordinator process's.
      std::vector<v1::HeartbeatRequest> beats;
      for (const auto& n : nodes) {
        v1::HeartbeatRequest& h = beats.emplace_back();
        h.set_node_id(n.node_id());
        h.set_address(n.address());
      }
      thread_ = std::thread([this, c, interval, beats = std::move(beats)] {
        std::unique_lock<std::mutex> l(mu_);
        while (!cv_.wait_for(l, std::chrono::duration<double>(interval), [this] { return stop_; }))
          for (const auto& h : beats) c->Heartbeat(h);
      });
    }
    ~Heartbeats() {
      {
        std::lock_guard<std::mutex> l(mu_);
        stop_ = true;
      }
      cv_.notify_all();
      thread_.join();
    }

   private:
    std::mutex mu_;
    std::condition_variable cv_;
    bool stop_ = false;
    std::thread thread_;
  };

  static bool Update(Coordinator& c, int64_t v, double* begin_ms, double* commit_ms) {
    const absl::Time t0 = absl::Now();
    v1::BeginUpdateRequest b;
    b.set_version(v);
    auto begun = c.BeginUpdate(b);
    const absl::Time t1 = absl::Now();
    if (!begun.ok()) {
      spdlog::error("update {}: {}", v, begun.status().ToString());
      return false;
    }
    v1::CommitUpdateRequest cr;
    cr.set_version(v);
    auto done = c.CommitUpdate(cr);
    const absl::Time t2 = absl::Now();
    if (!done.ok()) {
      spdlog::error("update {}: {}", v, done.status().ToString());
      return false;
    }
    *begin_ms = absl::ToDoubleMilliseconds(t1 - t0);
    *commit_ms = absl::ToDoubleMilliseconds(t2 - t1);
    return true;
  }

  // One size on SQLite: the figures of Result except etcd's.
  bool RunSqlite(const Size& sz, int updates, const std::string& dir, Result* out) {
    malloc_trim(0);  // what the previous size freed is not counted as this one's growth
    const double rss0 = RssMiB();
    const double fakes_rss0 = fakes_->Memory().rss_mib;
    fakes_->ResetPeak();
    auto store = daemon::SqliteStateStore::Open(absl::StrCat(dir, "/state-", sz.target_ranks, ".db"));
    if (!store.ok()) return false;
    daemon::StateStore* st = store->get();
    daemon::CoordinatorOptions opts;
    Coordinator c(opts, daemon::MakeGrpcPeers());
    if (!c.UseStateStore(*std::move(store)).ok()) return false;
    const auto nodes = Cluster(sz);
    for (const auto& n : nodes)
      if (auto r = c.RegisterNode(n); !r.ok()) {
        spdlog::error("register: {}", r.status().ToString());
        return false;
      }
    size_t reg_bytes = 0;
    for (const auto& n : nodes) reg_bytes += n.SpaceUsedLong();
    out->registrations_mib = reg_bytes / 1048576.0;
    Heartbeats hb(&c, nodes, opts.heartbeat_seconds);
    double b = 0, m = 0;
    ResetSelfPeak();
    const absl::Time f0 = absl::Now();
    const double fc0 = CpuSeconds();
    if (!Update(c, 1, &b, &m)) return false;
    out->first_update_ms = absl::ToDoubleMilliseconds(absl::Now() - f0);
    out->first_update_cpu_s = CpuSeconds() - fc0;
    out->coord_first_peak_mib = StatusMiB("VmHWM:") - rss0;
    std::vector<double> total, begin, commit, cpu, bytes;
    StatusProbe probe(&c);
    for (int k = 0; k < updates; ++k) {
      const uint64_t w0 = st->stats().bytes_written;
      const double c0 = CpuSeconds();
      if (!Update(c, 2 + k, &b, &m)) return false;
      cpu.push_back(CpuSeconds() - c0);
      begin.push_back(b);
      commit.push_back(m);
      total.push_back(b + m);
      bytes.push_back(static_cast<double>(st->stats().bytes_written - w0));
    }
    const std::vector<double> status_ms = probe.Stop();
    out->status_p99_ms = Percentile(status_ms, 0.99);
    out->status_max_ms = status_ms.empty() ? 0 : *std::max_element(status_ms.begin(), status_ms.end());
    out->overhead_ms = Median(total);
    out->begin_ms = Median(begin);
    out->commit_ms = Median(commit);
    out->cpu_s = Median(cpu);
    out->sqlite_bytes = static_cast<uint64_t>(Median(bytes));
    out->coord_steady_mib = RssMiB() - rss0;
    // A membership change: the last target re-registers (a restarted daemon); the next begin re-plans and
    // configures every source.
    ResetSelfPeak();
    const absl::Time g0 = absl::Now();
    const double gc0 = CpuSeconds();
    if (!c.RegisterNode(nodes.back()).ok()) return false;
    out->reregister_ms = absl::ToDoubleMilliseconds(absl::Now() - g0);  // the registration saved in the store
    out->reregister_cpu_s = CpuSeconds() - gc0;
    const double rc0 = CpuSeconds();
    if (!Update(c, 2 + updates, &b, &m)) return false;
    out->replan_cpu_s = CpuSeconds() - rc0;  // begin and commit (the commit's share is the steady CPU/update's)
    out->replan_ms = b;
    out->coord_replan_peak_mib = StatusMiB("VmHWM:") - rss0;
    out->rss_mib = RssMiB() - rss0;
    out->fakes_peak_mib = fakes_->Memory().peak_mib - fakes_rss0;
    return true;
  }

  // One size on etcd: bytes per steady update and the fail-over time.
  // One size on SQLite (slowed by `slow` per save), its history prefilled with `prefill` updates, then `updates`
  // steady ones measured with Status probed throughout.
  bool RunSide(const Size& sz, int prefill, absl::Duration slow, int updates, const std::string& dir,
               SideResult* out) {
    const std::string path = absl::StrCat(dir, "/side-", prefill, "-", absl::ToInt64Milliseconds(slow), ".db");
    auto store = daemon::SqliteStateStore::Open(path);
    if (!store.ok()) return false;
    daemon::CoordinatorOptions opts;
    Coordinator c(opts, daemon::MakeGrpcPeers());
    std::unique_ptr<daemon::StateStore> st = *std::move(store);
    if (slow > absl::ZeroDuration()) st = std::make_unique<SlowStore>(std::move(st), slow);
    if (!c.UseStateStore(std::move(st)).ok()) return false;
    const auto nodes = Cluster(sz);
    for (const auto& n : nodes)
      if (!c.RegisterNode(n).ok()) return false;
    Heartbeats hb(&c, nodes, opts.heartbeat_seconds);
    double b = 0, m = 0;
    int64_t v = 1;
    for (; v <= std::max(prefill, 1); ++v)
      if (!Update(c, v, &b, &m)) return false;
    std::vector<double> total, cpu;
    StatusProbe probe(&c);
    for (int k = 0; k < updates; ++k, ++v) {
      const double c0 = CpuSeconds();
      if (!Update(c, v, &b, &m)) {
        ++out->failed;
        continue;
      }
      cpu.push_back(CpuSeconds() - c0);
      total.push_back(b + m);
    }
    const std::vector<double> status_ms = probe.Stop();
    out->overhead_ms = Median(total);
    out->cpu_s = Median(cpu);
    out->status_p99_ms = Percentile(status_ms, 0.99);
    out->status_max_ms = status_ms.empty() ? 0 : *std::max_element(status_ms.begin(), status_ms.end());
    return true;
  }

  bool RunEtcd(const Size& sz, int updates, const std::string& endpoint, Result* out) {
    malloc_trim(0);
    const std::string prefix = absl::StrCat("bench/", sz.target_ranks, "-", absl::ToUnixMicros(absl::Now()));
    auto opts_for = [&](const std::string& self) {
      daemon::EtcdOptions o;
      o.endpoints = {endpoint};
      o.prefix = prefix;
      o.advertise = self;
      o.lease_ttl_seconds = 1;
      o.campaign_interval = absl::Milliseconds(50);
      return o;
    };
    auto a_store = daemon::EtcdStateStore::Open(opts_for("a:1"));
    if (!a_store.ok() || !(*a_store)->TryAcquire().value_or(false)) return false;
    (*a_store)->StartElection(nullptr, nullptr);  // keeps its lease alive until it "dies" below
    daemon::EtcdStateStore* as = a_store->get();
    auto a = std::make_unique<Coordinator>(daemon::CoordinatorOptions(), daemon::MakeGrpcPeers());
    if (!a->UseStateStore(*std::move(a_store)).ok()) return false;
    const auto nodes = Cluster(sz);
    for (const auto& n : nodes)
      if (!a->RegisterNode(n).ok()) return false;
    double b = 0, m = 0;
    if (!Update(*a, 1, &b, &m)) return false;
    std::vector<double> bytes;
    for (int k = 0; k < updates; ++k) {
      const uint64_t w0 = as->stats().bytes_written;
      if (!Update(*a, 2 + k, &b, &m)) return false;
      bytes.push_back(static_cast<double>(as->stats().bytes_written - w0));
    }
    out->etcd_bytes = static_cast<int64_t>(Median(bytes));

    // Fail-over: a standby campaigns; the leader dies without resigning (its lease expires after the TTL).
    auto b_store = daemon::EtcdStateStore::Open(opts_for("b:1"));
    if (!b_store.ok()) return false;
    daemon::EtcdStateStore* bs = b_store->get();
    std::mutex mu;
    std::condition_variable cv;
    bool elected = false;
    bs->StartElection(
        [&] {
          std::lock_guard<std::mutex> l(mu);
          elected = true;
          cv.notify_all();
        },
        nullptr);
    absl::SleepFor(absl::Milliseconds(300));
    const absl::Time died = absl::Now();
    a.reset();  // the store's election thread stops; its lease is left to expire
    {
      std::unique_lock<std::mutex> l(mu);
      if (!cv.wait_for(l, std::chrono::seconds(20), [&] { return elected; })) return false;
    }
    const absl::Time t_load = absl::Now();
    Coordinator standby(daemon::CoordinatorOptions(), daemon::MakeGrpcPeers());
    if (!standby.UseStateStore(*std::move(b_store)).ok()) return false;
    out->failover_s = absl::ToDoubleSeconds(absl::Now() - died);
    out->failover_load_s = absl::ToDoubleSeconds(absl::Now() - t_load);
    if (standby.Status().nodes_size() != static_cast<int>(nodes.size())) return false;
    bs->Resign();
    return true;
  }

 private:
  const std::string config_;
  const std::vector<v1::RankLayout> ranks_;
  const std::vector<std::string> addrs_;
  FakesChild* fakes_;
};

std::string Svg(const std::vector<Result>& rs) {
  // Two series against target ranks, both axes logarithmic: the overhead (tens of ms) and the re-plan (seconds).
  const double w = 640, h = 400, l = 70, r = 20, t = 40, b = 60;
  double ymax = 10;
  for (const auto& x : rs) ymax = std::max({ymax, x.overhead_ms, x.replan_ms});
  const double lo = 0, hi = std::ceil(std::log10(ymax));  // decades from 1 ms
  const double xmin = std::log2(rs.front().size.target_ranks), xmax = std::log2(rs.back().size.target_ranks);
  auto X = [&](int n) { return l + (xmax > xmin ? (std::log2(n) - xmin) / (xmax - xmin) : 0.5) * (w - l - r); };
  auto Y = [&](double v) { return h - b - (std::log10(std::max(v, 1.0)) - lo) / (hi - lo) * (h - t - b); };
  std::string s =
      absl::StrCat("<svg xmlns='http://www.w3.org/2000/svg' width='", w, "' height='", h,
                   "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' "
                   "fill='white'/>\n<text x='",
                   l, "' y='20' font-size='14'>wsync control plane: ms per update vs engine ranks</text>\n");
  absl::StrAppend(&s, "<line x1='", l, "' y1='", h - b, "' x2='", w - r, "' y2='", h - b, "' stroke='black'/>\n");
  absl::StrAppend(&s, "<line x1='", l, "' y1='", t, "' x2='", l, "' y2='", h - b, "' stroke='black'/>\n");
  for (double d = lo; d <= hi; ++d)
    absl::StrAppend(&s, "<text x='", l - 8, "' y='", Y(std::pow(10, d)) + 4, "' text-anchor='end'>",
                    absl::StrFormat("%.0f ms", std::pow(10, d)), "</text>\n");
  for (const auto& x : rs)
    absl::StrAppend(&s, "<text x='", X(x.size.target_ranks), "' y='", h - b + 18, "' text-anchor='middle'>",
                    x.size.target_ranks, " (", x.size.sources, " src)</text>\n");
  absl::StrAppend(&s, "<text x='", (l + w - r) / 2, "' y='", h - 15,
                  "' text-anchor='middle'>engine ranks (source nodes), log scale</text>\n");
  auto series = [&](const char* color, const char* name, double Result::*field, int row) {
    std::string pts;
    for (const auto& x : rs) absl::StrAppend(&pts, X(x.size.target_ranks), ",", Y(x.*field), " ");
    absl::StrAppend(&s, "<polyline fill='none' stroke='", color, "' stroke-width='2' points='", pts, "'/>\n");
    for (const auto& x : rs)
      absl::StrAppend(&s, "<circle cx='", X(x.size.target_ranks), "' cy='", Y(x.*field), "' r='3' fill='", color,
                      "'/>\n");
    absl::StrAppend(&s, "<text x='", l + 10, "' y='", t + 14 * row, "' fill='", color, "'>", name, "</text>\n");
  };
  series("#1f77b4", "control overhead (BeginUpdate to CommitUpdate, no data)", &Result::overhead_ms, 1);
  series("#d62728", "BeginUpdate after a membership change (re-plan + configure)", &Result::replan_ms, 2);
  absl::StrAppend(&s, "</svg>\n");
  return s;
}

int Main(int argc, char** argv) {
  CLI::App app("bench_control: the coordinator against N fake node daemons and engines over loopback mTLS");
  std::string sizes_arg = "64:32,256:64,1024:256", etcd_mode = "auto", out_dir = ".";
  int updates = 5, etcd_max_ranks = 1024, malloc_arenas = daemon::kMallocArenas, slow_store_ms = 0;
  std::string history_arg;
  app.add_option("--sizes", sizes_arg, "TARGET_RANKS:SOURCES,... (target ranks a multiple of 32)");
  app.add_option("--updates", updates, "steady updates measured per size");
  app.add_option("--etcd", etcd_mode, "auto (when an etcd binary is on PATH) | on | off");
  app.add_option("--etcd-max-ranks", etcd_max_ranks, "largest size run on etcd too");
  app.add_option("--out", out_dir, "where control_bench.svg goes");
  app.add_option(
      "--malloc-arenas", malloc_arenas,
      "glibc malloc arenas of the coordinator's process (as wsync-coordinator sets them; 0: glibc's default)");
  app.add_option("--history", history_arg,
                 "HISTORY,...: at the first size, the steady update's cost with the coordinator's history prefilled "
                 "with that many updates (e.g. 10,1000; default: not run)");
  app.add_option("--slow-store-ms", slow_store_ms,
                 "at the first size, the steady update and Status with every state store save this much slower "
                 "(a stalled disk or etcd; default 0: not run)");
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);
  std::vector<int> history_sizes;
  for (absl::string_view part : absl::StrSplit(history_arg, ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 1) {
      std::fprintf(stderr, "--history: '%s' is not a count of updates\n", std::string(part).c_str());
      return 2;
    }
    history_sizes.push_back(n);
  }
  std::vector<Size> sizes;
  for (absl::string_view part : absl::StrSplit(sizes_arg, ',', absl::SkipEmpty())) {
    std::vector<std::string> f = absl::StrSplit(part, ':');
    Size s;
    if (f.size() != 2 || !absl::SimpleAtoi(f[0], &s.target_ranks) || !absl::SimpleAtoi(f[1], &s.sources) ||
        s.target_ranks % 32 != 0 || s.target_ranks <= 0 || s.sources <= 0) {
      std::fprintf(stderr, "--sizes: '%s' is not TARGET_RANKS:SOURCES with ranks a multiple of 32\n",
                   std::string(part).c_str());
      return 2;
    }
    sizes.push_back(s);
  }
  if (sizes.empty()) return 2;

  const std::string dir = (fs::temp_directory_path() / absl::StrCat("wsync-control-bench-", getpid())).string();
  fs::create_directories(dir);
  const std::string certs = dir + "/certs";
  const std::string cmd =
      absl::StrCat(WSYNC_SOURCE_DIR "/tools/cli/wsync-certs.sh ", certs, " coordinator:bench >/dev/null");
  if (std::system(cmd.c_str()) != 0) {
    std::fprintf(stderr, "bench_control: %s failed\n", cmd.c_str());
    return 1;
  }
  tls::Options to;
  to.ca = certs + "/ca.pem";
  to.cert = certs + "/coordinator-bench.pem";
  to.key = certs + "/coordinator-bench-key.pem";

  std::string config = ReadFile(WSYNC_MODELS_DIR "/moonshotai__Kimi-K2-Instruct/config.json");
  auto j = nlohmann::json::parse(config);
  j["quantization_config"]["weight_block_size"] = {64, 64};
  config = j.dump();
  auto cfg = replica::ModelConfig::FromJson(config);
  if (!cfg.ok()) return 1;
  // One server, one port per fake daemon or engine, all with the same services, in a child process: the fakes'
  // memory (every ConfigureSource they parse) is not the coordinator's, and each process's is measured apart.
  int ports = 0;
  for (const auto& s : sizes) ports = std::max(ports, s.sources + 2 * (s.target_ranks / 32));
  FakesChild fakes;
  if (!fakes.Start(ports, config, to)) {
    std::fprintf(stderr, "bench_control: the fake daemons did not start\n");
    return 1;
  }
  // As wsync-coordinator's main does (daemon/coordinator/fanout.h), after the fakes' fork: theirs keep glibc's default.
  if (malloc_arenas > 0) daemon::LimitMallocArenas(malloc_arenas);
  if (auto st = tls::Configure(to, {"127.0.0.1:0"}); !st.ok()) {
    std::fprintf(stderr, "bench_control: TLS: %s\n", st.ToString().c_str());
    return 1;
  }
  const std::vector<std::string>& addrs = fakes.addrs;

  const absl::Time l0 = absl::Now();
  std::vector<v1::RankLayout> ranks = KimiRanks(*cfg);
  size_t table_bytes = 0;
  for (const auto& r : ranks) table_bytes += r.ByteSizeLong();
  std::printf("Kimi-K2 TP32/EP32 rank tables: %zu params per rank, %.2f MiB per engine (built in %.1f s)\n",
              static_cast<size_t>(ranks[0].params_size()), table_bytes / 1048576.0,
              absl::ToDoubleSeconds(absl::Now() - l0));

  // Baseline: an empty EngineControl round trip through the coordinator's own peers (TLS, a warm channel).
  double rtt_ms;
  {
    auto peers = daemon::MakeGrpcPeers();
    std::vector<double> rt;
    for (int i = 0; i < 220; ++i) {
      const absl::Time t = absl::Now();
      if (!peers->Continue(addrs[0]).ok()) return 1;
      if (i >= 20) rt.push_back(absl::ToDoubleMilliseconds(absl::Now() - t));
    }
    rtt_ms = Median(rt);
  }

  EtcdChild etcd;
  bool use_etcd = etcd_mode == "on" || (etcd_mode == "auto" && std::system("command -v etcd >/dev/null 2>&1") == 0);
  if (use_etcd && !StartEtcd(dir, &etcd)) {
    std::fprintf(stderr, "bench_control: etcd did not start (see %s/etcd.log)\n", dir.c_str());
    if (etcd_mode == "on") return 1;
    use_etcd = false;
  }

  Bench bench(config, std::move(ranks), addrs, &fakes);
  std::vector<Result> results;
  for (const auto& s : sizes) {
    Result r;
    r.size = s;
    if (!bench.RunSqlite(s, updates, dir, &r)) {
      std::fprintf(stderr, "bench_control: size %d:%d failed\n", s.target_ranks, s.sources);
      return 1;
    }
    if (use_etcd && s.target_ranks <= etcd_max_ranks && !bench.RunEtcd(s, updates, etcd.endpoint, &r)) {
      std::fprintf(stderr, "bench_control: size %d:%d on etcd failed\n", s.target_ranks, s.sources);
      return 1;
    }
    results.push_back(r);
    std::fprintf(stderr, "size %d:%d done\n", s.target_ranks, s.sources);
  }
  std::vector<SideResult> side;
  for (int n : history_sizes) {
    SideResult r;
    r.what = absl::StrCat("history ", n);
    if (!bench.RunSide(sizes[0], n, absl::ZeroDuration(), updates, dir, &r)) return 1;
    side.push_back(r);
    std::fprintf(stderr, "%s done\n", r.what.c_str());
  }
  if (slow_store_ms > 0) {
    SideResult r;
    r.what = absl::StrCat("store +", slow_store_ms, " ms per save");
    if (!bench.RunSide(sizes[0], 1, absl::Milliseconds(slow_store_ms), updates, dir, &r)) return 1;
    side.push_back(r);
    std::fprintf(stderr, "%s done\n", r.what.c_str());
  }
  const double fakes_peak_mib = fakes.PeakMiB();
  fakes.Stop();

  std::printf("\nbaseline: empty EngineControl round trip over mTLS %.3f ms (median of 200)\n", rtt_ms);
  std::printf("%7s %7s %9s %8s %8s %9s %10s %9s %9s %10s %10s %9s %9s\n", "ranks", "sources", "overhead", "xRTT",
              "begin", "commit", "1st upd", "re-plan", "CPU/upd", "RSS", "sqlite B", "etcd B", "failover");
  for (const auto& r : results)
    std::printf("%7d %7d %7.1fms %8.0f %6.1fms %7.1fms %8.0fms %7.0fms %8.3fs %7.0fMiB %10llu %9s %9s\n",
                r.size.target_ranks, r.size.sources, r.overhead_ms, r.overhead_ms / rtt_ms, r.begin_ms, r.commit_ms,
                r.first_update_ms, r.replan_ms, r.cpu_s, r.rss_mib, static_cast<unsigned long long>(r.sqlite_bytes),
                r.etcd_bytes < 0 ? "-" : std::to_string(r.etcd_bytes).c_str(),
                r.failover_s < 0 ? "-" : absl::StrFormat("%.2fs", r.failover_s).c_str());
  const std::string svg_path = out_dir + "/control_bench.svg";
  std::ofstream(svg_path) << Svg(results);
  std::printf("plot: %s\n", svg_path.c_str());

  std::printf("\nresident memory above each size's start, MiB (coordinator: this process, which also holds the driver's"
              " copy of the registrations; fakes: their own process)\n");
  std::printf("%7s %7s %14s %14s %14s %14s %12s\n", "ranks", "sources", "coord 1st upd", "coord re-plan",
              "coord steady", "registrations", "fakes peak");
  for (const auto& r : results)
    std::printf("%7d %7d %14.0f %14.0f %14.0f %14.0f %12.0f\n", r.size.target_ranks, r.size.sources,
                r.coord_first_peak_mib, r.coord_replan_peak_mib, r.coord_steady_mib, r.registrations_mib,
                r.fakes_peak_mib);
  std::printf("\nmembership change (one target registers again, then an update): RegisterNode, then BeginUpdate\n");
  for (const auto& r : results)
    std::printf("%7d %7d  register %.0f ms (CPU %.2f s)  begin %.0f ms  CPU of that update %.2f s\n",
                r.size.target_ranks, r.size.sources, r.reregister_ms, r.reregister_cpu_s, r.replan_ms, r.replan_cpu_s);
  std::printf("\nStatus() probed every 5 ms during the steady updates (ms)\n");
  for (const auto& r : results)
    std::printf("%7d %7d  p99 %.2f  max %.2f\n", r.size.target_ranks, r.size.sources, r.status_p99_ms,
                r.status_max_ms);
  if (!side.empty()) {
    std::printf("\nat %d:%d, steady updates (median) and Status while they run\n", sizes[0].target_ranks,
                sizes[0].sources);
    for (const auto& r : side)
      std::printf("  %-26s overhead %7.1f ms  CPU %.3f s  Status p99 %7.2f ms  max %7.2f ms  failed %d\n",
                  r.what.c_str(), r.overhead_ms, r.cpu_s, r.status_p99_ms, r.status_max_ms, r.failed);
  }
  const double peak_mib = SelfPeakMiB();
  std::printf("peak RSS of the coordinator's process (every size): %.0f MiB; of the fakes' process: %.0f MiB\n",
              peak_mib, fakes_peak_mib);
  nlohmann::json out = {{"bench", "control"},
                        {"rtt_ms", rtt_ms},
                        {"malloc_arenas", malloc_arenas},
                        {"peak_rss_mib", peak_mib},
                        {"fakes_peak_rss_mib", fakes_peak_mib},
                        {"sizes", nlohmann::json::array()}};
  for (const auto& r : results)
    out["sizes"].push_back({{"target_ranks", r.size.target_ranks},
                            {"sources", r.size.sources},
                            {"overhead_ms", r.overhead_ms},
                            {"overhead_x_rtt", r.overhead_ms / rtt_ms},
                            {"begin_ms", r.begin_ms},
                            {"commit_ms", r.commit_ms},
                            {"first_update_ms", r.first_update_ms},
                            {"first_update_cpu_s", r.first_update_cpu_s},
                            {"replan_update_cpu_s", r.replan_cpu_s},
                            {"replan_begin_ms", r.replan_ms},
                            {"reregister_ms", r.reregister_ms},
                            {"reregister_cpu_s", r.reregister_cpu_s},
                            {"cpu_s_per_update", r.cpu_s},
                            {"rss_growth_mib", r.rss_mib},
                            {"coordinator_first_update_peak_mib", r.coord_first_peak_mib},
                            {"coordinator_replan_peak_mib", r.coord_replan_peak_mib},
                            {"coordinator_steady_mib", r.coord_steady_mib},
                            {"driver_registrations_mib", r.registrations_mib},
                            {"fakes_peak_mib", r.fakes_peak_mib},
                            {"sqlite_bytes_per_update", r.sqlite_bytes},
                            {"etcd_bytes_per_update", r.etcd_bytes},
                            {"failover_s", r.failover_s},
                            {"failover_load_s", r.failover_load_s},
                            {"status_p99_ms", r.status_p99_ms},
                            {"status_max_ms", r.status_max_ms}});
  out["side"] = nlohmann::json::array();
  for (const auto& r : side)
    out["side"].push_back({{"what", r.what},
                           {"overhead_ms", r.overhead_ms},
                           {"cpu_s_per_update", r.cpu_s},
                           {"status_p99_ms", r.status_p99_ms},
                           {"status_max_ms", r.status_max_ms},
                           {"failed_updates", r.failed}});
  // The figure of merit: the largest size's steady overhead, against one round trip (the baseline of this run).
  out["value"] = results.back().overhead_ms;
  out["baseline"] = rtt_ms;
  out["ratio"] = results.back().overhead_ms / rtt_ms;
  std::error_code ec;
  fs::remove_all(dir, ec);
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace wsync

int main(int argc, char** argv) { return wsync::Main(argc, argv); }
