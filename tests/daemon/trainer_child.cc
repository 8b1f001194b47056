// A trainer rank for tests that kill one: opens a session on a source daemon's trainer socket with the real C++
// client and says "session <label>" on stdout, begins its push of update VERSION (waiting until the update opens) and
// says "ready", then blocks until it is killed, its push never ended.
//
//   daemon_trainer_child SOCKET LOCAL_RANK VERSION

#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "client/trainer_client.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s SOCKET LOCAL_RANK VERSION\n", argv[0]);
    return 2;
  }
  wsync::client::TrainerOptions o;
  o.daemon = argv[1];
  o.local_rank = std::atoi(argv[2]);
  o.connect_timeout = absl::Seconds(10);
  o.timeout = absl::Seconds(30);
  auto c = wsync::client::TrainerClient::Connect(o);
  if (!c.ok()) {
    std::fprintf(stderr, "connect: %s\n", c.status().ToString().c_str());
    return 1;
  }
  std::printf("session %s\n", (*c)->session_label().c_str());
  std::fflush(stdout);
  auto names = (*c)->BeginPush(std::atoll(argv[3]));
  if (!names.ok()) {
    std::fprintf(stderr, "begin push: %s\n", names.status().ToString().c_str());
    return 1;
  }
  std::printf("ready\n");
  std::fflush(stdout);
  for (;;) pause();
}
