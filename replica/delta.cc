#include "replica/delta.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace wsync::replica::delta {
namespace {

// The header is written and read as little-endian integers with memcpy; every host wsync runs on is little-endian.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "delta headers are little-endian on the wire");

constexpr uint32_t kMagic = 0x4C445357;  // "WSDL"
constexpr uint8_t kVersion = 1;
// Header field offsets. The frame checksum covers [0, kOffFrameSum) and the payload, so any flipped bit in the
// header or the payload is refused before anything is written.
constexpr size_t kOffMagic = 0;
constexpr size_t kOffVersion = 4;
constexpr size_t kOffFormat = 5;
constexpr size_t kOffElemSize = 6;
constexpr size_t kOffFlags = 7;
constexpr size_t kOffRangeBytes = 8;
constexpr size_t kOffChanged = 16;
constexpr size_t kOffIndexBytes = 24;
constexpr size_t kOffBaseSum = 32;
constexpr size_t kOffNewSum = 40;
constexpr size_t kOffFrameSum = 48;
static_assert(kOffFrameSum + 8 == kHeaderBytes, "the frame checksum is the header's last field");

// Compare and hash in blocks that stay in L1/L2 between the compare, the two hashes and the copy, so each buffer
// is read from memory once.
constexpr uint64_t kBlockBytes = 16 * 1024;
constexpr uint64_t kChunkBytes = 64;  // the compare's unit: one cache line

template <typename T>
void Put(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}
template <typename T>
T Get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

inline uint32_t VarintSize(uint64_t v) {
  // 7 payload bits per byte: 1 + floor(bit_width(v) - 1) / 7), with v == 0 taking one byte.
  const int bits = 64 - __builtin_clzll(v | 1);
  return static_cast<uint32_t>((bits + 6) / 7);
}

inline uint8_t* PutVarint(uint8_t* p, uint64_t v) {
  while (v >= 0x80) {
    *p++ = static_cast<uint8_t>(v) | 0x80;
    v >>= 7;
  }
  *p++ = static_cast<uint8_t>(v);
  return p;
}

// Reads one LEB128 varint from [*p, end); false when truncated or longer than a uint64_t.
inline bool GetVarint(const uint8_t** p, const uint8_t* end, uint64_t* v) {
  uint64_t result = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (*p == end) return false;
    const uint8_t b = *(*p)++;
    if (shift == 63 && b > 1) return false;  // bits beyond 64
    result |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) {
      *v = result;
      return true;
    }
  }
  return false;
}

// Bit i of the result set iff bytes i of a and b differ (i < n <= 64).
inline uint64_t DiffMaskScalar(const uint8_t* a, const uint8_t* b, uint64_t n) {
  uint64_t m = 0;
  for (uint64_t i = 0; i < n; ++i) m |= static_cast<uint64_t>(a[i] != b[i]) << i;
  return m;
}

// Turns a byte-difference mask into one bit per changed element, at the element's first byte.
inline uint64_t ElemStarts(uint64_t byte_mask, uint32_t elem_size) {
  switch (elem_size) {
    case 1:
      return byte_mask;
    case 2:
      return (byte_mask | (byte_mask >> 1)) & 0x5555555555555555ull;
    default:
      return (byte_mask | (byte_mask >> 1) | (byte_mask >> 2) | (byte_mask >> 3)) & 0x1111111111111111ull;
  }
}

// One 64-byte chunk in which some element changed: its byte offset and the element-start mask.
struct DiffChunk {
  uint64_t offset;
  uint64_t starts;
};

// Running sizes of each index format while the compare walks the range (decide), so the encoder (act) writes only
// the smallest one and the compare can stop as soon as all of them exceed the caller's limit.
class SizeTracker {
 public:
  SizeTracker(uint64_t elems, uint32_t elem_size) : elems_(elems), elem_size_(elem_size) {}

  void Add(uint64_t idx) {
    const uint64_t gap = idx - next_;
    gaps_bytes_ += VarintSize(gap);
    if (in_run_ && gap == 0) {
      ++run_len_;
    } else {
      CloseRun();
      run_gap_ = gap;
      run_len_ = 1;
      in_run_ = true;
    }
    next_ = idx + 1;
    ++changed_;
  }
  void Finish() { CloseRun(); }

