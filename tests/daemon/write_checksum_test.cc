// A source's write checksums (wsyncctl verify), hashed on its hash pool rather than on the ingest thread, driven
// in-process: a real SourceNode with the tiny model's replica, a trainer rank pushing through the real ring, and a
// transport that copies every write into per-engine host buffers (the engines' memory). The expectation is the
// engines' memory itself, hashed by the test: a checksum the source took of other bytes than it sent (a replica
// rewritten by the next update before the pool got to it) does not match.

#include <xxhash.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "client/ring/ring.h"
#include "daemon/common/convert.h"
#include "daemon/node/hash_pool.h"
#include "daemon/node/source_node.h"
#include "replica/model_config.h"
#include "replica/param_table.h"
#include "tests/daemon/null_source.h"
#include "transport/transport.h"

namespace wsync::daemon {
namespace {

using HostLocal = testing::NullLocalRegion;
using testing::EngineMemory;

// Copies every write at Post (the replica's bytes at the moment they were posted are what the engine holds).
class CopyEndpoint : public transport::Endpoint {
 public:
  std::string LocalInfo() const override { return "copy"; }
  absl::Status Connect(const std::string&, absl::Duration) override { return absl::OkStatus(); }
  absl::StatusOr<transport::BatchId> Post(absl::Span<const transport::WriteRequest> writes) override {
    for (const auto& w : writes) {
      if (auto st = transport::ValidateWrite(w); !st.ok()) return st;
      auto* dst = static_cast<const EngineMemory*>(w.dst);
      std::memcpy(dst->bytes.data() + w.dst_offset, static_cast<const uint8_t*>(w.src->addr()) + w.src_offset,
                  w.length);
    }
    return ++next_;
  }
  absl::Status Wait(transport::BatchId, absl::Duration) override { return absl::OkStatus(); }
  std::string PeerName() const override { return "copy peer"; }

