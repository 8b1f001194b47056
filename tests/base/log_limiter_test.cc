// LogLimiter: one line per key per interval, the count left out carried to the next line, bounded memory.

#include "base/log_limiter.h"

#include <catch2/catch.hpp>

namespace wsync {
namespace {

TEST_CASE("log limiter: one line per key per interval, with the count left out since the previous one") {
  LogLimiter lim(absl::Minutes(1));
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  CHECK(lim.Admit("10.0.0.1", t0) == std::optional<uint64_t>(0));
  for (int i = 0; i < 1000; ++i) CHECK_FALSE(lim.Admit("10.0.0.1", t0 + absl::Seconds(i % 59)).has_value());
  // Another peer is not silenced by the first one.
  CHECK(lim.Admit("10.0.0.2", t0 + absl::Seconds(1)) == std::optional<uint64_t>(0));
  // A minute after its previous line the key logs again, reporting the 1000 left out.
  CHECK(lim.Admit("10.0.0.1", t0 + absl::Seconds(60)) == std::optional<uint64_t>(1000));
  CHECK_FALSE(lim.Admit("10.0.0.1", t0 + absl::Seconds(61)).has_value());
  CHECK(lim.Admit("10.0.0.1", t0 + absl::Seconds(121)) == std::optional<uint64_t>(1));
}

TEST_CASE("log limiter: many keys share one slot beyond the bound; stale keys are forgotten") {
  LogLimiter lim(absl::Minutes(1), /*max_keys=*/3);
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  CHECK(lim.Admit("a", t0).has_value());
  CHECK(lim.Admit("b", t0).has_value());
  CHECK(lim.Admit("c", t0).has_value());
  // Full and nothing stale: new keys share the overflow slot, so only the first of them logs.
  CHECK(lim.Admit("d", t0 + absl::Seconds(1)) == std::optional<uint64_t>(0));
  CHECK_FALSE(lim.Admit("e", t0 + absl::Seconds(2)).has_value());
  CHECK_FALSE(lim.Admit("f", t0 + absl::Seconds(3)).has_value());
  // Once the interval passed, stale keys make room again.
  CHECK(lim.Admit("g", t0 + absl::Seconds(120)) == std::optional<uint64_t>(0));
  CHECK_FALSE(lim.Admit("g", t0 + absl::Seconds(121)).has_value());
}

}  // namespace
}  // namespace wsync
