// What one source node's data path moves: R trainer ranks push a node's share of a model through their
// shared-memory rings (or straight into the replica, zero-copy placement) into an in-process SourceNode, which
// validates each bucket, loads it into the replica (engine layouts) and hands every completed parameter to the
// transport. Each trainer thread works as the client library does (one bucket in flight, the next written while the
// daemon loads it; a bucket is half the ring; a tensor larger than that travels alone).
//
// Cases (--cases, comma-separated; all by default), each against its own baseline measured in the same run:
//   dense  a dense model's host tensors in bf16 (Qwen3-8B by default) at engine TP 1 and TP 8, null transport
//          (accepts each write at once: the figure is the node's own path) vs memcpy of the same bytes on every
//          hardware thread (taken again between each case's updates; a case's ratio uses its own, best of its reps).
//   moe    a Kimi-K2 / DeepSeek-V3-shaped node share (their real layer shapes, --moe-layers layers, routed experts
//          capped at --experts, each keeping its real size) at engine TP 8 EP 8, null transport: Kimi-K2 in FP8 64x64
//          pass-through (the trainer pushes codes + scales) and DeepSeek-V3 in bf16 quantized by the node to FP8
//          128x128; vs the all-core memcpy of the bytes pushed. --moe-layers 4 by default: one dense layer, then
//          MoE ones, as both models begin (--moe-dense).
//   tcp    the dense push at the first TP through the node's real tcp transport into a target over loopback: the
//          target side is what a target daemon does for host segments (each engine rank's segment registered with
//          its own tcp transport, an endpoint per connecting source), in this process; the clock stops when
//          FinishUpdate saw every write land. vs the tcp transport alone (bench_transport's sweep: sender and
//          receiver in this process, the same streams) at the node's mean write size, same run.
//   cuda   the dense and moe pushes from GPU tensors (cudaMalloc, device 0): ranks copy them as the C++ client does
//          (client/device_copy.h: D2H into the page-locked ring, or cudaMemcpy2DAsync into the page-locked replica
//          mapping) vs the pinned D2H peak of the same bytes (cudaMemcpyAsync into cudaMallocHost memory, one stream
//          and --d2h-streams streams, the better). All ranks share the one GPU. Without a GPU (or built without
//          CUDA) it prints a skip line and the JSON marks it skipped.
// Measured per case: the time from the first byte pushed to the last bucket's parameters handed to the transport
// (every required parameter complete: FinishUpdate checks it after the clock stops; tcp: until it returned), as GB/s
// of pushed bytes (tcp: of bytes written into the target), and the ratio to the baseline. Per rank a timeline:
// hand-over (the trainer's copies into the ring or the replica, waits for ring space included), lock wait (the
// bucket was in the ring, the node's locks were not yet taken), load (validate + claim + replica load), send (the
// transport's Post of what it completed). Last line: one JSON object; its value is the dense case's largest R at the
// first TP through the ring.
// Every host byte is copied twice on the ring path (host tensor → ring by the trainer, ring → replica by the node),
// so where memory bandwidth, not cores, limits the all-core memcpy, the ring ratio stays near 0.5.
// --placement on|off|both (default both): with placement each rank copies the tensors the node offers straight into
// its mapping of the replica (one copy per byte, per layout that reads it; committed every half ring of bytes, as the
// client does) and the rest through its ring; the line says placement ÷ ring.
// --copy-mode one-pass|per-region|both (default one-pass): how a host placement copies a tensor's column shards
// (engine TP > 1): in one pass over its rows writing every shard (the client's), or one strided copy per shard;
// both: each placement run both ways, the line names the mode.
// --slow-target-ms MS (tcp; default 0: off): does one slow target hold up the others? The tcp case runs twice in this
// process on the same layout, first unslowed, then with every Post to engine rank 0's target held MS ms. In both runs
// each engine rank's segment is in a target transport of its own (its own listener: a target host of its own, as the
// source sees it), and the source's tcp transport is wrapped in the fault transport (transport/fault: delay_peer
// names rank 0's listener in the slowed run; nothing is held in the unslowed one) and in a clock that logs, per
// target connection, the bytes of the batches whose Wait said they landed and when the last one did. Reported: each
// target's rate (its bytes / the time from the update's start until its last write landed) in both runs; for the
// other targets together (their bytes / until the last of theirs landed) slowed ÷ unslowed, the figure the source's
// one-writer-per-target design promises (goal >= 0.9), and the worst single other target; and the slowed target's
// own rate. Writers that shared a thread, or a rank that waited on rank 0's Posts (a lock held across them, or a
// writer whose credits rank 0's backlog keeps taken), would make the others' last writes land after rank 0's holds:
// the ratio would fall toward unslowed time ÷ slowed time. On a machine whose cores the loopback copies saturate, the
// others may go faster while rank 0 is held (its bytes move later): the ratio can exceed 1 there. The last line gains
// slow_target_ms, slow_target_others_unslowed_gbps, slow_target_others_slowed_gbps, slow_target_others_ratio,
// slow_target_worst_other_ratio and slow_target_gbps (the ring at the last --ranks), and slow_target (every R, mode).
// --results-out FILE writes the node rates the planner reads (planner/node_rates.h): a curve per R for every
// (weights, host or CUDA tensors, ring or placement) measured, at the largest engine TP run, and the pinned D2H
// peak. (bench/node/rates_from_outputs.py makes the same file from kept outputs of runs that ended early.)
//
//   bench_node                                   # every case at full size (Qwen3-8B, 36 layers, ~16 GB bf16)
//   bench_node --quick                           # small shapes, R = 1,2: every case in well under a minute
//   bench_node --cases dense --tp 1 --ranks 8 --write-checksums  # one case, with wsyncd's default hashing on
//   bench_node --cases tcp --tp 8 --ranks 8 --slow-target-ms 50  # 8 ranks -> 8 targets, then rank 0's slowed
// Memory: the tensors once per workload, the replica per case, R rings of --ring-mib (enlarged to fit the largest
// tensor); tcp adds the target's segments (--slow-target-ms: for each of its two runs), cuda the device copy and a
// pinned buffer of the same size.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "base/host_copy.h"
#include "base/memory_kind.h"
#include "base/status.h"
#include "bench/node/device_tensors.h"
#include "bench/transport/tcp_bench.h"
#include "client/device_copy.h"
#include "client/ring/ring.h"
#include "daemon/common/convert.h"
#include "daemon/node/source_node.h"
#include "nlohmann/json.hpp"
#include "replica/model_config.h"
#include "replica/param_table.h"
#include "transport/fault/fault_transport.h"
#include "transport/transport.h"

namespace {

using wsync::DType;
using Clock = std::chrono::steady_clock;
using json = nlohmann::ordered_json;
namespace v1 = wsync::v1;
namespace transport = wsync::transport;
namespace replica = wsync::replica;

double Since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

class NullLocal : public transport::LocalRegion {
 public:
  NullLocal(void* a, uint64_t n) : a_(a), n_(n) {}
  void* addr() const override { return a_; }
  uint64_t length() const override { return n_; }
  std::string Descriptor() const override { return std::to_string(n_); }

 private:
  void* a_;
  uint64_t n_;
};

class NullRemote : public transport::RemoteRegion {
 public:
  explicit NullRemote(uint64_t n) : n_(n) {}
  uint64_t length() const override { return n_; }

 private:
  uint64_t n_;
};

// Accepts every write (bounds checked as every backend does) and completes it at once.
class NullEndpoint : public transport::Endpoint {
 public:
  std::string LocalInfo() const override { return "null"; }
  absl::Status Connect(const std::string&, absl::Duration) override { return absl::OkStatus(); }
  absl::StatusOr<transport::BatchId> Post(absl::Span<const transport::WriteRequest> writes) override {
    for (const auto& w : writes)
      if (auto st = transport::ValidateWrite(w); !st.ok()) return st;
    return ++next_;
  }
  absl::Status Wait(transport::BatchId, absl::Duration) override { return absl::OkStatus(); }
  std::string PeerName() const override { return "null peer"; }

 private:
  transport::BatchId next_ = 0;
};

class NullTransport : public transport::Transport {
 public:
  std::string name() const override { return "null"; }
  bool viable() const override { return true; }
  std::string reason() const override { return ""; }
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return std::make_unique<NullLocal>(addr, len);
  }
  absl::StatusOr<std::unique_ptr<transport::RemoteRegion>> ImportRegion(const std::string& d) override {
    return std::make_unique<NullRemote>(std::stoull(d));
  }
  absl::StatusOr<std::unique_ptr<transport::Endpoint>> CreateEndpoint() override {
    return std::make_unique<NullEndpoint>();
  }
};

[[noreturn]] void Die(const std::string& what, const absl::Status& st) {
  std::fprintf(stderr, "bench_node: %s: %s\n", what.c_str(), st.ToString().c_str());
  std::exit(1);
}