  uint64_t changed() const { return changed_; }
  uint64_t bitmap_bytes() const { return (elems_ + 7) / 8; }
  uint64_t gaps_bytes() const { return gaps_bytes_; }
  uint64_t runs_bytes() const { return runs_bytes_ + (in_run_ ? 2 : 0); }  // an open run costs at least 2
  uint64_t ValueBytes() const { return changed_ * elem_size_; }
  // The smallest index section among the formats (a lower bound while the walk is under way: sizes only grow).
  uint64_t MinIndexBytes(Format* which) const {
    Format f = Format::kGaps;
    uint64_t best = gaps_bytes();
    if (bitmap_bytes() < best) best = bitmap_bytes(), f = Format::kBitmap;
    if (runs_bytes() < best) best = runs_bytes(), f = Format::kRuns;
    if (which != nullptr) *which = f;
    return best;
  }
  uint64_t MinTotal() const { return kHeaderBytes + MinIndexBytes(nullptr) + ValueBytes(); }

 private:
  void CloseRun() {
    if (!in_run_) return;
    runs_bytes_ += VarintSize(run_gap_) + VarintSize(run_len_ - 1);
    in_run_ = false;
  }

  uint64_t elems_;
  uint32_t elem_size_;
  uint64_t next_ = 0;  // index after the previous changed element
  uint64_t changed_ = 0;
  uint64_t gaps_bytes_ = 0;
  uint64_t runs_bytes_ = 0;
  bool in_run_ = false;
  uint64_t run_gap_ = 0;
  uint64_t run_len_ = 0;
};

// The compare of one block: calls on_diff(offset, byte_mask) for each 64-byte chunk (the last may be shorter) in
// which a byte differs. Vector versions skip equal chunks with one compare per 16/32 bytes and one branch.
template <typename OnDiff>
inline void ScanScalar(const uint8_t* a, const uint8_t* b, uint64_t begin, uint64_t end, OnDiff&& on_diff) {
  for (uint64_t off = begin; off < end; off += kChunkBytes) {
    const uint64_t n = std::min(kChunkBytes, end - off);
    if (n == kChunkBytes) {
      uint64_t acc = 0;
      for (int w = 0; w < 8; ++w) acc |= Get<uint64_t>(a + off + 8 * w) ^ Get<uint64_t>(b + off + 8 * w);
      if (acc == 0) continue;
    }
    const uint64_t m = DiffMaskScalar(a + off, b + off, n);
    if (m != 0) on_diff(off, m);
  }
}

#if defined(__x86_64__)
template <typename OnDiff>
inline void ScanSse2(const uint8_t* a, const uint8_t* b, uint64_t begin, uint64_t end, OnDiff&& on_diff) {
  uint64_t off = begin;
  for (; off + kChunkBytes <= end; off += kChunkBytes) {
    const __m128i e0 = _mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + off)),
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off)));
    const __m128i e1 = _mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + off + 16)),
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off + 16)));
    const __m128i e2 = _mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + off + 32)),
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off + 32)));
    const __m128i e3 = _mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + off + 48)),
                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off + 48)));
    const __m128i all = _mm_and_si128(_mm_and_si128(e0, e1), _mm_and_si128(e2, e3));
    if (_mm_movemask_epi8(all) == 0xffff) continue;
    const uint64_t eq = static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(e0))) |
                        static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(e1))) << 16 |
                        static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(e2))) << 32 |
                        static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(e3))) << 48;
    on_diff(off, ~eq);
  }
  if (off < end) ScanScalar(a, b, off, end, on_diff);
}
#endif

