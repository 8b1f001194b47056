#include "transport/mooncake/mooncake_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <sys/uio.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "spdlog/spdlog.h"
#include "transport/mooncake/mooncake_wire.h"
#include "transport/registry.h"
#include "transport/tcp/tcp_socket.h"
#if WSYNC_WITH_VERBS
#include <infiniband/verbs.h>

#include "transport/verbs/verbs_transport.h"
#include "transport/verbs/verbs_wire.h"
#endif

namespace wsync::transport::mooncake {
namespace {

using tcp::Fd;

constexpr char kDescPrefix[] = "mooncake/1";
constexpr char kSourceOnly[] =
    "source only: writes into Mooncake Transfer Engine peers (tcp protocol v2); never receives writes";
constexpr char kSourceOnlyRdma[] =
    "source only: writes into Mooncake Transfer Engine peers (rdma: RC WRITE through wsync's verbs code); never "
    "receives writes";

std::string Range(uint64_t addr, uint64_t length) { return absl::StrFormat("[0x%x, +%d B)", addr, length); }

template <typename Pred>
bool WaitFor(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, absl::Duration d, Pred pred) {
  if (d >= absl::Hours(24 * 365)) {
    cv.wait(lock, pred);
    return true;
  }
  return cv.wait_for(lock, absl::ToChronoNanoseconds(std::max(d, absl::ZeroDuration())), pred);
}

class MooncakeLocalRegion final : public LocalRegion {
 public:
  MooncakeLocalRegion(void* addr, uint64_t length, std::unique_ptr<LocalRegion> rdma = nullptr)
      : addr_(addr), length_(length), rdma_(std::move(rdma)) {}
  void* addr() const override { return addr_; }
  uint64_t length() const override { return length_; }
  // Source memory only: nothing can write into it through this backend.
  std::string Descriptor() const override { return ""; }
  // protocol rdma: the same memory registered with the inner verbs transport (its MRs); null for tcp.
  const LocalRegion* rdma() const { return rdma_.get(); }

 private:
  void* addr_;
  uint64_t length_;
  std::unique_ptr<LocalRegion> rdma_;
};

class MooncakeRemoteRegion final : public RemoteRegion {
 public:
  MooncakeRemoteRegion(std::string session_id, uint64_t base, uint64_t length)
      : session_id_(std::move(session_id)), base_(base), length_(length) {}
  uint64_t length() const override { return length_; }
  const std::string& session_id() const { return session_id_; }
  uint64_t base() const { return base_; }

 private:
  std::string session_id_;
  uint64_t base_;
  uint64_t length_;
};

// One RDMA NIC of the peer, as its descriptor lists it (protocol rdma).
struct PeerDevice {
  std::string name;  // "mlx5_0", "rxe0"
  uint16_t lid = 0;
  std::string gid;  // 16 bytes as colon-separated hex pairs
};

// What the peer's Metadata reply tells a writer.
struct PeerSegment {
  std::string session_id;
  SessionAddress address;
  std::string protocol;
  int data_port = 0;                                   // tcp
  std::string name;                                    // the engine's segment name (= session id)
  std::string rdma_server_name;                        // rdma: the name in its NIC paths when it differs from `name`
  std::vector<PeerDevice> devices;                     // rdma
  std::vector<std::pair<uint64_t, uint64_t>> buffers;  // (addr, length), sorted by addr
  std::map<uint64_t, std::vector<uint32_t>> rkeys;     // rdma: buffer addr -> one rkey per device, devices order

  // True when [addr, addr + length) lies inside one registered buffer (the peer's own acceptance rule).
  bool Contains(uint64_t addr, uint64_t length) const {
    auto it = std::upper_bound(buffers.begin(), buffers.end(), std::make_pair(addr, UINT64_MAX));
    if (it == buffers.begin()) return false;
    --it;
    return addr - it->first <= it->second && length <= it->second - (addr - it->first);
  }
};

// For error messages: never throws, even on strings that are not UTF-8.
std::string Dump(const nlohmann::json& j) {
  std::string s = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return s.size() > 200 ? s.substr(0, 200) + "..." : s;
}

absl::StatusOr<PeerSegment> ParseRdmaSegment(PeerSegment seg, const nlohmann::json& d);

absl::StatusOr<PeerSegment> ParseSegment(const std::string& session_id, const std::string& json_text,
                                         const std::string& want_protocol) {
  nlohmann::json d = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (d.is_discarded() || !d.is_object()) {
    return absl::FailedPreconditionError("Metadata reply is not a JSON object (not a Mooncake segment descriptor)");
  }
  const std::string protocol =
      d.contains("protocol") && d["protocol"].is_string() ? d["protocol"].get<std::string>() : std::string();
  if (protocol != want_protocol) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the peer's transfer engine runs protocol \"", protocol, "\"; this wsync mooncake transport is set to \"",
        want_protocol, "\" (MooncakeOptions::protocol / WSYNC_MOONCAKE_PROTOCOL; SGLang: MOONCAKE_PROTOCOL)"));
  }
  if (protocol == "rdma") {
    PeerSegment seg;
    seg.session_id = session_id;
    seg.protocol = protocol;
    WSYNC_ASSIGN_OR_RETURN(seg.address, ParseSessionId(session_id));
    return ParseRdmaSegment(std::move(seg), d);
  }
  // An absent version means 1 (engines before the acknowledged framing).
  const nlohmann::json& ver = d.contains("tcp_proto_version") ? d["tcp_proto_version"] : nlohmann::json(1);
  if (!ver.is_number_integer() || ver.get<int64_t>() != kTcpProtoVersion) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the peer's tcp data protocol is version ", Dump(ver), "; wsync needs version ", kTcpProtoVersion,
        " (acknowledged writes; without it a writer cannot know its bytes landed)"));
  }
  PeerSegment seg;
  seg.session_id = session_id;
  seg.protocol = protocol;
  WSYNC_ASSIGN_OR_RETURN(seg.address, ParseSessionId(session_id));
  const nlohmann::json& port = d.contains("tcp_data_port") ? d["tcp_data_port"] : nlohmann::json();
  if (!port.is_number_integer() || port.get<int64_t>() <= 0 || port.get<int64_t>() > 65535) {
    return absl::FailedPreconditionError(absl::StrCat("bad or missing tcp_data_port ", Dump(port)));
  }
  seg.data_port = port.get<int>();
  const nlohmann::json& bufs = d.contains("buffers") ? d["buffers"] : nlohmann::json::array();
  if (!bufs.is_array()) return absl::FailedPreconditionError("\"buffers\" is not an array");
  for (const nlohmann::json& b : bufs) {
    if (!b.is_object() || !b.contains("addr") || !b.contains("length") || !b["addr"].is_number_unsigned() ||
        !b["length"].is_number_unsigned()) {
      return absl::FailedPreconditionError(absl::StrCat("malformed buffer entry ", Dump(b)));
    }
    seg.buffers.emplace_back(b["addr"].get<uint64_t>(), b["length"].get<uint64_t>());
  }
  std::sort(seg.buffers.begin(), seg.buffers.end());
  return seg;
}