// What one target connection received in an update of the tcp case, as its sender saw it: the bytes of the batches
// whose Wait said they landed (tcp: written into the target's memory and acknowledged) and when the last one did.
struct LandedLog {
  std::atomic<uint64_t> bytes{0}, batches{0};
  std::atomic<int64_t> last_ns{0};  // Clock's time since its epoch; 0: nothing landed yet
  void Reset() { bytes = 0, batches = 0, last_ns = 0; }
  // The endpoint's PeerName() once connected ("" before).
  std::string peer() const {
    absl::MutexLock l(&mu);
    return peer_name;
  }
  mutable absl::Mutex mu;
  std::string peer_name ABSL_GUARDED_BY(mu);
};

// Decorates a sending endpoint with its LandedLog. Used by one thread at a time, as every endpoint.
class ClockedEndpoint : public transport::Endpoint {
 public:
  ClockedEndpoint(std::unique_ptr<transport::Endpoint> inner, std::shared_ptr<LandedLog> log)
      : inner_(std::move(inner)), log_(std::move(log)) {}
  std::string LocalInfo() const override { return inner_->LocalInfo(); }
  absl::Status Connect(const std::string& peer_info, absl::Duration timeout) override {
    WSYNC_RETURN_IF_ERROR(inner_->Connect(peer_info, timeout));
    absl::MutexLock l(&log_->mu);
    log_->peer_name = inner_->PeerName();
    return absl::OkStatus();
  }
  std::string PeerName() const override { return inner_->PeerName(); }
  // The source's writer sleeps on it; without it the writer would look at the endpoint every 2 ms instead.
  int CompletionFd() const override { return inner_->CompletionFd(); }
  void Cancel(const absl::Status& why) override { inner_->Cancel(why); }
  bool Reusable(const std::string& peer_info) const override { return inner_->Reusable(peer_info); }
  absl::StatusOr<transport::BatchId> Post(absl::Span<const transport::WriteRequest> writes) override {
    uint64_t n = 0;
    for (const auto& w : writes) n += w.length;
    absl::StatusOr<transport::BatchId> id = inner_->Post(writes);
    if (id.ok()) sizes_[*id] = n;
    return id;
  }
  absl::Status Wait(transport::BatchId batch, absl::Duration timeout) override {
    absl::Status st = inner_->Wait(batch, timeout);
    if (absl::IsDeadlineExceeded(st)) return st;  // still outstanding
    auto it = sizes_.find(batch);
    if (it == sizes_.end()) return st;
    if (st.ok()) {
      log_->bytes += it->second;
      ++log_->batches;
      log_->last_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
    }
    sizes_.erase(it);
    return st;
  }

 private:
  std::unique_ptr<transport::Endpoint> inner_;
  std::shared_ptr<LandedLog> log_;
  std::map<transport::BatchId, uint64_t> sizes_;  // posted, not yet waited for
};

// The source's transport of the tcp case with --slow-target-ms: every endpoint it makes keeps a LandedLog.
// Everything else is the inner's.
class ClockedTransport : public transport::Transport {
 public:
  explicit ClockedTransport(std::unique_ptr<transport::Transport> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  bool viable() const override { return inner_->viable(); }
  std::string reason() const override { return inner_->reason(); }
  transport::Capabilities Query() const override { return inner_->Query(); }
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return inner_->RegisterMemory(addr, len);
  }
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> RegisterSourceMemory(void* addr, uint64_t len) override {
    return inner_->RegisterSourceMemory(addr, len);
  }
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> RegisterSink(
      std::shared_ptr<transport::RegionSink> sink) override {
    return inner_->RegisterSink(std::move(sink));
  }
  absl::StatusOr<std::unique_ptr<transport::RemoteRegion>> ImportRegion(const std::string& descriptor) override {
    return inner_->ImportRegion(descriptor);
  }
  absl::StatusOr<std::unique_ptr<transport::Endpoint>> CreateEndpoint() override {
    WSYNC_ASSIGN_OR_RETURN(auto ep, inner_->CreateEndpoint());
    auto log = std::make_shared<LandedLog>();
    {
      absl::MutexLock l(&mu_);
      logs_.push_back(log);
    }
    return std::unique_ptr<transport::Endpoint>(std::make_unique<ClockedEndpoint>(std::move(ep), std::move(log)));
  }
  std::vector<std::shared_ptr<LandedLog>> logs() const {
    absl::MutexLock l(&mu_);
    return logs_;
  }

 private:
  std::unique_ptr<transport::Transport> inner_;
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<LandedLog>> logs_ ABSL_GUARDED_BY(mu_);
};

// One engine rank's target in an update of the tcp case with --slow-target-ms (seconds from the update's start).
struct TargetLanded {
  int rank = 0;
  uint64_t bytes = 0, batches = 0;
  double seconds = 0;  // its last write landed
  double gbps() const { return seconds > 0 ? bytes / seconds / 1e9 : 0; }
};

// The targets other than engine rank 0 (the one --slow-target-ms slows), together: their bytes / the time until the
// last of their writes landed.
double OthersGbps(const std::vector<TargetLanded>& targets) {
  uint64_t bytes = 0;
  double seconds = 0;
  for (const auto& t : targets)
    if (t.rank != 0) bytes += t.bytes, seconds = std::max(seconds, t.seconds);
  return seconds > 0 ? bytes / seconds / 1e9 : 0;
}

// The target side of the tcp case: what a target daemon does for its engine ranks' host segments (each registered
// with the target's tcp transport, its descriptor in the layout; a connecting source gets an endpoint connected back
// to it), in this process. The source node sends through `source()`, a tcp transport of its own.
// With `ranks` > 0 (--slow-target-ms, both runs): each of the engine's `ranks` ranks has a target transport of its
// own (its own listener: a target host of its own, as far as the source can tell), and the source's transport is the
// tcp one in the fault transport (holding every Post to rank 0's listener for `delay`; 0: nothing held) in a clock
// that logs what landed per target connection.
class TcpTarget {
 public:
  static absl::StatusOr<std::unique_ptr<TcpTarget>> Create(int streams, int ranks, absl::Duration delay) {
    transport::TransportOptions o;
    o.bind_host = "127.0.0.1";
    o.tcp_streams = streams;
    auto t = std::unique_ptr<TcpTarget>(new TcpTarget());
    t->delay_ = delay;
    WSYNC_ASSIGN_OR_RETURN(auto source, transport::CreateTransport("tcp", o));
    if (ranks == 0) {
      t->source_ = std::move(source);
      WSYNC_ASSIGN_OR_RETURN(auto target, transport::CreateTransport("tcp", o));
      t->targets_.push_back(std::move(target));
      return t;
    }
    for (int r = 0; r < ranks; ++r) {
      WSYNC_ASSIGN_OR_RETURN(auto target, transport::CreateTransport("tcp", o));
      // The name a source endpoint gives this target's listener (what delay_peer matches), from a probe connection.
      WSYNC_ASSIGN_OR_RETURN(std::string name, ListenerName(*source, *target));
      if (r > 0 && absl::StrContains(name, t->names_[0]))
        return absl::InternalError(absl::StrCat("the slowed target's listener ", t->names_[0], " is a part of rank ", r,
                                                "'s, ", name, ": delay_peer would hold both"));
      t->targets_.push_back(std::move(target));
      t->names_.push_back(std::move(name));
    }
    transport::FaultSpec spec;
    if (delay > absl::ZeroDuration()) spec.delay = delay, spec.delay_peer = t->names_[0];
    auto clocked = std::make_unique<ClockedTransport>(transport::WrapWithFaults(std::move(source), spec));
    t->clocked_ = clocked.get();
    t->source_ = std::move(clocked);
    return t;
  }
  transport::Transport* source() { return source_.get(); }
  bool clocked() const { return clocked_ != nullptr; }
  // How the case's line names this run ("" without --slow-target-ms).
  std::string Label() const {
    if (!clocked()) return "";
    return delay_ > absl::ZeroDuration()
               ? absl::StrFormat(" (target rank 0 slowed: %lld ms per Post)", absl::ToInt64Milliseconds(delay_))
               : " (unslowed)";
  }
  int64_t slowed_ms() const { return absl::ToInt64Milliseconds(delay_); }
  // A host segment of `bytes` (every page touched, as an engine's weights are), registered: its descriptor. Called
  // in engine rank order.
  absl::StatusOr<std::string> AddSegment(uint64_t bytes) {
    transport::Transport* on = On(static_cast<int>(segments_.size()));
    segments_.push_back(std::make_unique<uint8_t[]>(bytes));
    std::memset(segments_.back().get(), 0, bytes);
    WSYNC_ASSIGN_OR_RETURN(auto region, on->RegisterMemory(segments_.back().get(), bytes));
    regions_.push_back(std::move(region));
    return regions_.back()->Descriptor();
  }
  // The target daemon's ConnectTarget: an endpoint connected to the source's, whose info goes back. Thread-safe.
  absl::StatusOr<std::string> Connect(const v1::ConnectTargetRequest& req) {
    WSYNC_ASSIGN_OR_RETURN(auto ep, On(req.rank())->CreateEndpoint());
    WSYNC_RETURN_IF_ERROR(ep->Connect(req.source_endpoint_info(), absl::Seconds(10)));
    std::string info = ep->LocalInfo();
    std::lock_guard<std::mutex> l(mu_);
    endpoints_.push_back(std::move(ep));
    return info;
  }
  // Clocked only: before an update, nothing landed.
  void ResetLanded() {
    for (auto& log : clocked_->logs()) log->Reset();
  }
  // Clocked only: per engine rank, what landed since `t0` (on the source's endpoints connected to its listener).
  std::vector<TargetLanded> Landed(Clock::time_point t0) const {
    std::vector<TargetLanded> out;
    const int64_t t0_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
    for (auto& log : clocked_->logs()) {
      auto r = std::find(names_.begin(), names_.end(), log->peer());
      if (r == names_.end()) continue;  // a probe (connected before the clock), or never connected
      const int64_t last = log->last_ns;
      out.push_back(
          {static_cast<int>(r - names_.begin()), log->bytes, log->batches, last > 0 ? (last - t0_ns) / 1e9 : 0.0});
    }
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.rank < b.rank; });
    return out;
  }

 private:
  TcpTarget() = default;
  transport::Transport* On(int rank) const {
    return targets_.size() > 1 ? targets_.at(static_cast<size_t>(rank)).get() : targets_[0].get();
  }
  // The PeerName() an endpoint of `source` gives `target`'s listener, from a connection made and dropped here.
  static absl::StatusOr<std::string> ListenerName(transport::Transport& source, transport::Transport& target) {
    WSYNC_ASSIGN_OR_RETURN(auto a, source.CreateEndpoint());
    WSYNC_ASSIGN_OR_RETURN(auto b, target.CreateEndpoint());
    WSYNC_RETURN_IF_ERROR(b->Connect(a->LocalInfo(), absl::Seconds(10)));
    WSYNC_RETURN_IF_ERROR(a->Connect(b->LocalInfo(), absl::Seconds(10)));
    return a->PeerName();
  }
  std::unique_ptr<transport::Transport> source_;
  std::vector<std::unique_ptr<transport::Transport>> targets_;  // one, or one per engine rank
  std::vector<std::string> names_;                              // per engine rank: its listener, as a source names it
  ClockedTransport* clocked_ = nullptr;                         // source_, when it is one
  absl::Duration delay_;
  std::vector<std::unique_ptr<uint8_t[]>> segments_;
  std::vector<std::unique_ptr<transport::LocalRegion>> regions_;
  std::mutex mu_;
  std::vector<std::unique_ptr<transport::Endpoint>> endpoints_;
};