// Hashes, compares and (optionally) copies old/neu block by block, then writes the smallest encoding.
EncodeResult EncodeImpl(uint8_t* copy_into_old, const uint8_t* old, const uint8_t* neu, uint64_t bytes,
                        uint32_t elem_size, uint64_t limit, std::string* out) {
  EncodeResult result;
  const uint64_t elems = bytes / elem_size;
  SizeTracker sizes(elems, elem_size);
  std::vector<DiffChunk> chunks;
  bool over_limit = kHeaderBytes > limit;

  XXH3_state_t* old_state = XXH3_createState();
  XXH3_state_t* new_state = XXH3_createState();
  XXH3_64bits_reset(old_state);
  XXH3_64bits_reset(new_state);

  auto on_diff = [&](uint64_t off, uint64_t byte_mask) {
    uint64_t starts = ElemStarts(byte_mask, elem_size);
    chunks.push_back({off, starts});
    const uint64_t base = off / elem_size;
    while (starts != 0) {
      sizes.Add(base + static_cast<uint64_t>(__builtin_ctzll(starts)) / elem_size);
      starts &= starts - 1;
    }
  };

  uint64_t pos = 0;
  for (; pos < bytes && !over_limit; pos += kBlockBytes) {
    const uint64_t end = std::min(bytes, pos + kBlockBytes);
#if defined(__x86_64__)
    ScanSse2(old, neu, pos, end, on_diff);
#else
    ScanScalar(old, neu, pos, end, on_diff);
#endif
    XXH3_64bits_update(old_state, old + pos, end - pos);
    XXH3_64bits_update(new_state, neu + pos, end - pos);
    if (copy_into_old != nullptr) std::memcpy(copy_into_old + pos, neu + pos, end - pos);
    over_limit = sizes.MinTotal() > limit;
  }
  if (copy_into_old != nullptr && pos < bytes) std::memcpy(copy_into_old + pos, neu + pos, bytes - pos);
  sizes.Finish();
  const uint64_t base_sum = XXH3_64bits_digest(old_state);
  const uint64_t new_sum = XXH3_64bits_digest(new_state);
  XXH3_freeState(old_state);
  XXH3_freeState(new_state);

  result.changed_elems = sizes.changed();
  Format format;
  const uint64_t index_bytes = sizes.MinIndexBytes(&format);
  const uint64_t total = kHeaderBytes + index_bytes + sizes.ValueBytes();
  if (over_limit || total > limit) {
    result.dense_smaller = true;
    return result;
  }

  const size_t start = out->size();
  out->resize(start + total);
  uint8_t* hdr = reinterpret_cast<uint8_t*>(out->data()) + start;
  uint8_t* idx = hdr + kHeaderBytes;
  uint8_t* val = idx + index_bytes;
  if (format == Format::kBitmap) std::memset(idx, 0, index_bytes);

  uint64_t next = 0;  // index after the previous changed element
  bool in_run = false;
  uint64_t run_gap = 0, run_len = 0;
  for (const DiffChunk& c : chunks) {
    uint64_t starts = c.starts;
    const uint64_t base = c.offset / elem_size;
    while (starts != 0) {
      const uint64_t i = base + static_cast<uint64_t>(__builtin_ctzll(starts)) / elem_size;
      starts &= starts - 1;
      switch (format) {
        case Format::kBitmap:
          idx[i >> 3] |= static_cast<uint8_t>(1u << (i & 7));
          break;
        case Format::kGaps:
          idx = PutVarint(idx, i - next);
          break;
        case Format::kRuns:
          if (in_run && i == next) {
            ++run_len;
          } else {
            if (in_run) idx = PutVarint(PutVarint(idx, run_gap), run_len - 1);
            run_gap = i - next;
            run_len = 1;
            in_run = true;
          }
          break;
      }
      std::memcpy(val, neu + i * elem_size, elem_size);
      val += elem_size;
      next = i + 1;
    }
  }
  if (in_run) idx = PutVarint(PutVarint(idx, run_gap), run_len - 1);

  Put<uint32_t>(hdr + kOffMagic, kMagic);
  Put<uint8_t>(hdr + kOffVersion, kVersion);
  Put<uint8_t>(hdr + kOffFormat, static_cast<uint8_t>(format));
  Put<uint8_t>(hdr + kOffElemSize, static_cast<uint8_t>(elem_size));
  Put<uint8_t>(hdr + kOffFlags, 0);
  Put<uint64_t>(hdr + kOffRangeBytes, bytes);
  Put<uint64_t>(hdr + kOffChanged, sizes.changed());
  Put<uint64_t>(hdr + kOffIndexBytes, index_bytes);
  Put<uint64_t>(hdr + kOffBaseSum, base_sum);
  Put<uint64_t>(hdr + kOffNewSum, new_sum);
  const uint64_t frame_sum =
      XXH3_64bits_withSeed(hdr + kHeaderBytes, total - kHeaderBytes, XXH3_64bits(hdr, kOffFrameSum));
  Put<uint64_t>(hdr + kOffFrameSum, frame_sum);
  result.encoded_bytes = total;
  return result;
}

