#pragma once
// Test harness: a real local cluster of separate processes on 127.0.0.1 (coordinator, reference engines, target
// and source daemons), started from the built binaries with ephemeral ports, torn down (SIGTERM, then SIGKILL)
// when the object goes away. Logs go to a temporary directory that is printed when a test fails.

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace wsync::testing {

class Process {
 public:
  // `env`: extra "NAME=value" entries for the child, on top of this process's environment.
  Process(const std::vector<std::string>& argv, const std::string& log, const std::vector<std::string>& env = {}) {
    pid_ = fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      setpgid(0, 0);
      FILE* f = std::fopen(log.c_str(), "w");
      if (f) {
        dup2(fileno(f), 1);
        dup2(fileno(f), 2);
      }
      for (const auto& e : env) {
        const size_t eq = e.find('=');
        if (eq != std::string::npos) setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
      }
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
  }
  Process(const Process&) = delete;
  ~Process() { Stop(); }
  pid_t pid() const { return pid_; }
  bool Running() {
    if (pid_ <= 0) return false;
    int st;
    pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      exit_status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      pid_ = -1;
      return false;
    }
    return true;
  }
  // Waits for exit (up to `timeout`); returns the exit status, or -1 on timeout.
  int Wait(std::chrono::seconds timeout) {
    auto end = std::chrono::steady_clock::now() + timeout;
    while (Running()) {
      if (std::chrono::steady_clock::now() > end) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return exit_status_;
  }
  void Stop() {
    if (!Running()) return;
    kill(pid_, SIGTERM);
    if (Wait(std::chrono::seconds(5)) == -1) {
      kill(pid_, SIGKILL);
      Wait(std::chrono::seconds(5));
    }
  }

 private:
  pid_t pid_ = -1;
  int exit_status_ = -1;
};

inline std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

struct ClusterOptions {
  std::string bin_dir;
  std::string model;
  int engines = 1;
  int tp = 2;
  std::vector<int> engine_tp;  // per engine, overriding `tp` (engines of different TP are planned in different groups)
  int ep = 1;  // engines' expert parallelism (MoE models)
  int sources = 1;
  int trainer_ranks = 1;
  int ring_mib = 16;
  std::string transport = "tcp";
  int pp = 1;                            // trainer pipeline stages: sources split evenly, stage = s * pp / sources
  std::vector<std::string> coordinator_args;  // e.g. {"--strategy", "balanced", "--min-source-mib", "0"}
  std::vector<std::string> source_env;  // extra "NAME=value" environment for the source daemons (e.g. WSYNC_FAULTS)
  std::vector<std::string> target_args;  // extra arguments of every target daemon (e.g. --metrics-listen)
  std::vector<std::string> engine_args;  // extra arguments of every reference engine (e.g. --staging)
  // mTLS: a directory made by tools/cli/wsync-certs.sh holding ca.pem and coordinator-main, engine-engine<e>,
  // target-infer<e> and source-train<s> certificates; every process then runs with its own. Empty: insecure loopback.
  std::string tls_dir;
};

// The --tls-* flags for the certificate `name` ("admin-ops") in `dir`; nothing when `dir` is empty.
inline std::vector<std::string> TlsFlags(const std::string& dir, const std::string& name) {
  if (dir.empty()) return {};
  return {"--tls-ca", dir + "/ca.pem", "--tls-cert", dir + "/" + name + ".pem", "--tls-key", dir + "/" + name + "-key.pem"};
}

class Cluster {
 public:
  explicit Cluster(ClusterOptions o) : o_(std::move(o)) {
    char tmpl[] = "/tmp/wsync-cluster-test.XXXXXX";
    dir_ = mkdtemp(tmpl);
    std::vector<std::string> cargs = {o_.bin_dir + "/wsync-coordinator", "--listen", "127.0.0.1:0"};
    cargs.insert(cargs.end(), o_.coordinator_args.begin(), o_.coordinator_args.end());
    cargs = Tls(cargs, "coordinator-main");
    coordinator = "127.0.0.1:" + Start("coordinator", cargs);
    coordinator_argv_ = cargs;
    coordinator_proc_ = procs_.back().get();
    for (int e = 0; e < o_.engines; ++e) AddEngine(e < static_cast<int>(o_.engine_tp.size()) ? o_.engine_tp[e] : o_.tp);
    for (int s = 0; s < o_.sources; ++s) {
      trainer_sockets.push_back(dir_ + "/source" + std::to_string(s) + ".sock");
      sources.push_back("127.0.0.1:" +
                        Start("source" + std::to_string(s),
                              Tls({o_.bin_dir + "/wsyncd", "--listen", "127.0.0.1:0", "--role", "source", "--node-id", "train" + std::to_string(s),
                                   "--trainer-socket", trainer_sockets.back(),
                                   "--coordinator", coordinator, "--trainer-ranks", std::to_string(o_.trainer_ranks),
                                   "--ring-mib", std::to_string(o_.ring_mib), "--transport", o_.transport,
                                   "--pp-stage", std::to_string(s * o_.pp / o_.sources)},
                                  "source-train" + std::to_string(s)),
                              o_.source_env));
    }
  }
  ~Cluster() {
    for (auto it = procs_.rbegin(); it != procs_.rend(); ++it) (*it)->Stop();
    if (std::getenv("WSYNC_TEST_KEEP") == nullptr) std::system(("rm -rf " + dir_).c_str());
  }
  // Starts one more reference engine of `tp` ranks and its target daemon (node "infer<N>"), which registers it.
  void AddEngine(int tp) {
    const int e = static_cast<int>(engines.size());
    const std::string id = "engine" + std::to_string(e);
    engines.push_back("127.0.0.1:" +
                      Start(id, Tls({o_.bin_dir + "/wsync-engine-ref", "--id", id, "--model", o_.model, "--tp",
                                     std::to_string(tp), "--ep", std::to_string(o_.ep), "--listen", "127.0.0.1:0"},
                                    "engine-" + id, o_.engine_args)));
    engine_pids.push_back(procs_.back()->pid());
    std::vector<std::string> targs = {o_.bin_dir + "/wsyncd", "--listen", "127.0.0.1:0", "--role", "target",
                                      "--node-id", "infer" + std::to_string(e), "--coordinator", coordinator,
                                      "--engine", engines.back(), "--transport", o_.transport, "--engine-socket",
                                      dir_ + "/target" + std::to_string(e) + ".sock"};
    targs.insert(targs.end(), o_.target_args.begin(), o_.target_args.end());
    targs = Tls(targs, "target-infer" + std::to_string(e));
    targets.push_back("127.0.0.1:" + Start("target" + std::to_string(e), targs));
    target_pids.push_back(procs_.back()->pid());
    target_argv_.push_back(targs);
    target_procs_.push_back(procs_.back().get());
  }
  // Kills target daemon `e` (SIGKILL) and reaps it; its engine runs on.
  void KillTarget(int e) {
    kill(target_procs_[e]->pid(), SIGKILL);
    target_procs_[e]->Wait(std::chrono::seconds(10));
  }
  // Starts target daemon `e` again on its address with its arguments (same node id, same engine): it registers anew.
  void RestartTarget(int e) {
    std::vector<std::string> argv = target_argv_[e];
    argv[2] = targets[e];  // --listen: the address the cluster knows
    Start("target" + std::to_string(e) + "-restarted" + std::to_string(++restarts_), argv);
    target_procs_[e] = procs_.back().get();
    target_pids[e] = procs_.back()->pid();
  }
  // Kills the coordinator (SIGKILL) and starts it again on the same address with the same arguments (a state store
  // given in coordinator_args is then restored).
  void RestartCoordinator() {
    kill(coordinator_proc_->pid(), SIGKILL);
    coordinator_proc_->Wait(std::chrono::seconds(10));
    std::vector<std::string> argv = coordinator_argv_;
    argv[2] = coordinator;  // --listen: the address the daemons know
    Start("coordinator-restarted" + std::to_string(++restarts_), argv);
    coordinator_proc_ = procs_.back().get();
  }
  const std::string& dir() const { return dir_; }
  std::string Log(const std::string& name) const { return ReadFile(dir_ + "/" + name + ".log"); }
  // The last `lines` lines of every log of the cluster's directory, each under its name: printed when a step fails,
  // so that a run whose directory is gone (CI) still says what each process did last.
  std::string LogTails(size_t lines = 25) const {
    std::vector<std::string> names;
    if (DIR* d = opendir(dir_.c_str())) {
      while (dirent* e = readdir(d)) {
        const std::string n = e->d_name;
        if (n.size() > 4 && n.compare(n.size() - 4, 4, ".log") == 0) names.push_back(n);
      }
      closedir(d);
    }
    std::sort(names.begin(), names.end());
    std::string out;
    for (const auto& n : names) {
      const std::string text = ReadFile(dir_ + "/" + n);
      size_t start = text.size(), seen = 0;  // back from the end over `lines` line breaks (a final one not counted)
      while (start > 0 && !(text[start - 1] == '\n' && start != text.size() && ++seen == lines)) --start;
      out += "----- " + n + " (last " + std::to_string(lines) + " lines)\n" + text.substr(start);
      if (!text.empty() && text.back() != '\n') out += "\n";
    }
    return out;
  }
  // Waits for every process of `procs` (trainers of one step) to exit 0, within `timeout` in all. When one fails, the
  // others get `grace` to finish (a rank whose driver failed would otherwise wait out its whole push deadline) and are
  // then stopped. On any failure prints each process's exit status and every log's tail to stderr; returns success.
  bool WaitAll(std::vector<std::unique_ptr<Process>>& procs, std::chrono::seconds timeout,
               std::chrono::seconds grace = std::chrono::seconds(15)) {
    auto end = std::chrono::steady_clock::now() + timeout;
    std::vector<int> rc(procs.size(), -2);  // -2: running
    bool failed = false;
    for (;;) {
      bool running = false;
      for (size_t i = 0; i < procs.size(); ++i) {
        if (rc[i] != -2) continue;
        if (procs[i]->Running()) {
          running = true;
          continue;
        }
        rc[i] = procs[i]->Wait(std::chrono::seconds(0));
        if (rc[i] != 0 && !failed) {
          failed = true;
          end = std::min(end, std::chrono::steady_clock::now() + grace);
        }
      }
      if (!running) break;
      if (std::chrono::steady_clock::now() > end) {
        failed = true;
        for (size_t i = 0; i < procs.size(); ++i)
          if (rc[i] == -2) procs[i]->Stop();  // rc stays -2: "still running when stopped"
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (failed) {
      std::string why = "cluster step failed in " + dir_ + ":";
      for (size_t i = 0; i < procs.size(); ++i)
        why += " process " + std::to_string(i) + (rc[i] == -2 ? " still running (stopped)" : " exited " + std::to_string(rc[i])) + ";";
      std::fprintf(stderr, "%s\n%s", why.c_str(), LogTails().c_str());
    }
    return !failed;
  }
  // Runs a program to completion (e.g. a trainer process); returns its exit status.
  int Run(const std::string& name, const std::vector<std::string>& argv, std::chrono::seconds timeout) {
    Process p(argv, dir_ + "/" + name + ".log");
    int rc = p.Wait(timeout);
    if (rc == -1) p.Stop();
    return rc;
  }

  std::string coordinator;
  std::vector<std::string> engines, targets, sources;
  std::vector<std::string> trainer_sockets;  // per source daemon: the Unix socket its trainer ranks connect to
  std::vector<pid_t> engine_pids;  // reference engine processes, in `engines` order
  std::vector<pid_t> target_pids;  // target daemons, in `targets` order

 private:
  std::vector<std::string> Tls(std::vector<std::string> argv, const std::string& cert,
                               const std::vector<std::string>& extra = {}) const {
    argv.insert(argv.end(), extra.begin(), extra.end());
    for (auto& f : TlsFlags(o_.tls_dir, cert)) argv.push_back(f);
    return argv;
  }
  // Starts a server and returns the port it published.
  std::string Start(const std::string& name, std::vector<std::string> argv, const std::vector<std::string>& env = {}) {
    const std::string port_file = dir_ + "/" + name + ".port";
    argv.push_back("--port-file");
    argv.push_back(port_file);
    procs_.push_back(std::make_unique<Process>(argv, dir_ + "/" + name + ".log", env));
    for (int i = 0; i < 600; ++i) {
      std::string p = ReadFile(port_file);
      if (!p.empty() && p.back() == '\n') return p.substr(0, p.size() - 1);
      if (!procs_.back()->Running())
        throw std::runtime_error(name + " exited before serving:\n" + ReadFile(dir_ + "/" + name + ".log"));
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    throw std::runtime_error(name + " did not start within 30 s");
  }

  ClusterOptions o_;
  std::vector<std::string> coordinator_argv_;
  std::vector<std::vector<std::string>> target_argv_;  // per target daemon, as started (without --port-file)
  std::vector<Process*> target_procs_;
  Process* coordinator_proc_ = nullptr;
  int restarts_ = 0;
  std::string dir_;
  std::vector<std::unique_ptr<Process>> procs_;
};

}  // namespace wsync::testing
