#include "tools/testdata/step_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "nlohmann/json.hpp"

namespace wsync::tools {

std::string StepFiles::Path(const std::string& dir, int64_t step) {
  return absl::StrFormat("%s/step_%06d.safetensors", dir, step);
}

void StepFiles::Unmap() {
  if (data_ != nullptr) munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = data_start_ = 0;
  step_ = -1;
  index_.clear();
}

absl::Status StepFiles::Map(int64_t step) {
  Unmap();
  const std::string path = Path(dir_, step);
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("step ", step, ": cannot open ", path, ": ", strerror(errno)));
  struct stat st {};
  const bool sized = fstat(fd, &st) == 0 && st.st_size >= 8;
  void* m = sized ? mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);  // the mapping keeps the file
  if (m == MAP_FAILED) return absl::InvalidArgumentError(absl::StrCat(path, ": empty, unreadable or not mappable"));
  data_ = static_cast<const uint8_t*>(m);
  size_ = static_cast<uint64_t>(st.st_size);
  uint64_t header_len = 0;
  std::memcpy(&header_len, data_, 8);  // little-endian, as the format says and every host here is
  if (header_len > size_ - 8) {
    Unmap();
    return absl::InvalidArgumentError(absl::StrCat(path, ": header length ", header_len, " exceeds the file"));
  }
  const auto header = nlohmann::json::parse(data_ + 8, data_ + 8 + header_len, nullptr, false);
  if (header.is_discarded() || !header.is_object()) {
    Unmap();
    return absl::InvalidArgumentError(absl::StrCat(path, ": the header is not a JSON object"));
  }
  data_start_ = 8 + header_len;
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__") continue;
    auto dtype = t.is_object() && t.contains("dtype") && t["dtype"].is_string()
                     ? ParseDType(t["dtype"].get<std::string>())
                     : absl::InvalidArgumentError("no dtype");
    const bool offsets = t.is_object() && t.contains("data_offsets") && t["data_offsets"].is_array() &&
                         t["data_offsets"].size() == 2 && t["data_offsets"][0].is_number_unsigned() &&
                         t["data_offsets"][1].is_number_unsigned();
    const uint64_t b = offsets ? t["data_offsets"][0].get<uint64_t>() : 0;
    const uint64_t e = offsets ? t["data_offsets"][1].get<uint64_t>() : 0;
    if (!dtype.ok() || !offsets || b > e || e > size_ - data_start_) {
      Unmap();
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor ", name, " has no valid dtype or data_offsets"));
    }
    index_[name] = Entry{*dtype, b, e - b};
  }
  step_ = step;
  return absl::OkStatus();
}

absl::StatusOr<const uint8_t*> StepFiles::Tensor(int64_t step, const std::string& name, DType dtype, uint64_t bytes) {
  if (step != step_)
    if (absl::Status st = Map(step); !st.ok()) return st;
  auto it = index_.find(name);
  if (it == index_.end()) return absl::NotFoundError(absl::StrCat(Path(dir_, step), " has no tensor ", name));
  if (it->second.dtype != dtype || it->second.bytes != bytes)
    return absl::InvalidArgumentError(absl::StrCat(Path(dir_, step), ": tensor ", name, " is ",
                                                   DTypeName(it->second.dtype), " of ", it->second.bytes,
                                                   " bytes, not ", DTypeName(dtype), " of ", bytes));
  return data_ + data_start_ + it->second.offset;
}

}  // namespace wsync::tools
