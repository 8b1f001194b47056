#pragma once
// wsyncctl's output and error helpers that need no server: proto messages as JSON with numbers as numbers, and what a
// failed connection means for the user (a hint, and an exit code that tells a configuration error from an outage).

#include <string>

#include "absl/status/status.h"
#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"

namespace wsync::tools {

// Every field, default-valued ones included, under its proto name; 64-bit integers as JSON numbers (proto3 JSON
// writes them as strings), so that every wsyncctl command prints a version, an epoch or a byte count the same way.
nlohmann::json ProtoToJson(const google::protobuf::Message& m);

// What answers on a TCP endpoint, found by ProbeEndpoint (act) and used by DescribeCallError (decide).
enum class EndpointProbe {
  kNotProbed,    // not asked (the call did not fail for want of a connection)
  kRefused,      // nothing listens (connection refused, no route, timeout)
  kPlaintext,    // an HTTP/2 server without TLS answered
  kTlsRequired,  // the server closed the plaintext connection or answered with TLS: it wants a TLS client
  kHttp1,        // an HTTP/1.x server answered (e.g. a --metrics-listen or --http-listen port): not gRPC at all
};

// Connects to host:port and sends an HTTP/2 preface without TLS; classifies the answer within `timeout_ms`.
EndpointProbe ProbeEndpoint(const std::string& endpoint, int timeout_ms);

struct CallError {
  std::string message;  // one line for the user: what happened and what to do
  int exit_code;        // base/cli.h: 2 configuration or usage (retrying will not help), 3 unavailable, 1 otherwise
};

// Turns a failed call to `endpoint` into a message and exit code. `tls` says whether this client used TLS, `flag`
// names the option that set the endpoint ("--endpoints" for the coordinator), `probe` what ProbeEndpoint found when
// the call could not connect.
CallError DescribeCallError(const absl::Status& status, const std::string& endpoint, bool tls, const std::string& flag,
                            EndpointProbe probe);

// True when `status` is a failure to reach or handshake with the peer (worth a ProbeEndpoint).
bool IsConnectionFailure(const absl::Status& status);

}  // namespace wsync::tools
