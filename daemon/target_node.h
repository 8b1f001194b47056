#pragma once
// The target role of wsyncd: maps the weight memory of the engines on this node, registers it with the transport
// once, exports where each parameter lives, and accepts the sources' transport connections.

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "transport/transport.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/daemon.pb.h"
#include "wsync/v1/engine.grpc.pb.h"

namespace wsync::daemon {

// One mapped engine rank's weight memory (reference engine: a shared-memory file).
class MappedRegion {
 public:
  static absl::StatusOr<std::unique_ptr<MappedRegion>> Map(const std::string& path, uint64_t bytes);
  ~MappedRegion();
  uint8_t* data() const { return base_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* base_ = nullptr;
  uint64_t size_ = 0;
};

class TargetNode {
 public:
  TargetNode(std::string node_id, transport::Transport* transport);
  ~TargetNode();

  // Asks the engine at `address` for every rank's layout, maps and registers its memory.
  absl::Status AddEngine(const std::string& address);
  // What the coordinator needs to plan (layouts with region descriptors).
  std::vector<v1::EngineRegistration> Registrations() const;

  absl::StatusOr<v1::ConnectTargetReply> ConnectTarget(const v1::ConnectTargetRequest& req);
  v1::NodeStatus Status() const;

 private:
  struct Rank {
    v1::RankLayout layout;
    std::unique_ptr<MappedRegion> memory;
    std::unique_ptr<transport::LocalRegion> region;
  };
  struct Engine {
    std::string id, address;
    std::vector<Rank> ranks;
  };

  std::string node_id_;
  transport::Transport* transport_;
  mutable std::mutex mu_;
  std::vector<Engine> engines_;
  // One source connection per (engine, rank): the plan gives each target rank one source, and a source that
  // reconnects after a transport error replaces its broken endpoint.
  std::map<std::pair<std::string, int>, std::unique_ptr<transport::Endpoint>> endpoints_;
};

}  // namespace wsync::daemon
