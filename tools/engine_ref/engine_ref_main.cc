// wsync-engine-ref: a reference inference engine instance. It owns each TP rank's weights in shared memory, in
// SGLang's layout, implements the engine control API, and verifies what landed in its memory against its own naive
// loader. The target wsyncd maps that memory and writes into it directly, as it would into GPU weight memory.

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/logging.h"
#include "tools/engine_ref/ref_model.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::engine_ref {
namespace {

namespace pb = ::wsync::v1;

// One rank's weight memory: a shared-memory file this process owns (removed on exit).
class RankMemory {
 public:
  ~RankMemory() {
    if (base_ != nullptr) munmap(base_, size_);
    if (!path_.empty()) unlink(path_.c_str());
  }
  absl::Status Create(const std::string& path, uint64_t size) {
    path_ = path;
    size_ = size;
    int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0) return absl::InternalError(absl::StrCat("open ", path, ": ", strerror(errno)));
    if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
      close(fd);
      return absl::InternalError(absl::StrCat("ftruncate ", path, ": ", strerror(errno)));
    }
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap ", path, ": ", strerror(errno)));
    base_ = static_cast<uint8_t*>(p);
    return absl::OkStatus();
  }
  uint8_t* data() const { return base_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
};

class EngineService final : public pb::EngineControl::Service {
 public:
  EngineService(std::string id, std::string config_json, RefConfig cfg, int tp)
      : id_(std::move(id)), config_json_(std::move(config_json)), cfg_(cfg), tp_(tp) {}

  absl::Status Init(const std::string& shm_dir) {
    for (int r = 0; r < tp_; ++r) {
      auto layout = BuildRefLayout(cfg_, tp_, r);
      if (!layout.ok()) return layout.status();
      layouts_.push_back(*std::move(layout));
      auto mem = std::make_unique<RankMemory>();
      auto st = mem->Create(absl::StrCat(shm_dir, "/wsync-engine-", id_, "-", getpid(), "-r", r),
                            layouts_.back().total_bytes);
      if (!st.ok()) return st;
      memory_.push_back(std::move(mem));
      spdlog::info("engine {} rank {}: {} params, {:.1f} MiB at {}", id_, r, layouts_.back().params.size(),
                   layouts_.back().total_bytes / 1048576.0, memory_.back()->path());
    }
    return absl::OkStatus();
  }

  grpc::Status GetInfo(grpc::ServerContext*, const pb::GetEngineInfoRequest*, pb::EngineInfo* out) override {
    std::lock_guard<std::mutex> l(mu_);
    out->set_engine_id(id_);
    out->set_num_ranks(tp_);
    out->set_model_config_json(config_json_);
    out->set_weight_version(version_);
    out->set_paused(paused_);
    out->set_kind("reference");
    return grpc::Status::OK;
  }

  grpc::Status GetParallelism(grpc::ServerContext*, const pb::RankRequest* req, pb::RankParallelism* out) override {
    if (req->rank() < 0 || req->rank() >= tp_) return BadRank(req->rank());
    FillParallelism(req->rank(), out);
    return grpc::Status::OK;
  }

  grpc::Status GetWeightLayout(grpc::ServerContext*, const pb::RankRequest* req, pb::RankLayout* out) override {
    if (req->rank() < 0 || req->rank() >= tp_) return BadRank(req->rank());
    const RefLayout& l = layouts_[req->rank()];
    out->set_rank(req->rank());
    FillParallelism(req->rank(), out->mutable_parallelism());
    for (const auto& p : l.params) {
      auto* d = out->add_params();
      d->set_name(p.name);
      d->set_dtype(std::string(DTypeName(p.dtype)));
      for (int64_t s : p.shape) d->add_shape(s);
      d->set_bytes(p.bytes);
      d->set_offset(p.offset);
    }
    out->set_region_bytes(l.total_bytes);
    out->set_memory_handle(memory_[req->rank()]->path());
    return grpc::Status::OK;
  }

  grpc::Status Pause(grpc::ServerContext*, const pb::PauseRequest* req, pb::EngineReply* out) override {
    std::lock_guard<std::mutex> l(mu_);
    paused_ = true;
    spdlog::info("engine {}: paused (mode {})", id_, req->mode().empty() ? "retract" : req->mode());
    out->set_success(true);
    out->set_message("Generation paused successfully.");
    return grpc::Status::OK;
  }

