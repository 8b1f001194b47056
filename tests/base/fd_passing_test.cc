// SendFds/ReceiveFds: several descriptors on one frame, none, the 200 limit, framing of back-to-back frames on a
// stream socket, large messages, and the single-fd functions built on top.

#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "base/fd_passing.h"

namespace wsync {
namespace {

std::pair<ScopedFd, ScopedFd> Pair(int type = SOCK_STREAM) {
  int sv[2];
  REQUIRE(socketpair(AF_UNIX, type | SOCK_CLOEXEC, 0, sv) == 0);
  return {ScopedFd(sv[0]), ScopedFd(sv[1])};
}

// A memfd holding `text`.
ScopedFd MemfdWith(const std::string& text) {
  ScopedFd fd(memfd_create("fd-passing-test", MFD_CLOEXEC));
  REQUIRE(fd.valid());
  REQUIRE(write(fd.get(), text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  return fd;
}

std::string ReadAll(int fd) {
  char buf[64] = {0};
  ssize_t n = pread(fd, buf, sizeof(buf), 0);
  REQUIRE(n >= 0);
  return std::string(buf, static_cast<size_t>(n));
}

TEST_CASE("fd passing: several descriptors on one frame arrive in order") {
  auto [a, b] = Pair();
  std::vector<ScopedFd> owned;
  std::vector<int> fds;
  for (int i = 0; i < 3; ++i) {
    owned.push_back(MemfdWith("segment " + std::to_string(i)));
    fds.push_back(owned.back().get());
  }
  REQUIRE(SendFds(a.get(), fds, R"({"type":"attach"})").ok());
  auto got = ReceiveFds(b.get());
  REQUIRE(got.ok());
  CHECK(got->message == R"({"type":"attach"})");
  REQUIRE(got->fds.size() == 3);
  for (int i = 0; i < 3; ++i) CHECK(ReadAll(got->fds[i].get()) == "segment " + std::to_string(i));
}

TEST_CASE("fd passing: frames without descriptors, back to back on a stream socket") {
  auto [a, b] = Pair();
  REQUIRE(SendFds(a.get(), {}, "one").ok());
  REQUIRE(SendFds(a.get(), {}, "").ok());
  ScopedFd m = MemfdWith("x");
  const int fd[1] = {m.get()};
  REQUIRE(SendFds(a.get(), fd, "three").ok());
  auto f1 = ReceiveFds(b.get());
  auto f2 = ReceiveFds(b.get());
  auto f3 = ReceiveFds(b.get());
  REQUIRE((f1.ok() && f2.ok() && f3.ok()));
  CHECK((f1->message == "one" && f1->fds.empty()));
  CHECK((f2->message.empty() && f2->fds.empty()));
  CHECK((f3->message == "three" && f3->fds.size() == 1));
  // ReceiveFd insists on a descriptor.
  REQUIRE(SendFds(a.get(), {}, "no fd").ok());
  CHECK(absl::IsDataLoss(ReceiveFd(b.get()).status()));
}

TEST_CASE("fd passing: 200 descriptors per frame, more is refused by the sender") {
  auto [a, b] = Pair();
  ScopedFd m = MemfdWith("shared");
  std::vector<int> fds(kMaxFdsPerFrame, m.get());
  REQUIRE(SendFds(a.get(), fds, "many").ok());
  auto got = ReceiveFds(b.get());
  REQUIRE(got.ok());
  CHECK(got->fds.size() == kMaxFdsPerFrame);
  CHECK(ReadAll(got->fds.back().get()) == "shared");
  fds.push_back(m.get());
  CHECK(absl::IsInvalidArgument(SendFds(a.get(), fds, "too many")));
}

TEST_CASE("fd passing: large messages within the receiver's limit; over it is DataLoss") {
  auto [a, b] = Pair();
  const std::string big(3 << 20, 'j');
  ScopedFd m = MemfdWith("x");
  const int fd[1] = {m.get()};
  std::thread sender([&, fd0 = a.get()] {
    CHECK(SendFds(fd0, fd, big).ok());
    (void)SendFds(fd0, fd, big);  // refused by the receiver below; fails once it closes its end
  });
  auto got = ReceiveFds(b.get(), 4 << 20);
  REQUIRE(got.ok());
  CHECK(got->message == big);
  CHECK(got->fds.size() == 1);
  auto refused = ReceiveFds(b.get(), 1 << 20);
  CHECK(absl::IsDataLoss(refused.status()));
  b.reset();  // the rest of the refused frame is never read: closing our end ends the sender's send
  sender.join();
}

TEST_CASE("fd passing: a closed peer is Unavailable; SEQPACKET keeps working") {
  {
    auto [a, b] = Pair();
    a.reset();
    CHECK(absl::IsUnavailable(ReceiveFds(b.get()).status()));
  }
  auto [a, b] = Pair(SOCK_SEQPACKET);
  ScopedFd m1 = MemfdWith("p1"), m2 = MemfdWith("p2");
  const int fds[2] = {m1.get(), m2.get()};
  REQUIRE(SendFds(a.get(), fds, "packet").ok());
  auto got = ReceiveFds(b.get());
  REQUIRE(got.ok());
  CHECK(got->message == "packet");
  REQUIRE(got->fds.size() == 2);
  CHECK(ReadAll(got->fds[1].get()) == "p2");
  REQUIRE(SendFd(a.get(), m1.get(), "single").ok());
  auto one = ReceiveFd(b.get());
  REQUIRE(one.ok());
  CHECK(one->message == "single");
  CHECK(ReadAll(one->fd.get()) == "p1");
}

}  // namespace
}  // namespace wsync
