#include "proto/tls_files.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "spdlog/spdlog.h"

namespace wsync::tls {
namespace {

struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct KeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct StoreFree {
  void operator()(X509_STORE* s) const { X509_STORE_free(s); }
};
struct StoreCtxFree {
  void operator()(X509_STORE_CTX* c) const { X509_STORE_CTX_free(c); }
};
struct StackFree {
  void operator()(STACK_OF(X509) * s) const { sk_X509_free(s); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;

std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "no details";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof buf);
  return buf;
}

// Every certificate in `pem`, in order. Other PEM blocks (a key in the same file) are skipped.
std::vector<X509Ptr> ParseCertificates(const std::string& pem) {
  std::vector<X509Ptr> out;
  std::unique_ptr<BIO, BioFree> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (!bio) return out;
  while (X509* x = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) out.emplace_back(x);
  ERR_clear_error();  // the read that ends the loop leaves "no start line"
  return out;
}

std::string Hex(const unsigned char* p, size_t n, bool upper) {
  static const char* kLower = "0123456789abcdef";
  static const char* kUpper = "0123456789ABCDEF";
  const char* d = upper ? kUpper : kLower;
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s.push_back(d[p[i] >> 4]);
    s.push_back(d[p[i] & 15]);
  }
  return s;
}

std::string TimeString(const ASN1_TIME* t) {
  std::unique_ptr<BIO, BioFree> b(BIO_new(BIO_s_mem()));
  if (!b || ASN1_TIME_print(b.get(), t) != 1) return "?";
  char* data = nullptr;
  const long n = BIO_get_mem_data(b.get(), &data);
  return std::string(data, static_cast<size_t>(n));
}

CertificateInfo Describe(X509* x) {
  CertificateInfo info;
  char cn[256] = {0};
  if (X509_NAME_get_text_by_NID(X509_get_subject_name(x), NID_commonName, cn, sizeof cn) > 0) info.common_name = cn;
  if (const ASN1_INTEGER* serial = X509_get0_serialNumber(x))
    info.serial = Hex(serial->data, static_cast<size_t>(serial->length), true);
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int md_len = 0;
  if (X509_digest(x, EVP_sha256(), md, &md_len) == 1) info.sha256 = Hex(md, md_len, false);
  std::tm tm{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(x), &tm) == 1) info.not_after = timegm(&tm);
  return info;
}

std::string Utc(int64_t t) {
  const std::time_t tt = static_cast<std::time_t>(t);
  std::tm tm{};
  char buf[32];
  if (gmtime_r(&tt, &tm) == nullptr || std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0) return "?";
  return buf;
}

absl::Status Invalid(const std::string& flag, const std::string& path, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat(flag, " ", path, ": ", why));
}

absl::StatusOr<std::string> ReadWhole(const std::string& flag, const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f)
    return absl::NotFoundError(absl::StrCat(flag, " ", path, ": cannot read the file (", std::strerror(errno), ")"));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// An in-memory file gRPC reads through /proc/self/fd/N. Replace() swaps its content atomically (a new memfd dup2'd
// onto the same number), so a reader sees the old or the new content, never a mix.
class MemFile {
 public:
  static absl::StatusOr<MemFile> Create(const char* name, const std::string& content) {
    MemFile m;
    m.name_ = name;
    WSYNC_ASSIGN_OR_RETURN(m.fd_, m.Fill(content));
    return m;
  }
  absl::Status Replace(const std::string& content) {
    int fresh = -1;
    WSYNC_ASSIGN_OR_RETURN(fresh, Fill(content));
    const int r = dup2(fresh, fd_);
    const int err = errno;
    close(fresh);
    if (r < 0) return absl::InternalError(absl::StrCat("dup2 for ", name_, ": ", std::strerror(err)));
    return absl::OkStatus();
  }
  std::string path() const { return absl::StrCat("/proc/self/fd/", fd_); }

