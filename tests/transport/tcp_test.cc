// tcp-only behaviour: the factory, the handshake, the receiver's own checks, stalled peers, peers trickling their
// hello, and the rate-limited log of refusals.

#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "spdlog/spdlog.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/tcp/tcp_wire.h"
#include "transport/transport.h"

namespace {

using namespace wsync::transport;  // NOLINT: test brevity
using tcp::Fd;

const absl::Duration kTimeout = absl::Seconds(10);

std::unique_ptr<Transport> MakeTcp(absl::Duration io_timeout = absl::Seconds(5)) {
  TransportOptions opts;
  opts.io_timeout = io_timeout;
  auto t = CreateTransport("tcp", opts);
  REQUIRE(t.ok());
  return std::move(*t);
}

struct Info {
  std::string host;
  int port = 0;
  uint64_t token = 0;
};

Info ParseInfo(const std::string& s) {
  std::vector<std::string> p = absl::StrSplit(s, ' ');
  REQUIRE(p.size() == 4);
  Info i;
  i.host = p[1];
  REQUIRE(absl::SimpleAtoi(p[2], &i.port));
  i.token = std::stoull(p[3], nullptr, 16);
  return i;
}

std::string Descriptor(uint64_t token, uint64_t region, uint64_t length) {
  tcp::RegionDescriptor d{tcp::kDescMagic, tcp::kProtocolVersion, 0, token, region, length};
  return std::string(reinterpret_cast<const char*>(&d), sizeof(d));
}

void SendRaw(int fd, const void* p, size_t n) {
  iovec iov{const_cast<void*>(p), n};
  REQUIRE(tcp::SendAll(fd, &iov, 1).ok());
}

tcp::Ack RecvAck(int fd, std::string* msg) {
  tcp::Ack ack;
  REQUIRE(tcp::RecvAll(fd, &ack, sizeof(ack)).ok());
  msg->assign(ack.message_len, '\0');
  REQUIRE(tcp::RecvAll(fd, msg->data(), msg->size()).ok());
  return ack;
}

// A raw client that completed the hello with a real transport's listener.
Fd RawClient(const Info& info) {
  auto fd = tcp::ConnectTo(info.host, info.port, kTimeout);
  REQUIRE(fd.ok());
  tcp::TuneSocket(fd->get(), kTimeout);
  tcp::Hello hello{tcp::kFrameMagic, tcp::kHello, tcp::kProtocolVersion, info.token, 0, 0, {0, 0}};
  SendRaw(fd->get(), &hello, sizeof(hello));
  std::string msg;
  tcp::Ack ack = RecvAck(fd->get(), &msg);
  REQUIRE(ack.type == tcp::kHelloAck);
  REQUIRE(ack.code == 0);
  return std::move(*fd);
}

// This process's thread count (/proc/self/status).
int CountThreads() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (absl::StartsWith(line, "Threads:")) return std::stoi(line.substr(8));
  FAIL("no Threads: line in /proc/self/status");
  return -1;
}

// True once the peer closed `fd` (EOF or reset); never blocks.
bool ClosedByPeer(int fd) {
  char c;
  const ssize_t n = ::recv(fd, &c, 1, MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

// Routes spdlog's default logger into a ring buffer while alive (create it before the transports whose threads log,
// destroy it after them).
class CapturedLog {
 public:
  CapturedLog() : ring_(std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(4096)), old_(spdlog::default_logger()) {
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("captured", ring_));
  }
  ~CapturedLog() { spdlog::set_default_logger(old_); }
  // Warnings containing `text`.
  std::vector<std::string> Warnings(const std::string& text) const {
    std::vector<std::string> out;
    for (auto& l : ring_->last_formatted())
      if (absl::StrContains(l, "[warning]") && absl::StrContains(l, text)) out.push_back(l);
    return out;
  }

 private:
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> ring_;
  std::shared_ptr<spdlog::logger> old_;
};

uint64_t RegionId(const LocalRegion& r) {
  tcp::RegionDescriptor d;
  const std::string desc = r.Descriptor();
  REQUIRE(desc.size() == sizeof(d));
  std::memcpy(&d, desc.data(), sizeof(d));
  return d.region;
}

}  // namespace

