#include "replica/delta.h"

#include <xxhash.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "replica/delta_testing.h"

namespace wsync::replica::delta {
namespace {

using Bytes = std::vector<uint8_t>;

// The naive reference: indices of the elements whose bytes differ, one element at a time.
std::vector<uint64_t> NaiveChanged(const Bytes& a, const Bytes& b, uint32_t es) {
  std::vector<uint64_t> out;
  for (uint64_t i = 0; i < a.size() / es; ++i) {
    if (std::memcmp(a.data() + i * es, b.data() + i * es, es) != 0) out.push_back(i);
  }
  return out;
}

uint64_t Leb128Size(uint64_t v) {
  uint64_t n = 1;
  while (v >= 0x80) v >>= 7, ++n;
  return n;
}

// The index-section sizes of the three formats, from the format's definition.
struct FormatSizes {
  uint64_t bitmap, gaps, runs;
};
FormatSizes NaiveSizes(const std::vector<uint64_t>& idx, uint64_t elems) {
  FormatSizes s{(elems + 7) / 8, 0, 0};
  uint64_t next = 0;
  for (size_t k = 0; k < idx.size(); ++k) {
    s.gaps += Leb128Size(idx[k] - next);
    next = idx[k] + 1;
  }
  next = 0;
  for (size_t k = 0; k < idx.size();) {
    size_t e = k + 1;
    while (e < idx.size() && idx[e] == idx[e - 1] + 1) ++e;
    s.runs += Leb128Size(idx[k] - next) + Leb128Size(e - k - 1);
    next = idx[e - 1] + 1;
    k = e;
  }
  return s;
}

void PutLeb(std::string* s, uint64_t v) {
  while (v >= 0x80) s->push_back(static_cast<char>((v & 0x7f) | 0x80)), v >>= 7;
  s->push_back(static_cast<char>(v));
}

// Builds a frame by hand from the documented layout (independent of the encoder), with a valid frame checksum, so
// the decoder's own range and count checks are what must refuse it.
std::string HandFrame(uint8_t format, uint8_t es, uint64_t range_bytes, uint64_t changed, const std::string& index,
                      const std::string& values, uint64_t base_sum, uint64_t new_sum = 0) {
  std::string f(56, '\0');
  auto put64 = [&](size_t off, uint64_t v) { std::memcpy(&f[off], &v, 8); };
  const uint32_t magic = 0x4C445357;
  std::memcpy(&f[0], &magic, 4);
  f[4] = 1;
  f[5] = static_cast<char>(format);
  f[6] = static_cast<char>(es);
  f[7] = 0;
  put64(8, range_bytes);
  put64(16, changed);
  put64(24, index.size());
  put64(32, base_sum);
  put64(40, new_sum);
  const std::string payload = index + values;
  put64(48, XXH3_64bits_withSeed(payload.data(), payload.size(), XXH3_64bits(f.data(), 48)));
  return f + payload;
}

const uint8_t* U8(const std::string& s) { return reinterpret_cast<const uint8_t*>(s.data()); }

// Encodes old→neu, checks the encoding against the naive reference, applies it to a copy of old and checks the
// result is neu. Returns the encoding.
std::string RoundTrip(const Bytes& old, const Bytes& neu, uint32_t es) {
  const std::vector<uint64_t> changed = NaiveChanged(old, neu, es);
  const uint64_t elems = old.size() / es;
  const FormatSizes sizes = NaiveSizes(changed, elems);
  const uint64_t expect_bytes = 56 + std::min({sizes.bitmap, sizes.gaps, sizes.runs}) + changed.size() * es;

  std::string enc = "prefix";
  const EncodeResult r = Encode(old.data(), neu.data(), old.size(), es, UINT64_MAX, &enc);
  REQUIRE_FALSE(r.dense_smaller);
  REQUIRE(r.changed_elems == changed.size());
  REQUIRE(r.encoded_bytes == expect_bytes);  // the smallest format was chosen
  REQUIRE(enc.size() == 6 + expect_bytes);
  REQUIRE(enc.compare(0, 6, "prefix") == 0);  // appended, not overwritten
  enc.erase(0, 6);

  const auto info = Inspect(U8(enc), enc.size());
  REQUIRE(info.ok());
  REQUIRE(info->changed_elems == changed.size());
  REQUIRE(info->elem_size == es);
  REQUIRE(info->range_bytes == old.size());
  REQUIRE(info->base_checksum == XXH3_64bits(old.data(), old.size()));
  REQUIRE(info->new_checksum == XXH3_64bits(neu.data(), neu.size()));

  // The runs name exactly the naive changed elements with neu's values.
  std::vector<uint64_t> listed;
  REQUIRE(ForEachRun(U8(enc), enc.size(), [&](uint64_t first, uint64_t count, const uint8_t* values) {
            REQUIRE(count > 0);
            REQUIRE(std::memcmp(values, neu.data() + first * es, count * es) == 0);
            for (uint64_t k = 0; k < count; ++k) listed.push_back(first + k);
          }).ok());
  REQUIRE(listed == changed);

  Bytes dst = old;
  uint64_t consumed = 0;
  const absl::Status s = Apply(dst.data(), dst.size(), U8(enc), enc.size(), &consumed);
  REQUIRE(s.ok());
  REQUIRE(consumed == enc.size());
  REQUIRE(dst == neu);

  // CopyAndEncode gives the same bytes and leaves neu in the old buffer.
  Bytes replica = old;
  std::string enc2;
  const EncodeResult r2 = CopyAndEncode(replica.data(), neu.data(), neu.size(), es, UINT64_MAX, &enc2);
  REQUIRE(r2.encoded_bytes == r.encoded_bytes);
  REQUIRE(enc2 == enc);
  REQUIRE(replica == neu);
  return enc;
}

Bytes Random(std::mt19937_64& rng, size_t n) {
  Bytes b(n);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

TEST_CASE("delta: round trips on adversarial patterns, every element size and unaligned lengths") {
  std::mt19937_64 rng(28);
  for (uint32_t es : {1u, 2u, 4u}) {
    for (uint64_t elems : {1ull, 2ull, 7ull, 15ull, 16ull, 17ull, 31ull, 32ull, 33ull, 63ull, 64ull, 65ull, 127ull,
                           1000ull, 4097ull, 8191ull, 20000ull}) {
      CAPTURE(es, elems);
      const Bytes old = Random(rng, elems * es);
      SECTION("no change") { RoundTrip(old, old, es); }
      SECTION("all change") {
        Bytes neu = old;
        for (auto& x : neu) x ^= 0xA5;
        RoundTrip(old, neu, es);
      }
      SECTION("first and last element, one byte each") {
        Bytes neu = old;
        neu[0] ^= 1;
        neu[neu.size() - 1] ^= 0x80;
        RoundTrip(old, neu, es);
      }
      SECTION("only the last byte of each element") {
        Bytes neu = old;
        for (uint64_t i = 0; i < elems; i += 3) neu[i * es + es - 1] ^= 0x40;
        RoundTrip(old, neu, es);
      }
      SECTION("sparse random") {
        Bytes neu = old;
        for (uint64_t k = 0; k < elems / 50 + 1; ++k) neu[rng() % neu.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
        RoundTrip(old, neu, es);
      }
      SECTION("dense random (half the elements)") {
        Bytes neu = old;
        for (uint64_t i = 0; i < elems; ++i) {
          if (rng() & 1) neu[i * es] ^= 0x11;
        }
        RoundTrip(old, neu, es);
      }
      SECTION("clustered runs with long gaps") {
        Bytes neu = old;
        for (uint64_t start = rng() % 300; start < elems; start += 300 + rng() % 5000) {
          const uint64_t len = std::min<uint64_t>(1 + rng() % 200, elems - start);
          for (uint64_t i = start; i < start + len; ++i) neu[i * es] ^= 0x5A;
        }
        RoundTrip(old, neu, es);
      }
    }
  }
}

TEST_CASE("delta: every compare kernel this CPU has finds exactly the naive reference's changes") {
  const std::vector<std::string> kernels = testing::CompareKernels();
  REQUIRE(kernels.back() == "scalar");
  REQUIRE_FALSE(testing::UseCompareKernel("no-such-kernel"));
  struct Restore {  // the widest kernel again for the other test cases, also when a REQUIRE fails
    std::string widest;
    ~Restore() { testing::UseCompareKernel(widest); }
  } restore{kernels.front()};
  std::mt19937_64 rng(31);
  for (const std::string& kernel : kernels) {
    REQUIRE(testing::UseCompareKernel(kernel));
    for (uint32_t es : {1u, 2u, 4u}) {
      for (uint64_t elems : {1ull, 31ull, 32ull, 33ull, 64ull, 65ull, 4097ull, 20011ull}) {
        CAPTURE(kernel, es, elems);
        const Bytes old = Random(rng, elems * es);
        Bytes edges = old, sparse = old, half = old, all = old;
        edges[0] ^= 1, edges[edges.size() - 1] ^= 1;
        for (uint64_t k = 0; k < elems / 40 + 1; ++k) sparse[rng() % sparse.size()] ^= 0x10;
        for (uint64_t i = 0; i < elems; i += 2) half[i * es + rng() % es] ^= 0x01;
        for (auto& x : all) x = static_cast<uint8_t>(~x);
        for (const Bytes* neu : std::vector<const Bytes*>{&old, &edges, &sparse, &half, &all}) RoundTrip(old, *neu, es);
      }
    }
  }
}

TEST_CASE("delta: each format is chosen where it is smallest") {
  std::mt19937_64 rng(7);
  const uint64_t elems = 100000;
  const Bytes old = Random(rng, elems * 2);
  auto format_of = [&](const Bytes& neu) {
    const std::string enc = RoundTrip(old, neu, 2);
    return Inspect(U8(enc), enc.size())->format;
  };
  Bytes few = old;
  for (uint64_t i = 0; i < elems; i += 997) few[i * 2] ^= 1;
  CHECK(format_of(few) == Format::kGaps);
  Bytes many = old;
  for (uint64_t i = 0; i < elems; i += 3) many[i * 2] ^= 1;
  CHECK(format_of(many) == Format::kBitmap);
  Bytes blocks = old;
  for (uint64_t i = 0; i < elems; i += 1024) {
    for (uint64_t k = i; k < i + 128; ++k) blocks[k * 2] ^= 1;
  }
  CHECK(format_of(blocks) == Format::kRuns);
}

TEST_CASE("delta: the limit refuses encodings larger than dense and appends nothing") {
  std::mt19937_64 rng(3);
  const Bytes old = Random(rng, 4096);
  Bytes neu = old;
  for (size_t i = 0; i < neu.size(); i += 64) neu[i] ^= 1;
  std::string enc;
  const EncodeResult full = Encode(old.data(), neu.data(), old.size(), 2, UINT64_MAX, &enc);
  REQUIRE(enc.size() == full.encoded_bytes);

  std::string out = "keep";
  EncodeResult r = Encode(old.data(), neu.data(), old.size(), 2, full.encoded_bytes, &out);
  CHECK_FALSE(r.dense_smaller);
  CHECK(out == "keep" + enc);

  out = "keep";
  r = Encode(old.data(), neu.data(), old.size(), 2, full.encoded_bytes - 1, &out);
  CHECK(r.dense_smaller);
  CHECK(r.encoded_bytes == 0);
  CHECK(out == "keep");

  // All change: larger than dense, and CopyAndEncode still copies.
  Bytes all = old;
  for (auto& x : all) x = static_cast<uint8_t>(~x);
  Bytes replica = old;
  out.clear();
  r = CopyAndEncode(replica.data(), all.data(), all.size(), 2, all.size(), &out);
  CHECK(r.dense_smaller);
  CHECK(out.empty());
  CHECK(replica == all);

  // The compare stops once every format exceeds the limit (here about half way); CopyAndEncode still leaves the
  // whole new range in the replica: the chunks copied before the stop and the rest copied dense.
  const Bytes big_old = Random(rng, 200000);
  Bytes big_neu = big_old;
  for (size_t i = 0; i < 20000; i += 999) big_neu[i] ^= 1;
  for (size_t i = 20000; i < big_neu.size(); ++i) big_neu[i] ^= 0xFF;
  replica = big_old;
  out.clear();
  r = CopyAndEncode(replica.data(), big_neu.data(), big_neu.size(), 1, 100000, &out);
  CHECK(r.dense_smaller);
  CHECK(out.empty());
  CHECK(r.changed_elems < 150000);  // stopped early: a lower bound
  CHECK(replica == big_neu);

  // A limit below the header refuses even "no change".
  r = Encode(old.data(), old.data(), old.size(), 2, 55, &out);
  CHECK(r.dense_smaller);
}

TEST_CASE("delta: a checksum fed in pieces equals the one-shot checksum the header carries") {
  std::mt19937 rng(11);
  Bytes b(3 * 4096 + 17);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  for (uint64_t piece : {1ull, 7ull, 4096ull, 5000ull, static_cast<unsigned long long>(b.size())}) {
    ChecksumStream s;
    for (uint64_t at = 0; at < b.size(); at += piece) s.Update(b.data() + at, std::min<uint64_t>(piece, b.size() - at));
    CHECK(s.Digest() == Checksum(b.data(), b.size()));
    CHECK(s.Digest() == XXH3_64bits(b.data(), b.size()));  // the test's own hash: XXH3-64, seed 0
  }
  b[5] ^= 1;
  ChecksumStream s;
  s.Update(b.data(), b.size());
  CHECK(s.Digest() == XXH3_64bits(b.data(), b.size()));
}

TEST_CASE("delta: a known base checksum replaces the hash of old; a wrong one is refused by the target") {
  std::mt19937_64 rng(19);
  const Bytes old = Random(rng, 50000);
  Bytes neu = old;
  for (size_t i = 0; i < neu.size(); i += 101) neu[i] ^= 4;
  std::string plain;
  const EncodeResult r = Encode(old.data(), neu.data(), old.size(), 2, UINT64_MAX, &plain);
  CHECK(r.base_checksum == XXH3_64bits(old.data(), old.size()));
  CHECK(r.new_checksum == XXH3_64bits(neu.data(), neu.size()));

  EncodeOptions known;
  known.base_checksum = r.base_checksum;
  Bytes replica = old;
  std::string enc;
  CopyAndEncode(replica.data(), neu.data(), neu.size(), 2, UINT64_MAX, known, &enc);
  CHECK(enc == plain);
  CHECK(replica == neu);

  known.base_checksum = r.base_checksum ^ 1;  // stale: not the checksum of old's bytes
  replica = old;
  enc.clear();
  CopyAndEncode(replica.data(), neu.data(), neu.size(), 2, UINT64_MAX, known, &enc);
  Bytes dst = old;
  CHECK(Apply(dst.data(), dst.size(), U8(enc), enc.size(), nullptr).code() == absl::StatusCode::kFailedPrecondition);
  CHECK(dst == old);
}

TEST_CASE("delta: the sampled look sends nearly-all-changed ranges dense and never a sparse one") {
  std::mt19937_64 rng(7);
  const uint64_t bytes = 4u << 20;  // 2 Mi bf16 elements: sampled (over 4 x 256 chunks)
  Bytes old(bytes);
  for (auto& b : old) b = static_cast<uint8_t>(rng());
  const uint64_t limit = bytes - kHeaderBytes - 8;
  // Every element changed: Encode would scan the whole range to answer dense_smaller.
  Bytes all = old;
  for (uint64_t i = 0; i < bytes; i += 2) all[i] ^= 1;
  CHECK(SampledDenseSmaller(old.data(), all.data(), bytes, 2, limit));
  std::string out;
  CHECK(Encode(old.data(), all.data(), bytes, 2, limit, &out).dense_smaller);  // what the look spared
  // Sparse changes, scattered or clustered, whatever their share: the look answers false where a delta saves more
  // than a tenth (checked against Encode's exact answer).
  for (double share : {0.0, 0.001, 0.05, 0.3, 0.6}) {
    for (bool clustered : {false, true}) {
      Bytes neu = old;
      const uint64_t elems = bytes / 2;
      const uint64_t n = static_cast<uint64_t>(share * static_cast<double>(elems));
      if (clustered) {
        const uint64_t first = rng() % (elems - n + 1);
        for (uint64_t i = first; i < first + n; ++i) neu[2 * i] ^= 1;
      } else {
        for (uint64_t k = 0; k < n; ++k) neu[2 * (rng() % elems)] ^= 1;
      }
      std::string enc;
      const EncodeResult exact = Encode(old.data(), neu.data(), bytes, 2, limit, &enc);
      const bool looks_dense = SampledDenseSmaller(old.data(), neu.data(), bytes, 2, limit);
      INFO("share " << share << (clustered ? " clustered" : " scattered") << ": encoded " << exact.encoded_bytes);
      if (!clustered) {
        // Scattered changes are estimated well: never dense where the delta is under 0.8 of the limit.
        if (!exact.dense_smaller && exact.encoded_bytes < 0.8 * static_cast<double>(limit)) CHECK_FALSE(looks_dense);
      }
      if (looks_dense) CHECK(exact.dense_smaller | (exact.encoded_bytes > 0.5 * static_cast<double>(limit)));
    }
  }
  // Small ranges are not sampled; element sizes the codec does not describe neither.
  CHECK_FALSE(SampledDenseSmaller(old.data(), all.data(), 64 * 1023, 2, 64 * 1023));
  CHECK_FALSE(SampledDenseSmaller(old.data(), all.data(), bytes, 3, limit));
}

TEST_CASE("delta: element sizes the codec does not describe go dense") {
  const Bytes old(30, 1), neu(30, 2);
  Bytes replica = old;
  std::string out;
  CHECK(CopyAndEncode(replica.data(), neu.data(), 30, 3, 1000, &out).dense_smaller);
  CHECK(replica == neu);
  CHECK(Encode(old.data(), neu.data(), 30, 4, 1000, &out).dense_smaller);  // 30 is not a multiple of 4
  CHECK(out.empty());
}

// Applies `enc` to a copy of `base` expecting `code`; the destination must be untouched.
void ExpectRefused(const Bytes& base, const std::string& enc, absl::StatusCode code) {
  Bytes dst = base;
  uint64_t consumed = 12345;
  const absl::Status s = Apply(dst.data(), dst.size(), U8(enc), enc.size(), &consumed);
  CAPTURE(s.ToString());
  REQUIRE(s.code() == code);
  REQUIRE(dst == base);
  REQUIRE(consumed == 12345);
}

TEST_CASE("delta: every corruption is refused with the destination untouched") {
  std::mt19937_64 rng(11);
  const Bytes old = Random(rng, 3000);
  for (int pattern = 0; pattern < 3; ++pattern) {
    Bytes neu = old;
    if (pattern == 0) neu[17] ^= 1, neu[2000] ^= 2;  // gaps
    if (pattern == 1)
      for (size_t i = 0; i < neu.size(); i += 4) neu[i] ^= 1;  // bitmap
    if (pattern == 2)
      for (size_t i = 256; i < 768; ++i) neu[i] ^= 1;  // runs
    const std::string enc = RoundTrip(old, neu, 2);
    CAPTURE(pattern, static_cast<int>(Inspect(U8(enc), enc.size())->format));

    for (size_t i = 0; i < enc.size(); ++i) {
      for (uint8_t bit : {uint8_t{0x01}, uint8_t{0x80}}) {
        CAPTURE(i, static_cast<int>(bit));
        std::string bad = enc;
        bad[i] = static_cast<char>(bad[i] ^ bit);
        // The frame checksum covers the base checksum too: a flipped bit anywhere is a corrupt encoding.
        ExpectRefused(old, bad, absl::StatusCode::kInvalidArgument);
      }
    }
    for (size_t len = 0; len < enc.size(); ++len) {
      CAPTURE(len);
      ExpectRefused(old, enc.substr(0, len), absl::StatusCode::kInvalidArgument);
    }
    // Wrong base: the delta is applied onto something other than `old`.
    Bytes other = old;
    other[2999] ^= 1;
    ExpectRefused(other, enc, absl::StatusCode::kFailedPrecondition);
    // Wrong length of destination.
    Bytes longer = old;
    longer.push_back(0);
    longer.push_back(0);
    ExpectRefused(longer, enc, absl::StatusCode::kInvalidArgument);
    // Extra bytes after a frame are not consumed (several frames may follow each other).
    Bytes dst = old;
    uint64_t consumed = 0;
    const std::string two = enc + enc;
    REQUIRE(Apply(dst.data(), dst.size(), U8(two), two.size(), &consumed).ok());
    REQUIRE(consumed == enc.size());
    REQUIRE(dst == neu);
  }
}

TEST_CASE("delta: hand-built frames with valid checksums but bad indices are refused") {
  std::mt19937_64 rng(5);
  const Bytes base = Random(rng, 64);  // 32 elements of 2 bytes
  const uint64_t sum = XXH3_64bits(base.data(), base.size());
  const std::string v1("\x01\x02", 2), v2("\x01\x02\x03\x04", 4);
  auto leb = [](std::initializer_list<uint64_t> xs) {
    std::string s;
    for (uint64_t x : xs) PutLeb(&s, x);
    return s;
  };

  SECTION("a well-formed hand frame applies (the layout the test assumes is the codec's)") {
    const std::string ok = HandFrame(2, 2, 64, 2, leb({3, 27}), v2, sum);
    Bytes dst = base;
    uint64_t consumed = 0;
    REQUIRE(Apply(dst.data(), dst.size(), U8(ok), ok.size(), &consumed).ok());
    Bytes expect = base;
    expect[6] = 1, expect[7] = 2, expect[62] = 3, expect[63] = 4;
    REQUIRE(dst == expect);
    const std::string runs = HandFrame(3, 2, 64, 2, leb({30, 1}), v2, sum);
    dst = base;
    REQUIRE(Apply(dst.data(), dst.size(), U8(runs), runs.size(), &consumed).ok());
    expect = base;
    expect[60] = 1, expect[61] = 2, expect[62] = 3, expect[63] = 4;
    REQUIRE(dst == expect);
  }
  SECTION("gap past the end") {
    ExpectRefused(base, HandFrame(2, 2, 64, 1, leb({32}), v1, sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(2, 2, 64, 2, leb({31, 0}), v2, sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(2, 2, 64, 1, leb({UINT64_MAX}), v1, sum), absl::StatusCode::kInvalidArgument);
  }
  SECTION("run past the end") {
    ExpectRefused(base, HandFrame(3, 2, 64, 2, leb({31, 1}), v2, sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(3, 2, 64, 1, leb({UINT64_MAX, 0}), v1, sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(3, 2, 64, 1, leb({0, UINT64_MAX}), v1, sum), absl::StatusCode::kInvalidArgument);
  }
  SECTION("bitmap bit past the end and wrong bitmap length") {
    std::string bm(4, '\0');
    bm[3] = static_cast<char>(0x80);  // element 31: in range
    Bytes dst = base;
    const std::string ok = HandFrame(1, 2, 64, 1, bm, v1, sum);
    REQUIRE(Apply(dst.data(), dst.size(), U8(ok), ok.size(), nullptr).ok());
    const Bytes base3 = Random(rng, 60);  // 30 elements: bits 30, 31 of the last byte are past the end
    const uint64_t sum3 = XXH3_64bits(base3.data(), base3.size());
    ExpectRefused(base3, HandFrame(1, 2, 60, 1, bm, v1, sum3), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(1, 2, 64, 1, bm + '\0', v1, sum), absl::StatusCode::kInvalidArgument);
  }
  SECTION("counts that disagree with the index section") {
    ExpectRefused(base, HandFrame(2, 2, 64, 1, leb({3, 27}), v1, sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(2, 2, 64, 2, leb({3}), v2, sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(3, 2, 64, 1, leb({3, 1}), v1, sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(2, 2, 64, 33, leb({}), std::string(66, 'x'), sum),
                  absl::StatusCode::kInvalidArgument);
  }
  SECTION("truncated varint, bad element size, range not a multiple of it, unknown format") {
    ExpectRefused(base, HandFrame(2, 2, 64, 1, std::string("\x80", 1), v1, sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(2, 3, 64, 0, "", "", sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(2, 4, 62, 0, "", "", sum), absl::StatusCode::kInvalidArgument);
    ExpectRefused(base, HandFrame(4, 2, 64, 0, "", "", sum), absl::StatusCode::kInvalidArgument);
  }
  SECTION("a valid frame on the wrong base") {
    ExpectRefused(base, HandFrame(2, 2, 64, 1, leb({3}), v1, sum ^ 1), absl::StatusCode::kFailedPrecondition);
  }
}

TEST_CASE(
    "delta: one-sided writes coalesce nearby runs and save nothing over one dense write when changes are scattered") {
  // The Mooncake figures measured on the build machine (docs/delta.md): ~45 us per write, ~1 GB/s.
  const OneSidedCost cost{45e-6, 1e9};  // bridge gaps below 45 000 bytes
  std::mt19937_64 rng(3);
  const uint64_t bytes = 8u << 20;  // a 4 Mi-element bf16 parameter
  const Bytes old = Random(rng, bytes);
  auto plan_for = [&](const Bytes& neu) {
    std::string enc;
    REQUIRE_FALSE(Encode(old.data(), neu.data(), bytes, 2, ~0ull, &enc).dense_smaller);
    auto plan = PlanOneSidedWrites(U8(enc), enc.size(), cost);
    REQUIRE(plan.ok());
    return *plan;
  };
  SECTION("a few clustered changes: coalesced writes, far cheaper than dense") {
    Bytes neu = old;
    for (uint64_t at : {1000ull, 1010ull, 20000ull, 3000000ull}) neu[2 * at] ^= 1;  // 1000..20000: one write
    const OneSidedPlan p = plan_for(neu);
    CHECK_FALSE(p.dense);
    REQUIRE(p.writes.size() == 2);
    CHECK(p.writes[0] == std::make_pair<uint64_t, uint64_t>(2000, 2 * 20000 + 2 - 2000));
    CHECK(p.writes[1] == std::make_pair<uint64_t, uint64_t>(6000000, 2));
    CHECK(p.runs_seconds < 0.2 * p.dense_seconds);
  }
  SECTION("RL-step sparsity (1.4 % of the elements, scattered): no saving over dense") {
    Bytes neu = old;
    for (uint64_t k = 0; k < bytes / 2 * 14 / 1000; ++k) neu[2 * (rng() % (bytes / 2))] ^= 1;
    const OneSidedPlan p = plan_for(neu);
    // Every gap is bridged: at most one write spanning the first to the last change, i.e. dense in all but name.
    CHECK(p.runs_seconds > 0.99 * p.dense_seconds);
    CHECK((p.dense || (p.writes.size() == 1 && p.write_bytes > 0.99 * bytes)));
  }
  SECTION("no change: nothing to write") {
    const OneSidedPlan p = plan_for(old);
    CHECK_FALSE(p.dense);
    CHECK(p.writes.empty());
    CHECK(p.runs_seconds == 0);
  }
  SECTION("a corrupt encoding or a cost without a rate is refused") {
    Bytes neu = old;
    neu[10] ^= 1;
    std::string enc;
    Encode(old.data(), neu.data(), bytes, 2, ~0ull, &enc);
    CHECK_FALSE(PlanOneSidedWrites(U8(enc), enc.size(), OneSidedCost{1e-5, 0}).ok());
    enc[enc.size() - 1] ^= 1;
    CHECK(PlanOneSidedWrites(U8(enc), enc.size(), cost).status().code() == absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace wsync::replica::delta
