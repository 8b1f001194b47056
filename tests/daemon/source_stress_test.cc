// A source's data path under eight trainer ranks pushing at once, driven in-process: a real SourceNode with the
// tiny Qwen3 model's replica, eight sessions each pushing through its own real ring from its own thread, three
// engine ranks (engine "a" at TP 1, engine "b" at TP 2) whose memory a copy transport fills at each Post. The ranks'
// shares interleave: q/k/v (fused into one qkv_proj) and gate/up come from different ranks, the embedding arrives as
// eight row slices (one per rank) and a down_proj as four column slices, so ranks write different parts of the same
// engine parameters concurrently. The expectation is independent: the reference engine's own loader
// (tools/testing/engine_ref) computes every byte each engine rank must hold after each update, from the same
// generated checkpoint. A tensor refused (a wrong shape, an overlapping slice) must leave every parameter reading
// it untouched in every engine. And a bucket held inside the data path holds up neither another rank's bucket nor a
// session hand-over (with a node-wide ingest lock both would wait for it).
// Zero-copy placement: ranks copy the tensors the daemon offers straight into the replica's memfd-backed layout
// buffers (mapped here as a trainer maps them) and commit them with CommitPlaced, alone or mixed with ring pushes
// in one update; the same reference bytes must come out. Commits the daemon must refuse (a tensor offered to another
// rank, one never offered, a second commit, another update's, a stale replica) fail the update, name the tensor and
// leave every parameter reading it unwritten in every engine.

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/tensor_slice.h"
#include "client/ring/ring.h"
#include "client/trainer_client.h"
#include "daemon/common/convert.h"
#include "daemon/common/serve.h"
#include "daemon/node/node_services.h"
#include "daemon/node/source_node.h"
#include "daemon/node/trainer_socket.h"
#include "replica/model_config.h"
#include "replica/param_table.h"
#include "tests/daemon/null_source.h"
#include "tools/testdata/weight_gen.h"
#include "tools/testing/engine_ref/ref_model.h"
#include "transport/fault/fault_transport.h"
#include "transport/transport.h"

namespace wsync::daemon {
namespace {

using HostLocal = testing::NullLocalRegion;
using testing::EngineMemory;

// Copies every write at Post: what the replica held when the parameter was handed over is what the engine gets, so
// a parameter posted before all its parts were loaded shows up as wrong bytes.
class CopyEndpoint : public transport::Endpoint {
 public:
  using Hook = std::function<void(const EngineMemory*)>;
  CopyEndpoint(std::atomic<uint64_t>* posts, const Hook* on_post) : posts_(posts), on_post_(on_post) {}
  std::string LocalInfo() const override { return "copy"; }
  absl::Status Connect(const std::string&, absl::Duration) override { return absl::OkStatus(); }
  absl::StatusOr<transport::BatchId> Post(absl::Span<const transport::WriteRequest> writes) override {
    // The transport contract: one thread at a time per endpoint. A second one inside Post is the source's bug.
    if (in_post_.exchange(true)) return absl::InternalError("two threads in Post of one endpoint");
    if (*on_post_ && !writes.empty()) (*on_post_)(static_cast<const EngineMemory*>(writes[0].dst));
    for (const auto& w : writes) {
      if (auto st = transport::ValidateWrite(w); !st.ok()) {
        in_post_ = false;
        return st;
      }
      auto* dst = static_cast<const EngineMemory*>(w.dst);
      std::memcpy(dst->bytes.data() + w.dst_offset, static_cast<const uint8_t*>(w.src->addr()) + w.src_offset,
                  w.length);
    }
    in_post_ = false;
    ++*posts_;
    return ++next_;
  }
  absl::Status Wait(transport::BatchId, absl::Duration) override { return absl::OkStatus(); }
  std::string PeerName() const override { return "copy peer"; }

 private:
  std::atomic<bool> in_post_{false};
  std::atomic<uint64_t>* posts_;
  const Hook* on_post_;
  transport::BatchId next_ = 0;
};

// Imports regions in plan order: engines[i] is the i-th target's (one segment each).
class CopyTransport : public transport::Transport {
 public:
  std::vector<const EngineMemory*> engines;
  std::atomic<uint64_t> posts{0};  // batches that reached an engine's memory
  CopyEndpoint::Hook on_post;       // runs inside every Post, with the engine memory it writes (set before pushes)
  std::string name() const override { return "copy"; }
  bool viable() const override { return true; }
  std::string reason() const override { return ""; }
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return std::make_unique<HostLocal>(addr, len);
  }
  absl::StatusOr<std::unique_ptr<transport::RemoteRegion>> ImportRegion(const std::string& d) override {
    auto m = std::make_unique<EngineMemory>(std::stoull(d));
    engines.push_back(m.get());
    return m;
  }
  absl::StatusOr<std::unique_ptr<transport::Endpoint>> CreateEndpoint() override {
    return std::make_unique<CopyEndpoint>(&posts, &on_post);
  }
};

// Forwards to a transport it does not own (the harness's CopyTransport), so that the fault decorator, which owns
// what it wraps, can wrap it.
class Borrowed : public transport::Transport {
 public:
  explicit Borrowed(transport::Transport* t) : t_(t) {}
  std::string name() const override { return t_->name(); }
  bool viable() const override { return t_->viable(); }
  std::string reason() const override { return t_->reason(); }
  absl::StatusOr<std::unique_ptr<transport::LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    return t_->RegisterMemory(addr, len);
  }
  absl::StatusOr<std::unique_ptr<transport::RemoteRegion>> ImportRegion(const std::string& d) override {
    return t_->ImportRegion(d);
  }
  absl::StatusOr<std::unique_ptr<transport::Endpoint>> CreateEndpoint() override { return t_->CreateEndpoint(); }

 private:
  transport::Transport* t_;
};

constexpr int64_t kPlan = 5;
constexpr int kRanks = 8;
constexpr const char* kEmbed = "model.embed_tokens.weight";
constexpr const char* kDown = "model.layers.0.mlp.down_proj.weight";  // four column slices (ranks 0-3)
constexpr const char* kBadK = "model.layers.1.self_attn.k_proj.weight";

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  REQUIRE(f.good());
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// bfloat16 values widened to float32, exactly (the replica narrows them back to the same bits).
std::vector<uint8_t> Bf16ToF32(const std::vector<uint8_t>& in) {
  std::vector<uint8_t> out(in.size() * 2);
  for (size_t i = 0; i < in.size() / 2; ++i) {
    uint16_t h;
    std::memcpy(&h, in.data() + 2 * i, 2);
    const uint32_t f = static_cast<uint32_t>(h) << 16;
    std::memcpy(out.data() + 4 * i, &f, 4);
  }
  return out;
}