// What one engine's layouts ask of the node.
struct PlannedEngine {
  v1::ConfigureSourceRequest request;
  uint64_t bytes = 0;   // every rank's layout, summed: what the node writes per update
  uint64_t params = 0;  // parameters over all ranks (the writes it posts, about)
};

// One engine at TP `tp` (EP `ep`): its ranks' layouts are the replica's tables for that parallelism (as a real
// engine reports). `segment(bytes)` answers each rank's segment descriptor.
PlannedEngine Plan(const std::string& json_text, const replica::ModelConfig& cfg, const replica::QuantSpec& quant,
                   int tp, int ep, int64_t epoch, const std::string& target_daemon,
                   const std::function<std::string(uint64_t)>& segment) {
  PlannedEngine out;
  v1::ConfigureSourceRequest& req = out.request;
  req.set_model_config_json(json_text);
  req.set_plan_epoch(epoch);
  if (quant.mode == replica::QuantSpec::Mode::kFp8Block) {
    req.set_quantization("fp8_block");
    req.add_weight_block_size(quant.block_n);
    req.add_weight_block_size(quant.block_k);
  }
  for (int r = 0; r < tp; ++r) {
    const auto rp = replica::RankParallelism::ForTp(tp, r, ep);
    auto table = replica::BuildParamTable(cfg, rp, quant);
    if (!table.ok()) Die("param table", table.status());
    auto* t = req.add_targets();
    t->set_engine_id("e0");
    t->set_rank(r);
    t->set_target_daemon(target_daemon);
    t->set_engine_kind("reference");
    auto* l = t->mutable_layout();
    *l->mutable_parallelism() = wsync::daemon::ToProto(rp);
    for (const auto& p : table->params()) {
      auto* d = l->add_params();
      d->set_name(p.name);
      d->set_dtype(std::string(wsync::DTypeName(p.dtype)));
      for (int64_t s : p.shape) d->add_shape(s);
      d->set_bytes(p.bytes);
      d->set_offset(p.offset);
      d->set_segment(0);
    }
    auto* seg = l->add_segments();
    seg->set_id(0);
    seg->set_kind(std::string(wsync::SegmentKindName(wsync::SegmentKind::kHost)));
    seg->set_bytes(std::max<uint64_t>(table->total_bytes(), 1));
    seg->set_region_descriptor(segment(seg->bytes()));
    l->set_region_bytes(seg->bytes());
    out.bytes += table->total_bytes();
    out.params += table->params().size();
  }
  return out;
}

// A trainer tensor: its spec and where its bytes are in the workload's host buffer (and, for CUDA tensors, at the
// same offset in the device copy).
struct Tensor {
  replica::TensorSpec spec;
  const uint8_t* host = nullptr;
  uint64_t offset = 0;
};

// A model cut to size, the tensors its trainer pushes and how the engine stores them.
struct Workload {
  std::string name;   // "dense", "kimi-k2-fp8-64", "deepseek-v3-bf16-fp8-128"
  std::string label;  // for the output
  std::string model_path, json_text;
  replica::ModelConfig cfg;
  replica::QuantSpec quant;
  int ep = 1;
  // The node quantizes what is pushed (bf16 -> FP8): nothing is offered for placement, so no placement run.
  bool node_quantizes = false;
  std::vector<int> tps;
  std::vector<uint8_t> host;
  std::map<std::string, Tensor> tensors;
  uint64_t total = 0, largest = 0;
};

// Reads `path` and applies the cuts (0: keep the model's value).
std::string CutConfig(const std::string& path, int layers, int dense_layers, int vocab, int experts,
                      const std::vector<int>& block) {
  std::ifstream f(path);
  if (!f.good()) Die("reading " + path, absl::NotFoundError("no such file"));
  nlohmann::json cj = nlohmann::json::parse(f);
  if (layers > 0) {
    cj["num_hidden_layers"] = layers;
    if (cj.contains("max_window_layers")) cj["max_window_layers"] = layers;
  }
  if (dense_layers >= 0 && cj.contains("first_k_dense_replace")) cj["first_k_dense_replace"] = dense_layers;
  if (cj.contains("num_nextn_predict_layers")) cj["num_nextn_predict_layers"] = 0;
  if (vocab > 0) cj["vocab_size"] = vocab;
  for (const char* key : {"num_experts", "n_routed_experts"})
    if (experts > 0 && cj.contains(key) && cj[key].is_number() && cj[key].get<int>() > experts) cj[key] = experts;
  if (!block.empty() && cj.contains("quantization_config")) cj["quantization_config"]["weight_block_size"] = block;
  return cj.dump();
}

