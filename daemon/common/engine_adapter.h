#pragma once
// Control of one inference engine instance (all of its ranks) from the target daemon on its node: how it is told to
// attach its memory, paused, post-processed, versioned and resumed. One implementation per engine kind
// (reference: the engine's own EngineControl gRPC API; vllm: vLLM's HTTP API). The target daemon serves the
// coordinator's EngineControl calls for an engine through its adapter.
//
// Threading: the target daemon calls one method at a time per adapter; every call blocks until the engine answered
// or its timeout passed, and never holds a lock of the daemon while it waits.

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "wsync/v1/common.pb.h"

namespace wsync::daemon {

// What the target passes to an engine so that its ranks attach (docs/engines.md, "The attach protocol").
struct AttachInfo {
  std::string socket_path;
  std::string engine_id;
  std::string token;
  std::string mode;  // "staged" | "direct" (vLLM); "" = the engine's default
};

// The memory of an engine that registers it itself with a transport wsync's sources speak (SGLang: Mooncake):
// every rank's layout with one segment per region and the transport's region descriptors filled in.
struct RemoteMemory {
  std::string model_config_json;
  std::vector<v1::RankLayout> ranks;  // index = rank
};

struct EngineDescription {
  std::string engine_id;  // unique in the cluster
  std::string kind;       // "reference" | "vllm"
  int num_ranks = 0;      // ranks (workers) that will attach
  std::string weight_version;
  bool paused = false;
};

class EngineAdapter {
 public:
  virtual ~EngineAdapter() = default;

  virtual const std::string& kind() const = 0;
  // The address as given on the command line, e.g. "vllm+http://127.0.0.1:8000".
  virtual const std::string& address() const = 0;
  // The engine's own EngineControl gRPC endpoint when it has one (reference engine): the coordinator then calls it
  // directly. "" (the default) = the target daemon serves an EngineControl facade over this adapter.
  virtual std::string control_address() const { return ""; }

  virtual absl::StatusOr<EngineDescription> Describe() = 0;
  // Asks every rank to attach to the target daemon's engine socket. Returns once the engine accepted the request
  // (vLLM: when every worker's backend has attached and /init_weight_transfer_engine answered); the target
  // daemon waits for the attaches on its socket.
  virtual absl::Status RequestAttach(const AttachInfo& info) = 0;
  // True for engines whose ranks do not attach to the target daemon: their memory is already registered by the
  // engine (RemoteLayouts says where), and sources write into it directly. RequestAttach is then never called.
  virtual bool remote_memory() const { return false; }
  virtual absl::StatusOr<RemoteMemory> RemoteLayouts() {
    return absl::UnimplementedError(absl::StrCat("engine kind ", kind(), " has no remote memory"));
  }
  // mode: "abort" | "retract" | "in_place" (the coordinator's names; each adapter maps them to its engine's).
  virtual absl::Status Pause(const std::string& mode) = 0;
  // Every write of update `version` into this engine's memory has completed and every rank has been sent its
  // "commit": make the engine use the new bytes (vLLM: start_weight_update → update_weights → finish_weight_update).
  virtual absl::Status PostProcess(const std::string& version) = 0;
  virtual absl::Status SetWeightVersion(const std::string& version) = 0;
  // Resets caches that hold results computed with the old weights (prefix/KV cache) and resumes generation.
  virtual absl::Status Continue() = 0;
};

// Parses "KIND+SCHEME://HOST:PORT[?k=v&...]" (a bare "HOST:PORT" is "reference+grpc://HOST:PORT") and creates the
// adapter; InvalidArgument naming the address for an unknown kind or a malformed address.
absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeEngineAdapter(const std::string& address,
                                                                 absl::Duration call_timeout);

}  // namespace wsync::daemon