// What one handshake exchange gives back: the reply's JSON text and the local address of the connection.
struct HandshakeReply {
  std::string json;
  std::string local_host;
  int local_port = 0;
};

// One request/reply on the handshake port (docs/mooncake-protocol.md §2): `type` frame with `body` out, one frame
// of the same type back.
absl::StatusOr<HandshakeReply> Handshake(const std::string& session_id, uint8_t type, const std::string& body,
                                         absl::Duration timeout) {
  const char* what = type == kMetadata ? "Metadata" : "Connection";
  WSYNC_ASSIGN_OR_RETURN(SessionAddress a, ParseSessionId(session_id));
  absl::StatusOr<Fd> fd = tcp::ConnectTo(a.host, a.port, timeout);
  if (!fd.ok()) {
    return Annotate(fd.status(), "handshake (is the session id right and its transfer engine running?)");
  }
  tcp::TuneSocket(fd->get(), timeout);
  HandshakeReply out;
  sockaddr_storage ss{};
  socklen_t sl = sizeof(ss);
  if (::getsockname(fd->get(), reinterpret_cast<sockaddr*>(&ss), &sl) == 0 && ss.ss_family == AF_INET) {
    const auto* sin = reinterpret_cast<const sockaddr_in*>(&ss);
    char buf[INET_ADDRSTRLEN] = {};
    if (::inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf)) != nullptr) out.local_host = buf;
    out.local_port = ntohs(sin->sin_port);
  }
  uint64_t length = 1 + body.size();
  iovec iov[3] = {{&length, sizeof(length)}, {&type, 1}, {const_cast<char*>(body.data()), body.size()}};
  WSYNC_RETURN_IF_ERROR_CTX(tcp::SendAll(fd->get(), iov, 3), "handshake: sending the ", what, " request");
  uint64_t reply_len = 0;
  WSYNC_RETURN_IF_ERROR_CTX(tcp::RecvAll(fd->get(), &reply_len, sizeof(reply_len)), "handshake: waiting for the ",
                            what, " reply");
  if (reply_len < 1 || reply_len > kMaxHandshakeFrame) {
    std::string raw(reinterpret_cast<const char*>(&reply_len), sizeof(reply_len));
    return absl::FailedPreconditionError(
        absl::StrCat("handshake: reply frame length ", reply_len, " (bytes \"", absl::CHexEscape(raw),
                     "\") is not a Mooncake handshake frame: is ", a.host, ":", a.port,
                     " a transfer engine's handshake (rpc) port?"));
  }
  std::string frame(reply_len, '\0');
  WSYNC_RETURN_IF_ERROR_CTX(tcp::RecvAll(fd->get(), frame.data(), frame.size()), "handshake: reading the ", what,
                            " reply");
  if (static_cast<uint8_t>(frame[0]) != type) {
    return absl::FailedPreconditionError(absl::StrCat("handshake: reply of type ",
                                                      static_cast<int>(static_cast<uint8_t>(frame[0])), ", want ",
                                                      static_cast<int>(type), " (", what, ")"));
  }
  out.json = frame.substr(1);
  return out;
}

// One Metadata exchange on the handshake port: the peer's segment descriptor.
absl::StatusOr<PeerSegment> FetchSegment(const std::string& session_id, absl::Duration timeout,
                                         const std::string& want_protocol) {
  // The peer ignores the requester's own descriptor; an empty object is a valid one.
  WSYNC_ASSIGN_OR_RETURN(HandshakeReply r, Handshake(session_id, kMetadata, "{}", timeout));
  absl::StatusOr<PeerSegment> seg = ParseSegment(session_id, r.json, want_protocol);
  if (!seg.ok()) return Annotate(seg.status(), "handshake");
  return seg;
}

