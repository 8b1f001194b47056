#include "transport/tcp/tcp_transport.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/numbers.h"
#include "base/status.h"
#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"

namespace wsync::transport::tcp {
namespace {

// A batch smaller than this goes over one connection; larger ones are split so that each connection carries at
// least this much (splitting tiny batches costs more in wake-ups than it gains).
constexpr uint64_t kMinBytesPerStream = 4 << 20;
// Frames per sendmsg: a header and a payload iovec each, under IOV_MAX (1024).
constexpr size_t kFramesPerSend = 500;
// The receiver reads headers and small payloads through this buffer; payloads at least kDirectRecvBytes long
// are recv()d straight into the destination region.
constexpr size_t kRecvBufferBytes = 256 << 10;
constexpr size_t kDirectRecvBytes = 64 << 10;
constexpr char kInfoPrefix[] = "wsync-tcp/1";

std::string ClipMessage(std::string m) {
  if (m.size() > kMaxAckMessage) m.resize(kMaxAckMessage);
  return m;
}

// A std::condition_variable wait with an absl::Duration that may be infinite.
template <typename Pred>
bool WaitFor(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, absl::Duration d, Pred pred) {
  if (d >= absl::Hours(24 * 365)) {
    cv.wait(lock, pred);
    return true;
  }
  return cv.wait_for(lock, absl::ToChronoNanoseconds(std::max(d, absl::ZeroDuration())), pred);
}

// ---------------------------------------------------------------------------------------------------------------
// Regions registered on one transport. Shared by the transport, its regions and its connection threads, so any
// of them may go first. A region is removed only when no connection thread is writing into it.
class RegionTable {
 public:
  struct Entry {
    char* addr;
    uint64_t length;
    std::shared_ptr<RegionSink> sink;  // set for memory the CPU cannot write (payload goes through its staging)
    int writers = 0;
  };

  explicit RegionTable(uint64_t token) : token_(token) {}
  uint64_t token() const { return token_; }

  // Region ids are random (never 0, never reused while registered): a peer cannot guess another region's id.
  uint64_t Add(void* addr, uint64_t length, std::shared_ptr<RegionSink> sink = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t id = 0;
    while (id == 0 || regions_.count(id)) id = (static_cast<uint64_t>(rng_()) << 32) ^ rng_();
    regions_[id] = std::make_shared<Entry>(Entry{static_cast<char*>(addr), length, std::move(sink)});
    return id;
  }

  // A write grant (Transport::CreateGrantedEndpoint): the region ids it covers, live until revoked.
  struct Grant {
    Transport::WriteGrant info;
    std::unordered_set<uint64_t> regions;
    std::atomic<bool> live{true};
  };
  using Secret = std::pair<uint64_t, uint64_t>;
  struct SecretHash {
    size_t operator()(const Secret& s) const { return std::hash<uint64_t>()(s.first ^ (s.second * 0x9e3779b97f4a7c15ULL)); }
  };

  // Mints a fresh random 128-bit secret for `g`.
  Secret AddGrant(std::shared_ptr<Grant> g) {
    std::lock_guard<std::mutex> lock(mu_);
    Secret sec{0, 0};
    while ((sec.first == 0 && sec.second == 0) || grants_.count(sec))
      sec = {(static_cast<uint64_t>(rng_()) << 32) ^ rng_(), (static_cast<uint64_t>(rng_()) << 32) ^ rng_()};
    grants_[sec] = std::move(g);
    return sec;
  }
  void RemoveGrant(const Secret& sec) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = grants_.find(sec);
    if (it == grants_.end()) return;
    it->second->live = false;
    grants_.erase(it);
  }
  void RevokeGrants(const std::function<bool(const Transport::WriteGrant&)>& keep) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = grants_.begin(); it != grants_.end();) {
      if (keep(it->second->info)) {
        ++it;
        continue;
      }
      spdlog::info("tcp: write grant for {} ({}) revoked", it->second->info.peer, it->second->info.scope);
      it->second->live = false;
      it = grants_.erase(it);
    }
  }
  // Null when the secret is unknown or was revoked.
  std::shared_ptr<Grant> FindGrant(const Secret& sec) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = grants_.find(sec);
    return it == grants_.end() ? nullptr : it->second;
  }
  void SetRequireGrants(bool r) { require_grants_.store(r); }
  bool require_grants() const { return require_grants_.load(); }

  void SetWindow(bool open) { window_open_.store(open); }
  bool window_open() const { return window_open_.load(); }
  void CountRefused() { refused_.fetch_add(1); }
  uint64_t refused() const { return refused_.load(); }

  // Blocks while a connection thread is still receiving into the region.
  void Remove(uint64_t id) {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return;
    std::shared_ptr<Entry> e = std::move(it->second);
    regions_.erase(it);
    idle_.wait(lock, [&] { return e->writers == 0; });
  }

  // Null when the id is not (or no longer) registered.
  std::shared_ptr<Entry> AcquireForWrite(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return nullptr;
    ++it->second->writers;
    return it->second;
  }

  void Release(const std::shared_ptr<Entry>& e) {
    std::lock_guard<std::mutex> lock(mu_);
    if (--e->writers == 0) idle_.notify_all();
  }

 private:
  const uint64_t token_;
  std::atomic<bool> window_open_{true};
  std::atomic<bool> require_grants_{false};
  std::atomic<uint64_t> refused_{0};
  std::mutex mu_;
  std::condition_variable idle_;
  std::random_device rng_;
  std::unordered_map<uint64_t, std::shared_ptr<Entry>> regions_;
  std::unordered_map<Secret, std::shared_ptr<Grant>, SecretHash> grants_;
};

