#pragma once
// A decorator that injects transport faults for tests: it delegates every call to an inner Transport and makes
// chosen batches fail, so error paths above the transport (daemon recovery, coordinator abort) can be exercised
// against a real backend without any test-only code in the backends themselves.
//
// Faults are failures or delays, never silent corruption: a failed Post sends nothing; a failed Wait reports an error for a
// batch the inner transport may have delivered (as a real completion error can). After an injected error the
// endpoint behaves like a broken one: every later Post/Wait on it fails until it is re-created, as the transport
// contract requires of callers anyway.
//
// Batches are numbered 1, 2, ... in the order they are posted across all endpoints of one wrapped transport
// (a per-transport atomic counter), so a spec picks the same batch on every run of a deterministic workload.
// Regions are the inner transport's own (no wrapping), so requests built from them reach the inner endpoint as is.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace wsync::transport {

struct FaultSpec {
  uint64_t fail_post = 0;  // 1-based number of the batch whose Post fails (Unavailable, nothing sent); 0 = never
  uint64_t fail_wait = 0;  // 1-based number of the batch whose Wait fails (Unavailable); 0 = never
  // A slow link: each batch is handed to the inner transport `delay` after its Post, or after the previous batch of
  // its endpoint was handed on, whichever is later (one batch per `delay`). Post never sleeps (transport.h): the
  // batch waits inside the endpoint and the owner's Wait hands it on once due; CompletionFd (an epoll set of the
  // inner's fd, a timer for the next due batch and Cancel's eventfd) polls readable then. Cancel drops held batches
  // unsent.
  absl::Duration delay = absl::ZeroDuration();
  // Only the endpoints whose PeerName() contains this text are delayed (one slow target among several, e.g. its
  // "host:port"); empty: every endpoint. Failures stay counted over every endpoint whatever it says.
  std::string delay_peer;
  // A link whose pace varies: each delayed batch waits `delay` plus a random extra of up to `jitter` (uniform, in
  // microseconds), drawn from a generator seeded by `seed` and the endpoint's creation order, so a run repeats
  // exactly with the same seed. A jitter alone (delay 0) delays too.
  absl::Duration jitter = absl::ZeroDuration();
  uint64_t seed = 0;

  bool delays() const { return delay > absl::ZeroDuration() || jitter > absl::ZeroDuration(); }
  bool empty() const { return fail_post == 0 && fail_wait == 0 && !delays(); }
  // Canonical text form, parseable by ParseFaultSpec ("" for an empty spec).
  std::string ToString() const;
};

// Parses "key=value[,key=value...]" with keys fail_post, fail_wait (positive batch numbers), delay_ms and jitter_ms
// (non-negative milliseconds), seed (a non-negative integer, only with a jitter_ms above 0) and delay_peer
// (non-empty text, no comma; only with a delay_ms or jitter_ms above 0). Whitespace
// around items and values is ignored; "" is the empty spec. Unknown keys, repeated keys, missing or malformed
// values are InvalidArgument naming the offending item.
absl::StatusOr<FaultSpec> ParseFaultSpec(const std::string& text);

// Wraps `inner`. An empty spec gives a transparent wrapper. name(), viable() and reason() are the inner's.
std::unique_ptr<Transport> WrapWithFaults(std::unique_ptr<Transport> inner, FaultSpec spec);

}  // namespace wsync::transport
