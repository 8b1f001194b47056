#include "daemon/node/target_node.h"

#include <xxhash.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/checked_size.h"
#include "base/dtype.h"
#include "base/memory_kind.h"
#include "base/status.h"
#include "daemon/common/quantization.h"
#include "daemon/common/serve.h"
#include "daemon/common/window_assignments.h"
#include "daemon/node/node_services.h"
#include "daemon/node/relay_notice.h"
#include "replica/layout_plan.h"
#include "replica/model_config.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

using Json = nlohmann::json;

constexpr int kProtocol = 1;
// A frame that starts must arrive whole within this; a stalled peer cannot hold the loop longer.
constexpr int kFrameTimeoutMs = 10000;
// Accepted connections at once (attached ranks plus ones that have not sent their attach yet).
constexpr size_t kMaxConns = 4096;

absl::Status ErrnoError(absl::string_view what) {
  return absl::ErrnoToStatus(errno, absl::StrCat(what, ": ", std::strerror(errno)));
}

std::string RandomToken() {
  std::random_device rd;  // /dev/urandom on Linux
  std::string out;
  static const char* kHex = "0123456789abcdef";
  for (int i = 0; i < 8; ++i) {
    uint32_t v = rd();
    for (int k = 0; k < 8; ++k, v >>= 4) out.push_back(kHex[v & 0xf]);
  }
  return out;
}

bool SameToken(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string Frame(const Json& j) { return j.dump(); }

// Typed field access with errors that name the field.
absl::StatusOr<int64_t> Int(const Json& j, const char* key, bool required = true, int64_t def = 0) {
  if (!j.contains(key) || j[key].is_null()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat("attach message lacks \"", key, "\""));
    return def;
  }
  if (!j[key].is_number_integer())
    return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" must be an integer"));
  return j[key].get<int64_t>();
}
absl::StatusOr<std::string> Str(const Json& j, const char* key, bool required = true) {
  if (!j.contains(key) || j[key].is_null()) {
    if (required) return absl::InvalidArgumentError(absl::StrCat("attach message lacks \"", key, "\""));
    return std::string();
  }
  if (!j[key].is_string()) return absl::InvalidArgumentError(absl::StrCat("\"", key, "\" must be a string"));
  return j[key].get<std::string>();
}

// The parts of an attach message that do not depend on the daemon's state (docs/engines.md).
struct AttachMessage {
  std::string token, engine_id, kind, mode, model_config_json;
  int rank = 0, world_size = 0;
  v1::RankLayout layout;  // rank, parallelism, params, segments (without descriptors), region_bytes
  std::map<int, CudaSegmentDesc> cuda;  // index in layout.segments → how to import that cuda segment
};

// "0x…"/"GPU-…"-prefixed, dash-separated or plain hex into bytes; `want` bytes exactly.
absl::StatusOr<std::string> HexBytes(std::string text, size_t want, const std::string& what) {
  if (text.rfind("GPU-", 0) == 0) text = text.substr(4);
  if (text.rfind("0x", 0) == 0) text = text.substr(2);
  std::string hex;
  for (char c : text)
    if (c != '-') hex += c;
  auto val = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    const int hi = val(hex[i]), lo = val(hex[i + 1]);
    if (hi < 0 || lo < 0) return absl::InvalidArgumentError(absl::StrCat(what, " is not hexadecimal"));
    out += static_cast<char>(hi * 16 + lo);
  }
  if (hex.size() % 2 != 0 || out.size() != want)
    return absl::InvalidArgumentError(absl::StrCat(what, " must be ", want, " bytes in hex, got ", hex.size(),
                                                   " hex digits"));
  return out;
}

// The cuda-specific fields of a segment (docs/engines.md, "CUDA segments").
absl::StatusOr<CudaSegmentDesc> ParseCudaSegment(const Json& s, int64_t id, uint64_t bytes) {
  const std::string who = absl::StrCat("segment ", id);
  WSYNC_ASSIGN_OR_RETURN(std::string handle_type, Str(s, "handle_type", false));
  if (handle_type.empty()) handle_type = "cuda_ipc";
  if (handle_type == "cuda_vmm_fd" || handle_type == "vmm")
    return absl::UnimplementedError(absl::StrCat(
        who, ": VMM allocations (cuMemCreate with shareable file descriptors: vLLM sleep mode, SGLang memory "
             "saver, PyTorch expandable segments) are not supported; allocate the weights with cudaMalloc (the "
             "PyTorch caching allocator without expandable_segments) and export legacy IPC handles"));
  if (handle_type != "cuda_ipc")
    return absl::InvalidArgumentError(absl::StrCat(who, ": unknown handle_type \"", handle_type,
                                                   "\" (cuda_ipc is supported)"));
  CudaSegmentDesc d;
  d.bytes = bytes;
  WSYNC_ASSIGN_OR_RETURN(std::string handle, Str(s, "ipc_handle"));
  WSYNC_ASSIGN_OR_RETURN(d.ipc_handle, HexBytes(handle, 64, absl::StrCat(who, ": \"ipc_handle\"")));
  WSYNC_ASSIGN_OR_RETURN(std::string uuid, Str(s, "device_uuid"));
  WSYNC_ASSIGN_OR_RETURN(d.device_uuid, HexBytes(uuid, 16, absl::StrCat(who, ": \"device_uuid\"")));
  if (s.contains("offset")) {
    if (!s["offset"].is_number_unsigned())
      return absl::InvalidArgumentError(absl::StrCat(who, ": \"offset\" must be a non-negative integer"));
    d.offset = s["offset"].get<uint64_t>();
  }
  return d;
}