class TcpLocalRegion final : public LocalRegion {
 public:
  TcpLocalRegion(std::shared_ptr<RegionTable> table, uint64_t id, void* addr, uint64_t length)
      : table_(std::move(table)), id_(id), addr_(addr), length_(length) {}
  ~TcpLocalRegion() override { table_->Remove(id_); }
  uint64_t id() const { return id_; }
  void* addr() const override { return addr_; }
  uint64_t length() const override { return length_; }
  std::string Descriptor() const override {
    RegionDescriptor d{kDescMagic, kProtocolVersion, 0, table_->token(), id_, length_};
    return std::string(reinterpret_cast<const char*>(&d), sizeof(d));
  }

 private:
  std::shared_ptr<RegionTable> table_;
  uint64_t id_;
  void* addr_;
  uint64_t length_;
};

class TcpRemoteRegion final : public RemoteRegion {
 public:
  TcpRemoteRegion(uint64_t token, uint64_t id, uint64_t length) : token_(token), id_(id), length_(length) {}
  uint64_t length() const override { return length_; }
  uint64_t token() const { return token_; }
  uint64_t id() const { return id_; }

 private:
  uint64_t token_;
  uint64_t id_;
  uint64_t length_;
};

// ---------------------------------------------------------------------------------------------------------------
// Receiving side.

absl::Status SendAck(int fd, uint16_t type, uint64_t batch, uint64_t bytes, const absl::Status& status) {
  std::string msg = ClipMessage(std::string(status.message()));
  Ack ack{kFrameMagic, type, static_cast<uint16_t>(status.code()), batch, bytes,
          static_cast<uint32_t>(msg.size()), 0};
  iovec iov[2] = {{&ack, sizeof(ack)}, {msg.data(), msg.size()}};
  return SendAll(fd, iov, msg.empty() ? 1 : 2);
}

// Reads a connection's byte stream: headers and small payloads through a buffer (few syscalls for many small
// writes), large payloads straight into their destination.
class FrameReader {
 public:
  explicit FrameReader(int fd) : fd_(fd), buf_(kRecvBufferBytes) {}

  // Reads exactly n bytes into dst. With `idle_ok`, a receive timeout before the first byte is an idle
  // connection between batches, not a stall: keep waiting (shutdown of the socket ends the wait).
  // `fill_limit` caps how much one buffered recv pulls in: after a large payload the next header is read
  // alone, so that the large payload after it is not copied through the buffer.
  absl::Status Read(void* dst, size_t n, bool idle_ok, size_t fill_limit = kRecvBufferBytes) {
    char* out = static_cast<char*>(dst);
    bool started = false;
    while (n > 0) {
      if (begin_ < end_) {
        size_t k = std::min(n, end_ - begin_);
        std::memcpy(out, buf_.data() + begin_, k);
        begin_ += k;
        out += k;
        n -= k;
        started = true;
        continue;
      }
      begin_ = end_ = 0;
      const bool direct = n >= kDirectRecvBytes;
      ssize_t got = direct ? ::recv(fd_, out, n, MSG_WAITALL)
                           : ::recv(fd_, buf_.data(), std::max(n, std::min(fill_limit, buf_.size())), 0);
      if (got < 0) {
        if (errno == EINTR) continue;
        if ((errno == EAGAIN || errno == EWOULDBLOCK) && idle_ok && !started) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
          return absl::DeadlineExceededError("sender stalled in the middle of a frame");
        }
        return absl::UnavailableError(absl::StrCat("recv: ", ErrnoText(errno)));
      }
      if (got == 0) {
        return absl::UnavailableError(started || !idle_ok ? "connection closed in the middle of a frame"
                                                          : "connection closed");
      }
      started = true;
      if (direct) {
        out += got;
        n -= static_cast<size_t>(got);
      } else {
        end_ = static_cast<size_t>(got);
      }
    }
    return absl::OkStatus();
  }

  absl::Status Discard(uint64_t n) {
    char scratch[16 << 10];
    while (n > 0) {
      size_t k = static_cast<size_t>(std::min<uint64_t>(n, sizeof(scratch)));
      WSYNC_RETURN_IF_ERROR(Read(scratch, k, false));
      n -= k;
    }
    return absl::OkStatus();
  }

 private:
  int fd_;
  std::vector<char> buf_;
  size_t begin_ = 0;
  size_t end_ = 0;
};

// Receives one write's payload through a sink's staging buffers, one chunk at a time; each chunk's copy starts as
// soon as it is in, so receiving the next chunk overlaps the copy of the previous ones. Returns the stream's
// status; a failure of the sink (a device error) goes to *sink_error, the rest of the payload is read and dropped
// so the stream stays in step, and the batch's ack reports it.
absl::Status ReceiveIntoSink(FrameReader& reader, RegionSink& sink, uint64_t offset, uint64_t length,
                             absl::Status* sink_error) {
  const uint64_t chunk = std::max<uint64_t>(sink.chunk_bytes(), 1);
  for (uint64_t done = 0; done < length;) {
    const uint64_t n = std::min(chunk, length - done);
    absl::StatusOr<RegionSink::Staging> st = sink.Acquire();
    if (!st.ok()) {
      *sink_error = st.status();
      return reader.Discard(length - done);
    }
    absl::Status s = reader.Read(st->data, n, false);
    if (!s.ok()) {
      sink.Cancel(*st);
      return s;
    }
    done += n;
    if (absl::Status ss = sink.Submit(*st, offset + done - n, n); !ss.ok()) {
      *sink_error = ss;
      return reader.Discard(length - done);
    }
  }
  return absl::OkStatus();
}

