#include "transport/tcp/tcp_endpoint.h"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
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
constexpr char kInfoPrefix[] = "wsync-tcp/1";

// A std::condition_variable wait with an absl::Duration that may be infinite.
template <typename Pred>
bool WaitFor(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, absl::Duration d, Pred pred) {
  if (d >= absl::Hours(24 * 365)) {
    cv.wait(lock, pred);
    return true;
  }
  return cv.wait_for(lock, absl::ToChronoNanoseconds(std::max(d, absl::ZeroDuration())), pred);
}

struct PeerInfo {
  std::string host;
  int port = 0;
  uint64_t token = 0;
  uint64_t secret[2] = {0, 0};  // a granted endpoint's write secret (sent in every Hello), else zero
};

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
        io_timeout_(opts.io_timeout > absl::ZeroDuration() ? opts.io_timeout : absl::Seconds(30)),
        progress_timeout_(opts.send_progress_timeout),
        event_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

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

  int CompletionFd() const override { return event_.get(); }

  bool Reusable(const std::string& peer_info) const override {
    (void)peer_info;  // any sender endpoint holding the grant's secret connects
    if (!grant_table_ || was_cancelled_.load()) return false;
    auto g = grant_table_->FindGrant(grant_secret_);  // null once revoked
    return g != nullptr && g->connections.load() > 0;
  }

  void Cancel(const absl::Status& why) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!cancelled_.ok()) return;
      cancelled_ = why.ok() ? absl::CancelledError("cancelled") : why;
      was_cancelled_ = true;
      if (broken_.ok()) broken_ = cancelled_;
      if (!streams_ready_) {
        Notify();
        return;
      }
    }
    ShutdownStreams();
    done_.notify_all();
    Notify();
  }

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
    // Every Stream exists from here on (threads start lazily), so Cancel may walk them from another thread.
    streams_.resize(static_cast<size_t>(max_streams_));
    for (auto& st : streams_) st = std::make_unique<Stream>();
    streams_[0]->fd = std::move(*fd);
    connected_ = true;
    std::lock_guard<std::mutex> lock(mu_);
    streams_ready_ = true;
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
    if (event_.valid()) {  // consumed before the state is read: a completion after this read signals it again
      uint64_t n;
      while (read(event_.get(), &n, sizeof(n)) == static_cast<ssize_t>(sizeof(n))) {
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    auto it = batches_.find(batch);
    if (it == batches_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown batch ", batch, " (never posted, or already waited for)"));
    }
    // A batch that failed on one connection is answered at once: the others' sockets were shut down (Complete), and
    // a connection still opening sends nothing once the endpoint is broken.
    if (!WaitFor(done_, lock, timeout,
                 [&] { return it->second.pending == 0 || !cancelled_.ok() || !it->second.status.ok(); })) {
      return absl::DeadlineExceededError(absl::StrCat("batch ", batch, " to tcp peer ", PeerName(),
                                                      " not complete after ", absl::FormatDuration(timeout)));
    }
    absl::Status s = it->second.status;
    if (s.ok() && !cancelled_.ok()) s = cancelled_;
    batches_.erase(it);  // a stream still finishing a cancelled batch finds it gone (Complete ignores it)
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
    SetSendProgressTimeout(fd.get(), progress_timeout_);
    return fd;
  }

  void Enqueue(size_t index, Job job) {
    Stream* s = streams_[index].get();
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
      if (status.ok()) {
        // A Cancel that came while the connection opened did not see its fd: it must not be used.
        std::lock_guard<std::mutex> lock(mu_);
        status = broken_;
      }
      const PeerWatch watch{progress_timeout_, io_timeout_};
      if (status.ok()) status = SendJob(s.fd.get(), job, watch, headers, iov);
      if (status.ok()) status = ReadAck(s.fd.get(), job, watch);
      if (!status.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!cancelled_.ok()) status = cancelled_;  // the socket error a Cancel caused says less than its reason
        // No progress within the i/o timeout fails the batch: Wait reads DeadlineExceeded as "still outstanding"
        // (transport.h), so the batch's answer is terminal, Unavailable.
        if (status.code() == absl::StatusCode::kDeadlineExceeded) status = absl::UnavailableError(status.message());
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
  static absl::Status SendJob(int fd, const Job& job, const PeerWatch& watch, std::vector<FrameHeader>& headers,
                              std::vector<iovec>& iov) {
    headers.resize(kFramesPerSend + 1);
    iov.clear();
    size_t h = 0;
    uint64_t frames = 0;
    auto flush = [&]() -> absl::Status {
      absl::Status s = SendAllWatched(fd, iov.data(), static_cast<int>(iov.size()), watch);
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

  static absl::Status ReadAck(int fd, const Job& job, const PeerWatch& watch) {
    Ack ack;
    WSYNC_RETURN_IF_ERROR_CTX(RecvAllWatched(fd, &ack, sizeof(ack), watch), "waiting for the ack");
    if (ack.magic != kFrameMagic || ack.type != kBatchAck) {
      return absl::DataLossError(absl::StrFormat("malformed ack (magic %#x type %d)", ack.magic, ack.type));
    }
    std::string msg(std::min(ack.message_len, kMaxAckMessage), '\0');
    WSYNC_RETURN_IF_ERROR_CTX(RecvAllWatched(fd, msg.data(), msg.size(), watch), "reading the ack");
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

  // A stream thread blocked in send or recv on its socket returns at once; queued jobs fail with broken_ (set first).
  void ShutdownStreams() {
    for (auto& st : streams_) {
      std::lock_guard<std::mutex> lock(st->mu);
      if (st->fd.valid()) st->fd.ShutdownBoth();
    }
  }

  void Complete(BatchId batch, const absl::Status& status) {
    bool first_error = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!status.ok() && broken_.ok()) {
        broken_ = status;
        first_error = true;
      }
      auto it = batches_.find(batch);
      if (it != batches_.end()) {
        if (!status.ok() && it->second.status.ok()) it->second.status = status;
        --it->second.pending;
      }
    }
    // The endpoint is dead (the contract: re-create it): the other connections stop now rather than at their own
    // timeouts, so that no batch waits on a connection of a broken endpoint.
    if (first_error) ShutdownStreams();
    done_.notify_all();
    Notify();
  }

  // Makes CompletionFd readable.
  void Notify() const {
    if (!event_.valid()) return;
    const uint64_t one = 1;
    ssize_t r = write(event_.get(), &one, sizeof(one));
    (void)r;  // only EAGAIN (the counter is full, i.e. readable already) can fail it
  }

  const std::string local_info_;
  std::shared_ptr<RegionTable> grant_table_;
  RegionTable::Secret grant_secret_{0, 0};
  const int max_streams_;
  const absl::Duration io_timeout_;
  const absl::Duration progress_timeout_;
  const Fd event_;  // CompletionFd: an eventfd, written on every completion and by Cancel
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
  absl::Status cancelled_;      // Cancel's reason
  std::atomic<bool> was_cancelled_{false};  // !cancelled_.ok(), for Reusable without mu_
  bool streams_ready_ = false;  // Connect created every Stream (Cancel walks them only then)
};

}  // namespace

std::string FormatInfo(const std::string& host, int port, uint64_t token) {
  return absl::StrFormat("%s %s %d %016x", kInfoPrefix, host, port, token);
}

std::string FormatGrantedInfo(const std::string& info, const RegionTable::Secret& sec) {
  return absl::StrFormat("%s %016x%016x", info, sec.first, sec.second);
}

std::unique_ptr<Endpoint> NewTcpEndpoint(std::string local_info, const TransportOptions& opts,
                                         std::shared_ptr<RegionTable> grant_table, RegionTable::Secret secret) {
  auto ep = std::make_unique<TcpEndpoint>(std::move(local_info), opts);
  if (grant_table != nullptr) ep->SetGrant(std::move(grant_table), secret);
  return ep;
}

}  // namespace wsync::transport::tcp