absl::StatusOr<AttachMessage> ParseAttach(const std::string& text, size_t num_fds) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("attach message is not valid JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError("attach message is not a JSON object");
  AttachMessage m;
  try {
    WSYNC_ASSIGN_OR_RETURN(std::string type, Str(j, "type"));
    if (type != "attach") return absl::InvalidArgumentError(absl::StrCat("expected type \"attach\", got \"", type, "\""));
    WSYNC_ASSIGN_OR_RETURN(int64_t protocol, Int(j, "protocol"));
    if (protocol != kProtocol)
      return absl::InvalidArgumentError(absl::StrCat("attach protocol ", protocol, " is not supported (this daemon "
                                                     "speaks ", kProtocol, ")"));
    WSYNC_ASSIGN_OR_RETURN(m.token, Str(j, "token"));
    WSYNC_ASSIGN_OR_RETURN(m.engine_id, Str(j, "engine_id"));
    WSYNC_ASSIGN_OR_RETURN(m.kind, Str(j, "kind"));
    WSYNC_ASSIGN_OR_RETURN(m.mode, Str(j, "mode", false));
    WSYNC_ASSIGN_OR_RETURN(m.model_config_json, Str(j, "model_config_json", false));
    WSYNC_ASSIGN_OR_RETURN(int64_t rank, Int(j, "rank"));
    WSYNC_ASSIGN_OR_RETURN(int64_t world, Int(j, "world_size"));
    if (world < 1 || world > 65536) return absl::InvalidArgumentError(absl::StrCat("world_size ", world, " is invalid"));
    if (rank < 0 || rank >= world)
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is outside [0, ", world, ")"));
    m.rank = static_cast<int>(rank);
    m.world_size = static_cast<int>(world);
    m.layout.set_rank(m.rank);

    const Json par = j.contains("parallelism") ? j["parallelism"] : Json::object();
    if (!par.is_object()) return absl::InvalidArgumentError("\"parallelism\" must be an object");
    auto* p = m.layout.mutable_parallelism();
    const std::pair<const char*, void (v1::RankParallelism::*)(int32_t)> fields[] = {
        {"tp_size", &v1::RankParallelism::set_tp_size},           {"tp_rank", &v1::RankParallelism::set_tp_rank},
        {"pp_size", &v1::RankParallelism::set_pp_size},           {"pp_rank", &v1::RankParallelism::set_pp_rank},
        {"ep_size", &v1::RankParallelism::set_ep_size},           {"ep_rank", &v1::RankParallelism::set_ep_rank},
        {"moe_tp_size", &v1::RankParallelism::set_moe_tp_size},   {"moe_tp_rank", &v1::RankParallelism::set_moe_tp_rank},
        {"attn_tp_size", &v1::RankParallelism::set_attn_tp_size}, {"attn_tp_rank", &v1::RankParallelism::set_attn_tp_rank},
        {"attn_dp_size", &v1::RankParallelism::set_attn_dp_size}, {"attn_dp_rank", &v1::RankParallelism::set_attn_dp_rank},
    };
    for (const auto& [key, set] : fields) {
      const bool is_size = std::string(key).find("_size") != std::string::npos;
      WSYNC_ASSIGN_OR_RETURN(int64_t v, Int(par, key, false, is_size ? 1 : 0));
      if (v < 0 || v > (1 << 20)) return absl::InvalidArgumentError(absl::StrCat("parallelism.", key, " = ", v));
      (p->*set)(static_cast<int32_t>(v));
    }

    if (!j.contains("segments") || !j["segments"].is_array())
      return absl::InvalidArgumentError("attach message lacks the \"segments\" array");
    const Json& segs = j["segments"];
    if (segs.empty()) return absl::InvalidArgumentError("an attach needs at least one segment");
    size_t host_segments = 0;
    bool draft_segments = false;
    std::map<int64_t, uint64_t> seg_bytes;
    uint64_t total = 0;
    for (const Json& s : segs) {
      if (!s.is_object()) return absl::InvalidArgumentError("every segment must be an object");
      WSYNC_ASSIGN_OR_RETURN(int64_t id, Int(s, "id"));
      WSYNC_ASSIGN_OR_RETURN(std::string kind_name, Str(s, "kind"));
      if (!s.contains("bytes") || !s["bytes"].is_number_unsigned())
        return absl::InvalidArgumentError(absl::StrCat("segment ", id, ": \"bytes\" must be a non-negative integer"));
      const uint64_t bytes = s["bytes"].get<uint64_t>();
      if (id < 0 || id > INT32_MAX) return absl::InvalidArgumentError(absl::StrCat("segment id ", id, " is invalid"));
      absl::StatusOr<SegmentKind> kind = ParseSegmentKind(kind_name);
      if (!kind.ok()) return Annotate(kind.status(), absl::StrCat("segment ", id));
      if (*kind == SegmentKind::kMooncake)  // written by the engine's own transfer engine, never through a daemon
        return absl::InvalidArgumentError(absl::StrCat("segment ", id, ": kind \"", kind_name,
                                                       "\" cannot be attached to a target daemon (host or cuda)"));
      if (bytes == 0) return absl::InvalidArgumentError(absl::StrCat("segment ", id, " has 0 bytes"));
      if (*kind == SegmentKind::kCuda) {
        WSYNC_ASSIGN_OR_RETURN(CudaSegmentDesc cd, ParseCudaSegment(s, id, bytes));
        m.cuda[m.layout.segments_size()] = std::move(cd);
      } else {
        ++host_segments;
      }
      if (!seg_bytes.emplace(id, bytes).second)
        return absl::InvalidArgumentError(absl::StrCat("segment id ", id, " appears twice"));
      total += bytes;
      auto* seg = m.layout.add_segments();
      seg->set_id(static_cast<int32_t>(id));
      seg->set_kind(std::string(SegmentKindName(*kind)));
      seg->set_bytes(bytes);
      // Which of the rank's models the segment holds (docs/engines.md, "Speculative drafts"); absent: the target.
      WSYNC_ASSIGN_OR_RETURN(std::string weights, Str(s, "weights", false));
      if (weights == "draft") {
        seg->set_weights(v1::WEIGHT_SET_DRAFT);
        draft_segments = true;
      } else if (!weights.empty() && weights != "target") {
        return absl::InvalidArgumentError(
            absl::StrCat("segment ", id, ": unknown \"weights\" \"", weights, "\" (target | draft)"));
      }
    }
    // A draft the model does not have is refused here, before anything is registered.
    if (draft_segments && !m.model_config_json.empty()) {
      auto config = replica::ModelConfig::FromJson(m.model_config_json);
      if (config.ok() && !replica::HasDraft(*config))
        return absl::InvalidArgumentError(absl::StrCat(
            "rank ", m.rank, " declares a draft segment, but its model (", config->architecture,
            ") has no draft: its config.json declares no next-n / MTP layer (num_nextn_predict_layers) and the engine "
            "reports no separate draft checkpoint (speculative_draft)"));
    }
    m.layout.set_region_bytes(total);
    // Staged updates: segment id + shift is the staging copy of segment id (docs/operations.md, "Staged updates").
    WSYNC_ASSIGN_OR_RETURN(int64_t shift, Int(j, "staging_segment_shift", false, 0));
    if (shift < 0 || shift > INT32_MAX)
      return absl::InvalidArgumentError(absl::StrCat("staging_segment_shift ", shift, " is invalid"));
    for (const auto& [id, bytes] : seg_bytes) {
      if (shift == 0 || id >= shift) continue;
      auto twin = seg_bytes.find(id + shift);
      if (twin == seg_bytes.end() || twin->second != bytes)
        return absl::InvalidArgumentError(
            absl::StrCat("segment ", id, " has no staging copy of its size (segment ", id + shift, ")"));
    }
    m.layout.set_staging_segment_shift(static_cast<int32_t>(shift));
    // The segments are staging memory themselves (vLLM's staged attach): this daemon hashes them for the staged
    // verify and Switch, so they must be host memory it maps.
    if (j.contains("stages_in_place") && !j["stages_in_place"].is_null()) {
      if (!j["stages_in_place"].is_boolean())
        return absl::InvalidArgumentError("\"stages_in_place\" must be a boolean");
      const bool in_place = j["stages_in_place"].get<bool>();
      if (in_place && shift > 0)
        return absl::InvalidArgumentError("stages_in_place and staging_segment_shift exclude each other");
      if (in_place && host_segments != seg_bytes.size())
        return absl::InvalidArgumentError("stages_in_place needs host segments only (cuda ones are not mapped here)");
      m.layout.set_stages_in_place(in_place);
    }
    if (host_segments != num_fds)
      return absl::InvalidArgumentError(absl::StrCat("the message lists ", host_segments, " host segments but ",
                                                     num_fds, " file descriptors came with it"));

    if (!j.contains("params") || !j["params"].is_array())
      return absl::InvalidArgumentError("attach message lacks the \"params\" array");
    std::set<std::string> names;
    // segment → (offset, end, name) for the overlap check
    std::map<int64_t, std::vector<std::tuple<uint64_t, uint64_t, std::string>>> extents;
    for (const Json& pj : j["params"]) {
      if (!pj.is_object()) return absl::InvalidArgumentError("every parameter must be an object");
      WSYNC_ASSIGN_OR_RETURN(std::string name, Str(pj, "name"));
      if (name.empty()) return absl::InvalidArgumentError("a parameter has an empty name");
      if (!names.insert(name).second)
        return absl::InvalidArgumentError(absl::StrCat("parameter ", name, " appears twice"));
      WSYNC_ASSIGN_OR_RETURN(std::string dtype_name, Str(pj, "dtype"));
      auto dtype = ParseDType(dtype_name);
      if (!dtype.ok())
        return absl::InvalidArgumentError(absl::StrCat("parameter ", name, ": unknown dtype \"", dtype_name, "\""));
      if (!pj.contains("shape") || !pj["shape"].is_array())
        return absl::InvalidArgumentError(absl::StrCat("parameter ", name, ": \"shape\" must be an array"));
      WSYNC_ASSIGN_OR_RETURN(int64_t segment, Int(pj, "segment"));
      auto seg = seg_bytes.find(segment);
      if (seg == seg_bytes.end())
        return absl::InvalidArgumentError(absl::StrCat("parameter ", name, ": no segment ", segment));
      if (!pj.contains("offset") || !pj["offset"].is_number_unsigned() || !pj.contains("bytes") ||
          !pj["bytes"].is_number_unsigned())
        return absl::InvalidArgumentError(
            absl::StrCat("parameter ", name, ": \"offset\" and \"bytes\" must be non-negative integers"));
      const uint64_t offset = pj["offset"].get<uint64_t>(), bytes = pj["bytes"].get<uint64_t>();
      auto* d = m.layout.add_params();
      d->set_name(name);
      d->set_dtype(std::string(DTypeName(*dtype)));
      d->set_segment(static_cast<int32_t>(segment));
      d->set_offset(offset);
      d->set_bytes(bytes);
      for (const Json& dim : pj["shape"]) {
        if (!dim.is_number_unsigned() || dim.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
          return absl::InvalidArgumentError(
              absl::StrCat("parameter ", name, ": shape entries must be integers in [0, 2^63)"));
        d->add_shape(dim.get<int64_t>());
      }
      WSYNC_ASSIGN_OR_RETURN(const uint64_t want,
                             ShapeBytes(d->shape(), *dtype, absl::StrCat("parameter ", name)));
      if (want != bytes)
        return absl::InvalidArgumentError(absl::StrCat("parameter ", name, ": ", dtype_name, " × shape is ", want,
                                                       " bytes, the message says ", bytes));
      if (offset > seg->second || bytes > seg->second - offset)
        return absl::InvalidArgumentError(absl::StrCat("parameter ", name, " [", offset, ", +", bytes,
                                                       ") lies outside segment ", segment, " (", seg->second,
                                                       " bytes)"));
      if (bytes > 0) extents[segment].emplace_back(offset, offset + bytes, name);
    }
    for (auto& [segment, ex] : extents) {
      std::sort(ex.begin(), ex.end());
      for (size_t i = 1; i < ex.size(); ++i)
        if (std::get<0>(ex[i]) < std::get<1>(ex[i - 1]))
          return absl::InvalidArgumentError(absl::StrCat("parameters ", std::get<2>(ex[i - 1]), " and ",
                                                         std::get<2>(ex[i]), " overlap in segment ", segment));
    }
    // How the engine holds its weights (docs/engines.md, "Quantization"): reported, never read off the names; a
    // layout with FP8 block scales that does not report it is refused here rather than at planning.
    if (j.contains("quantization")) {
      const Json& q = j["quantization"];
      if (!q.is_object()) return absl::InvalidArgumentError("\"quantization\" must be an object");
      auto* wq = m.layout.mutable_quantization();
      WSYNC_ASSIGN_OR_RETURN(*wq->mutable_method(), Str(q, "method", false));
      WSYNC_ASSIGN_OR_RETURN(*wq->mutable_scale_format(), Str(q, "scale_format", false));
      if (q.contains("block_size")) {
        if (!q["block_size"].is_array()) return absl::InvalidArgumentError("quantization.block_size must be an array");
        for (const Json& b : q["block_size"]) {
          if (!b.is_number_integer() || b.get<int64_t>() <= 0 || b.get<int64_t>() > (1 << 20))
            return absl::InvalidArgumentError("quantization.block_size must hold positive integers");
          wq->add_block_size(b.get<int32_t>());
        }
      }
    }
    WSYNC_RETURN_IF_ERROR(QuantSpecOfLayout(m.layout, absl::StrCat("engine ", m.engine_id, " rank ", m.rank)).status());
  } catch (const std::exception& e) {  // nlohmann type errors on values we did not check by hand
    return absl::InvalidArgumentError(absl::StrCat("malformed attach message: ", e.what()));
  }
  return m;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MappedSegment>> MappedSegment::Map(int fd, uint64_t bytes, const std::string& who) {
  struct stat st {};
  if (fstat(fd, &st) != 0) return ErrnoError(absl::StrCat("fstat ", who));
  if (!S_ISREG(st.st_mode))
    return absl::InvalidArgumentError(absl::StrCat(who, " is not a shared-memory file (memfd or tmpfs file)"));
  if (static_cast<uint64_t>(st.st_size) < bytes)
    return absl::InvalidArgumentError(
        absl::StrCat(who, " is ", st.st_size, " bytes, smaller than the ", bytes, " its segment declares"));
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoError(absl::StrCat("mmap ", who));
  auto r = std::unique_ptr<MappedSegment>(new MappedSegment());
  r->base_ = static_cast<uint8_t*>(p);
  r->size_ = bytes;
  return r;
}

MappedSegment::~MappedSegment() {
  if (base_ != nullptr && munmap(base_, size_) != 0) spdlog::warn("munmap engine memory: {}", strerror(errno));
}

std::string DefaultEngineSocket(int port) { return DefaultSocketPath(absl::StrCat("target-", port, ".sock")); }

TargetNode::TargetNode(TargetOptions opts, transport::Transport* transport)
    : opts_(std::move(opts)), transport_(transport) {}

TargetNode::~TargetNode() {
  if (loop_.joinable()) {
    stop_ = true;
    char b = 1;
    if (write(wake_wr_.get(), &b, 1) < 0) spdlog::warn("waking the engine socket loop: {}", strerror(errno));
    loop_.join();
  }
  if (listen_fd_.valid()) {
    listen_fd_.reset();
    if (unlink(opts_.engine_socket.c_str()) != 0 && errno != ENOENT)
      spdlog::warn("removing engine socket {}: {}", opts_.engine_socket, strerror(errno));
  }
  for (auto& [id, e] : engines_)
    if (e->facade_server) e->facade_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  {
    // Forwarders write from the engines' registrations: they go first.
    std::lock_guard<std::mutex> l(relay_mu_);
    relays_.clear();
  }
  endpoints_.clear();
  conns_.clear();
  // Registrations go before the mappings they cover (Rank's member order), engines after their servers.
  engines_.clear();
}

void TargetNode::TakeAssignments(const v1::SetWriteWindowRequest& req) {
  assignments_.clear();
  assigned_writes_.clear();
  for (const auto& a : req.assignments()) {
    assignments_.insert({a.source_node(), a.engine_id(), a.rank()});
    assigned_writes_[{a.source_node(), a.engine_id(), a.rank()}].assign(a.writes().begin(), a.writes().end());
  }
  // Computed here from what arrived, not taken from the request: a later request naming a digest is matched
  // against these assignments only.
  assignments_digest_ = WindowAssignmentsDigest(req.assignments());
  assignments_known_ = true;
}

int TargetNode::RevokeUnassignedGrants() {
  // The plan decides who may write where: grants for ranks the plan does not give their source are revoked.
  int revoked = 0;
  transport_->RevokeGrants([&](const transport::Transport::WriteGrant& g) {
    const size_t colon = g.peer.find(':');
    if (colon == std::string::npos) return true;  // an insecure daemon's grant: no identity to compare
    const std::string id = g.peer.substr(colon + 1);
    const size_t slash = g.scope.rfind('/');
    int rank = -1;
    if (slash == std::string::npos || !absl::SimpleAtoi(g.scope.substr(slash + 1), &rank)) return false;
    const bool keep = assignments_.count({id, g.scope.substr(0, slash), rank}) > 0;
    revoked += !keep;
    return keep;
  });
  return revoked;
}

void TargetNode::DropUnassignedConnections(std::vector<Connection>* dropped) {
  for (auto it = endpoints_.begin(); it != endpoints_.end();) {
    const auto& [engine, rank, who] = it->first;
    if (it->second.source_id.empty() || assignments_.count({it->second.source_id, engine, rank}) > 0) {
      ++it;
      continue;
    }
    spdlog::info("engine {} rank {}: the plan no longer gives it to source {}; its connection{} dropped", engine, rank,
                 it->second.source_id, it->second.staging ? " and delta staging" : "");
    dropped->push_back(std::move(it->second));
    it = endpoints_.erase(it);
  }
}

v1::SetWriteWindowReply TargetNode::SetWriteWindow(const v1::SetWriteWindowRequest& req) {
  // Connections a re-plan took from their source; destroyed after mu_ is released (declared before the lock).
  std::vector<Connection> dropped;
  std::lock_guard<std::mutex> l(mu_);
  v1::SetWriteWindowReply out;
  const WindowAssignmentsAction what = DecideWindowAssignments(req, assignments_known_ ? assignments_digest_ : "");
  if (what == WindowAssignmentsAction::kMissing) {
    // Opening with assignments other than the plan's would narrow grants and check delta records against a stale
    // plan: nothing changes until the coordinator sends them.
    out.set_assignments_missing(true);
    out.set_assignments_digest(assignments_known_ ? assignments_digest_ : "");
    out.set_enforced(window_enforced_);
    out.set_refused_writes(transport_->refused_writes());
    spdlog::info("write window for update {} not opened: the coordinator named assignments {}, this target holds {}",
                 req.version(), req.assignments_digest(), assignments_known_ ? assignments_digest_ : "none");
    return out;
  }
  if (what == WindowAssignmentsAction::kTake) TakeAssignments(req);
  if (what == WindowAssignmentsAction::kNone && req.open()) {
    assignments_known_ = false;  // a coordinator that sends no assignments: grants are not narrowed
    assignments_digest_.clear();
    assigned_writes_.clear();
  }
  if (req.open() && assignments_known_) {
    // Kept assignments too: a grant given since the last opening is checked against the plan like the others.
    out.set_grants_revoked(RevokeUnassignedGrants());
    DropUnassignedConnections(&dropped);
    out.set_assignments_digest(assignments_digest_);
  }
  if (req.open()) {
    // Sources may write staging memory again: no switch prepared before counts any more.
    for (auto& [id, e] : engines_) e->armed_switch.reset();
    OpenDeltaWindow(req.version(), &out);
  }
  absl::Status st = transport_->SetWriteWindow(req.open());
  window_enforced_ = st.ok();
  window_open_ = req.open();
  out.set_enforced(window_enforced_);
  out.set_refused_writes(transport_->refused_writes());
  spdlog::info("write window {} for update {}{}", req.open() ? "opened" : "closed", req.version(),
               window_enforced_ ? "" : " (not enforced by this transport)");
  return out;
}

absl::Status TargetNode::Start() {
  // Writes only on connections granted by ConnectTarget (tcp: a write secret; verbs: the rank's MRs in the
  // connection's own protection domain); a backend that cannot enforce it (mooncake) keeps plain connections.
  if (auto st = transport_->RequireGrants(true); st.ok()) {
    grants_enforced_ = true;
  } else {
    spdlog::warn("{}: a source connection needs no per-connection secret", std::string(st.message()));
  }
  // No writes into engine memory until the coordinator opens the window for an update.
  if (auto st = transport_->SetWriteWindow(false); st.ok()) {
    window_enforced_ = true;
  } else {
    spdlog::warn("{}: engines on this node accept writes at any time", std::string(st.message()));
  }
  const std::string& path = opts_.engine_socket;
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(
        absl::StrCat("engine socket path '", path, "' is empty or longer than ", sizeof(addr.sun_path) - 1));
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0)
    WSYNC_RETURN_IF_ERROR_CTX(MakeDirs(path.substr(0, slash), 0711), "engine socket directory");
  // A socket left behind by a daemon that died is replaced; anything else at the path is not ours to remove.
  struct stat st {};
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode))
      return absl::FailedPreconditionError(absl::StrCat("engine socket path ", path, " exists and is not a socket"));
    unlink(path.c_str());
  }
  ScopedFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return ErrnoError("engine socket");
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    return ErrnoError(absl::StrCat("bind engine socket ", path));
  // Other uids may connect only when named with --engine-uid; SO_PEERCRED is checked either way.
  chmod(path.c_str(), opts_.engine_uids.empty() ? 0600 : 0666);
  if (listen(fd.get(), 128) != 0) return ErrnoError(absl::StrCat("listen on engine socket ", path));
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) return ErrnoError("pipe");
  wake_rd_.reset(pipefd[0]);
  wake_wr_.reset(pipefd[1]);
  listen_fd_ = std::move(fd);
  loop_ = std::thread([this] { Loop(); });
  spdlog::info("engine socket {} (peers: uid {}{}{})", path, getuid(), opts_.engine_uids.empty() ? "" : ", ",
               absl::StrJoin(opts_.engine_uids, ", "));
  return absl::OkStatus();
}