// The rdma descriptor's devices and per-buffer keys (docs/mooncake-protocol.md §4).
absl::StatusOr<PeerSegment> ParseRdmaSegment(PeerSegment seg, const nlohmann::json& d) {
  seg.name = d.contains("name") && d["name"].is_string() ? d["name"].get<std::string>() : seg.session_id;
  if (d.contains("rdma_server_name") && d["rdma_server_name"].is_string()) {
    seg.rdma_server_name = d["rdma_server_name"].get<std::string>();
  }
  const nlohmann::json& devs = d.contains("devices") ? d["devices"] : nlohmann::json::array();
  if (!devs.is_array() || devs.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("rdma descriptor lists no devices: ", Dump(devs)));
  }
  for (const nlohmann::json& v : devs) {
    if (!v.is_object() || !v.contains("name") || !v["name"].is_string() || !v.contains("gid") ||
        !v["gid"].is_string() || !v.contains("lid") || !v["lid"].is_number_unsigned()) {
      return absl::FailedPreconditionError(absl::StrCat("malformed device entry ", Dump(v)));
    }
    seg.devices.push_back(PeerDevice{v["name"].get<std::string>(), v["lid"].get<uint16_t>(),
                                     v["gid"].get<std::string>()});
  }
  const nlohmann::json& bufs = d.contains("buffers") ? d["buffers"] : nlohmann::json::array();
  if (!bufs.is_array()) return absl::FailedPreconditionError("\"buffers\" is not an array");
  for (const nlohmann::json& b : bufs) {
    if (!b.is_object() || !b.contains("addr") || !b.contains("length") || !b["addr"].is_number_unsigned() ||
        !b["length"].is_number_unsigned() || !b.contains("rkey") || !b["rkey"].is_array()) {
      return absl::FailedPreconditionError(absl::StrCat("malformed rdma buffer entry ", Dump(b)));
    }
    std::vector<uint32_t> keys;
    for (const nlohmann::json& k : b["rkey"]) {
      if (!k.is_number_unsigned()) return absl::FailedPreconditionError(absl::StrCat("bad rkey in ", Dump(b)));
      keys.push_back(k.get<uint32_t>());
    }
    if (keys.size() != seg.devices.size()) {
      return absl::FailedPreconditionError(absl::StrCat("buffer has ", keys.size(), " rkeys for ",
                                                        seg.devices.size(), " devices: ", Dump(b)));
    }
    const uint64_t addr = b["addr"].get<uint64_t>();
    seg.buffers.emplace_back(addr, b["length"].get<uint64_t>());
    seg.rkeys[addr] = std::move(keys);
  }
  std::sort(seg.buffers.begin(), seg.buffers.end());
  return seg;
}

// One request on the wire: `length` bytes from `src` to the peer's absolute address `addr`.
struct Chunk {
  BatchId batch = 0;
  size_t write = 0;  // index of the write in its batch, for errors
  const char* src = nullptr;
  uint64_t addr = 0;
  uint64_t length = 0;
};

class MooncakeEndpoint final : public Endpoint {
 public:
  MooncakeEndpoint(const TransportOptions& opts, const MooncakeOptions& mopts)
      : mopts_(mopts),
        workers_n_(std::max(1, opts.tcp_streams)),
        io_timeout_(opts.io_timeout > absl::ZeroDuration() ? opts.io_timeout : absl::Seconds(30)) {}