// Serves one accepted connection until it closes, fails, or the socket is shut down.
// Errors in a batch's content (unknown region, out of bounds) are reported in that batch's ack, after which the
// connection closes (the sender re-creates its endpoint). A malformed stream is answered with an error ack at
// once and closed.
absl::Status ServeConnection(int fd, RegionTable& table) {
  FrameReader reader(fd);
  Hello hello;
  // The accept loop hands a connection over only once its first bytes arrived: the rest of the hello must follow
  // within the io timeout.
  WSYNC_RETURN_IF_ERROR(reader.Read(&hello, sizeof(hello), false));
  if (hello.magic != kFrameMagic || hello.type != kHello || hello.version != kProtocolVersion) {
    absl::Status s = absl::InvalidArgumentError(
        absl::StrFormat("bad hello (magic %#x type %d version %d)", hello.magic, hello.type, hello.version));
    SendAck(fd, kHelloAck, 0, 0, s).IgnoreError();
    return s;
  }
  if (hello.token != table.token()) {
    absl::Status s = absl::FailedPreconditionError(absl::StrFormat(
        "peer info is for transport %016x, this listener belongs to %016x (stale or foreign peer info)",
        hello.token, table.token()));
    SendAck(fd, kHelloAck, 0, 0, s).IgnoreError();
    return s;
  }
  std::shared_ptr<RegionTable::Grant> grant;
  if (hello.secret[0] != 0 || hello.secret[1] != 0) {
    grant = table.FindGrant({hello.secret[0], hello.secret[1]});
    if (grant == nullptr) {
      table.CountRefused();
      absl::Status s = absl::PermissionDeniedError(
          "write secret unknown or expired (revoked at a new plan, or its connection was replaced): ask the target "
          "daemon again (ConnectTarget)");
      SendAck(fd, kHelloAck, 0, 0, s).IgnoreError();
      return s;
    }
  }
  // Without a secret the connection is accepted (a peer's endpoint connects back to complete the symmetric
  // handshake) but, when grants are required, every write frame on it is refused.
  const bool ungranted_refused = grant == nullptr && table.require_grants();
  WSYNC_RETURN_IF_ERROR(SendAck(fd, kHelloAck, 0, 0, absl::OkStatus()));

  absl::Status batch_status;
  uint64_t frames = 0;
  uint64_t bytes = 0;
  std::vector<std::shared_ptr<RegionSink>> sinks;  // sink regions this batch wrote into
  bool large_payloads = false;  // the last write frame was large: expect another one
  for (;;) {
    FrameHeader f;
    WSYNC_RETURN_IF_ERROR(
        reader.Read(&f, sizeof(f), true, large_payloads ? sizeof(FrameHeader) : kRecvBufferBytes));
    if (f.magic != kFrameMagic) {
      absl::Status s = absl::InvalidArgumentError(absl::StrFormat("bad frame magic %#x", f.magic));
      SendAck(fd, kBatchAck, f.batch, bytes, s).IgnoreError();
      return s;
    }
    if (f.type == kWrite) {
      if (f.length > kMaxFramePayload) {
        absl::Status s = absl::InvalidArgumentError(
            absl::StrCat("write frame of ", f.length, " bytes exceeds the limit of ", kMaxFramePayload));
        SendAck(fd, kBatchAck, f.batch, bytes, s).IgnoreError();
        return s;
      }
      std::shared_ptr<RegionTable::Entry> region;
      if (batch_status.ok() && ungranted_refused) {
        table.CountRefused();
        batch_status = absl::PermissionDeniedError(
            "write refused: this receiver accepts writes only on connections authorized by a write secret (minted "
            "by the target daemon's ConnectTarget for a source the coordinator assigned); the batch fails");
      }
      if (batch_status.ok() && grant != nullptr && !grant->live) {
        table.CountRefused();
        batch_status = absl::PermissionDeniedError(absl::StrCat(
            "write refused: the write grant of this connection (", grant->info.peer, ", ", grant->info.scope,
            ") was revoked; the batch fails"));
      }
      if (batch_status.ok() && grant != nullptr && grant->regions.count(f.region) == 0) {
        table.CountRefused();
        batch_status = absl::PermissionDeniedError(absl::StrCat(
            "write refused: region ", f.region, " is not covered by this connection's write grant (", grant->info.peer,
            ", ", grant->info.scope, "); the batch fails"));
      }
      if (batch_status.ok() && !table.window_open()) {
        table.CountRefused();
        batch_status = absl::PermissionDeniedError(
            "write refused: the receiver's write window is closed (writes are accepted only while the coordinator "
            "has an update open); nothing of this batch was written");
      }
      if (batch_status.ok()) {
        region = table.AcquireForWrite(f.region);
        if (region == nullptr) {
          batch_status = absl::NotFoundError(
              absl::StrCat("region ", f.region, " is not registered on the receiver (deregistered?)"));
        } else if (f.offset > region->length || f.length > region->length - f.offset) {
          batch_status = absl::OutOfRangeError(absl::StrCat("write [", f.offset, ", +", f.length,
                                                            ") is outside region ", f.region, " of ",
                                                            region->length, " bytes"));
          table.Release(region);
          region = nullptr;
        }
      }
      if (region == nullptr) {
        WSYNC_RETURN_IF_ERROR(reader.Discard(f.length));
        continue;
      }
      large_payloads = f.length >= kDirectRecvBytes;
      absl::Status s;
      if (region->sink != nullptr) {
        absl::Status sink_error;
        s = ReceiveIntoSink(reader, *region->sink, f.offset, f.length, &sink_error);
        if (!sink_error.ok() && batch_status.ok()) batch_status = sink_error;
        if (std::find(sinks.begin(), sinks.end(), region->sink) == sinks.end()) sinks.push_back(region->sink);
      } else {
        s = reader.Read(region->addr + f.offset, f.length, false);
      }
      table.Release(region);
      WSYNC_RETURN_IF_ERROR(s);
      ++frames;
      bytes += f.length;
    } else if (f.type == kCommit) {
      // The batch is complete only when the staged copies into device memory have finished.
      for (const auto& sink : sinks) {
        absl::Status fs = sink->Flush();
        if (batch_status.ok() && !fs.ok()) batch_status = fs;
      }
      sinks.clear();
      if (batch_status.ok() && (f.region != frames || f.length != bytes)) {
        batch_status = absl::DataLossError(absl::StrCat("batch ", f.batch, ": received ", frames, " frames / ",
                                                        bytes, " bytes, sender sent ", f.region, " / ",
                                                        f.length));
      }
      WSYNC_RETURN_IF_ERROR(SendAck(fd, kBatchAck, f.batch, bytes, batch_status));
      if (!batch_status.ok()) return batch_status;
      frames = 0;
      bytes = 0;
    } else {
      absl::Status s = absl::InvalidArgumentError(absl::StrCat("unknown frame type ", f.type));
      SendAck(fd, kBatchAck, f.batch, bytes, s).IgnoreError();
      return s;
    }
  }
}

