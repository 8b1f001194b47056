#pragma once
// Little helpers for the transports' connection blobs and region descriptors (verbs, fabric): fixed-size
// trivially-copyable fields in host byte order and length-prefixed strings, appended to / read from a std::string.
// Readers never read past the end: every Get says whether the field was there.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>

namespace wsync {

class ByteWriter {
 public:
  template <typename T>
  void Put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    out_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  // A uint32 length, then the bytes.
  void PutString(const std::string& s) {
    Put(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class ByteReader {
 public:
  explicit ByteReader(const std::string& in) : in_(in) {}
  template <typename T>
  bool Get(T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (in_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  // A string PutString wrote, refused (false) when longer than `max` or truncated.
  bool GetString(std::string* s, size_t max) {
    uint32_t n = 0;
    if (!Get(&n) || n > max || in_.size() - pos_ < n) return false;
    s->assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool AtEnd() const { return pos_ == in_.size(); }

 private:
  const std::string& in_;
  size_t pos_ = 0;
};

}  // namespace wsync
