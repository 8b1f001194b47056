// wsync-engine-ref: a reference inference engine instance. It owns each TP rank's weights in shared memory (memfd
// segments), in SGLang's layout, implements the engine control API, and verifies what landed in its memory against
// its own naive loader. On the Attach RPC its ranks hand their segments to the target wsyncd over its engine socket
// (docs/engines.md); the daemon maps them and writes into them directly, as it would into GPU weight memory.
// With --load-socket it also loads full HF tensors handed over in a file (the broadcast baseline's receivers,
// bench/cluster) through the same loader it verifies with (docs/engines.md, "Loading HF tensors directly").
// With --staging every rank holds two copies of its segments: the live one it serves from and a staging one that
// staged updates write while it serves; Switch makes the staging copy live by swapping which copy is read
// (docs/operations.md, "Staged updates").
// With --lora-rank it serves a LoRA adapter slot instead of the model: its memory is the adapter's lora_A/lora_B
// alone, and it reports the base config plus a "lora_adapter" section, as vLLM's adapter mode does (docs/engines.md,
// "LoRA adapters").

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/cli.h"
#include "base/fd_passing.h"
#include "base/logging.h"
#include "base/status.h"
#include "daemon/node/armed_switch.h"
#include "nlohmann/json.hpp"
#include "proto/tls.h"
#include "tools/testdata/step_files.h"
#include "tools/testing/engine_ref/ref_faults.h"
#include "tools/testing/engine_ref/ref_model.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::engine_ref {
namespace {

namespace pb = ::wsync::v1;

// One rank's weight memory: several memfd segments (the parameter list split in kSegmentsPerRank parts, so the
// general segment model is exercised), each mapped here; the target daemon gets the fds through the attach socket.
// With `copies` 2 (--staging) every segment exists twice: copy c of segment i has id i + c * per_copy().
constexpr int kSegmentsPerRank = 3;

struct Placement {
  int segment = 0;
  uint64_t offset = 0;  // inside the segment
};

class RankMemory {
 public:
  struct Segment {
    wsync::ScopedFd fd;
    uint8_t* base = nullptr;
    uint64_t bytes = 0;
  };
  ~RankMemory() {
    for (auto& s : segments_)
      if (s.base != nullptr) munmap(s.base, s.bytes);
  }
  // Splits `layout`'s parameters into contiguous runs of about equal bytes, one memfd each, 256-byte aligned inside;
  // `copies` times.
  absl::Status Create(const std::string& name, const RefLayout& layout, int copies) {
    const uint64_t per = layout.total_bytes / kSegmentsPerRank + 1;
    std::vector<uint64_t> sizes(1, 0);
    for (const auto& p : layout.params) {
      if (p.draft && first_draft_ < 0) {  // the draft in a segment of its own (MemorySegment.weights)
        first_draft_ = static_cast<int>(sizes.size());
        sizes.push_back(0);
      }
      if (sizes.back() >= per && static_cast<int>(sizes.size()) < kSegmentsPerRank) sizes.push_back(0);
      const uint64_t off = (sizes.back() + 255) / 256 * 256;
      placement_.push_back({static_cast<int>(sizes.size()) - 1, off});
      sizes.back() = off + p.bytes;
    }
    per_copy_ = static_cast<int>(sizes.size());
    for (size_t k = 0; k < sizes.size() * copies; ++k) {
      const size_t i = k % sizes.size();
      Segment s;
      s.bytes = std::max<uint64_t>(sizes[i], 1);
      s.fd.reset(memfd_create(absl::StrCat(name, "-s", k).c_str(), MFD_CLOEXEC));
      if (!s.fd.valid()) return absl::InternalError(absl::StrCat("memfd_create: ", strerror(errno)));
      if (ftruncate(s.fd.get(), static_cast<off_t>(s.bytes)) != 0)
        return absl::InternalError(absl::StrCat("ftruncate memfd: ", strerror(errno)));
      void* p = mmap(nullptr, s.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s.fd.get(), 0);
      if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap memfd: ", strerror(errno)));
      s.base = static_cast<uint8_t*>(p);
      segments_.push_back(std::move(s));
    }
    return absl::OkStatus();
  }
  const std::vector<Segment>& segments() const { return segments_; }
  const Placement& placement(size_t param) const { return placement_[param]; }
  // Parameter `param` in copy `set` (0 unless staging).
  uint8_t* at(size_t param, int set = 0) const {
    return segments_[placement_[param].segment + set * per_copy_].base + placement_[param].offset;
  }
  int per_copy() const { return per_copy_; }
  // Whether segment `id` (of either copy) holds the rank's draft.
  bool draft(int id) const { return first_draft_ >= 0 && id % per_copy_ >= first_draft_; }
  // XXH3-128 (hex) of every segment of copy `set`, in id order.
  std::string Digest(int set) const {
    XXH3_state_t* st = XXH3_createState();
    XXH3_128bits_reset(st);
    for (int i = 0; i < per_copy_; ++i) {
      const Segment& s = segments_[i + set * per_copy_];
      XXH3_128bits_update(st, s.base, s.bytes);
    }
    const XXH128_hash_t h = XXH3_128bits_digest(st);
    XXH3_freeState(st);
    return absl::StrFormat("%016x%016x", h.high64, h.low64);
  }

 private:
  std::vector<Segment> segments_;
  int per_copy_ = 0;
  int first_draft_ = -1;  // the draft's first segment, -1 without a draft
  std::vector<Placement> placement_;  // per param of the layout
};

class EngineService final : public pb::EngineControl::Service {
 public:
  EngineService(std::string id, std::string config_json, RefConfig cfg, int tp, bool staging)
      : id_(std::move(id)), config_json_(std::move(config_json)), cfg_(cfg), tp_(tp), staging_(staging) {
    // An adapter slot reports the vLLM dialect: the table it holds is vLLM's adapter table (PEFT names, whole on every
    // rank), which the replica plans for that dialect only (SGLang has no in-memory adapter path).
    if (cfg_.lora_rank > 0) kind_ = "vllm";
  }