// Fills the workload's tensors: one host buffer, every page written (neither side pays first-touch faults), with
// bf16 values of a normal distribution tiled (the node's FP8 quantizer sees real numbers; FP8 codes and float32
// scales pushed as pass-through are bytes of the same pool).
void Fill(Workload* w, const std::vector<replica::TensorSpec>& specs) {
  for (const auto& s : specs) w->total += s.bytes(), w->largest = std::max(w->largest, s.bytes());
  w->host.resize(w->total);
  std::vector<uint16_t> pool(1 << 20);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (auto& v : pool) {
    const float x = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  const uint64_t pool_bytes = pool.size() * 2;
  for (uint64_t i = 0; i < w->total; i += pool_bytes)
    std::memcpy(&w->host[i], pool.data(), std::min(pool_bytes, w->total - i));
  uint64_t at = 0;
  for (const auto& s : specs) {
    w->tensors[s.name] = {s, w->host.data() + at, at};
    at += s.bytes();
  }
}

// A rank's mapping of the replica's layout buffers (what the client maps from the daemon's memfds), made once per
// case (per session), outside the timed updates.
struct ReplicaMap {
  std::vector<std::pair<uint8_t*, uint64_t>> layouts;
  ReplicaMap() = default;
  ReplicaMap(const ReplicaMap&) = delete;
  ReplicaMap& operator=(const ReplicaMap&) = delete;
  ~ReplicaMap() {
    for (auto& [a, n] : layouts) munmap(a, n);
  }
};

// What one rank's push took (seconds from the case's start).
struct RankLog {
  double handover = 0;  // copies into the ring or the replica, waits for ring space and CUDA drains included
  double end = 0;       // its last bucket's parameters were handed to the transport
  uint64_t bytes = 0;
  uint64_t placed_bytes = 0;  // of `bytes`, copied straight into the replica
  double commit_placed = 0;   // CommitPlaced calls (claim, arrival counting, posting)
  std::vector<wsync::daemon::BucketTiming> buckets;
};

// Where a rank's tensors come from: host memory, or (with a copier) the device copy at `device` (same offsets).
struct RankSource {
  const uint8_t* device = nullptr;
  wsync::client::DeviceCopier* copier = nullptr;
  wsync::CopyPool* pool = nullptr;  // host tensors: the rank's copy threads (TrainerOptions::host_copy_threads)
  wsync::PlaceMode place_mode = wsync::PlaceMode::kOnePass;  // how host placements copy column shards
};

// One rank's push of update `version`, as the client library does it (TrainerClient::Push / PushDevice).
absl::Status PushRank(wsync::daemon::SourceNode& node, const std::string& session, wsync::RingProducer& ring,
                      const ReplicaMap* replica, const RankSource& from, int64_t version,
                      const std::map<std::string, Tensor>& tensors, RankLog* log, Clock::time_point t0) {
  v1::BeginPushRequest bp;
  bp.set_session_id(session);
  bp.set_version(version);
  WSYNC_ASSIGN_OR_RETURN(v1::BeginPushReply names, node.BeginPush(bp));
  const uint64_t bucket_limit = ring.capacity() / 2;
  std::map<std::string, const v1::TensorPlacement*> offers;
  if (replica != nullptr)
    for (const auto& p : names.placements()) offers[p.name()] = &p;
  std::vector<std::string> placed;
  uint64_t placed_pending = 0;
  // CUDA copies must have landed before the daemon reads what they wrote (the client drains before each commit).
  auto drain = [&]() -> absl::Status {
    if (from.copier == nullptr) return absl::OkStatus();
    const auto d0 = Clock::now();
    absl::Status st = from.copier->Drain();
    log->handover += Since(d0);
    return st;
  };
  auto commit_placed = [&]() -> absl::Status {
    if (placed.empty()) return absl::OkStatus();
    WSYNC_RETURN_IF_ERROR(drain());
    const auto c0 = Clock::now();
    v1::CommitPlacedRequest cp;
    cp.set_session_id(session);
    cp.set_version(version);
    cp.set_replica_generation(names.replica_generation());
    for (auto& n : placed) cp.add_names(std::move(n));
    placed.clear();
    placed_pending = 0;
    auto r = node.CommitPlaced(cp);
    log->commit_placed += Since(c0);
    return r.status();
  };
  std::future<absl::Status> in_flight;
  auto wait = [&]() -> absl::Status { return in_flight.valid() ? in_flight.get() : absl::OkStatus(); };
  auto commit = [&]() -> absl::Status {
    if (ring.bucket_tensors() == 0) return absl::OkStatus();
    WSYNC_RETURN_IF_ERROR(wait());
    WSYNC_RETURN_IF_ERROR(drain());
    WSYNC_ASSIGN_OR_RETURN(uint64_t seq, ring.CommitBucket());
    in_flight = std::async(std::launch::async, [&node, &session, seq]() -> absl::Status {
      v1::CommitBucketRequest cb;
      cb.set_session_id(session);
      cb.set_bucket_seq(seq);
      return node.CommitBucket(cb).status();
    });
    return absl::OkStatus();
  };
  // FP8 pass-through: a tensor the node names goes as its codes followed by its `_scale_inv` (the node accepts
  // either form per tensor and names only the weight).
  std::vector<std::string> order;
  for (const std::string& name : names.tensor_names()) {
    order.push_back(name);
    if (tensors.count(name + "_scale_inv") > 0) order.push_back(name + "_scale_inv");
  }
  for (const std::string& name : order) {
    const Tensor& t = tensors.at(name);
    const uint64_t bytes = t.spec.bytes();
    const uint8_t* dev = from.copier != nullptr ? from.device + t.offset : nullptr;
    // An offer is for exactly its dtype and shape (an FP8 replica offers codes and scales, not the bf16 tensor).
    auto o = offers.find(name);
    if (o != offers.end() &&
        (o->second->dtype() != wsync::DTypeName(t.spec.dtype) ||
         !std::equal(o->second->shape().begin(), o->second->shape().end(), t.spec.shape.begin(), t.spec.shape.end())))
      o = offers.end();
    if (o != offers.end()) {
      // The client's placement: host, every region at once (CopyPlaced: column shards in one pass over the rows,
      // or per region with --copy-mode per-region); CUDA, one cudaMemcpy2DAsync per region.
      const auto h0 = Clock::now();
      if (dev != nullptr) WSYNC_RETURN_IF_ERROR(from.copier->Check(name, dev, bytes, 0));
      std::vector<wsync::PlacedCopy> copies;
      for (const auto& r : o->second->regions()) {
        uint8_t* dst = replica->layouts[r.layout()].first + r.offset();
        if (dev != nullptr) {
          WSYNC_RETURN_IF_ERROR(from.copier->Copy2DAsync(name, dst, r.pitch(), dev + r.src_offset(), r.src_pitch(),
                                                         r.row_bytes(), r.rows(), 0, 0, false));
        } else {
          copies.push_back({dst, r.pitch(), r.src_offset(), r.src_pitch(), r.row_bytes(), r.rows()});
        }
      }
      if (dev == nullptr) wsync::CopyPlaced(copies, t.host, from.pool, from.place_mode);
      log->handover += Since(h0);
      log->bytes += bytes;
      log->placed_bytes += bytes;
      placed.push_back(name);
      placed_pending += bytes;
      if (placed_pending >= bucket_limit) WSYNC_RETURN_IF_ERROR(commit_placed());
      continue;
    }
    const bool alone = bytes > bucket_limit;
    if (alone) {
      WSYNC_RETURN_IF_ERROR(commit());
      WSYNC_RETURN_IF_ERROR(wait());
    } else if (!ring.FitsInBucket(name.size(), bytes) || ring.bucket_payload_bytes() + bytes > bucket_limit) {
      WSYNC_RETURN_IF_ERROR(commit());
    }
    const auto h0 = Clock::now();
    if (dev != nullptr) WSYNC_RETURN_IF_ERROR(from.copier->Check(name, dev, bytes, 0));
    WSYNC_ASSIGN_OR_RETURN(uint8_t * dst,
                           ring.BeginTensor(name, t.spec.dtype, t.spec.shape, bytes, absl::Seconds(120)));
    if (dev != nullptr) {
      WSYNC_RETURN_IF_ERROR(from.copier->CopyAsync(name, dst, dev, bytes, 0, 0));
    } else {
      wsync::CopyRect(dst, bytes, t.host, bytes, bytes, 1, from.pool);
    }
    WSYNC_RETURN_IF_ERROR(ring.FinishTensor());
    log->handover += Since(h0);
    log->bytes += bytes;
    if (alone) WSYNC_RETURN_IF_ERROR(commit());
  }
  WSYNC_RETURN_IF_ERROR(commit());
  WSYNC_RETURN_IF_ERROR(wait());
  WSYNC_RETURN_IF_ERROR(commit_placed());
  log->end = Since(t0);
  v1::EndPushRequest ep;
  ep.set_session_id(session);
  ep.set_version(version);
  return node.EndPush(ep);
}

// memcpy of `bytes` from src to dst on `threads` threads, each a contiguous share; seconds.
double ParallelCopy(uint8_t* dst, const uint8_t* src, uint64_t bytes, int threads) {
  const uint64_t share = (bytes / threads + 4095) / 4096 * 4096;
  std::vector<std::thread> pool;
  const auto t0 = Clock::now();
  for (int i = 0; i < threads; ++i) {
    const uint64_t a = std::min(bytes, share * i), b = std::min(bytes, share * (i + 1));
    pool.emplace_back([=] { std::memcpy(dst + a, src + a, b - a); });
  }
  for (auto& t : pool) t.join();
  return Since(t0);
}

std::vector<int> ParseList(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view item : absl::StrSplit(s, ',', absl::SkipEmpty())) out.push_back(std::stoi(std::string(item)));
  return out;
}

struct BenchOptions {
  int reps = 3, ring_mib = 512, threads = 1, tcp_streams = 4;
  int slow_target_ms = 0;  // tcp: run again with engine rank 0's target slowed by this per Post (0: off)
  int copy_threads = 0;    // per rank, as the client's host_copy_threads (0: hardware threads / R, at most 8)
  bool write_checksums = false, timeline = true;
  std::string placement = "both";
  std::string copy_mode = "one-pass";  // host placement: one-pass, per-region or both (base/host_copy.h PlaceMode)
};

// One case's figure per mode (ring, placement).
struct ModeResult {
  bool placement = false;
  std::string copy_mode;  // placement: one-pass or per-region
  double gbps = 0, baseline_gbps = 0;
  // tcp with --slow-target-ms: what landed per target in the update whose other targets (not rank 0) were fastest.
  std::vector<TargetLanded> targets;
};

// The baseline a case is measured against: the all-core memcpy of its bytes, taken between its updates (`memcpy`),
// or a figure measured once before it (`fixed_gbps`: the pinned D2H peak, the tcp transport alone).
struct Baseline {
  std::string name;
  double fixed_gbps = 0;  // 0: the memcpy between updates
  std::vector<uint8_t>* scratch = nullptr;
};