// One frame a rank pushes: a whole tensor or a slice of one.
struct Frame {
  std::string name;  // the frame name (slices: EncodeSliceName)
  std::string tensor;
  std::vector<int64_t> shape;    // the frame's (a slice's extents)
  std::vector<int64_t> offsets;  // slices only
  DType dtype = DType::kInvalid;  // pushed as (kInvalid: the checkpoint's); float32 for a bfloat16 tensor converts
};

struct Engine {
  int tp = 1, rank = 0;
  replica::ParamTable table;  // the layout the engine reports (and the source writes)
};

struct Harness {
  CopyTransport transport;
  std::unique_ptr<transport::Transport> faulty;  // the fault decorator around `transport`, when faults are asked
  std::unique_ptr<SourceNode> node;
  std::string json;
  std::unique_ptr<replica::ModelConfig> cfg;
  std::map<std::string, replica::TensorSpec> specs;
  std::vector<Engine> engines;  // in plan order
  std::vector<std::string> sessions;
  std::vector<ScopedFd> fds;
  std::vector<std::vector<Frame>> frames;  // per rank, in push order

  std::atomic<int> placed{0};  // tensors committed with CommitPlaced (accepted)

  // `slices`: the embedding and one down_proj arrive as slices (else whole, like every other tensor).
  explicit Harness(std::function<void(const BucketTiming&)> observer = nullptr, bool slices = true,
                   transport::FaultSpec faults = {}) {
    json = ReadFile(WSYNC_TINY_MODEL);
    auto c = replica::ModelConfig::FromJson(json);
    REQUIRE(c.ok());
    cfg = std::make_unique<replica::ModelConfig>(*c);
    auto all = replica::CheckpointTensors(*cfg);
    REQUIRE(all.ok());
    for (const auto& t : *all) specs[t.name] = t;

    v1::ConfigureSourceRequest req;
    req.set_model_config_json(json);
    req.set_plan_epoch(kPlan);
    const std::vector<std::pair<std::string, int>> engine_tp = {{"a", 1}, {"b", 2}};
    for (const auto& [id, tp] : engine_tp) {
      for (int r = 0; r < tp; ++r) {
        const auto rp = replica::RankParallelism::ForTp(tp, r);
        auto table = replica::BuildParamTable(*cfg, rp, replica::QuantSpec());
        REQUIRE(table.ok());
        auto* t = req.add_targets();
        t->set_engine_id(id);
        t->set_rank(r);
        t->set_target_daemon("nowhere:1");
        t->set_engine_kind("reference");
        auto* l = t->mutable_layout();
        *l->mutable_parallelism() = ToProto(rp);
        for (const auto& p : table->params()) {
          auto* d = l->add_params();
          d->set_name(p.name);
          d->set_dtype(std::string(DTypeName(p.dtype)));
          for (int64_t s : p.shape) d->add_shape(s);
          d->set_bytes(p.bytes);
          d->set_offset(p.offset);
          d->set_segment(0);
        }
        auto* seg = l->add_segments();
        seg->set_id(0);
        seg->set_kind("host");
        seg->set_bytes(table->total_bytes());
        seg->set_region_descriptor(std::to_string(seg->bytes()));
        l->set_region_bytes(seg->bytes());
        engines.push_back({tp, r, *std::move(table)});
      }
    }

    // The push: the embedding in eight row slices (one per rank), the down_proj in four column slices (ranks 0-3),
    // every other tensor whole, round-robin (so q/k/v and gate/up of a layer come from different ranks).
    frames.resize(kRanks);
    std::vector<v1::RankPushFilter*> filters;
    for (int r = 0; r < kRanks; ++r) {
      auto* f = req.add_push_filters();
      f->set_local_rank(r);
      filters.push_back(f);
    }
    auto add_slice = [&](int rank, const std::string& name, std::vector<int64_t> offsets, std::vector<int64_t> ext) {
      const auto& full = specs.at(name).shape;
      auto* sp = filters[rank]->add_slices();
      sp->set_name(name);
      for (int64_t d : full) sp->add_shape(d);
      for (int64_t o : offsets) sp->add_offsets(o);
      for (int64_t e : ext) sp->add_extents(e);
      frames[rank].push_back({EncodeSliceName(name, full, offsets), name, ext, offsets});
    };
    const auto& emb = specs.at(kEmbed).shape;
    for (int r = 0; r < kRanks && slices; ++r) {
      const int64_t r0 = emb[0] * r / kRanks, r1 = emb[0] * (r + 1) / kRanks;
      add_slice(r, kEmbed, {r0, 0}, {r1 - r0, emb[1]});
    }
    const auto& down = specs.at(kDown).shape;
    for (int r = 0; r < 4 && slices; ++r) {
      const int64_t c0 = down[1] * r / 4, c1 = down[1] * (r + 1) / 4;
      add_slice(r, kDown, {0, c0}, {down[0], c1 - c0});
    }
    int i = 0;
    for (const auto& t : *all) {
      if (slices && (t.name == kEmbed || t.name == kDown)) continue;
      const int r = i++ % kRanks;
      filters[r]->add_tensor_names(t.name);
      frames[r].push_back({t.name, t.name, t.shape, {}});
    }

    SourceOptions o;
    o.node_id = "src";
    o.trainer_ranks = kRanks;
    o.ring_bytes = 4 << 20;
    o.push_timeout = absl::Seconds(30);
    o.write_checksum_threads = 2;
    o.bucket_observer = std::move(observer);
    if (!faults.empty()) faulty = transport::WrapWithFaults(std::make_unique<Borrowed>(&transport), faults);
    node = std::make_unique<SourceNode>(
        o, faulty ? faulty.get() : &transport,
        [](const std::string&, const v1::ConnectTargetRequest&) -> absl::StatusOr<std::string> {
          return std::string("copy");
        });
    auto cr = node->Configure(req);
    INFO(cr.status().ToString());
    REQUIRE(cr.ok());
    REQUIRE(transport.engines.size() == engines.size());
    for (int r = 0; r < kRanks; ++r) {
      SessionRequest sr;
      sr.local_rank = r;
      auto s = node->OpenSession(sr);
      REQUIRE(s.ok());
      sessions.push_back(s->id);
      fds.push_back(std::move(s->ring_fd));
    }
  }