TEST_CASE("factory: the first viable transport of an operator's list", "[transport][tcp]") {
  auto tcp = CreateFirstViableTransport("tcp", TransportOptions{});
  REQUIRE(tcp.ok());
  CHECK((*tcp)->name() == "tcp");

  // verbs first: used where viable, else the listed fallback; never a transport the list does not name.
  auto v = CreateTransport("verbs", TransportOptions{});
  REQUIRE(v.ok());
  auto listed = CreateFirstViableTransport(" verbs , tcp ", TransportOptions{});
  REQUIRE(listed.ok());
  CHECK((*listed)->name() == ((*v)->viable() ? "verbs" : "tcp"));
  if (!(*v)->viable()) {
    auto alone = CreateFirstViableTransport("verbs", TransportOptions{});
    CHECK(alone.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK(absl::StrContains(alone.status().message(), (*v)->reason()));
    CHECK(absl::StrContains(alone.status().message(), "verbs,tcp"));
  }

  CHECK(CreateFirstViableTransport("", TransportOptions{}).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(CreateFirstViableTransport("tcp,tcp", TransportOptions{}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  auto unknown = CreateFirstViableTransport("tcp,carrier-pigeon", TransportOptions{});
  CHECK(unknown.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(unknown.status().message(), "carrier-pigeon"));
}

TEST_CASE("factory: tcp, verbs and unknown names", "[transport][tcp]") {
  auto t = CreateTransport("tcp", TransportOptions{});
  REQUIRE(t.ok());
  CHECK((*t)->name() == "tcp");
  CHECK((*t)->viable());

  auto v = CreateTransport("verbs", TransportOptions{});
  REQUIRE(v.ok());
  CHECK((*v)->name() == "verbs");
  if (!(*v)->viable()) {
    CHECK_FALSE((*v)->reason().empty());
    CHECK_FALSE((*v)->CreateEndpoint().ok());
  }

  CHECK(CreateTransport("carrier-pigeon", TransportOptions{}).status().code() ==
        absl::StatusCode::kInvalidArgument);

  TransportOptions bad;
  bad.bind_host = "203.0.113.1";  // TEST-NET-3: not an address of this host
  CHECK_FALSE(CreateTransport("tcp", bad).ok());
}

TEST_CASE("connect: bad info, nobody listening, stale token", "[transport][tcp]") {
  auto a = MakeTcp();
  auto ep = a->CreateEndpoint();
  REQUIRE(ep.ok());
  CHECK((*ep)->Connect("not an endpoint", kTimeout).code() == absl::StatusCode::kInvalidArgument);
  CHECK((*ep)->Post({}).status().code() == absl::StatusCode::kFailedPrecondition);

  // A port nobody listens on: the transport that owned it is gone.
  std::string gone_info;
  {
    auto b = MakeTcp();
    auto e = b->CreateEndpoint();
    REQUIRE(e.ok());
    gone_info = (*e)->LocalInfo();
  }
  const Info gone = ParseInfo(gone_info);
  absl::Status s = (*ep)->Connect(gone_info, kTimeout);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(s.message(), absl::StrCat("127.0.0.1:", gone.port)));

  // The right address but another transport's token (e.g. the peer restarted on the same port).
  auto b = MakeTcp();
  auto eb = b->CreateEndpoint();
  REQUIRE(eb.ok());
  Info live = ParseInfo((*eb)->LocalInfo());
  const std::string stale = absl::StrCat("wsync-tcp/1 ", live.host, " ", live.port, " 00000000deadbeef");
  s = (*ep)->Connect(stale, kTimeout);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("receiver: a region deregistered after import fails the batch, endpoint then unusable",
          "[transport][tcp]") {
  auto sender = MakeTcp();
  auto receiver = MakeTcp();
  std::vector<uint8_t> src(1 << 20, 1), dst(1 << 20, 0);
  auto sr = sender->RegisterMemory(src.data(), src.size());
  auto dr = receiver->RegisterMemory(dst.data(), dst.size());
  REQUIRE(sr.ok());
  REQUIRE(dr.ok());
  auto remote = sender->ImportRegion((*dr)->Descriptor());
  REQUIRE(remote.ok());
  auto es = sender->CreateEndpoint();
  auto er = receiver->CreateEndpoint();
  REQUIRE(es.ok());
  REQUIRE(er.ok());
  REQUIRE((*es)->Connect((*er)->LocalInfo(), kTimeout).ok());
  dr->reset();

  WriteRequest w{sr->get(), 0, remote->get(), 0, 4096};
  absl::Status s = (*es)->Write({&w, 1}, kTimeout);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kNotFound);
  CHECK(absl::StrContains(s.message(), "not registered"));
  CHECK(absl::StrContains(s.message(), (*es)->PeerName()));
  CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0; }));
  CHECK_FALSE((*es)->Post({&w, 1}).ok());
}