void TargetNode::Loop() {
  while (!stop_) {
    std::vector<pollfd> pfds;
    pfds.push_back({wake_rd_.get(), POLLIN, 0});
    pfds.push_back({listen_fd_.get(), POLLIN, 0});
    for (const auto& [fd, c] : conns_) pfds.push_back({fd, POLLIN, 0});
    int n = poll(pfds.data(), pfds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("engine socket poll: {}", strerror(errno));
      return;
    }
    if (pfds[0].revents != 0) return;
    if (pfds[1].revents & POLLIN) Accept();
    for (size_t i = 2; i < pfds.size(); ++i) {
      if (pfds[i].revents == 0) continue;
      auto it = conns_.find(pfds[i].fd);
      if (it == conns_.end()) continue;
      std::shared_ptr<Conn> c = it->second;
      if (!Serve(c)) conns_.erase(pfds[i].fd);
    }
  }
}

void TargetNode::Accept() {
  ScopedFd fd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (!fd.valid()) {
    spdlog::warn("engine socket accept: {}", strerror(errno));
    return;
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    spdlog::warn("engine socket: SO_PEERCRED: {}", strerror(errno));
    return;
  }
  const bool allowed = cred.uid == getuid() || std::find(opts_.engine_uids.begin(), opts_.engine_uids.end(),
                                                         cred.uid) != opts_.engine_uids.end();
  if (!allowed || conns_.size() >= kMaxConns) {
    const std::string why = !allowed ? absl::StrCat("uid ", cred.uid, " may not attach (allowed: ", getuid(),
                                                    opts_.engine_uids.empty() ? "" : ", ",
                                                    absl::StrJoin(opts_.engine_uids, ", "), "; see --engine-uid)")
                                     : absl::StrCat("too many engine connections (", kMaxConns, ")");
    spdlog::warn("engine socket: refused pid {}: {}", cred.pid, why);
    timeval tv{1, 0};
    setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    (void)SendFds(fd.get(), {}, Frame({{"type", "attached"}, {"ok", false}, {"error", why}}));
    return;
  }
  // Bounds how long one frame may take, so a stalled peer cannot hold the loop (and the commit sends).
  timeval tv{kFrameTimeoutMs / 1000, 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  auto c = std::make_shared<Conn>();
  c->uid = cred.uid;
  const int raw = fd.get();
  c->fd = std::move(fd);
  conns_[raw] = std::move(c);
}

bool TargetNode::Serve(const std::shared_ptr<Conn>& c) {
  auto frame = ReceiveFds(c->fd.get(), opts_.max_attach_bytes);
  if (!frame.ok()) {
    Detach(c, absl::IsUnavailable(frame.status()) ? "closed its attach socket" : frame.status().ToString());
    return false;
  }
  std::string type;
  try {
    Json j = Json::parse(frame->message);
    if (j.is_object() && j.contains("type") && j["type"].is_string()) type = j["type"].get<std::string>();
  } catch (const std::exception&) {
  }
  if (type == "detach") {
    Detach(c, "detached");
    return false;
  }
  if (type != "attach" || c->rank >= 0) {
    const std::string why = c->rank >= 0 ? absl::StrCat("unexpected message type \"", type, "\" after attach")
                                         : "the first message must be an attach";
    Detach(c, why);
    std::lock_guard<std::mutex> l(c->send_mu);
    (void)SendFds(c->fd.get(), {}, Frame({{"type", "attached"}, {"ok", false}, {"error", why}}));
    return false;
  }
  absl::Status st = Attach(c, frame->message, std::move(frame->fds));
  Json reply = {{"type", "attached"}, {"ok", st.ok()}};
  if (!st.ok()) {
    reply["error"] = std::string(st.message());
    spdlog::warn("engine attach refused: {}", st.ToString());
  }
  absl::Status sent;
  {
    std::lock_guard<std::mutex> l(c->send_mu);
    sent = SendFds(c->fd.get(), {}, Frame(reply));
  }
  if (st.ok() && !sent.ok()) {
    Detach(c, absl::StrCat("cannot send its attach reply: ", sent.ToString()));
    return false;
  }
  return st.ok();
}

absl::Status TargetNode::Attach(const std::shared_ptr<Conn>& c, const std::string& msg, std::vector<ScopedFd> fds) {
  WSYNC_ASSIGN_OR_RETURN(AttachMessage m, ParseAttach(msg, fds.size()));
  const std::string who = absl::StrCat("engine ", m.engine_id, " rank ", m.rank);
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = engines_.find(m.engine_id);
    // The same answer for an unknown engine and a wrong token: the socket does not reveal which engines exist.
    if (it == engines_.end() || !SameToken(it->second->token, m.token))
      return absl::PermissionDeniedError(absl::StrCat(who, ": the token is not valid for this engine"));
    Engine& e = *it->second;
    if (m.kind != e.kind)
      return absl::InvalidArgumentError(absl::StrCat(who, ": attaches as kind ", m.kind, " but the engine is ", e.kind));
    if (m.world_size != e.num_ranks)
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": world_size ", m.world_size, " but the engine has ", e.num_ranks, " ranks"));
    if (e.ranks[m.rank].state == Rank::State::kAttached)
      return absl::AlreadyExistsError(absl::StrCat(who, " is already attached"));
  }
  // Map and register outside the lock: registration can take long (verbs pins the memory).
  Rank r;
  r.layout = m.layout;
  absl::Time t0 = absl::Now();
  size_t next_fd = 0;
  for (int i = 0; i < m.layout.segments_size(); ++i) {
    auto* seg = r.layout.mutable_segments(i);
    const std::string swho = absl::StrCat(who, " segment ", seg->id());
    if (auto cd = m.cuda.find(i); cd != m.cuda.end()) {
      // GPU memory: imported once here; the transport writes it through the segment's staging sink.
      WSYNC_ASSIGN_OR_RETURN(auto cuda, opts_.import_cuda_segment ? opts_.import_cuda_segment(cd->second, swho)
                                                                  : ImportCudaSegment(cd->second, swho));
      auto region = transport_->RegisterSink(cuda->sink());
      if (!region.ok()) return Annotate(region.status(), absl::StrCat("registering ", swho));
      seg->set_region_descriptor((*region)->Descriptor());
      std::string path = (*region)->DevicePath();
      if (path.empty()) path = absl::StrCat("staging (", transport_->name(), ")");
      spdlog::info("{} on {}: writes reach it by {}", swho, cuda->device(), path);
      r.cuda_paths.push_back(absl::StrCat("segment ", seg->id(), ": ", path));
      r.cuda.push_back(std::move(cuda));
      r.regions.push_back(*std::move(region));
      continue;
    }
    WSYNC_ASSIGN_OR_RETURN(auto mem, MappedSegment::Map(fds[next_fd++].get(), seg->bytes(), swho));
    auto region = transport_->RegisterMemory(mem->data(), seg->bytes());
    if (!region.ok()) return Annotate(region.status(), absl::StrCat("registering ", swho));
    seg->set_region_descriptor((*region)->Descriptor());
    r.memory.push_back(std::move(mem));
    r.regions.push_back(*std::move(region));
  }
  r.state = Rank::State::kAttached;
  r.conn = c;
  std::lock_guard<std::mutex> l(mu_);
  r.attach_gen = ++attach_gen_;
  auto it = engines_.find(m.engine_id);
  if (it == engines_.end()) return absl::NotFoundError(absl::StrCat(who, ": the engine went away"));
  Engine& e = *it->second;
  if (e.ranks[m.rank].state == Rank::State::kAttached)
    return absl::AlreadyExistsError(absl::StrCat(who, " is already attached"));
  if (e.ranks[m.rank].state == Rank::State::kDetached)
    spdlog::warn("{} attached again; the coordinator keeps the plan built from its first attach", who);
  if (m.rank == 0 || e.model_config_json.empty()) e.model_config_json = m.model_config_json;
  // The previous mapping of a re-attaching rank stays until here (a source may still write into it); it goes when
  // `old` does, registrations before mappings.
  Rank old = std::move(e.ranks[m.rank]);
  e.ranks[m.rank] = std::move(r);
  c->engine_id = m.engine_id;
  c->rank = m.rank;
  spdlog::info("{} attached (kind {}, mode {}): {} params in {} segments, {:.1f} MiB mapped and registered in {:.3f}s",
               who, m.kind, m.mode.empty() ? "-" : m.mode, m.layout.params_size(), m.layout.segments_size(),
               m.layout.region_bytes() / 1048576.0, absl::ToDoubleSeconds(absl::Now() - t0));
  attached_cv_.notify_all();
  return absl::OkStatus();
}