// Accepts connections on the transport's listening socket. A new connection first waits in the accept loop's own
// poll set (no thread) until its hello arrives, for at most hello_timeout; then it gets a thread that serves it.
// Connections per peer address and in total are capped (pending and served together), so an idle-connection flood
// costs a bounded number of fds and threads and the listener keeps serving.
class Listener {
 public:
  Listener(std::shared_ptr<RegionTable> table, Fd listen_fd, Fd wake_fd, std::string address,
           const TransportOptions& opts)
      : table_(std::move(table)),
        listen_fd_(std::move(listen_fd)),
        wake_fd_(std::move(wake_fd)),
        address_(std::move(address)),
        io_timeout_(opts.io_timeout),
        hello_timeout_(opts.hello_timeout > absl::ZeroDuration() ? opts.hello_timeout : absl::Seconds(5)),
        max_per_peer_(std::max(1, opts.max_conns_per_peer)),
        max_total_(std::max(1, opts.max_conns)) {
    thread_ = std::thread([this] { AcceptLoop(); });
  }

  ~Listener() {
    uint64_t one = 1;
    if (::write(wake_fd_.get(), &one, sizeof(one)) < 0) spdlog::warn("tcp: wake listener: {}", ErrnoText(errno));
    thread_.join();
    for (auto& c : conns_) c->fd.ShutdownBoth();
    for (auto& c : conns_) c->thread.join();
    spdlog::debug("tcp listener {} closed", address_);
  }

 private:
  struct Conn {
    Fd fd;
    std::string host;  // peer address (the per-peer cap's key)
    std::string peer;  // host:port
    std::thread thread;
    std::atomic<bool> done{false};
  };
  struct Pending {
    std::unique_ptr<Conn> conn;
    absl::Time deadline;
  };

  void AcceptLoop() {
    std::vector<pollfd> p;
    for (;;) {
      p.assign({{listen_fd_.get(), POLLIN, 0}, {wake_fd_.get(), POLLIN, 0}});
      absl::Time next = absl::InfiniteFuture();
      for (const auto& w : pending_) {
        p.push_back({w.conn->fd.get(), POLLIN, 0});
        next = std::min(next, w.deadline);
      }
      const int timeout_ms =
          next == absl::InfiniteFuture()
              ? -1
              : static_cast<int>(std::clamp<int64_t>(absl::ToInt64Milliseconds(next - absl::Now()) + 1, 0, 60000));
      int rc = ::poll(p.data(), p.size(), timeout_ms);
      if (rc < 0) {
        if (errno == EINTR) continue;
        spdlog::error("tcp listener {}: poll: {}", address_, ErrnoText(errno));
        return;
      }
      if (p[1].revents != 0) return;
      Reap();
      // Pending connections: readable (hello arriving, or closed) → served by a thread; past the deadline → closed.
      const absl::Time now = absl::Now();
      std::vector<Pending> still;
      for (size_t i = 0; i < pending_.size(); ++i) {
        Pending& w = pending_[i];
        if (p[2 + i].revents != 0) {
          Serve(std::move(w.conn));
        } else if (now >= w.deadline) {
          table_->CountRefused();
          spdlog::warn("tcp listener {}: {} sent no hello within {}; closed", address_, w.conn->peer,
                       absl::FormatDuration(hello_timeout_));
          Drop(w.conn->host);
        } else {
          still.push_back(std::move(w));
        }
      }
      pending_ = std::move(still);
      if (p[0].revents != 0) Accept();
    }
  }