  ~EngineService() { CloseAttachments(); }

  // Verify's expectation for step N: the checkpoint `wsync-rl-steps --out dir` wrote for it instead of the
  // generated one. Call before serving.
  void UseStepFiles(const std::string& dir) { step_files_ = std::make_unique<wsync::tools::StepFiles>(dir); }

  absl::Status Init() {
    rank_mu_ = std::make_unique<std::mutex[]>(tp_);
    for (int r = 0; r < tp_; ++r) {
      auto layout = BuildRefLayout(cfg_, tp_, r);
      if (!layout.ok()) return layout.status();
      layouts_.push_back(*std::move(layout));
      auto mem = std::make_unique<RankMemory>();
      auto st = mem->Create(absl::StrCat("wsync-engine-", id_, "-r", r), layouts_.back(), staging_ ? 2 : 1);
      if (!st.ok()) return st;
      memory_.push_back(std::move(mem));
      spdlog::info("engine {} rank {}: {} params, {:.1f} MiB in {} memfd segments", id_, r,
                   layouts_.back().params.size(), layouts_.back().total_bytes / 1048576.0,
                   memory_.back()->segments().size());
    }
    return absl::OkStatus();
  }

  // Connects one socket per rank to the target daemon, sends each rank's attach frame with its segment fds, and
  // waits for every reply. A later Attach (the target restarted) replaces the previous connections.
  grpc::Status Attach(grpc::ServerContext* ctx, const pb::AttachRequest* req, pb::EngineReply* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "Attach", {::wsync::tls::kTarget}); !a.ok()) return a;
    std::lock_guard<std::mutex> al(attach_mu_);
    CloseAttachments();
    if (req->engine_id() != id_)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("this is engine ", id_, ", not ", req->engine_id()));
    std::vector<wsync::ScopedFd> socks;
    for (int r = 0; r < tp_; ++r) {
      wsync::ScopedFd sock(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
      sockaddr_un addr{};
      addr.sun_family = AF_UNIX;
      if (req->socket_path().size() >= sizeof(addr.sun_path))
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "socket path too long");
      std::memcpy(addr.sun_path, req->socket_path().data(), req->socket_path().size());
      if (!sock.valid() || connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
        return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat("rank ", r, ": connect ", req->socket_path(), ": ", strerror(errno)));
      timeval tv{60, 0};
      setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
      std::vector<int> fds;
      for (const auto& seg : memory_[r]->segments()) fds.push_back(seg.fd.get());
      auto st = wsync::SendFds(sock.get(), fds, AttachMessage(*req, r));
      if (!st.ok()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, absl::StrCat("rank ", r, ": ", st.ToString()));
      socks.push_back(std::move(sock));
    }
    for (int r = 0; r < tp_; ++r) {
      auto reply = wsync::ReceiveFds(socks[r].get());
      if (!reply.ok())
        return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                            absl::StrCat("rank ", r, ": no attach reply: ", reply.status().ToString()));
      nlohmann::json j = nlohmann::json::parse(reply->message, nullptr, false);
      if (j.is_discarded() || !j.is_object() || j.value("type", "") != "attached")
        return grpc::Status(grpc::StatusCode::INTERNAL, absl::StrCat("rank ", r, ": unexpected reply ", reply->message));
      if (!j.value("ok", false))
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("rank ", r, ": the target refused the attach: ", j.value("error", "")));
    }
    spdlog::info("engine {}: {} ranks attached to {}", id_, tp_, req->socket_path());
    // Commits are read (and logged) so the socket never fills; the reference engine needs nothing from them.
    attached_ = std::move(socks);
    int p[2];
    if (pipe2(p, O_CLOEXEC) == 0) {
      stop_rd_.reset(p[0]);
      stop_wr_.reset(p[1]);
    }
    reader_ = std::thread([this] { ReadCommits(); });
    out->set_success(true);
    out->set_message(absl::StrCat(tp_, " ranks attached"));
    return grpc::Status::OK;
  }

  grpc::Status GetInfo(grpc::ServerContext* ctx, const pb::GetEngineInfoRequest*, pb::EngineInfo* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "GetInfo", WSYNC_ANY_ROLE); !a.ok()) return a;
    if (auto f = Fault("engine_info", ctx); !f.ok()) return f;
    std::lock_guard<std::mutex> l(mu_);
    out->set_engine_id(id_);
    out->set_num_ranks(tp_);
    out->set_model_config_json(config_json_);
    out->set_weight_version(version_);
    out->set_paused(paused_);
    out->set_kind(kind_);
    out->set_staging(staging_);
    std::shared_lock<std::shared_mutex> sl(serving_mu_);
    out->set_live_set(live_set_);
    return grpc::Status::OK;
  }

  grpc::Status GetParallelism(grpc::ServerContext* ctx, const pb::RankRequest* req, pb::RankParallelism* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "GetParallelism", WSYNC_ANY_ROLE); !a.ok()) return a;
    if (req->rank() < 0 || req->rank() >= tp_) return BadRank(req->rank());
    FillParallelism(req->rank(), out);
    return grpc::Status::OK;
  }

  grpc::Status GetWeightLayout(grpc::ServerContext* ctx, const pb::RankRequest* req, pb::RankLayout* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "GetWeightLayout", WSYNC_ANY_ROLE); !a.ok()) return a;
    if (req->rank() < 0 || req->rank() >= tp_) return BadRank(req->rank());
    const RefLayout& l = layouts_[req->rank()];
    out->set_rank(req->rank());
    FillParallelism(req->rank(), out->mutable_parallelism());
    for (size_t i = 0; i < l.params.size(); ++i) {
      const auto& p = l.params[i];
      auto* d = out->add_params();
      d->set_name(p.name);
      d->set_dtype(std::string(DTypeName(p.dtype)));
      for (int64_t s : p.shape) d->add_shape(s);
      d->set_bytes(p.bytes);
      d->set_segment(memory_[req->rank()]->placement(i).segment);
      d->set_offset(memory_[req->rank()]->placement(i).offset);
    }
    out->set_region_bytes(l.total_bytes);
    if (cfg_.fp8_bn > 0) {
      out->mutable_quantization()->set_method("fp8_block");
      out->mutable_quantization()->add_block_size(static_cast<int32_t>(cfg_.fp8_bn));
      out->mutable_quantization()->add_block_size(static_cast<int32_t>(cfg_.fp8_bk));
    }
    for (size_t i = 0; i < memory_[req->rank()]->segments().size(); ++i) {
      auto* s = out->add_segments();
      s->set_id(static_cast<int>(i));
      s->set_kind("host");
      s->set_bytes(memory_[req->rank()]->segments()[i].bytes);
      if (memory_[req->rank()]->draft(static_cast<int>(i))) s->set_weights(pb::WEIGHT_SET_DRAFT);
    }
    if (staging_) out->set_staging_segment_shift(memory_[req->rank()]->per_copy());
    return grpc::Status::OK;
  }

  grpc::Status Pause(grpc::ServerContext* ctx, const pb::PauseRequest* req, pb::EngineReply* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "Pause", {::wsync::tls::kCoordinator, ::wsync::tls::kTarget}); !a.ok()) return a;
    if (auto f = Fault("pause", ctx); !f.ok()) return f;
    std::lock_guard<std::mutex> l(mu_);
    paused_ = true;
    spdlog::info("engine {}: paused (mode {})", id_, req->mode().empty() ? "retract" : req->mode());
    out->set_success(true);
    out->set_message("Generation paused successfully.");
    return grpc::Status::OK;
  }

  grpc::Status PostProcess(grpc::ServerContext* ctx, const pb::PostProcessRequest* req, pb::EngineReply* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "PostProcess", {::wsync::tls::kCoordinator, ::wsync::tls::kTarget}); !a.ok()) return a;
    if (auto f = Fault("post_process", ctx); !f.ok()) return f;
    std::lock_guard<std::mutex> l(mu_);
    if (!paused_) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "post_process requires a paused engine");
    spdlog::debug("engine {}: post_process of version {}", id_, req->version());
    out->set_success(true);
    out->set_message("nothing to post-process for bf16 dense weights");
    return grpc::Status::OK;
  }

  grpc::Status SetWeightVersion(grpc::ServerContext* ctx, const pb::SetWeightVersionRequest* req,
                                pb::EngineReply* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "SetWeightVersion", {::wsync::tls::kCoordinator, ::wsync::tls::kTarget}); !a.ok()) return a;
    if (auto f = Fault("set_version", ctx); !f.ok()) return f;
    std::lock_guard<std::mutex> l(mu_);
    version_ = req->version();
    spdlog::info("engine {}: weight version {}", id_, version_);
    out->set_success(true);
    return grpc::Status::OK;
  }

  grpc::Status Continue(grpc::ServerContext* ctx, const pb::ContinueRequest*, pb::EngineReply* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "Continue", {::wsync::tls::kCoordinator, ::wsync::tls::kTarget}); !a.ok()) return a;
    if (auto f = Fault("continue", ctx); !f.ok()) return f;
    Disarm();  // continued without its switch (left out after a prepare): a later switch hashes again
    std::lock_guard<std::mutex> l(mu_);
    paused_ = false;
    spdlog::info("engine {}: generation continued", id_);
    out->set_success(true);
    out->set_message("Generation continued successfully.");
    return grpc::Status::OK;
  }

  // Makes every rank's staging copy live at once, after checking that each still hashes to what was verified, unless
  // the PrepareSwitch just before it checked exactly that.
  grpc::Status Switch(grpc::ServerContext* ctx, const pb::SwitchRequest* req, pb::EngineReply* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "Switch", {::wsync::tls::kCoordinator, ::wsync::tls::kTarget}); !a.ok())
      return a;
    if (auto f = Fault("switch", ctx); !f.ok()) return f;
    return DoSwitch(*req, /*prepare=*/false, out);
  }
  // Switch's check only, while serving (readers of the live copy are not held up); arms the switch, so that the
  // switch that follows for the same version and digests swaps without hashing, inside the paused window.
  grpc::Status PrepareSwitch(grpc::ServerContext* ctx, const pb::SwitchRequest* req, pb::EngineReply* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "PrepareSwitch", {::wsync::tls::kCoordinator, ::wsync::tls::kTarget});
        !a.ok())
      return a;
    if (auto f = Fault("prepare", ctx); !f.ok()) return f;
    return DoSwitch(*req, /*prepare=*/true, out);
  }

  grpc::Status DoSwitch(const pb::SwitchRequest& req, bool prepare, pb::EngineReply* out) {
    if (!staging_)
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("engine ", id_, " offers no staging memory (start it with --staging)"));
    if (req.staging_digests_size() != tp_)
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("switch to version ", req.version(), " carries ", req.staging_digests_size(),
                                       " staging digests; the engine has ", tp_, " ranks"));
    if (prepare) {
      int staging_set = 0;
      {
        // Shared: readers of the live copy go on; a switch cannot swap the copies under the hash.
        std::shared_lock<std::shared_mutex> sl(serving_mu_);
        staging_set = 1 - live_set_;
        if (auto st = CheckStaging(req, staging_set); !st.ok()) {
          Disarm();
          return st;
        }
      }
      std::lock_guard<std::mutex> l(arm_mu_);
      armed_ = ::wsync::daemon::ArmFrom(req, staging_set);
      out->set_success(true);
      out->set_message(absl::StrCat("staging copy of version ", req.version(), " as verified; switch armed"));
      return grpc::Status::OK;
    }
    std::unique_lock<std::shared_mutex> sl(serving_mu_);
    bool checked = false;
    {
      std::lock_guard<std::mutex> l(arm_mu_);
      checked = ::wsync::daemon::SwitchMaySkipRehash(armed_, req, 1 - live_set_);
      armed_.reset();  // one switch per prepare
    }
    if (!checked)
      if (auto st = CheckStaging(req, 1 - live_set_); !st.ok()) return st;
    live_set_ = 1 - live_set_;
    sl.unlock();
    std::lock_guard<std::mutex> l(mu_);
    version_ = req.version();
    spdlog::info("engine {}: switched to version {} (copy {} live{})", id_, version_, live_set_,
                 checked ? ", checked by its prepare" : "");
    out->set_success(true);
    out->set_message(absl::StrCat("version ", version_, " live"));
    return grpc::Status::OK;
  }

  grpc::Status GetChecksums(grpc::ServerContext* ctx, const pb::RankRequest* req, pb::ChecksumReply* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "GetChecksums",
                                         {::wsync::tls::kAdmin, ::wsync::tls::kTrainer, ::wsync::tls::kCoordinator});
        !a.ok())
      return a;
    if (req->rank() < 0 || req->rank() >= tp_) return BadRank(req->rank());
    if (auto f = Fault("checksums", ctx); !f.ok()) return f;
    if (req->staging() && !staging_)
      return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                          absl::StrCat("engine ", id_, " offers no staging memory (start it with --staging)"));
    out->set_rank(req->rank());
    const RankMemory& mem = *memory_[req->rank()];
    // A reader of the live weights sees one version: a switch waits for it, and it for a switch.
    std::shared_lock<std::shared_mutex> sl(serving_mu_);
    const int set = req->staging() ? 1 - live_set_ : live_set_;
    if (req->staging()) out->set_staging_digest(mem.Digest(set));
    const auto& params = layouts_[req->rank()].params;
    if (req->ranges_size() > 0) {  // byte ranges of parameters (what a source recorded writing), in request order
      std::map<std::string, size_t> index;
      for (size_t i = 0; i < params.size(); ++i) index[params[i].name] = i;
      for (const auto& r : req->ranges()) {
        auto it = index.find(r.param());
        if (it == index.end())
          return grpc::Status(grpc::StatusCode::NOT_FOUND,
                              absl::StrCat("rank ", req->rank(), " has no parameter ", r.param()));
        const uint64_t bytes = params[it->second].bytes;
        if (r.offset() > bytes || r.length() > bytes - r.offset())
          return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              absl::StrCat("range [", r.offset(), ", +", r.length(), ") of ", r.param(),
                                           " is outside its ", bytes, " bytes"));
        XXH128_hash_t h = XXH3_128bits(mem.at(it->second, set) + r.offset(), r.length());
        auto* c = out->add_params();
        c->set_name(r.param());
        c->set_offset(r.offset());
        c->set_bytes(r.length());
        c->set_range(true);
        c->set_xxh128(absl::StrFormat("%016x%016x", h.high64, h.low64));
      }
      return grpc::Status::OK;
    }
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      XXH128_hash_t h = XXH3_128bits(mem.at(i, set), p.bytes);
      auto* c = out->add_params();
      c->set_name(p.name);
      c->set_bytes(p.bytes);
      c->set_xxh128(absl::StrFormat("%016x%016x", h.high64, h.low64));
    }
    return grpc::Status::OK;
  }

  grpc::Status Verify(grpc::ServerContext* ctx, const pb::VerifyRequest* req, pb::VerifyReply* out) override {
    if (auto a = ::wsync::tls::Authorize(ctx, "Verify", {::wsync::tls::kAdmin, ::wsync::tls::kTrainer}); !a.ok()) return a;
    auto st = VerifyStep(req->step(), out);
    if (!st.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, std::string(st.message()));
    return grpc::Status::OK;
  }

  // Checks every rank's memory against the loader's expectation for the generated checkpoint of `step`.
  absl::Status VerifyStep(int64_t step, pb::VerifyReply* out) {
    std::lock_guard<std::mutex> vl(verify_mu_);
    std::shared_lock<std::shared_mutex> sl(serving_mu_);  // one version throughout, even across a switch
    int64_t checked = 0, bytes = 0;
    for (int r = 0; r < tp_; ++r) {
      const RefLayout& l = layouts_[r];
      std::vector<uint8_t> expected(l.total_bytes);
      if (step_files_ != nullptr) {
        absl::Status missing;  // why the file could not give a tensor: more precise than the loader's NotFound
        absl::Status loaded = LoadHfTensors(
            cfg_, tp_, r, l,
            [&](const std::string& name, wsync::DType dtype, uint64_t bytes) -> const uint8_t* {
              auto t = step_files_->Tensor(step, name, dtype, bytes);
              if (!t.ok() && missing.ok()) missing = t.status();
              return t.ok() ? *t : nullptr;
            },
            expected.data());
        if (!loaded.ok()) return missing.ok() ? loaded : missing;
      } else {
        WSYNC_RETURN_IF_ERROR(ComputeExpected(cfg_, tp_, r, l, step, expected.data()));
      }
      std::lock_guard<std::mutex> rl(rank_mu_[r]);
      for (size_t k = 0; k < l.params.size(); ++k) {
        const auto& p = l.params[k];
        const uint8_t* have = memory_[r]->at(k, live_set_);  // in its segment; `expected` is packed by the loader
        ++checked;
        bytes += static_cast<int64_t>(p.bytes);
        if (std::memcmp(have, expected.data() + p.offset, p.bytes) == 0) continue;
        uint64_t i = 0;
        while (i < p.bytes && have[i] == expected[p.offset + i]) ++i;
        if (out->mismatches_size() < 20)
          out->add_mismatches(absl::StrCat("rank ", r, ": ", p.name, " (first differing byte at ", i, " of ",
                                           p.bytes, ")"));
      }
    }
    out->set_ok(out->mismatches_size() == 0);
    out->set_params_checked(checked);
    out->set_bytes_checked(bytes);
    out->set_ranks(tp_);
    spdlog::info("engine {}: verify step {}: {} params, {} mismatched", id_, step, checked,
                 out->mismatches_size());
    return absl::OkStatus();
  }

  int LiveSet() const {
    std::shared_lock<std::shared_mutex> sl(serving_mu_);
    return live_set_;
  }

  // Loads full HF tensors into rank `rank`'s memory with the engine's own loader, as an engine's load_weights does
  // for tensors a collective delivered. `file` holds them back to back as `tensors` ({name, dtype, shape, offset,
  // bytes}) describes. Returns the parameters written.
  absl::StatusOr<size_t> LoadFromFile(int rank, const std::string& file, const nlohmann::json& tensors) {
    if (rank < 0 || rank >= tp_) return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " out of range [0, ", tp_, ")"));
    if (!tensors.is_array()) return absl::InvalidArgumentError("load: 'tensors' must be an array");
    wsync::ScopedFd fd(open(file.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) return absl::NotFoundError(absl::StrCat("load: cannot open ", file, ": ", strerror(errno)));
    struct stat stt {};
    if (fstat(fd.get(), &stt) != 0 || stt.st_size <= 0)
      return absl::InvalidArgumentError(absl::StrCat("load: ", file, " is empty or unreadable"));
    const uint64_t size = static_cast<uint64_t>(stt.st_size);
    void* m = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
    if (m == MAP_FAILED) return absl::InternalError(absl::StrCat("load: mmap ", file, ": ", strerror(errno)));
    std::unique_ptr<void, std::function<void(void*)>> unmap(m, [size](void* p) { munmap(p, size); });
    const auto* base = static_cast<const uint8_t*>(m);
    struct Entry {
      uint64_t offset, bytes;
    };
    std::map<std::string, Entry> index;
    for (const auto& t : tensors) {
      if (!t.is_object() || !t.contains("name") || !t.contains("offset") || !t.contains("bytes"))
        return absl::InvalidArgumentError("load: every tensor needs name, offset and bytes");
      const std::string name = t["name"].get<std::string>();
      const std::string dtype = t.value("dtype", std::string(DTypeName(cfg_.dtype)));
      if (dtype != DTypeName(cfg_.dtype))
        return absl::InvalidArgumentError(absl::StrCat("load: tensor ", name, " is ", dtype, ", the model is ",
                                                       DTypeName(cfg_.dtype)));
      const Entry e{t["offset"].get<uint64_t>(), t["bytes"].get<uint64_t>()};
      if (e.offset > size || e.bytes > size - e.offset)
        return absl::InvalidArgumentError(absl::StrCat("load: tensor ", name, " [", e.offset, ", +", e.bytes,
                                                       ") lies outside ", file, " (", size, " bytes)"));
      index[name] = e;
    }
    const RefLayout& l = layouts_[rank];
    std::vector<uint8_t> packed(l.total_bytes);
    WSYNC_RETURN_IF_ERROR(LoadHfTensors(
        cfg_, tp_, rank, l,
        [&](const std::string& name, DType, uint64_t bytes) -> const uint8_t* {
          // every tensor in the file is in the model's dtype (checked above): a float32 one is found by size only
          auto it = index.find(name);
          return it == index.end() || it->second.bytes != bytes ? nullptr : base + it->second.offset;
        },
        packed.data()));
    std::lock_guard<std::mutex> rl(rank_mu_[rank]);
    for (size_t k = 0; k < l.params.size(); ++k)
      std::memcpy(memory_[rank]->at(k, LiveSet()), packed.data() + l.params[k].offset, l.params[k].bytes);
    return l.params.size();
  }

 private:
  grpc::Status BadRank(int r) const {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("rank ", r, " out of range [0, ", tp_, ")"));
  }
  void FillParallelism(int r, pb::RankParallelism* p) const {
    p->set_tp_size(tp_);
    p->set_tp_rank(r);
    p->set_pp_size(1);
    const int moe_tp = tp_ / cfg_.ep;
    p->set_ep_size(cfg_.ep);
    p->set_ep_rank(r / moe_tp);
    p->set_moe_tp_size(moe_tp);
    p->set_moe_tp_rank(r % moe_tp);
    p->set_attn_tp_size(tp_);
    p->set_attn_tp_rank(r);
    p->set_attn_dp_size(1);
  }

  std::string AttachMessage(const pb::AttachRequest& req, int r) const {
    const int moe_tp = tp_ / cfg_.ep;
    nlohmann::json par = {{"tp_size", tp_},      {"tp_rank", r},      {"pp_size", 1},       {"pp_rank", 0},
                          {"ep_size", cfg_.ep},  {"ep_rank", r / moe_tp}, {"moe_tp_size", moe_tp},
                          {"moe_tp_rank", r % moe_tp},
                          {"attn_tp_size", tp_}, {"attn_tp_rank", r}, {"attn_dp_size", 1},  {"attn_dp_rank", 0}};
    nlohmann::json segs = nlohmann::json::array(), params = nlohmann::json::array();
    const RankMemory& mem = *memory_[r];
    for (size_t i = 0; i < mem.segments().size(); ++i)
      segs.push_back({{"id", i},
                      {"kind", "host"},
                      {"bytes", mem.segments()[i].bytes},
                      {"weights", mem.draft(static_cast<int>(i)) ? "draft" : "target"}});
    const int shift = staging_ ? mem.per_copy() : 0;
    const auto& ps = layouts_[r].params;
    for (size_t i = 0; i < ps.size(); ++i)
      params.push_back({{"name", ps[i].name}, {"dtype", std::string(DTypeName(ps[i].dtype))}, {"shape", ps[i].shape},
                        {"segment", mem.placement(i).segment}, {"offset", mem.placement(i).offset},
                        {"bytes", ps[i].bytes}});
    nlohmann::json j = {{"type", "attach"}, {"protocol", 1}, {"token", req.token()}, {"engine_id", id_},
                        {"kind", kind_}, {"mode", req.mode().empty() ? "direct" : req.mode()}, {"rank", r},
                        {"world_size", tp_}, {"parallelism", par}, {"model_config_json", config_json_},
                        {"segments", segs}, {"params", params}};
    if (shift > 0) j["staging_segment_shift"] = shift;
    // What this engine holds, reported (the daemon and the planner never read it off the parameter names): FP8
    // blocks of its config, float32 amax/448 scales (its encoder knows no other scale format).
    if (cfg_.fp8_bn > 0)
      j["quantization"] = {{"method", "fp8_block"}, {"block_size", {cfg_.fp8_bn, cfg_.fp8_bk}}, {"scale_format", ""}};
    return j.dump();
  }

  void ReadCommits() {
    while (true) {
      std::vector<pollfd> pfds{{stop_rd_.get(), POLLIN, 0}};
      for (const auto& s : attached_) pfds.push_back({s.get(), POLLIN, 0});
      if (poll(pfds.data(), pfds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (pfds[0].revents != 0) return;
      for (size_t i = 1; i < pfds.size(); ++i) {
        if (pfds[i].revents == 0) continue;
        auto f = wsync::ReceiveFds(pfds[i].fd);
        if (!f.ok()) {
          spdlog::warn("engine {} rank {}: the target closed the attach socket ({})", id_, i - 1,
                       f.status().ToString());
          return;  // the target went away; its successor calls Attach again
        }
        spdlog::debug("engine {} rank {}: {}", id_, i - 1, f->message);
      }
    }
  }

  // Refused unless every rank's copy `set` hashes to the digest the request gives for it. Callers hold serving_mu_.
  grpc::Status CheckStaging(const pb::SwitchRequest& req, int set) const {
    for (int r = 0; r < tp_; ++r) {
      const std::string have = memory_[r]->Digest(set);
      if (have != req.staging_digests(r))
        return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                            absl::StrCat("switch to version ", req.version(), " refused: rank ", r,
                                         "'s staging copy is not what was verified (", have,
                                         " != ", req.staging_digests(r), "); nothing switched"));
    }
    return grpc::Status::OK;
  }
  // Testing aid (ref_faults.h): the injected failure or hang of `call`, if one is asked for.
  grpc::Status Fault(absl::string_view call, grpc::ServerContext* ctx) {
    return faults_.At(call, [ctx] { return ctx->IsCancelled(); });
  }

  void Disarm() {
    std::lock_guard<std::mutex> l(arm_mu_);
    armed_.reset();
  }

  void CloseAttachments() {
    if (reader_.joinable()) {
      char b = 1;
      if (write(stop_wr_.get(), &b, 1) < 0) spdlog::warn("stopping the commit reader: {}", strerror(errno));
      reader_.join();
    }
    attached_.clear();  // closing the sockets detaches the ranks
  }

  std::string id_, config_json_;
  std::string kind_ = "reference";  // the layout dialect this engine's table follows (EngineInfo.kind)
  RefConfig cfg_;
  int tp_;
  std::vector<RefLayout> layouts_;
  std::vector<std::unique_ptr<RankMemory>> memory_;
  std::mutex mu_, verify_mu_, attach_mu_;
  std::unique_ptr<wsync::tools::StepFiles> step_files_;  // guarded by verify_mu_
  std::unique_ptr<std::mutex[]> rank_mu_ = nullptr;  // per rank: its memory is being loaded or verified
  std::vector<wsync::ScopedFd> attached_;  // one attach socket per rank
  wsync::ScopedFd stop_rd_, stop_wr_;
  std::thread reader_;
  bool paused_ = false;
  std::string version_ = "0";
  const bool staging_;
  // Guards live_set_: readers of the live weights (GetChecksums, Verify) hold it shared, Switch exclusively.
  mutable std::shared_mutex serving_mu_;
  int live_set_ = 0;  // which copy of the segments is live (always 0 without --staging)
  // The last successful PrepareSwitch, until the next switch or continue; guarded by arm_mu_ (taken
  // after serving_mu_, never before).
  std::mutex arm_mu_;
  std::optional<::wsync::daemon::ArmedSwitch> armed_;
  RefFaults faults_{id_};
};