  ~MooncakeEndpoint() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      for (Worker& w : workers_) w.fd.ShutdownBoth();
    }
    work_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  std::string LocalInfo() const override { return ""; }

  std::string PeerName() const override {
    return connected_ ? absl::StrCat("mooncake peer ", seg_.session_id) : "(unconnected mooncake endpoint)";
  }

  absl::Status Connect(const std::string& peer_info, absl::Duration timeout) override {
    if (connected_) return absl::FailedPreconditionError("mooncake endpoint is already connected");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!cancelled_.ok()) return Annotate(cancelled_, "mooncake endpoint was cancelled before it connected");
    }
    absl::StatusOr<PeerSegment> seg = FetchSegment(peer_info, std::min(timeout, mopts_.handshake_timeout), "tcp");
    if (!seg.ok()) return Annotate(seg.status(), absl::StrCat("mooncake peer ", peer_info));
    seg_ = std::move(*seg);
    uint64_t total = 0;
    for (const auto& b : seg_.buffers) total += b.second;
    spdlog::debug("mooncake endpoint connected to {}: data port {}, {} registered buffers ({} bytes)",
                  seg_.session_id, seg_.data_port, seg_.buffers.size(), total);
    connected_ = true;
    {
      // Under mu_: a concurrent Cancel walks workers_.
      std::lock_guard<std::mutex> lock(mu_);
      workers_.resize(static_cast<size_t>(workers_n_));
    }
    for (int i = 0; i < workers_n_; ++i) threads_.emplace_back([this, i] { WorkerLoop(workers_[i], i); });
    return absl::OkStatus();
  }

  absl::StatusOr<BatchId> Post(absl::Span<const WriteRequest> writes) override {
    if (!connected_) return absl::FailedPreconditionError("mooncake endpoint is not connected");
    uint64_t chunks = 0;
    for (size_t i = 0; i < writes.size(); ++i) {
      const WriteRequest& w = writes[i];
      WSYNC_RETURN_IF_ERROR_CTX(ValidateWrite(w), "write ", i, " to ", PeerName());
      auto* dst = dynamic_cast<const MooncakeRemoteRegion*>(w.dst);
      if (dst == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("write ", i, ": destination was not imported by mooncake"));
      }
      if (dst->session_id() != seg_.session_id) {
        return absl::InvalidArgumentError(absl::StrCat("write ", i, ": destination region is on mooncake peer ",
                                                       dst->session_id(), ", this endpoint is connected to ",
                                                       seg_.session_id));
      }
      if (mopts_.check_peer_buffers && !seg_.Contains(dst->base(), dst->length())) {
        return absl::FailedPreconditionError(absl::StrCat(
            "write ", i, " (", Range(dst->base() + w.dst_offset, w.length), ") to ", PeerName(),
            ": destination region ", Range(dst->base(), dst->length()), " lies outside every one of the ",
            seg_.buffers.size(),
            " buffers the peer registered (stale descriptor? if the peer registered memory since Connect, "
            "re-create the endpoint)"));
      }
      chunks += (w.length + mopts_.chunk_bytes - 1) / mopts_.chunk_bytes;
    }

    std::unique_lock<std::mutex> lock(mu_);
    // Bounded outstanding work: wait for earlier requests (a batch bigger than the bound goes alone).
    room_.wait(lock, [&] {
      return !broken_.ok() || outstanding_ == 0 || outstanding_ + chunks <= mopts_.max_outstanding_chunks;
    });
    if (!broken_.ok()) {
      return Annotate(broken_, "mooncake endpoint is unusable after an earlier error (re-create it)");
    }
    const BatchId id = next_batch_++;
    batches_[id] = Batch{chunks, absl::OkStatus()};
    outstanding_ += chunks;
    for (size_t i = 0; i < writes.size(); ++i) {
      const WriteRequest& w = writes[i];
      const char* src = static_cast<const char*>(w.src->addr()) + w.src_offset;
      const uint64_t addr = static_cast<const MooncakeRemoteRegion*>(w.dst)->base() + w.dst_offset;
      // Zero-length writes complete here, as in the engine's own initiator: the peer refuses size 0.
      for (uint64_t off = 0; off < w.length; off += mopts_.chunk_bytes) {
        queue_.push_back(Chunk{id, i, src + off, addr + off, std::min(mopts_.chunk_bytes, w.length - off)});
      }
    }
    lock.unlock();
    work_.notify_all();
    return id;
  }

  absl::Status Wait(BatchId batch, absl::Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown batch ", batch, " (never posted, or already waited for)"));
    }
    if (!WaitFor(done_, lock, timeout, [&] { return it->second.pending == 0 || !cancelled_.ok(); })) {
      return absl::DeadlineExceededError(absl::StrCat("batch ", batch, " to ", PeerName(), " not complete after ",
                                                      absl::FormatDuration(timeout)));
    }
    if (!cancelled_.ok()) {
      // Never reported as landed, whatever completed. Requests still on the wire finish or fail on their worker
      // thread; CompleteLocked absorbs them (the batch is gone, only outstanding_ drops).
      batches_.erase(it);
      return Annotate(cancelled_, absl::StrCat("batch ", batch, " to ", PeerName(), " cancelled"));
    }
    absl::Status s = it->second.status;
    batches_.erase(it);
    return s;
  }

  // From any thread: fails the endpoint with `why`, wakes every waiter and shuts the data connections down, so a
  // worker blocked in send or recv on a stalled peer returns at once; queued requests are dropped unsent.
  void Cancel(const absl::Status& why) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!cancelled_.ok()) return;
      cancelled_ = why.ok() ? absl::CancelledError("cancelled") : why;
      if (broken_.ok()) broken_ = cancelled_;
      for (Worker& w : workers_) w.fd.ShutdownBoth();
    }
    done_.notify_all();
    room_.notify_all();
  }

 private:
  struct Batch {
    uint64_t pending = 0;
    absl::Status status;
  };

  // One data connection, used by one worker thread; the fd is replaced only under mu_ (so the destructor can
  // shut it down to interrupt a blocked call).
  struct Worker {
    Fd fd;
  };

  void WorkerLoop(Worker& w, int index) {
    for (;;) {
      Chunk c;
      absl::Status broken;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_) {
          for (const Chunk& q : queue_) CompleteLocked(q, absl::CancelledError("mooncake endpoint destroyed"));
          queue_.clear();
          return;
        }
        c = queue_.front();
        queue_.pop_front();
        broken = broken_;
      }
      // After the first error the endpoint is dead: drain the queue without touching the network.
      absl::Status s = broken.ok() ? Send(w, c, index) : absl::AbortedError("an earlier write failed");
      std::lock_guard<std::mutex> lock(mu_);
      CompleteLocked(c, s);
    }
  }

  absl::Status Send(Worker& w, const Chunk& c, int index) {
    const bool reused = w.fd.valid();
    bool answered = false;
    absl::Status s = reused ? Request(w.fd.get(), c, &answered) : absl::UnavailableError("not connected");
    // A kept-alive connection the peer has since closed fails before any answer: the request was not applied
    // (or, if it was, re-sending the same bytes to the same address is harmless). Retry once on a fresh one.
    if (!s.ok() && !answered && s.code() == absl::StatusCode::kUnavailable && !Cancelled()) {
      ResetFd(w, Fd());
      absl::StatusOr<Fd> fd =
          tcp::ConnectTo(seg_.address.host, seg_.data_port, std::min(io_timeout_, absl::Seconds(10)));
      if (fd.ok()) {
        tcp::TuneSocket(fd->get(), io_timeout_);
        if (!ResetFd(w, std::move(*fd))) return absl::CancelledError("mooncake endpoint destroyed or cancelled");
        s = Request(w.fd.get(), c, &answered);
      } else {
        s = Annotate(fd.status(), absl::StrCat("data port ", seg_.data_port));
      }
    }
    if (s.ok()) return s;
    ResetFd(w, Fd());  // the peer closes the connection after a rejection; any other error leaves it unusable
    // No progress within the i/o timeout fails the request: Wait reads DeadlineExceeded as "still outstanding"
    // (transport.h), so the batch's answer is terminal, Unavailable.
    if (s.code() == absl::StatusCode::kDeadlineExceeded) s = absl::UnavailableError(s.message());
    return Annotate(s, absl::StrCat(PeerName(), " (connection ", index, "): batch ", c.batch, " write ", c.write,
                                    ", request ", Range(c.addr, c.length)));
  }

  // Installs `fd` as the worker's connection; false (and `fd` closed) when the endpoint is being destroyed or was
  // cancelled (Cancel shut the connections down: a new one must not be used).
  bool ResetFd(Worker& w, Fd fd) {
    std::lock_guard<std::mutex> lock(mu_);
    const bool usable = !stop_ && cancelled_.ok();
    w.fd = usable ? std::move(fd) : Fd();
    return usable;
  }

  bool Cancelled() {
    std::lock_guard<std::mutex> lock(mu_);
    return !cancelled_.ok();
  }

  // One v2 WRITE: header + payload, then the status frame. *answered: the peer sent a status frame.
  static absl::Status Request(int fd, const Chunk& c, bool* answered) {
    RequestHeader h{};
    h.size = c.length;
    h.addr = c.addr;
    h.opcode = kOpWrite | kOpV2Flag;
    iovec iov[2] = {{&h, sizeof(h)}, {const_cast<char*>(c.src), static_cast<size_t>(c.length)}};
    absl::Status sent = tcp::SendAll(fd, iov, 2);
    // A rejected request is answered before the peer reads the payload, and the peer then closes: a failed send
    // may still have a status frame waiting. Read it either way.
    uint64_t frame = 0;
    absl::Status got = tcp::RecvAll(fd, &frame, sizeof(frame));
    if (!got.ok()) {
      return sent.ok() ? Annotate(got, "waiting for the status") : Annotate(sent, "sending the request");
    }
    *answered = true;
    if ((frame >> 32) != kStatusMagic) {
      return absl::DataLossError(absl::StrFormat("status frame 0x%016x has no \"MCTV\" magic", frame));
    }
    const uint32_t code = static_cast<uint32_t>(frame);
    if (code == kStatusAddressRejected) {
      return absl::FailedPreconditionError(
          "address rejected by the peer (status 1: not inside one of its registered buffers; unregistered since "
          "Connect?)");
    }
    if (code != kStatusOk) return absl::UnknownError(absl::StrCat("unknown status code ", code, " from the peer"));
    return sent;
  }

  void CompleteLocked(const Chunk& c, const absl::Status& s) {
    if (!s.ok() && broken_.ok()) broken_ = s;
    auto it = batches_.find(c.batch);
    if (it != batches_.end()) {
      if (!s.ok() && it->second.status.ok()) it->second.status = s;
      --it->second.pending;
    }
    --outstanding_;
    done_.notify_all();
    room_.notify_all();
  }

  const MooncakeOptions mopts_;
  const int workers_n_;
  const absl::Duration io_timeout_;
  // Set by Connect, read-only afterwards (workers start at the end of Connect).
  bool connected_ = false;
  PeerSegment seg_;
  std::vector<Worker> workers_;
  std::vector<std::thread> threads_;

  std::mutex mu_;
  std::condition_variable work_;  // queue_ non-empty or stop_
  std::condition_variable done_;  // a batch's pending count dropped
  std::condition_variable room_;  // outstanding_ dropped or broken_
  std::deque<Chunk> queue_;
  uint64_t outstanding_ = 0;  // chunks queued or in flight
  BatchId next_batch_ = 1;
  std::unordered_map<BatchId, Batch> batches_;
  absl::Status broken_;     // first error; the endpoint accepts no batches after it
  absl::Status cancelled_;  // Cancel's reason: every Wait returns it from then on
  bool stop_ = false;
};

