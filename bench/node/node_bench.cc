// What one source node's data path moves: R trainer ranks push a node's share of host tensors (a dense model in
// bf16, Qwen3-8B by default) through their shared-memory rings into an in-process SourceNode, which validates each
// bucket, loads it into the replica (engine TP 1 and TP 8 layouts) and hands every completed parameter to the
// transport: a null one that accepts each write at once, so the figure is the node's own path. Each trainer thread
// works as the client library does (one bucket in flight, the next written while the daemon loads it; a bucket is
// half the ring; a tensor larger than that travels alone).
//
// Measured per (TP, R): the time from the first byte pushed to the last bucket's parameters handed to the transport
// (every required parameter complete: FinishUpdate checks it after the clock stops), as GB/s of tensor bytes, and
// the baseline from the same run: memcpy of the same bytes on every hardware thread (threads = cores, each its
// share), taken again between each case's updates (a case's ratio uses its own, best of its reps). Per rank a timeline:
// hand-over (the trainer's copies into the ring, waits for ring space included), lock wait (the bucket was in the ring,
// the node's locks were not yet taken), load (validate + claim + replica load), send (the transport's Post of what it
// completed). Last line: one JSON object; its value is the largest R's GB/s at the first TP.
// Every byte is copied twice on this path (host tensor → ring by the trainer, ring → replica by the node), so where
// memory bandwidth, not cores, limits the all-core memcpy, the ratio stays near 0.5; where cores limit it (one thread
// far below all of them), it shows how much of the machine the ranks and the node use together.
// --placement on|off|both (default both): with placement each rank copies the tensors the node offers straight into
// its mapping of the replica (one copy per byte, per layout that reads it; committed every half ring of bytes, as the
// client does) and the rest through its ring. Both runs per case, one after the other on the same node: the line
// says placement ÷ ring and each ÷ the all-core memcpy. The JSON's "value" stays the ring figure; "placement_value"
// is the placement one of the same case.
//
//   bench_node                                   # Qwen3-8B (36 layers, ~16 GB bf16), TP 1 and 8, R = 1,4,8
//   bench_node --layers 2 --vocab 32768 --ranks 1,2 --reps 2   # small enough for a 2-core box
//   bench_node --tp 1 --ranks 8 --write-checksums               # one case, with wsyncd's default hashing on
// Memory: the tensors once, the replica per case, R rings of --ring-mib (enlarged to fit the largest tensor).

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "client/ring/ring.h"
#include "daemon/common/convert.h"
#include "daemon/node/source_node.h"
#include "nlohmann/json.hpp"
#include "replica/model_config.h"
#include "replica/param_table.h"
#include "transport/transport.h"

namespace {

using wsync::DType;
using Clock = std::chrono::steady_clock;
namespace v1 = wsync::v1;
namespace transport = wsync::transport;

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

// One engine at TP `tp`: its ranks' layouts are the replica's tables for that parallelism (as a real engine reports).
v1::ConfigureSourceRequest Plan(const std::string& json, const wsync::replica::ModelConfig& cfg, int tp,
                                int64_t epoch) {
  v1::ConfigureSourceRequest req;
  req.set_model_config_json(json);
  req.set_plan_epoch(epoch);
  for (int r = 0; r < tp; ++r) {
    const auto rp = wsync::replica::RankParallelism::ForTp(tp, r);
    auto table = wsync::replica::BuildParamTable(cfg, rp, wsync::replica::QuantSpec());
    if (!table.ok()) Die("param table", table.status());
    auto* t = req.add_targets();
    t->set_engine_id("e0");
    t->set_rank(r);
    t->set_target_daemon("null:1");
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
    seg->set_kind("host");
    seg->set_bytes(std::max<uint64_t>(table->total_bytes(), 1));
    seg->set_region_descriptor(std::to_string(seg->bytes()));
    l->set_region_bytes(seg->bytes());
  }
  return req;
}

struct HostTensor {
  wsync::replica::TensorSpec spec;
  const uint8_t* data = nullptr;
};

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
  double handover = 0;  // copies into the ring, waits for ring space included
  double end = 0;       // its last bucket's parameters were handed to the transport
  uint64_t bytes = 0;
  uint64_t placed_bytes = 0;  // of `bytes`, copied straight into the replica
  double commit_placed = 0;   // CommitPlaced calls (claim, arrival counting, posting)
  std::vector<wsync::daemon::BucketTiming> buckets;
};

