#include "daemon/common/engine_adapter.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/engines/reference_adapter.h"
#include "daemon/common/engines/sglang_adapter.h"
#include "daemon/common/engines/vllm_adapter.h"

namespace wsync::daemon {
namespace {

// "HOST:PORT" with a non-empty host and a port in [1, 65535].
bool IsHostPort(absl::string_view hp) {
  const size_t colon = hp.rfind(':');
  if (colon == absl::string_view::npos || colon == 0) return false;
  int port = 0;
  return absl::SimpleAtoi(hp.substr(colon + 1), &port) && port > 0 && port < 65536 &&
         hp.find_first_of("/?# ") == absl::string_view::npos;
}

}  // namespace

absl::StatusOr<std::unique_ptr<EngineAdapter>> MakeEngineAdapter(const std::string& address,
                                                                 absl::Duration call_timeout) {
  const size_t scheme_end = address.find("://");
  if (scheme_end == std::string::npos) {
    if (!IsHostPort(address))
      return absl::InvalidArgumentError(
          absl::StrCat("engine address '", address, "' is neither KIND+SCHEME://HOST:PORT nor HOST:PORT"));
    return MakeReferenceAdapter(address, address, call_timeout);
  }
  const std::string scheme = address.substr(0, scheme_end);
  const size_t plus = scheme.find('+');
  if (plus == std::string::npos)
    return absl::InvalidArgumentError(
        absl::StrCat("engine address '", address, "' names no engine kind (expected KIND+SCHEME://...)"));
  const std::string kind = scheme.substr(0, plus);
  const std::string rest = address.substr(plus + 1);  // "SCHEME://..."
  if (kind == "reference") {
    const std::string hp = address.substr(scheme_end + 3);
    if (scheme.substr(plus + 1) != "grpc" || !IsHostPort(hp))
      return absl::InvalidArgumentError(
          absl::StrCat("engine address '", address, "': a reference engine is reference+grpc://HOST:PORT"));
    return MakeReferenceAdapter(address, hp, call_timeout);
  }
  if (kind == "vllm") return MakeVllmAdapter(rest, call_timeout);
  if (kind == "sglang") return MakeSglangAdapter(rest, call_timeout);
  return absl::InvalidArgumentError(absl::StrCat("engine address '", address, "': unknown engine kind '", kind,
                                                 "' (known: reference, vllm, sglang)"));
}

}  // namespace wsync::daemon
