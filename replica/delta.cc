#include "replica/delta.h"

#include "replica/delta_testing.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <xxhash.h>
#if defined(__x86_64__)
#include <xxh_x86dispatch.h>  // XXH3 with the widest vectors the CPU has (the library picks at run time)
#endif

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
  // 7 payload bits per byte: ceil(bit_width(v) / 7), with v == 0 taking one byte.
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

// A growable byte buffer written through a raw cursor: the encoder reserves room for one chunk's output once per
// changed chunk rather than checking per element.
class Sink {
 public:
  void Clear() { size_ = 0; }
  uint8_t* Reserve(size_t n) {
    if (size_ + n > buf_.size()) buf_.resize(std::max(buf_.size() * 2, size_ + n + 4096));
    return buf_.data() + size_;
  }
  void Commit(uint8_t* end) { size_ = static_cast<size_t>(end - buf_.data()); }
  const uint8_t* data() const { return buf_.data(); }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  // Keeps the buffer for the next call (no allocation, no page faults per parameter) unless it grew large.
  void Release() {
    if (buf_.size() > kKeepBytes) std::vector<uint8_t>().swap(buf_);
  }

 private:
  static constexpr size_t kKeepBytes = 16u << 20;
  std::vector<uint8_t> buf_;
  size_t size_ = 0;
};

// What the compare has found so far: the changed elements' gap varints and new values (the kGaps payload, written
// as the compare goes) and the number of runs of consecutive changed elements (a kRuns index costs at least two
// bytes per run). The kBitmap size depends only on the element count. After the walk the smallest format is known
// exactly (decide; the kRuns size is computed from the gaps only when its lower bound could win) before any of it is
// written out (act).
struct ScanState {
  uint64_t elems = 0;
  uint64_t next = 0;  // index after the previous changed element
  Sink gaps, values;
  uint64_t runs = 0;

  void Reset(uint64_t n) {
    elems = n;
    next = 0;
    gaps.Clear();
    values.Clear();
    runs = 0;
  }
  uint64_t BitmapBytes() const { return (elems + 7) / 8; }
  // A lower bound of every format's index size while the walk is under way (every size only grows).
  uint64_t MinIndexLowerBound() const { return std::min<uint64_t>({gaps.size(), BitmapBytes(), 2 * runs}); }
  uint64_t MinTotalLowerBound() const { return kHeaderBytes + MinIndexLowerBound() + values.size(); }
};

// The exact kRuns index size of the changed elements listed by gap varints.
uint64_t RunsBytesFromGaps(const uint8_t* g, const uint8_t* end) {
  uint64_t bytes = 0, run_gap = 0, run_len = 0;
  while (g != end) {
    uint64_t gap = 0;
    GetVarint(&g, end, &gap);  // written by the encoder: well formed
    if (run_len != 0 && gap == 0) {
      ++run_len;
      continue;
    }
    if (run_len != 0) bytes += VarintSize(run_gap) + VarintSize(run_len - 1);
    run_gap = gap;
    run_len = 1;
  }
  if (run_len != 0) bytes += VarintSize(run_gap) + VarintSize(run_len - 1);
  return bytes;
}

// Records the changed elements of one 64-byte chunk (byte_mask: its differing bytes). Within a chunk consecutive
// changed elements are fewer than 64 apart, so only the chunk's first gap may need more than one varint byte.
template <uint32_t ES>
inline void RecordChunk(uint64_t off, uint64_t byte_mask, const uint8_t* neu, ScanState* st) {
  uint64_t starts = ElemStarts(byte_mask, ES);
  const uint64_t base = off / ES;
  // Elements that start a run: changed, and the element before is not (for the chunk's first element, the previous
  // chunk's last one).
  uint64_t run_starts = starts & ~(starts << ES);
  if (st->next == base && base != 0) run_starts &= ~uint64_t{1};
  st->runs += static_cast<uint64_t>(__builtin_popcountll(run_starts));

  uint8_t* g = st->gaps.Reserve(kChunkBytes + 10);
  uint8_t* v = st->values.Reserve(kChunkBytes);
  uint64_t i = base + static_cast<uint64_t>(__builtin_ctzll(starts)) / ES;
  starts &= starts - 1;
  g = PutVarint(g, i - st->next);
  std::memcpy(v, neu + i * ES, ES);
  v += ES;
  uint64_t next = i + 1;
  while (starts != 0) {
    i = base + static_cast<uint64_t>(__builtin_ctzll(starts)) / ES;
    starts &= starts - 1;
    *g++ = static_cast<uint8_t>(i - next);
    std::memcpy(v, neu + i * ES, ES);
    v += ES;
    next = i + 1;
  }
  st->next = next;
  st->gaps.Commit(g);
  st->values.Commit(v);
}

