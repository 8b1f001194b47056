#pragma once
// The digest of a source's configuration: one function for both sides, so that a source's heartbeat (what it
// applied) and the coordinator (what it planned for that source) compare the same thing.

#include <string>

#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon {

// Hex XXH3-128 of `req`'s deterministic serialization with plan_epoch cleared (the epoch travels on its own): equal
// requests give equal digests in every process of the same protocol version. Not a security measure: it tells a
// source that lost or never applied its configuration from one that holds it.
std::string ConfigureSourceDigest(const v1::ConfigureSourceRequest& req);

}  // namespace wsync::daemon