  // The full tensor of checkpoint `step`, as the reference engine generates it.
  std::vector<uint8_t> Tensor(const std::string& name, int64_t step) const {
    const auto& s = specs.at(name);
    std::vector<uint8_t> out(s.bytes());
    tools::GenerateTensor(name, step, s.dtype, s.bytes() / DTypeSize(s.dtype), out.data());
    return out;
  }

  // What a rank's frame carries in update `step` (a slice's rectangle cut from the full tensor).
  std::vector<uint8_t> FrameData(const Frame& f, int64_t step) const {
    std::vector<uint8_t> full = Tensor(f.tensor, step);
    if (f.offsets.empty()) return full;
    const auto& shape = specs.at(f.tensor).shape;
    const size_t es = DTypeSize(specs.at(f.tensor).dtype);
    const size_t row = static_cast<size_t>(f.shape[1]) * es;
    std::vector<uint8_t> out(static_cast<size_t>(f.shape[0]) * row);
    for (int64_t r = 0; r < f.shape[0]; ++r)
      std::memcpy(out.data() + r * row, full.data() + ((f.offsets[0] + r) * shape[1] + f.offsets[1]) * es, row);
    return out;
  }

  // One bucket of rank `rank` holding the whole tensors `names` of checkpoint `step`, committed from this thread.
  absl::StatusOr<v1::CommitBucketReply> Bucket(int rank, const std::vector<std::string>& names, int64_t step) {
    auto prod = RingProducer::Attach(fds[rank].get());
    if (!prod.ok()) return prod.status();
    for (const auto& n : names) {
      const std::vector<uint8_t> data = Tensor(n, step);
      auto dst = prod->BeginTensor(n, specs.at(n).dtype, specs.at(n).shape, data.size(), absl::Seconds(5));
      if (!dst.ok()) return dst.status();
      std::memcpy(*dst, data.data(), data.size());
      if (auto st = prod->FinishTensor(); !st.ok()) return st;
    }
    auto seq = prod->CommitBucket();
    if (!seq.ok()) return seq.status();
    v1::CommitBucketRequest cb;
    cb.set_session_id(sessions[rank]);
    cb.set_bucket_seq(*seq);
    return node->CommitBucket(cb);
  }

  absl::Status Start(int64_t v, bool no_placement = false) {
    v1::StartUpdateRequest r;
    r.set_version(v);
    r.set_plan_epoch(kPlan);
    r.set_no_placement(no_placement);
    return node->StartUpdate(r);
  }

  // The replica's layout buffers as a trainer rank maps them (its own MAP_SHARED mapping of the daemon's memfds).
  struct Mapping {
    uint64_t generation = 0;
    std::vector<std::pair<uint8_t*, uint64_t>> layouts;
    Mapping() = default;
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping() {
      for (auto& [a, n] : layouts) munmap(a, n);
    }
  };
  // (No REQUIREs: called from the ranks' threads.)
  absl::StatusOr<std::unique_ptr<Mapping>> Map(int rank) {
    auto h = node->ReplicaFds(sessions[rank]);
    if (!h.ok()) return h.status();
    auto m = std::make_unique<Mapping>();
    m->generation = h->generation;
    for (size_t i = 0; i < h->fds.size(); ++i) {
      void* a = mmap(nullptr, h->bytes[i], PROT_READ | PROT_WRITE, MAP_SHARED, h->fds[i].get(), 0);
      if (a == MAP_FAILED) return absl::InternalError("mmap of a replica layout failed");
      m->layouts.push_back({static_cast<uint8_t*>(a), h->bytes[i]});
    }
    return m;
  }
  // Copies `data` into the regions `p` offers, as the client does.
  static absl::Status Place(const Mapping& m, const v1::TensorPlacement& p, const std::vector<uint8_t>& data) {
    for (const auto& r : p.regions()) {
      if (static_cast<size_t>(r.layout()) >= m.layouts.size() ||
          r.offset() + (r.rows() - 1) * r.pitch() + r.row_bytes() > m.layouts[r.layout()].second ||
          r.src_offset() + (r.rows() - 1) * r.src_pitch() + r.row_bytes() > data.size())
        return absl::InternalError(absl::StrCat("region of ", p.name(), " outside the replica or the tensor"));
      for (int64_t i = 0; i < r.rows(); ++i)
        std::memcpy(m.layouts[r.layout()].first + r.offset() + i * r.pitch(),
                    data.data() + r.src_offset() + i * r.src_pitch(), r.row_bytes());
    }
    return absl::OkStatus();
  }
  absl::StatusOr<v1::CommitPlacedReply> CommitPlaced(int rank, int64_t version, uint64_t generation,
                                                     const std::vector<std::string>& names) {
    v1::CommitPlacedRequest req;
    req.set_session_id(sessions[rank]);
    req.set_version(version);
    req.set_replica_generation(generation);
    for (const auto& n : names) req.add_names(n);
    return node->CommitPlaced(req);
  }
  absl::StatusOr<v1::FinishUpdateReply> Finish(int64_t v) {
    v1::FinishUpdateRequest r;
    r.set_version(v);
    r.set_plan_epoch(kPlan);
    r.set_timeout_seconds(60);
    return node->FinishUpdate(r);
  }