// The compare of one block [begin, end): writes {offset, byte_mask} for each 64-byte chunk (the last may be shorter)
// in which a byte differs and returns how many. Equal chunks cost one compare per vector and one branch. The widest
// instruction set the CPU has is picked once, at load.
struct DiffChunk {
  uint64_t offset;
  uint64_t byte_mask;
};
constexpr uint64_t kChunksPerBlock = kBlockBytes / kChunkBytes;
using ScanFn = size_t (*)(const uint8_t* a, const uint8_t* b, uint64_t begin, uint64_t end, DiffChunk* out);

size_t ScanScalar(const uint8_t* a, const uint8_t* b, uint64_t begin, uint64_t end, DiffChunk* out) {
  size_t n_out = 0;
  for (uint64_t off = begin; off < end; off += kChunkBytes) {
    const uint64_t n = std::min(kChunkBytes, end - off);
    if (n == kChunkBytes) {
      uint64_t acc = 0;
      for (int w = 0; w < 8; ++w) acc |= Get<uint64_t>(a + off + 8 * w) ^ Get<uint64_t>(b + off + 8 * w);
      if (acc == 0) continue;
    }
    const uint64_t m = DiffMaskScalar(a + off, b + off, n);
    if (m != 0) out[n_out++] = {off, m};
  }
  return n_out;
}

struct Kernel {
  const char* name;
  ScanFn fn;
};

#if defined(__x86_64__)
size_t ScanSse2(const uint8_t* a, const uint8_t* b, uint64_t begin, uint64_t end, DiffChunk* out) {
  size_t n_out = 0;
  uint64_t off = begin;
  for (; off + kChunkBytes <= end; off += kChunkBytes) {
    __m128i e[4];
    for (int k = 0; k < 4; ++k) {
      e[k] = _mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + off + 16 * k)),
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + off + 16 * k)));
    }
    const __m128i all = _mm_and_si128(_mm_and_si128(e[0], e[1]), _mm_and_si128(e[2], e[3]));
    if (_mm_movemask_epi8(all) == 0xffff) continue;
    uint64_t eq = 0;
    for (int k = 0; k < 4; ++k) eq |= static_cast<uint64_t>(static_cast<uint32_t>(_mm_movemask_epi8(e[k]))) << (16 * k);
    out[n_out++] = {off, ~eq};
  }
  if (off < end) n_out += ScanScalar(a, b, off, end, out + n_out);
  return n_out;
}

__attribute__((target("avx2"))) size_t ScanAvx2(const uint8_t* a, const uint8_t* b, uint64_t begin, uint64_t end,
                                                DiffChunk* out) {
  size_t n_out = 0;
  uint64_t off = begin;
  for (; off + kChunkBytes <= end; off += kChunkBytes) {
    const __m256i e0 = _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + off)),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + off)));
    const __m256i e1 = _mm256_cmpeq_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + off + 32)),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + off + 32)));
    if (_mm256_movemask_epi8(_mm256_and_si256(e0, e1)) == -1) continue;
    const uint64_t eq = static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(e0))) |
                        static_cast<uint64_t>(static_cast<uint32_t>(_mm256_movemask_epi8(e1))) << 32;
    out[n_out++] = {off, ~eq};
  }
  if (off < end) n_out += ScanScalar(a, b, off, end, out + n_out);
  return n_out;
}

__attribute__((target("avx512f,avx512bw"))) size_t ScanAvx512(const uint8_t* a, const uint8_t* b, uint64_t begin,
                                                              uint64_t end, DiffChunk* out) {
  size_t n_out = 0;
  uint64_t off = begin;
  for (; off + kChunkBytes <= end; off += kChunkBytes) {
    const uint64_t m = _mm512_cmpneq_epi8_mask(_mm512_loadu_si512(a + off), _mm512_loadu_si512(b + off));
    if (m != 0) out[n_out++] = {off, m};
  }
  if (off < end) n_out += ScanScalar(a, b, off, end, out + n_out);
  return n_out;
}

