#pragma once
// A test executable run again as a peer in a process of its own (a Catch2 hidden case such as "[.peer]"), talking
// over its stdin and stdout: the transport tests that need a peer they can kill or stop whole (SIGKILL, SIGSTOP: its
// transport's threads included) — fabric_test's dead peer, the conformance suite's stopped peer. The peer prints
// "PEER <what> <value>" lines (Next reads them, skipping its log lines) and reads lines the case Sends. Killed on
// destruction. Descriptors travel as hex (ToHex/FromHex).

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <string>

#include "absl/strings/match.h"

namespace wsync::transport::testing {

inline std::string ToHex(const std::string& bytes) {
  static const char* kDigits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out.push_back(kDigits[c >> 4]);
    out.push_back(kDigits[c & 15]);
  }
  return out;
}

inline std::string FromHex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

class PeerProcess {
 public:
  // Runs this executable as `name` with the Catch2 test spec `tag` (the peer's hidden case).
  PeerProcess(const char* name, const char* tag) {
    int to_child[2], from_child[2];
    REQUIRE(pipe(to_child) == 0);
    REQUIRE(pipe(from_child) == 0);
    pid_ = fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      dup2(to_child[0], 0);
      dup2(from_child[1], 1);
      for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1]}) close(fd);
      execl("/proc/self/exe", name, tag, static_cast<char*>(nullptr));
      _exit(127);
    }
    close(to_child[0]);
    close(from_child[1]);
    in_ = fdopen(to_child[1], "w");
    out_ = fdopen(from_child[0], "r");
    REQUIRE(in_ != nullptr);
    REQUIRE(out_ != nullptr);
  }
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess() {
    Kill();
    if (in_ != nullptr) fclose(in_);
    if (out_ != nullptr) fclose(out_);
  }
  // The next line the peer printed for us ("PEER <what> <value>"), skipping its log lines; empty at its end.
  std::string Next(const std::string& what) {
    char buf[16384];
    const std::string prefix = "PEER " + what + " ";
    while (fgets(buf, sizeof(buf), out_) != nullptr) {
      std::string line(buf);
      while (!line.empty() && line.back() == '\n') line.pop_back();
      if (absl::StartsWith(line, prefix)) return line.substr(prefix.size());
    }
    return "";
  }
  void Send(const std::string& line) {
    fprintf(in_, "%s\n", line.c_str());
    fflush(in_);
  }
  // Returns once the whole process is stopped (its transport's threads included).
  void Stop() {
    REQUIRE(kill(pid_, SIGSTOP) == 0);
    int status = 0;
    REQUIRE(waitpid(pid_, &status, WUNTRACED) == pid_);
    REQUIRE(WIFSTOPPED(status));
  }
  void Resume() { kill(pid_, SIGCONT); }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status = 0;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  FILE* in_ = nullptr;
  FILE* out_ = nullptr;
};

}  // namespace wsync::transport::testing
