#pragma once
// The plan's write-window assignments, kept by a target daemon between updates (docs/operations.md, "Write
// windows"): the coordinator sends a target its assignments once per plan and afterwards names them by digest. The
// digest and both sides' decisions are here, so that the coordinator and the target compute the same thing.

#include <string>

#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon {

// Hex XXH3-128 of `assignments` in order, every field length-prefixed: equal lists give equal digests in every
// process. Not a security measure (only the coordinator may open a window): it tells a target that holds the
// plan's assignments from one that does not.
std::string WindowAssignmentsDigest(const google::protobuf::RepeatedPtrField<v1::WindowAssignment>& assignments);

// What a target does with the assignments of a SetWriteWindow request.
enum class WindowAssignmentsAction {
  kNone,     // a close, or an older coordinator's open without assignments (grants are not narrowed)
  kTake,     // the request carries them: they replace what the target holds
  kKeep,     // the request names the ones the target holds
  kMissing,  // the request names assignments the target does not hold: change nothing, answer assignments_missing
};
// `held_digest`: the digest of the assignments the target holds, "" when it holds none.
WindowAssignmentsAction DecideWindowAssignments(const v1::SetWriteWindowRequest& req, const std::string& held_digest);

// Coordinator: whether the open request `full` (the plan's assignments and their digest) may go without them to a
// target whose last answer said it holds `acknowledged`.
bool MayNameHeldAssignments(const v1::SetWriteWindowRequest& full, const std::string& acknowledged);
// `full` without its assignments, naming them by their digest (assignments_held).
v1::SetWriteWindowRequest NamingHeldAssignments(const v1::SetWriteWindowRequest& full);
// Whether `reply` to `sent` means the target does not hold what `sent` named: the assignments must be sent.
bool AssignmentsNeeded(const v1::SetWriteWindowRequest& sent, const v1::SetWriteWindowReply& reply);

}  // namespace wsync::daemon