  // Every rank pushes its frames of checkpoint `step` as update `step`, from its own thread, all released at once;
  // buckets of three frames, each committed from the rank's thread. `mutate(rank, frame)` may change a frame's shape
  // or offsets (the data stays the frame's bytes). Returns every CommitBucket error, by rank.
  // Ranks whose bit is set in `placing` copy every frame the daemon offers for placement straight into the replica
  // and commit those with CommitPlaced at the same bucket boundaries.
  std::map<int, std::vector<absl::Status>> PushAll(int64_t step,
                                                   const std::function<void(int, Frame*)>& mutate = nullptr,
                                                   uint32_t placing = 0) {
    std::mutex mu;
    std::condition_variable cv;
    int ready = 0;
    std::map<int, std::vector<absl::Status>> errors;
    std::vector<std::thread> threads;
    std::atomic<int> failures{0};
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        auto fail = [&](const absl::Status& st) {
          std::lock_guard<std::mutex> l(mu);
          errors[r].push_back(st);
          ++failures;
        };
        // Frames prepared before the start, so the ranks' commits overlap as much as they can.
        std::vector<Frame> mine = frames[r];
        std::vector<std::vector<uint8_t>> data;
        for (auto& f : mine) {
          data.push_back(FrameData(f, step));
          if (mutate) mutate(r, &f);
          if (f.dtype == DType::kF32 && specs.at(f.tensor).dtype == DType::kBF16) data.back() = Bf16ToF32(data.back());
        }
        v1::BeginPushRequest bp;
        bp.set_session_id(sessions[r]);
        bp.set_version(step);
        auto names = node->BeginPush(bp);
        if (!names.ok()) return fail(names.status());
        auto prod = RingProducer::Attach(fds[r].get());
        if (!prod.ok()) return fail(prod.status());
        std::map<std::string, v1::TensorPlacement> offers;
        if (placing & (1u << r))
          for (const auto& p : names->placements()) offers[p.name()] = p;
        {
          std::unique_lock<std::mutex> l(mu);
          ++ready;
          cv.notify_all();
          cv.wait(l, [&] { return ready == kRanks; });
        }
        std::unique_ptr<Mapping> mapping;
        if (!offers.empty()) {
          auto m = Map(r);
          if (!m.ok()) return fail(m.status());
          mapping = *std::move(m);
        }
        std::vector<std::string> pending;
        int in_bucket = 0;
        for (size_t i = 0; i < mine.size(); ++i) {
          const Frame& f = mine[i];
          auto offer = offers.find(f.name);
          if (offer != offers.end()) {
            if (auto st = Place(*mapping, offer->second, data[i]); !st.ok()) return fail(st);
            pending.push_back(f.name);
          } else {
            const DType dt = f.dtype == DType::kInvalid ? specs.at(f.tensor).dtype : f.dtype;
            auto dst = prod->BeginTensor(f.name, dt, f.shape, data[i].size(), absl::Seconds(10));
            if (!dst.ok()) return fail(dst.status());
            std::memcpy(*dst, data[i].data(), data[i].size());
            if (auto st = prod->FinishTensor(); !st.ok()) return fail(st);
            ++in_bucket;
          }
          if (i % 3 != 2 && i + 1 != mine.size()) continue;
          if (!pending.empty()) {
            auto c = CommitPlaced(r, step, names->replica_generation(), pending);
            if (c.ok()) placed += static_cast<int>(pending.size());
            if (!c.ok()) fail(c.status());
            pending.clear();
          }
          if (in_bucket == 0) continue;
          in_bucket = 0;
          auto seq = prod->CommitBucket();
          if (!seq.ok()) return fail(seq.status());
          v1::CommitBucketRequest cb;
          cb.set_session_id(sessions[r]);
          cb.set_bucket_seq(*seq);
          if (auto c = node->CommitBucket(cb); !c.ok()) fail(c.status());
        }
        v1::EndPushRequest ep;
        ep.set_session_id(sessions[r]);
        ep.set_version(step);
        if (auto st = node->EndPush(ep); !st.ok()) fail(st);
      });
    }
    for (auto& t : threads) t.join();
    return errors;
  }

  size_t NumParams() const {
    size_t n = 0;
    for (const auto& e : engines) n += e.table.params().size();
    return n;
  }

  // Per engine rank: the parameters whose bytes differ from what the reference engine's loader computes for
  // checkpoint `step`.
  std::vector<std::string> Mismatches(int64_t step) const {
    auto rc = engine_ref::ParseRefConfig(json);
    REQUIRE(rc.ok());
    std::vector<std::string> bad;
    for (size_t e = 0; e < engines.size(); ++e) {
      const Engine& en = engines[e];
      auto layout = engine_ref::BuildRefLayout(*rc, en.tp, en.rank);
      REQUIRE(layout.ok());
      std::vector<uint8_t> expected(layout->total_bytes);
      REQUIRE(engine_ref::ComputeExpected(*rc, en.tp, en.rank, *layout, step, expected.data()).ok());
      REQUIRE(layout->params.size() == en.table.params().size());
      for (const auto& rp : layout->params) {
        const replica::EngineParam* p = en.table.Find(rp.name);
        REQUIRE(p != nullptr);
        REQUIRE(p->bytes == rp.bytes);
        if (std::memcmp(transport.engines[e]->bytes.data() + p->offset, expected.data() + rp.offset, rp.bytes) != 0)
          bad.push_back(absl::StrCat("tp", en.tp, "/", en.rank, ":", rp.name));
      }
    }
    return bad;
  }
};

std::string Join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += s + " ";
  return out;
}

std::string Errors(const std::map<int, std::vector<absl::Status>>& e) {
  std::string out;
  for (const auto& [r, list] : e)
    for (const auto& s : list) out += absl::StrCat("rank ", r, ": ", s.ToString(), "\n");
  return out;
}

// One whole update through every rank at once, then every engine rank's bytes against the reference loader.
void UpdateAndCheck(Harness& h, int64_t step) {
  REQUIRE(h.Start(step).ok());
  const auto errors = h.PushAll(step);
  INFO(Errors(errors));
  REQUIRE(errors.empty());
  auto fin = h.Finish(step);
  INFO(fin.status().ToString());
  REQUIRE(fin.ok());
  const auto bad = h.Mismatches(step);
  INFO(Join(bad));
  CHECK(bad.empty());
}

TEST_CASE("source under eight concurrent ranks: every byte of every engine rank matches the reference loader") {
  Harness h;
  for (int64_t step = 1; step <= 3; ++step) {
    INFO("update " << step);
    UpdateAndCheck(h, step);
  }
  // Every update's bytes differ from the last one's (else the checks could not tell an update that wrote nothing).
  CHECK(h.Mismatches(2).size() == h.NumParams());
}