TEST_CASE("receiver: a source's memory is read-only for peers, the write refused, counted, bytes unchanged",
          "[transport][tcp]") {
  auto writer = MakeTcp();
  auto source = MakeTcp();  // a source daemon's transport: its replica is registered with RegisterSourceMemory
  std::vector<uint8_t> src(1 << 20, 0xAB), replica(1 << 20), other(1 << 20, 0);
  for (size_t i = 0; i < replica.size(); ++i) replica[i] = static_cast<uint8_t>(i * 7 + 3);
  const std::vector<uint8_t> before = replica;
  auto sr = writer->RegisterMemory(src.data(), src.size());
  auto rr = source->RegisterSourceMemory(replica.data(), replica.size());
  auto orr = source->RegisterMemory(other.data(), other.size());  // an ordinary region of the same transport
  REQUIRE(sr.ok());
  REQUIRE(rr.ok());
  REQUIRE(orr.ok());
  auto remote = writer->ImportRegion((*rr)->Descriptor());
  auto remote_other = writer->ImportRegion((*orr)->Descriptor());
  REQUIRE(remote.ok());
  REQUIRE(remote_other.ok());
  const uint64_t refused_before = source->refused_writes();
  {
    auto es = writer->CreateEndpoint();
    auto er = source->CreateEndpoint();
    REQUIRE(es.ok());
    REQUIRE(er.ok());
    REQUIRE((*es)->Connect((*er)->LocalInfo(), kTimeout).ok());
    // The same connection writes an ordinary region: the listener accepts it (the refusal below is the region's).
    WriteRequest ok_w{sr->get(), 0, remote_other->get(), 0, 4096};
    REQUIRE((*es)->Write({&ok_w, 1}, kTimeout).ok());
    CHECK(other[0] == 0xAB);
    CHECK(other[4095] == 0xAB);
    CHECK(other[4096] == 0);

    WriteRequest w{sr->get(), 0, remote->get(), 4096, 65536};
    absl::Status s = (*es)->Write({&w, 1}, kTimeout);
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kPermissionDenied);
    CHECK(absl::StrContains(s.message(), "read-only"));
    CHECK(absl::StrContains(s.message(), absl::StrCat("region ", RegionId(**rr))));
  }
  CHECK(replica == before);
  CHECK(source->refused_writes() == refused_before + 1);

  // A raw peer holding the token and the descriptor, sending the frame itself, is refused the same way and the
  // error ack names the region and the writer's address.
  auto probe = source->CreateEndpoint();
  REQUIRE(probe.ok());
  Info info = ParseInfo((*probe)->LocalInfo());
  Fd fd = RawClient(info);
  std::vector<uint8_t> payload(4096, 0xEE);
  tcp::FrameHeader f{tcp::kFrameMagic, tcp::kWrite, 0, 1, RegionId(**rr), 0, payload.size()};
  SendRaw(fd.get(), &f, sizeof(f));
  SendRaw(fd.get(), payload.data(), payload.size());
  tcp::FrameHeader c{tcp::kFrameMagic, tcp::kCommit, 0, 1, 1, 0, payload.size()};
  SendRaw(fd.get(), &c, sizeof(c));
  std::string msg;
  tcp::Ack ack = RecvAck(fd.get(), &msg);
  INFO(msg);
  CHECK(ack.type == tcp::kBatchAck);
  CHECK(ack.code == static_cast<uint16_t>(absl::StatusCode::kPermissionDenied));
  CHECK(absl::StrContains(msg, absl::StrCat("region ", RegionId(**rr))));
  CHECK(absl::StrContains(msg, "127.0.0.1:"));
  CHECK(replica == before);
  CHECK(source->refused_writes() == refused_before + 2);
}

