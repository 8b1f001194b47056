#pragma once
// Reads the consecutive RL-like steps `wsync-rl-steps --out DIR` wrote (DIR/step_NNNNNN.safetensors, step 0 = the
// initial weights), so that a demo trainer can push step k at update k and a reference engine can compute what its
// loader must hold after it (the emulated-cluster delta bench, bench/cluster).

#include <cstdint>
#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "base/dtype.h"

namespace wsync::tools {

// Not thread-safe: one caller at a time (the file of the last step asked for stays mapped until another step is).
class StepFiles {
 public:
  explicit StepFiles(std::string dir) : dir_(std::move(dir)) {}
  ~StepFiles() { Unmap(); }
  StepFiles(const StepFiles&) = delete;
  StepFiles& operator=(const StepFiles&) = delete;

  static std::string Path(const std::string& dir, int64_t step);

  // The bytes of tensor `name` at `step`, valid until a call for another step or the destruction. NotFound when the
  // file or the tensor is missing, InvalidArgument when its dtype or size is not `dtype` × `bytes`.
  absl::StatusOr<const uint8_t*> Tensor(int64_t step, const std::string& name, DType dtype, uint64_t bytes);

 private:
  struct Entry {
    DType dtype;
    uint64_t offset, bytes;
  };
  absl::Status Map(int64_t step);
  void Unmap();

  std::string dir_;
  int64_t step_ = -1;
  const uint8_t* data_ = nullptr;  // the whole file, mapped read-only
  uint64_t size_ = 0, data_start_ = 0;
  std::map<std::string, Entry> index_;
};

}  // namespace wsync::tools
