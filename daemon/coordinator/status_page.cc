#include "daemon/coordinator/status_page.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <sys/socket.h>

#include <algorithm>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/timeline_svg.h"
#include "httplib.h"
#include "proto/tls.h"
#include "proto/tls_files.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

constexpr int kDefaultUpdates = 10;
constexpr int kMaxUpdates = 100;

std::string Cell(const std::string& s) { return absl::StrCat("<td>", XmlEscape(s.empty() ? "-" : s), "</td>"); }

// ready / stale / paused / not ready, as routers see it (EngineStatesOf: one fact).
std::string Readiness(const v1::EngineState& e) {
  if (e.ready()) return "ready";
  if (e.stale()) return "stale";
  if (e.paused()) return "paused";
  return "not ready";
}

template <typename T>
using OsslPtr = std::unique_ptr<T, void (*)(T*)>;

OsslPtr<BIO> MemBio(const std::string& pem) {
  return OsslPtr<BIO>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), [](BIO* b) { BIO_free(b); });
}

// Every certificate of a PEM bundle, in order.
std::vector<OsslPtr<X509>> ReadCertificates(const std::string& pem) {
  std::vector<OsslPtr<X509>> out;
  OsslPtr<BIO> bio = MemBio(pem);
  while (bio != nullptr) {
    X509* c = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr);
    if (c == nullptr) break;
    out.emplace_back(c, X509_free);
  }
  ERR_clear_error();  // the end of the bundle reads as an error
  return out;
}

// OpenSSL's certificate callback, at every handshake: the process's credentials in use (validated, rotated by
// proto/tls_files.h) as this connection's certificate chain, key and client CA store. 1: go on; 0: fail the handshake.
int UseCurrentCredentials(SSL* ssl, void*) {
  std::shared_ptr<tls::CredentialFiles> files = tls::Files();
  if (files == nullptr) return 0;
  const tls::CredentialPems p = files->published();
  std::vector<OsslPtr<X509>> chain = ReadCertificates(p.cert);
  OsslPtr<BIO> key_bio = MemBio(p.key);
  OsslPtr<EVP_PKEY> key(key_bio ? PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr) : nullptr,
                        EVP_PKEY_free);
  std::vector<OsslPtr<X509>> cas = ReadCertificates(p.ca);
  if (chain.empty() || key == nullptr || cas.empty()) return 0;
  if (SSL_use_certificate(ssl, chain[0].get()) != 1 || SSL_use_PrivateKey(ssl, key.get()) != 1) return 0;
  SSL_clear_chain_certs(ssl);
  for (size_t i = 1; i < chain.size(); ++i)
    if (SSL_add1_chain_cert(ssl, chain[i].get()) != 1) return 0;
  OsslPtr<X509_STORE> store(X509_STORE_new(), X509_STORE_free);
  if (store == nullptr) return 0;
  for (const auto& c : cas)
    if (X509_STORE_add_cert(store.get(), c.get()) != 1) return 0;
  return SSL_set1_verify_cert_store(ssl, store.get()) == 1 ? 1 : 0;
}

// The API's rule for read-only calls (GetClusterStatus): any wsync role. The handshake already required a
// certificate that verifies against the CA; this checks that it is a wsync identity.
// A plain-HTTP request on the HTTPS port: OpenSSL sees "GET " where a TLS record should start and fails the handshake
// with SSL_R_HTTP_REQUEST, after which the library closes the connection without a word. This info callback runs as
// the failed handshake exits and answers in plain text instead, on the still open socket, saying what to use.
void AnswerPlainHttp(const SSL* ssl, int where, int ret) {
  if ((where & SSL_CB_ACCEPT_EXIT) == 0 || ret > 0) return;
  const auto http_request = [](unsigned long err) {
    return ERR_GET_LIB(err) == ERR_LIB_SSL && ERR_GET_REASON(err) == SSL_R_HTTP_REQUEST;
  };
  if (!http_request(ERR_peek_error()) && !http_request(ERR_peek_last_error())) return;
  const int fd = SSL_get_fd(ssl);
  if (fd < 0) return;
  // The rest of the request, as far as it has arrived (the socket is non-blocking): closing with unread bytes would
  // reset the connection before the client reads the answer.
  char sink[4096];
  while (recv(fd, sink, sizeof(sink), MSG_DONTWAIT) > 0) {
  }
  static const std::string kBody =
      "This is the wsync coordinator's status page over TLS: open it as https:// with a client certificate of the "
      "cluster CA (docs/operations.md, \"Status page\").\n";
  const std::string answer = absl::StrCat("HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n",
                                          "Content-Length: ", kBody.size(), "\r\nConnection: close\r\n\r\n", kBody);
  // A fresh connection's send buffer takes these few hundred bytes at once; a client that stalls gets none.
  if (send(fd, answer.data(), answer.size(), MSG_DONTWAIT | MSG_NOSIGNAL) > 0) shutdown(fd, SHUT_WR);
}

