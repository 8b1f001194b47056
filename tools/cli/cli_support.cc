#include "tools/cli/cli_support.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/cli.h"
#include "base/fd_passing.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"

namespace wsync::tools {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

std::string Base64(const std::string& in) {
  static const char* k = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    out += {k[v >> 18], k[(v >> 12) & 63], k[(v >> 6) & 63], k[v & 63]};
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out += {k[v >> 18], k[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out += {k[v >> 18], k[(v >> 12) & 63], k[(v >> 6) & 63], '='};
  }
  return out;
}

// One value of `f` (index < 0: the singular field).
nlohmann::json Value(const Message& m, const Reflection* r, const FieldDescriptor* f, int index) {
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f);
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f);
    case FieldDescriptor::CPPTYPE_ENUM:
      return (rep ? r->GetRepeatedEnum(m, f, index) : r->GetEnum(m, f))->name();
    case FieldDescriptor::CPPTYPE_STRING: {
      const std::string s = rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      return f->type() == FieldDescriptor::TYPE_BYTES ? nlohmann::json(Base64(s)) : nlohmann::json(s);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return ProtoToJson(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f));
  }
  return nullptr;
}

}  // namespace

nlohmann::json ProtoToJson(const Message& m) {
  nlohmann::json out = nlohmann::json::object();
  const auto* d = m.GetDescriptor();
  const Reflection* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const FieldDescriptor* f = d->field(i);
    if (f->is_map()) {
      // A map is a repeated entry message {key, value}; JSON object keys are strings.
      nlohmann::json obj = nlohmann::json::object();
      const FieldDescriptor* kf = f->message_type()->map_key();
      const FieldDescriptor* vf = f->message_type()->map_value();
      for (int j = 0; j < r->FieldSize(m, f); ++j) {
        const Message& entry = r->GetRepeatedMessage(m, f, j);
        const nlohmann::json key = Value(entry, entry.GetReflection(), kf, -1);
        obj[key.is_string() ? key.get<std::string>() : key.dump()] = Value(entry, entry.GetReflection(), vf, -1);
      }
      out[f->name()] = std::move(obj);
    } else if (f->is_repeated()) {
      nlohmann::json arr = nlohmann::json::array();
      for (int j = 0; j < r->FieldSize(m, f); ++j) arr.push_back(Value(m, r, f, j));
      out[f->name()] = std::move(arr);
    } else if (f->has_presence() && !r->HasField(m, f)) {
      continue;  // an unset message, oneof member or optional field: absent, as in proto JSON
    } else {
      out[f->name()] = Value(m, r, f, -1);
    }
  }
  return out;
}