TEST_CASE("receiver: bounds check and malformed frames get an error ack", "[transport][tcp]") {
  auto receiver = MakeTcp();
  std::vector<uint8_t> dst(4096, 0);
  auto dr = receiver->RegisterMemory(dst.data(), dst.size());
  REQUIRE(dr.ok());
  auto ep = receiver->CreateEndpoint();
  REQUIRE(ep.ok());
  const Info info = ParseInfo((*ep)->LocalInfo());
  tcp::RegionDescriptor desc;
  std::memcpy(&desc, (*dr)->Descriptor().data(), sizeof(desc));
  std::string msg;

  SECTION("out of bounds") {
    Fd fd = RawClient(info);
    std::vector<char> payload(128, 'x');
    tcp::FrameHeader f{tcp::kFrameMagic, tcp::kWrite, 0, 1, desc.region, 4000, payload.size()};
    SendRaw(fd.get(), &f, sizeof(f));
    SendRaw(fd.get(), payload.data(), payload.size());
    tcp::FrameHeader c{tcp::kFrameMagic, tcp::kCommit, 0, 1, 1, 0, payload.size()};
    SendRaw(fd.get(), &c, sizeof(c));
    tcp::Ack ack = RecvAck(fd.get(), &msg);
    INFO(msg);
    CHECK(ack.type == tcp::kBatchAck);
    CHECK(ack.code == static_cast<uint16_t>(absl::StatusCode::kOutOfRange));
    CHECK(absl::StrContains(msg, "outside region"));
    CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0; }));
  }
  SECTION("bad magic") {
    Fd fd = RawClient(info);
    tcp::FrameHeader f{0x12345678, tcp::kWrite, 0, 1, desc.region, 0, 16};
    SendRaw(fd.get(), &f, sizeof(f));
    tcp::Ack ack = RecvAck(fd.get(), &msg);
    CHECK(ack.code == static_cast<uint16_t>(absl::StatusCode::kInvalidArgument));
    CHECK(absl::StrContains(msg, "magic"));
    char byte;
    CHECK(::recv(fd.get(), &byte, 1, 0) == 0);  // and the receiver closed the connection
  }
  SECTION("oversized frame") {
    Fd fd = RawClient(info);
    tcp::FrameHeader f{tcp::kFrameMagic, tcp::kWrite, 0, 1, desc.region, 0, uint64_t{1} << 40};
    SendRaw(fd.get(), &f, sizeof(f));
    tcp::Ack ack = RecvAck(fd.get(), &msg);
    CHECK(ack.code == static_cast<uint16_t>(absl::StatusCode::kInvalidArgument));
  }
  SECTION("a valid frame lands") {
    Fd fd = RawClient(info);
    std::vector<char> payload(100, 'y');
    tcp::FrameHeader f{tcp::kFrameMagic, tcp::kWrite, 0, 9, desc.region, 10, payload.size()};
    SendRaw(fd.get(), &f, sizeof(f));
    SendRaw(fd.get(), payload.data(), payload.size());
    tcp::FrameHeader c{tcp::kFrameMagic, tcp::kCommit, 0, 9, 1, 0, payload.size()};
    SendRaw(fd.get(), &c, sizeof(c));
    tcp::Ack ack = RecvAck(fd.get(), &msg);
    CHECK(ack.code == 0);
    CHECK(ack.batch == 9);
    CHECK(ack.bytes == 100);
    CHECK(dst[9] == 0);
    CHECK(dst[10] == 'y');
    CHECK(dst[109] == 'y');
    CHECK(dst[110] == 0);
  }
}