// One rank's push of update `version`, as the client library does it.
absl::Status PushRank(wsync::daemon::SourceNode& node, const std::string& session, wsync::RingProducer& ring,
                      const ReplicaMap* replica, int64_t version, const std::map<std::string, HostTensor>& tensors,
                      RankLog* log, Clock::time_point t0) {
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
  auto commit_placed = [&]() -> absl::Status {
    if (placed.empty()) return absl::OkStatus();
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
    WSYNC_ASSIGN_OR_RETURN(uint64_t seq, ring.CommitBucket());
    in_flight = std::async(std::launch::async, [&node, &session, seq]() -> absl::Status {
      v1::CommitBucketRequest cb;
      cb.set_session_id(session);
      cb.set_bucket_seq(seq);
      return node.CommitBucket(cb).status();
    });
    return absl::OkStatus();
  };
  for (const std::string& name : names.tensor_names()) {
    const HostTensor& t = tensors.at(name);
    const uint64_t bytes = t.spec.bytes();
    if (auto o = offers.find(name); o != offers.end()) {
      // The client's host placement: a memcpy per region (per row where the region is strided).
      const auto h0 = Clock::now();
      for (const auto& r : o->second->regions()) {
        uint8_t* dst = replica->layouts[r.layout()].first + r.offset();
        if (r.pitch() == r.row_bytes() && r.src_pitch() == r.row_bytes()) {
          std::memcpy(dst, t.data + r.src_offset(), r.row_bytes() * static_cast<uint64_t>(r.rows()));
        } else {
          for (int64_t i = 0; i < r.rows(); ++i)
            std::memcpy(dst + i * r.pitch(), t.data + r.src_offset() + i * r.src_pitch(), r.row_bytes());
        }
      }
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
    WSYNC_ASSIGN_OR_RETURN(uint8_t * dst,
                           ring.BeginTensor(name, t.spec.dtype, t.spec.shape, bytes, absl::Seconds(120)));
    std::memcpy(dst, t.data, bytes);
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
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(std::stoi(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "bench_node: trainer ranks pushing host tensors through one source node (in-process, null transport) "
      "vs all-core memcpy of the same bytes"};
  std::string model = std::string(WSYNC_MODELS_DIR) + "/Qwen__Qwen3-8B/config.json";
  std::string ranks_list = "1,4,8", tp_list = "1,8";
  int layers = 0, vocab = 0, reps = 3, ring_mib = 512;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  bool write_checksums = false, timeline = true;
  std::string placement = "both";
  app.add_option("--model", model, "a dense model's config.json (bf16)")->capture_default_str();
  app.add_option("--ranks", ranks_list, "trainer ranks R, comma-separated")->capture_default_str();
  app.add_option("--tp", tp_list, "engine tensor-parallel sizes (one engine, all its ranks written by this node)")
      ->capture_default_str();
  app.add_option("--layers", layers, "override num_hidden_layers (0: the model's) to size the push down")
      ->check(CLI::Range(0, 1000));
  app.add_option("--vocab", vocab, "override vocab_size (0: the model's)")->check(CLI::Range(0, 1 << 22));
  app.add_option("--reps", reps, "updates per case; the best counts")->check(CLI::Range(1, 100))->capture_default_str();
  app.add_option("--ring-mib", ring_mib, "ring per rank, MiB (wsyncd --ring-mib; enlarged to fit the largest tensor)")
      ->check(CLI::Range(8, 1 << 16))
      ->capture_default_str();
  app.add_option("--threads", threads, "memcpy baseline threads")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_flag("--write-checksums", write_checksums,
               "hash what is written on the node's hash pool (wsyncd's default; off here: the data path alone)");
  app.add_option("--placement", placement,
                 "zero-copy placement: on, off, or both (each case run both ways, placement ÷ ring reported)")
      ->check(CLI::IsMember({"on", "off", "both"}))
      ->capture_default_str();
  app.add_flag("--timeline,!--no-timeline", timeline, "print the per-rank timeline of each case's best update");
  CLI11_PARSE(app, argc, argv);

  std::ifstream f(model);
  if (!f.good()) Die("reading " + model, absl::NotFoundError("no such file"));
  nlohmann::json cj = nlohmann::json::parse(f);
  if (layers > 0) cj["num_hidden_layers"] = layers, cj["max_window_layers"] = layers;
  if (vocab > 0) cj["vocab_size"] = vocab;
  const std::string json = cj.dump();
  auto cfg = wsync::replica::ModelConfig::FromJson(json);
  if (!cfg.ok()) Die("model config", cfg.status());
  auto specs = wsync::replica::CheckpointTensors(*cfg);
  if (!specs.ok()) Die("checkpoint tensors", specs.status());

  // The trainer's host tensors, once: one buffer, every page written (so neither side pays first-touch faults).
  uint64_t total = 0, largest = 0;
  for (const auto& s : *specs) total += s.bytes(), largest = std::max(largest, s.bytes());
  std::vector<uint8_t> host(total), scratch(total);
  for (uint64_t i = 0; i < total; i += 8) {
    const uint64_t v = (i * 0x9E3779B97F4A7C15ull) >> 3;
    std::memcpy(&host[i], &v, std::min<uint64_t>(8, total - i));
  }
  std::memset(scratch.data(), 1, total);
  std::map<std::string, HostTensor> tensors;
  uint64_t at = 0;
  for (const auto& s : *specs) {
    tensors[s.name] = {s, host.data() + at};
    at += s.bytes();
  }
  const uint64_t ring_bytes =
      std::max<uint64_t>(static_cast<uint64_t>(ring_mib) << 20, (largest + (64ull << 20)) / (1 << 20) * (1 << 20));

  double copy_s = 1e30;
  for (int i = 0; i < std::max(reps, 3); ++i)
    copy_s = std::min(copy_s, ParallelCopy(scratch.data(), host.data(), total, threads));
  const double copy_gbps = total / copy_s / 1e9;
  double copy1_s = ParallelCopy(scratch.data(), host.data(), total, 1);
  std::printf(
      "model %s: %lld layers, vocab %lld, %zu tensors, %.2f GB bf16; ring %llu MiB per rank; write checksums "
      "%s; hardware threads %u\n",
      model.c_str(), static_cast<long long>(cfg->num_layers), static_cast<long long>(cfg->vocab_size), specs->size(),
      total / 1e9, static_cast<unsigned long long>(ring_bytes >> 20), write_checksums ? "on" : "off",
      std::thread::hardware_concurrency());
  std::printf("baseline: memcpy of the same bytes on %d threads: %.2f GB/s (1 thread: %.2f GB/s)\n", threads, copy_gbps,
              total / copy1_s / 1e9);

  nlohmann::ordered_json results = nlohmann::ordered_json::array();
  double headline = 0, headline_copy = copy_gbps, headline_placed = 0, headline_placed_copy = copy_gbps;
  int64_t epoch = 0, version = 0;
  for (int tp : ParseList(tp_list)) {
    for (int R : ParseList(ranks_list)) {
      NullTransport null_transport;
      wsync::daemon::SourceOptions o;
      o.node_id = "bench";
      o.trainer_ranks = R;
      o.ring_bytes = ring_bytes;
      o.write_checksums = write_checksums;
      o.push_timeout = absl::Seconds(600);
      std::mutex log_mu;
      std::vector<RankLog> logs(R);
      o.bucket_observer = [&](const wsync::daemon::BucketTiming& b) {
        std::lock_guard<std::mutex> l(log_mu);
        logs[b.local_rank].buckets.push_back(b);
      };
      wsync::daemon::SourceNode node(
          o, &null_transport,
          [](const std::string&, const v1::ConnectTargetRequest&) -> absl::StatusOr<std::string> { return "null"; });
      const v1::ConfigureSourceRequest plan = Plan(json, *cfg, tp, ++epoch);
      if (auto c = node.Configure(plan); !c.ok()) Die("configure", c.status());
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
      for (int r = 0; r < R && placement != "off"; ++r) {
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
      std::vector<bool> modes;
      if (placement != "on") modes.push_back(false);
      if (placement != "off") modes.push_back(true);
      double ring_gbps = 0;
      for (const bool place : modes) {
        double best = 1e30, case_copy_s = 1e30;
        std::vector<RankLog> best_logs;
        Clock::time_point best_t0;
        for (int rep = 1; rep <= reps; ++rep) {
          const int64_t v = ++version;
          for (auto& l : logs) l = RankLog();
          v1::StartUpdateRequest su;
          su.set_version(v);
          su.set_plan_epoch(epoch);
          su.set_no_placement(!place);
          if (auto st = node.StartUpdate(su); !st.ok()) Die("start update", st);
          // The baseline again between this case's updates, so both figures of a ratio see the same machine (on a
          // shared machine the memory bandwidth left over varies from minute to minute).
          case_copy_s = std::min(case_copy_s, ParallelCopy(scratch.data(), host.data(), total, threads));
          std::vector<std::future<absl::Status>> pushes;
          const auto t0 = Clock::now();
          for (int r = 0; r < R; ++r)
            pushes.push_back(std::async(std::launch::async, [&, r] {
              return PushRank(node, sessions[r], *producers[r], place ? maps[r].get() : nullptr, v, tensors, &logs[r],
                              t0);
            }));
          for (auto& p : pushes)
            if (auto st = p.get(); !st.ok()) Die("push", st);
          double s = 0;
          for (const auto& l : logs) s = std::max(s, l.end);
          v1::FinishUpdateRequest fu;
          fu.set_version(v);
          fu.set_plan_epoch(epoch);
          fu.set_timeout_seconds(600);
          auto fin = node.FinishUpdate(fu);  // every required parameter was completed and posted, or this fails
          if (!fin.ok()) Die("finish update", fin.status());
          if (s < best) {
            best = s;
            std::lock_guard<std::mutex> l(log_mu);
            best_logs = logs;
            best_t0 = t0;
          }
        }
        const double gbps = total / best / 1e9, case_copy_gbps = total / case_copy_s / 1e9;
        uint64_t placed_bytes = 0;
        for (const auto& l : best_logs) placed_bytes += l.placed_bytes;
        const bool headline_case = tp == ParseList(tp_list).front() && R == ParseList(ranks_list).back();
        if (headline_case && !place) headline = gbps, headline_copy = case_copy_gbps;
        if (headline_case && place) headline_placed = gbps, headline_placed_copy = case_copy_gbps;
        if (!place) ring_gbps = gbps;
        std::printf(
            "TP %d, R %d, %s: %.2f GB in %.3f s = %.2f GB/s, %.2fx the all-core memcpy (%.2f GB/s, between its "
            "updates)",
            tp, R, place ? "placement" : "ring", total / 1e9, best, gbps, gbps / case_copy_gbps, case_copy_gbps);
        if (place)
          std::printf("; %.0f%% of the bytes placed%s", 100.0 * placed_bytes / total,
                      ring_gbps > 0
                          ? absl::StrCat(", placement / ring ", absl::StrFormat("%.2f", gbps / ring_gbps)).c_str()
                          : "");
        std::printf("\n");
        nlohmann::ordered_json ranks_json = nlohmann::ordered_json::array();
        for (int r = 0; r < R; ++r) {
          const RankLog& l = best_logs[r];
          double wait = 0, load = 0, send = 0;
          for (const auto& b : l.buckets) {
            wait += absl::ToDoubleSeconds(b.begin - b.got);
            load += absl::ToDoubleSeconds(b.loaded - b.begin);
            send += absl::ToDoubleSeconds(b.posted - b.loaded);
          }
          if (timeline)
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
        results.push_back({{"tp", tp},
                           {"ranks", R},
                           {"placement", place},
                           {"gbps", gbps},
                           {"ratio", gbps / case_copy_gbps},
                           {"memcpy_gbps", case_copy_gbps},
                           {"placed_bytes", placed_bytes},
                           {"placement_over_ring", place && ring_gbps > 0 ? gbps / ring_gbps : 0.0},
                           {"seconds", best},
                           {"per_rank", ranks_json}});
      }
    }
  }
  nlohmann::ordered_json j = {
      {"bench", "source_node_push_host_tensors_vs_all_core_memcpy"},
      {"value", headline},
      {"baseline", headline_copy},
      {"ratio", headline > 0 ? headline / headline_copy : 0.0},
      {"placement_value", headline_placed},
      {"placement_ratio", headline_placed > 0 ? headline_placed / headline_placed_copy : 0.0},
      {"placement_over_ring", headline > 0 && headline_placed > 0 ? headline_placed / headline : 0.0},
      {"unit", "GB/s"},
      {"model", model},
      {"layers", cfg->num_layers},
      {"bytes", total},
      {"write_checksums", write_checksums},
      {"memcpy_threads", threads},
      {"hardware_threads", std::thread::hardware_concurrency()},
      {"results", results}};
  std::printf("%s\n", j.dump().c_str());
  return 0;
}
