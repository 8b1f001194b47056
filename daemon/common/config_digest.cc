#include "daemon/common/config_digest.h"

#include <xxhash.h>

#include <cstdio>
#include <memory>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream.h"

namespace wsync::daemon {
namespace {

// Feeds what a message serializes to XXH3-128 in 64 KiB pieces, never holding the whole serialization: a request
// with its engine ranks' tables is megabytes, and the coordinator digests one per source on up to 64 workers at once.
class HashingStream final : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  HashingStream() : state_(XXH3_createState(), &XXH3_freeState) { XXH3_128bits_reset(state_.get()); }
  bool Next(void** data, int* size) override {
    Flush();
    *data = buf_;
    *size = sizeof(buf_);
    used_ = sizeof(buf_);
    return true;
  }
  void BackUp(int count) override { used_ -= static_cast<size_t>(count); }
  int64_t ByteCount() const override { return static_cast<int64_t>(total_ + used_); }
  // Call once the CodedOutputStream writing here is gone (it backs up what it did not use when destroyed).
  XXH128_hash_t Digest() {
    Flush();
    return XXH3_128bits_digest(state_.get());
  }

 private:
  void Flush() {
    if (used_ > 0) XXH3_128bits_update(state_.get(), buf_, used_);
    total_ += used_;
    used_ = 0;
  }
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state_;
  char buf_[64 << 10];
  size_t used_ = 0, total_ = 0;
};

}  // namespace

std::string ConfigureSourceDigest(const v1::ConfigureSourceRequest& req) {
  if (req.plan_epoch() != 0) {
    // The coordinator digests requests before it sets their epoch; a source digests the one it received.
    v1::ConfigureSourceRequest copy = req;
    copy.clear_plan_epoch();
    return ConfigureSourceDigest(copy);
  }
  auto hs = std::make_unique<HashingStream>();  // its buffer is too large for a worker thread's stack
  {
    google::protobuf::io::CodedOutputStream cos(hs.get());
    cos.SetSerializationDeterministic(true);  // map fields in key order
    req.SerializeToCodedStream(&cos);
  }
  const XXH128_hash_t h = hs->Digest();
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(h.high64),
                static_cast<unsigned long long>(h.low64));
  return hex;
}

}  // namespace wsync::daemon