 private:
  absl::StatusOr<int> Fill(const std::string& content) const {
    const int fd = memfd_create(name_.c_str(), MFD_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("memfd_create ", name_, ": ", std::strerror(errno)));
    size_t done = 0;
    while (done < content.size()) {
      const ssize_t n = write(fd, content.data() + done, content.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = errno;
        close(fd);
        return absl::InternalError(absl::StrCat("write ", name_, ": ", std::strerror(err)));
      }
      done += static_cast<size_t>(n);
    }
    return fd;
  }
  std::string name_;
  int fd_ = -1;
};

}  // namespace

absl::StatusOr<CertificateInfo> DescribeCertificate(const std::string& pem) {
  auto certs = ParseCertificates(pem);
  if (certs.empty()) return absl::InvalidArgumentError("no PEM certificate found");
  return Describe(certs.front().get());
}

absl::StatusOr<CertificateInfo> ValidateCredentials(const CredentialPems& p, std::time_t now,
                                                    const std::string& expected_cn) {
  std::vector<X509Ptr> cas = ParseCertificates(p.ca);
  if (cas.empty()) return Invalid("--tls-ca", p.ca_path, "no PEM certificate in it");
  std::vector<X509Ptr> chain = ParseCertificates(p.cert);
  if (chain.empty()) return Invalid("--tls-cert", p.cert_path, "no PEM certificate in it");
  X509* leaf = chain.front().get();

  std::unique_ptr<BIO, BioFree> kb(BIO_new_mem_buf(p.key.data(), static_cast<int>(p.key.size())));
  std::unique_ptr<EVP_PKEY, KeyFree> key(kb ? PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr) : nullptr);
  if (!key) return Invalid("--tls-key", p.key_path, absl::StrCat("no PEM private key in it (", OpenSslError(), ")"));
  if (X509_check_private_key(leaf, key.get()) != 1) {
    ERR_clear_error();
    return Invalid("--tls-key", p.key_path, absl::StrCat("does not match the certificate in --tls-cert ", p.cert_path));
  }

  std::time_t t = now;
  if (X509_cmp_time(X509_get0_notBefore(leaf), &t) > 0)
    return Invalid("--tls-cert", p.cert_path,
                   absl::StrCat("not valid yet (not before ", TimeString(X509_get0_notBefore(leaf)), ")"));
  if (X509_cmp_time(X509_get0_notAfter(leaf), &t) < 0)
    return Invalid("--tls-cert", p.cert_path, absl::StrCat("expired on ", TimeString(X509_get0_notAfter(leaf))));

  std::unique_ptr<X509_STORE, StoreFree> store(X509_STORE_new());
  for (auto& ca : cas) X509_STORE_add_cert(store.get(), ca.get());  // duplicates in a bundle are harmless
  ERR_clear_error();
  std::unique_ptr<STACK_OF(X509), StackFree> untrusted(sk_X509_new_null());
  for (size_t i = 1; i < chain.size(); ++i) sk_X509_push(untrusted.get(), chain[i].get());
  std::unique_ptr<X509_STORE_CTX, StoreCtxFree> ctx(X509_STORE_CTX_new());
  if (!ctx || X509_STORE_CTX_init(ctx.get(), store.get(), leaf, untrusted.get()) != 1)
    return absl::InternalError(absl::StrCat("X509_STORE_CTX_init: ", OpenSslError()));
  X509_STORE_CTX_set_time(ctx.get(), 0, now);
  if (X509_verify_cert(ctx.get()) != 1) {
    const int err = X509_STORE_CTX_get_error(ctx.get());
    ERR_clear_error();
    return Invalid("--tls-cert", p.cert_path,
                   absl::StrCat("does not verify against the CA bundle --tls-ca ", p.ca_path, " (",
                                X509_verify_cert_error_string(err), ")"));
  }

  CertificateInfo info = Describe(leaf);
  info.ca_certificates = static_cast<int>(cas.size());
  if (!expected_cn.empty() && info.common_name != expected_cn)
    return Invalid("--tls-cert", p.cert_path,
                   absl::StrCat("subject CN \"", info.common_name, "\" is not the running identity \"", expected_cn,
                                "\"; a rotation keeps the CN (restart the process to change its identity)"));
  return info;
}

