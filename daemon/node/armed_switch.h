// A staged switch in two calls: PrepareSwitch re-hashes the staging memory while the engine still serves and
// arms the switch; the switch itself, inside the paused window, then swaps without hashing again
// (docs/operations.md, "Staged updates"; docs/security.md, "Staged updates: what the switch checks").
#ifndef WSYNC_DAEMON_NODE_ARMED_SWITCH_H_
#define WSYNC_DAEMON_NODE_ARMED_SWITCH_H_

#include <optional>
#include <string>
#include <vector>

#include "wsync/v1/engine.pb.h"

namespace wsync::daemon {

// What a successful prepare checked: the version and the per-rank digests its staging memory hashed to, and which
// copy was the staging one (an engine with two copies; 0 for one that stages in place).
struct ArmedSwitch {
  std::string version;
  std::vector<std::string> digests;
  int staging_set = 0;
};

inline ArmedSwitch ArmFrom(const v1::SwitchRequest& req, int staging_set) {
  ArmedSwitch a;
  a.version = req.version();
  a.digests.assign(req.staging_digests().begin(), req.staging_digests().end());
  a.staging_set = staging_set;
  return a;
}

// Decides whether a switch may skip its re-hash: only when the prepare just before it checked exactly
// this version, these digests and this staging copy. Anything else (no prepare, another version or digest, a copy
// swapped since) hashes again, as a switch without a prepare always did.
inline bool SwitchMaySkipRehash(const std::optional<ArmedSwitch>& armed, const v1::SwitchRequest& req,
                                int staging_set) {
  if (!armed || armed->version != req.version() || armed->staging_set != staging_set) return false;
  if (static_cast<int>(armed->digests.size()) != req.staging_digests_size()) return false;
  for (int i = 0; i < req.staging_digests_size(); ++i)
    if (armed->digests[static_cast<size_t>(i)] != req.staging_digests(i)) return false;
  return true;
}

}  // namespace wsync::daemon

#endif  // WSYNC_DAEMON_NODE_ARMED_SWITCH_H_
