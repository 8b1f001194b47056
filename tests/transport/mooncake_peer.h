#pragma once
// One real Mooncake Transfer Engine peer (tests/engines/mooncake_peer.py: an SGLang-shaped TP rank whose memory the
// engine registered) as a child process, and the HTTP calls that read what it publishes and what its memory holds.
// Used by mooncake_test.cc and by the conformance suite's receiver for the mooncake backend (mooncake_factory.cc).
// The peer is found through WSYNC_MOONCAKE_PYTHON / WSYNC_MOONCAKE_PEER (tests/engines/run_mooncake_test.sh).

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "transport/tcp/tcp_socket.h"

namespace wsync::transport::testing {

// GET/POST on the peer's bootstrap server (plain HTTP/1.0: the peer answers and closes).
inline std::pair<int, std::string> Http(const std::string& host, int port, const std::string& method,
                                        const std::string& path) {
  auto fd = tcp::ConnectTo(host, port, absl::Seconds(10));
  REQUIRE(fd.ok());
  tcp::TuneSocket(fd->get(), absl::Seconds(30));
  std::string req = absl::StrCat(method, " ", path, " HTTP/1.0\r\nHost: ", host, "\r\nContent-Length: 0\r\n\r\n");
  iovec iov{req.data(), req.size()};
  REQUIRE(tcp::SendAll(fd->get(), &iov, 1).ok());
  std::string resp;
  char buf[65536];
  for (;;) {
    ssize_t n = ::recv(fd->get(), buf, sizeof(buf), 0);
    REQUIRE(n >= 0);
    if (n == 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  const size_t eoh = resp.find("\r\n\r\n");
  REQUIRE(eoh != std::string::npos);
  int code = 0;
  REQUIRE(absl::SimpleAtoi(resp.substr(9, 3), &code));
  return {code, resp.substr(eoh + 4)};
}

struct Param {
  std::string name;
  uint64_t ptr = 0;
  uint64_t bytes = 0;
};

// One real Mooncake peer process (tests/engines/mooncake_peer.py), killed on destruction.
class Peer {
 public:
  // `extra`: more arguments for the peer (rdma: --protocol rdma --device rxe0 --local-ip ...).
  explicit Peer(const nlohmann::json& layout, const std::vector<std::string>& extra = {}) {
    const char* py = std::getenv("WSYNC_MOONCAKE_PYTHON");
    const char* script = std::getenv("WSYNC_MOONCAKE_PEER");
    INFO(
        "run this test through tests/engines/run_mooncake_test.sh (it installs the real Mooncake engine and "
        "sets WSYNC_MOONCAKE_PYTHON and WSYNC_MOONCAKE_PEER)");
    REQUIRE(py != nullptr);
    REQUIRE(script != nullptr);
    layout_path_ = absl::StrCat(TmpDir(), "/wsync-mooncake-layout-", ::getpid(), "-", ++counter_, ".json");
    std::ofstream(layout_path_) << layout.dump();
    int out[2];
    REQUIRE(::pipe(out) == 0);
    pid_ = ::fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // a test killed on the spot (timeout, SIGPIPE) takes its peer along
      ::dup2(out[1], 1);
      ::close(out[0]);
      ::close(out[1]);
      std::vector<std::string> args = {py, script, "--rank", "0", "--layout", layout_path_};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(py, argv.data());
      ::_exit(127);
    }
    ::close(out[1]);
    try {
      Init(out[0]);
    } catch (...) {  // a failed REQUIRE in a constructor skips the destructor
      Kill();
      ::unlink(layout_path_.c_str());
      throw;
    }
  }

  ~Peer() {
    Kill();
    ::unlink(layout_path_.c_str());
  }

  // The whole process (the engine's threads included) stopped, and resumed.
  void Stop() {
    REQUIRE(pid_ > 0);
    REQUIRE(::kill(pid_, SIGSTOP) == 0);
    int status = 0;
    REQUIRE(::waitpid(pid_, &status, WUNTRACED) == pid_);
    REQUIRE(WIFSTOPPED(status));
  }
  void Resume() {
    if (pid_ > 0) ::kill(pid_, SIGCONT);
  }

  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  // Reads the peer's ready line from `out` (and closes it), then what a writer learns from the bootstrap.
  void Init(int out) {
    std::string line;
    pollfd p{out, POLLIN, 0};
    const absl::Time deadline = absl::Now() + absl::Seconds(120);  // first start imports the engine: slow on CI
    while (line.find('\n') == std::string::npos && absl::Now() < deadline) {
      if (::poll(&p, 1, 1000) <= 0) continue;
      char c[4096];
      ssize_t n = ::read(out, c, sizeof(c));
      if (n <= 0) break;
      line.append(c, static_cast<size_t>(n));
    }
    ::close(out);
    INFO("peer's first line: " << line);
    REQUIRE(line.find('\n') != std::string::npos);
    nlohmann::json ready = nlohmann::json::parse(line.substr(0, line.find('\n')));
    REQUIRE(ready.value("ready", false));
    const std::string bootstrap = ready["bootstrap"];
    host_ = bootstrap.substr(0, bootstrap.rfind(':'));
    REQUIRE(absl::SimpleAtoi(bootstrap.substr(bootstrap.rfind(':') + 1), &port_));
    for (const nlohmann::json& r : ready["regions"]) {
      uint64_t base = 0;
      REQUIRE(absl::SimpleHexAtoi(r[0].get<std::string>().substr(2), &base));
      regions_.emplace_back(base, r[1].get<uint64_t>());
    }

    // What a writer learns from the bootstrap, as SGLang publishes it.
    auto [code, body] = Http(host_, port_, "GET", "/get_transfer_engine_info?rank=0");
    REQUIRE(code == 200);
    nlohmann::json info = nlohmann::json::parse(body)["remote_instance_transfer_engine_info"];
    session_id_ = info[0];
    for (auto& [name, v] : info[1].items()) {
      params_[name] = Param{name, v[0].get<uint64_t>(), v[1].get<uint64_t>() * v[2].get<uint64_t>()};
    }
  }

 public:
  std::map<std::string, std::string> Checksums(const std::string& which = "checksums") {
    auto [code, body] = Http(host_, port_, "GET", absl::StrCat("/wsync_test/", which));
    REQUIRE(code == 200);
    return nlohmann::json::parse(body)["checksums"].get<std::map<std::string, std::string>>();
  }

  // `length` more bytes of the peer's memory, every one `fill`, registered with its engine: their address.
  uint64_t AddRegion(uint64_t length, uint8_t fill) {
    auto [code, body] = Http(host_, port_, "POST",
                             absl::StrCat("/wsync_test/region?length=", length, "&fill=", static_cast<int>(fill)));
    INFO(body);
    REQUIRE(code == 200);
    return nlohmann::json::parse(body)["addr"].get<uint64_t>();
  }
  // The peer's bytes [addr, addr + length) as they are now (inside one of its regions): copied by the kernel out of
  // its address space (process_vm_readv: at memory speed, nothing asked of the peer, so a snapshot is taken in
  // milliseconds), else (not permitted here) read through its HTTP endpoint.
  std::string Read(uint64_t addr, uint64_t length) {
    std::string out(length, '\0');
    iovec local{out.data(), length};
    iovec remote{reinterpret_cast<void*>(addr), length};
    if (pid_ > 0 && ::process_vm_readv(pid_, &local, 1, &remote, 1, 0) == static_cast<ssize_t>(length)) return out;
    auto [code, body] = Http(host_, port_, "GET", absl::StrCat("/wsync_test/bytes?addr=", addr, "&length=", length));
    REQUIRE(code == 200);
    REQUIRE(body.size() == length);
    return std::move(body);
  }
  void Fill(uint64_t addr, uint64_t length, uint8_t byte) {
    auto [code, body] =
        Http(host_, port_, "POST",
             absl::StrCat("/wsync_test/fill?addr=", addr, "&length=", length, "&byte=", static_cast<int>(byte)));
    INFO(body);
    REQUIRE(code == 200);
  }

  const std::string& session_id() const { return session_id_; }
  const Param& param(const std::string& name) const {
    INFO(name);
    REQUIRE(params_.count(name) == 1);
    return params_.at(name);
  }
  // (base, length) of each registered buffer, as the peer printed them.
  const std::vector<std::pair<uint64_t, uint64_t>>& regions() const { return regions_; }

 private:
  static const char* TmpDir() {
    const char* t = std::getenv("TMPDIR");
    return t != nullptr ? t : "/tmp";
  }
  static inline int counter_ = 0;
  std::string layout_path_;
  pid_t pid_ = -1;
  std::string host_;
  int port_ = 0;
  std::string session_id_;
  std::map<std::string, Param> params_;
  std::vector<std::pair<uint64_t, uint64_t>> regions_;
};

inline nlohmann::json Layout(std::vector<std::vector<std::tuple<std::string, uint64_t, int>>> regions) {
  nlohmann::json out = {{"regions", nlohmann::json::array()}};
  for (const auto& r : regions) {
    nlohmann::json list = nlohmann::json::array();
    for (const auto& [name, numel, esz] : r) list.push_back({{"name", name}, {"numel", numel}, {"element_size", esz}});
    out["regions"].push_back(list);
  }
  return out;
}

}  // namespace wsync::transport::testing
