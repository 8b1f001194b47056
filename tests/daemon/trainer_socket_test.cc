// The source daemon's trainer socket, in process: a real SourceNode behind TrainerSocket and the TrainerIngest gRPC
// server on a Unix socket, reached by the real C++ client. A session hands over a working ring; a process of another
// uid is refused naming its uid and gid; a forged session id is refused; a dead path fails within the connect
// timeout naming it, a missing path at once; a TCP address is refused.

#include <catch2/catch.hpp>

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <future>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "base/fd_passing.h"
#include "client/trainer_client.h"
#include "daemon/common/serve.h"
#include "daemon/node/node_services.h"
#include "daemon/node/source_node.h"
#include "daemon/node/trainer_socket.h"
#include "transport/transport.h"

namespace wsync::daemon {
namespace {

struct Daemon {
  std::string dir, path;
  std::unique_ptr<transport::Transport> transport;  // unused by sessions; the node reports its name
  std::unique_ptr<SourceNode> node;
  std::unique_ptr<TrainerIngestService> ingest;
  std::unique_ptr<grpc::Server> rpc;
  std::unique_ptr<TrainerSocket> sock;

  explicit Daemon(std::vector<uint32_t> uids = {}) {
    char tmpl[] = "/tmp/wsync-trainer-socket-test.XXXXXX";
    dir = mkdtemp(tmpl);
    chmod(dir.c_str(), 0755);
    path = dir + "/wsyncd.sock";
    transport::TransportOptions topts;
    topts.bind_host = "127.0.0.1";
    auto tr = transport::CreateTransport("tcp", topts);
    REQUIRE(tr.ok());
    transport = *std::move(tr);
    SourceOptions o;
    o.node_id = "src";
    o.trainer_ranks = 2;
    o.ring_bytes = 1 << 20;
    node = std::make_unique<SourceNode>(o, transport.get(), [](const std::string&, const v1::ConnectTargetRequest&)
                                                        -> absl::StatusOr<std::string> { return std::string(); });
    ingest = std::make_unique<TrainerIngestService>(node.get());
    TrainerSocketOptions to;
    to.path = path;
    to.uids = std::move(uids);
    auto r = ServeUnix(path + ".rpc", {ingest.get()}, TrainerSocket::SocketMode(to));
    REQUIRE(r.ok());
    rpc = *std::move(r);
    auto s = TrainerSocket::Start(to, node.get(), "unix:" + path + ".rpc");
    INFO(s.status().ToString());
    REQUIRE(s.ok());
    sock = *std::move(s);
  }
  ~Daemon() {
    sock.reset();
    rpc->Shutdown();
    rpc.reset();
    node.reset();
    std::system(("rm -rf " + dir).c_str());
  }
};

client::TrainerOptions Opts(const std::string& path, int rank = 0) {
  client::TrainerOptions o;
  o.daemon = path;
  o.local_rank = rank;
  o.connect_timeout = absl::Seconds(5);
  o.timeout = absl::Seconds(1);
  return o;
}

TEST_CASE("trainer socket: a session hands over a working ring and a 128-bit id", "[trainer_socket]") {
  Daemon d;
  struct stat st {};
  REQUIRE(stat(d.path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0660);
  auto c = client::TrainerClient::Connect(Opts(d.path));
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  CHECK((*c)->session_id().size() == 32);
  CHECK((*c)->session_label() == "src-s0");
  CHECK(d.node->Status().sessions() == 1);
  // The ring is really shared with the daemon: a pushed bucket reaches it (and is refused, as no update is open).
  const uint16_t bits[4] = {1, 2, 3, 4};
  const int64_t shape[1] = {4};
  REQUIRE((*c)->Push("model.norm.weight", DType::kBF16, shape, bits, sizeof(bits)).ok());
  absl::Status flushed = (*c)->Flush();
  CHECK(absl::IsFailedPrecondition(flushed));
  CHECK(absl::StrContains(flushed.message(), "no update is open"));
  // "no update is open" within the rank's own timeout (1 s).
  const absl::Time t0 = absl::Now();
  auto begun = (*c)->BeginPush(1);
  CHECK(absl::Now() - t0 < absl::Milliseconds(1100));
  CHECK(absl::IsDeadlineExceeded(begun.status()));
  CHECK(absl::StrContains(begun.status().message(), "no update is open"));

  // A second session id per rank; the first rank's connection going away ends its session.
  auto c2 = client::TrainerClient::Connect(Opts(d.path, 1));
  REQUIRE(c2.ok());
  CHECK((*c2)->session_id() != (*c)->session_id());
  c->reset();
  c2->reset();
  for (int i = 0; i < 100 && d.node->Status().sessions() > 0; ++i) usleep(10000);
  CHECK(d.node->Status().sessions() == 0);
}

TEST_CASE("trainer socket: a forged session id is refused on every call", "[trainer_socket]") {
  Daemon d;
  auto c = client::TrainerClient::Connect(Opts(d.path));
  REQUIRE(c.ok());
  std::string forged = (*c)->session_id();
  forged[0] = forged[0] == '0' ? '1' : '0';
  v1::BeginPushRequest bp;
  bp.set_session_id(forged);
  bp.set_version(1);
  CHECK(absl::IsPermissionDenied(d.node->BeginPush(bp).status()));
  v1::CommitBucketRequest cb;
  cb.set_session_id(forged);
  CHECK(absl::IsPermissionDenied(d.node->CommitBucket(cb).status()));
  v1::EndPushRequest ep;
  ep.set_session_id(forged);
  absl::Status ended = d.node->EndPush(ep);
  CHECK(absl::IsPermissionDenied(ended));
  CHECK_FALSE(absl::StrContains(ended.message(), forged));  // ids are never echoed
  CHECK(absl::IsPermissionDenied(d.node->CloseSession(forged)));
  CHECK(d.node->Status().sessions() == 1);
}

TEST_CASE("trainer socket: a process of another uid is refused, named", "[trainer_socket]") {
  if (geteuid() != 0) {
    FAIL("needs root to run a client as another uid (CI runs as root)");
  }
  Daemon d({4242});  // another uid allowed: the socket is 0666 and SO_PEERCRED alone decides
  struct stat st {};
  REQUIRE(stat(d.path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0666);
  int pipefd[2];
  REQUIRE(pipe(pipefd) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    close(pipefd[0]);
    if (setresgid(65534, 65534, 65534) != 0 || setresuid(65534, 65534, 65534) != 0) _exit(3);
    auto c = client::TrainerClient::Connect(Opts(d.path));
    const std::string msg = c.ok() ? "OPENED" : c.status().ToString();
    (void)!write(pipefd[1], msg.data(), msg.size());
    _exit(0);
  }
  close(pipefd[1]);
  std::string msg;
  char buf[512];
  for (ssize_t n; (n = read(pipefd[0], buf, sizeof(buf))) > 0;) msg.append(buf, n);
  close(pipefd[0]);
  int status = 0;
  waitpid(child, &status, 0);
  INFO(msg);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(absl::StartsWith(msg, "PERMISSION_DENIED"));
  CHECK(absl::StrContains(msg, "uid 65534 gid 65534"));
  CHECK(d.node->Status().sessions() == 0);
}

TEST_CASE(
    "trainer socket: a missing path fails at once, a dead socket within the connect timeout; a TCP address is "
    "refused",
    "[trainer_socket]") {
  // A path that does not exist is a wrong path: no wait, the path named.
  const std::string missing = "/tmp/wsync-no-daemon-here-" + std::to_string(getpid()) + ".sock";
  client::TrainerOptions o = Opts(missing);
  o.connect_timeout = absl::Seconds(5);
  absl::Time t0 = absl::Now();
  auto c = client::TrainerClient::Connect(o);
  absl::Duration took = absl::Now() - t0;
  INFO(c.status().ToString() << " after " << absl::FormatDuration(took));
  CHECK(absl::IsNotFound(c.status()));
  CHECK(absl::StrContains(c.status().message(), missing));
  CHECK(absl::StrContains(c.status().message(), "does not exist"));
  CHECK(took < absl::Milliseconds(200));

  // A socket file nobody listens on (a daemon that died or is restarting): retried until the connect timeout.
  const std::string dead = "/tmp/wsync-dead-daemon-" + std::to_string(getpid()) + ".sock";
  {
    ScopedFd s(socket(AF_UNIX, SOCK_STREAM, 0));
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, dead.c_str(), dead.size());
    unlink(dead.c_str());
    REQUIRE(bind(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);  // bound, never listening
  }
  o = Opts(dead);
  o.connect_timeout = absl::Milliseconds(500);
  t0 = absl::Now();
  c = client::TrainerClient::Connect(o);
  took = absl::Now() - t0;
  unlink(dead.c_str());
  INFO(c.status().ToString() << " after " << absl::FormatDuration(took));
  CHECK(absl::IsDeadlineExceeded(c.status()));
  CHECK(absl::StrContains(c.status().message(), dead));
  CHECK(took >= absl::Milliseconds(500));
  CHECK(took < absl::Milliseconds(900));

  auto tcp = client::TrainerClient::Connect(Opts("127.0.0.1:7601"));
  CHECK(absl::IsInvalidArgument(tcp.status()));
  CHECK(absl::StrContains(tcp.status().message(), "not a Unix socket path"));
}

TEST_CASE("trainer socket: a live socket is not taken over; a stale one is replaced", "[trainer_socket]") {
  Daemon d;
  CHECK(absl::IsAlreadyExists(TrainerSocket::ClaimPath(d.path)));
  const std::string stale = d.dir + "/stale.sock";
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", stale.c_str());
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  close(fd);  // bound, never listened: what a dead daemon leaves
  CHECK(TrainerSocket::ClaimPath(stale).ok());
  CHECK(access(stale.c_str(), F_OK) != 0);
}

// A raw connection to the trainer socket (the test speaks the frame format itself).
ScopedFd Dial(const std::string& path) {
  ScopedFd s(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::snprintf(a.sun_path, sizeof(a.sun_path), "%s", path.c_str());
  REQUIRE(connect(s.get(), reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0);
  return s;
}

// base/fd_passing.h framing, built here: a 4-byte little-endian length, then the message.
std::string Frame(const std::string& msg) {
  const uint32_t len = static_cast<uint32_t>(msg.size());
  std::string out(4, '\0');
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((len >> (8 * i)) & 0xff);
  return out + msg;
}

// The loop never blocks on one peer (issue 39): a rank that trickles its hello a byte at a time (a frame that would
// take ~30 s) holds up no other rank's session open, and is closed once its one deadline for the whole frame (5 s
// from its accept) passed, however recently its last byte came. A hello arriving in pieces within the deadline opens
// its session.
TEST_CASE("trainer socket: a trickling peer delays no other rank and is cut at its frame deadline",
          "[trainer_socket][faults]") {
  Daemon d;
  const std::string slow = Frame(R"({"type": "open", "protocol": 1, "local_rank": 0, "pad": "xxxxx"})");
  ScopedFd trickler = Dial(d.path);
  const absl::Time trickle_start = absl::Now();
  std::promise<void> inside;  // set once the trickler is inside its frame
  absl::Time cut_at;
  size_t sent = 0;
  std::thread t([&] {
    for (; sent < slow.size(); ++sent) {
      if (send(trickler.get(), slow.data() + sent, 1, MSG_NOSIGNAL) != 1) break;  // the daemon closed it
      if (sent == 1) inside.set_value();
      absl::SleepFor(absl::Milliseconds(400));  // the trickler's own pacing
    }
    cut_at = absl::Now();
    if (sent <= 1) inside.set_value();
  });
  struct Joiner {
    std::thread& t;
    ~Joiner() {
      if (t.joinable()) t.join();
    }
  } joiner{t};
  inside.get_future().wait();

  // Rank 1 opens its session at once.
  const absl::Time t0 = absl::Now();
  client::TrainerOptions o = Opts(d.path, 1);
  o.connect_timeout = absl::Seconds(3);
  auto c = client::TrainerClient::Connect(o);
  const absl::Duration took = absl::Now() - t0;
  INFO(c.status().ToString() << " after " << absl::FormatDuration(took));
  REQUIRE(c.ok());
  CHECK(took < absl::Seconds(1));

  // Rank 0's hello in three pieces (the length prefix split): reassembled, answered with its ring.
  ScopedFd pieces = Dial(d.path);
  const std::string hello = Frame(R"({"type": "open", "protocol": 1, "local_rank": 0, "global_rank": 4})");
  for (const auto& [at, n] : {std::pair<size_t, size_t>{0, 2}, {2, 9}, {11, hello.size() - 11}})
    REQUIRE(send(pieces.get(), hello.data() + at, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n));
  auto reply = ReceiveFds(pieces.get());
  INFO(reply.status().ToString());
  REQUIRE(reply.ok());
  CHECK(absl::StrContains(reply->message, "\"ok\":true"));
  CHECK(reply->fds.size() == 1);
  CHECK(d.node->Status().sessions() == 2);

  t.join();
  INFO("trickled " << sent << " of " << slow.size() << " bytes in " << absl::FormatDuration(cut_at - trickle_start));
  CHECK(sent < slow.size());                           // cut off before it finished
  CHECK(cut_at - trickle_start < absl::Seconds(7));    // at its deadline (5 s) plus one pacing step and slack
  CHECK(d.node->Status().sessions() == 2);             // the trickler opened nothing
}

}  // namespace
}  // namespace wsync::daemon