struct CredentialFiles::State {
  std::string ca_path, cert_path, key_path;
  int refresh_seconds = 60;
  MemFile ca_file, identity_file;  // what gRPC's provider watches: only validated content

  std::mutex check_mu;    // one CheckNow at a time (the watcher's and a caller's), so publications do not interleave
  mutable std::mutex mu;  // the fields below
  std::condition_variable cv;
  bool stop = false;
  CredentialPems published;  // the contents in use
  CertificateInfo current;
  Counters counters;
  std::string last_logged;  // the last rejection logged (not repeated every interval)
  std::time_t last_expiry_warning = 0;
  std::thread watcher;
};

CredentialFiles::CredentialFiles(std::unique_ptr<State> s) : s_(std::move(s)) {}

absl::StatusOr<std::shared_ptr<CredentialFiles>> CredentialFiles::Open(const std::string& ca_path,
                                                                       const std::string& cert_path,
                                                                       const std::string& key_path,
                                                                       int refresh_seconds) {
  if (refresh_seconds < 1)
    return absl::InvalidArgumentError(absl::StrCat("--tls-refresh-seconds ", refresh_seconds, ": must be at least 1"));
  CredentialPems p;
  p.ca_path = ca_path;
  p.cert_path = cert_path;
  p.key_path = key_path;
  WSYNC_ASSIGN_OR_RETURN(p.ca, ReadWhole("--tls-ca", ca_path));
  WSYNC_ASSIGN_OR_RETURN(p.cert, ReadWhole("--tls-cert", cert_path));
  WSYNC_ASSIGN_OR_RETURN(p.key, ReadWhole("--tls-key", key_path));
  CertificateInfo info;
  WSYNC_ASSIGN_OR_RETURN(info, ValidateCredentials(p, std::time(nullptr)));

  auto s = std::make_unique<State>();
  s->ca_path = ca_path;
  s->cert_path = cert_path;
  s->key_path = key_path;
  s->refresh_seconds = refresh_seconds;
  WSYNC_ASSIGN_OR_RETURN(s->ca_file, MemFile::Create("wsync-tls-ca", p.ca));
  // Key and certificate in one file, so gRPC reads a matching pair in one read (OpenSSL's PEM readers skip the
  // blocks of the other kind).
  WSYNC_ASSIGN_OR_RETURN(s->identity_file, MemFile::Create("wsync-tls-identity", p.cert + "\n" + p.key));
  s->published = std::move(p);
  s->current = info;
  std::shared_ptr<CredentialFiles> f(new CredentialFiles(std::move(s)));
  // The provider only reads the staged copies, which change only when a replacement is published: checking them
  // every second costs two small reads and makes a published replacement live within a second.
  f->provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      f->s_->identity_file.path(), f->s_->identity_file.path(), f->s_->ca_file.path(), 1);
  f->s_->watcher = std::thread([raw = f.get()] { raw->Run(); });
  spdlog::info("TLS: {} (serial {}, expires {}), {} CA certificate(s); files checked every {} s", info.common_name,
               info.serial, Utc(info.not_after), info.ca_certificates, refresh_seconds);
  return f;
}

CredentialFiles::~CredentialFiles() {
  {
    std::lock_guard<std::mutex> l(s_->mu);
    s_->stop = true;
  }
  s_->cv.notify_all();
  if (s_->watcher.joinable()) s_->watcher.join();
  // The memfds stay open: gRPC's provider (kept alive by credentials that may outlive this object) still reads
  // them by number, and a closed number could be reused by an unrelated file. They cost two fds per configuration.
  s_.release();
}

CertificateInfo CredentialFiles::current() const {
  std::lock_guard<std::mutex> l(s_->mu);
  return s_->current;
}