  void Accept() {
    sockaddr_in addr{};
    socklen_t len = sizeof(addr);
    Fd fd(::accept4(listen_fd_.get(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_CLOEXEC));
    if (!fd.valid()) {
      if (errno != EINTR && errno != ECONNABORTED && errno != EAGAIN) {
        spdlog::warn("tcp listener {}: accept: {}", address_, ErrnoText(errno));
      }
      return;
    }
    char host[INET_ADDRSTRLEN] = "?";
    ::inet_ntop(AF_INET, &addr.sin_addr, host, sizeof(host));
    int& from_peer = per_peer_[host];
    if (from_peer >= max_per_peer_ || total_ >= max_total_) {
      table_->CountRefused();
      if (refused_logged_++ % 100 == 0)
        spdlog::warn("tcp listener {}: connection from {} refused: {} ({} such refusals)", address_, host,
                     from_peer >= max_per_peer_ ? absl::StrCat(max_per_peer_, " connections from that address")
                                               : absl::StrCat(max_total_, " connections in total"),
                     refused_logged_);
      if (from_peer == 0) per_peer_.erase(host);
      return;  // fd closes here
    }
    ++from_peer;
    ++total_;
    TuneSocket(fd.get(), io_timeout_);
    auto conn = std::make_unique<Conn>();
    conn->fd = std::move(fd);
    conn->host = host;
    conn->peer = absl::StrCat(host, ":", ntohs(addr.sin_port));
    pending_.push_back({std::move(conn), absl::Now() + hello_timeout_});
  }

  void Serve(std::unique_ptr<Conn> conn) {
    Conn* c = conn.get();
    c->thread = std::thread([this, c] {
      absl::Status s = ServeConnection(c->fd.get(), *table_);
      // The peer sees EOF now; the fd itself is closed when the thread is reaped (no fd-reuse race).
      c->fd.ShutdownBoth();
      if (s.code() == absl::StatusCode::kUnavailable) {
        spdlog::debug("tcp listener {}: connection from {} ended: {}", address_, c->peer, s.ToString());
      } else {
        spdlog::warn("tcp listener {}: connection from {} failed: {}", address_, c->peer, s.ToString());
      }
      c->done = true;
    });
    conns_.push_back(std::move(conn));
  }

  void Drop(const std::string& host) {
    --total_;
    auto it = per_peer_.find(host);
    if (it != per_peer_.end() && --it->second <= 0) per_peer_.erase(it);
  }

  // Joins the threads of connections that have ended.
  void Reap() {
    for (auto it = conns_.begin(); it != conns_.end();) {
      if ((*it)->done) {
        (*it)->thread.join();
        Drop((*it)->host);
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
  }

  std::shared_ptr<RegionTable> table_;
  Fd listen_fd_;
  Fd wake_fd_;
  std::string address_;
  absl::Duration io_timeout_;
  const absl::Duration hello_timeout_;
  const int max_per_peer_;
  const int max_total_;
  // Only the accept thread touches these until it has been joined.
  std::list<std::unique_ptr<Conn>> conns_;
  std::vector<Pending> pending_;
  std::unordered_map<std::string, int> per_peer_;
  int total_ = 0;
  uint64_t refused_logged_ = 0;
  std::thread thread_;
};

// ---------------------------------------------------------------------------------------------------------------
// Sending side.

struct PeerInfo {
  std::string host;
  int port = 0;
  uint64_t token = 0;
  uint64_t secret[2] = {0, 0};  // a granted endpoint's write secret (sent in every Hello), else zero
};

std::string FormatInfo(const std::string& host, int port, uint64_t token) {
  return absl::StrFormat("%s %s %d %016x", kInfoPrefix, host, port, token);
}

// A granted endpoint's info: FormatInfo plus " SECRET" (32 hex digits).
std::string FormatGrantedInfo(const std::string& info, const RegionTable::Secret& sec) {
  return absl::StrFormat("%s %016x%016x", info, sec.first, sec.second);
}

bool ParseHex64(const std::string& s, uint64_t* out) {
  if (s.empty() || s.size() > 16) return false;
  char* end = nullptr;
  errno = 0;
  *out = std::strtoull(s.c_str(), &end, 16);
  return errno == 0 && end != nullptr && *end == '\0';
}

absl::StatusOr<PeerInfo> ParseInfo(const std::string& info) {
  std::vector<std::string> parts = absl::StrSplit(info, ' ');
  PeerInfo p;
  if ((parts.size() == 4 || parts.size() == 5) && parts[0] == kInfoPrefix && absl::SimpleAtoi(parts[2], &p.port) &&
      p.port > 0 && p.port < 65536 && ParseHex64(parts[3], &p.token) &&
      (parts.size() == 4 || (parts[4].size() == 32 && ParseHex64(parts[4].substr(0, 16), &p.secret[0]) &&
                             ParseHex64(parts[4].substr(16), &p.secret[1])))) {
    p.host = parts[1];
    return p;
  }
  return absl::InvalidArgumentError(absl::StrCat("not a tcp endpoint info: \"", absl::CEscape(info.substr(0, 80)),
                                                 "\""));
}

// One piece of a write, already resolved to raw addresses; at most one piece per write per connection.
struct Piece {
  const char* src;
  uint64_t region;
  uint64_t offset;
  uint64_t length;
};

// The part of a batch that one connection carries.
struct Job {
  BatchId batch = 0;
  std::vector<Piece> pieces;
  uint64_t bytes = 0;
};

class TcpEndpoint final : public Endpoint {
 public:
  TcpEndpoint(std::string local_info, const TransportOptions& opts)
      : local_info_(std::move(local_info)),
        max_streams_(std::max(1, opts.tcp_streams)),
        io_timeout_(opts.io_timeout > absl::ZeroDuration() ? opts.io_timeout : absl::Seconds(30)) {}

  // A granted endpoint (Transport::CreateGrantedEndpoint): destroying it revokes its grant.
  void SetGrant(std::shared_ptr<RegionTable> table, RegionTable::Secret secret) {
    grant_table_ = std::move(table);
    grant_secret_ = secret;
  }

  ~TcpEndpoint() override {
    if (grant_table_) grant_table_->RemoveGrant(grant_secret_);
    for (auto& s : streams_) {
      if (s == nullptr) continue;
      {
        std::lock_guard<std::mutex> lock(s->mu);
        s->stop = true;
        s->fd.ShutdownBoth();
      }
      s->cv.notify_all();
      if (s->thread.joinable()) s->thread.join();
    }
  }

  std::string LocalInfo() const override { return local_info_; }

  std::string PeerName() const override {
    return connected_ ? absl::StrCat(peer_.host, ":", peer_.port) : std::string("(unconnected tcp endpoint)");
  }

  absl::Status Connect(const std::string& peer_info, absl::Duration timeout) override {
    if (connected_) return absl::FailedPreconditionError("tcp endpoint is already connected");
    WSYNC_ASSIGN_OR_RETURN(PeerInfo peer, ParseInfo(peer_info));
    const std::string name = absl::StrCat(peer.host, ":", peer.port);
    absl::StatusOr<Fd> fd = OpenStream(peer, 0, timeout);
    if (!fd.ok()) return Annotate(fd.status(), absl::StrCat("tcp peer ", name));
    peer_ = std::move(peer);
    streams_.resize(static_cast<size_t>(max_streams_));
    streams_[0] = std::make_unique<Stream>();
    streams_[0]->fd = std::move(*fd);
    connected_ = true;
    spdlog::debug("tcp endpoint connected to {}", name);
    return absl::OkStatus();
  }

  absl::StatusOr<BatchId> Post(absl::Span<const WriteRequest> writes) override {
    if (!connected_) return absl::FailedPreconditionError("tcp endpoint is not connected");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!broken_.ok()) {
        return Annotate(broken_, "tcp endpoint is unusable after an earlier error (re-create it)");
      }
    }
    uint64_t total = 0;
    for (size_t i = 0; i < writes.size(); ++i) {
      const WriteRequest& w = writes[i];
      WSYNC_RETURN_IF_ERROR_CTX(ValidateWrite(w), "write ", i);
      auto* dst = dynamic_cast<const TcpRemoteRegion*>(w.dst);
      if (dst == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("write ", i, ": destination was not imported by tcp"));
      }
      if (dst->token() != peer_.token) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "write %d: destination region belongs to transport %016x, but this endpoint is connected to %s "
            "(transport %016x)",
            i, dst->token(), PeerName(), peer_.token));
      }
      total += w.length;
    }

    // Contiguous split: each connection gets about total/n bytes, cutting writes where needed.
    uint64_t n = 1;
    if (total > kMinBytesPerStream) {
      n = std::min<uint64_t>(max_streams_, (total + kMinBytesPerStream - 1) / kMinBytesPerStream);
    }
    const uint64_t per = std::max<uint64_t>(1, (total + n - 1) / n);
    std::vector<Job> jobs(n);
    size_t j = 0;
    for (const WriteRequest& w : writes) {
      const char* src = static_cast<const char*>(w.src->addr()) + w.src_offset;
      const uint64_t region = static_cast<const TcpRemoteRegion*>(w.dst)->id();
      uint64_t offset = w.dst_offset;
      uint64_t left = w.length;
      while (left > 0) {
        if (j + 1 < n && jobs[j].bytes >= per) ++j;
        const uint64_t take = j + 1 == n ? left : std::min(left, per - jobs[j].bytes);
        jobs[j].pieces.push_back(Piece{src, region, offset, take});
        jobs[j].bytes += take;
        src += take;
        offset += take;
        left -= take;
      }
    }

    BatchId id;
    int used = 0;
    for (const Job& job : jobs) used += job.pieces.empty() ? 0 : 1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      id = next_batch_++;
      batches_[id] = Batch{used, absl::OkStatus()};
    }
    for (size_t i = 0; i < jobs.size(); ++i) {
      if (jobs[i].pieces.empty()) continue;
      jobs[i].batch = id;
      Enqueue(i, std::move(jobs[i]));
    }
    return id;
  }

  absl::Status Wait(BatchId batch, absl::Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown batch ", batch, " (never posted, or already waited for)"));
    }
    if (!WaitFor(done_, lock, timeout, [&] { return it->second.pending == 0; })) {
      return absl::DeadlineExceededError(absl::StrCat("batch ", batch, " to tcp peer ", PeerName(),
                                                      " not complete after ", absl::FormatDuration(timeout)));
    }
    absl::Status s = it->second.status;
    batches_.erase(it);
    return s;
  }

 private:
  struct Batch {
    int pending = 0;
    absl::Status status;
  };

  struct Stream {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Job> queue;
    bool stop = false;
    Fd fd;  // opened by Connect (stream 0) or by the stream's thread; shut down under `mu` to interrupt it
    std::thread thread;
  };

  // Connects to the peer's listener and completes the hello exchange.
  absl::StatusOr<Fd> OpenStream(const PeerInfo& peer, int index, absl::Duration timeout) const {
    WSYNC_ASSIGN_OR_RETURN(Fd fd, ConnectTo(peer.host, peer.port, timeout));
    TuneSocket(fd.get(), std::min(timeout, io_timeout_));
    Hello hello{kFrameMagic, kHello, kProtocolVersion, peer.token, static_cast<uint32_t>(index), 0,
                {peer.secret[0], peer.secret[1]}};
    iovec iov{&hello, sizeof(hello)};
    WSYNC_RETURN_IF_ERROR_CTX(SendAll(fd.get(), &iov, 1), "hello");
    Ack ack;
    WSYNC_RETURN_IF_ERROR_CTX(RecvAll(fd.get(), &ack, sizeof(ack)), "hello");
    std::string msg(std::min(ack.message_len, kMaxAckMessage), '\0');
    if (ack.magic != kFrameMagic || ack.type != kHelloAck) {
      return absl::InvalidArgumentError("hello: the peer does not speak the wsync tcp protocol");
    }
    WSYNC_RETURN_IF_ERROR_CTX(RecvAll(fd.get(), msg.data(), msg.size()), "hello");
    if (ack.code != 0) {
      return absl::Status(static_cast<absl::StatusCode>(ack.code), absl::StrCat("peer refused: ", msg));
    }
    TuneSocket(fd.get(), io_timeout_);
    return fd;
  }

  void Enqueue(size_t index, Job job) {
    Stream* s = streams_[index].get();
    if (s == nullptr) {
      streams_[index] = std::make_unique<Stream>();
      s = streams_[index].get();
    }
    if (!s->thread.joinable()) s->thread = std::thread([this, s, index] { StreamLoop(*s, static_cast<int>(index)); });
    {
      std::lock_guard<std::mutex> lock(s->mu);
      s->queue.push_back(std::move(job));
    }
    s->cv.notify_one();
  }

  void StreamLoop(Stream& s, int index) {
    std::vector<FrameHeader> headers;
    std::vector<iovec> iov;
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(s.mu);
        s.cv.wait(lock, [&] { return s.stop || !s.queue.empty(); });
        if (s.stop) break;
        job = std::move(s.queue.front());
        s.queue.pop_front();
      }
      absl::Status status;
      {
        std::lock_guard<std::mutex> lock(mu_);
        status = broken_;
      }
      if (status.ok() && !s.fd.valid()) {
        // Extra connections open on first use: an endpoint that only receives never opens them.
        absl::StatusOr<Fd> fd = OpenStream(peer_, index, std::min(io_timeout_, absl::Seconds(10)));
        std::lock_guard<std::mutex> lock(s.mu);
        if (!fd.ok()) {
          status = fd.status();
        } else if (s.stop) {
          status = absl::CancelledError("endpoint destroyed");
        } else {
          s.fd = std::move(*fd);
        }
      }
      if (status.ok()) status = SendJob(s.fd.get(), job, headers, iov);
      if (status.ok()) status = ReadAck(s.fd.get(), job);
      if (!status.ok()) {
        status = Annotate(status, absl::StrCat("tcp peer ", PeerName(), " (connection ", index, ", batch ",
                                               job.batch, ")"));
      }
      Complete(job.batch, status);
    }
    std::lock_guard<std::mutex> lock(s.mu);
    for (const Job& job : s.queue) Complete(job.batch, absl::CancelledError("tcp endpoint destroyed"));
    s.queue.clear();
  }

  // Frames go out straight from the source memory: header and payload iovecs, many frames per sendmsg.
  static absl::Status SendJob(int fd, const Job& job, std::vector<FrameHeader>& headers,
                              std::vector<iovec>& iov) {
    headers.resize(kFramesPerSend + 1);
    iov.clear();
    size_t h = 0;
    uint64_t frames = 0;
    auto flush = [&]() -> absl::Status {
      absl::Status s = SendAll(fd, iov.data(), static_cast<int>(iov.size()));
      iov.clear();
      h = 0;
      return s;
    };
    for (const Piece& p : job.pieces) {
      for (uint64_t off = 0; off < p.length; off += kMaxFramePayload) {
        const uint64_t len = std::min(kMaxFramePayload, p.length - off);
        headers[h] = FrameHeader{kFrameMagic, kWrite, 0, job.batch, p.region, p.offset + off, len};
        iov.push_back({&headers[h], sizeof(FrameHeader)});
        iov.push_back({const_cast<char*>(p.src + off), static_cast<size_t>(len)});
        ++h;
        ++frames;
        if (h == kFramesPerSend) WSYNC_RETURN_IF_ERROR(flush());
      }
    }
    headers[h] = FrameHeader{kFrameMagic, kCommit, 0, job.batch, frames, 0, job.bytes};
    iov.push_back({&headers[h], sizeof(FrameHeader)});
    return flush();
  }

  static absl::Status ReadAck(int fd, const Job& job) {
    Ack ack;
    WSYNC_RETURN_IF_ERROR_CTX(RecvAll(fd, &ack, sizeof(ack)), "waiting for the ack");
    if (ack.magic != kFrameMagic || ack.type != kBatchAck) {
      return absl::DataLossError(absl::StrFormat("malformed ack (magic %#x type %d)", ack.magic, ack.type));
    }
    std::string msg(std::min(ack.message_len, kMaxAckMessage), '\0');
    WSYNC_RETURN_IF_ERROR_CTX(RecvAll(fd, msg.data(), msg.size()), "reading the ack");
    if (ack.code != 0) {
      return absl::Status(static_cast<absl::StatusCode>(ack.code), absl::StrCat("receiver rejected: ", msg));
    }
    if (ack.batch != job.batch || ack.bytes != job.bytes) {
      return absl::DataLossError(absl::StrCat("ack for batch ", ack.batch, " (", ack.bytes,
                                              " bytes) while waiting for batch ", job.batch, " (", job.bytes,
                                              " bytes)"));
    }
    return absl::OkStatus();
  }

  void Complete(BatchId batch, const absl::Status& status) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!status.ok() && broken_.ok()) broken_ = status;
      auto it = batches_.find(batch);
      if (it != batches_.end()) {
        if (!status.ok() && it->second.status.ok()) it->second.status = status;
        --it->second.pending;
      }
    }
    done_.notify_all();
  }

  const std::string local_info_;
  std::shared_ptr<RegionTable> grant_table_;
  RegionTable::Secret grant_secret_{0, 0};
  const int max_streams_;
  const absl::Duration io_timeout_;
  // Set by Connect, read-only afterwards (stream threads start after Connect).
  bool connected_ = false;
  PeerInfo peer_;
  // Only the thread using the endpoint touches the vector; each Stream guards itself.
  std::vector<std::unique_ptr<Stream>> streams_;

  std::mutex mu_;
  std::condition_variable done_;
  BatchId next_batch_ = 1;
  std::unordered_map<BatchId, Batch> batches_;
  absl::Status broken_;  // first transport error; the endpoint accepts no batches after it
};

