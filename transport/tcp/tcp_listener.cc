#include "transport/tcp/tcp_listener.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <list>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_server.h"

namespace wsync::transport::tcp {

class Listener::Impl {
 public:
  Impl(std::shared_ptr<RegionTable> table, Fd listen_fd, Fd wake_fd, std::string address,
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

  ~Impl() {
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
      absl::Status s = ServeConnection(c->fd.get(), *table_, c->peer);
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

Listener::Listener(std::shared_ptr<RegionTable> table, Fd listen_fd, Fd wake_fd, std::string address,
                   const TransportOptions& opts)
    : impl_(std::make_unique<Impl>(std::move(table), std::move(listen_fd), std::move(wake_fd), std::move(address),
                                   opts)) {}

Listener::~Listener() = default;

}  // namespace wsync::transport::tcp
