#include "tools/testing/engine_ref/ref_faults.h"

#include "absl/strings/str_cat.h"
#include "proto/status_convert.h"

namespace wsync::engine_ref {

RefFaults::RefFaults(const std::string& engine_id)
    : knob_("WSYNC_REF_FAULTS_FILE", engine_id, absl::StrCat("ref_fault: engine ", engine_id)) {}

grpc::Status RefFaults::At(absl::string_view call, const std::function<bool()>& cancelled) {
  return ToGrpcStatus(knob_.At(call, cancelled));
}

}  // namespace wsync::engine_ref