// The --load-socket server: a Unix stream socket (owner only) taking one JSON request per line and answering one JSON
// line each. {"type":"load","rank":R,"file":PATH,"tensors":[{name,dtype,shape,offset,bytes}...]} loads rank R from
// the file; {"type":"verify","step":N} runs the Verify check. Connections are served concurrently (one engine
// rank's receiver each), at most kMaxConnections at a time.
class LoadServer {
 public:
  static constexpr int kMaxConnections = 64;
  static constexpr size_t kMaxRequest = 64u << 20;

  explicit LoadServer(EngineService* engine) : engine_(engine) {}
  ~LoadServer() { Stop(); }

  absl::Status Start(const std::string& path) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.empty() || path.size() >= sizeof(addr.sun_path))
      return absl::InvalidArgumentError(absl::StrCat("--load-socket path '", path, "' is empty or too long"));
    std::memcpy(addr.sun_path, path.data(), path.size());
    unlink(path.c_str());
    listen_.reset(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    const mode_t old = umask(0077);  // only this user may hand the engine weights
    const int b = listen_.valid() ? bind(listen_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) : -1;
    umask(old);
    if (b != 0 || listen(listen_.get(), 16) != 0)
      return absl::UnavailableError(absl::StrCat("--load-socket ", path, ": ", strerror(errno)));
    path_ = path;
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
    stop_rd_.reset(p[0]);
    stop_wr_.reset(p[1]);
    acceptor_ = std::thread([this] { Accept(); });
    spdlog::info("load socket {}", path);
    return absl::OkStatus();
  }

  void Stop() {
    if (!acceptor_.joinable()) return;
    char b = 1;
    if (write(stop_wr_.get(), &b, 1) < 0) spdlog::warn("stopping the load socket: {}", strerror(errno));
    acceptor_.join();
    {
      std::lock_guard<std::mutex> l(mu_);
      for (int fd : open_) shutdown(fd, SHUT_RDWR);  // wakes handlers blocked in recv
    }
    for (auto& t : handlers_) t.join();
    unlink(path_.c_str());
  }

 private:
  void Accept() {
    while (true) {
      pollfd pfds[2] = {{stop_rd_.get(), POLLIN, 0}, {listen_.get(), POLLIN, 0}};
      if (poll(pfds, 2, -1) < 0) {
        if (errno == EINTR) continue;
        return;
      }
      if (pfds[0].revents != 0) return;
      int fd = accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) continue;
      std::lock_guard<std::mutex> l(mu_);
      if (static_cast<int>(open_.size()) >= kMaxConnections) {
        spdlog::warn("load socket: more than {} connections; refusing one", kMaxConnections);
        close(fd);
        continue;
      }
      open_.push_back(fd);
      handlers_.emplace_back([this, fd] { Serve(fd); });
    }
  }

  void Serve(int fd) {
    std::string buf;
    char chunk[65536];
    while (true) {
      size_t nl;
      while ((nl = buf.find('\n')) == std::string::npos) {
        const ssize_t n = recv(fd, chunk, sizeof(chunk), 0);
        if (n <= 0 || buf.size() > kMaxRequest) return Close(fd);
        buf.append(chunk, static_cast<size_t>(n));
      }
      const std::string reply = Handle(buf.substr(0, nl)).dump() + "\n";
      buf.erase(0, nl + 1);
      for (size_t sent = 0; sent < reply.size();) {
        const ssize_t n = send(fd, reply.data() + sent, reply.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) return Close(fd);
        sent += static_cast<size_t>(n);
      }
    }
  }

  nlohmann::json Handle(const std::string& line) {
    nlohmann::json req = nlohmann::json::parse(line, nullptr, false);
    auto fail = [](const std::string& why) { return nlohmann::json{{"ok", false}, {"error", why}}; };
    if (req.is_discarded() || !req.is_object()) return fail("request is not a JSON object");
    const std::string type = req.value("type", "");
    const auto t0 = std::chrono::steady_clock::now();
    auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
    if (type == "load") {
      if (!req.contains("rank") || !req["rank"].is_number_integer() || !req.contains("file") ||
          !req["file"].is_string())
        return fail("load needs rank (integer), file and tensors");
      const int rank = req["rank"].get<int>();
      auto n = engine_->LoadFromFile(rank, req["file"].get<std::string>(),
                                     req.contains("tensors") ? req["tensors"] : nlohmann::json());
      if (!n.ok()) return fail(n.status().ToString());
      spdlog::info("load socket: rank {} loaded {} params from {} in {:.3f}s", rank, *n,
                   req["file"].get<std::string>(), seconds());
      return {{"ok", true}, {"rank", rank}, {"params", *n}, {"seconds", seconds()}};
    }
    if (type == "verify") {
      if (!req.contains("step") || !req["step"].is_number_integer()) return fail("verify needs step (integer)");
      pb::VerifyReply v;
      if (auto st = engine_->VerifyStep(req["step"].get<int64_t>(), &v); !st.ok()) return fail(st.ToString());
      return {{"ok", v.ok()},
              {"params_checked", v.params_checked()},
              {"bytes_checked", v.bytes_checked()},
              {"ranks", v.ranks()},
              {"mismatches", std::vector<std::string>(v.mismatches().begin(), v.mismatches().end())},
              {"seconds", seconds()}};
    }
    return fail(absl::StrCat("unknown request type '", type, "' (load or verify)"));
  }

  void Close(int fd) {
    std::lock_guard<std::mutex> l(mu_);
    open_.erase(std::remove(open_.begin(), open_.end(), fd), open_.end());
    close(fd);
  }

  EngineService* engine_;
  std::string path_;
  wsync::ScopedFd listen_, stop_rd_, stop_wr_;
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> open_;  // connections being served
  std::vector<std::thread> handlers_;
};