TEST_CASE("source under eight concurrent ranks: a refused tensor or slice leaves its parameters untouched") {
  Harness h;
  REQUIRE(h.Start(1).ok());
  REQUIRE(h.PushAll(1).empty());
  REQUIRE(h.Finish(1).ok());
  REQUIRE(h.Mismatches(1).empty());

  // Update 2: the rank pushing layer 1's k_proj sends it with a wrong shape (same bytes), and rank 5's embedding
  // slice overlaps rank 4's (whichever claims second is refused). Every other tensor is pushed, concurrently; the
  // first refusal fails the update, and the buckets committed after it are refused before they load (fail fast).
  REQUIRE(h.Start(2).ok());
  const auto errors = h.PushAll(2, [&](int rank, Frame* f) {
    if (f->name == kBadK) std::swap(f->shape[0], f->shape[1]);
    if (rank == 5 && f->tensor == kEmbed) {
      f->offsets[0] -= 1;
      f->name = EncodeSliceName(kEmbed, h.specs.at(kEmbed).shape, f->offsets);
    }
  });
  std::string all = Errors(errors);
  INFO(all);
  // Whichever is claimed first is refused by name; the other is refused by name too, or, committed after the update
  // failed, before anything of it was looked at.
  CHECK((absl::StrContains(all, kBadK) || absl::StrContains(all, "overlaps")));
  CHECK(absl::StrContains(all, "nothing from it was written"));
  auto fin = h.Finish(2);
  CHECK_FALSE(fin.ok());

  // The parameters reading a refused tensor hold update 1's bytes in every engine rank; the rest hold update 2's,
  // or update 1's where their bucket came after the failure (or shared a refused bucket).
  const auto stale = h.Mismatches(2);
  const auto fresh = h.Mismatches(1);
  std::set<std::string> untouched(fresh.begin(), fresh.end());
  INFO("not update 2's: " << Join(stale));
  INFO("not update 1's: " << Join(fresh));
  for (const auto& e : h.engines) {
    const std::string who = absl::StrCat("tp", e.tp, "/", e.rank, ":");
    CHECK(untouched.count(who + "model.layers.1.self_attn.qkv_proj.weight") == 0);  // still update 1's
    CHECK(untouched.count(who + "model.embed_tokens.weight") == 0);
    CHECK(std::count(stale.begin(), stale.end(), who + "model.layers.1.self_attn.qkv_proj.weight") == 1);
    CHECK(std::count(stale.begin(), stale.end(), who + "model.embed_tokens.weight") == 1);
  }
  for (const auto& s : stale) CHECK(untouched.count(s) == 0);  // a parameter is either update 1's or update 2's

  // The next update is whole again.
  REQUIRE(h.Start(3).ok());
  const auto e3 = h.PushAll(3);
  INFO(Errors(e3));
  REQUIRE(e3.empty());
  auto fin3 = h.Finish(3);
  INFO(fin3.status().ToString());
  REQUIRE(fin3.ok());
  CHECK(h.Mismatches(3).empty());
}

TEST_CASE("slices land straight in the replica, in any order; duplicates refused; a converting dtype is staged") {
  Harness h;  // the embedding in eight row slices, a down_proj in four column slices
  auto& m = h.node->metrics();
  auto sliced = [&](const std::string& path) { return m.Value("wsync_source_sliced_tensors_total", {{"path", path}}); };
  std::mt19937 rng(20261205);
  for (int64_t step = 1; step <= 3; ++step) {
    INFO("update " << step);
    // Every rank's frames (its slices among them) in another order each update, so slices of one tensor complete
    // it in a different order every time.
    for (auto& f : h.frames) std::shuffle(f.begin(), f.end(), rng);
    UpdateAndCheck(h, step);
    // Both sliced tensors need no conversion: both landed directly, none was assembled.
    CHECK(sliced("direct") == 2 * step);
    CHECK(sliced("staged") == 0);
  }

  SECTION("a slice pushed twice is refused, failing the update; no parameter mixes two updates") {
    // Rank 6 pushes rank 2's embedding slice as well as its own (an exact duplicate, claimed second or first).
    for (const Frame& f : h.frames[2])
      if (f.tensor == kEmbed) h.frames[6].push_back(f);
    REQUIRE(h.Start(4).ok());
    const std::string all = Errors(h.PushAll(4));
    INFO(all);
    // Which refusal depends on the ranks' timing: the duplicate overlaps a slice still being assembled, or it comes
    // after the slices completed the tensor. Either way it is refused by name.
    CHECK((absl::StrContains(all, "overlaps") || absl::StrContains(all, "arrived after the tensor was complete")));
    CHECK(absl::StrContains(all, kEmbed));
    CHECK(absl::StrContains(all, "nothing from it was written"));
    CHECK_FALSE(h.Finish(4).ok());
    // The duplicate's bucket was refused whole, so some parameters hold update 3's bytes; each holds one update's.
    const auto stale = h.Mismatches(4);
    const auto old = h.Mismatches(3);
    CHECK_FALSE(stale.empty());
    std::set<std::string> not3(old.begin(), old.end());
    for (const auto& p : stale) CHECK(not3.count(p) == 0);
  }
  SECTION("slices that need a conversion are assembled whole first, with the same bytes") {
    // The embedding's slices as float32 (the replica narrows them to bfloat16): a conversion, so staged.
    for (auto& frames : h.frames)
      for (Frame& f : frames)
        if (f.tensor == kEmbed) f.dtype = DType::kF32;
    REQUIRE(h.Start(4).ok());
    const auto errors = h.PushAll(4);
    INFO(Errors(errors));
    REQUIRE(errors.empty());
    auto fin = h.Finish(4);
    INFO(fin.status().ToString());
    REQUIRE(fin.ok());
    const auto bad = h.Mismatches(4);
    INFO(Join(bad));
    CHECK(bad.empty());
    CHECK(sliced("staged") == 1);
    CHECK(sliced("direct") == 2 * 3 + 1);
  }
}

TEST_CASE("source: a bucket still being worked on holds up neither another rank's bucket nor a session hand-over") {
  // Rank 0's bucket stops after posting (the observer waits, bounded), still inside the node's data path.
  std::mutex mu;
  std::condition_variable cv;
  bool inside = false, release = false;
  Harness h([&](const BucketTiming& b) {
    if (b.local_rank != 0) return;
    std::unique_lock<std::mutex> l(mu);
    inside = true;
    cv.notify_all();
    cv.wait_for(l, std::chrono::seconds(10), [&] { return release; });
  });
  REQUIRE(h.Start(1).ok());
  auto stuck = std::async(std::launch::async, [&] { return h.Bucket(0, {"model.norm.weight"}, 1); });
  {
    std::unique_lock<std::mutex> l(mu);
    REQUIRE(cv.wait_for(l, std::chrono::seconds(10), [&] { return inside; }));
  }
  // Meanwhile: another rank's bucket goes through, a rank reconnects (a new session), status answers.
  auto other =
      std::async(std::launch::async, [&] { return h.Bucket(1, {"model.layers.0.input_layernorm.weight"}, 1); });
  auto reopen = std::async(std::launch::async, [&] {
    // Rank 7's process went away (its hand-over connection closed) and a new one takes its place.
    h.node->SessionDisconnected(h.sessions[7], "test: hand-over connection closed");
    SessionRequest sr;
    sr.local_rank = 7;
    return h.node->OpenSession(sr);
  });
  auto status = std::async(std::launch::async, [&] { return h.node->Status(); });
  const bool other_done = other.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  const bool reopen_done = reopen.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  const bool status_done = status.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
  }
  cv.notify_all();
  CHECK(other_done);
  CHECK(reopen_done);
  CHECK(status_done);
  auto o = other.get();
  INFO(o.status().ToString());
  CHECK(o.ok());
  CHECK(reopen.get().ok());
  auto st = stuck.get();
  INFO(st.status().ToString());
  CHECK(st.ok());
}

