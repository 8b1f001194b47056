#include "bench/transport/tcp_bench.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/status.h"
#include "nlohmann/json.hpp"
#include "transport/tcp/tcp_socket.h"
#include "transport/transport.h"

namespace wsync::bench {
namespace {

using transport::BatchId;
using transport::WriteRequest;

// An unused port on 127.0.0.1 (bound, read back, released; a small race we accept in a benchmark).
absl::StatusOr<int> FreeLoopbackPort() {
  int port = 0;
  absl::StatusOr<transport::tcp::Fd> fd = transport::tcp::Listen("127.0.0.1", 0, &port);
  if (!fd.ok()) return fd.status();
  return port;
}

bool OnPath(const std::string& tool) {
  return std::system(absl::StrCat("command -v ", tool, " >/dev/null 2>&1").c_str()) == 0;
}

std::string RunAndCapture(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

}  // namespace

absl::StatusOr<std::vector<SizePoint>> RunTcpTransportSweep(const TcpBenchOptions& opts) {
  transport::TransportOptions topts;
  topts.bind_host = "127.0.0.1";
  topts.tcp_streams = opts.streams;
  return RunTransportSweep("tcp", topts, opts);
}

absl::StatusOr<std::vector<SizePoint>> RunTransportSweep(const std::string& name,
                                                         const transport::TransportOptions& topts,
                                                         const TcpBenchOptions& opts) {
  WSYNC_ASSIGN_OR_RETURN(auto sender, transport::CreateTransport(name, topts));
  WSYNC_ASSIGN_OR_RETURN(auto receiver, transport::CreateTransport(name, topts));
  if (!sender->viable()) return absl::FailedPreconditionError(absl::StrCat(name, ": ", sender->reason()));

  uint64_t region_bytes = opts.batch_bytes;
  for (uint64_t s : opts.sizes) region_bytes = std::max(region_bytes, s);
  std::vector<char> src(region_bytes, 'w');
  std::vector<char> dst(region_bytes, 0);
  for (uint64_t i = 0; i < region_bytes; i += 4096) src[i] = static_cast<char>(i >> 12);  // touch every page
  WSYNC_ASSIGN_OR_RETURN(auto src_region, sender->RegisterMemory(src.data(), src.size()));
  WSYNC_ASSIGN_OR_RETURN(auto dst_region, receiver->RegisterMemory(dst.data(), dst.size()));
  WSYNC_ASSIGN_OR_RETURN(auto remote, sender->ImportRegion(dst_region->Descriptor()));
  // Open the receiver's write window as a target does for each update (a backend that does not enforce windows
  // answers Unimplemented; the fabric transport still learns that writes are expected).
  if (auto st = receiver->SetWriteWindow(true); !st.ok() && !absl::IsUnimplemented(st)) return st;
  WSYNC_ASSIGN_OR_RETURN(auto tx, sender->CreateEndpoint());
  WSYNC_ASSIGN_OR_RETURN(auto rx, receiver->CreateEndpoint());
  WSYNC_RETURN_IF_ERROR(tx->Connect(rx->LocalInfo(), absl::Seconds(5)));
  WSYNC_RETURN_IF_ERROR(rx->Connect(tx->LocalInfo(), absl::Seconds(5)));
  const absl::Duration kWait = absl::Seconds(30);

  std::vector<SizePoint> points;
  for (uint64_t size : opts.sizes) {
    const uint64_t per_batch = std::max<uint64_t>(1, opts.batch_bytes / size);
    const uint64_t slots = std::max<uint64_t>(1, region_bytes / size);
    std::vector<WriteRequest> writes(per_batch);
    for (uint64_t i = 0; i < per_batch; ++i) {
      const uint64_t off = (i % slots) * size;
      writes[i] = WriteRequest{src_region.get(), off, remote.get(), off, size};
    }
    const uint64_t batch_bytes = per_batch * size;
    WSYNC_RETURN_IF_ERROR_CTX(tx->Write(writes, kWait), "warm-up, message size ", size);

    SizePoint p;
    p.message_bytes = size;
    p.writes_per_batch = per_batch;
    std::deque<BatchId> in_flight;
    const absl::Time start = absl::Now();
    const absl::Time stop = start + opts.per_size;
    while (absl::Now() < stop || !in_flight.empty()) {
      if (absl::Now() < stop && static_cast<int>(in_flight.size()) < opts.in_flight) {
        WSYNC_ASSIGN_OR_RETURN(BatchId id, tx->Post(writes));
        in_flight.push_back(id);
        continue;
      }
      WSYNC_RETURN_IF_ERROR_CTX(tx->Wait(in_flight.front(), kWait), "message size ", size);
      in_flight.pop_front();
      p.bytes += batch_bytes;
    }
    p.seconds = absl::ToDoubleSeconds(absl::Now() - start);
    points.push_back(p);
  }
  return points;
}

absl::StatusOr<Baseline> RunIperf3Loopback(absl::Duration duration, int streams) {
  if (!OnPath("iperf3")) return absl::NotFoundError("iperf3 is not installed");
  const int seconds = std::max<int>(1, static_cast<int>(absl::ToInt64Seconds(duration)));
  std::string last_error;
  for (int attempt = 0; attempt < 3; ++attempt) {
    WSYNC_ASSIGN_OR_RETURN(int port, FreeLoopbackPort());
    const std::string port_str = std::to_string(port);
    pid_t server = ::fork();
    if (server < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
    if (server == 0) {
      std::freopen("/dev/null", "w", stdout);
      std::freopen("/dev/null", "w", stderr);
      ::execlp("iperf3", "iperf3", "-s", "-1", "-B", "127.0.0.1", "-p", port_str.c_str(), nullptr);
      ::_exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // let the server bind
    const std::string out = RunAndCapture(absl::StrCat("timeout ", seconds + 10, " iperf3 -c 127.0.0.1 -p ",
                                                       port, " -J -t ", seconds, " -P ", std::max(1, streams), " 2>&1"));
    // The one-shot server exits after its client; make sure it is gone either way.
    int status = 0;
    for (int i = 0; i < 20 && ::waitpid(server, &status, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      if (i == 19) {
        ::kill(server, SIGTERM);
        ::waitpid(server, &status, 0);
      }
    }
    nlohmann::json j = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      last_error = absl::StrCat("unparsable iperf3 output: ", out.substr(0, 200));
      continue;
    }
    if (j.contains("error")) {
      last_error = absl::StrCat("iperf3: ", j["error"].get<std::string>());
      continue;
    }
    const double bps = j["end"]["sum_received"]["bits_per_second"].get<double>();
    return Baseline{"iperf3", bps / 8 / 1e9, ""};
  }
  return absl::UnavailableError(last_error);
}

absl::StatusOr<Baseline> RunSocketLoopback(absl::Duration duration) {
  int port = 0;
  WSYNC_ASSIGN_OR_RETURN(transport::tcp::Fd listener, transport::tcp::Listen("127.0.0.1", 0, &port));
  WSYNC_ASSIGN_OR_RETURN(transport::tcp::Fd client,
                         transport::tcp::ConnectTo("127.0.0.1", port, absl::Seconds(5)));
  transport::tcp::Fd server(::accept(listener.get(), nullptr, nullptr));
  if (!server.valid()) return absl::InternalError(absl::StrCat("accept: ", std::strerror(errno)));
  transport::tcp::TuneSocket(client.get(), absl::Seconds(10));
  transport::tcp::TuneSocket(server.get(), absl::Seconds(10));

  constexpr size_t kChunk = 4 << 20;
  uint64_t received = 0;
  std::thread reader([&] {
    std::vector<char> buf(kChunk);
    for (;;) {
      ssize_t n = ::recv(server.get(), buf.data(), buf.size(), 0);
      if (n <= 0) return;
      received += static_cast<uint64_t>(n);
    }
  });
  std::vector<char> buf(kChunk, 'b');
  const absl::Time start = absl::Now();
  absl::Status s;
  while (s.ok() && absl::Now() - start < duration) {
    iovec iov{buf.data(), buf.size()};
    s = transport::tcp::SendAll(client.get(), &iov, 1);
  }
  ::shutdown(client.get(), SHUT_WR);
  reader.join();
  const double secs = absl::ToDoubleSeconds(absl::Now() - start);
  WSYNC_RETURN_IF_ERROR(s);
  return Baseline{"socket", received / secs / 1e9, ""};
}

}  // namespace wsync::bench
