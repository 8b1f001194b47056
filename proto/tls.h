#pragma once
// Mutual TLS for every wsync gRPC channel, and the caller's role taken from its certificate (docs/security.md).
//
// One process-wide configuration, set once at start (Configure, from the --tls-* / --insecure flags AddFlags adds),
// or, in a process that never calls Configure (a trainer or library user of the C++/C/Python clients), read on first
// use from WSYNC_TLS_CA / WSYNC_TLS_CERT / WSYNC_TLS_KEY. Either all three files are given (TLS: servers require and
// verify a client certificate signed by the CA, clients verify the server's certificate against the CA and the
// dialled host name or IP) or none (insecure: only for loopback addresses, checked when configuring and at every
// dial).
//
// Identity: the certificate's subject common name is "<role>:<id>" with role one of coordinator, source, target,
// engine, admin, trainer (tools/cli/wsync-certs.sh makes them). An insecure server checks no roles. A binary checks
// at start that its own certificate is its identity (Configure's `identity`), and refuses to start otherwise.
//
// gRPC's own log (Configure routes it to spdlog): a failed TLS handshake is counted (HandshakeFailures) and logged at
// most once a minute, so a peer without a valid certificate hammering a port cannot fill the log.
//
// Rotation: the files are read again every --tls-refresh-seconds; a replacement that passes the same checks as at
// start (and keeps the certificate's CN) is used by every new handshake, server and client side, from then on; one
// that does not is logged, naming the file, and the credentials in use stay (proto/tls_files.h).
//
// Thread safety: Configure must run before any channel or server is created (main, before threads); everything else
// may be called from any thread.

#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace wsync::tls {

class CredentialFiles;  // proto/tls_files.h

struct Options {
  std::string ca;    // PEM file of the CA that signs every wsync certificate
  std::string cert;  // PEM file of this process's certificate (CN "<role>:<id>")
  std::string key;   // PEM file of its private key
  bool insecure = false;  // explicitly no TLS (loopback only)
  int refresh_seconds = 60;  // how often the files are checked for a replacement (proto/tls_files.h)
};

// --tls-ca, --tls-cert, --tls-key, --tls-refresh-seconds (defaults from WSYNC_TLS_CA / WSYNC_TLS_CERT /
// WSYNC_TLS_KEY / WSYNC_TLS_REFRESH_SECONDS) and --insecure.
void AddFlags(CLI::App& app, Options* o);

// Who a binary is (docs/security.md, "Roles"): its certificate's CN "<role>:<id>" must name one of `roles` and, when
// `id` is not empty, that id. A rotation keeps the CN (tls_files.h), so what was checked at start holds while the
// process runs.
struct Identity {
  std::string process;             // how errors name the process: "wsyncd --role source --node-id train0"
  std::vector<std::string> roles;  // empty: no check (library users, tests)
  std::string id;                  // empty: any id
};

// Splits a certificate CN "<role>:<id>" (both parts non-empty); false when it is not a wsync certificate's CN.
bool ParseCommonName(const std::string& cn, std::string* role, std::string* id);

// OK when `common_name`, the CN of the certificate in `cert_path`, is the identity `want`; InvalidArgument naming
// the file, the CN found and the CN wanted otherwise.
absl::Status CheckIdentity(const std::string& common_name, const std::string& cert_path, const Identity& want);

// Validates `o` against `addresses` (every address the process listens on or dials that is known at start, host:port
// or unix:PATH) and makes it the process configuration. InvalidArgument, naming the flag or address, when only some
// of the TLS files are given, --insecure is combined with them, or TLS is off and an address is not loopback;
// NotFound/InvalidArgument when a file cannot be read or the files are not valid credentials (ValidateCredentials:
// the key matches the certificate, which is current and verifies against the CA bundle); InvalidArgument naming the
// certificate file and its CN when the certificate is not `identity` (CheckIdentity; nothing is checked without TLS).
// Also routes gRPC's log to spdlog (RouteGrpcLog).
absl::Status Configure(const Options& o, const std::vector<std::string>& addresses, const Identity& identity = {});

// True when the process configuration has TLS.
bool Enabled();

// The process's TLS files (null when insecure): the credentials in use and the reload counters.
std::shared_ptr<CredentialFiles> Files();

// True for 127.0.0.0/8, ::1, localhost and unix: addresses (host:port, [v6]:port, or a bare host).
bool IsLoopback(const std::string& address);

// Server credentials of the process configuration (TLS requiring a verified client certificate, or insecure).
std::shared_ptr<grpc::ServerCredentials> ServerCredentials();

// A channel to `address` with the process configuration; `max_message_bytes` > 0 sets both message limits.
// FailedPrecondition when TLS is off and `address` is not loopback.
absl::StatusOr<std::shared_ptr<grpc::Channel>> Dial(const std::string& address, int max_message_bytes = 0);

// The caller of an RPC, from its verified certificate. `authenticated` is false on an insecure server.
struct Peer {
  bool authenticated = false;
  std::string role;
  std::string id;
  std::string Describe() const;  // "source:train0" or "unauthenticated peer"
};
Peer PeerOf(const grpc::ServerContext* ctx);

// This process's own identity, from its certificate in use; not authenticated when insecure.
Peer Self();

// Sends gRPC's own log lines (gpr_log) to spdlog. gRPC logs a failed TLS handshake (a peer without a certificate of
// the CA, with another CA's, or a server whose certificate does not verify) as "Handshake failed ...", without the
// peer's address: such lines are counted and logged at most once a minute, with the number left out. Idempotent;
// Configure calls it.
void RouteGrpcLog();

// TLS handshakes that failed in this process since it started, server and client side (from gRPC's log).
uint64_t HandshakeFailures();

// OK when the process runs insecure (loopback development: no roles) or the caller's role is one of `roles`;
// PERMISSION_DENIED naming the caller, the RPC and the roles allowed otherwise. `out`, if set, receives the peer.
grpc::Status Authorize(const grpc::ServerContext* ctx, const char* rpc, std::initializer_list<const char*> roles,
                       Peer* out = nullptr);

// Roles (the prefix of a certificate's common name).
inline constexpr const char* kCoordinator = "coordinator";
inline constexpr const char* kSource = "source";
inline constexpr const char* kTarget = "target";
inline constexpr const char* kEngine = "engine";
inline constexpr const char* kAdmin = "admin";
inline constexpr const char* kTrainer = "trainer";
inline std::vector<std::string> AllRoles() { return {kCoordinator, kSource, kTarget, kEngine, kAdmin, kTrainer}; }
// Every role: read-only RPCs any authenticated caller may use.
#define WSYNC_ANY_ROLE                                                                                     \
  {                                                                                                        \
    ::wsync::tls::kCoordinator, ::wsync::tls::kSource, ::wsync::tls::kTarget, ::wsync::tls::kEngine,       \
        ::wsync::tls::kAdmin, ::wsync::tls::kTrainer                                                       \
  }

}  // namespace wsync::tls