std::atomic<bool> g_stop{false};

}  // namespace
}  // namespace wsync::engine_ref

int main(int argc, char** argv) {
  using namespace wsync::engine_ref;
  CLI::App app{"wsync reference engine: holds one engine instance's TP-rank weights in shared memory (memfd)"};
  std::string id = "engine0", model, listen = "127.0.0.1:0", port_file, log_level;
  wsync::cli::AddCommonFlags(app, "wsync-engine-ref", &log_level);
  int tp = 1;
  app.add_option("--id", id, "engine instance id");
  app.add_option("--model", model, "HF config.json of the model")->required()->check(CLI::ExistingFile);
  app.add_option("--tp", tp, "tensor-parallel size (number of ranks)")->check(CLI::Range(1, 1024));
  int ep = 1;
  app.add_option("--ep", ep, "expert-parallel size inside tp (MoE models)")->check(CLI::Range(1, 1024))->capture_default_str();
  app.add_option("--listen", listen, "host:port of the control API (port 0 = any free port)");
  app.add_option("--port-file", port_file, "write the bound port here once serving");
  std::string load_socket;
  app.add_option("--load-socket", load_socket,
                 "Unix socket (owner only) on which whole HF tensors handed over in a file are loaded with the "
                 "engine's own loader, and checked (docs/engines.md)");
  bool staging = false;
  app.add_flag("--staging", staging,
               "hold a second (staging) copy of every rank's weights, so that staged updates write while the engine "
               "serves and switch by swapping the copies (doubles the memory)");
  bool draft = false;
  app.add_flag("--draft", draft,
               "every rank also holds the model's next-n (MTP) draft, as SGLang's NextN model does, in a segment of "
               "its own (weights: draft); the model's config must declare num_nextn_predict_layers 1");
  int64_t lora_rank = 0;
  std::vector<std::string> lora_targets;
  app.add_option("--lora-rank", lora_rank,
                 "serve a LoRA adapter slot of this rank instead of the model: every rank holds the adapter alone "
                 "(lora_A [r, in] / lora_B [out, r] per target module and layer, PEFT names, whole on every rank, "
                 "as vLLM holds adapters); the base weights are NOT held. It reports the config with a "
                 "\"lora_adapter\" section and the vLLM dialect; adapter updates only. Dense Llama/Qwen2/Qwen3")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  app.add_option("--lora-targets", lora_targets,
                 "with --lora-rank: the adapter's target modules, comma-separated (q_proj,k_proj,v_proj,o_proj,"
                 "gate_proj,up_proj,down_proj)")
      ->delimiter(',');
  std::string steps_dir;
  app.add_option("--steps-dir", steps_dir,
                 "Verify step N against DIR/step_NNNNNN.safetensors (`wsync-rl-steps --out DIR`) loaded by the "
                 "engine's loader, instead of the generated checkpoint of step N")
      ->check(CLI::ExistingDirectory);
  wsync::tls::Options tls_opts;
  wsync::tls::AddFlags(app, &tls_opts);
  if (int rc = wsync::cli::Parse(app, argc, argv); rc >= 0) return rc;
  wsync::InitLogging("engine-ref", log_level);
  const wsync::tls::Identity self{"wsync-engine-ref --id " + id, {wsync::tls::kEngine}, id};  // CN "engine:<id>"
  if (auto st = wsync::tls::Configure(tls_opts, {listen}, self); !st.ok()) {
    spdlog::error("{}", st.ToString());
    return 2;
  }

  std::ifstream f(model);
  std::stringstream ss;
  ss << f.rdbuf();
  auto cfg = ParseRefConfig(ss.str());
  if (!cfg.ok()) {
    spdlog::error("{}", cfg.status().ToString());
    return 2;
  }
  cfg->ep = ep;
  cfg->draft = draft;
  std::string config_json = ss.str();
  if (lora_rank > 0 || !lora_targets.empty()) {
    if (lora_rank <= 0 || lora_targets.empty()) {
      spdlog::error("--lora-rank and --lora-targets go together");
      return 2;
    }
    cfg->lora_rank = lora_rank;
    cfg->lora_targets = lora_targets;
    // What the engine serves: the base model's config plus the adapter's section (the replica plans the adapter
    // from it).
    nlohmann::json j = nlohmann::json::parse(config_json);
    j["lora_adapter"] = {{"r", lora_rank}, {"target_modules", lora_targets}};
    config_json = j.dump();
  }
  EngineService service(id, config_json, *cfg, tp, staging);
  if (!steps_dir.empty()) service.UseStepFiles(steps_dir);
  if (auto st = service.Init(); !st.ok()) {
    spdlog::error("{}", st.ToString());
    return 1;
  }
  LoadServer loader(&service);
  if (!load_socket.empty())
    if (auto st = loader.Start(load_socket); !st.ok()) {
      spdlog::error("{}", st.ToString());
      return 1;
    }
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort(listen, wsync::tls::ServerCredentials(), &port);  // mTLS unless insecure (loopback)
  b.RegisterService(&service);
  b.SetMaxReceiveMessageSize(256 << 20);
  b.SetMaxSendMessageSize(256 << 20);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (!server || port == 0) {
    spdlog::error("cannot listen on {}", listen);
    return 1;
  }
  spdlog::info("engine {} serving control API on port {}", id, port);
  if (!port_file.empty()) {
    std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << port << "\n";
    rename(tmp.c_str(), port_file.c_str());
  }
  std::signal(SIGTERM, [](int) { g_stop = true; });
  std::signal(SIGINT, [](int) { g_stop = true; });
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  spdlog::info("engine {} shutting down", id);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  loader.Stop();
  return 0;
}