void TargetNode::Detach(const std::shared_ptr<Conn>& c, const std::string& why) {
  if (c->rank < 0) {
    spdlog::debug("engine socket: a connection that never attached went away ({})", why);
    return;
  }
  std::lock_guard<std::mutex> l(mu_);
  auto it = engines_.find(c->engine_id);
  if (it == engines_.end()) return;
  Rank& r = it->second->ranks[c->rank];
  if (r.conn != c) return;  // replaced by a newer attach already
  // The mapping and registration stay: a source may still be writing; they go when the rank attaches again.
  r.state = Rank::State::kDetached;
  r.conn.reset();
  spdlog::warn("engine {} rank {} detached ({}); the engine is unusable until the rank attaches again",
               c->engine_id, c->rank, why);
}

absl::Status TargetNode::AddEngine(std::unique_ptr<EngineAdapter> adapter) {
  const std::string address = adapter->address();
  WSYNC_ASSIGN_OR_RETURN(EngineDescription desc, adapter->Describe());
  if (desc.engine_id.empty()) return absl::InvalidArgumentError(absl::StrCat("engine at ", address, " has no id"));
  if (desc.num_ranks < 1 || desc.num_ranks > 65536)
    return absl::InvalidArgumentError(absl::StrCat("engine ", desc.engine_id, " at ", address, " reports ",
                                                   desc.num_ranks, " ranks"));
  auto e = std::make_unique<Engine>();
  e->id = desc.engine_id;
  e->kind = desc.kind.empty() ? adapter->kind() : desc.kind;
  e->num_ranks = desc.num_ranks;
  e->version = desc.weight_version;
  e->paused = desc.paused;
  e->token = RandomToken();
  e->control_address = adapter->control_address();
  e->ranks.resize(desc.num_ranks);
  EngineAdapter* a = adapter.get();
  e->adapter = std::move(adapter);
  AttachInfo info{opts_.engine_socket, e->id, e->token, ""};
  Engine* engine = e.get();
  {
    std::lock_guard<std::mutex> l(mu_);
    if (!engines_.emplace(e->id, std::move(e)).second)
      return absl::AlreadyExistsError(absl::StrCat("engine ", desc.engine_id, " (", address, ") is added twice"));
  }
  auto forget = [&](const absl::Status& st) {
    std::lock_guard<std::mutex> l(mu_);
    engines_.erase(desc.engine_id);  // its ranks' registrations and mappings go with it
    return st;
  };
  absl::Time t0 = absl::Now();
  if (a->remote_memory()) {
    // The engine registered its memory itself (SGLang + Mooncake): take its layouts as they are; sources write
    // into it directly, nothing attaches here.
    auto remote = a->RemoteLayouts();
    if (!remote.ok()) return forget(remote.status());
    if (static_cast<int>(remote->ranks.size()) != desc.num_ranks)
      return forget(absl::InternalError(absl::StrCat("engine ", desc.engine_id, ": ", remote->ranks.size(),
                                                     " rank layouts for ", desc.num_ranks, " ranks")));
    std::lock_guard<std::mutex> l(mu_);
    engine->model_config_json = remote->model_config_json;
    for (int i = 0; i < desc.num_ranks; ++i) {
      engine->ranks[i].layout = std::move(remote->ranks[i]);
      engine->ranks[i].state = Rank::State::kAttached;
    }
    spdlog::info("engine {} ({}, {} ranks) at {}: layouts of its own registered memory taken in {:.3f}s",
                 desc.engine_id, engine->kind, desc.num_ranks, address, absl::ToDoubleSeconds(absl::Now() - t0));
  } else {
  spdlog::info("engine {} ({}, {} ranks) at {}: asking it to attach to {}", desc.engine_id, engine->kind,
               desc.num_ranks, address, opts_.engine_socket);
  if (auto st = a->RequestAttach(info); !st.ok())
    return forget(Annotate(st, absl::StrCat("engine ", desc.engine_id, " at ", address, ": attach request")));
  {
    std::unique_lock<std::mutex> l(mu_);
    auto all = [&] {
      for (const auto& r : engine->ranks)
        if (r.state != Rank::State::kAttached) return false;
      return true;
    };
    if (!attached_cv_.wait_for(l, absl::ToChronoSeconds(opts_.attach_timeout), all)) {
      std::vector<int> missing;
      for (int i = 0; i < engine->num_ranks; ++i)
        if (engine->ranks[i].state != Rank::State::kAttached) missing.push_back(i);
      l.unlock();
      return forget(absl::DeadlineExceededError(absl::StrCat(
          "engine ", desc.engine_id, " at ", address, ": ranks [", absl::StrJoin(missing, ","),
          "] did not attach to ", opts_.engine_socket, " within ", absl::FormatDuration(opts_.attach_timeout))));
    }
  }
  spdlog::info("engine {}: all {} ranks attached in {:.3f}s", desc.engine_id, desc.num_ranks,
               absl::ToDoubleSeconds(absl::Now() - t0));
  }
  if (engine->control_address.empty() && !opts_.facade_host.empty()) {
    auto facade = MakeEngineFacade(this, desc.engine_id);
    auto served = daemon::Serve(absl::StrCat(opts_.facade_host, ":0"), {facade.get()}, "");
    if (!served.ok()) return forget(Annotate(served.status(), absl::StrCat("engine ", desc.engine_id, " facade")));
    std::lock_guard<std::mutex> l(mu_);
    engine->control_address = absl::StrCat(opts_.facade_host, ":", served->port);
    engine->facade = std::move(facade);
    engine->facade_server = std::move(served->server);
    spdlog::info("engine {}: EngineControl facade on {}", desc.engine_id, engine->control_address);
  }
  return absl::OkStatus();
}