// Walks the index section of a header-checked encoding, calling fn(first, count, values) per run of consecutive
// changed elements; returns InvalidArgument at the first inconsistency (index past the end, counts that disagree).
template <typename Fn>
absl::Status DecodeRuns(const Info& info, const uint8_t* idx, uint64_t index_bytes, const uint8_t* values, Fn&& fn) {
  const uint64_t elems = info.range_bytes / info.elem_size;
  const uint32_t es = info.elem_size;
  const uint8_t* end = idx + index_bytes;
  uint64_t seen = 0;
  switch (info.format) {
    case Format::kBitmap: {
      if (index_bytes != (elems + 7) / 8) {
        return absl::InvalidArgumentError(absl::StrCat("bitmap of ", index_bytes, " bytes for ", elems, " elements"));
      }
      if (elems % 8 != 0 && (idx[index_bytes - 1] >> (elems % 8)) != 0) {
        return absl::InvalidArgumentError("bitmap marks elements past the end of the range");
      }
      uint64_t run_first = 0, run_len = 0;
      auto flush = [&]() {
        if (run_len == 0) return;
        fn(run_first, run_len, values + seen * es);
        seen += run_len;
        run_len = 0;
      };
      for (uint64_t w = 0; w < index_bytes; w += 8) {
        const uint64_t n = std::min<uint64_t>(8, index_bytes - w);
        uint64_t word = 0;
        std::memcpy(&word, idx + w, n);
        while (word != 0) {
          const uint64_t i = w * 8 + static_cast<uint64_t>(__builtin_ctzll(word));
          word &= word - 1;
          if (run_len != 0 && i == run_first + run_len) {
            ++run_len;
          } else {
            flush();
            run_first = i;
            run_len = 1;
          }
          if (seen + run_len > info.changed_elems) {
            return absl::InvalidArgumentError("bitmap marks more elements than the header's count");
          }
        }
      }
      flush();
      break;
    }
    case Format::kGaps: {
      uint64_t next = 0, run_first = 0, run_len = 0;
      while (idx != end) {
        uint64_t gap;
        if (!GetVarint(&idx, end, &gap)) return absl::InvalidArgumentError("truncated or overlong gap varint");
        if (gap >= elems - next || next >= elems) {
          return absl::InvalidArgumentError(absl::StrCat("index past the end of the range (", elems, " elements)"));
        }
        const uint64_t i = next + gap;
        if (seen + run_len >= info.changed_elems) {
          return absl::InvalidArgumentError("more indices than the header's count");
        }
        if (run_len != 0 && gap == 0) {
          ++run_len;
        } else {
          if (run_len != 0) fn(run_first, run_len, values + seen * es);
          seen += run_len;
          run_first = i;
          run_len = 1;
        }
        next = i + 1;
      }
      if (run_len != 0) fn(run_first, run_len, values + seen * es);
      seen += run_len;
      break;
    }
    case Format::kRuns: {
      uint64_t next = 0;
      while (idx != end) {
        uint64_t gap, len_minus_1;
        if (!GetVarint(&idx, end, &gap) || !GetVarint(&idx, end, &len_minus_1)) {
          return absl::InvalidArgumentError("truncated or overlong run varint");
        }
        if (next > elems || gap > elems - next || len_minus_1 >= elems - next - gap) {
          return absl::InvalidArgumentError(absl::StrCat("run past the end of the range (", elems, " elements)"));
        }
        const uint64_t len = len_minus_1 + 1;
        if (len > info.changed_elems - seen) {
          return absl::InvalidArgumentError("runs cover more elements than the header's count");
        }
        fn(next + gap, len, values + seen * es);
        seen += len;
        next += gap + len;
      }
      break;
    }
  }
  if (seen != info.changed_elems) {
    return absl::InvalidArgumentError(
        absl::StrCat("index section lists ", seen, " elements, the header ", info.changed_elems));
  }
  return absl::OkStatus();
}

