#pragma once
// Testing aid of the reference engine: control calls that fail or hang on demand, so that tests inject a fault at
// one named phase of an update and act when the engine reaches it (tests/daemon/fault_matrix_real_test.py).
//
// WSYNC_REF_FAULTS_FILE=PATH in the engine's environment names a file read at the start of each hooked control call
// (pause, post_process, set_version, continue, prepare, switch, checksums, engine_info). Each line is
// "ENGINE CALL ACTION [TAG]", ENGINE the engine's id or "*"; the format, the actions and the once-per-content rule are
// base/fault_knob.h's (the node daemon's WSYNC_DAEMON_FAULTS_FILE uses the same). The engine logs
// "ref_fault: engine ID reached CALL (ACTION)" when a rule fires, before acting: the event a test waits for.

#include <functional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/strings/string_view.h"
#include "base/fault_knob.h"

namespace wsync::engine_ref {

class RefFaults {
 public:
  // Reads WSYNC_REF_FAULTS_FILE; `engine_id` selects this engine's rules.
  explicit RefFaults(const std::string& engine_id);
  // At the start of control call `call`: OK to go on, or the injected failure (after the hang, if one was asked).
  // `cancelled` says whether the caller gave up (ServerContext::IsCancelled).
  grpc::Status At(absl::string_view call, const std::function<bool()>& cancelled);

 private:
  FaultKnob knob_;
};

}  // namespace wsync::engine_ref