absl::Status Authorize(const httplib::Request& req) {
  if (!tls::Enabled()) return absl::OkStatus();
  if (req.ssl == nullptr) return absl::PermissionDeniedError("the status page is served over TLS only");
  if (SSL_get_verify_result(req.ssl) != X509_V_OK)
    return absl::PermissionDeniedError("the client certificate does not verify against the cluster CA");
  OsslPtr<X509> peer(SSL_get1_peer_certificate(req.ssl), X509_free);
  if (peer == nullptr) return absl::PermissionDeniedError("no client certificate");
  char cn[256] = {0};
  X509_NAME_get_text_by_NID(X509_get_subject_name(peer.get()), NID_commonName, cn, sizeof(cn));
  std::string role, id;
  const std::vector<std::string> roles = tls::AllRoles();
  if (!tls::ParseCommonName(cn, &role, &id) || std::find(roles.begin(), roles.end(), role) == roles.end())
    return absl::PermissionDeniedError(absl::StrCat("the status page refused certificate CN \"", cn,
                                                    "\": not a wsync identity (roles: ", absl::StrJoin(roles, ", "),
                                                    ")"));
  return absl::OkStatus();
}

int UpdatesAsked(const httplib::Request& req) {
  int n = kDefaultUpdates;
  if (req.has_param("n") && !absl::SimpleAtoi(req.get_param_value("n"), &n)) n = kDefaultUpdates;
  return std::clamp(n, 1, kMaxUpdates);
}

std::vector<v1::UpdateRecord> Records(const v1::HistoryReply& h) { return {h.records().begin(), h.records().end()}; }

}  // namespace