// Fail fast (issue 39): the first failed Post (the fault decorator fails batch 3) fails the source's update at once:
// the target's writer reports it to the update, which cancels every writer. Every bucket committed after it, by any rank, is refused before it loads anything, no further batch reaches an
// engine, and FinishUpdate answers the fault without waiting for the ranks. Driven from one thread, bucket by bucket
// (one tensor each, every rank's tensors in turn), so "after the fault" is exact: with the failure looked at only at
// the commit, the other targets' batches go on for the rest of the push.
TEST_CASE("source: a failed Post fails the update at once: later buckets of every rank load and post nothing",
          "[faults]") {
  transport::FaultSpec faults;
  faults.fail_post = 3;
  std::atomic<int> loaded{0};  // buckets that went through load and write (the observer runs after their posts)
  Harness h([&](const BucketTiming&) { ++loaded; }, /*slices=*/false, faults);
  REQUIRE(h.Start(1).ok());
  std::vector<std::pair<int, std::string>> order;  // (rank, tensor): every rank's tensors, round-robin
  for (size_t i = 0;; ++i) {
    bool any = false;
    for (int r = 0; r < kRanks; ++r)
      if (i < h.frames[r].size()) {
        order.push_back({r, h.frames[r][i].tensor});
        any = true;
      }
    if (!any) break;
  }
  size_t fault_at = order.size();
  int loaded_at_fault = 0;
  uint64_t posts_at_fault = 0;
  std::vector<std::string> after;  // the refusals of the buckets after the fault
  for (size_t i = 0; i < order.size(); ++i) {
    auto c = h.Bucket(order[i].first, {order[i].second}, 1);
    if (fault_at == order.size()) {
      // The writers post asynchronously: the bucket handed its batches over; the fault shows once they were posted.
      INFO(c.status().ToString());
      REQUIRE(c.ok());
      const absl::Status w = h.node->WaitWritten(absl::Seconds(20));
      if (w.ok()) continue;
      INFO(w.ToString());
      CHECK(absl::StrContains(w.message(), "injected fault: posting batch 3"));
      fault_at = i;
      loaded_at_fault = loaded;
      posts_at_fault = h.transport.posts;
      continue;
    }
    CHECK_FALSE(c.ok());
    if (!c.ok())
      after.push_back(absl::StrCat("rank ", order[i].first, " ", order[i].second, ": ", c.status().ToString()));
  }
  REQUIRE(fault_at < order.size() / 2);  // the fault came early: most of the push was still to come
  INFO("fault at bucket " << fault_at << " of " << order.size() << "; after it:\n" << Join(after));
  CHECK(posts_at_fault == faults.fail_post - 1);  // batches 1 and 2 reached the engines, 3 failed
  CHECK(h.transport.posts == posts_at_fault);     // nothing after it
  CHECK(loaded == loaded_at_fault);               // no bucket after it was loaded
  CHECK(after.size() == order.size() - fault_at - 1);
  for (const auto& a : after) CHECK(absl::StrContains(a, "the update already failed"));
  // FinishUpdate does not wait for the ranks (none ended its push): it answers the fault at once.
  const absl::Time t0 = absl::Now();
  auto fin = h.Finish(1);
  INFO(fin.status().ToString());
  CHECK(absl::Now() - t0 < absl::Seconds(1));
  REQUIRE_FALSE(fin.ok());
  CHECK(absl::StrContains(fin.status().message(), "injected fault: posting batch 3"));
}

// Every byte stays exact while the links misbehave at random: the fault transport delays each batch by a seeded
// random time (up to 3 ms on every endpoint, so the eight ranks' batches land in a shuffled order) and fails one
// seeded batch. Per seed: update 1 lands bit-exact; update 2 loses a batch in its first half and fails naming it;
// update 3 re-creates the broken endpoint and lands bit-exact. Also under ThreadSanitizer.
TEST_CASE("eight ranks, seeded random delays and a seeded failed batch: every byte exact", "[faults]") {
  uint64_t per_update = 0;  // batches one update posts (the same for every update of this model and plan)
  {
    Harness probe;
    UpdateAndCheck(probe, 1);
    per_update = probe.transport.posts;
  }
  REQUIRE(per_update >= 4);
  for (uint64_t seed : {11u, 12u}) {
    std::mt19937_64 rng(seed);
    transport::FaultSpec faults;
    faults.jitter = absl::Milliseconds(3);
    faults.seed = seed;
    faults.fail_post = per_update + 1 + rng() % (per_update / 2);  // a batch in the first half of update 2
    INFO("seed " << seed << ", faults " << faults.ToString() << ", " << per_update << " batches per update");
    Harness h(nullptr, /*slices=*/true, faults);
    UpdateAndCheck(h, 1);
    REQUIRE(h.transport.posts == per_update);
    REQUIRE(h.Start(2).ok());
    const auto errors = h.PushAll(2);  // refusals after the fault, if any, are the fail-fast case's subject
    auto fin = h.Finish(2);
    INFO(fin.status().ToString() << "\n" << Errors(errors));
    REQUIRE_FALSE(fin.ok());
    CHECK(absl::StrContains(fin.status().message(), absl::StrCat("injected fault: posting batch ", faults.fail_post)));
    UpdateAndCheck(h, 3);
  }
}

