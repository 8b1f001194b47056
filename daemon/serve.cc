#include "daemon/serve.h"

#include <pthread.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "proto/tls.h"

namespace wsync::daemon {

absl::StatusOr<Served> Serve(const std::string& listen, const std::vector<grpc::Service*>& services,
                             const std::string& port_file) {
  Served s;
  // grpc.health.v1.Health on every server ("" = the whole server, SERVING while it runs): Kubernetes grpc probes
  // and `grpc_health_probe` use it.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder b;
  b.AddListeningPort(listen, tls::ServerCredentials(), &s.port);  // mTLS unless the process runs insecure
  for (auto* svc : services) b.RegisterService(svc);
  // Control messages only (weights never travel over gRPC): the largest are registrations and plans carrying every
  // engine rank's parameter table, a few MiB for the largest models. Larger requests are refused before parsing.
  b.SetMaxReceiveMessageSize(kMaxControlMessageBytes);
  b.SetMaxSendMessageSize(kMaxControlMessageBytes);
  s.server = b.BuildAndStart();
  if (!s.server || s.port == 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", listen));
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << s.port << "\n";
    if (std::rename(tmp.c_str(), port_file.c_str()) != 0)
      return absl::InternalError(absl::StrCat("cannot write port file ", port_file));
  }
  return s;
}

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

void WaitForTermination() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  int sig = 0;
  sigwait(&set, &sig);
}

bool TerminationRequested(int timeout_ms) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  timespec ts{timeout_ms / 1000, static_cast<long>(timeout_ms % 1000) * 1000000L};
  for (;;) {
    const int sig = sigtimedwait(&set, nullptr, &ts);
    if (sig == SIGTERM || sig == SIGINT) return true;
    if (sig < 0 && errno == EINTR) continue;  // another signal; the remaining time is not tracked, close enough
    return false;
  }
}

bool IsWildcardHost(const std::string& host) {
  return host.empty() || host == "0.0.0.0" || host == "::" || host == "[::]" || host == "*";
}

}  // namespace wsync::daemon
