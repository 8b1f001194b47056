#pragma once
// The coordinator's side of relay trees (issue 41, docs/planner.md "The relay data path"). Decided apart from the
// coordinator: WireRelays turns a direct plan into a relayed one (the sources keep their assignments to each
// group's root only, marked relay_root; every other engine rank gets one assignment whose "source" is its parent
// relay's node, so its write window and grant name the relay) and says which engine relays to which. Applied with
// two calls: StartRelays (after the write windows opened, before the sources start) hands every member its
// children; DrainRelays (after the sources finished, before the windows close) waits until every member has
// checked and forwarded everything.
//
// Threading: WireRelays is pure; StartRelays and DrainRelays block on RPCs to the target daemons (no lock held).

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/mutex.h"
#include "daemon/coordinator/replan.h"
#include "planner/cluster.h"
#include "planner/relay.h"
#include "planner/relay_shape.h"
#include "wsync/v1/daemon.pb.h"

// Runs `stmt` holding `mu` (one line of the coordinator reads its relay wiring with it).
#define WSYNC_UNDER(mu, stmt) \
  do {                        \
    MutexLock l_(&(mu));      \
    stmt;                     \
  } while (0)

namespace wsync::daemon {

// One engine of a relay tree.
struct RelayMember {
  std::string engine_id;
  std::string node_id;          // its target daemon's node id
  std::string address;          // its target daemon
  std::string parent;           // engine id of its relay ("": the group's root, written by the sources)
  v1::SetRelayRequest request;  // its children; the version is set per update
};

struct RelayWiring {
  std::vector<RelayMember> members;  // every engine of every relayed group, roots first per group
  std::vector<std::string> why;      // per group not relayed: why (logged)
  bool relayed() const { return !members.empty(); }
};

// Rewrites `plan` (the direct plan of `groups`) for `options` and answers the trees. kOff leaves it untouched. A
// group is relayed when it has two engines or more and every engine's rank layouts hold the same parameters at the
// same places in host memory. kAuto decides per group with the link-rate model (planner/relay_shape.h,
// ChooseRelayShape on GroupRelayLinks): the degree it predicts fastest, or direct (the group not relayed) when no
// tree beats it. `nic`: every node's NICs (the coordinator's --nic; its default 1x400Gbps). Pure.
RelayWiring WireRelays(const planner::RelayOptions& options, const std::map<std::string, GroupPlan>& groups,
                       std::vector<PlannedAssignment>* plan, const planner::NicSpec& nic = planner::NicSpec{1, 400.0});

// What ChooseRelayShape needs of one group, read off the direct plan: one copy's bytes (the root's ranks), the
// members, the source nodes writing the group (x NICs per node), the NICs the root's ranks use on their nodes (a
// rank per NIC up to nic.per_node per node) and how many of its ranks share one. Pure.
planner::RelayLinks GroupRelayLinks(const std::vector<std::string>& members, const std::vector<PlannedAssignment>& plan,
                                    const planner::NicSpec& nic, const planner::RelayOptions& options);

// A tree without the members whose target daemons died (`dead`, engine ids; docs/planner.md "A relay that dies"):
// every live member's parent becomes its nearest live ancestor, which takes it as a child after its own. Pure.
struct RelayReroute {
  RelayWiring wiring;                          // the live members, re-wired (their requests' children replaced)
  std::map<std::string, std::string> adopted;  // re-parented engine → its new parent engine
  std::vector<std::string> changed;            // live members whose children changed (told with SetRelay adopt)
  // Why the tree cannot be routed around ("" when it can): a dead root's children have no live ancestor, and the
  // sources write only the roots within an update.
  std::string impossible;
};
RelayReroute RerouteRelays(const RelayWiring& wiring, const std::set<std::string>& dead);

// The members of `wiring` whose target daemons do not answer (GetNodeStatus within `timeout_s`: unreachable or
// silent), by engine id; all asked at once.
std::set<std::string> DeadRelays(const RelayWiring& wiring, double timeout_s);
inline constexpr double kRelayProbeSeconds = 3;  // DeadRelays' wait on each member

// SetRelay on every member for update `version`, all at once; the first error names the member.
absl::Status StartRelays(const RelayWiring& wiring, int64_t version);
// RelayDrain on every member, all at once, each bounded by `timeout_s`; the first error names the member (a relay
// that failed, or did not get or forward everything).
absl::Status DrainRelays(const RelayWiring& wiring, int64_t version, double timeout_s);
// SetRelay with `adopt` on each member of `reroute.changed`: its new children, everything landed forwarded again.
absl::Status AdoptRelays(const RelayReroute& reroute, int64_t version);

}  // namespace wsync::daemon
