#pragma once
// What the transport benches share: exit-on-error unwrapping, a connected endpoint pair, positive-integer flags.
// Header-only, for bench programs (they print and exit; nothing here returns an error).

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace wsync::bench {

template <typename T>
T Must(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, v.status().ToString().c_str());
    std::exit(1);
  }
  return std::move(*v);
}
inline void Must(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

struct Pair {
  std::unique_ptr<transport::Endpoint> src, dst;
};

// A source endpoint of `source` connected to an endpoint of `target` (a granted one when `grant` is given).
inline Pair Connect(transport::Transport& source, transport::Transport& target,
                    const transport::Transport::WriteGrant* grant = nullptr,
                    absl::Duration timeout = absl::Seconds(30)) {
  Pair p{Must(source.CreateEndpoint(), "endpoint"),
         grant ? Must(target.CreateGrantedEndpoint(*grant), "granted endpoint")
               : Must(target.CreateEndpoint(), "endpoint")};
  Must(p.src->Connect(p.dst->LocalInfo(), timeout), "connect");
  Must(p.dst->Connect(p.src->LocalInfo(), timeout), "connect");
  return p;
}

// `--name N` (a positive integer) from argv, else `def`; exits 2 on a bad value.
inline uint64_t Flag(int argc, char** argv, const char* name, uint64_t def) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) != 0) continue;
    uint64_t v = 0;
    if (!absl::SimpleAtoi(argv[i + 1], &v) || v == 0) {
      std::fprintf(stderr, "%s must be a positive integer, got '%s'\n", name, argv[i + 1]);
      std::exit(2);
    }
    return v;
  }
  return def;
}

}  // namespace wsync::bench
