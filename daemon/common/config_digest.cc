#include "daemon/common/config_digest.h"

#include <xxhash.h>

#include <cstdio>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace wsync::daemon {

std::string ConfigureSourceDigest(const v1::ConfigureSourceRequest& req) {
  v1::ConfigureSourceRequest copy = req;
  copy.clear_plan_epoch();
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream sos(&bytes);
    google::protobuf::io::CodedOutputStream cos(&sos);
    cos.SetSerializationDeterministic(true);  // map fields in key order
    copy.SerializeToCodedStream(&cos);
  }
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return hex;
}

}  // namespace wsync::daemon