std::vector<v1::EngineRegistration> TargetNode::Registrations() const {
  std::lock_guard<std::mutex> l(mu_);
  std::vector<v1::EngineRegistration> out;
  for (const auto& [id, e] : engines_) {
    v1::EngineRegistration r;
    r.set_engine_id(e->id);
    r.set_kind(e->kind);
    r.set_control_address(e->control_address);
    for (const auto& rank : e->ranks) *r.add_ranks() = rank.layout;
    out.push_back(std::move(r));
  }
  return out;
}

ConnectTargetAction DecideConnectTarget(bool have_connection, bool reusable) {
  if (!have_connection) return ConnectTargetAction::kCreate;
  return reusable ? ConnectTargetAction::kReuse : ConnectTargetAction::kReplace;
}

absl::StatusOr<v1::ConnectTargetReply> TargetNode::ConnectTarget(const v1::ConnectTargetRequest& req,
                                                                 const std::string& source) {
  transport::Transport::WriteGrant grant;
  grant.peer = source.empty() ? std::string("(insecure source)") : source;
  grant.scope = absl::StrCat(req.engine_id(), "/", req.rank());
  // Without identities (insecure) sources are told apart by their transport's info, so that several sources writing
  // slices of one rank (balanced plans) do not replace each other's connection.
  const EndpointKey key{req.engine_id(), req.rank(), source.empty() ? req.source_endpoint_info() : source};
  v1::ConnectTargetReply out;
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = engines_.find(req.engine_id());
    if (it == engines_.end() || req.rank() < 0 || req.rank() >= it->second->num_ranks)
      return absl::NotFoundError(
          absl::StrCat("node ", opts_.node_id, " serves no engine ", req.engine_id(), " rank ", req.rank()));
    // While an update's window is open, only a source the plan assigned this rank may connect to it.
    const std::string source_id = source.substr(source.find(':') + 1);  // "source:train0" → "train0"
    if (window_open_ && assignments_known_ && !source.empty() &&
        assignments_.count({source_id, req.engine_id(), req.rank()}) == 0)
      return absl::PermissionDeniedError(absl::StrCat("ConnectTarget refused for ", source, ": the current plan does "
                                                      "not assign engine ", req.engine_id(), " rank ", req.rank(),
                                                      " to it"));
    // The live connection owns the rank for its source: a repeat (a retried call, a second process under the same
    // identity) gets the same grant and leaves the connection an open update writes through untouched.
    auto old = endpoints_.find(key);
    if (DecideConnectTarget(old != endpoints_.end(),
                            old != endpoints_.end() && old->second.endpoint->Reusable(req.source_endpoint_info())) ==
        ConnectTargetAction::kReuse) {
      spdlog::info("ConnectTarget from {} for engine {} rank {}: its connection is live; answered with the same grant",
                   grant.peer, req.engine_id(), req.rank());
      out.set_target_endpoint_info(old->second.endpoint->LocalInfo());
      if (const Staging* st = old->second.staging.get(); req.delta_write_bytes() > 0 && st != nullptr) {
        out.set_staging_descriptor(st->region->Descriptor());
        out.set_staging_bytes(st->bytes);
      }
      return out;
    }
    for (const auto& r : it->second->ranks[req.rank()].regions) grant.regions.push_back(r.get());
  }
  // The delta staging region (created or reused outside mu_'s registration) is written under the same grant; the
  // connection owns it from here (a region no connection names is freed).
  Connection conn;
  conn.source_id = source.empty() ? req.source_node() : source.substr(source.find(':') + 1);
  WSYNC_RETURN_IF_ERROR(ProvideStaging(req, source, &out, &grant, &conn.staging));
  // A fresh grant per source connection, for exactly this rank's regions (tcp: a write secret; verbs: the regions
  // registered again in the connection's own protection domain, once per connection, not per update); a transport
  // that cannot enforce grants gets a plain endpoint.
  auto ep = grants_enforced_ ? transport_->CreateGrantedEndpoint(grant) : transport_->CreateEndpoint();
  if (!ep.ok()) return ep.status();
  out.set_target_endpoint_info((*ep)->LocalInfo());
  WSYNC_RETURN_IF_ERROR_CTX((*ep)->Connect(req.source_endpoint_info(), absl::Seconds(30)), "accepting source for engine ",
                            req.engine_id(), " rank ", req.rank());
  conn.endpoint = *std::move(ep);
  // The connection that loses goes outside mu_ (a transport's endpoint may take a while to stop its threads);
  // replacing one revokes its grant and frees the staging only it named.
  Connection loser;
  std::lock_guard<std::mutex> l(mu_);
  auto old = endpoints_.find(key);
  const ConnectTargetAction action = DecideConnectTarget(
      old != endpoints_.end(), old != endpoints_.end() && old->second.endpoint->Reusable(req.source_endpoint_info()));
  if (action == ConnectTargetAction::kReuse) {
    // A concurrent ConnectTarget of the same source connected first: its connection stays, this one is dropped.
    out.set_target_endpoint_info(old->second.endpoint->LocalInfo());
    if (const Staging* st = old->second.staging.get(); st != nullptr) {
      out.set_staging_descriptor(st->region->Descriptor());
      out.set_staging_bytes(st->bytes);
    } else {
      out.clear_staging_descriptor();
      out.set_staging_bytes(0);
    }
    loser = std::move(conn);
  } else {
    if (action == ConnectTargetAction::kReplace) {
      spdlog::info("ConnectTarget from {} for engine {} rank {}: its previous connection is gone; replaced", grant.peer,
                   req.engine_id(), req.rank());
      loser = std::move(old->second);
    }
    endpoints_[key] = std::move(conn);
  }
  return out;
}

