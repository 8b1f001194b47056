#pragma once
// The timeline of updates as SVG: the coordinator's status page (status_page.h) and `wsyncctl history --plot` draw
// the same picture from the same history records (docs/operations.md, "Status page").
//
// Per update, one row of its phases (pause, configure, push, post_process, ...), one row per source node (its push,
// with bytes and rate) and one row per engine (each of its calls, from the phase's start to when it answered). Bar
// widths are proportional to durations on a time axis scaled per update. Every bar is a <rect class="phase"> with
// data-version, data-row and data-phase attributes and a <title> (the tooltip browsers show), so tests and tools read
// the drawing without parsing geometry. Every text that comes from the cluster (node and engine ids, errors) is
// escaped.
//
// Everything here is pure (no clock, no I/O) and thread-compatible.

#include <map>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "wsync/v1/coordinator.pb.h"
#include "wsync/v1/daemon.pb.h"

namespace wsync::daemon {

struct TimelineOptions {
  double width = 1000;  // px of the whole drawing
};

// The SVG document (standalone: an <svg> root with its namespace, usable inline in HTML too). No records: a drawing
// that says so.
std::string TimelineSvg(const std::vector<v1::UpdateRecord>& records, const TimelineOptions& options = {});

// `s` with &, <, >, " and ' escaped for XML text and attribute values; other control characters dropped (XML 1.0
// cannot carry them).
std::string XmlEscape(absl::string_view s);

// One engine's call of one phase, as the coordinator saw it end.
struct EngineCallEnd {
  std::string address;  // the engine's control address
  std::string phase;
  absl::Time end;
  bool ok = true;
};

// Adds `rec`'s engine_phases: each call starts when its phase started (`rec.phases`, start_seconds) and ends at
// `end`; engine ids from `engine_ids` (control address -> engine id; an address not in it is named as is). Calls of
// a phase the record does not hold are left out. A record is stored whole (one state-store value), so it keeps the
// calls of at most `max_engines` engines: those whose last call ended latest (where the update waited).
void AddEnginePhases(v1::UpdateRecord* rec, const std::vector<EngineCallEnd>& ends,
                     const std::map<std::string, std::string>& engine_ids, int max_engines = 64);

// Adds `rec`'s source_pushes: one per finished source (node id from `node_ids`, source address -> node id), from the
// push phase's start (`push_start`) until its FinishUpdate answered (`done`).
void AddSourcePushes(v1::UpdateRecord* rec, const std::vector<std::pair<std::string, v1::FinishUpdateReply>>& finished,
                     const std::map<std::string, absl::Time>& done, const std::map<std::string, std::string>& node_ids,
                     absl::Time push_start);

}  // namespace wsync::daemon