// Those this CPU can run, widest first.
std::vector<Kernel> Kernels() {
  std::vector<Kernel> k;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512bw")) k.push_back({"avx512bw", ScanAvx512});
  if (__builtin_cpu_supports("avx2")) k.push_back({"avx2", ScanAvx2});
  k.push_back({"sse2", ScanSse2});
  k.push_back({"scalar", ScanScalar});
  return k;
}
#else
std::vector<Kernel> Kernels() { return {{"scalar", ScanScalar}}; }
#endif

// Chosen once at load; only delta_testing.h's hook changes it.
ScanFn kScan = Kernels().front().fn;

// Per thread, so that encoding many parameters allocates once.
thread_local ScanState tls_scan;

// Hashes, compares and (optionally) copies old/neu block by block, then writes the smallest encoding.
template <uint32_t ES>
EncodeResult EncodeImpl(uint8_t* copy_into_old, const uint8_t* old, const uint8_t* neu, uint64_t bytes, uint64_t limit,
                        const EncodeOptions& options, std::string* out) {
  EncodeResult result;
  ScanState& st = tls_scan;
  st.Reset(bytes / ES);
  bool over_limit = kHeaderBytes > limit;

  XXH3_state_t old_state, new_state;  // XXH_STATIC_LINKING_ONLY: on the stack, no allocation
  XXH3_64bits_reset(&old_state);
  XXH3_64bits_reset(&new_state);
  DiffChunk diffs[kChunksPerBlock];

  uint64_t pos = 0;
  for (; pos < bytes && !over_limit; pos += kBlockBytes) {
    const uint64_t end = std::min(bytes, pos + kBlockBytes);
    const size_t n = kScan(old, neu, pos, end, diffs);
    for (size_t k = 0; k < n; ++k) RecordChunk<ES>(diffs[k].offset, diffs[k].byte_mask, neu, &st);
    if (!options.base_checksum.has_value()) XXH3_64bits_update(&old_state, old + pos, end - pos);
    XXH3_64bits_update(&new_state, neu + pos, end - pos);
    if (copy_into_old != nullptr) {
      // Only the chunks that differ need the copy: the rest of old already holds neu's bytes, so the replica's
      // update writes O(changed) bytes instead of the whole range. After the hash of old: it covers the base.
      for (size_t k = 0; k < n; ++k) {
        const uint64_t off = diffs[k].offset;
        if (off + kChunkBytes <= bytes) {
          std::memcpy(copy_into_old + off, neu + off, kChunkBytes);  // fixed size: inlined vector moves
        } else {
          std::memcpy(copy_into_old + off, neu + off, bytes - off);
        }
      }
    }
    over_limit = st.MinTotalLowerBound() > limit;
  }
  if (copy_into_old != nullptr && pos < bytes) std::memcpy(copy_into_old + pos, neu + pos, bytes - pos);
  const uint64_t changed = st.values.size() / ES;
  result.changed_elems = changed;
  Format format = Format::kGaps;
  uint64_t index_bytes = st.gaps.size();
  if (st.BitmapBytes() < index_bytes) format = Format::kBitmap, index_bytes = st.BitmapBytes();
  if (!over_limit && 2 * st.runs < index_bytes) {
    const uint64_t runs_bytes = RunsBytesFromGaps(st.gaps.data(), st.gaps.data() + st.gaps.size());
    if (runs_bytes < index_bytes) format = Format::kRuns, index_bytes = runs_bytes;
  }
  const uint64_t total = kHeaderBytes + index_bytes + st.values.size();
  if (over_limit || total > limit) {
    result.dense_smaller = true;
    st.gaps.Release();
    st.values.Release();
    return result;
  }

  const size_t start = out->size();
  out->resize(start + total);
  uint8_t* hdr = reinterpret_cast<uint8_t*>(out->data()) + start;
  uint8_t* idx = hdr + kHeaderBytes;
  // The buffers have no storage until a thread's first change: memcpy must not see their null data() even for 0.
  if (format == Format::kGaps) {
    if (index_bytes != 0) std::memcpy(idx, st.gaps.data(), index_bytes);
  } else {
    // Re-read the gap varints (O(changed), small next to the compare) into the chosen format.
    if (format == Format::kBitmap) std::memset(idx, 0, index_bytes);
    const uint8_t* g = st.gaps.data();
    const uint8_t* g_end = g + st.gaps.size();
    uint64_t next = 0;
    bool in_run = false;
    uint64_t run_gap = 0, run_len = 0;
    uint8_t* w = idx;
    while (g != g_end) {
      uint64_t gap = 0;
      GetVarint(&g, g_end, &gap);  // written above: well formed
      const uint64_t i = next + gap;
      if (format == Format::kBitmap) {
        w[i >> 3] |= static_cast<uint8_t>(1u << (i & 7));
      } else if (in_run && gap == 0) {
        ++run_len;
      } else {
        if (in_run) w = PutVarint(PutVarint(w, run_gap), run_len - 1);
        run_gap = gap;
        run_len = 1;
        in_run = true;
      }
      next = i + 1;
    }
    if (in_run) PutVarint(PutVarint(w, run_gap), run_len - 1);
  }
  if (!st.values.empty()) std::memcpy(idx + index_bytes, st.values.data(), st.values.size());
  st.gaps.Release();
  st.values.Release();

  Put<uint32_t>(hdr + kOffMagic, kMagic);
  Put<uint8_t>(hdr + kOffVersion, kVersion);
  Put<uint8_t>(hdr + kOffFormat, static_cast<uint8_t>(format));
  Put<uint8_t>(hdr + kOffElemSize, static_cast<uint8_t>(ES));
  Put<uint8_t>(hdr + kOffFlags, 0);
  Put<uint64_t>(hdr + kOffRangeBytes, bytes);
  Put<uint64_t>(hdr + kOffChanged, changed);
  Put<uint64_t>(hdr + kOffIndexBytes, index_bytes);
  result.base_checksum = options.base_checksum.has_value() ? *options.base_checksum : XXH3_64bits_digest(&old_state);
  result.new_checksum = XXH3_64bits_digest(&new_state);
  Put<uint64_t>(hdr + kOffBaseSum, result.base_checksum);
  Put<uint64_t>(hdr + kOffNewSum, result.new_checksum);
  const uint64_t frame_sum =
      XXH3_64bits_withSeed(hdr + kHeaderBytes, total - kHeaderBytes, XXH3_64bits(hdr, kOffFrameSum));
  Put<uint64_t>(hdr + kOffFrameSum, frame_sum);
  result.encoded_bytes = total;
  return result;
}

