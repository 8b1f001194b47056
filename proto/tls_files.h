#pragma once
// The TLS files of a process (CA bundle, certificate chain, private key), validated before gRPC ever sees them and
// reloaded while the process runs (docs/security.md, "Certificate rotation").
//
// gRPC's FileWatcherCertificateProvider re-reads files every interval, but it hands whatever it reads to new
// handshakes: a half-written, expired or mismatched replacement would break every new connection. So the provider
// here watches in-memory copies (memfds, read through /proc/self/fd) that hold only credentials that passed
// ValidateCredentials; a watcher thread reads the configured paths every `refresh_seconds`, and publishes a
// replacement only when it is valid. A rejected replacement is logged (naming the file and the reason) and the
// credentials in use stay. Reading by path each time follows symlinks anew, so a Kubernetes Secret update (an atomic
// swap of the mounted directory's ..data link) is picked up like an in-place rewrite.
//
// Thread safety: every member may be called from any thread.

#include <grpcpp/security/tls_certificate_provider.h>

#include <cstdint>
#include <ctime>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace wsync::tls {

// What a validated set of files holds (for logs, status and tests).
struct CertificateInfo {
  std::string common_name;  // the certificate's subject CN, "<role>:<id>"
  std::string serial;       // serial number, upper-case hex
  std::string sha256;       // SHA-256 fingerprint of the DER certificate, lower-case hex
  int64_t not_after = 0;    // expiry, seconds since the epoch
  int ca_certificates = 0;  // certificates in the CA bundle
};

// The file contents to check and the paths to name in errors.
struct CredentialPems {
  std::string ca, cert, key;                 // PEM contents
  std::string ca_path, cert_path, key_path;  // where they came from
};

// Checks that `p.ca` holds at least one CA certificate, `p.cert` a certificate chain whose first certificate matches
// the private key in `p.key`, is valid at `now` (not before notBefore, not after notAfter) and verifies against the
// CA bundle (with the chain's other certificates as intermediates), and that its CN is `expected_cn` unless that is
// empty. InvalidArgument naming the flag, the file and the reason otherwise.
absl::StatusOr<CertificateInfo> ValidateCredentials(const CredentialPems& p, std::time_t now,
                                                    const std::string& expected_cn = "");

// SHA-256 fingerprint and serial of the first certificate in `pem` (tests compare a peer's certificate with a file).
absl::StatusOr<CertificateInfo> DescribeCertificate(const std::string& pem);

class CredentialFiles {
 public:
  // Reads and validates the three files (errors name the flag and the file), stages them and starts the watcher.
  // `refresh_seconds` >= 1: how often the files are checked for a replacement.
  static absl::StatusOr<std::shared_ptr<CredentialFiles>> Open(const std::string& ca_path, const std::string& cert_path,
                                                               const std::string& key_path, int refresh_seconds);
  ~CredentialFiles();  // stops the watcher; the staged copies stay readable (see the .cc)
  CredentialFiles(const CredentialFiles&) = delete;
  CredentialFiles& operator=(const CredentialFiles&) = delete;

  // The provider every server and channel of the process uses (root certificates and the identity key/cert pair).
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider() const { return provider_; }

  // The credentials in use (the last validated ones).
  CertificateInfo current() const;
  // Their contents (servers that are not gRPC's, e.g. the coordinator's status page, read them per handshake).
  CredentialPems published() const;
  // How many replacements were published / rejected since Open, and the last rejection's message ("" if none).
  struct Counters {
    uint64_t reloads = 0, rejected = 0;
    std::string last_error;
  };
  Counters counters() const;

  // Checks the files once now (the watcher does this every refresh_seconds): OK when nothing changed or the
  // replacement was published; the rejection otherwise (the old credentials stay).
  absl::Status CheckNow();

 private:
  struct State;
  explicit CredentialFiles(std::unique_ptr<State> s);
  void Run();
  std::unique_ptr<State> s_;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider_;
};

}  // namespace wsync::tls