std::string StatusPageHtml(const v1::ClusterStatus& status, const v1::HistoryReply& history, absl::Time now) {
  std::string out =
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><meta http-equiv=\"refresh\" content=\"10\">"
      "<title>wsync coordinator</title><style>"
      "body{font-family:sans-serif;font-size:14px;margin:16px;color:#222}"
      "table{border-collapse:collapse;margin:6px 0 16px}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}"
      "th{background:#eee}.ready{color:#1e8449}.stale{color:#b9770e}.paused,.failed{color:#c0392b}"
      "</style></head><body>\n";
  absl::StrAppend(&out, "<h1>wsync coordinator</h1>\n<p id=\"headline\">state <b>", XmlEscape(status.state()),
                  "</b> &middot; current version <b>",
                  XmlEscape(status.current_version().empty() ? "none" : status.current_version()),
                  "</b> &middot; membership epoch ", status.membership_epoch(), " &middot; plan epoch ",
                  status.plan_epoch());
  if (status.open_version() >= 0) absl::StrAppend(&out, " &middot; update ", status.open_version(), " open");
  if (status.failed_version() >= 0)
    absl::StrAppend(&out, "<br><span class=\"failed\">update ", status.failed_version(),
                    " failed: ", XmlEscape(status.failure()), "</span>");
  if (status.engines_hold_partial_writes())
    absl::StrAppend(&out,
                    "<br><span class=\"failed\">engines may hold partial writes: they stay paused until an "
                    "update completes</span>");
  absl::StrAppend(&out, "<br><small>", XmlEscape(status.server_version()), " &middot; as of ",
                  absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", now, absl::UTCTimeZone()), "</small></p>\n");

  absl::StrAppend(&out,
                  "<h2>Membership</h2>\n<table id=\"nodes\"><tr><th>node</th><th>role</th><th>address</th>"
                  "<th>transport</th><th>lease</th><th>engines</th></tr>\n");
  for (const auto& n : status.nodes()) {
    const std::string lease =
        n.last_heartbeat_seconds_ago() < 0
            ? (n.reachable() ? "current" : "none yet")
            : absl::StrFormat("%s, %.1f s ago", n.reachable() ? "current" : "LOST", n.last_heartbeat_seconds_ago());
    absl::StrAppend(&out, "<tr>", Cell(n.node_id()), Cell(n.role()), Cell(n.address()), Cell(n.transport()),
                    Cell(lease), Cell(absl::StrJoin(n.engines(), ", ")), "</tr>\n");
  }
  absl::StrAppend(&out, "</table>\n");

  absl::StrAppend(&out,
                  "<h2>Engines</h2>\n<table id=\"engines\"><tr><th>engine</th><th>node</th><th>version</th>"
                  "<th>staged</th><th>readiness</th><th>coordinator's view</th></tr>\n");
  const v1::EngineStates states = EngineStatesOf(status);
  for (const auto& e : states.engines()) {
    const std::string r = Readiness(e);
    absl::StrAppend(&out, "<tr data-engine=\"", XmlEscape(e.engine_id()), "\">", Cell(e.engine_id()), Cell(e.node_id()),
                    Cell(e.weight_version()), Cell(e.staged_version()), "<td class=\"", r == "not ready" ? "paused" : r,
                    "\">", r, "</td>", Cell(e.state()), "</tr>\n");
  }
  absl::StrAppend(&out, "</table>\n");

  absl::StrAppend(&out, "<h2>Last ", history.records_size(), " updates</h2>\n<div id=\"timeline\">",
                  TimelineSvg(Records(history)), "</div>\n</body></html>\n");
  return out;
}

absl::StatusOr<std::unique_ptr<StatusPageServer>> StatusPageServer::Start(const std::string& listen,
                                                                          StatusPageSource source) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("--http-listen '", listen, "' is not HOST:PORT"));
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  std::unique_ptr<StatusPageServer> s(new StatusPageServer());
  const bool secure = tls::Enabled();
  if (secure) {
    auto ssl = std::make_unique<httplib::SSLServer>([](SSL_CTX& ctx) {
      SSL_CTX_set_min_proto_version(&ctx, TLS1_2_VERSION);
      // A client certificate of the CA is required, as by the gRPC API: no certificate, no handshake.
      SSL_CTX_set_verify(&ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
      SSL_CTX_set_cert_cb(&ctx, &UseCurrentCredentials, nullptr);
      SSL_CTX_set_info_callback(&ctx, &AnswerPlainHttp);
      return true;
    });
    if (!ssl->is_valid()) return absl::InternalError("--http-listen: cannot set up the TLS context");
    s->server_ = std::move(ssl);
  } else {
    s->server_ = std::make_unique<httplib::Server>();
  }
  httplib::Server& srv = *s->server_;
  // SO_REUSEADDR only: the library's default also sets SO_REUSEPORT, which would let a second process share the port.
  srv.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Bounded: GET only (no body), short timeouts, few requests per connection (the library's pool has few threads).
  srv.set_payload_max_length(4096);
  srv.set_read_timeout(5, 0);
  srv.set_write_timeout(5, 0);
  srv.set_keep_alive_max_count(20);
  auto shared = std::make_shared<StatusPageSource>(std::move(source));
  // Answers with the page from `render`, after the role check and the leader gate.
  auto serve = [shared](const char* type, std::function<std::string(const httplib::Request&)> render) {
    return [shared, type, render](const httplib::Request& req, httplib::Response& res) {
      if (absl::Status a = Authorize(req); !a.ok()) {
        spdlog::warn("status page: {} from {}", std::string(a.message()), req.remote_addr);
        res.status = 403;
        res.set_content(absl::StrCat(a.message(), "\n"), "text/plain");
        return;
      }
      if (shared->ready) {
        if (absl::Status r = shared->ready(); !r.ok()) {
          res.status = 503;
          res.set_content(absl::StrCat(r.message(), "\n"), "text/plain");
          return;
        }
      }
      res.set_header("Cache-Control", "no-store");
      res.set_content(render(req), type);
    };
  };
  srv.Get("/", serve("text/html; charset=utf-8", [shared](const httplib::Request& req) {
            return StatusPageHtml(shared->status(), shared->history(UpdatesAsked(req)), absl::Now());
          }));
  srv.Get("/timeline.svg", serve("image/svg+xml", [shared](const httplib::Request& req) {
            return TimelineSvg(Records(shared->history(UpdatesAsked(req))));
          }));
  s->port_ = port == 0 ? srv.bind_to_any_port(host) : (srv.bind_to_port(host, port) ? port : -1);
  if (s->port_ <= 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", listen, " for the status page"));
  httplib::Server* raw = s->server_.get();
  s->thread_ = std::thread([raw] { raw->listen_after_bind(); });
  spdlog::info("status page on {}://{}:{}/", secure ? "https" : "http", host, s->port_);
  return s;
}

StatusPageServer::~StatusPageServer() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace wsync::daemon