// No rank waits on another's network (issue 39): the Post to engine a of rank 0's bucket is stuck (the test holds it
// in the target's writer, as a slow link would); rank 0's and rank 1's buckets for the same engine are taken and
// return meanwhile (their batches queued for the writer, within its credits), and once the link moves the bytes of
// both reach the engine. With the target's lock held across the Post, rank 1 waited for rank 0's network.
TEST_CASE("source: a bucket for a target whose Post is stuck is queued, not held up; both land once it moves") {
  Harness h(nullptr, /*slices=*/false);
  REQUIRE(h.Start(1).ok());
  const EngineMemory* slow = h.transport.engines[0];  // engine a rank 0 (TP 1): every parameter goes there
  std::mutex mu;
  std::condition_variable cv;
  bool inside = false, release = false;
  h.transport.on_post = [&](const EngineMemory* m) {
    if (m != slow) return;
    std::unique_lock<std::mutex> l(mu);
    if (inside) return;  // only the first Post to it is held
    inside = true;
    cv.notify_all();
    cv.wait_for(l, std::chrono::seconds(10), [&] { return release; });
  };
  const std::string a = "model.norm.weight", b = "model.layers.0.input_layernorm.weight";
  auto stuck = std::async(std::launch::async, [&] { return h.Bucket(0, {a}, 1); });
  {
    std::unique_lock<std::mutex> l(mu);
    REQUIRE(cv.wait_for(l, std::chrono::seconds(10), [&] { return inside; }));
  }
  auto other = std::async(std::launch::async, [&] { return h.Bucket(1, {b}, 1); });
  const bool other_done = other.wait_for(std::chrono::seconds(3)) == std::future_status::ready;
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
  }
  cv.notify_all();
  CHECK(other_done);
  auto o = other.get();
  INFO(o.status().ToString());
  CHECK(o.ok());
  auto st = stuck.get();
  INFO(st.status().ToString());
  REQUIRE(st.ok());
  // The buckets handed their batches to the target's writer; they land once its Post moves.
  const absl::Status written = h.node->WaitWritten(absl::Seconds(20));
  INFO(written.ToString());
  REQUIRE(written.ok());
  // Both parameters hold the generated bytes in engine a (bf16 norms, written whole at TP 1): the queued batch was
  // posted by the bucket that was posting before it returned.
  for (const std::string& name : {a, b}) {
    const replica::EngineParam* p = h.engines[0].table.Find(name);
    REQUIRE(p != nullptr);
    const std::vector<uint8_t> want = h.Tensor(name, 1);
    REQUIRE(want.size() == p->bytes);
    CHECK(std::memcmp(slow->bytes.data() + p->offset, want.data(), want.size()) == 0);
  }
}

constexpr uint32_t kAllRanks = (1u << kRanks) - 1;

TEST_CASE("placement: eight ranks copying straight into the replica give the reference loader's bytes (TP 1, TP 2)") {
  // Every tensor whole: fused q/k/v and gate/up slots, row and column shards at TP 2, the vocabulary-sharded
  // embedding and lm_head, norms: all of them byte copies for this bf16 model, so all are offered.
  Harness h(nullptr, /*slices=*/false);
  size_t frames = 0;
  for (const auto& f : h.frames) frames += f.size();
  for (int64_t step = 1; step <= 3; ++step) {
    INFO("update " << step);
    h.placed = 0;
    REQUIRE(h.Start(step).ok());
    const auto errors = h.PushAll(step, nullptr, kAllRanks);
    INFO(Errors(errors));
    REQUIRE(errors.empty());
    CHECK(static_cast<size_t>(h.placed.load()) == frames);  // nothing went through a ring
    auto fin = h.Finish(step);
    INFO(fin.status().ToString());
    REQUIRE(fin.ok());
    const auto bad = h.Mismatches(step);
    INFO(Join(bad));
    CHECK(bad.empty());
  }
  CHECK(h.Mismatches(2).size() == h.NumParams());
}

TEST_CASE("placement: ring pushes, slices and placements of eight ranks mixed in one update; off for one update") {
  Harness h;  // the embedding and a down_proj as slices (through the rings)
  for (int64_t step = 1; step <= 3; ++step) {
    INFO("update " << step);
    h.placed = 0;
    // Update 2 turns placement off (StartUpdateRequest.no_placement): nothing is offered, all goes through rings.
    REQUIRE(h.Start(step, /*no_placement=*/step == 2).ok());
    const auto errors = h.PushAll(step, nullptr, 0x55);  // ranks 0, 2, 4, 6 place; the others use their rings
    INFO(Errors(errors));
    REQUIRE(errors.empty());
    if (step == 2) {
      CHECK(h.placed == 0);
    } else {
      CHECK(h.placed > 0);
    }
    auto fin = h.Finish(step);
    INFO(fin.status().ToString());
    REQUIRE(fin.ok());
    const auto bad = h.Mismatches(step);
    INFO(Join(bad));
    CHECK(bad.empty());
  }
}

