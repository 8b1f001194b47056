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
#include "transport/tcp/tcp_wire.h"

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
    absl::Time deadline;  // accept time + hello_timeout: the whole hello must be in by then
    Hello hello{};
    size_t got = 0;  // bytes of `hello` received so far
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
      // Pending connections: readable → read what there is of the hello (a complete, admitted one is handed to a
      // thread); past the deadline → closed, however many bytes came.
      const absl::Time now = absl::Now();
      std::vector<Pending> still;
      for (size_t i = 0; i < pending_.size(); ++i) {
        Pending& w = pending_[i];
        if (p[2 + i].revents != 0 && !ReadHello(w)) continue;
        if (w.conn == nullptr) continue;  // handed to its thread
        if (now >= w.deadline) {
          table_->CountRefused();
          table_->WarnPeer(w.conn->host, absl::StrCat("tcp listener ", address_, ": ", w.conn->peer, " sent ", w.got,
                                                      " of the ", sizeof(Hello), " bytes of its hello within ",
                                                      absl::FormatDuration(hello_timeout_), "; closed"));
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
      table_->WarnPeer(
          host, absl::StrCat("tcp listener ", address_, ": connection from ", host, " refused: ",
                             from_peer >= max_per_peer_ ? absl::StrCat(max_per_peer_, " connections from that address")
                                                        : absl::StrCat(max_total_, " connections in total")));
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

  // Reads what has arrived of `w`'s hello without blocking. Once it is complete: admitted → handed to a thread
  // (w.conn becomes null), refused → answered and closed. False when the connection is gone (closed, failed or
  // refused) and `w` is to be forgotten; true while it stays pending or was handed over.
  bool ReadHello(Pending& w) {
    Conn& c = *w.conn;
    const ssize_t n =
        ::recv(c.fd.get(), reinterpret_cast<char*>(&w.hello) + w.got, sizeof(Hello) - w.got, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return true;
    if (n <= 0) {
      spdlog::debug("tcp listener {}: {} closed before its hello ({} of {} bytes): {}", address_, c.peer, w.got,
                    sizeof(Hello), n == 0 ? std::string("EOF") : ErrnoText(errno));
      Drop(c.host);
      return false;
    }
    w.got += static_cast<size_t>(n);
    if (w.got < sizeof(Hello)) return true;
    absl::StatusOr<std::shared_ptr<RegionTable::Grant>> grant = AdmitHello(w.hello, *table_);
    if (!grant.ok()) {
      table_->WarnPeer(c.host, absl::StrCat("tcp listener ", address_, ": hello from ", c.peer,
                                            " refused: ", grant.status().ToString()));
      RejectHello(c.fd.get(), grant.status());
      Drop(c.host);
      return false;
    }
    Serve(std::move(w.conn), *std::move(grant));
    return true;
  }

  void Serve(std::unique_ptr<Conn> conn, std::shared_ptr<RegionTable::Grant> grant) {
    Conn* c = conn.get();
    c->thread = std::thread([this, c, grant = std::move(grant)]() mutable {
      absl::Status s = ServeConnection(c->fd.get(), *table_, c->peer, std::move(grant));
      // The peer sees EOF now; the fd itself is closed when the thread is reaped (no fd-reuse race).
      c->fd.ShutdownBoth();
      if (s.code() == absl::StatusCode::kUnavailable) {
        spdlog::debug("tcp listener {}: connection from {} ended: {}", address_, c->peer, s.ToString());
      } else {
        table_->WarnPeer(
            c->host, absl::StrCat("tcp listener ", address_, ": connection from ", c->peer, " failed: ", s.ToString()));
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
  std::thread thread_;
};

Listener::Listener(std::shared_ptr<RegionTable> table, Fd listen_fd, Fd wake_fd, std::string address,
                   const TransportOptions& opts)
    : impl_(std::make_unique<Impl>(std::move(table), std::move(listen_fd), std::move(wake_fd), std::move(address),
                                   opts)) {}

Listener::~Listener() = default;

}  // namespace wsync::transport::tcp