// Runs one case: a fresh node configured for `w` at engine TP `tp`, R ranks' sessions, then --reps updates per
// placement mode. `tcp`: through the real tcp transport into that target (else the null transport); `device`: the
// ranks push CUDA tensors from this device copy. Appends its JSON to `results`.
std::vector<ModeResult> RunCase(const std::string& case_name, Workload& w, int tp, int R, TcpTarget* tcp,
                                const uint8_t* device, const Baseline& base, const BenchOptions& opt, int64_t* epoch,
                                int64_t* version, json* results) {
  const uint64_t ring_bytes = std::max<uint64_t>(static_cast<uint64_t>(opt.ring_mib) << 20,
                                                 (w.largest + (64ull << 20)) / (1 << 20) * (1 << 20));
  NullTransport null_transport;
  wsync::daemon::SourceOptions o;
  o.node_id = "bench";
  o.trainer_ranks = R;
  o.ring_bytes = ring_bytes;
  o.write_checksums = opt.write_checksums;
  o.push_timeout = absl::Seconds(600);
  std::mutex log_mu;
  std::vector<RankLog> logs(R);
  o.bucket_observer = [&](const wsync::daemon::BucketTiming& b) {
    std::lock_guard<std::mutex> l(log_mu);
    logs[b.local_rank].buckets.push_back(b);
  };
  wsync::daemon::ConnectTargetFn connect = [tcp](const std::string&,
                                                 const v1::ConnectTargetRequest& req) -> absl::StatusOr<std::string> {
    if (tcp == nullptr) return std::string("null");
    return tcp->Connect(req);
  };
  wsync::daemon::SourceNode node(o, tcp != nullptr ? tcp->source() : &null_transport, connect);
  const PlannedEngine plan = Plan(w.json_text, w.cfg, w.quant, tp, w.ep, ++*epoch,
                                  tcp != nullptr ? "loopback-target:1" : "null:1", [tcp](uint64_t bytes) {
                                    if (tcp == nullptr) return std::to_string(bytes);
                                    auto d = tcp->AddSegment(bytes);
                                    if (!d.ok()) Die("target segment", d.status());
                                    return *d;
                                  });
  if (auto c = node.Configure(plan.request); !c.ok()) Die("configure", c.status());
  std::vector<std::string> sessions;
  std::vector<wsync::ScopedFd> fds;
  std::vector<std::unique_ptr<wsync::RingProducer>> producers;
  for (int r = 0; r < R; ++r) {
    wsync::daemon::SessionRequest sr;
    sr.local_rank = r;
    auto s = node.OpenSession(sr);
    if (!s.ok()) Die("open session", s.status());
    sessions.push_back(s->id);
    fds.push_back(std::move(s->ring_fd));
    // Attached once per session, as the client does (the mapping is populated then, not per update).
    auto prod = wsync::RingProducer::Attach(fds.back().get());
    if (!prod.ok()) Die("ring", prod.status());
    producers.push_back(std::make_unique<wsync::RingProducer>(*std::move(prod)));
  }
  // Mapped once per session, as the client does; placement runs only use them.
  std::vector<std::unique_ptr<ReplicaMap>> maps;
  for (int r = 0; r < R && opt.placement != "off"; ++r) {
    auto h = node.ReplicaFds(sessions[r]);
    if (!h.ok()) Die("replica fds", h.status());
    auto m = std::make_unique<ReplicaMap>();
    for (size_t i = 0; i < h->fds.size(); ++i) {
      void* a = mmap(nullptr, h->bytes[i], PROT_READ | PROT_WRITE, MAP_SHARED, h->fds[i].get(), 0);
      if (a == MAP_FAILED) Die("mapping the replica", absl::ErrnoToStatus(errno, "mmap"));
      m->layouts.push_back({static_cast<uint8_t*>(a), h->bytes[i]});
    }
    maps.push_back(std::move(m));
  }
  // CUDA tensors: a copier per rank, its ring and replica mappings page-locked once per session (as the client
  // does). Declared after the rings and mappings: destroyed (unregistered) before them.
  std::vector<std::unique_ptr<wsync::client::DeviceCopier>> copiers;
  for (int r = 0; r < R && device != nullptr; ++r) {
    auto c = wsync::client::DeviceCopier::Create(producers[r]->data_area(), producers[r]->capacity(),
                                                 absl::StrCat("rank ", r, " ring"));
    if (!c.ok()) Die("device copier", c.status());
    for (size_t i = 0; r < static_cast<int>(maps.size()) && i < maps[r]->layouts.size(); ++i)
      if (auto st = (*c)->RegisterDestination(maps[r]->layouts[i].first, maps[r]->layouts[i].second,
                                              absl::StrCat("replica layout ", i));
          !st.ok())
        Die("registering the replica mapping", st);
    copiers.push_back(*std::move(c));
  }
  const uint64_t bytes = tcp != nullptr ? plan.bytes : w.total;
  // Each rank's copy threads, started once for the case as the client starts them once per session.
  std::vector<std::unique_ptr<wsync::CopyPool>> pools;
  for (int r = 0; r < R; ++r)
    pools.push_back(std::make_unique<wsync::CopyPool>(wsync::HostCopyThreads(opt.copy_threads, R)));
  // (placement, copy mode): the ring, then placement with each copy mode asked for (host tensors; CUDA copies
  // do not use it).
  std::vector<std::pair<bool, std::string>> modes;
  if (opt.placement != "on" || w.node_quantizes) modes.emplace_back(false, "");
  if (opt.placement != "off" && !w.node_quantizes) {
    if (device == nullptr && opt.copy_mode == "both") modes.emplace_back(true, "per-region");
    modes.emplace_back(true, device != nullptr ? "cuda" : opt.copy_mode == "both" ? "one-pass" : opt.copy_mode);
  }
  std::vector<ModeResult> out;
  double ring_gbps = 0;
  for (const auto& [place, copy_mode] : modes) {
    const wsync::PlaceMode place_mode =
        copy_mode == "per-region" ? wsync::PlaceMode::kPerRegion : wsync::PlaceMode::kOnePass;
    double best = 1e30, case_copy_s = 1e30;
    std::vector<RankLog> best_logs;
    std::vector<TargetLanded> best_targets;
    for (int rep = 1; rep <= opt.reps; ++rep) {
      const int64_t v = ++*version;
      for (auto& l : logs) l = RankLog();
      v1::StartUpdateRequest su;
      su.set_version(v);
      su.set_plan_epoch(*epoch);
      su.set_no_placement(!place);
      if (auto st = node.StartUpdate(su); !st.ok()) Die("start update", st);
      // The memcpy baseline again between this case's updates, so both figures of a ratio see the same machine (on
      // a shared machine the memory bandwidth left over varies from minute to minute).
      if (base.fixed_gbps == 0)
        case_copy_s = std::min(case_copy_s, ParallelCopy(base.scratch->data(), w.host.data(), w.total, opt.threads));
      std::vector<std::future<absl::Status>> pushes;
      if (tcp != nullptr && tcp->clocked()) tcp->ResetLanded();
      const auto t0 = Clock::now();
      for (int r = 0; r < R; ++r)
        pushes.push_back(std::async(std::launch::async, [&, r] {
          const RankSource from{device, device != nullptr ? copiers[r].get() : nullptr, pools[r].get(), place_mode};
          return PushRank(node, sessions[r], *producers[r], place ? maps[r].get() : nullptr, from, v, w.tensors,
                          &logs[r], t0);
        }));
      for (auto& p : pushes)
        if (auto st = p.get(); !st.ok()) Die(absl::StrCat(case_name, " push"), st);
      double s = 0;
      for (const auto& l : logs) s = std::max(s, l.end);
      v1::FinishUpdateRequest fu;
      fu.set_version(v);
      fu.set_plan_epoch(*epoch);
      fu.set_timeout_seconds(600);
      auto fin =
          node.FinishUpdate(fu);  // every required parameter was completed and posted (and landed), or this fails
      if (!fin.ok()) Die("finish update", fin.status());
      if (tcp != nullptr) s = Since(t0);  // the writes landed in the target
      if (tcp != nullptr && tcp->clocked()) {
        std::vector<TargetLanded> landed = tcp->Landed(t0);
        uint64_t landed_bytes = 0;
        for (const auto& t : landed) landed_bytes += t.bytes;
        if (static_cast<int>(landed.size()) != tp || landed_bytes != plan.bytes)
          Die("slow-target accounting",
              absl::InternalError(absl::StrCat(landed.size(), " targets logged ", landed_bytes,
                                               " bytes landed; the plan: ", tp, " targets, ", plan.bytes, " bytes")));
        if (best_targets.empty() || OthersGbps(landed) > OthersGbps(best_targets)) best_targets = std::move(landed);
      }
      if (s < best) {
        best = s;
        std::lock_guard<std::mutex> l(log_mu);
        best_logs = logs;
      }
    }
    const double gbps = bytes / best / 1e9;
    const double base_gbps = base.fixed_gbps > 0 ? base.fixed_gbps : w.total / case_copy_s / 1e9;
    uint64_t placed_bytes = 0;
    for (const auto& l : best_logs) placed_bytes += l.placed_bytes;
    if (!place) ring_gbps = gbps;
    out.push_back({place, copy_mode, gbps, base_gbps, best_targets});
    const std::string mode_name = !place ? "ring" : device != nullptr ? "placement" : "placement (" + copy_mode + ")";
    const std::string shown = case_name + (tcp != nullptr ? tcp->Label() : "");
    std::printf("%s %s TP %d%s, R %d, %s: %.2f GB in %.3f s = %.2f GB/s, %.2fx %s (%.2f GB/s)", shown.c_str(),
                w.label.c_str(), tp, w.ep > 1 ? absl::StrCat(" EP ", w.ep).c_str() : "", R, mode_name.c_str(),
                bytes / 1e9, best, gbps, gbps / base_gbps, base.name.c_str(), base_gbps);
    if (place)
      std::printf(
          "; %.0f%% of the bytes placed%s", 100.0 * placed_bytes / w.total,
          ring_gbps > 0 ? absl::StrCat(", placement / ring ", absl::StrFormat("%.2f", gbps / ring_gbps)).c_str() : "");
    std::printf("\n");
    json ranks_json = json::array();
    for (int r = 0; r < R; ++r) {
      const RankLog& l = best_logs[r];
      double wait = 0, load = 0, send = 0;
      for (const auto& b : l.buckets) {
        wait += absl::ToDoubleSeconds(b.begin - b.got);
        load += absl::ToDoubleSeconds(b.loaded - b.begin);
        send += absl::ToDoubleSeconds(b.posted - b.loaded);
      }
      if (opt.timeline)
        std::printf(
            "  rank %d: %zu buckets, %.2f GB (%.2f GB placed): hand-over %.3f s, lock wait %.3f s, load %.3f s, "
            "send %.3f s, placed commits %.3f s, done at %.3f s\n",
            r, l.buckets.size(), l.bytes / 1e9, l.placed_bytes / 1e9, l.handover, wait, load, send, l.commit_placed,
            l.end);
      ranks_json.push_back({{"rank", r},
                            {"buckets", l.buckets.size()},
                            {"bytes", l.bytes},
                            {"placed_bytes", l.placed_bytes},
                            {"handover_s", l.handover},
                            {"lock_wait_s", wait},
                            {"load_s", load},
                            {"send_s", send},
                            {"commit_placed_s", l.commit_placed},
                            {"end_s", l.end}});
    }
    std::fflush(stdout);
    const wsync::MemoryKind tensors = device != nullptr ? wsync::MemoryKind::kCuda : wsync::MemoryKind::kHost;
    results->push_back({{"case", case_name},
                        {"workload", w.name},
                        {"tensors", wsync::MemoryKindName(tensors)},
                        {"tp", tp},
                        {"ep", w.ep},
                        {"ranks", R},
                        {"placement", place},
                        {"copy_mode", copy_mode},
                        {"gbps", gbps},
                        {"baseline", base.name},
                        {"baseline_gbps", base_gbps},
                        {"ratio", gbps / base_gbps},
                        {"bytes", bytes},
                        {"placed_bytes", placed_bytes},
                        {"placement_over_ring", place && ring_gbps > 0 ? gbps / ring_gbps : 0.0},
                        {"seconds", best},
                        {"per_rank", ranks_json}});
    if (tcp != nullptr && tcp->clocked()) {
      json targets_json = json::array();
      for (const auto& t : best_targets)
        targets_json.push_back({{"rank", t.rank},
                                {"bytes", t.bytes},
                                {"batches", t.batches},
                                {"last_landed_s", t.seconds},
                                {"gbps", t.gbps()}});
      results->back()["slowed_target_ms"] = tcp->slowed_ms();
      results->back()["targets"] = targets_json;
      results->back()["others_gbps"] = OthersGbps(best_targets);
    }
  }
  return out;
}