// The stall fails the batch with a terminal code: Unavailable naming the peer, never DeadlineExceeded, which Wait's
// contract (transport.h) reserves for a batch still outstanding (a caller would wait again for a batch that is gone).
TEST_CASE("a peer that stops reading: Wait times out, then the stall fails the batch", "[transport][tcp]") {
  // A fake peer: answers the hello, then never reads again.
  int port = 0;
  auto listen_fd = tcp::Listen("127.0.0.1", 0, &port);
  REQUIRE(listen_fd.ok());
  const uint64_t token = 0x1234;
  Fd accepted;
  std::thread peer([&] {
    Fd fd(::accept(listen_fd->get(), nullptr, nullptr));
    tcp::Hello hello;
    if (!tcp::RecvAll(fd.get(), &hello, sizeof(hello)).ok()) return;
    tcp::Ack ack{tcp::kFrameMagic, tcp::kHelloAck, 0, 0, 0, 0, 0};
    iovec iov{&ack, sizeof(ack)};
    tcp::SendAll(fd.get(), &iov, 1).IgnoreError();
    accepted = std::move(fd);  // kept open, never read
  });

  TransportOptions opts;
  opts.io_timeout = absl::Seconds(1);
  opts.tcp_streams = 1;
  auto sender = CreateTransport("tcp", opts);
  REQUIRE(sender.ok());
  constexpr uint64_t kLen = 64 << 20;  // far more than the socket buffers hold
  std::vector<uint8_t> src(kLen, 3);
  auto sr = (*sender)->RegisterMemory(src.data(), src.size());
  REQUIRE(sr.ok());
  auto remote = (*sender)->ImportRegion(Descriptor(token, 1, kLen));
  REQUIRE(remote.ok());
  auto ep = (*sender)->CreateEndpoint();
  REQUIRE(ep.ok());
  REQUIRE((*ep)->Connect(absl::StrCat("wsync-tcp/1 127.0.0.1 ", port, " ", absl::Hex(token)), kTimeout).ok());
  peer.join();

  WriteRequest w{sr->get(), 0, remote->get(), 0, kLen};
  auto id = (*ep)->Post({&w, 1});
  REQUIRE(id.ok());
  CHECK((*ep)->Wait(*id, absl::Milliseconds(200)).code() == absl::StatusCode::kDeadlineExceeded);
  const absl::Time start = absl::Now();
  absl::Status s = (*ep)->Wait(*id, kTimeout);
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(s.message(), "i/o timeout"));
  CHECK(absl::StrContains(s.message(), absl::StrCat("127.0.0.1:", port)));
  CHECK(absl::Now() - start < absl::Seconds(5));
  CHECK((*ep)->Wait(*id, absl::ZeroDuration()).code() == absl::StatusCode::kNotFound);  // answered: not outstanding
}