#if WSYNC_WITH_VERBS
// "00:00:...:ff:ff:c0:00:02:01" (Mooncake's GID text: 16 hex pairs joined by ':') <-> raw bytes.
std::string GidText(const uint8_t (&gid)[16]) {
  std::string out;
  for (int i = 0; i < 16; ++i) absl::StrAppendFormat(&out, "%s%02x", i ? ":" : "", gid[i]);
  return out;
}

bool ParseGid(const std::string& text, uint8_t (&gid)[16]) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  if (parts.size() != 16) return false;
  for (int i = 0; i < 16; ++i) {
    uint32_t v = 0;
    if (parts[i].empty() || parts[i].size() > 2 || !absl::SimpleHexAtoi(parts[i], &v)) return false;
    gid[i] = static_cast<uint8_t>(v);
  }
  return true;
}

// The rdma half (docs/mooncake-protocol.md §4): the Metadata exchange gives the peer's NICs and per-buffer rkeys;
// a Connection exchange on the same handshake port trades queue pair numbers, LID and GID; then the writes are
// RC RDMA WRITEs posted by wsync's verbs endpoint, whose QPs are connected to the peer's with Mooncake's
// conventions (QP i to QP i, PSN 0 both ways). Nothing reaches the peer's CPU: a batch is complete when its
// WRITEs are acknowledged by the peer's NIC.
class MooncakeRdmaEndpoint final : public Endpoint {
 public:
  MooncakeRdmaEndpoint(std::shared_ptr<Transport> verbs, std::string device, const MooncakeOptions& mopts)
      : verbs_(std::move(verbs)), device_(std::move(device)), mopts_(mopts) {}

  std::string LocalInfo() const override { return ""; }

  std::string PeerName() const override {
    return connected_ ? absl::StrCat("mooncake peer ", seg_.session_id, " (rdma ", peer_nic_path_, ")")
                      : "(unconnected mooncake rdma endpoint)";
  }

  absl::Status Connect(const std::string& peer_info, absl::Duration timeout) override {
    if (connected_) return absl::FailedPreconditionError("mooncake endpoint is already connected");
    {
      std::lock_guard<std::mutex> lock(cancel_mu_);
      if (!cancelled_.ok()) return Annotate(cancelled_, "mooncake endpoint was cancelled before it connected");
    }
    absl::Status s = DoConnect(peer_info, std::min(timeout, mopts_.handshake_timeout));
    if (!s.ok()) return Annotate(s, absl::StrCat("mooncake peer ", peer_info, " (rdma)"));
    connected_ = true;
    return absl::OkStatus();
  }