// The planner's name for a case's figure (planner/node_rates.h: WEIGHTS/TENSORS/PATH); empty for what the planner
// does not read (the tcp send path, the per-region copy kept for comparison).
std::string CurveName(const std::string& case_name, const Workload& w, const ModeResult& m) {
  if (case_name == "tcp" || m.copy_mode == "per-region") return "";
  const std::string weights = w.name == "kimi-k2-fp8-64"             ? "fp8-passthrough"
                              : w.name == "deepseek-v3-bf16-fp8-128" ? "fp8-quantize"
                                                                     : "bf16";
  const wsync::MemoryKind tensors = case_name == "cuda" ? wsync::MemoryKind::kCuda : wsync::MemoryKind::kHost;
  return absl::StrCat(weights, "/", wsync::MemoryKindName(tensors), "/", m.placement ? "placement" : "ring");
}

std::string UtcNow() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "bench_node: trainer ranks pushing through one source node (in-process) vs a baseline of the same bytes "
      "measured in the same run: dense and MoE FP8 host tensors vs all-core memcpy, through a loopback tcp target "
      "vs the tcp transport alone, CUDA tensors vs the pinned D2H peak"};
  std::string models_dir = WSYNC_MODELS_DIR, model, kimi, dsv3;
  std::string cases_list = "dense,moe,tcp,cuda", ranks_list = "1,4,8", tp_list = "1,8";
  std::string results_out, machine;
  int layers = 0, vocab = 0, moe_layers = 4, moe_dense = 1, moe_vocab = 16384, experts = 16, d2h_streams = 4;
  double tcp_seconds = 1.0;
  bool quick = false;
  BenchOptions opt;
  opt.threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  app.add_option("--cases", cases_list, "dense, moe, tcp, cuda: comma-separated")->capture_default_str();
  app.add_flag("--quick", quick,
               "small shapes (1 layer, vocab 4096; MoE: one MoE layer of 8 experts; R = 1,2; 2 reps) unless given "
               "explicitly: every case in well under a minute on 2 cores");
  app.add_option("--models-dir", models_dir,
                 "holds <org>__<name>/config.json of Qwen3-8B, Kimi-K2-Instruct and DeepSeek-V3 (a bundle's "
                 "tests/data/models)")
      ->capture_default_str();
  app.add_option("--model", model, "the dense model's config.json (bf16; default: Qwen3-8B in --models-dir)");
  app.add_option("--kimi-model", kimi, "Kimi-K2's config.json (FP8 64x64 pass-through; default: in --models-dir)");
  app.add_option("--deepseek-model", dsv3,
                 "DeepSeek-V3's config.json (bf16 -> FP8 128x128 on the node; default: in --models-dir)");
  app.add_option("--ranks", ranks_list, "trainer ranks R, comma-separated")->capture_default_str();
  app.add_option("--tp", tp_list, "dense engine tensor-parallel sizes (one engine, all its ranks written by this node)")
      ->capture_default_str();
  app.add_option("--layers", layers, "dense: override num_hidden_layers (0: the model's)")->check(CLI::Range(0, 1000));
  app.add_option("--vocab", vocab, "dense: override vocab_size (0: the model's)")->check(CLI::Range(0, 1 << 22));
  app.add_option("--moe-layers", moe_layers, "MoE: layers kept (the first --moe-dense dense, the rest MoE)")
      ->check(CLI::Range(1, 61))
      ->capture_default_str();
  app.add_option("--moe-dense", moe_dense, "MoE: of those, dense layers first (first_k_dense_replace)")
      ->check(CLI::Range(0, 61))
      ->capture_default_str();
  app.add_option("--moe-vocab", moe_vocab, "MoE: vocab_size (0: the model's)")
      ->check(CLI::Range(0, 1 << 22))
      ->capture_default_str();
  app.add_option("--experts", experts, "MoE: routed experts per layer, capped (each keeps its real size; >= 8)")
      ->check(CLI::Range(8, 4096))
      ->capture_default_str();
  app.add_option("--reps", opt.reps, "updates per case; the best counts")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--ring-mib", opt.ring_mib,
                 "ring per rank, MiB (wsyncd --ring-mib; enlarged to fit the largest tensor)")
      ->check(CLI::Range(8, 1 << 16))
      ->capture_default_str();
  app.add_option("--copy-threads", opt.copy_threads,
                 "threads each rank spreads a host tensor's copy over, as the client does (TrainerOptions::"
                 "host_copy_threads; 0: hardware threads / R, at most 8; 1: one memcpy per copy)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--copy-mode", opt.copy_mode,
                 "host placement of column shards: one-pass (the client's), per-region, or both (each run both ways)")
      ->check(CLI::IsMember({"one-pass", "per-region", "both"}))
      ->capture_default_str();
  app.add_option("--threads", opt.threads, "memcpy baseline threads")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--tcp-streams", opt.tcp_streams, "tcp: connections per endpoint, node and baseline alike")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--tcp-seconds", tcp_seconds, "tcp baseline: measurement time per message size")
      ->capture_default_str();
  app.add_option("--slow-target-ms", opt.slow_target_ms,
                 "tcp: run the case again with every Post to engine rank 0's target held this long (the fault "
                 "transport's delay_peer); reports the other targets' rate, slowed / unslowed (0: off)")
      ->check(CLI::Range(0, 600000))
      ->capture_default_str();
  app.add_option("--d2h-streams", d2h_streams, "cuda baseline: streams of the split pinned D2H copy")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_flag("--write-checksums", opt.write_checksums,
               "hash what is written on the node's hash pool (wsyncd's default; off here: the data path alone)");
  app.add_option("--placement", opt.placement,
                 "zero-copy placement: on, off, or both (each case run both ways, placement ÷ ring reported)")
      ->check(CLI::IsMember({"on", "off", "both"}))
      ->capture_default_str();
  app.add_flag("--timeline,!--no-timeline", opt.timeline, "print the per-rank timeline of each case's best update");
  app.add_option("--results-out", results_out,
                 "write the node rates for the planner (planner/node_rates.h format) to this file");
  app.add_option("--machine", machine, "what the results file says this ran on (default: cores, memory, GPU)");
  CLI11_PARSE(app, argc, argv);
  if (model.empty()) model = models_dir + "/Qwen__Qwen3-8B/config.json";
  if (kimi.empty()) kimi = models_dir + "/moonshotai__Kimi-K2-Instruct/config.json";
  if (dsv3.empty()) dsv3 = models_dir + "/deepseek-ai__DeepSeek-V3/config.json";
  if (quick) {
    if (app.count("--layers") == 0) layers = 1;
    if (app.count("--vocab") == 0) vocab = 4096;
    if (app.count("--moe-layers") == 0) moe_layers = 1;
    if (app.count("--moe-dense") == 0) moe_dense = 0;
    if (app.count("--moe-vocab") == 0) moe_vocab = 2048;
    if (app.count("--experts") == 0) experts = 8;
    if (app.count("--ranks") == 0) ranks_list = "1,2";
    if (app.count("--reps") == 0) opt.reps = 2;
    if (app.count("--ring-mib") == 0) opt.ring_mib = 64;
    if (app.count("--tcp-seconds") == 0) tcp_seconds = 0.3;
  }
  std::map<std::string, bool> run;
  for (absl::string_view c : absl::StrSplit(cases_list, ',', absl::SkipEmpty())) {
    if (c != "dense" && c != "moe" && c != "tcp" && c != "cuda") Die("--cases", absl::InvalidArgumentError(c));
    run[std::string(c)] = true;
  }
  json skipped = json::object();
  if (run["cuda"]) {
    if (absl::Status st = wsync::bench::DeviceTensors::Available(); !st.ok()) {
      std::printf("cuda: skipped: %s\n", std::string(st.message()).c_str());
      skipped["cuda"] = std::string(st.message());
      run["cuda"] = false;
    }
  }
  const std::vector<int> ranks = ParseList(ranks_list), tps = ParseList(tp_list);
  if (ranks.empty() || tps.empty()) Die("--ranks/--tp", absl::InvalidArgumentError("empty list"));

  auto load = [&](Workload* w, const std::string& name, const std::string& label, const std::string& path,
                  const std::string& cut, replica::QuantSpec quant, int ep, std::vector<int> wtps,
                  bool fp8_pass_through) {
    w->name = name;
    w->label = label;
    w->model_path = path;
    w->json_text = cut;
    auto cfg = replica::ModelConfig::FromJson(cut);
    if (!cfg.ok()) Die("model config " + path, cfg.status());
    w->cfg = *cfg;
    w->quant = quant;
    w->ep = ep;
    w->tps = std::move(wtps);
    w->node_quantizes = quant.mode == replica::QuantSpec::Mode::kFp8Block && !fp8_pass_through;
    auto specs = fp8_pass_through ? replica::CheckpointTensors(w->cfg, replica::CheckpointFormat::kFp8PassThrough,
                                                               quant.block_n, quant.block_k)
                                  : replica::CheckpointTensors(w->cfg);
    if (!specs.ok()) Die("checkpoint tensors " + path, specs.status());
    Fill(w, *specs);
    std::printf("%s: %s, %lld layers, vocab %lld, %zu tensors, %.2f GB pushed%s\n", name.c_str(), path.c_str(),
                static_cast<long long>(w->cfg.num_layers), static_cast<long long>(w->cfg.vocab_size), specs->size(),
                w->total / 1e9,
                quant.mode == replica::QuantSpec::Mode::kFp8Block
                    ? absl::StrFormat(", engine FP8 %dx%d blocks, routed experts capped at %d", quant.block_n,
                                      quant.block_k, experts)
                          .c_str()
                    : "");
  };
  std::vector<std::unique_ptr<Workload>> dense_w, moe_w;
  if (run["dense"] || run["tcp"] || run["cuda"]) {
    dense_w.push_back(std::make_unique<Workload>());
    load(dense_w.back().get(), "dense", "dense bf16", model, CutConfig(model, layers, -1, vocab, 0, {}), {}, 1, tps,
         false);
  }
  if (run["moe"] || run["cuda"]) {
    replica::QuantSpec fp8_64;
    fp8_64.mode = replica::QuantSpec::Mode::kFp8Block;
    fp8_64.block_n = fp8_64.block_k = 64;
    moe_w.push_back(std::make_unique<Workload>());
    load(moe_w.back().get(), "kimi-k2-fp8-64", "Kimi-K2 FP8 64x64 pass-through", kimi,
         CutConfig(kimi, moe_layers, moe_dense, moe_vocab, experts, {64, 64}), fp8_64, 8, {8}, true);
    replica::QuantSpec fp8_128;
    fp8_128.mode = replica::QuantSpec::Mode::kFp8Block;
    moe_w.push_back(std::make_unique<Workload>());
    load(moe_w.back().get(), "deepseek-v3-bf16-fp8-128", "DeepSeek-V3 bf16 -> FP8 128x128", dsv3,
         CutConfig(dsv3, moe_layers, moe_dense, moe_vocab, experts, {}), fp8_128, 8, {8}, false);
  }
  uint64_t largest_total = 0;
  for (auto* ws : {&dense_w, &moe_w})
    for (auto& w : *ws) largest_total = std::max(largest_total, w->total);
  std::vector<uint8_t> scratch(largest_total, 1);
  std::printf("hardware threads %u; write checksums %s; ring %d MiB per rank (at least)\n",
              std::thread::hardware_concurrency(), opt.write_checksums ? "on" : "off", opt.ring_mib);
  for (auto* ws : {&dense_w, &moe_w})
    for (auto& w : *ws) {
      double s = 1e30, s1 = ParallelCopy(scratch.data(), w->host.data(), w->total, 1);
      // Informational (each case's ratio uses the copies between its own updates): one warm copy is enough.
      s = ParallelCopy(scratch.data(), w->host.data(), w->total, opt.threads);
      std::printf("baseline %s: memcpy of the same bytes on %d threads: %.2f GB/s (1 thread: %.2f GB/s)\n",
                  w->name.c_str(), opt.threads, w->total / s / 1e9, w->total / s1 / 1e9);
    }

  json results = json::array();
  json slow_results = json::array(), slow_line = json::object();  // tcp with --slow-target-ms
  int64_t epoch = 0, version = 0;
  // The planner's curves (planner/node_rates.h names) at the largest engine TP run, per R; and the dense headline.
  struct Curve {
    int tp = 0;
    std::vector<std::pair<int, double>> gbps;
  };
  std::map<std::string, Curve> curves;
  double headline = 0, headline_base = 0, headline_placed = 0;
  const Baseline memcpy_base{absl::StrFormat("the %d-thread memcpy", opt.threads), 0, &scratch};
  auto run_all = [&](const std::string& case_name, Workload& w, const uint8_t* device, const Baseline& base,
                     const std::vector<int>& case_tps) {
    for (int tp : case_tps)
      for (int R : ranks) {
        auto modes = RunCase(case_name, w, tp, R, nullptr, device, base, opt, &epoch, &version, &results);
        for (const ModeResult& m : modes) {
          const std::string name = CurveName(case_name, w, m);
          if (name.empty()) continue;
          Curve& c = curves[name];
          if (tp > c.tp) c = Curve{tp, {}};
          if (tp == c.tp) c.gbps.emplace_back(R, m.gbps);
        }
        if (case_name == "dense" && tp == case_tps.front() && R == ranks.back())
          for (const auto& m : modes) {
            if (!m.placement) headline = m.gbps, headline_base = m.baseline_gbps;
            if (m.placement) headline_placed = m.gbps;
          }
      }
  };
  if (run["dense"]) run_all("dense", *dense_w[0], nullptr, memcpy_base, tps);
  if (run["moe"])
    for (auto& w : moe_w) run_all("moe", *w, nullptr, memcpy_base, w->tps);
  if (run["tcp"]) {
    Workload& w = *dense_w[0];
    // The node's writes are whole parameters: the baseline at their mean size (and at 64 MiB, bench_transport's
    // headline size), the same streams.
    uint64_t total_params = 0, written = 0;
    for (int r = 0; r < tps.front(); ++r) {
      auto t = replica::BuildParamTable(w.cfg, replica::RankParallelism::ForTp(tps.front(), r), {});
      if (!t.ok()) Die("param table", t.status());
      total_params += t->params().size();
      written += t->total_bytes();
    }
    const uint64_t mean =
        std::clamp<uint64_t>(written / std::max<uint64_t>(total_params, 1) / 4096 * 4096, 64 << 10, 64 << 20);
    wsync::bench::TcpBenchOptions topts;
    topts.sizes = {mean, 64ull << 20};
    topts.per_size = absl::Seconds(tcp_seconds);
    topts.streams = opt.tcp_streams;
    auto sweep = wsync::bench::RunTcpTransportSweep(topts);
    if (!sweep.ok()) Die("tcp transport baseline", sweep.status());
    std::printf(
        "baseline tcp: the tcp transport alone over loopback, %d streams: %.2f GB/s at %llu KiB (the node's "
        "mean write), %.2f GB/s at 64 MiB\n",
        opt.tcp_streams, (*sweep)[0].gbps(), static_cast<unsigned long long>(mean >> 10), (*sweep)[1].gbps());
    const Baseline tcp_base{
        absl::StrFormat("the tcp transport alone at %llu KiB", static_cast<unsigned long long>(mean >> 10)),
        (*sweep)[0].gbps(), nullptr};
    const int tp = tps.front();
    const bool slow = opt.slow_target_ms > 0;
    // With --slow-target-ms: per R, the unslowed run, then the slowed one, on the same layout; compared per mode.
    for (int R : ranks) {
      std::vector<ModeResult> runs[2];
      for (int slowed = 0; slowed < (slow ? 2 : 1); ++slowed) {
        auto target =
            TcpTarget::Create(opt.tcp_streams, slow ? tp : 0, absl::Milliseconds(slowed ? opt.slow_target_ms : 0));
        if (!target.ok()) Die("tcp target", target.status());
        runs[slowed] = RunCase("tcp", w, tp, R, target->get(), nullptr, tcp_base, opt, &epoch, &version, &results);
      }
      for (size_t m = 0; slow && m < runs[0].size(); ++m) {
        const ModeResult &a = runs[0][m], &b = runs[1][m];
        const double before = OthersGbps(a.targets), after = OthersGbps(b.targets);
        const double ratio = before > 0 ? after / before : 0;
        double worst = 1e30;
        json per_target = json::array();
        for (size_t i = 0; i < a.targets.size() && i < b.targets.size(); ++i) {
          const TargetLanded &u = a.targets[i], &v = b.targets[i];
          const double r = u.gbps() > 0 ? v.gbps() / u.gbps() : 0;
          if (u.rank != 0) worst = std::min(worst, r);
          std::printf(
              "  target rank %d%s: %.3f GB in %llu batches; unslowed %.2f GB/s (last write landed at %.3f s), "
              "slowed %.2f GB/s (at %.3f s), %.2fx\n",
              u.rank, u.rank == 0 ? " (slowed)" : "", u.bytes / 1e9, static_cast<unsigned long long>(v.batches),
              u.gbps(), u.seconds, v.gbps(), v.seconds, r);
          per_target.push_back(
              {{"rank", u.rank}, {"unslowed_gbps", u.gbps()}, {"slowed_gbps", v.gbps()}, {"ratio", r}});
        }
        if (worst > 1e29) worst = 0;
        const double own = b.targets.empty() ? 0 : b.targets[0].gbps();
        const double own_before = a.targets.empty() ? 0 : a.targets[0].gbps();
        std::printf(
            "slow target, TP %d, R %d, %s: the %zu other targets %.2f GB/s unslowed, %.2f GB/s with rank 0 slowed by "
            "%d "
            "ms per Post: %.2fx (goal >= 0.9; worst single target %.2fx); the slowed target %.2f GB/s (unslowed "
            "%.2f GB/s)\n",
            tp, R, a.placement ? "placement" : "ring", a.targets.size() - 1, before, after, opt.slow_target_ms, ratio,
            worst, own, own_before);
        std::fflush(stdout);
        slow_results.push_back({{"tp", tp},
                                {"ranks", R},
                                {"placement", a.placement},
                                {"slow_ms", opt.slow_target_ms},
                                {"others_unslowed_gbps", before},
                                {"others_slowed_gbps", after},
                                {"others_ratio", ratio},
                                {"worst_other_ratio", worst},
                                {"slowed_target_gbps", own},
                                {"slowed_target_unslowed_gbps", own_before},
                                {"targets", per_target}});
        // The final line's figures: the ring at the largest R (listed last).
        if (m == 0) slow_line = slow_results.back();
      }
    }
  }
  double d2h_peak = 0;
  if (run["cuda"]) {
    for (auto* ws : {&dense_w, &moe_w}) {
      for (auto& w : *ws) {
        auto dev = wsync::bench::DeviceTensors::Create(w->host.data(), w->total);
        if (!dev.ok()) {
          std::printf("cuda: skipped: %s\n", std::string(dev.status().message()).c_str());
          skipped["cuda"] = std::string(dev.status().message());
          break;
        }
        auto one = (*dev)->PinnedD2hSeconds(1, 3);
        auto many = (*dev)->PinnedD2hSeconds(d2h_streams, 3);
        if (!one.ok()) Die("pinned D2H", one.status());
        if (!many.ok()) Die("pinned D2H", many.status());
        const double peak = std::max(w->total / *one, w->total / *many) / 1e9;
        d2h_peak = std::max(d2h_peak, peak);
        std::printf(
            "baseline cuda %s on %s: pinned D2H of the same bytes %.2f GB/s on 1 stream, %.2f GB/s on %d; "
            "all ranks share this one GPU\n",
            w->name.c_str(), (*dev)->Describe().c_str(), w->total / *one / 1e9, w->total / *many / 1e9, d2h_streams);
        const Baseline cuda_base{"the pinned D2H peak", peak, nullptr};
        run_all("cuda", *w, (*dev)->data(), cuda_base, w->tps);
      }
      if (skipped.contains("cuda")) break;
    }
  }

  json j = {{"bench", "source_node_push_vs_baselines"},
            {"value", headline},
            {"baseline", headline_base},
            {"ratio", headline > 0 && headline_base > 0 ? headline / headline_base : 0.0},
            {"placement_value", headline_placed},
            {"placement_ratio", headline_placed > 0 && headline_base > 0 ? headline_placed / headline_base : 0.0},
            {"unit", "GB/s"},
            {"cases", cases_list},
            {"skipped", skipped},
            {"write_checksums", opt.write_checksums},
            {"memcpy_threads", opt.threads},
            {"copy_threads_per_rank",
             opt.copy_threads == 0 ? "auto (hardware threads / R, at most 8)" : std::to_string(opt.copy_threads)},
            {"copy_mode", opt.copy_mode},
            {"hardware_threads", std::thread::hardware_concurrency()},
            {"results", results}};
  if (!slow_line.empty()) {
    j["slow_target_ms"] = opt.slow_target_ms;
    j["slow_target_others_unslowed_gbps"] = slow_line["others_unslowed_gbps"];
    j["slow_target_others_slowed_gbps"] = slow_line["others_slowed_gbps"];
    j["slow_target_others_ratio"] = slow_line["others_ratio"];
    j["slow_target_worst_other_ratio"] = slow_line["worst_other_ratio"];
    j["slow_target_gbps"] = slow_line["slowed_target_gbps"];
    j["slow_target"] = slow_results;
  }
  if (!results_out.empty()) {
    if (curves.empty()) Die("--results-out", absl::FailedPreconditionError("no case measured a replica load"));
    if (machine.empty()) {
      const double mem = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE) / (1ull << 30);
      machine = absl::StrFormat("%u hardware threads, %.0f GiB memory%s", std::thread::hardware_concurrency(), mem,
                                d2h_peak > 0 ? ", one GPU (CUDA tensors)" : "");
    }
    std::vector<std::string> args(argv, argv + argc);
    json r = {{"machine", machine}, {"date", UtcNow()}, {"command", absl::StrJoin(args, " ")}};
    json c = json::object();
    for (auto& [name, curve] : curves) {
      std::sort(curve.gbps.begin(), curve.gbps.end());
      json a = json::array();
      for (const auto& [ranks_n, g] : curve.gbps) a.push_back({ranks_n, g});
      c[name] = {{"gbps", a}, {"tp", curve.tp}, {"source", "this run (results below)"}};
    }
    r["curves"] = c;
    if (d2h_peak > 0) r["d2h_gbps"] = d2h_peak;
    if (!dense_w.empty()) {
      r["dense_model"] = dense_w[0]->model_path;
      r["dense_bytes"] = dense_w[0]->total;
    }
    r["results"] = results;
    std::ofstream f(results_out);
    f << r.dump(2) << "\n";
    if (!f.good()) Die("writing " + results_out, absl::UnavailableError("write failed"));
    std::printf("node rates written to %s\n", results_out.c_str());
  }
  std::printf("%s\n", j.dump().c_str());
  return 0;
}
