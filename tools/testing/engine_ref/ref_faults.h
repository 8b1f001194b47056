#pragma once
// Testing aid of the reference engine: control calls that fail or hang on demand, so that tests inject a fault at
// one named phase of an update and act when the engine reaches it (tests/daemon/fault_matrix_real_test.cc).
//
// WSYNC_REF_FAULTS_FILE=PATH in the engine's environment names a file read at the start of each hooked control call
// (pause, post_process, set_version, continue, prepare, switch, checksums, engine_info). Each line is
// "ENGINE CALL ACTION [TAG]": ENGINE is the engine's id or "*", ACTION is
//   error  the call fails (INTERNAL, "injected fault at CALL");
//   hang   the call blocks until its caller gives up (deadline, cancellation, the caller's process gone); it then
//          fails. A test kills the engine or the caller while it blocks.
// The engine logs "ref_fault: engine ID reached CALL (ACTION)" when a rule fires, before acting: the event a test
// waits for. A rule fires once per content of the file (write the file again, e.g. with a new TAG, to re-arm), so
// the coordinator's own recovery calls (a Continue after a failed one) are not failed too. No variable, no file, or
// an empty file: no faults, one stat per call.

#include <functional>
#include <mutex>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/strings/string_view.h"

namespace wsync::engine_ref {

class RefFaults {
 public:
  // Reads WSYNC_REF_FAULTS_FILE; `engine_id` selects this engine's rules.
  explicit RefFaults(std::string engine_id);
  // At the start of control call `call`: OK to go on, or the injected failure (after the hang, if one was asked).
  // `cancelled` says whether the caller gave up (ServerContext::IsCancelled).
  grpc::Status At(absl::string_view call, const std::function<bool()>& cancelled);

 private:
  std::string engine_id_;
  std::string path_;
  std::mutex mu_;
  std::string fired_;  // the file's content when a rule last fired: it fires once per content
};

}  // namespace wsync::engine_ref