// Header checks and frame checksum; on success *index points at the index section and *values at the values.
absl::StatusOr<Info> ParseHeader(const uint8_t* enc, uint64_t enc_bytes, uint64_t* index_bytes) {
  if (enc_bytes < kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("delta of ", enc_bytes, " bytes is shorter than its header"));
  }
  if (Get<uint32_t>(enc + kOffMagic) != kMagic) return absl::InvalidArgumentError("not a delta encoding (magic)");
  if (enc[kOffVersion] != kVersion) {
    return absl::InvalidArgumentError(absl::StrCat("delta format version ", enc[kOffVersion], " is not supported"));
  }
  Info info;
  const uint8_t format = enc[kOffFormat];
  if (format < 1 || format > 3) return absl::InvalidArgumentError(absl::StrCat("unknown delta format ", format));
  info.format = static_cast<Format>(format);
  info.elem_size = enc[kOffElemSize];
  if (info.elem_size != 1 && info.elem_size != 2 && info.elem_size != 4) {
    return absl::InvalidArgumentError(absl::StrCat("element size ", info.elem_size, " is not 1, 2 or 4"));
  }
  if (enc[kOffFlags] != 0) return absl::InvalidArgumentError("unknown delta flags");
  info.range_bytes = Get<uint64_t>(enc + kOffRangeBytes);
  info.changed_elems = Get<uint64_t>(enc + kOffChanged);
  *index_bytes = Get<uint64_t>(enc + kOffIndexBytes);
  info.base_checksum = Get<uint64_t>(enc + kOffBaseSum);
  info.new_checksum = Get<uint64_t>(enc + kOffNewSum);
  if (info.range_bytes % info.elem_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("range of ", info.range_bytes, " bytes is not a multiple of the element size ", info.elem_size));
  }
  const uint64_t elems = info.range_bytes / info.elem_size;
  if (info.changed_elems > elems) {
    return absl::InvalidArgumentError(absl::StrCat(info.changed_elems, " changed elements in a range of ", elems));
  }
  // No overflow: changed_elems <= elems, so changed_elems * elem_size <= range_bytes.
  const uint64_t payload = enc_bytes - kHeaderBytes;
  const uint64_t value_bytes = info.changed_elems * info.elem_size;
  if (*index_bytes > payload || value_bytes > payload - *index_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("delta truncated: payload needs ", *index_bytes, " + ", value_bytes,
                                                   " bytes, ", payload, " present"));
  }
  info.encoded_bytes = kHeaderBytes + *index_bytes + value_bytes;
  const uint64_t frame_sum =
      XXH3_64bits_withSeed(enc + kHeaderBytes, info.encoded_bytes - kHeaderBytes, XXH3_64bits(enc, kOffFrameSum));
  if (frame_sum != Get<uint64_t>(enc + kOffFrameSum)) {
    return absl::InvalidArgumentError("delta frame checksum mismatch (corrupt header or payload)");
  }
  return info;
}

}  // namespace

uint64_t Checksum(const uint8_t* data, uint64_t bytes) { return XXH3_64bits(data, bytes); }

EncodeResult Encode(const uint8_t* old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                    std::string* out) {
  return EncodeImpl(nullptr, old, neu, bytes, elem_size, limit, out);
}

EncodeResult CopyAndEncode(uint8_t* dst_old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                           std::string* out) {
  return EncodeImpl(dst_old, dst_old, neu, bytes, elem_size, limit, out);
}

absl::StatusOr<Info> Inspect(const uint8_t* enc, uint64_t enc_bytes) {
  uint64_t index_bytes = 0;
  WSYNC_ASSIGN_OR_RETURN(Info info, ParseHeader(enc, enc_bytes, &index_bytes));
  const uint8_t* idx = enc + kHeaderBytes;
  WSYNC_RETURN_IF_ERROR(
      DecodeRuns(info, idx, index_bytes, idx + index_bytes, [](uint64_t, uint64_t, const uint8_t*) {}));
  return info;
}

absl::Status ForEachRun(const uint8_t* enc, uint64_t enc_bytes,
                        const std::function<void(uint64_t first_elem, uint64_t count, const uint8_t* values)>& fn) {
  WSYNC_ASSIGN_OR_RETURN(Info info, Inspect(enc, enc_bytes));
  const uint64_t index_bytes = info.encoded_bytes - kHeaderBytes - info.changed_elems * info.elem_size;
  const uint8_t* idx = enc + kHeaderBytes;
  return DecodeRuns(info, idx, index_bytes, idx + index_bytes, fn);
}

absl::Status Apply(uint8_t* dst, uint64_t dst_bytes, const uint8_t* enc, uint64_t enc_bytes, uint64_t* consumed) {
  WSYNC_ASSIGN_OR_RETURN(Info info, Inspect(enc, enc_bytes));
  if (info.range_bytes != dst_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("delta covers ", info.range_bytes, " bytes, the destination has ", dst_bytes));
  }
  if (Checksum(dst, dst_bytes) != info.base_checksum) {
    return absl::FailedPreconditionError("delta base mismatch: the destination does not hold the delta's base");
  }
  const uint64_t index_bytes = info.encoded_bytes - kHeaderBytes - info.changed_elems * info.elem_size;
  const uint8_t* idx = enc + kHeaderBytes;
  const uint32_t es = info.elem_size;
  // Validated above, so this pass cannot fail.
  WSYNC_RETURN_IF_ERROR(
      DecodeRuns(info, idx, index_bytes, idx + index_bytes, [&](uint64_t first, uint64_t count, const uint8_t* values) {
        std::memcpy(dst + first * es, values, count * es);
      }));
  if (consumed != nullptr) *consumed = info.encoded_bytes;
  return absl::OkStatus();
}

}  // namespace wsync::replica::delta
