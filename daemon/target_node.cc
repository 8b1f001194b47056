#include "daemon/target_node.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "proto/status_convert.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {

absl::StatusOr<std::unique_ptr<MappedRegion>> MappedRegion::Map(const std::string& path, uint64_t bytes) {
  int fd = open(path.c_str(), O_RDWR);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open engine memory ", path, ": ", strerror(errno)));
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("engine memory ", path, " is ", st.st_size, " bytes, layout needs ", bytes));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return absl::InternalError(absl::StrCat("mmap ", path, ": ", strerror(errno)));
  auto r = std::unique_ptr<MappedRegion>(new MappedRegion());
  r->base_ = static_cast<uint8_t*>(p);
  r->size_ = bytes;
  return r;
}

MappedRegion::~MappedRegion() {
  if (base_ != nullptr && munmap(base_, size_) != 0) spdlog::warn("munmap engine memory: {}", strerror(errno));
}

TargetNode::TargetNode(std::string node_id, transport::Transport* transport)
    : node_id_(std::move(node_id)), transport_(transport) {}

TargetNode::~TargetNode() {
  endpoints_.clear();
  engines_.clear();
}

absl::Status TargetNode::AddEngine(const std::string& address) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  auto stub = v1::EngineControl::NewStub(channel);
  Engine e;
  e.address = address;
  v1::EngineInfo info;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    WSYNC_RETURN_IF_ERROR_CTX(FromGrpcStatus(stub->GetInfo(&ctx, v1::GetEngineInfoRequest(), &info)),
                              "engine at ", address);
  }
  e.id = info.engine_id();
  for (int r = 0; r < info.num_ranks(); ++r) {
    Rank rank;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::RankRequest req;
    req.set_rank(r);
    WSYNC_RETURN_IF_ERROR_CTX(FromGrpcStatus(stub->GetWeightLayout(&ctx, req, &rank.layout)), "engine ", e.id,
                              " rank ", r, " layout");
    const uint64_t bytes = std::max<uint64_t>(rank.layout.region_bytes(), 1);
    WSYNC_ASSIGN_OR_RETURN(rank.memory, MappedRegion::Map(rank.layout.memory_handle(), bytes));
    absl::Time t0 = absl::Now();
    WSYNC_ASSIGN_OR_RETURN(rank.region, transport_->RegisterMemory(rank.memory->data(), bytes));
    rank.layout.set_region_descriptor(rank.region->Descriptor());
    spdlog::info("engine {} rank {}: {} params, {:.1f} MiB mapped and registered in {:.3f}s", e.id, r,
                 rank.layout.params_size(), bytes / 1048576.0, absl::ToDoubleSeconds(absl::Now() - t0));
    e.ranks.push_back(std::move(rank));
  }
  std::lock_guard<std::mutex> l(mu_);
  engines_.push_back(std::move(e));
  return absl::OkStatus();
}

std::vector<v1::EngineRegistration> TargetNode::Registrations() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<v1::EngineRegistration> out;
  for (const auto& e : engines_) {
    v1::EngineRegistration r;
    r.set_engine_id(e.id);
    r.set_control_address(e.address);
    for (const auto& rank : e.ranks) *r.add_ranks() = rank.layout;
    out.push_back(std::move(r));
  }
  return out;
}

absl::StatusOr<v1::ConnectTargetReply> TargetNode::ConnectTarget(const v1::ConnectTargetRequest& req) {
  {
    std::lock_guard<std::mutex> l(mu_);
    bool found = false;
    for (const auto& e : engines_)
      if (e.id == req.engine_id() && req.rank() >= 0 && req.rank() < static_cast<int>(e.ranks.size())) found = true;
    if (!found)
      return absl::NotFoundError(
          absl::StrCat("node ", node_id_, " serves no engine ", req.engine_id(), " rank ", req.rank()));
  }
  WSYNC_ASSIGN_OR_RETURN(auto ep, transport_->CreateEndpoint());
  v1::ConnectTargetReply out;
  out.set_target_endpoint_info(ep->LocalInfo());
  WSYNC_RETURN_IF_ERROR_CTX(ep->Connect(req.source_endpoint_info(), absl::Seconds(30)), "accepting source for engine ",
                            req.engine_id(), " rank ", req.rank());
  std::lock_guard<std::mutex> l(mu_);
  endpoints_[{req.engine_id(), req.rank()}] = std::move(ep);
  return out;
}

v1::NodeStatus TargetNode::Status() const {
  std::lock_guard<std::mutex> l(mu_);
  v1::NodeStatus s;
  s.set_node_id(node_id_);
  s.set_role("target");
  s.set_transport(transport_->name());
  uint64_t bytes = 0;
  for (const auto& e : engines_)
    for (const auto& r : e.ranks) bytes += r.layout.region_bytes();
  s.set_replica_bytes(bytes);
  s.set_state(absl::StrCat(engines_.size(), " engines, ", endpoints_.size(), " source connections"));
  return s;
}

}  // namespace wsync::daemon