v1::NodeStatus TargetNode::Status() const {
  std::lock_guard<std::mutex> l(mu_);
  v1::NodeStatus s;
  s.set_node_id(opts_.node_id);
  s.set_role("target");
  s.set_transport(transport_->name());
  uint64_t bytes = 0;
  int attached = 0, ranks = 0;
  for (const auto& [id, e] : engines_)
    for (const auto& r : e->ranks) {
      bytes += r.layout.region_bytes();
      ++ranks;
      attached += r.state == Rank::State::kAttached;
    }
  s.set_replica_bytes(bytes);
  s.set_state(absl::StrCat(engines_.size(), " engines, ", attached, "/", ranks, " ranks attached, ",
                           endpoints_.size(), " source connections"));
  s.set_write_window(!window_enforced_ ? "not enforced" : (window_open_ ? "open" : "closed"));
  s.set_refused_writes(transport_->refused_writes());
  bool all_direct = false;
  for (const auto& [id, e] : engines_)
    for (size_t i = 0; i < e->ranks.size(); ++i)
      for (const std::string& p : e->ranks[i].cuda_paths) {
        if (s.cuda_segments_size() == 0) all_direct = true;
        all_direct = all_direct && absl::EndsWith(p, ": gpudirect");
        s.add_cuda_segments(absl::StrCat("engine ", id, " rank ", i, " ", p));
      }
  s.set_gpu_direct(all_direct);
  return s;
}

