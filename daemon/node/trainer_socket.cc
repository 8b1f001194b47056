#include "daemon/node/trainer_socket.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <google/protobuf/util/json_util.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "daemon/common/serve.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

std::string ToJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

// A connected peer's whole hello frame must arrive within this (read without blocking: it holds no one else up).
constexpr int kHelloTimeoutMs = 5000;
// Connections at once (open sessions plus ones that have not sent their hello yet).
constexpr size_t kMaxConns = 1024;
constexpr size_t kMaxHelloBytes = 4096;

int64_t NowMs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000 + ts.tv_nsec / 1000000;
}

absl::Status ErrnoError(absl::string_view what) {
  const int err = errno;
  return absl::ErrnoToStatus(err, absl::StrCat(what, ": ", std::strerror(err)));
}

void Refuse(int fd, const std::string& why) {
  timeval tv{1, 0};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  v1::TrainerOpened r;
  r.set_type("opened");
  r.set_error(why);
  (void)SendFds(fd, {}, ToJson(r));
}

}  // namespace

std::string DefaultTrainerSocket() { return DefaultSocketPath("wsyncd.sock"); }

int TrainerSocket::SocketMode(const TrainerSocketOptions& opts) { return opts.uids.empty() ? 0660 : 0666; }

absl::Status TrainerSocket::ClaimPath(const std::string& path) {
  sockaddr_un addr{};
  if (path.empty() || path.front() != '/' || path.size() + 4 >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(absl::StrCat("trainer socket path '", path, "' must be absolute and at most ",
                                                   sizeof(addr.sun_path) - 5, " bytes (its gRPC socket adds .rpc)"));
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) return absl::OkStatus();
  if (!S_ISSOCK(st.st_mode))
    return absl::FailedPreconditionError(absl::StrCat("trainer socket path ", path, " exists and is not a socket"));
  ScopedFd probe(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  if (probe.valid() && connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0)
    return absl::AlreadyExistsError(absl::StrCat("another daemon serves trainer socket ", path,
                                                 ": give this one its own --trainer-socket"));
  unlink(path.c_str());  // left behind by a daemon that died
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TrainerSocket>> TrainerSocket::Start(TrainerSocketOptions opts, SourceNode* source,
                                                                    std::string rpc_address) {
  std::unique_ptr<TrainerSocket> t(new TrainerSocket(std::move(opts), source, std::move(rpc_address)));
  const std::string& path = t->opts_.path;
  WSYNC_RETURN_IF_ERROR(ClaimPath(path));
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos && slash > 0)
    WSYNC_RETURN_IF_ERROR_CTX(MakeDirs(path.substr(0, slash), 0711), "trainer socket directory");
  ScopedFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return ErrnoError("trainer socket");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  if (bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    return ErrnoError(absl::StrCat("bind trainer socket ", path));
  if (chmod(path.c_str(), SocketMode(t->opts_)) != 0) return ErrnoError(absl::StrCat("chmod ", path));
  if (!t->opts_.gids.empty() && chown(path.c_str(), static_cast<uid_t>(-1), t->opts_.gids.front()) != 0)
    spdlog::warn("trainer socket {}: chown to group {} failed ({}); members of it connect only if the mode allows",
                 path, t->opts_.gids.front(), std::strerror(errno));
  if (listen(fd.get(), 128) != 0) return ErrnoError(absl::StrCat("listen on trainer socket ", path));
  int pipefd[2];
  if (pipe2(pipefd, O_CLOEXEC) != 0) return ErrnoError("pipe");
  t->wake_rd_.reset(pipefd[0]);
  t->wake_wr_.reset(pipefd[1]);
  t->listen_fd_ = std::move(fd);
  TrainerSocket* raw = t.get();
  t->loop_ = std::thread([raw] { raw->Loop(); });
  spdlog::info("trainer socket {} (mode {:o}; peers: {}), trainer RPCs on {}", path, SocketMode(t->opts_),
               t->Allowed(), t->rpc_address_);
  return t;
}

TrainerSocket::~TrainerSocket() {
  if (loop_.joinable()) {
    stop_ = true;
    char b = 1;
    if (write(wake_wr_.get(), &b, 1) < 0) spdlog::warn("waking the trainer socket loop: {}", std::strerror(errno));
    loop_.join();
  }
  conns_.clear();
  if (listen_fd_.valid()) {
    listen_fd_.reset();
    if (unlink(opts_.path.c_str()) != 0 && errno != ENOENT)
      spdlog::warn("removing trainer socket {}: {}", opts_.path, std::strerror(errno));
  }
}

std::string TrainerSocket::Allowed() const {
  std::vector<uint32_t> uids = {static_cast<uint32_t>(getuid())};
  for (uint32_t u : opts_.uids)
    if (std::find(uids.begin(), uids.end(), u) == uids.end()) uids.push_back(u);
  std::string out = absl::StrCat("uid ", absl::StrJoin(uids, ", "));
  if (!opts_.gids.empty()) absl::StrAppend(&out, "; gid ", absl::StrJoin(opts_.gids, ", "));
  return out;
}

void TrainerSocket::Loop() {
  while (!stop_) {
    std::vector<pollfd> pfds;
    pfds.push_back({wake_rd_.get(), POLLIN, 0});
    pfds.push_back({listen_fd_.get(), POLLIN, 0});
    int64_t next_deadline = -1;
    for (const auto& [fd, c] : conns_) {
      pfds.push_back({fd, POLLIN, 0});
      if (c->session_id.empty() && (next_deadline < 0 || c->hello_by_ms < next_deadline))
        next_deadline = c->hello_by_ms;
    }
    const int timeout = next_deadline < 0 ? -1 : static_cast<int>(std::max<int64_t>(0, next_deadline - NowMs()) + 1);
    const int n = poll(pfds.data(), pfds.size(), timeout);
    if (n < 0) {
      if (errno == EINTR) continue;
      spdlog::error("trainer socket poll: {}", std::strerror(errno));
      return;
    }
    if (pfds[0].revents != 0) return;
    if (pfds[1].revents & POLLIN) Accept();
    const int64_t now = NowMs();
    // Sessions' connections first, hellos second: a rank's new process whose hello arrives in the same poll as its
    // old process's exit is a reconnect, not a takeover of a live session (SourceNode::OpenSession).
    for (const bool sessions : {true, false}) {
      for (size_t i = 2; i < pfds.size(); ++i) {
        auto it = conns_.find(pfds[i].fd);
        if (it == conns_.end() || it->second->session_id.empty() == sessions) continue;
        Conn* c = it->second.get();
        bool keep = true;
        if (pfds[i].revents != 0) keep = Serve(c);
        // One deadline for the whole frame, however its bytes trickle in.
        if (keep && c->session_id.empty() && std::max(now, NowMs()) >= c->hello_by_ms) {
          spdlog::warn("trainer socket: pid {} (uid {}) sent no complete hello within {} ms ({} bytes); closed", c->pid,
                       c->uid, kHelloTimeoutMs, c->hello.size());
          keep = false;
        }
        if (!keep) conns_.erase(it);
      }
    }
  }
}

void TrainerSocket::Accept() {
  ScopedFd fd(accept4(listen_fd_.get(), nullptr, nullptr, SOCK_CLOEXEC));
  if (!fd.valid()) {
    if (errno != EAGAIN && errno != EWOULDBLOCK) spdlog::warn("trainer socket accept: {}", std::strerror(errno));
    return;
  }
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    spdlog::warn("trainer socket: SO_PEERCRED: {}", std::strerror(errno));
    return;
  }
  const bool allowed = cred.uid == getuid() ||
                       std::find(opts_.uids.begin(), opts_.uids.end(), cred.uid) != opts_.uids.end() ||
                       std::find(opts_.gids.begin(), opts_.gids.end(), cred.gid) != opts_.gids.end();
  if (!allowed) {
    const std::string why = absl::StrCat("permission denied: a process of uid ", cred.uid, " gid ", cred.gid,
                                         " may not open a trainer session on ", opts_.path, " (allowed: ", Allowed(),
                                         "; see wsyncd --trainer-uid / --trainer-gid)");
    spdlog::warn("trainer socket: refused pid {}: {}", cred.pid, why);
    Refuse(fd.get(), why);
    return;
  }
  if (conns_.size() >= kMaxConns) {
    const std::string why = absl::StrCat("too many trainer connections (", kMaxConns, ")");
    spdlog::warn("trainer socket: refused pid {}: {}", cred.pid, why);
    Refuse(fd.get(), why);
    return;
  }
  // Reads never block (ReadHello); the answer is one small frame, bounded all the same.
  timeval tv{kHelloTimeoutMs / 1000, 0};
  setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  auto c = std::make_unique<Conn>();
  c->uid = cred.uid;
  c->gid = cred.gid;
  c->pid = cred.pid;
  c->hello_by_ms = NowMs() + kHelloTimeoutMs;
  const int raw = fd.get();
  c->fd = std::move(fd);
  conns_[raw] = std::move(c);
}

bool TrainerSocket::Serve(Conn* c) {
  if (!c->session_id.empty()) {
    // An open session's connection carries nothing more: readable means closed (or a protocol error).
    char b;
    const ssize_t n = recv(c->fd.get(), &b, 1, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
    source_->SessionDisconnected(c->session_id, n == 0 ? "closed its trainer connection"
                                                       : "sent bytes after its hello (protocol error)");
    return false;
  }
  absl::StatusOr<bool> complete = ReadHello(c);
  if (!complete.ok()) {
    if (!absl::IsUnavailable(complete.status()))
      spdlog::warn("trainer socket: pid {}: bad hello: {}", c->pid, complete.status().ToString());
    return false;
  }
  if (!*complete) return true;  // the rest of the frame is still to come (within its deadline)
  const std::string message = c->hello.substr(4);
  c->hello.clear();
  SessionRequest req;
  req.pid = c->pid;
  req.uid = c->uid;
  std::string error;
  v1::TrainerHello hello;
  google::protobuf::util::JsonParseOptions po;
  po.ignore_unknown_fields = true;  // newer clients may say more
  if (c->hello_fds) {
    error = "the hello must not carry descriptors";
  } else if (auto st = google::protobuf::util::JsonStringToMessage(message, &hello, po); !st.ok()) {
    error = absl::StrCat("malformed hello (want {\"type\": \"open\", \"protocol\": 1, \"local_rank\": R}): ",
                         st.ToString());
  } else if (hello.type() == "replica") {
    return ServeReplica(c, hello.session_id());
  } else if (hello.type() != "open") {
    error = absl::StrCat("the first message must have type \"open\", not \"", hello.type(), "\"");
  } else if (hello.protocol() != kTrainerProtocol) {
    error = absl::StrCat("trainer protocol ", hello.protocol(), " is not supported (this daemon speaks ",
                         kTrainerProtocol, ")");
  }
  req.local_rank = hello.local_rank();
  req.global_rank = hello.global_rank();
  if (!error.empty()) {
    spdlog::warn("trainer socket: pid {}: {}", c->pid, error);
    Refuse(c->fd.get(), error);
    return false;
  }
  absl::StatusOr<OpenedSession> s = source_->OpenSession(req);
  if (!s.ok()) {
    spdlog::warn("trainer socket: pid {} rank {}: {}", c->pid, req.local_rank, s.status().ToString());
    Refuse(c->fd.get(), std::string(s.status().message()));
    return false;
  }
  v1::TrainerOpened reply;
  reply.set_type("opened");
  reply.set_ok(true);
  reply.set_session_id(s->id);
  reply.set_ring_bytes(s->ring_bytes);
  reply.set_num_local_ranks(s->num_local_ranks);
  reply.set_rpc(rpc_address_);
  reply.set_session(s->label);
  const int fds[1] = {s->ring_fd.get()};
  if (absl::Status sent = SendFds(c->fd.get(), fds, ToJson(reply)); !sent.ok()) {
    spdlog::warn("trainer socket: session {}: cannot hand over the ring: {}", s->label, sent.ToString());
    source_->SessionDisconnected(s->id, "went away during the hand-over");
    return false;
  }
  c->session_id = s->id;
  return true;
}

absl::StatusOr<bool> TrainerSocket::ReadHello(Conn* c) {
  // The framing of base/fd_passing.h: a 4-byte little-endian length, then the message. Only the frame's own bytes
  // are read (nothing follows a hello before its answer anyway).
  static_assert(kMaxHelloBytes <= kMaxFdMessageBytes, "a hello is an ordinary fd_passing frame");
  char buf[kMaxHelloBytes + 4];
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFdsPerFrame));
  for (;;) {
    size_t want = 4 - std::min<size_t>(c->hello.size(), 4);
    if (c->hello.size() >= 4) {
      uint32_t len;
      std::memcpy(&len, c->hello.data(), 4);
      if (len > kMaxHelloBytes)
        return absl::DataLossError(absl::StrCat("hello of ", len, " bytes exceeds ", kMaxHelloBytes));
      want = 4 + len - c->hello.size();
    }
    if (want == 0) return true;
    iovec iov{buf, want};
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = control.data();
    mh.msg_controllen = control.size();
    const ssize_t n = recvmsg(c->fd.get(), &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return false;
    if (n < 0) return ErrnoError("reading the hello");
    // Descriptors are never part of a hello: closed at once, and the hello is refused once complete.
    for (cmsghdr* m = CMSG_FIRSTHDR(&mh); m != nullptr; m = CMSG_NXTHDR(&mh, m)) {
      if (m->cmsg_level != SOL_SOCKET || m->cmsg_type != SCM_RIGHTS) continue;
      const size_t count = (m->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(m) + i * sizeof(int), sizeof(int));
        ScopedFd closed(fd);
      }
      c->hello_fds = true;
    }
    if ((mh.msg_flags & MSG_CTRUNC) != 0) c->hello_fds = true;
    if (n == 0) return absl::UnavailableError("the peer closed before its hello was complete");
    c->hello.append(buf, static_cast<size_t>(n));
  }
}

bool TrainerSocket::ServeReplica(Conn* c, const std::string& session_id) {
  v1::TrainerOpened reply;
  reply.set_type("replica");
  absl::StatusOr<SourceNode::ReplicaHandles> h = source_->ReplicaFds(session_id);
  if (!h.ok()) {
    spdlog::warn("trainer socket: pid {}: replica buffers refused: {}", c->pid, h.status().ToString());
    reply.set_error(std::string(h.status().message()));
    (void)SendFds(c->fd.get(), {}, ToJson(reply));
    return false;
  }
  reply.set_ok(true);
  reply.set_replica_generation(h->generation);
  std::vector<int> fds;
  for (size_t i = 0; i < h->fds.size(); ++i) {
    fds.push_back(h->fds[i].get());
    reply.add_replica_bytes(h->bytes[i]);
  }
  if (absl::Status sent = SendFds(c->fd.get(), fds, ToJson(reply)); !sent.ok())
    spdlog::warn("trainer socket: pid {}: cannot hand over the replica buffers: {}", c->pid, sent.ToString());
  return false;  // one answer per connection; the session's own connection stays the liveness signal
}

}  // namespace wsync::daemon