EndpointProbe ProbeEndpoint(const std::string& endpoint, int timeout_ms) {
  const size_t colon = endpoint.rfind(':');
  if (colon == std::string::npos) return EndpointProbe::kRefused;
  std::string host = endpoint.substr(0, colon);
  const std::string port = endpoint.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &res) != 0 || res == nullptr) return EndpointProbe::kRefused;
  ScopedFd fd(socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  const int rc = fd.valid() ? connect(fd.get(), res->ai_addr, res->ai_addrlen) : -1;
  const int connect_errno = errno;
  freeaddrinfo(res);
  if (!fd.valid() || (rc != 0 && connect_errno != EINPROGRESS)) return EndpointProbe::kRefused;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  auto wait = [&](short events) {
    const int left = static_cast<int>(
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
    pollfd p{fd.get(), events, 0};
    return left > 0 && poll(&p, 1, left) == 1 ? p.revents : 0;
  };
  if (!(wait(POLLOUT) & POLLOUT)) return EndpointProbe::kRefused;
  int err = 0;
  socklen_t len = sizeof(err);
  if (getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) return EndpointProbe::kRefused;
  // The HTTP/2 client preface and an empty SETTINGS frame: a plaintext gRPC server answers with its SETTINGS frame
  // (frame type 4 in the fourth byte); a TLS server cannot parse it and closes, or answers with a TLS alert record.
  static const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
  if (send(fd.get(), kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL) < 0) return EndpointProbe::kTlsRequired;
  unsigned char buf[16];
  size_t got = 0;
  while (got < 4) {
    if (!(wait(POLLIN) & (POLLIN | POLLHUP | POLLERR))) break;
    const ssize_t n = recv(fd.get(), buf + got, sizeof(buf) - got, 0);
    if (n <= 0) return EndpointProbe::kTlsRequired;  // closed or reset on a plaintext preface
    got += static_cast<size_t>(n);
  }
  if (got == 0) return EndpointProbe::kRefused;  // accepted but silent: not something we can name
  // An HTTP/1.x server (metrics, status page) answers the preface's request line with its own status line.
  if (got >= 4 && std::string(reinterpret_cast<const char*>(buf), 4) == "HTTP") return EndpointProbe::kHttp1;
  if (buf[0] == 0x15 || buf[0] == 0x16) return EndpointProbe::kTlsRequired;  // TLS alert or handshake record
  return got >= 4 && buf[3] == 0x04 ? EndpointProbe::kPlaintext : EndpointProbe::kTlsRequired;
}

bool IsConnectionFailure(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded ||
         absl::StrContains(s.message(), "handshake") || absl::StrContains(s.message(), "SSL");
}

CallError DescribeCallError(const absl::Status& s, const std::string& endpoint, bool tls, const std::string& flag,
                            EndpointProbe probe) {
  const std::string msg(s.message());
  const std::string env = flag == "--endpoints" ? " or WSYNC_COORDINATOR" : "";
  const std::string certs =
      "--tls-ca/--tls-cert/--tls-key or WSYNC_TLS_CA/WSYNC_TLS_CERT/WSYNC_TLS_KEY (docs/security.md; "
      "tools/cli/wsync-certs.sh makes test ones)";
  if (absl::StrContains(msg, "CERTIFICATE_VERIFY_FAILED") || absl::StrContains(msg, "certificate verify failed"))
    return {absl::StrCat("TLS: the certificate of ", endpoint,
                         " is not signed by the CA this client trusts (--tls-ca / WSYNC_TLS_CA)"),
            cli::kExitUsage};
  if (absl::StrContains(msg, "Peer name") && absl::StrContains(msg, "not in peer certificate"))
    return {absl::StrCat("TLS: the certificate of ", endpoint,
                         " does not name that address in its subjectAltName (dial the name it was issued for)"),
            cli::kExitUsage};
  if (absl::StrContains(msg, "ALERT_UNKNOWN_CA") || absl::StrContains(msg, "ALERT_BAD_CERTIFICATE") ||
      absl::StrContains(msg, "ALERT_CERTIFICATE_REQUIRED"))
    return {absl::StrCat("TLS: ", endpoint,
                         " refused this client's certificate (is it signed by the CA the server trusts?)"),
            cli::kExitUsage};
  if (probe == EndpointProbe::kHttp1)
    return {absl::StrCat(endpoint,
                         " answers HTTP/1.1, not gRPC: is that a --metrics-listen or --http-listen port? Give the "
                         "gRPC address (the server's --listen; a coordinator's is port 7600 by default) with ",
                         flag, env),
            cli::kExitUsage};
  if (probe == EndpointProbe::kTlsRequired && !tls)
    return {absl::StrCat(endpoint, " requires TLS: a client certificate is required (", certs, ")"), cli::kExitUsage};
  if (probe == EndpointProbe::kTlsRequired && tls)
    return {absl::StrCat(endpoint,
                         " closed the TLS connection: it did not accept this client's certificate (signed by a CA it "
                         "does not trust?)"),
            cli::kExitUsage};
  if (probe == EndpointProbe::kPlaintext && tls)
    return {absl::StrCat(endpoint, " serves without TLS, but this client was given TLS files (", certs,
                         "): drop them or give the server TLS"),
            cli::kExitUsage};
  if (probe == EndpointProbe::kRefused)
    return {absl::StrCat("cannot reach ", endpoint,
                         " (nothing answers there): is it running, and is that its "
                         "address? Set it with ",
                         flag, env),
            cli::kExitUnavailable};
  if (s.code() == absl::StatusCode::kUnavailable || s.code() == absl::StatusCode::kDeadlineExceeded)
    return {absl::StrCat(s.ToString(), " (endpoint ", endpoint, "; set it with ", flag, env, ")"),
            cli::kExitUnavailable};
  return {s.ToString(), s.code() == absl::StatusCode::kInvalidArgument ? cli::kExitUsage : cli::kExitFailure};
}

}  // namespace wsync::tools
