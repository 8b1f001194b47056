#pragma once
// Testing aid shared by the reference engine (tools/testing/engine_ref/ref_faults.h) and the node daemon
// (daemon/node/node_services.cc): calls that fail or hang on demand, so that a test injects a fault at one named
// phase of an update and acts when the process reaches it (tests/daemon/fault_matrix_real_test.py).
//
// The environment variable the owner names (WSYNC_REF_FAULTS_FILE, WSYNC_DAEMON_FAULTS_FILE) names a file read at
// the start of each hooked call. Each line is "ID CALL ACTION [TAG]": ID is the process's id (an engine's, a node's)
// or "*", ACTION is
//   error  the call fails (Internal, "injected fault at CALL");
//   hang   the call blocks until its caller gives up (deadline, cancellation, the caller's process gone) or
//          kHangBound passed; it then fails (Cancelled).
// When a rule fires, "<who> reached CALL (ACTION)" is logged before acting (who: e.g. "ref_fault: engine e1"): the
// event a test waits for. A rule fires once per content of the file (write the file again, e.g. with a new TAG, to
// re-arm), so the caller's own recovery calls are not failed too. No variable, no file, or an empty file: no faults,
// one open per call.

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "base/mutex.h"

namespace wsync {

class FaultKnob {
 public:
  static constexpr absl::Duration kHangBound = absl::Minutes(10);

  // Reads the file's name from `env_var` (and warns once that faults are armed); `id` selects this process's rules;
  // `who` starts the log line of a fired rule.
  FaultKnob(const char* env_var, std::string id, std::string who);
  // At the start of call `call`: OK to go on, or the injected failure (after the hang, if one was asked).
  // `cancelled` says whether the caller gave up (e.g. ServerContext::IsCancelled). Thread-safe; blocks only on hang.
  absl::Status At(absl::string_view call, const std::function<bool()>& cancelled);

 private:
  std::string id_;
  std::string who_;
  std::string path_;
  Mutex mu_;
  std::string fired_ ABSL_GUARDED_BY(mu_);  // the file's content when a rule last fired: it fires once per content
};

}  // namespace wsync
