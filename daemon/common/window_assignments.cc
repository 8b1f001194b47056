#include "daemon/common/window_assignments.h"

#include <xxhash.h>

#include <cstdio>
#include <memory>

namespace wsync::daemon {
namespace {

void Add(XXH3_state_t* st, const std::string& s) {
  const uint64_t n = s.size();  // length-prefixed: no two different lists hash the same bytes
  XXH3_128bits_update(st, &n, sizeof(n));
  XXH3_128bits_update(st, s.data(), s.size());
}

void Add(XXH3_state_t* st, uint64_t v) { XXH3_128bits_update(st, &v, sizeof(v)); }

}  // namespace

std::string WindowAssignmentsDigest(const google::protobuf::RepeatedPtrField<v1::WindowAssignment>& assignments) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(), &XXH3_freeState);
  if (state == nullptr) return std::string();  // never named as held: the assignments are always sent
  XXH3_state_t* st = state.get();
  XXH3_128bits_reset(st);
  Add(st, static_cast<uint64_t>(assignments.size()));
  for (const auto& a : assignments) {
    Add(st, a.source_node());
    Add(st, a.engine_id());
    Add(st, static_cast<uint64_t>(static_cast<int64_t>(a.rank())));
    Add(st, static_cast<uint64_t>(a.writes_size()));
    for (const auto& w : a.writes()) {
      Add(st, w.param());
      Add(st, w.offset());
      Add(st, w.length());
    }
  }
  const XXH128_hash_t h = XXH3_128bits_digest(st);
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return hex;
}

WindowAssignmentsAction DecideWindowAssignments(const v1::SetWriteWindowRequest& req, const std::string& held_digest) {
  if (!req.open() || !req.assignments_given()) return WindowAssignmentsAction::kNone;
  if (!req.assignments_held()) return WindowAssignmentsAction::kTake;
  // An empty digest names nothing: a request naming "" is never taken as naming a target that holds none.
  if (!held_digest.empty() && held_digest == req.assignments_digest()) return WindowAssignmentsAction::kKeep;
  return WindowAssignmentsAction::kMissing;
}

bool MayNameHeldAssignments(const v1::SetWriteWindowRequest& full, const std::string& acknowledged) {
  return full.open() && full.assignments_given() && !full.assignments_held() && !full.assignments_digest().empty() &&
         acknowledged == full.assignments_digest();
}

v1::SetWriteWindowRequest NamingHeldAssignments(const v1::SetWriteWindowRequest& full) {
  v1::SetWriteWindowRequest out;
  out.set_open(full.open());
  out.set_version(full.version());
  out.set_assignments_given(full.assignments_given());
  out.set_assignments_digest(full.assignments_digest());
  out.set_assignments_held(true);
  return out;
}

bool AssignmentsNeeded(const v1::SetWriteWindowRequest& sent, const v1::SetWriteWindowReply& reply) {
  return sent.assignments_held() &&
         (reply.assignments_missing() || reply.assignments_digest() != sent.assignments_digest());
}

}  // namespace wsync::daemon