  grpc::Status PostProcess(grpc::ServerContext*, const pb::PostProcessRequest*, pb::EngineReply* out) override {
    std::lock_guard<std::mutex> l(mu_);
    if (!paused_) return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION, "post_process requires a paused engine");
    out->set_success(true);
    out->set_message("nothing to post-process for bf16 dense weights");
    return grpc::Status::OK;
  }

  grpc::Status SetWeightVersion(grpc::ServerContext*, const pb::SetWeightVersionRequest* req,
                                pb::EngineReply* out) override {
    std::lock_guard<std::mutex> l(mu_);
    version_ = req->version();
    spdlog::info("engine {}: weight version {}", id_, version_);
    out->set_success(true);
    return grpc::Status::OK;
  }

  grpc::Status Continue(grpc::ServerContext*, const pb::ContinueRequest*, pb::EngineReply* out) override {
    std::lock_guard<std::mutex> l(mu_);
    paused_ = false;
    spdlog::info("engine {}: generation continued", id_);
    out->set_success(true);
    out->set_message("Generation continued successfully.");
    return grpc::Status::OK;
  }

  grpc::Status GetChecksums(grpc::ServerContext*, const pb::RankRequest* req, pb::ChecksumReply* out) override {
    if (req->rank() < 0 || req->rank() >= tp_) return BadRank(req->rank());
    out->set_rank(req->rank());
    const uint8_t* base = memory_[req->rank()]->data();
    for (const auto& p : layouts_[req->rank()].params) {
      XXH128_hash_t h = XXH3_128bits(base + p.offset, p.bytes);
      auto* c = out->add_params();
      c->set_name(p.name);
      c->set_bytes(p.bytes);
      c->set_xxh128(absl::StrFormat("%016x%016x", h.high64, h.low64));
    }
    return grpc::Status::OK;
  }

  grpc::Status Verify(grpc::ServerContext*, const pb::VerifyRequest* req, pb::VerifyReply* out) override {
    std::lock_guard<std::mutex> vl(verify_mu_);
    int64_t checked = 0, bytes = 0;
    for (int r = 0; r < tp_; ++r) {
      const RefLayout& l = layouts_[r];
      std::vector<uint8_t> expected(l.total_bytes);
      auto st = ComputeExpected(cfg_, tp_, r, l, req->step(), expected.data());
      if (!st.ok()) return grpc::Status(grpc::StatusCode::INTERNAL, std::string(st.message()));
      const uint8_t* have = memory_[r]->data();
      for (const auto& p : l.params) {
        ++checked;
        bytes += static_cast<int64_t>(p.bytes);
        if (std::memcmp(have + p.offset, expected.data() + p.offset, p.bytes) == 0) continue;
        uint64_t i = 0;
        while (i < p.bytes && have[p.offset + i] == expected[p.offset + i]) ++i;
        if (out->mismatches_size() < 20)
          out->add_mismatches(absl::StrCat("rank ", r, ": ", p.name, " (first differing byte at ", i, " of ",
                                           p.bytes, ")"));
      }
    }
    out->set_ok(out->mismatches_size() == 0);
    out->set_params_checked(checked);
    out->set_bytes_checked(bytes);
    out->set_ranks(tp_);
    spdlog::info("engine {}: verify step {}: {} params, {} mismatched", id_, req->step(), checked,
                 out->mismatches_size());
    return grpc::Status::OK;
  }

 private:
  grpc::Status BadRank(int r) const {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("rank ", r, " out of range [0, ", tp_, ")"));
  }
  void FillParallelism(int r, pb::RankParallelism* p) const {
    p->set_tp_size(tp_);
    p->set_tp_rank(r);
    p->set_pp_size(1);
    p->set_ep_size(1);
    p->set_moe_tp_size(tp_);
    p->set_moe_tp_rank(r);
    p->set_attn_tp_size(tp_);
    p->set_attn_tp_rank(r);
    p->set_attn_dp_size(1);
  }

  std::string id_, config_json_;
  RefConfig cfg_;
  int tp_;
  std::vector<RefLayout> layouts_;
  std::vector<std::unique_ptr<RankMemory>> memory_;
  std::mutex mu_, verify_mu_;
  bool paused_ = false;
  std::string version_ = "0";
};

std::atomic<bool> g_stop{false};

}  // namespace
}  // namespace wsync::engine_ref

int main(int argc, char** argv) {
  using namespace wsync::engine_ref;
  CLI::App app{"wsync reference engine: holds one engine instance's TP-rank weights in shared memory"};
  std::string id = "engine0", model, listen = "127.0.0.1:0", port_file, shm_dir = "/dev/shm", log_level;
  int tp = 1;
  app.add_option("--id", id, "engine instance id");
  app.add_option("--model", model, "HF config.json of the model")->required()->check(CLI::ExistingFile);
  app.add_option("--tp", tp, "tensor-parallel size (number of ranks)")->check(CLI::Range(1, 1024));
  app.add_option("--listen", listen, "host:port of the control API (port 0 = any free port)");
  app.add_option("--port-file", port_file, "write the bound port here once serving");
  app.add_option("--shm-dir", shm_dir, "directory for the ranks' weight memory");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error");
  CLI11_PARSE(app, argc, argv);
  wsync::InitLogging("engine-ref", log_level);

  std::ifstream f(model);
  std::stringstream ss;
  ss << f.rdbuf();
  auto cfg = ParseRefConfig(ss.str());
  if (!cfg.ok()) {
    spdlog::error("{}", cfg.status().ToString());
    return 2;
  }
  EngineService service(id, ss.str(), *cfg, tp);
  if (auto st = service.Init(shm_dir); !st.ok()) {
    spdlog::error("{}", st.ToString());
    return 1;
  }
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort(listen, grpc::InsecureServerCredentials(), &port);
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
  return 0;
}
