#include "daemon/common/serve.h"

#include <pthread.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "proto/tls.h"

namespace wsync::daemon {

uint64_t MaxRequestBytes(std::string_view rpc) {
  return rpc == "RegisterNode" || rpc == "ConfigureSource" ? kMaxPlanRequestBytes : kMaxControlRequestBytes;
}

grpc::Status CheckRequestSize(const char* rpc, const google::protobuf::Message& req) {
  const uint64_t limit = MaxRequestBytes(rpc);
  const uint64_t size = req.ByteSizeLong();
  if (size <= limit) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                      absl::StrCat(rpc, " request of ", size, " bytes refused: the limit for ", rpc, " is ", limit,
                                   " bytes (docs/security.md, \"Bounded requests\")"));
}

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
  // engine rank's parameter table, a few MiB for the largest models. Larger requests are refused before parsing;
  // each handler then applies its RPC's own limit (CheckRequestSize).
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

absl::StatusOr<std::unique_ptr<grpc::Server>> ServeUnix(const std::string& path,
                                                        const std::vector<grpc::Service*>& services, int mode) {
  if (path.empty() || path.front() != '/' || path.size() >= sizeof(sockaddr_un::sun_path))
    return absl::InvalidArgumentError(absl::StrCat("socket path '", path, "' must be absolute and shorter than ",
                                                   sizeof(sockaddr_un::sun_path), " bytes"));
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder b;
  // Local peers only (the path's permissions and the session ids authorize them), so no TLS here.
  b.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  for (auto* svc : services) b.RegisterService(svc);
  b.SetMaxReceiveMessageSize(kMaxControlMessageBytes);
  b.SetMaxSendMessageSize(kMaxControlMessageBytes);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  if (!server) return absl::UnavailableError(absl::StrCat("cannot serve gRPC on unix:", path));
  if (chmod(path.c_str(), static_cast<mode_t>(mode)) != 0) {
    const int err = errno;
    server->Shutdown();
    return absl::ErrnoToStatus(err, absl::StrCat("chmod ", path, ": ", std::strerror(err)));
  }
  return server;
}

absl::Status MakeDirs(const std::string& dir, int mode) {
  if (dir.empty()) return absl::OkStatus();
  struct stat st {};
  if (stat(dir.c_str(), &st) == 0) {
    return S_ISDIR(st.st_mode) ? absl::OkStatus()
                               : absl::FailedPreconditionError(absl::StrCat(dir, " exists and is no directory"));
  }
  const size_t slash = dir.rfind('/');
  if (slash != std::string::npos && slash > 0) {
    absl::Status parent = MakeDirs(dir.substr(0, slash), mode);
    if (!parent.ok()) return parent;
  }
  if (mkdir(dir.c_str(), static_cast<mode_t>(mode)) != 0 && errno != EEXIST)
    return absl::ErrnoToStatus(errno, absl::StrCat("mkdir ", dir, ": ", std::strerror(errno)));
  return absl::OkStatus();
}

std::string DefaultSocketPath(const std::string& name) {
  if (MakeDirs("/run/wsync", 0711).ok() && access("/run/wsync", W_OK | X_OK) == 0) return "/run/wsync/" + name;
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg != nullptr && *xdg != '\0') {
    const std::string dir = absl::StrCat(xdg, "/wsync");
    if (MakeDirs(dir, 0700).ok()) return dir + "/" + name;
  }
  return absl::StrCat("/tmp/wsync-", getuid(), "/", name);
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