// Changed elements of one sampled chunk, and the runs of consecutive changed elements starting in it (the element
// before the chunk is compared too, when there is one).
template <uint32_t ES>
void SampleChunk(const uint8_t* old, const uint8_t* neu, uint64_t off, uint64_t* changed, uint64_t* runs) {
  bool prev = off >= ES && std::memcmp(old + off - ES, neu + off - ES, ES) != 0;
  for (uint64_t i = off; i < off + kChunkBytes; i += ES) {
    const bool c = std::memcmp(old + i, neu + i, ES) != 0;
    *changed += c;
    *runs += c && !prev;
    prev = c;
  }
}

}  // namespace

bool SampledDenseSmaller(const uint8_t* old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                         uint32_t samples) {
  if ((elem_size != 1 && elem_size != 2 && elem_size != 4) || samples == 0 || bytes % elem_size != 0) return false;
  const uint64_t chunks = bytes / kChunkBytes;
  if (chunks < uint64_t{samples} * 4) return false;  // small: Encode's own early stop is cheap enough
  const uint64_t stride = chunks / samples;
  uint64_t changed = 0, runs = 0;
  for (uint64_t k = 0; k < samples; ++k) {
    const uint64_t off = (k * stride + stride / 2) * kChunkBytes;
    if (elem_size == 1) SampleChunk<1>(old, neu, off, &changed, &runs);
    if (elem_size == 2) SampleChunk<2>(old, neu, off, &changed, &runs);
    if (elem_size == 4) SampleChunk<4>(old, neu, off, &changed, &runs);
  }
  const double sampled = static_cast<double>(samples) * static_cast<double>(kChunkBytes / elem_size);
  const double elems = static_cast<double>(bytes / elem_size);
  const double fraction = static_cast<double>(changed) / sampled;
  // The cheapest index: one bit per element, one byte or more per changed element (gaps), two or more per run.
  const double index = std::min({elems / 8.0, fraction * elems, 2.0 * static_cast<double>(runs) / sampled * elems});
  const double estimate = static_cast<double>(kHeaderBytes) + fraction * static_cast<double>(bytes) + index;
  // A delta expected to save under a tenth of the range is not worth the scan that would make it.
  return estimate > 0.9 * static_cast<double>(limit);
}