  absl::StatusOr<BatchId> Post(absl::Span<const WriteRequest> writes) override {
    if (!connected_) return absl::FailedPreconditionError("mooncake endpoint is not connected");
    std::vector<WriteRequest> out;
    out.reserve(writes.size());
    for (size_t i = 0; i < writes.size(); ++i) {
      const WriteRequest& w = writes[i];
      WSYNC_RETURN_IF_ERROR_CTX(ValidateWrite(w), "write ", i, " to ", PeerName());
      const auto* src = dynamic_cast<const MooncakeLocalRegion*>(w.src);
      const auto* dst = dynamic_cast<const MooncakeRemoteRegion*>(w.dst);
      if (src == nullptr || src->rdma() == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("write ", i, ": source region was not registered by a mooncake rdma transport"));
      }
      if (dst == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("write ", i, ": destination was not imported by mooncake"));
      }
      if (dst->session_id() != seg_.session_id) {
        return absl::InvalidArgumentError(absl::StrCat("write ", i, ": destination region is on mooncake peer ",
                                                       dst->session_id(), ", this endpoint is connected to ",
                                                       seg_.session_id));
      }
      if (w.length == 0) continue;  // completes locally, like the engine's own initiator
      const uint64_t addr = dst->base() + w.dst_offset;
      // The region must lie in one registered buffer (as for tcp); the write then does too.
      auto it = std::upper_bound(seg_.buffers.begin(), seg_.buffers.end(), std::make_pair(dst->base(), UINT64_MAX));
      const bool inside = it != seg_.buffers.begin() && seg_.Contains(dst->base(), dst->length());
      if (!inside) {
        return absl::FailedPreconditionError(absl::StrCat(
            "write ", i, " (", Range(addr, w.length), ") to ", PeerName(), ": destination region ",
            Range(dst->base(), dst->length()), " lies outside every one of the ", seg_.buffers.size(),
            " buffers the peer registered (stale descriptor? if the peer registered memory since Connect, "
            "re-create the endpoint)"));
      }
      --it;
      out.push_back(WriteRequest{src->rdma(), w.src_offset, buffers_.at(it->first).get(), addr - it->first,
                                 w.length});
    }
    return ep_->Post(out);
  }

  absl::Status Wait(BatchId batch, absl::Duration timeout) override {
    absl::Status s = ep_ ? ep_->Wait(batch, timeout) : absl::FailedPreconditionError("not connected");
    if (s.ok()) return s;
    return Annotate(s, PeerName());
  }

  // From any thread: the verbs endpoint's Cancel (its QPs to the error state, Post and Wait released at once); one
  // that comes before the verbs endpoint exists is handed to it when DoConnect creates it.
  void Cancel(const absl::Status& why) override {
    std::lock_guard<std::mutex> lock(cancel_mu_);
    if (!cancelled_.ok()) return;
    cancelled_ = why.ok() ? absl::CancelledError("cancelled") : why;
    if (ep_) ep_->Cancel(cancelled_);
  }

 private:
  absl::Status DoConnect(const std::string& session_id, absl::Duration timeout) {
    WSYNC_ASSIGN_OR_RETURN(HandshakeReply meta, Handshake(session_id, kMetadata, "{}", timeout));
    absl::StatusOr<PeerSegment> seg = ParseSegment(session_id, meta.json, "rdma");
    if (!seg.ok()) return Annotate(seg.status(), "handshake");
    seg_ = std::move(*seg);
    // The peer's NIC: the one named like ours when it has one (same fabric naming), else its first.
    size_t pd = 0;
    for (size_t i = 0; i < seg_.devices.size(); ++i) {
      if (seg_.devices[i].name == device_) pd = i;
    }
    const PeerDevice& peer_dev = seg_.devices[pd];
    WSYNC_ASSIGN_OR_RETURN(std::unique_ptr<Endpoint> ep, verbs_->CreateEndpoint());
    {
      std::lock_guard<std::mutex> lock(cancel_mu_);
      ep_ = std::move(ep);
      if (!cancelled_.ok()) ep_->Cancel(cancelled_);
    }
    WSYNC_ASSIGN_OR_RETURN(verbs::ConnInfo mine, verbs::DecodeConnInfo(ep_->LocalInfo()));
    if (mine.qps.empty()) return absl::InternalError("the verbs endpoint has no queue pairs");

    // Our name in NIC paths: "<our address toward the peer>:<pid>" (the peer never connects back: our LID and GID
    // travel in the request, so it needs no descriptor of ours).
    // The port part is the local port of the Metadata connection: unique on this host while we run.
    const std::string our_name =
        absl::StrCat(meta.local_host.empty() ? "wsync" : meta.local_host, ":", meta.local_port);
    const std::string local_nic_path = absl::StrCat(our_name, "@", device_);
    peer_nic_path_ = absl::StrCat(seg_.rdma_server_name.empty() ? seg_.name : seg_.rdma_server_name, "@",
                                  peer_dev.name);
    nlohmann::json req = {{"local_nic_path", local_nic_path},
                          {"local_lid", mine.qps[0].lid},
                          {"local_gid", GidText(mine.qps[0].gid)},
                          {"peer_nic_path", peer_nic_path_},
                          {"qp_num", nlohmann::json::array()},
                          {"reply_msg", ""}};
    for (const verbs::WireQp& q : mine.qps) req["qp_num"].push_back(q.qpn);
    // No "ready_ack" key: the peer then marks its side connected as soon as its QPs are in RTS.
    WSYNC_ASSIGN_OR_RETURN(HandshakeReply r, Handshake(session_id, kConnection, req.dump() + "\n", timeout));
    nlohmann::json rep = nlohmann::json::parse(r.json, nullptr, /*allow_exceptions=*/false);
    if (rep.is_discarded() || !rep.is_object()) {
      return absl::FailedPreconditionError(absl::StrCat("Connection reply is not a JSON object: ",
                                                        absl::CHexEscape(r.json.substr(0, 200))));
    }
    const std::string reply_msg = rep.value("reply_msg", std::string());
    if (!reply_msg.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the peer refused the queue-pair exchange for ", local_nic_path, " -> ", peer_nic_path_,
                       ": \"", reply_msg, "\" (we offered ", mine.qps.size(),
                       " QPs; the engine's MC_NUM_QP_PER_EP must match MooncakeOptions::rdma_qps)"));
    }
    if (rep.value("peer_nic_path", std::string()) != local_nic_path ||
        rep.value("local_nic_path", std::string()) != peer_nic_path_) {
      return absl::FailedPreconditionError(absl::StrCat("Connection reply is for another pair of NICs: ",
                                                        Dump(rep)));
    }
    std::vector<uint32_t> qpns;
    if (rep.contains("qp_num") && rep["qp_num"].is_array()) {
      for (const auto& q : rep["qp_num"]) {
        if (q.is_number_unsigned()) qpns.push_back(q.get<uint32_t>());
      }
    }
    if (qpns.size() != mine.qps.size()) {
      return absl::FailedPreconditionError(absl::StrCat("the peer answered with ", qpns.size(), " QP numbers for our ",
                                                        mine.qps.size(), ": ", Dump(rep)));
    }
    verbs::WireQp proto{};
    const std::string gid_text = rep.value("local_gid", std::string());
    if (!ParseGid(gid_text.empty() ? peer_dev.gid : gid_text, proto.gid)) {
      return absl::FailedPreconditionError(absl::StrCat("unparsable GID \"", gid_text, "\" / \"", peer_dev.gid,
                                                        "\" from the peer"));
    }
    proto.lid = rep.contains("local_lid") && rep["local_lid"].is_number_unsigned() ? rep["local_lid"].get<uint16_t>()
                                                                                  : peer_dev.lid;
    proto.psn = 0;  // Mooncake starts both directions at PSN 0
    proto.mtu = IBV_MTU_4096;  // the engine caps its path MTU at 4096 (MC_MTU); ours is min(this, our port's)
    proto.link_layer = mine.qps[0].link_layer;
    proto.port = 1;
    proto.device_index = 0;
    verbs::ConnInfo peer;
    peer.transport_id = 0x6d6f6f6e63616b65ull;  // "mooncake": the regions imported below carry the same id
    peer.owner = absl::StrCat("mooncake peer ", seg_.session_id, " (", peer_nic_path_, ")");
    for (uint32_t qpn : qpns) {
      verbs::WireQp q = proto;
      q.qpn = qpn;
      peer.qps.push_back(q);
    }
    WSYNC_RETURN_IF_ERROR_CTX(ep_->Connect(verbs::EncodeConnInfo(peer), timeout), "connecting queue pairs to ",
                              peer_nic_path_);
    for (const auto& [addr, len] : seg_.buffers) {
      if (len == 0) continue;
      verbs::RegionDesc rd;
      rd.transport_id = peer.transport_id;
      rd.owner = peer.owner;
      rd.base = addr;
      rd.length = len;
      rd.chunk_size = len;
      rd.num_devices = 1;
      rd.num_chunks = 1;
      rd.rkeys = {seg_.rkeys.at(addr)[pd]};
      WSYNC_ASSIGN_OR_RETURN(buffers_[addr], verbs_->ImportRegion(verbs::EncodeRegionDesc(rd)));
    }
    spdlog::debug("mooncake rdma endpoint {} -> {}: {} QPs, {} registered buffers", local_nic_path, peer_nic_path_,
                  qpns.size(), buffers_.size());
    return absl::OkStatus();
  }

  std::shared_ptr<Transport> verbs_;
  const std::string device_;
  const MooncakeOptions mopts_;
  bool connected_ = false;
  PeerSegment seg_;
  std::string peer_nic_path_;
  std::mutex cancel_mu_;  // ep_ is set, and cancelled_ read and written, under it
  absl::Status cancelled_;
  std::unique_ptr<Endpoint> ep_;
  std::map<uint64_t, std::unique_ptr<RemoteRegion>> buffers_;  // the peer's registered buffers, by address
};
#endif  // WSYNC_WITH_VERBS