 private:
  transport::BatchId next_ = 0;
};

// Imports regions in plan order: engines[i] is the i-th target's (one segment each).
class CopyTransport : public transport::Transport {
 public:
  std::vector<const EngineMemory*> engines;
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
    return std::make_unique<CopyEndpoint>();
  }
};

constexpr int64_t kPlan = 3;
constexpr int kEngines = 2;  // two engines of the same layout: one hash per range, one entry per engine

std::string Hex(const uint8_t* p, uint64_t n) {
  const XXH128_hash_t h = XXH3_128bits(p, n);
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

struct Harness {
  CopyTransport transport;
  std::unique_ptr<SourceNode> node;
  std::string session;
  ScopedFd ring_fd;
  std::map<std::string, replica::TensorSpec> specs;
  std::map<std::string, std::pair<uint64_t, uint64_t>> params;  // engine parameter → (offset in segment, bytes)
  size_t num_params = 0;

  explicit Harness(std::function<void()> hook, int threads = 2) {
    std::ifstream f(WSYNC_TINY_MODEL);
    REQUIRE(f.good());
    std::stringstream json;
    json << f.rdbuf();
    auto cfg = replica::ModelConfig::FromJson(json.str());
    REQUIRE(cfg.ok());
    const replica::RankParallelism rp;
    auto table = replica::BuildParamTable(*cfg, rp, replica::QuantSpec());
    REQUIRE(table.ok());
    v1::ConfigureSourceRequest req;
    req.set_model_config_json(json.str());
    req.set_plan_epoch(kPlan);
    for (int e = 0; e < kEngines; ++e) {
      auto* t = req.add_targets();
      t->set_engine_id("e" + std::to_string(e));
      t->set_rank(0);
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
        params[p.name] = {p.offset, p.bytes};
      }
      auto* seg = l->add_segments();
      seg->set_id(0);
      seg->set_kind("host");
      seg->set_bytes(table->total_bytes());
      seg->set_region_descriptor(std::to_string(seg->bytes()));
      l->set_region_bytes(seg->bytes());
    }
    num_params = table->params().size();

    SourceOptions o;
    o.node_id = "src";
    o.ring_bytes = 8 << 20;
    o.push_timeout = absl::Seconds(10);
    o.write_checksum_threads = threads;
    o.checksum_hook = std::move(hook);
    node = std::make_unique<SourceNode>(
        o, &transport, [](const std::string&, const v1::ConnectTargetRequest&) -> absl::StatusOr<std::string> {
          return std::string("copy");
        });
    auto c = node->Configure(req);
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    REQUIRE(transport.engines.size() == kEngines);
    SessionRequest os;
    auto s = node->OpenSession(os);
    REQUIRE(s.ok());
    session = s->id;
    ring_fd = std::move(s->ring_fd);
    auto all = replica::CheckpointTensors(*cfg);
    REQUIRE(all.ok());
    for (auto& t : *all) specs[t.name] = t;
  }

  absl::Status Start(int64_t v) {
    v1::StartUpdateRequest r;
    r.set_version(v);
    r.set_plan_epoch(kPlan);
    return node->StartUpdate(r);
  }
  absl::StatusOr<v1::FinishUpdateReply> Finish(int64_t v) {
    v1::FinishUpdateRequest r;
    r.set_version(v);
    r.set_timeout_seconds(20);
    r.set_plan_epoch(kPlan);
    return node->FinishUpdate(r);
  }
  // The rank's whole push of update v in `buckets` buckets, every byte a function of (v, tensor, position), so two
  // versions differ everywhere. CommitBucket runs on this thread (the ingest path).
  void Push(int64_t v, int buckets = 4) {
    v1::BeginPushRequest bp;
    bp.set_session_id(session);
    bp.set_version(v);
    auto names = node->BeginPush(bp);
    REQUIRE(names.ok());
    const int n = names->tensor_names_size();
    REQUIRE(n >= buckets);
    auto prod = RingProducer::Attach(ring_fd.get());
    REQUIRE(prod.ok());
    for (int b = 0; b < buckets; ++b) {
      for (int i = b * n / buckets; i < (b + 1) * n / buckets; ++i) {
        const replica::TensorSpec& s = specs.at(names->tensor_names(i));
        auto dst = prod->BeginTensor(s.name, s.dtype, s.shape, s.bytes(), absl::Seconds(5));
        REQUIRE(dst.ok());
        auto* p = static_cast<uint8_t*>(*dst);
        for (uint64_t k = 0; k < s.bytes(); ++k) p[k] = static_cast<uint8_t>(k * 131 + i * 17 + v * 59 + 1);
        REQUIRE(prod->FinishTensor().ok());
      }
      auto seq = prod->CommitBucket();
      REQUIRE(seq.ok());
      v1::CommitBucketRequest cb;
      cb.set_session_id(session);
      cb.set_bucket_seq(*seq);
      auto c = node->CommitBucket(cb);
      INFO(c.status().ToString());
      REQUIRE(c.ok());
    }
    v1::EndPushRequest ep;
    ep.set_session_id(session);
    ep.set_version(v);
    REQUIRE(node->EndPush(ep).ok());
  }

  // What the engines hold now, per recorded range of `rec`: (engine, param, offset, length) → XXH3-128 hex.
  using Key = std::tuple<std::string, std::string, uint64_t, uint64_t>;
  std::map<Key, std::string> EngineHashes(const v1::WriteChecksumsReply& rec) const {
    std::map<Key, std::string> out;
    for (const auto& w : rec.writes()) {
      const int e = std::stoi(w.engine_id().substr(1));
      const uint8_t* base = transport.engines.at(e)->bytes.data() + params.at(w.param()).first;
      out[{w.engine_id(), w.param(), w.offset(), w.length()}] = Hex(base + w.offset(), w.length());
    }
    return out;
  }
  // The same for every parameter of every engine, whole (this plan writes whole parameters).
  std::map<Key, std::string> EngineHashesAll() const {
    std::map<Key, std::string> out;
    for (int e = 0; e < kEngines; ++e)
      for (const auto& [name, at] : params)
        out[{"e" + std::to_string(e), name, 0, at.second}] =
            Hex(transport.engines[e]->bytes.data() + at.first, at.second);
    return out;
  }
  static std::map<Key, std::string> Recorded(const v1::WriteChecksumsReply& rec) {
    std::map<Key, std::string> out;
    for (const auto& w : rec.writes()) out[{w.engine_id(), w.param(), w.offset(), w.length()}] = w.xxh128();
    return out;
  }
  v1::WriteChecksumsReply Checksums(int64_t v) const {
    auto r = node->WriteChecksums(v);
    INFO(r.status().ToString());
    REQUIRE(r.ok());
    return *r;
  }
};

// Slow hashing (each range waits a little first), so the pool lags well behind the ingest thread.
void SlowHash() { std::this_thread::sleep_for(std::chrono::milliseconds(5)); }

TEST_CASE(
    "write checksums: recorded hashes are of the bytes each engine got, though the next update rewrites the "
    "replica at once") {
  Harness h(SlowHash);

  SECTION("finished update, then the next one") {
    REQUIRE(h.Start(1).ok());
    h.Push(1);
    REQUIRE(h.Finish(1).ok());
    const v1::WriteChecksumsReply v1rec = h.Checksums(1);
    CHECK(v1rec.finished());
    // Complete when reported finished: every parameter, every engine, whole.
    REQUIRE(static_cast<size_t>(v1rec.writes_size()) == h.num_params * kEngines);
    const auto engines_after_1 = h.EngineHashes(v1rec);
    CHECK(Harness::Recorded(v1rec) == engines_after_1);

    REQUIRE(h.Start(2).ok());  // the replica is rewritten with update 2's bytes right away
    h.Push(2);
    REQUIRE(h.Finish(2).ok());
    const v1::WriteChecksumsReply v2rec = h.Checksums(2);
    CHECK(v2rec.finished());
    CHECK(Harness::Recorded(v2rec) == h.EngineHashes(v2rec));
    CHECK(Harness::Recorded(h.Checksums(1)) == engines_after_1);  // unchanged by update 2
    // The two updates' bytes differ in every range (else the checks above could not tell them apart).
    const auto r1 = Harness::Recorded(v1rec), r2 = Harness::Recorded(v2rec);
    for (const auto& [k, hex] : r1) CHECK(r2.at(k) != hex);
  }

  SECTION("aborted update, then the next one") {
    REQUIRE(h.Start(1).ok());
    h.Push(1);
    v1::AbortSourceUpdateRequest ab;
    ab.set_version(1);
    ab.set_reason("test");
    REQUIRE(h.node->AbortUpdate(ab).ok());
    const v1::WriteChecksumsReply rec = h.Checksums(1);
    CHECK_FALSE(rec.finished());
    // What the engines got: the abort drops the batches still queued at the writers (those are not listed), the
    // ones written are, each with the hash of the bytes that engine holds.
    REQUIRE(rec.writes_size() > 0);
    REQUIRE(static_cast<size_t>(rec.writes_size()) <= h.num_params * kEngines);
    const auto engines_after_1 = h.EngineHashes(rec);
    CHECK(Harness::Recorded(rec) == engines_after_1);
    REQUIRE(h.Start(2).ok());
    h.Push(2);
    REQUIRE(h.Finish(2).ok());
    CHECK(Harness::Recorded(h.Checksums(1)) == engines_after_1);
  }

  SECTION("abandoned update (no commit, no abort), then the next one") {
    REQUIRE(h.Start(1).ok());
    h.Push(1);
    // What the engines got from update 1, before anything of update 2 exists: a push returns once its batches are
    // queued at the targets' writers, so wait for them to be written (the copy transport writes at Post); the pool
    // may still be hashing update 1 here.
    REQUIRE(h.node->WaitWritten(absl::Seconds(30)).ok());
    const auto engines_after_1 = h.EngineHashesAll();
    REQUIRE(h.Start(2).ok());  // abandons 1: the pool must finish hashing it before the replica changes
    const v1::WriteChecksumsReply rec1 = h.Checksums(1);
    CHECK_FALSE(rec1.finished());
    CHECK(static_cast<size_t>(rec1.writes_size()) == h.num_params * kEngines);
    h.Push(2);
    REQUIRE(h.Finish(2).ok());
    CHECK(Harness::Recorded(h.Checksums(1)) == engines_after_1);
    const v1::WriteChecksumsReply rec2 = h.Checksums(2);
    CHECK(Harness::Recorded(rec2) == h.EngineHashes(rec2));
  }
}

TEST_CASE("write checksums: the ingest thread does not hash; the commit waits for the pool") {
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::set<std::thread::id> hashing_threads;
  std::atomic<int> hashed{0};
  auto hook = [&] {
    std::unique_lock<std::mutex> l(mu);
    hashing_threads.insert(std::this_thread::get_id());
    cv.notify_all();  // the test waits for the first hashing thread
    // Held until the test releases it (bounded, so an inline implementation fails the checks instead of hanging).
    cv.wait_for(l, std::chrono::seconds(10), [&] { return release; });
    ++hashed;
  };
  Harness h(hook, 3);
  REQUIRE(h.Start(1).ok());
  const auto t0 = std::chrono::steady_clock::now();
  h.Push(1);  // every CommitBucket on this thread
  const auto push_time = std::chrono::steady_clock::now() - t0;
  CHECK(push_time < std::chrono::seconds(5));  // not held by the blocked hashing
  {
    // The pool may not have been scheduled yet when the push returns (a loaded machine): wait for its first hash.
    std::unique_lock<std::mutex> l(mu);
    cv.wait_for(l, std::chrono::seconds(10), [&] { return !hashing_threads.empty(); });
    CHECK(hashing_threads.count(std::this_thread::get_id()) == 0);
    CHECK(hashing_threads.size() >= 1);
    CHECK(hashing_threads.size() <= 3);
  }
  // Nothing hashed yet: the open update's list is empty and not finished (never partial reported as complete).
  const v1::WriteChecksumsReply open = h.Checksums(1);
  CHECK_FALSE(open.finished());
  CHECK(open.writes_size() == 0);

  auto finish = std::async(std::launch::async, [&] { return h.Finish(1); });
  CHECK(finish.wait_for(std::chrono::milliseconds(300)) == std::future_status::timeout);  // waits for the pool
  {
    std::lock_guard<std::mutex> l(mu);
    release = true;
  }
  cv.notify_all();
  REQUIRE(finish.wait_for(std::chrono::seconds(20)) == std::future_status::ready);
  auto fin = finish.get();
  INFO(fin.status().ToString());
  REQUIRE(fin.ok());
  const v1::WriteChecksumsReply done = h.Checksums(1);
  CHECK(done.finished());
  REQUIRE(static_cast<size_t>(done.writes_size()) == h.num_params * kEngines);
  CHECK(Harness::Recorded(done) == h.EngineHashes(done));
  CHECK(static_cast<size_t>(hashed.load()) == h.num_params);  // one hash per range, shared by both engines
  std::lock_guard<std::mutex> l(mu);
  CHECK(hashing_threads.count(std::this_thread::get_id()) == 0);
}

TEST_CASE("hash pool: WaitIdle returns after every job submitted before it; destruction runs the queued ones") {
  std::atomic<int> done{0};
  {
    HashPool pool(2);
    CHECK(pool.threads() == 2);
    for (int i = 0; i < 20; ++i)
      pool.Submit([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        ++done;
      });
    pool.WaitIdle();
    CHECK(done.load() == 20);
    for (int i = 0; i < 10; ++i)
      pool.Submit([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        ++done;
      });
  }
  CHECK(done.load() == 30);
  CHECK(HashPool::DefaultThreads() >= 1);
  CHECK(HashPool::DefaultThreads() <= 4);
}

}  // namespace
}  // namespace wsync::daemon