namespace {

EncodeResult Dispatch(uint8_t* copy_into_old, const uint8_t* old, const uint8_t* neu, uint64_t bytes,
                      const EncodeOptions& options, uint32_t elem_size, uint64_t limit, std::string* out) {
  if ((elem_size != 1 && elem_size != 2 && elem_size != 4) || bytes % elem_size != 0) {
    // Not a range the codec describes: the caller sends it dense.
    if (copy_into_old != nullptr) std::memcpy(copy_into_old, neu, bytes);
    EncodeResult r;
    r.dense_smaller = true;
    return r;
  }
  switch (elem_size) {
    case 1:
      return EncodeImpl<1>(copy_into_old, old, neu, bytes, limit, options, out);
    case 2:
      return EncodeImpl<2>(copy_into_old, old, neu, bytes, limit, options, out);
    default:
      return EncodeImpl<4>(copy_into_old, old, neu, bytes, limit, options, out);
  }
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

// The kGaps index check without building runs (the common format, so the tight loop): every varint well formed,
// every index inside the range, as many as the header says.
absl::Status ValidateGaps(const Info& info, const uint8_t* idx, const uint8_t* end) {
  const uint64_t elems = info.range_bytes / info.elem_size;
  uint64_t next = 0, count = 0;
  while (idx != end) {
    uint64_t gap = *idx;
    if (gap < 0x80) {
      ++idx;
    } else if (!GetVarint(&idx, end, &gap)) {
      return absl::InvalidArgumentError("truncated or overlong gap varint");
    }
    if (next >= elems || gap >= elems - next) {
      return absl::InvalidArgumentError(absl::StrCat("index past the end of the range (", elems, " elements)"));
    }
    next += gap + 1;
    ++count;
  }
  if (count != info.changed_elems) {
    return absl::InvalidArgumentError(
        absl::StrCat("index section lists ", count, " elements, the header ", info.changed_elems));
  }
  return absl::OkStatus();
}

// Writes a validated encoding's values into dst: element by element for kGaps and kBitmap (mostly isolated changes:
// fixed-size moves), run by run for kRuns.
template <uint32_t ES>
void Scatter(const Info& info, const uint8_t* idx, uint64_t index_bytes, uint8_t* dst) {
  const uint8_t* values = idx + index_bytes;
  const uint8_t* end = idx + index_bytes;
  switch (info.format) {
    case Format::kGaps: {
      uint64_t next = 0;
      while (idx != end) {
        uint64_t gap = *idx;
        if (gap < 0x80) {
          ++idx;
        } else {
          GetVarint(&idx, end, &gap);
        }
        const uint64_t i = next + gap;
        std::memcpy(dst + i * ES, values, ES);
        values += ES;
        next = i + 1;
      }
      break;
    }
    case Format::kBitmap:
      for (uint64_t w = 0; w < index_bytes; w += 8) {
        uint64_t word = 0;
        std::memcpy(&word, idx + w, std::min<uint64_t>(8, index_bytes - w));
        while (word != 0) {
          const uint64_t i = w * 8 + static_cast<uint64_t>(__builtin_ctzll(word));
          word &= word - 1;
          std::memcpy(dst + i * ES, values, ES);
          values += ES;
        }
      }
      break;
    case Format::kRuns:
      DecodeRuns(info, idx, index_bytes, values, [&](uint64_t first, uint64_t count, const uint8_t* v) {
        std::memcpy(dst + first * ES, v, count * ES);
      }).IgnoreError();
      break;
  }
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

namespace testing {

std::vector<std::string> CompareKernels() {
  std::vector<std::string> names;
  for (const Kernel& k : Kernels()) names.push_back(k.name);
  return names;
}

bool UseCompareKernel(const std::string& name) {
  for (const Kernel& k : Kernels()) {
    if (name == k.name) {
      kScan = k.fn;
      return true;
    }
  }
  return false;
}

}  // namespace testing

uint64_t Checksum(const uint8_t* data, uint64_t bytes) { return XXH3_64bits(data, bytes); }

ChecksumStream::ChecksumStream() : state_(XXH3_createState()) { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }
ChecksumStream::~ChecksumStream() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void ChecksumStream::Update(const uint8_t* data, uint64_t bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, bytes);
}
uint64_t ChecksumStream::Digest() const { return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)); }