class MooncakeTransport final : public Transport {
 public:
  MooncakeTransport(const TransportOptions& opts, const MooncakeOptions& mopts, std::shared_ptr<Transport> verbs,
                    std::string device, std::string not_viable)
      : opts_(opts),
        mopts_(mopts),
        verbs_(std::move(verbs)),
        device_(std::move(device)),
        not_viable_(std::move(not_viable)) {}

  std::string name() const override { return "mooncake"; }
  // Sending side only: the receiver is the engine's own transfer engine, which enforces nothing of wsync's.
  Capabilities Query() const override {
    Capabilities c = CapabilitiesOf(name());
    c.provider = "mooncake";
    return c;
  }
  bool viable() const override { return not_viable_.empty(); }
  std::string reason() const override {
    if (!not_viable_.empty()) return not_viable_;
    return mopts_.protocol == "rdma" ? kSourceOnlyRdma : kSourceOnly;
  }

  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    if (addr == nullptr && len > 0) return absl::InvalidArgumentError("cannot register a null address");
    if (!not_viable_.empty()) return absl::FailedPreconditionError(not_viable_);
    std::unique_ptr<LocalRegion> rdma;
    if (verbs_) {
      WSYNC_ASSIGN_OR_RETURN(rdma, verbs_->RegisterMemory(addr, len));
      spdlog::debug("mooncake: registered source region ({} bytes at {}) on {}", len, addr, device_);
    } else {
      spdlog::debug("mooncake: registered source region ({} bytes at {}); nothing to pin for tcp", len, addr);
    }
    return std::unique_ptr<LocalRegion>(std::make_unique<MooncakeLocalRegion>(addr, len, std::move(rdma)));
  }

  absl::StatusOr<std::unique_ptr<RemoteRegion>> ImportRegion(const std::string& descriptor) override {
    WSYNC_ASSIGN_OR_RETURN(RegionDescriptorFields f, ParseRegionDescriptor(descriptor));
    // The same checks as for a descriptor built here (session id, non-empty, no wrap-around).
    WSYNC_RETURN_IF_ERROR(MakeRegionDescriptor(f.session_id, f.base_addr, f.length).status());
    return std::unique_ptr<RemoteRegion>(
        std::make_unique<MooncakeRemoteRegion>(f.session_id, f.base_addr, f.length));
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    if (!not_viable_.empty()) return absl::FailedPreconditionError(not_viable_);
#if WSYNC_WITH_VERBS
    if (verbs_) return std::unique_ptr<Endpoint>(std::make_unique<MooncakeRdmaEndpoint>(verbs_, device_, mopts_));
#endif
    return std::unique_ptr<Endpoint>(std::make_unique<MooncakeEndpoint>(opts_, mopts_));
  }

 private:
  const TransportOptions opts_;
  const MooncakeOptions mopts_;
  std::shared_ptr<Transport> verbs_;  // protocol rdma: the inner verbs transport (one device)
  const std::string device_;          // its device name
  const std::string not_viable_;
};

}  // namespace

