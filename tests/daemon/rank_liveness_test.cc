// Trainer rank liveness on a source daemon, in process (a real SourceNode behind its TrainerSocket and TrainerIngest
// server, a null transport) with real trainer processes (daemon_trainer_child: the C++ client) that are SIGKILLed or
// whose session another process takes over while update 1 is open: the update fails within the rank grace, naming
// the rank, instead of at the commit's own timeout. Prints the measured detection times (docs/operations.md).

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/serve.h"
#include "daemon/node/node_services.h"
#include "daemon/node/source_node.h"
#include "daemon/node/trainer_socket.h"
#include "tests/daemon/null_source.h"

namespace wsync::daemon {
namespace {

constexpr int64_t kPlan = 3;
constexpr absl::Duration kGrace = absl::Seconds(1);

struct Daemon {
  std::string dir, path;
  testing::NullTransport transport;
  std::unique_ptr<SourceNode> node;
  std::unique_ptr<TrainerIngestService> ingest;
  std::unique_ptr<grpc::Server> rpc;
  std::unique_ptr<TrainerSocket> sock;

  Daemon() {
    char tmpl[] = "/tmp/wsync-rank-liveness-test.XXXXXX";
    dir = mkdtemp(tmpl);
    path = dir + "/wsyncd.sock";
    SourceOptions o;
    o.node_id = "src";
    o.trainer_ranks = 1;
    o.ring_bytes = 1 << 20;
    o.rank_grace = kGrace;
    node = std::make_unique<SourceNode>(
        o, &transport, [](const std::string&, const v1::ConnectTargetRequest&) -> absl::StatusOr<std::string> {
          return std::string("null");
        });
    auto c = node->Configure(testing::TinyPlan(WSYNC_TINY_MODEL, kPlan));
    INFO(c.status().ToString());
    REQUIRE(c.ok());
    ingest = std::make_unique<TrainerIngestService>(node.get());
    TrainerSocketOptions to;
    to.path = path;
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
  absl::Status Start(int64_t v) {
    v1::StartUpdateRequest r;
    r.set_version(v);
    r.set_plan_epoch(kPlan);
    return node->StartUpdate(r);
  }
  absl::StatusOr<v1::FinishUpdateReply> Finish(int64_t v, double timeout_s) {
    v1::FinishUpdateRequest r;
    r.set_version(v);
    r.set_timeout_seconds(timeout_s);
    r.set_plan_epoch(kPlan);
    return node->FinishUpdate(r);
  }
};

// A trainer rank in its own process (fork + exec right away: nothing of this process's gRPC state is used there).
struct Trainer {
  pid_t pid = -1;
  int out = -1;  // its stdout

  Trainer(const std::string& socket, int rank, int64_t version) {
    int p[2];
    REQUIRE(pipe2(p, O_CLOEXEC) == 0);
    const std::string r = std::to_string(rank), v = std::to_string(version);
    pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      dup2(p[1], 1);
      execl(WSYNC_TRAINER_CHILD, WSYNC_TRAINER_CHILD, socket.c_str(), r.c_str(), v.c_str(), nullptr);
      _exit(127);
    }
    close(p[1]);
    out = p[0];
  }
  ~Trainer() {
    Kill();
    close(out);
  }
  // Its next line: "session <label>" (the session is open), then "ready" (its push of the update begun); "" after
  // 20 s or its exit.
  std::string Line() {
    std::string line;
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    while (absl::Now() < deadline) {
      pollfd pfd{out, POLLIN, 0};
      if (poll(&pfd, 1, 100) <= 0) continue;
      char c;
      if (read(out, &c, 1) != 1) return "";
      if (c == '\n') return line;
      line.push_back(c);
    }
    return "";
  }
  void Kill() {
    if (pid <= 0) return;
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
};

TEST_CASE("rank liveness: a SIGKILLed trainer rank fails the open update within the rank grace, named", "[faults]") {
  Daemon d;
  REQUIRE(d.Start(1).ok());
  Trainer t(d.path, 0, 1);
  const std::string session = t.Line();
  REQUIRE(absl::StartsWith(session, "session "));
  REQUIRE(t.Line() == "ready");
  const absl::Time killed = absl::Now();
  t.Kill();
  auto r = d.Finish(1, 60);  // the commit's own timeout is far beyond the grace
  const double detected_s = absl::ToDoubleSeconds(absl::Now() - killed);
  std::printf("rank liveness: SIGKILLed trainer rank detected after %.2f s (rank grace %.1f s)\n", detected_s,
              absl::ToDoubleSeconds(kGrace));
  INFO(r.status().ToString());
  REQUIRE_FALSE(r.ok());
  CHECK(absl::IsUnavailable(r.status()));
  CHECK(absl::StrContains(r.status().message(), "trainer rank 0 on node src exited"));
  CHECK(absl::StrContains(r.status().message(), session.substr(8)));  // its session
  CHECK(detected_s >= absl::ToDoubleSeconds(kGrace) - 0.05);          // it had the grace to come back
  CHECK(detected_s < absl::ToDoubleSeconds(kGrace) + 2);
}

TEST_CASE("rank liveness: a second process taking over a live rank's session fails the open update at once, named",
          "[faults]") {
  Daemon d;
  REQUIRE(d.Start(1).ok());
  Trainer first(d.path, 0, 1);
  REQUIRE(absl::StartsWith(first.Line(), "session "));
  REQUIRE(first.Line() == "ready");
  const absl::Time taken = absl::Now();
  Trainer second(d.path, 0, 1);  // the same local rank, while the first process still holds it
  auto r = d.Finish(1, 60);
  const double detected_s = absl::ToDoubleSeconds(absl::Now() - taken);
  std::printf("rank liveness: session takeover detected after %.2f s (including the new process's start)\n",
              detected_s);
  INFO(r.status().ToString());
  REQUIRE_FALSE(r.ok());
  CHECK(absl::IsAborted(r.status()));
  CHECK(absl::StrContains(r.status().message(), "trainer rank 0 on node src was taken over"));
  CHECK(absl::StrContains(r.status().message(), absl::StrCat("pid ", first.pid, ")")));
  CHECK(absl::StrContains(r.status().message(), absl::StrCat("pid ", second.pid, ")")));
  CHECK(detected_s < absl::ToDoubleSeconds(kGrace) + 2);
  REQUIRE(absl::StartsWith(second.Line(), "session "));  // the new process holds the rank from now on

  // Outside an open update a new session of a live rank is a reconnect: update 2 is not failed by it (its commit
  // waits for the rank's push, up to its own timeout).
  Trainer third(d.path, 0, 2);
  REQUIRE(absl::StartsWith(third.Line(), "session "));
  REQUIRE(d.Start(2).ok());
  REQUIRE(third.Line() == "ready");
  auto r2 = d.Finish(2, 0.5);
  INFO(r2.status().ToString());
  CHECK(absl::IsDeadlineExceeded(r2.status()));
  CHECK(absl::StrContains(r2.status().message(), "did not finish pushing"));
}

}  // namespace
}  // namespace wsync::daemon