TEST_CASE("a large batch is spread over several connections and arrives intact", "[transport][tcp]") {
  for (int streams : {1, 3, 8}) {
    TransportOptions opts;
    opts.tcp_streams = streams;
    auto sender = CreateTransport("tcp", opts);
    auto receiver = CreateTransport("tcp", opts);
    REQUIRE(sender.ok());
    REQUIRE(receiver.ok());
    constexpr uint64_t kLen = (24 << 20) + 5;
    std::vector<uint8_t> src(kLen), dst(kLen, 0);
    for (uint64_t i = 0; i < kLen; ++i) src[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
    auto sr = (*sender)->RegisterMemory(src.data(), kLen);
    auto dr = (*receiver)->RegisterMemory(dst.data(), kLen);
    REQUIRE(sr.ok());
    REQUIRE(dr.ok());
    auto remote = (*sender)->ImportRegion((*dr)->Descriptor());
    REQUIRE(remote.ok());
    auto es = (*sender)->CreateEndpoint();
    auto er = (*receiver)->CreateEndpoint();
    REQUIRE((*es)->Connect((*er)->LocalInfo(), kTimeout).ok());
    REQUIRE((*er)->Connect((*es)->LocalInfo(), kTimeout).ok());
    // Three writes of uneven sizes: the split cuts through them.
    WriteRequest w[3] = {{sr->get(), 0, remote->get(), 0, 1000},
                         {sr->get(), 1000, remote->get(), 1000, kLen - 2000},
                         {sr->get(), kLen - 1000, remote->get(), kLen - 1000, 1000}};
    absl::Status s = (*es)->Write(w, kTimeout);
    INFO(streams << " streams: " << s.ToString());
    REQUIRE(s.ok());
    CHECK(std::memcmp(src.data(), dst.data(), kLen) == 0);
  }
}

TEST_CASE("Cancel releases a batch blocked on a peer that stopped reading, at once, with the caller's reason",
          "[transport][tcp]") {
  int port = 0;
  auto listen_fd = tcp::Listen("127.0.0.1", 0, &port);
  REQUIRE(listen_fd.ok());
  const uint64_t token = 0x4321;
  Fd accepted;
  std::thread peer([&] {
    Fd fd(::accept(listen_fd->get(), nullptr, nullptr));
    tcp::Hello hello;
    if (!tcp::RecvAll(fd.get(), &hello, sizeof(hello)).ok()) return;
    tcp::Ack ack{tcp::kFrameMagic, tcp::kHelloAck, 0, 0, 0, 0, 0};
    iovec iov{&ack, sizeof(ack)};
    tcp::SendAll(fd.get(), &iov, 1).IgnoreError();
    accepted = std::move(fd);  // kept open, never read
  });

  TransportOptions opts;
  opts.io_timeout = absl::Seconds(60);  // without Cancel the batch would hang this long
  opts.tcp_streams = 1;
  auto sender = CreateTransport("tcp", opts);
  REQUIRE(sender.ok());
  constexpr uint64_t kLen = 64 << 20;
  std::vector<uint8_t> src(kLen, 5);
  auto sr = (*sender)->RegisterMemory(src.data(), src.size());
  REQUIRE(sr.ok());
  auto remote = (*sender)->ImportRegion(Descriptor(token, 1, kLen));
  REQUIRE(remote.ok());
  auto ep = (*sender)->CreateEndpoint();
  REQUIRE(ep.ok());
  REQUIRE((*ep)->Connect(absl::StrCat("wsync-tcp/1 127.0.0.1 ", port, " ", absl::Hex(token)), kTimeout).ok());
  peer.join();

  WriteRequest w{sr->get(), 0, remote->get(), 0, kLen};
  auto id = (*ep)->Post({&w, 1});
  REQUIRE(id.ok());
  CHECK((*ep)->Wait(*id, absl::Milliseconds(300)).code() == absl::StatusCode::kDeadlineExceeded);
  auto id2 = (*ep)->Post({&w, 1});  // queued behind the blocked one
  REQUIRE(id2.ok());
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    (*ep)->Cancel(absl::AbortedError("update 7 aborted: node n1 lost its lease"));
  });
  const absl::Time start = absl::Now();
  absl::Status s = (*ep)->Wait(*id, kTimeout);
  const absl::Duration took = absl::Now() - start;
  canceller.join();
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kAborted);
  CHECK(absl::StrContains(s.message(), "node n1 lost its lease"));
  CHECK(took < absl::Seconds(2));
  absl::Status s2 = (*ep)->Wait(*id2, kTimeout);
  CHECK(absl::StrContains(s2.message(), "node n1 lost its lease"));
  auto again = (*ep)->Post({&w, 1});
  CHECK(!again.ok());
  CHECK(absl::StrContains(again.status().message(), "node n1 lost its lease"));
  // Destroying the cancelled endpoint does not hang on the blocked connection.
  const absl::Time d0 = absl::Now();
  ep->reset();
  CHECK(absl::Now() - d0 < absl::Seconds(2));
}