TEST_CASE(
    "placement: a commit the daemon did not offer, a repeat, another update's or a stale replica's is refused "
    "and nothing of it reaches an engine") {
  Harness h(nullptr, /*slices=*/false);
  REQUIRE(h.Start(1).ok());
  REQUIRE(h.PushAll(1, nullptr, kAllRanks).empty());
  REQUIRE(h.Finish(1).ok());
  REQUIRE(h.Mismatches(1).empty());

  // The victim: layer 1's k_proj (a slot of the fused qkv_proj at TP 1 and TP 2), offered to its owner only.
  int owner = -1;
  for (int r = 0; r < kRanks; ++r)
    for (const auto& f : h.frames[r])
      if (f.name == kBadK) owner = r;
  REQUIRE(owner >= 0);
  const int other = (owner + 1) % kRanks;
  std::vector<std::string> offered_to_owner, offered_to_other;
  uint64_t generation = 0;
  REQUIRE(h.Start(2).ok());
  for (int r : {owner, other}) {
    v1::BeginPushRequest bp;
    bp.set_session_id(h.sessions[r]);
    bp.set_version(2);
    auto rep = h.node->BeginPush(bp);
    REQUIRE(rep.ok());
    generation = rep->replica_generation();
    for (const auto& p : rep->placements()) (r == owner ? offered_to_owner : offered_to_other).push_back(p.name());
  }
  REQUIRE(std::count(offered_to_owner.begin(), offered_to_owner.end(), kBadK) == 1);
  REQUIRE(std::count(offered_to_other.begin(), offered_to_other.end(), kBadK) == 0);

  std::string why;
  SECTION("a rank placing into another rank's destinations") {
    // Rank `other` writes its own bytes over the victim's regions (the daemon cannot see a stray copy) and commits
    // it: refused, as it was never offered to it.
    auto mapping = h.Map(other);
    REQUIRE(mapping.ok());
    v1::BeginPushRequest bp;
    bp.set_session_id(h.sessions[owner]);
    bp.set_version(2);
    auto rep = h.node->BeginPush(bp);
    REQUIRE(rep.ok());
    for (const auto& p : rep->placements())
      if (p.name() == kBadK) REQUIRE(h.Place(**mapping, p, std::vector<uint8_t>(h.Tensor(kBadK, 2).size(), 0x7f)).ok());
    auto c = h.CommitPlaced(other, 2, generation, {kBadK});
    REQUIRE_FALSE(c.ok());
    CHECK(c.status().code() == absl::StatusCode::kPermissionDenied);
    CHECK(absl::StrContains(c.status().message(), kBadK));
    why = c.status().ToString();
  }
  SECTION("a rank committing a tensor nobody was offered") {
    auto c = h.CommitPlaced(owner, 2, generation, {kBadK, "model.layers.1.self_attn.no_such_proj.weight"});
    REQUIRE_FALSE(c.ok());
    CHECK(absl::StrContains(c.status().message(), "no_such_proj"));
    why = c.status().ToString();  // all or none: kBadK of the same call is not claimed either
  }
  SECTION("a placement committed for another update") {
    auto c = h.CommitPlaced(owner, 1, generation, {kBadK});
    REQUIRE_FALSE(c.ok());
    CHECK(absl::StrContains(c.status().message(), "update 1"));
    CHECK(absl::StrContains(c.status().message(), kBadK));
    why = c.status().ToString();
  }
  SECTION("a placement committed for a replica that is no longer in use") {
    auto c = h.CommitPlaced(owner, 2, generation - 1, {kBadK});
    REQUIRE_FALSE(c.ok());
    CHECK(absl::StrContains(c.status().message(), "generation"));
    CHECK(absl::StrContains(c.status().message(), kBadK));
    why = c.status().ToString();
  }
  SECTION("a tensor placed twice, or placed after it came through the ring") {
    // The owner pushes the victim through its ring (accepted), then also commits it as placed: refused. Nothing
    // of the victim may be missing here (the ring's copy was whole), so the check is the refusal and the failure.
    auto b = h.Bucket(owner, {kBadK}, 2);
    REQUIRE(b.ok());
    auto c = h.CommitPlaced(owner, 2, generation, {kBadK});
    REQUIRE_FALSE(c.ok());
    CHECK(c.status().code() == absl::StatusCode::kAlreadyExists);
    CHECK(absl::StrContains(c.status().message(), kBadK));
    auto fin = h.Finish(2);
    CHECK_FALSE(fin.ok());
    return;
  }
  INFO(why);
  CHECK(absl::StrContains(why, "nothing from it was written"));

  // Every other tensor is pushed (the victim is not: its placement was refused). The update failed at the refusal,
  // so each of them is refused before it is loaded, and nothing more reaches an engine (fail fast).
  auto& mine = h.frames[owner];
  mine.erase(std::remove_if(mine.begin(), mine.end(), [](const Frame& f) { return f.name == kBadK; }), mine.end());
  const uint64_t posts = h.transport.posts;
  const auto errors = h.PushAll(2, nullptr, kAllRanks);
  INFO(Errors(errors));
  CHECK_FALSE(errors.empty());
  for (const auto& [rank, list] : errors)
    for (const auto& e : list) CHECK(absl::StrContains(e.message(), "the update already failed"));
  CHECK(h.transport.posts == posts);
  auto fin = h.Finish(2);
  CHECK_FALSE(fin.ok());
  const auto stale = h.Mismatches(2);
  const auto fresh = h.Mismatches(1);
  const std::set<std::string> not_one(fresh.begin(), fresh.end());
  INFO("not update 2's: " << Join(stale));
  for (const auto& e : h.engines) {
    const std::string qkv = absl::StrCat("tp", e.tp, "/", e.rank, ":model.layers.1.self_attn.qkv_proj.weight");
    CHECK(std::count(stale.begin(), stale.end(), qkv) == 1);  // never written in update 2 ...
    CHECK(not_one.count(qkv) == 0);                           // ... still update 1's bytes
  }
}

TEST_CASE("placement through the C++ client: offered host tensors land in the replica, the rest in the ring") {
#if defined(__SANITIZE_THREAD__)
  // This case serves the trainer RPCs over gRPC in-process; Debian's libgrpc is not instrumented, so TSan reports its
  // internals (tcp_send, completion queues, protobuf parsing) as races. The placement data path under concurrent ranks
  // is covered by the cases above in the TSan build; this one runs in the plain build.
  WARN("skipped under ThreadSanitizer: gRPC in-process (uninstrumented libgrpc)");
  return;
#endif
  // The real client over the daemon's trainer socket and TrainerIngest gRPC server: even ranks place (the default),
  // odd ranks turn placement off; the same clients across two updates (the replica is mapped once).
  Harness h(nullptr, /*slices=*/false);
  char tmpl[] = "/tmp/wsync-placement-test.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string path = dir + "/wsyncd.sock";
  TrainerSocketOptions to;
  to.path = path;
  TrainerIngestService ingest(h.node.get());
  auto rpc = ServeUnix(path + ".rpc", {&ingest}, TrainerSocket::SocketMode(to));
  REQUIRE(rpc.ok());
  auto sock = TrainerSocket::Start(to, h.node.get(), "unix:" + path + ".rpc");
  REQUIRE(sock.ok());
  std::vector<std::unique_ptr<client::TrainerClient>> clients;
  for (int r = 0; r < kRanks; ++r) {
    client::TrainerOptions o;
    o.daemon = path;
    o.local_rank = r;
    o.bucket_bytes = 64 << 10;
    o.placement = r % 2 == 0;
    auto c = client::TrainerClient::Connect(o);
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    clients.push_back(*std::move(c));
  }
  for (int64_t step = 1; step <= 2; ++step) {
    INFO("update " << step);
    REQUIRE(h.Start(step).ok());
    std::vector<absl::Status> results(kRanks);
    std::vector<client::PushStats> stats(kRanks);
    std::vector<std::thread> threads;
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        results[r] = [&]() -> absl::Status {
          auto names = clients[r]->BeginPush(step);
          if (!names.ok()) return names.status();
          for (const auto& n : *names) {
            const std::vector<uint8_t> data = h.Tensor(n, step);
            const auto& spec = h.specs.at(n);
            if (auto st = clients[r]->Push(n, spec.dtype, spec.shape, data.data(), data.size()); !st.ok()) return st;
          }
          stats[r] = clients[r]->stats();
          return clients[r]->EndPush(step);
        }();
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < kRanks; ++r) {
      INFO("rank " << r << ": " << results[r].ToString());
      CHECK(results[r].ok());
      CHECK(stats[r].tensors > 0);
      if (r % 2 == 0) {
        CHECK(stats[r].placed == stats[r].tensors);  // every tensor of this bf16 model is a byte copy
      } else {
        CHECK(stats[r].placed == 0);
      }
    }
    auto fin = h.Finish(step);
    INFO(fin.status().ToString());
    REQUIRE(fin.ok());
    const auto bad = h.Mismatches(step);
    INFO(Join(bad));
    CHECK(bad.empty());
  }
  clients.clear();
  sock->reset();
  (*rpc)->Shutdown();
  std::system(("rm -rf " + dir).c_str());
}

}  // namespace
}  // namespace wsync::daemon