// ---------------------------------------------------------------------------------------------------------------

uint64_t RandomToken() {
  std::random_device rd;
  uint64_t t = 0;
  while (t == 0) t = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return t;
}

class TcpTransport final : public Transport {
 public:
  TcpTransport(const TransportOptions& opts, std::shared_ptr<RegionTable> table, std::string host, int port,
               Fd listen_fd, Fd wake_fd)
      : opts_(opts),
        table_(table),
        local_info_(FormatInfo(host, port, table->token())),
        listener_(std::move(table), std::move(listen_fd), std::move(wake_fd), absl::StrCat(host, ":", port), opts) {}

  std::string name() const override { return "tcp"; }
  bool viable() const override { return true; }
  std::string reason() const override { return ""; }

  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterMemory(void* addr, uint64_t len) override {
    if (addr == nullptr && len > 0) return absl::InvalidArgumentError("cannot register a null address");
    absl::Time start = absl::Now();
    uint64_t id = table_->Add(addr, len);
    spdlog::debug("tcp: registered region {} ({} bytes at {}) in {}", id, len, addr,
                  absl::FormatDuration(absl::Now() - start));
    return std::unique_ptr<LocalRegion>(std::make_unique<TcpLocalRegion>(table_, id, addr, len));
  }

  absl::StatusOr<std::unique_ptr<LocalRegion>> RegisterSink(std::shared_ptr<RegionSink> sink) override {
    if (sink == nullptr) return absl::InvalidArgumentError("cannot register a null sink");
    const uint64_t len = sink->length();
    uint64_t id = table_->Add(nullptr, len, sink);
    spdlog::debug("tcp: registered region {} ({} bytes, staged into {})", id, len, sink->Describe());
    return std::unique_ptr<LocalRegion>(std::make_unique<TcpLocalRegion>(table_, id, nullptr, len));
  }