TEST_CASE(
    "listener: hellos trickled a byte at a time hold no thread and are closed at one total deadline, while a "
    "good peer connects",
    "[transport][tcp]") {
  constexpr int kTrickling = 48;  // under the per-peer cap (64): every one is accepted and must wait for its hello
  const absl::Duration kHelloTimeout = absl::Seconds(1);
  TransportOptions opts;
  opts.hello_timeout = kHelloTimeout;
  auto receiver = CreateTransport("tcp", opts);
  auto sender = CreateTransport("tcp", TransportOptions{});
  REQUIRE(receiver.ok());
  REQUIRE(sender.ok());
  std::vector<uint8_t> src(1 << 20), dst(1 << 20, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  auto sr = (*sender)->RegisterMemory(src.data(), src.size());
  auto dr = (*receiver)->RegisterMemory(dst.data(), dst.size());
  REQUIRE(sr.ok());
  REQUIRE(dr.ok());
  auto remote = (*sender)->ImportRegion((*dr)->Descriptor());
  REQUIRE(remote.ok());
  auto er = (*receiver)->CreateEndpoint();
  REQUIRE(er.ok());
  const Info info = ParseInfo((*er)->LocalInfo());
  const uint64_t refused0 = (*receiver)->refused_writes();

  const int threads0 = CountThreads();
  std::vector<Fd> socks;
  std::vector<absl::Time> opened, closed;
  for (int i = 0; i < kTrickling; ++i) {
    auto fd = tcp::ConnectTo(info.host, info.port, kTimeout);
    REQUIRE(fd.ok());
    socks.push_back(std::move(*fd));
    opened.push_back(absl::Now());
    closed.push_back(absl::InfiniteFuture());
  }
  // A valid hello (the right token), one byte per connection every 100 ms: complete after 4 s, had the listener
  // waited that long. 20 ms polls time each close.
  const tcp::Hello hello{tcp::kFrameMagic, tcp::kHello, tcp::kProtocolVersion, info.token, 0, 0, {0, 0}};
  const char* hello_bytes = reinterpret_cast<const char*>(&hello);
  int max_threads = 0, open = kTrickling;
  bool good_peer_done = false;
  for (int step = 0; open > 0 && absl::Now() - opened[0] < absl::Seconds(6); ++step) {
    const size_t byte = static_cast<size_t>(step / 5);
    for (int i = 0; i < kTrickling; ++i) {
      if (closed[i] != absl::InfiniteFuture()) continue;
      if (ClosedByPeer(socks[i].get())) {
        closed[i] = absl::Now();
        --open;
      } else if (step % 5 == 0 && byte < sizeof(hello)) {
        ::send(socks[i].get(), hello_bytes + byte, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      }
    }
    if (!good_peer_done) max_threads = std::max(max_threads, CountThreads());
    if (step == 25) {
      // Half-way to the deadline: a good peer connects and writes, and its bytes land.
      auto es = (*sender)->CreateEndpoint();
      REQUIRE(es.ok());
      REQUIRE((*es)->Connect((*er)->LocalInfo(), kTimeout).ok());
      WriteRequest w{sr->get(), 0, remote->get(), 0, src.size()};
      REQUIRE((*es)->Write({&w, 1}, kTimeout).ok());
      CHECK(dst == src);
      CHECK(absl::Now() - opened[0] < kHelloTimeout);  // it did not have to wait for the deadline
      good_peer_done = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(good_peer_done);
  absl::Duration first = absl::InfiniteDuration(), last = absl::ZeroDuration();
  for (int i = 0; i < kTrickling; ++i) {
    first = std::min(first, closed[i] - opened[i]);
    last = std::max(last, closed[i] - opened[i]);
  }
  std::printf(
      "tcp: %d connections trickling their hello: process threads %d -> at most %d; %d closed, after %.2f .. "
      "%.2f s (hello deadline %.1f s)\n",
      kTrickling, threads0, max_threads, kTrickling - open, absl::ToDoubleSeconds(first), absl::ToDoubleSeconds(last),
      absl::ToDoubleSeconds(kHelloTimeout));
  CHECK(max_threads <= threads0);  // no thread per pending connection, however many bytes it sent
  CHECK(open == 0);
  CHECK(first >= kHelloTimeout - absl::Milliseconds(50));
  CHECK(last <= kHelloTimeout + absl::Milliseconds(800));         // poll steps of 20 ms, slow sanitizer builds
  CHECK((*receiver)->refused_writes() == refused0 + kTrickling);  // each deadline counted
}

TEST_CASE("listener: refused writes and bad hellos from one peer are counted one by one, logged once a minute",
          "[transport][tcp]") {
  constexpr int kRefused = 25;
  CapturedLog log;
  {
    auto source = MakeTcp();
    std::vector<uint8_t> replica(1 << 16, 0x5A);
    const std::vector<uint8_t> before = replica;
    auto rr = source->RegisterSourceMemory(replica.data(), replica.size());
    REQUIRE(rr.ok());
    auto probe = source->CreateEndpoint();
    REQUIRE(probe.ok());
    const Info info = ParseInfo((*probe)->LocalInfo());
    const uint64_t refused0 = source->refused_writes();
    std::vector<uint8_t> payload(4096, 0xEE);
    for (int i = 0; i < kRefused; ++i) {
      // A write into the source's read-only replica: refused, the batch fails, the connection closes.
      Fd fd = RawClient(info);
      tcp::FrameHeader f{tcp::kFrameMagic, tcp::kWrite, 0, 1, RegionId(**rr), 0, payload.size()};
      SendRaw(fd.get(), &f, sizeof(f));
      SendRaw(fd.get(), payload.data(), payload.size());
      tcp::FrameHeader c{tcp::kFrameMagic, tcp::kCommit, 0, 1, 1, 0, payload.size()};
      SendRaw(fd.get(), &c, sizeof(c));
      std::string msg;
      CHECK(RecvAck(fd.get(), &msg).code == static_cast<uint16_t>(absl::StatusCode::kPermissionDenied));
      // A hello with a made-up token: refused at the hello.
      auto bad = tcp::ConnectTo(info.host, info.port, kTimeout);
      REQUIRE(bad.ok());
      const tcp::Hello hello{tcp::kFrameMagic, tcp::kHello, tcp::kProtocolVersion, info.token ^ 1, 0, 0, {0, 0}};
      SendRaw(bad->get(), &hello, sizeof(hello));
      CHECK(RecvAck(bad->get(), &msg).code == static_cast<uint16_t>(absl::StatusCode::kFailedPrecondition));
    }
    // Every refusal is counted (the last connection thread may still be ending: wait for the count, not a line).
    const absl::Time until = absl::Now() + kTimeout;
    while (source->refused_writes() < refused0 + 2 * kRefused && absl::Now() < until)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    CHECK(source->refused_writes() == refused0 + 2 * kRefused);
    CHECK(replica == before);
  }
  // Transports gone, every thread that logs joined: the log holds one line about this peer, not 2 x 25.
  const std::vector<std::string> lines = log.Warnings(" from 127.0.0.1:");
  INFO(absl::StrJoin(lines, "\n"));
  std::printf("tcp: %d refused writes + %d refused hellos from one peer: %zu log line(s)\n", kRefused, kRefused,
              lines.size());
  CHECK(lines.size() >= 1);
  CHECK(lines.size() <= 2);
}