CredentialPems CredentialFiles::published() const {
  std::lock_guard<std::mutex> l(s_->mu);
  return s_->published;
}

CredentialFiles::Counters CredentialFiles::counters() const {
  std::lock_guard<std::mutex> l(s_->mu);
  return s_->counters;
}

absl::Status CredentialFiles::CheckNow() {
  std::lock_guard<std::mutex> serial(s_->check_mu);
  std::string expected_cn;
  CredentialPems seen;
  {
    std::lock_guard<std::mutex> l(s_->mu);
    expected_cn = s_->current.common_name;
    seen = s_->published;
  }
  absl::Status rejection;
  // A replacement read while it is being swapped (the key of one version, the certificate of the next) fails the
  // checks; reading again, up to three times while the files keep changing, gets a consistent set.
  for (int attempt = 0; attempt < 3; ++attempt) {
    CredentialPems p;
    p.ca_path = s_->ca_path;
    p.cert_path = s_->cert_path;
    p.key_path = s_->key_path;
    auto ca = ReadWhole("--tls-ca", p.ca_path);
    auto cert = ReadWhole("--tls-cert", p.cert_path);
    auto key = ReadWhole("--tls-key", p.key_path);
    if (!ca.ok() || !cert.ok() || !key.ok()) {
      rejection = !ca.ok() ? ca.status() : !cert.ok() ? cert.status() : key.status();
      break;
    }
    p.ca = *std::move(ca);
    p.cert = *std::move(cert);
    p.key = *std::move(key);
    if (p.ca == seen.ca && p.cert == seen.cert && p.key == seen.key) {
      if (attempt == 0) {  // unchanged since published: say so (hourly) when the certificate is about to expire
        const std::time_t now = std::time(nullptr);
        std::lock_guard<std::mutex> l(s_->mu);
        if (now + 24 * 3600 > s_->current.not_after && now >= s_->last_expiry_warning + 3600) {
          s_->last_expiry_warning = now;
          spdlog::warn("TLS: {} (serial {}) {} {} and no replacement was found in {}", s_->current.common_name,
                       s_->current.serial, now > s_->current.not_after ? "expired on" : "expires on",
                       Utc(s_->current.not_after), s_->cert_path);
        }
        return absl::OkStatus();
      }
      break;  // the same rejected contents again
    }
    auto info = ValidateCredentials(p, std::time(nullptr), expected_cn);
    if (info.ok()) {
      // The CA first: a new certificate's peers may already present certificates of a CA it adds.
      WSYNC_RETURN_IF_ERROR(s_->ca_file.Replace(p.ca));
      WSYNC_RETURN_IF_ERROR(s_->identity_file.Replace(p.cert + "\n" + p.key));
      std::lock_guard<std::mutex> l(s_->mu);
      s_->published = std::move(p);
      s_->current = *info;
      ++s_->counters.reloads;
      s_->last_logged.clear();
      spdlog::info("TLS: reloaded {} (serial {}, expires {}), {} CA certificate(s); new connections use them",
                   info->common_name, info->serial, Utc(info->not_after), info->ca_certificates);
      return absl::OkStatus();
    }
    rejection = info.status();
    seen = std::move(p);
  }
  std::lock_guard<std::mutex> l(s_->mu);
  ++s_->counters.rejected;
  s_->counters.last_error = std::string(rejection.message());
  if (s_->last_logged != s_->counters.last_error) {
    s_->last_logged = s_->counters.last_error;
    spdlog::error("TLS: replacement credentials rejected, still serving {} (serial {}): {}", s_->current.common_name,
                  s_->current.serial, s_->counters.last_error);
  }
  return rejection;
}

void CredentialFiles::Run() {
  std::unique_lock<std::mutex> l(s_->mu);
  while (!s_->stop) {
    s_->cv.wait_for(l, std::chrono::seconds(s_->refresh_seconds));
    if (s_->stop) break;
    l.unlock();
    (void)CheckNow();  // logs a rejection itself
    l.lock();
  }
}

}  // namespace wsync::tls