  absl::StatusOr<std::unique_ptr<RemoteRegion>> ImportRegion(const std::string& descriptor) override {
    RegionDescriptor d;
    if (descriptor.size() != sizeof(d)) {
      return absl::InvalidArgumentError(absl::StrCat("tcp region descriptor must be ", sizeof(d),
                                                     " bytes, got ", descriptor.size()));
    }
    std::memcpy(&d, descriptor.data(), sizeof(d));
    if (d.magic != kDescMagic || d.version != kProtocolVersion || d.token == 0 || d.region == 0) {
      return absl::InvalidArgumentError("not a tcp region descriptor (bad magic, version or ids)");
    }
    return std::unique_ptr<RemoteRegion>(std::make_unique<TcpRemoteRegion>(d.token, d.region, d.length));
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateEndpoint() override {
    return std::unique_ptr<Endpoint>(std::make_unique<TcpEndpoint>(local_info_, opts_));
  }

  absl::StatusOr<std::unique_ptr<Endpoint>> CreateGrantedEndpoint(const WriteGrant& grant) override {
    auto g = std::make_shared<RegionTable::Grant>();
    g->info = grant;
    for (const LocalRegion* r : grant.regions) {
      auto* tr = dynamic_cast<const TcpLocalRegion*>(r);
      if (tr == nullptr) return absl::InvalidArgumentError("write grant names a region of another transport");
      g->regions.insert(tr->id());
    }
    const RegionTable::Secret sec = table_->AddGrant(std::move(g));
    auto ep = std::make_unique<TcpEndpoint>(FormatGrantedInfo(local_info_, sec), opts_);
    ep->SetGrant(table_, sec);
    spdlog::info("tcp: write grant minted for {} ({}, {} regions)", grant.peer, grant.scope, grant.regions.size());
    return std::unique_ptr<Endpoint>(std::move(ep));
  }
  void RevokeGrants(const std::function<bool(const WriteGrant&)>& keep) override { table_->RevokeGrants(keep); }
  absl::Status RequireGrants(bool require) override {
    table_->SetRequireGrants(require);
    return absl::OkStatus();
  }

  absl::Status SetWriteWindow(bool open) override {
    table_->SetWindow(open);
    return absl::OkStatus();
  }
  uint64_t refused_writes() const override { return table_->refused(); }

 private:
  const TransportOptions opts_;
  std::shared_ptr<RegionTable> table_;
  const std::string local_info_;
  Listener listener_;  // last: its threads stop before anything above goes away
};

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateTcpTransport(const TransportOptions& opts) {
  int port = 0;
  absl::StatusOr<Fd> listen_fd = Listen(opts.bind_host, opts.tcp_port, &port);
  if (!listen_fd.ok()) return Annotate(listen_fd.status(), "tcp transport");
  Fd wake_fd(::eventfd(0, EFD_CLOEXEC));
  if (!wake_fd.valid()) return absl::InternalError(absl::StrCat("eventfd: ", ErrnoText(errno)));
  auto table = std::make_shared<RegionTable>(RandomToken());
  spdlog::info("tcp transport listening on {}:{}", opts.bind_host, port);
  return std::unique_ptr<Transport>(std::make_unique<TcpTransport>(opts, std::move(table), opts.bind_host, port,
                                                                   std::move(*listen_fd), std::move(wake_fd)));
}

}  // namespace wsync::transport::tcp