absl::StatusOr<TargetNode::Engine*> TargetNode::Find(const std::string& engine_id) {
  auto it = engines_.find(engine_id);
  if (it == engines_.end())
    return absl::NotFoundError(absl::StrCat("node ", opts_.node_id, " serves no engine ", engine_id));
  return it->second.get();
}

absl::StatusOr<TargetNode::Engine*> TargetNode::Usable(const std::string& engine_id) {
  WSYNC_ASSIGN_OR_RETURN(Engine * e, Find(engine_id));
  for (int i = 0; i < e->num_ranks; ++i) {
    const Rank& r = e->ranks[i];
    if (r.state == Rank::State::kAttached) continue;
    return absl::FailedPreconditionError(absl::StrCat(
        "engine ", engine_id, " rank ", i,
        r.state == Rank::State::kDetached ? " is detached (its attach socket closed)" : " has not attached",
        "; the engine is unusable until it attaches again"));
  }
  return e;
}

absl::StatusOr<TargetNode::RankView> TargetNode::ViewRank(const std::string& engine_id, int rank) {
  std::lock_guard<std::mutex> l(mu_);
  WSYNC_ASSIGN_OR_RETURN(Engine * e, Usable(engine_id));
  if (rank < 0 || rank >= e->num_ranks)
    return absl::InvalidArgumentError(
        absl::StrCat("engine ", engine_id, " has ranks [0, ", e->num_ranks, "), not ", rank));
  const Rank& r = e->ranks[rank];
  RankView out;
  out.layout = r.layout;
  // Host segments are mapped in layout order; cuda ones are not mapped here.
  size_t next = 0;
  for (const auto& seg : r.layout.segments())
    if (ParseSegmentKind(seg.kind()).value_or(SegmentKind::kHost) != SegmentKind::kCuda && next < r.memory.size())
      out.host[seg.id()] = r.memory[next++];
  return out;
}

namespace {
// XXH3-128 of every host segment of the rank in segment-id order: the whole staging memory of an engine that
// stages in place, hashed as the engine would reload it.
std::string StagingDigestOf(const std::map<int, std::shared_ptr<MappedSegment>>& host) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> st(XXH3_createState(), &XXH3_freeState);
  XXH3_128bits_reset(st.get());
  for (const auto& [id, seg] : host) XXH3_128bits_update(st.get(), seg->data(), seg->size());
  const XXH128_hash_t h = XXH3_128bits_digest(st.get());
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}
}  // namespace

absl::StatusOr<v1::ChecksumReply> TargetNode::Checksums(const std::string& engine_id, const v1::RankRequest& req) {
  // The mappings are shared: hashing runs without mu_ (a staged update's verify hashes whole models).
  WSYNC_ASSIGN_OR_RETURN(RankView view, ViewRank(engine_id, req.rank()));
  if (req.staging() && !view.layout.stages_in_place())
    return absl::FailedPreconditionError(
        absl::StrCat("engine ", engine_id, " rank ", req.rank(), " offers no staging memory this daemon can hash"));
  std::map<std::string, const v1::ParamDesc*> params;
  for (const auto& p : view.layout.params()) params[p.name()] = &p;
  v1::ChecksumReply out;
  out.set_rank(req.rank());
  if (req.staging()) out.set_staging_digest(StagingDigestOf(view.host));
  auto hash = [&](const v1::ParamDesc& p, uint64_t offset, uint64_t length, bool range) -> absl::Status {
    auto seg = view.host.find(p.segment());
    if (seg == view.host.end())
      return absl::FailedPreconditionError(absl::StrCat("engine ", engine_id, " rank ", req.rank(), ": ", p.name(),
                                                        " is in cuda segment ", p.segment(),
                                                        ", which this daemon does not map (no checksum)"));
    if (p.offset() + p.bytes() > seg->second->size())
      return absl::InternalError(absl::StrCat(p.name(), " lies outside its segment"));
    const XXH128_hash_t h = XXH3_128bits(seg->second->data() + p.offset() + offset, length);
    auto* c = out.add_params();
    c->set_name(p.name());
    c->set_offset(offset);
    c->set_bytes(length);
    c->set_range(range);
    c->set_xxh128(absl::StrFormat("%016x%016x", h.high64, h.low64));
    return absl::OkStatus();
  };
  if (req.ranges_size() == 0) {
    for (const auto& p : view.layout.params()) WSYNC_RETURN_IF_ERROR(hash(p, 0, p.bytes(), false));
    return out;
  }
  for (const auto& q : req.ranges()) {
    auto it = params.find(q.param());
    if (it == params.end())
      return absl::NotFoundError(absl::StrCat("engine ", engine_id, " rank ", req.rank(), " has no parameter ",
                                              q.param()));
    if (q.offset() > it->second->bytes() || q.length() > it->second->bytes() - q.offset())
      return absl::InvalidArgumentError(absl::StrCat("range [", q.offset(), ", +", q.length(), ") of ", q.param(),
                                                     " is outside its ", it->second->bytes(), " bytes"));
    WSYNC_RETURN_IF_ERROR(hash(*it->second, q.offset(), q.length(), true));
  }
  return out;
}

absl::Status TargetNode::Switch(const std::string& engine_id, const v1::SwitchRequest& req, bool prepare) {
  int num_ranks = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    WSYNC_ASSIGN_OR_RETURN(Engine * e, Usable(engine_id));
    num_ranks = e->num_ranks;
  }
  if (req.staging_digests_size() != num_ranks)
    return absl::InvalidArgumentError(absl::StrCat("engine ", engine_id, ": switch to version ", req.version(),
                                                   " carries ", req.staging_digests_size(),
                                                   " staging digests; the engine has ", num_ranks, " ranks"));
  // Nothing is swapped here: the engine's post-processing (vLLM's reload) makes the staging memory live. What the
  // switch guarantees is that it reloads the bytes that were verified. A prepare (sent while the engine serves) does
  // the re-hash and arms the switch; the switch that follows it, inside the paused window, need not hash again.
  if (!prepare) {
    std::lock_guard<std::mutex> l(mu_);
    WSYNC_ASSIGN_OR_RETURN(Engine * e, Usable(engine_id));
    const bool checked = SwitchMaySkipRehash(e->armed_switch, req, 0);
    e->armed_switch.reset();  // one switch per prepare
    if (checked) {
      spdlog::info("engine {}: staging memory of version {} checked by its prepare; its post-processing makes it live",
                   engine_id, req.version());
      return absl::OkStatus();
    }
  }
  absl::Status st = CheckStagingDigests(engine_id, req, num_ranks);
  std::lock_guard<std::mutex> l(mu_);
  WSYNC_ASSIGN_OR_RETURN(Engine * e, Usable(engine_id));
  if (!st.ok() || !prepare) {
    e->armed_switch.reset();
    if (st.ok())
      spdlog::info("engine {}: staging memory of version {} still as verified; its post-processing makes it live",
                   engine_id, req.version());
    return st;
  }
  // Armed only while no source can write: the window closed and enforced by the transport (where it is not, e.g. a
  // fabric provider that picks its own keys, the switch hashes again inside the paused window).
  if (!window_enforced_ || window_open_) {
    spdlog::info("engine {}: staging memory of version {} still as verified; switch not armed (write window {})",
                 engine_id, req.version(), window_open_ ? "open" : "not enforced");
    return absl::OkStatus();
  }
  e->armed_switch = ArmFrom(req, 0);
  spdlog::info("engine {}: staging memory of version {} still as verified; switch armed", engine_id, req.version());
  return absl::OkStatus();
}

