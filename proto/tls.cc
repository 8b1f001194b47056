#include "proto/tls.h"
#include "proto/tls_files.h"

#include <arpa/inet.h>
#include <grpc/support/log.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_join.h"
#include "absl/strings/numbers.h"
#include "absl/time/clock.h"
#include "base/log_limiter.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "spdlog/spdlog.h"

namespace wsync::tls {
namespace {

struct Loaded {
  bool enabled = false;
  std::shared_ptr<CredentialFiles> files;  // validated, reloaded while the process runs (proto/tls_files.h)
  std::string error;                       // a bad WSYNC_TLS_* environment: every Dial fails with it
};

std::mutex g_mu;
bool g_configured = false;
// Never destroyed: credentials and channels may be used until the process exits, and the watcher and gRPC's provider
// must not be torn down by static destruction (after gRPC may have shut down).
Loaded& g_loaded = *new Loaded;

absl::StatusOr<Loaded> Load(const Options& o) {
  Loaded l;
  const int given = !o.ca.empty() + !o.cert.empty() + !o.key.empty();
  if (given == 0) return l;
  if (o.insecure)
    return absl::InvalidArgumentError("--insecure cannot be combined with --tls-ca/--tls-cert/--tls-key");
  if (given != 3)
    return absl::InvalidArgumentError(
        "TLS needs all three of --tls-ca, --tls-cert and --tls-key (or WSYNC_TLS_CA, WSYNC_TLS_CERT, WSYNC_TLS_KEY)");
  auto files = CredentialFiles::Open(o.ca, o.cert, o.key, o.refresh_seconds);
  if (!files.ok()) return files.status();
  l.enabled = true;
  l.files = *std::move(files);
  return l;
}

// The process configuration; from the environment when Configure was never called.
const Loaded& Current() {
  std::lock_guard<std::mutex> l(g_mu);
  if (!g_configured) {
    Options o;
    if (const char* v = std::getenv("WSYNC_TLS_CA")) o.ca = v;
    if (const char* v = std::getenv("WSYNC_TLS_CERT")) o.cert = v;
    if (const char* v = std::getenv("WSYNC_TLS_KEY")) o.key = v;
    absl::Status refresh;
    if (const char* v = std::getenv("WSYNC_TLS_REFRESH_SECONDS"); v != nullptr && *v != 0)
      if (!absl::SimpleAtoi(v, &o.refresh_seconds))
        refresh = absl::InvalidArgumentError(absl::StrCat("WSYNC_TLS_REFRESH_SECONDS ", v, ": not a number"));
    auto loaded = refresh.ok() ? Load(o) : absl::StatusOr<Loaded>(refresh);
    if (loaded.ok()) {
      g_loaded = *std::move(loaded);
    } else {
      g_loaded = Loaded();
      g_loaded.error = std::string(loaded.status().message());
    }
    g_configured = true;
  }
  return g_loaded;
}

std::string HostOf(const std::string& address) {
  std::string a = address;
  for (const char* scheme : {"dns:///", "ipv4:", "ipv6:"})
    if (absl::StartsWith(a, scheme)) a = a.substr(std::string(scheme).size());
  if (!a.empty() && a[0] == '[') {
    const size_t e = a.find(']');
    return e == std::string::npos ? a.substr(1) : a.substr(1, e - 1);
  }
  const size_t colon = a.rfind(':');
  if (colon != std::string::npos && a.find(':') == colon) return a.substr(0, colon);  // host:port
  return a;  // a bare host, or a bare IPv6 address
}

std::atomic<uint64_t> g_handshake_failures{0};
// Never destroyed: gRPC may log from its own threads until the process exits.
LogLimiter& g_handshake_log = *new LogLimiter(absl::Minutes(1));

absl::string_view BaseName(absl::string_view path) {
  const size_t slash = path.rfind('/');
  return slash == absl::string_view::npos ? path : path.substr(slash + 1);
}

// gRPC 1.51 logs each failed TLS handshake once, at ERROR, from its SSL transport: "Handshake failed with fatal error
// SSL_ERROR_SSL: ...", server side (no or a foreign client certificate) and client side alike.
bool IsHandshakeFailure(absl::string_view file, absl::string_view message) {
  return BaseName(file) == "ssl_transport_security.cc" && absl::StartsWith(message, "Handshake failed");
}

void GrpcLogToSpdlog(gpr_log_func_args* args) {
  const absl::string_view file = args->file != nullptr ? args->file : "";
  // fmt cannot print this Abseil's string_view: log std::strings.
  const std::string message(absl::StripTrailingAsciiWhitespace(args->message != nullptr ? args->message : ""));
  if (IsHandshakeFailure(file, message)) {
    const uint64_t total = g_handshake_failures.fetch_add(1) + 1;
    if (std::optional<uint64_t> left_out = g_handshake_log.Admit("handshake", absl::Now())) {
      spdlog::warn(
          "TLS: a handshake failed (a peer without a valid certificate of the cluster CA, or a server whose "
          "certificate does not verify): {}; {} failed handshakes since start, {} since the previous such line "
          "(gRPC does not name the peer)",
          message, total, *left_out + 1);
    }
    return;
  }
  const std::string where = absl::StrCat("grpc ", BaseName(file), ":", args->line);
  switch (args->severity) {
    case GPR_LOG_SEVERITY_ERROR:
      spdlog::error("{}: {}", where, message);
      break;
    case GPR_LOG_SEVERITY_INFO:
      spdlog::info("{}: {}", where, message);
      break;
    default:
      spdlog::debug("{}: {}", where, message);
  }
}

}  // namespace

bool ParseCommonName(const std::string& cn, std::string* role, std::string* id) {
  const size_t colon = cn.find(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == cn.size()) return false;
  *role = cn.substr(0, colon);
  *id = cn.substr(colon + 1);
  return true;
}

absl::Status CheckIdentity(const std::string& common_name, const std::string& cert_path, const Identity& want) {
  if (want.roles.empty()) return absl::OkStatus();
  std::string role, id;
  const bool parsed = ParseCommonName(common_name, &role, &id);
  bool role_ok = false;
  for (const auto& r : want.roles) role_ok = role_ok || (parsed && role == r);
  if (role_ok && (want.id.empty() || id == want.id)) return absl::OkStatus();
  std::string wanted;
  for (const auto& r : want.roles)
    absl::StrAppend(&wanted, wanted.empty() ? "" : " or ", "\"", r, ":", want.id.empty() ? "<name>" : want.id, "\"");
  return absl::InvalidArgumentError(
      absl::StrCat("--tls-cert ", cert_path, ": the certificate's CN is \"", common_name, "\", but ", want.process,
                   " needs a certificate with CN ", wanted,
                   " (a certificate names its holder's role and id; docs/security.md, \"Roles\")"));
}

void RouteGrpcLog() {
  static std::once_flag once;
  std::call_once(once, [] { gpr_set_log_function(&GrpcLogToSpdlog); });
}

uint64_t HandshakeFailures() { return g_handshake_failures.load(); }

void AddFlags(CLI::App& app, Options* o) {
  app.add_option("--tls-ca", o->ca, "PEM file of the CA that signs every wsync certificate (mTLS)")
      ->envname("WSYNC_TLS_CA");
  app.add_option("--tls-cert", o->cert, "PEM file of this process's certificate, CN \"<role>:<id>\"")
      ->envname("WSYNC_TLS_CERT");
  app.add_option("--tls-key", o->key, "PEM file of the certificate's private key")->envname("WSYNC_TLS_KEY");
  app.add_option("--tls-refresh-seconds", o->refresh_seconds,
                 "how often the TLS files are checked for a replacement (rotation without a restart; an invalid "
                 "replacement is logged and the credentials in use stay)")
      ->envname("WSYNC_TLS_REFRESH_SECONDS")
      ->check(CLI::Range(1, 86400))
      ->capture_default_str();
  app.add_flag("--insecure", o->insecure,
               "no TLS and no roles: loopback development only (refused when any address is not loopback); the "
               "default when no TLS files are given");
}

absl::Status Configure(const Options& o, const std::vector<std::string>& addresses, const Identity& identity) {
  RouteGrpcLog();
  auto loaded = Load(o);
  if (!loaded.ok()) return loaded.status();
  if (loaded->enabled) {
    if (absl::Status st = CheckIdentity(loaded->files->current().common_name, o.cert, identity); !st.ok()) return st;
  }
  if (!loaded->enabled) {
    for (const auto& list : addresses)
      for (absl::string_view part : absl::StrSplit(list, ',', absl::SkipWhitespace())) {  // "A,B": a fail-over list
        const std::string a(absl::StripAsciiWhitespace(part));
        if (a.empty() || IsLoopback(a)) continue;
        return absl::InvalidArgumentError(absl::StrCat(
            "address ", a, " is not loopback: without TLS (", o.insecure ? "--insecure" : "no --tls-* files given",
            ") wsync listens on and dials loopback addresses only; give --tls-ca, --tls-cert and --tls-key "
            "(docs/security.md)"));
      }
  }
  std::shared_ptr<CredentialFiles> previous;  // stopped outside the lock (its watcher is joined)
  std::lock_guard<std::mutex> l(g_mu);
  previous = std::move(g_loaded.files);
  g_loaded = *std::move(loaded);
  g_configured = true;
  return absl::OkStatus();
}

bool Enabled() { return Current().enabled; }

std::shared_ptr<CredentialFiles> Files() { return Current().files; }

bool IsLoopback(const std::string& address) {
  // A Unix socket (gRPC "unix:" or a plain path, as trainer ranks give their daemon) never leaves the host.
  if (absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:") || absl::StartsWith(address, "/"))
    return true;
  const std::string host = HostOf(address);
  if (host == "localhost") return true;
  in_addr v4{};
  if (inet_pton(AF_INET, host.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  if (inet_pton(AF_INET6, host.c_str(), &v6) == 1) return IN6_IS_ADDR_LOOPBACK(&v6);
  return false;
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials() {
  const Loaded& l = Current();
  if (!l.enabled) return grpc::InsecureServerCredentials();
  // The provider hands new handshakes the current validated files; connections already up keep their session.
  grpc::experimental::TlsServerCredentialsOptions o(l.files->provider());
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  return grpc::experimental::TlsServerCredentials(o);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(const std::string& address, int max_message_bytes) {
  const Loaded& l = Current();
  if (!l.error.empty()) return absl::InvalidArgumentError(absl::StrCat("TLS configuration: ", l.error));
  grpc::ChannelArguments args;
  if (max_message_bytes > 0) {
    args.SetMaxReceiveMessageSize(max_message_bytes);
    args.SetMaxSendMessageSize(max_message_bytes);
  }
  if (!l.enabled) {
    if (!IsLoopback(address))
      return absl::FailedPreconditionError(absl::StrCat(
          "refusing to dial ", address,
          " without TLS: insecure channels are for loopback addresses only; configure --tls-ca/--tls-cert/--tls-key "
          "or WSYNC_TLS_CA/WSYNC_TLS_CERT/WSYNC_TLS_KEY"));
    return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  }
  grpc::experimental::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(l.files->provider());
  o.watch_root_certs();
  o.watch_identity_key_cert_pairs();
  o.set_verify_server_certs(true);  // chain to the CA bundle
  // The server's certificate must name the dialled host or IP (subjectAltName), as with the plain SSL credentials.
  o.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  o.set_check_call_host(true);
  return grpc::CreateCustomChannel(address, grpc::experimental::TlsCredentials(o), args);
}

std::string Peer::Describe() const {
  return authenticated ? absl::StrCat(role, ":", id) : std::string("unauthenticated peer");
}

Peer PeerOf(const grpc::ServerContext* ctx) {
  Peer p;
  if (ctx == nullptr) return p;
  auto auth = ctx->auth_context();
  if (!auth || !auth->IsPeerAuthenticated()) return p;
  auto cn = auth->FindPropertyValues("x509_common_name");
  if (cn.empty()) return p;
  // Not a wsync certificate's CN: unauthenticated.
  p.authenticated = ParseCommonName(std::string(cn.front().data(), cn.front().size()), &p.role, &p.id);
  return p;
}

Peer Self() {
  Peer p;
  if (std::shared_ptr<CredentialFiles> f = Files())
    p.authenticated = ParseCommonName(f->current().common_name, &p.role, &p.id);
  return p;
}

grpc::Status Authorize(const grpc::ServerContext* ctx, const char* rpc, std::initializer_list<const char*> roles,
                       Peer* out) {
  Peer p = PeerOf(ctx);
  if (out != nullptr) *out = p;
  if (!Enabled()) return grpc::Status::OK;  // insecure (loopback development): no roles
  if (p.authenticated)
    for (const char* r : roles)
      if (p.role == r) return grpc::Status::OK;
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat(rpc, " refused for ", p.Describe(), ": allowed roles are ",
                                   absl::StrJoin(roles.begin(), roles.end(), ", ")));
}

}  // namespace wsync::tls