EncodeResult Encode(const uint8_t* old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                    std::string* out) {
  return Dispatch(nullptr, old, neu, bytes, EncodeOptions(), elem_size, limit, out);
}

EncodeResult CopyAndEncode(uint8_t* dst_old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                           std::string* out) {
  return Dispatch(dst_old, dst_old, neu, bytes, EncodeOptions(), elem_size, limit, out);
}

EncodeResult CopyAndEncode(uint8_t* dst_old, const uint8_t* neu, uint64_t bytes, uint32_t elem_size, uint64_t limit,
                           const EncodeOptions& options, std::string* out) {
  return Dispatch(dst_old, dst_old, neu, bytes, options, elem_size, limit, out);
}

absl::StatusOr<Info> Inspect(const uint8_t* enc, uint64_t enc_bytes) {
  uint64_t index_bytes = 0;
  WSYNC_ASSIGN_OR_RETURN(Info info, ParseHeader(enc, enc_bytes, &index_bytes));
  const uint8_t* idx = enc + kHeaderBytes;
  if (info.format == Format::kGaps) {
    WSYNC_RETURN_IF_ERROR(ValidateGaps(info, idx, idx + index_bytes));
  } else {
    WSYNC_RETURN_IF_ERROR(
        DecodeRuns(info, idx, index_bytes, idx + index_bytes, [](uint64_t, uint64_t, const uint8_t*) {}));
  }
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
  // Validated above, so this pass cannot fail.
  switch (info.elem_size) {
    case 1:
      Scatter<1>(info, idx, index_bytes, dst);
      break;
    case 2:
      Scatter<2>(info, idx, index_bytes, dst);
      break;
    default:
      Scatter<4>(info, idx, index_bytes, dst);
      break;
  }
  if (consumed != nullptr) *consumed = info.encoded_bytes;
  return absl::OkStatus();
}

absl::StatusOr<OneSidedPlan> PlanOneSidedWrites(const uint8_t* enc, uint64_t enc_bytes, const OneSidedCost& cost) {
  if (!(cost.per_write_seconds >= 0) || !(cost.bytes_per_second > 0))
    return absl::InvalidArgumentError("one-sided write cost: per-write seconds >= 0 and a positive rate");
  WSYNC_ASSIGN_OR_RETURN(Info info, Inspect(enc, enc_bytes));
  // Bridging a gap of g bytes costs g / rate; a separate write costs per_write: bridge while g < per_write × rate.
  const double bridge = cost.per_write_seconds * cost.bytes_per_second;
  OneSidedPlan plan;
  const uint64_t es = info.elem_size;
  WSYNC_RETURN_IF_ERROR(ForEachRun(enc, enc_bytes, [&](uint64_t first, uint64_t count, const uint8_t*) {
    const uint64_t begin = first * es, bytes = count * es;
    if (!plan.writes.empty()) {
      auto& last = plan.writes.back();
      const uint64_t end = last.first + last.second;
      if (static_cast<double>(begin - end) < bridge) {
        last.second = begin + bytes - last.first;
        return;
      }
    }
    plan.writes.emplace_back(begin, bytes);
  }));
  for (const auto& w : plan.writes) plan.write_bytes += w.second;
  plan.runs_seconds = static_cast<double>(plan.writes.size()) * cost.per_write_seconds +
                      static_cast<double>(plan.write_bytes) / cost.bytes_per_second;
  plan.dense_seconds = cost.per_write_seconds + static_cast<double>(info.range_bytes) / cost.bytes_per_second;
  plan.dense = plan.runs_seconds >= plan.dense_seconds;
  if (plan.dense) plan.writes.clear();
  return plan;
}

}  // namespace wsync::replica::delta