absl::StatusOr<RegionDescriptorFields> ParseRegionDescriptor(const std::string& descriptor) {
  std::vector<std::string> p = absl::StrSplit(descriptor, ' ');
  RegionDescriptorFields f;
  if (p.size() != 4 || p[0] != kDescPrefix || !absl::StartsWith(p[2], "0x") ||
      !absl::SimpleHexAtoi(p[2].substr(2), &f.base_addr) || !absl::SimpleAtoi(p[3], &f.length)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "not a mooncake region descriptor (want \"", kDescPrefix, " <session_id> 0x<addr> <length>\"): \"",
        absl::CHexEscape(descriptor.substr(0, 80)), "\""));
  }
  f.session_id = p[1];
  return f;
}

absl::StatusOr<SessionAddress> ParseSessionId(const std::string& session_id) {
  SessionAddress a;
  std::string port;
  if (!session_id.empty() && session_id[0] == '[') {
    const size_t close = session_id.find(']');
    if (close != std::string::npos && close + 1 < session_id.size() && session_id[close + 1] == ':') {
      a.host = session_id.substr(1, close - 1);
      port = session_id.substr(close + 2);
    }
  } else if (const size_t colon = session_id.rfind(':'); colon != std::string::npos &&
                                                          session_id.find(':') == colon) {
    a.host = session_id.substr(0, colon);
    port = session_id.substr(colon + 1);
  }
  if (a.host.empty() || !absl::SimpleAtoi(port, &a.port) || a.port <= 0 || a.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a Mooncake session id (want \"host:port\" or \"[v6]:port\"): \"",
                     absl::CHexEscape(session_id.substr(0, 80)), "\""));
  }
  return a;
}

absl::StatusOr<std::string> MakeRegionDescriptor(const std::string& session_id, uint64_t base_addr,
                                                 uint64_t length) {
  WSYNC_RETURN_IF_ERROR(ParseSessionId(session_id).status());
  if (length == 0) return absl::InvalidArgumentError("a mooncake region cannot be empty (the peer refuses size 0)");
  if (base_addr + length < base_addr) {
    return absl::InvalidArgumentError(absl::StrCat("mooncake region ", Range(base_addr, length), " wraps around"));
  }
  return absl::StrFormat("%s %s 0x%x %d", kDescPrefix, session_id, base_addr, length);
}

absl::StatusOr<std::unique_ptr<Transport>> CreateMooncakeTransport(const TransportOptions& opts,
                                                                   const MooncakeOptions& mopts) {
  MooncakeOptions m = mopts;
  m.chunk_bytes = std::max<uint64_t>(1, m.chunk_bytes);
  m.max_outstanding_chunks = std::max<uint64_t>(1, m.max_outstanding_chunks);
  if (m.protocol.empty()) {
    const char* env = std::getenv("WSYNC_MOONCAKE_PROTOCOL");
    m.protocol = env != nullptr && *env != '\0' ? env : "tcp";
  }
  if (m.protocol != "tcp" && m.protocol != "rdma") {
    return absl::InvalidArgumentError(absl::StrCat("mooncake protocol \"", m.protocol, "\": want tcp or rdma"));
  }
  std::shared_ptr<Transport> inner;
  std::string device, not_viable;
  if (m.protocol == "rdma") {
#if WSYNC_WITH_VERBS
    verbs::VerbsOptions v;
    v.qps_per_device = m.rdma_qps;
    v.zero_psn = true;
    TransportOptions vo = opts;
    if (const char* dev = std::getenv("WSYNC_MOONCAKE_DEVICE"); vo.devices.empty() && dev != nullptr && *dev) {
      vo.devices = {dev};
    }
    absl::StatusOr<std::unique_ptr<Transport>> t = verbs::CreateVerbsTransport(vo, v);
    if (!t.ok()) return Annotate(t.status(), "mooncake rdma");
    inner = std::move(*t);
    if (!inner->viable()) {
      not_viable = absl::StrCat("mooncake rdma: ", inner->reason());
      inner.reset();
    } else {
      std::vector<std::string> devs = verbs::GetVerbsTransportDevices(*inner);
      if (devs.size() != 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "mooncake rdma writes through exactly one RDMA device (the engine pairs one NIC with one NIC); found ",
            devs.size(), " (", absl::StrJoin(devs, ","), "): name one in TransportOptions::devices"));
      }
      device = devs[0];
    }
#else
    not_viable = "mooncake rdma: this build has no verbs support (WSYNC_WITH_VERBS=OFF)";
#endif
  }
  return std::unique_ptr<Transport>(
      std::make_unique<MooncakeTransport>(opts, m, std::move(inner), std::move(device), std::move(not_viable)));
}

}  // namespace wsync::transport::mooncake