absl::Status TargetNode::CheckStagingDigests(const std::string& engine_id, const v1::SwitchRequest& req,
                                             int num_ranks) {
  // The mappings are shared: hashing runs without mu_.
  for (int r = 0; r < num_ranks; ++r) {
    WSYNC_ASSIGN_OR_RETURN(RankView view, ViewRank(engine_id, r));
    if (!view.layout.stages_in_place())
      return absl::FailedPreconditionError(
          absl::StrCat("engine ", engine_id, " rank ", r, " offers no staging memory; nothing switched"));
    const std::string have = StagingDigestOf(view.host);
    if (have != req.staging_digests(r))
      return absl::FailedPreconditionError(absl::StrCat("engine ", engine_id, ": switch to version ", req.version(),
                                                        " refused: rank ", r, "'s staging memory is not what was ",
                                                        "verified (", have, " != ", req.staging_digests(r),
                                                        "); nothing switched"));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::EngineInfo> TargetNode::EngineInfo(const std::string& engine_id) {
  std::lock_guard<std::mutex> l(mu_);
  WSYNC_ASSIGN_OR_RETURN(Engine * e, Usable(engine_id));
  v1::EngineInfo out;
  out.set_engine_id(e->id);
  out.set_num_ranks(e->num_ranks);
  out.set_model_config_json(e->model_config_json);
  out.set_weight_version(e->version);
  out.set_paused(e->paused);
  out.set_kind(e->kind);
  out.set_staging(e->num_ranks > 0 && e->ranks[0].layout.stages_in_place());
  return out;
}

absl::StatusOr<v1::RankLayout> TargetNode::Layout(const std::string& engine_id, int rank) {
  std::lock_guard<std::mutex> l(mu_);
  WSYNC_ASSIGN_OR_RETURN(Engine * e, Usable(engine_id));
  if (rank < 0 || rank >= e->num_ranks)
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " out of range [0, ", e->num_ranks, ")"));
  return e->ranks[rank].layout;
}

absl::Status TargetNode::CallEngine(const std::string& engine_id, const char* what,
                                  const std::function<absl::Status(EngineAdapter*)>& call,
                                  const std::function<void(Engine*)>& record) {
  EngineAdapter* a;
  Engine* e;
  {
    std::lock_guard<std::mutex> l(mu_);
    WSYNC_ASSIGN_OR_RETURN(e, Usable(engine_id));
    a = e->adapter.get();
  }
  std::lock_guard<std::mutex> call_lock(e->call_mu);
  WSYNC_RETURN_IF_ERROR_CTX(call(a), "engine ", engine_id, " ", what);
  std::lock_guard<std::mutex> l(mu_);
  record(e);
  return absl::OkStatus();
}

absl::Status TargetNode::Pause(const std::string& engine_id, const std::string& mode) {
  return CallEngine(
      engine_id, "pause", [&](EngineAdapter* a) { return a->Pause(mode); }, [](Engine* e) { e->paused = true; });
}

absl::Status TargetNode::PostProcess(const std::string& engine_id, const std::string& version) {
  EngineAdapter* a;
  Engine* e;
  std::vector<std::pair<int, std::shared_ptr<Conn>>> conns;
  std::vector<std::pair<int, transport::LocalRegion*>> settle;
  {
    std::lock_guard<std::mutex> l(mu_);
    WSYNC_ASSIGN_OR_RETURN(e, Usable(engine_id));
    a = e->adapter.get();
    for (int i = 0; i < e->num_ranks; ++i) {
      conns.emplace_back(i, e->ranks[i].conn);
      if (!e->ranks[i].cuda.empty())
        for (auto& region : e->ranks[i].regions) settle.emplace_back(i, region.get());
    }
  }
  std::lock_guard<std::mutex> call(e->call_mu);
  // Device memory a NIC wrote through a host mirror (verbs without GPUDirect) is copied to the GPU before the engine
  // hears of the update; for every other region this does nothing.
  for (auto& [rank, region] : settle)
    WSYNC_RETURN_IF_ERROR_CTX(region->Settle(), "engine ", engine_id, " rank ", rank, ": settling version ", version);
  const std::string commit = Frame({{"type", "commit"}, {"version", version}});
  for (auto& [rank, c] : conns) {
    if (c == nullptr) continue;  // an engine with remote memory: no attach connection, the adapter does it all
    absl::Status st;
    {
      std::lock_guard<std::mutex> l(c->send_mu);
      st = SendFds(c->fd.get(), {}, commit);
    }
    if (!st.ok())
      return Annotate(st, absl::StrCat("engine ", engine_id, " rank ", rank, ": sending commit of version ", version));
  }
  WSYNC_RETURN_IF_ERROR_CTX(a->PostProcess(version), "engine ", engine_id, " post_process");
  return absl::OkStatus();
}

absl::Status TargetNode::SetWeightVersion(const std::string& engine_id, const std::string& version) {
  return CallEngine(
      engine_id, "set_weight_version", [&](EngineAdapter* a) { return a->SetWeightVersion(version); },
      [&](Engine* e) { e->version = version; });
}

absl::Status TargetNode::Continue(const std::string& engine_id) {
  return CallEngine(
      engine_id, "continue", [](EngineAdapter* a) { return a->Continue(); },
      [](Engine* e) {
        e->paused = false;
        e->armed_switch.reset();  // continued without its switch: a later switch hashes again
      });
}

absl::StatusOr<v1::SetRelayReply> TargetNode::SetRelay(const v1::SetRelayRequest& req) {
  std::vector<RelayRankMemory> ranks;
  {
    std::lock_guard<std::mutex> l(mu_);
    WSYNC_ASSIGN_OR_RETURN(Engine * e, Usable(req.engine_id()));
    for (const Rank& r : e->ranks) {
      RelayRankMemory& m = ranks.emplace_back();
      m.layout = r.layout;
      // Host segments are mapped in layout order; regions are one per segment in layout order.
      size_t next = 0;
      for (int i = 0; i < r.layout.segments_size(); ++i) {
        const auto& seg = r.layout.segments(i);
        if (ParseSegmentKind(seg.kind()).value_or(SegmentKind::kHost) == SegmentKind::kCuda) continue;
        if (next >= r.memory.size() || i >= static_cast<int>(r.regions.size())) break;
        m.data[seg.id()] = r.memory[next]->data();
        m.keep.push_back(r.memory[next++]);
        m.regions[seg.id()] = r.regions[i].get();
      }
    }
  }
  std::shared_ptr<RelayForwarder> f;
  {
    std::lock_guard<std::mutex> l(relay_mu_);
    auto& slot = relays_[req.engine_id()];
    if (!slot) slot = std::make_shared<RelayForwarder>(opts_.node_id, transport_, DialRelayChild, CallRelayLanded);
    f = slot;
  }
  return req.adopt() ? f->Adopt(req) : f->Begin(req, std::move(ranks));
}

absl::StatusOr<std::shared_ptr<RelayForwarder>> TargetNode::RelayOf(const std::string& engine_id) {
  std::lock_guard<std::mutex> l(relay_mu_);
  auto it = relays_.find(engine_id);
  if (it == relays_.end())
    return absl::FailedPreconditionError(
        absl::StrCat("node ", opts_.node_id, ": engine ", engine_id, " is in no relay tree"));
  return it->second;
}

absl::Status TargetNode::RelayLanded(const v1::RelayLandedRequest& req) {
  auto f = RelayOf(req.engine_id());
  if (!f.ok()) return f.status();
  return (*f)->Landed(req);
}

absl::StatusOr<v1::RelayDrainReply> TargetNode::RelayDrain(const v1::RelayDrainRequest& req) {
  auto f = RelayOf(req.engine_id());
  if (!f.ok()) return f.status();
  return (*f)->Drain(req);
}

absl::StatusOr<v1::WriteChecksumsReply> TargetNode::WriteChecksums(int64_t version) {
  std::vector<std::shared_ptr<RelayForwarder>> relays;
  {
    std::lock_guard<std::mutex> l(relay_mu_);
    for (const auto& [engine, f] : relays_) relays.push_back(f);
  }
  v1::WriteChecksumsReply out;
  out.set_node_id(opts_.node_id);
  out.set_version(version);
  out.set_finished(true);
  bool any = false;
  for (const auto& f : relays) {
    auto w = f->WriteChecksums(version);
    if (!w.ok() || w->writes.empty()) continue;
    any = true;
    if (!w->finished) out.set_finished(false);
    for (auto& c : w->writes) *out.add_writes() = std::move(c);
  }
  if (!any)
    return absl::NotFoundError(
        absl::StrCat("node ", opts_.node_id, " relayed nothing of update ", version, " (no relay tree wrote from it)"));
  return out;
}

}  // namespace wsync::daemon
