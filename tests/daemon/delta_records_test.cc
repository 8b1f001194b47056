// The target daemon's check of the delta records a source staged (CheckDeltaRecords, what ApplyDelta runs before it
// writes anything): real encodings from replica/delta.h, then corrupted, out of range, of another update, in a
// segment it cannot apply into, or outside the plan's ranges for the source — each refused with the rank and
// parameter named. And what of a ConfigureSource the source's delta base depends on (DeltaBaseShape).

#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "daemon/node/source_node.h"
#include "daemon/node/target_node.h"
#include "replica/delta.h"

namespace wsync::daemon {
namespace {

constexpr int64_t kVersion = 42;

v1::RankLayout Layout() {
  v1::RankLayout l;
  auto* s0 = l.add_segments();
  s0->set_id(0);
  s0->set_kind("host");
  s0->set_bytes(4096);
  auto* s1 = l.add_segments();
  s1->set_id(1);
  s1->set_kind("cuda");
  s1->set_bytes(4096);
  auto add = [&](const std::string& name, int seg, uint64_t offset, uint64_t bytes) {
    auto* p = l.add_params();
    p->set_name(name);
    p->set_dtype("bfloat16");
    p->set_segment(seg);
    p->set_offset(offset);
    p->set_bytes(bytes);
  };
  add("a.weight", 0, 0, 1024);
  add("b.weight", 0, 1024, 2048);
  add("c.weight", 1, 0, 512);
  return l;
}

const std::map<int, uint64_t> kHost = {{0, 4096}};

// Appends one record: the encoding of a range whose every 10th bf16 element changed.
void Append(std::string* staging, uint32_t param, uint64_t offset, uint64_t length, int64_t version = kVersion) {
  std::vector<uint8_t> old(length), neu(length);
  for (uint64_t i = 0; i < length; ++i) old[i] = neu[i] = static_cast<uint8_t>(i * 7);
  for (uint64_t i = 0; i + 1 < length; i += 20) neu[i] ^= 0x5a;
  std::string enc;
  auto r = replica::delta::Encode(old.data(), neu.data(), length, 2, length, &enc);
  REQUIRE_FALSE(r.dense_smaller);
  DeltaRecordHeader h{kDeltaRecordMagic, param, version, offset, length, enc.size()};
  std::string rec(DeltaRecordBytes(enc.size()), '\0');
  std::memcpy(rec.data(), &h, sizeof(h));
  std::memcpy(rec.data() + sizeof(h), enc.data(), enc.size());
  staging->append(rec);
}

absl::StatusOr<std::vector<DeltaRecordRef>> Check(const std::string& staging, uint32_t records,
                                                  const std::vector<v1::WriteRange>* owned = nullptr) {
  const v1::RankLayout layout = Layout();
  return CheckDeltaRecords(reinterpret_cast<const uint8_t*>(staging.data()), staging.size(), records, kVersion, layout,
                           kHost, owned, "engine e0 rank 1");
}

void Refused(const absl::StatusOr<std::vector<DeltaRecordRef>>& r, absl::StatusCode code, const std::string& says) {
  INFO(r.status().ToString());
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == code);
  CHECK(absl::StrContains(r.status().message(), "engine e0 rank 1"));
  CHECK(absl::StrContains(r.status().message(), says));
  CHECK(absl::StrContains(r.status().message(), "nothing was written"));
}

TEST_CASE("delta records: well-formed records of the update in host parameters are accepted") {
  std::string s;
  Append(&s, 0, 0, 1024);
  Append(&s, 1, 512, 1024);
  auto r = Check(s, 2);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  REQUIRE(r->size() == 2);
  CHECK((*r)[0].param == 0);
  CHECK((*r)[1].param == 1);
  CHECK((*r)[1].offset == 512);
  CHECK((*r)[1].length == 1024);
  // Inside the plan's ranges for the source: accepted too.
  std::vector<v1::WriteRange> owned(2);
  owned[0].set_param("a.weight");
  owned[0].set_offset(0);
  owned[0].set_length(1024);
  owned[1].set_param("b.weight");
  owned[1].set_offset(0);
  owned[1].set_length(2048);
  CHECK(Check(s, 2, &owned).ok());
}

TEST_CASE("delta records: each kind of bad record is refused, naming the rank, the record and the parameter") {
  std::string good;
  Append(&good, 0, 0, 1024);
  SECTION("another update's record") {
    std::string s;
    Append(&s, 0, 0, 1024, kVersion - 1);
    Refused(Check(s, 1), absl::StatusCode::kInvalidArgument, "is not a record of update 42");
  }
  SECTION("a corrupt header") {
    std::string s = good;
    s[0] ^= 1;
    Refused(Check(s, 1), absl::StatusCode::kInvalidArgument, "record 0 at byte 0");
  }
  SECTION("a parameter index out of range") {
    std::string s;
    Append(&s, 7, 0, 1024);
    Refused(Check(s, 1), absl::StatusCode::kInvalidArgument, "names parameter index 7 but the rank has 3");
  }
  SECTION("a range outside its parameter") {
    std::string s;
    Append(&s, 0, 512, 1024);
    Refused(Check(s, 1), absl::StatusCode::kInvalidArgument, "a.weight [512, +1024)");
  }
  SECTION("a parameter in a segment the target cannot apply records into (not imported)") {
    std::string s;
    Append(&s, 2, 0, 512);
    Refused(Check(s, 1), absl::StatusCode::kInvalidArgument, "c.weight [0, +512): not in a segment of the rank");
  }
  SECTION("a range the plan gives another source") {
    std::vector<v1::WriteRange> owned(1);
    owned[0].set_param("a.weight");
    owned[0].set_offset(0);
    owned[0].set_length(512);
    Refused(Check(good, 1, &owned), absl::StatusCode::kPermissionDenied,
            "a.weight [0, +1024): the plan does not give that range to the source");
  }
  SECTION("an encoding longer than what was staged") {
    std::string s = good.substr(0, good.size() - 16);
    Refused(Check(s, 1), absl::StatusCode::kInvalidArgument, "is out of bounds");
  }
  SECTION("fewer records than the source reported") {
    Refused(Check(good, 2), absl::StatusCode::kInvalidArgument, "1 records in");
  }
  SECTION("a truncated header") {
    Refused(Check(good.substr(0, 20), 1), absl::StatusCode::kInvalidArgument, "is truncated");
  }
}

TEST_CASE("delta records: an accepted record applied onto a wrong base writes nothing") {
  std::string s;
  Append(&s, 0, 0, 1024);
  auto r = Check(s, 1);
  REQUIRE(r.ok());
  std::vector<uint8_t> dst(1024, 0xee);  // not the base the record was encoded against
  const std::vector<uint8_t> before = dst;
  uint64_t consumed = 0;
  absl::Status st = replica::delta::Apply(dst.data(), (*r)[0].length, (*r)[0].enc, (*r)[0].enc_bytes, &consumed);
  CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(dst == before);
  // Onto the right base it yields the new bytes.
  for (uint64_t i = 0; i < 1024; ++i) dst[i] = static_cast<uint8_t>(i * 7);
  REQUIRE(replica::delta::Apply(dst.data(), 1024, (*r)[0].enc, (*r)[0].enc_bytes, &consumed).ok());
  CHECK(consumed == (*r)[0].enc_bytes);
  for (uint64_t i = 0; i < 1024; i += 20) CHECK(dst[i] == static_cast<uint8_t>((i * 7) ^ 0x5a));
}

TEST_CASE("delta base: kept across a re-configuration that moves only where targets' memory is") {
  v1::ConfigureSourceRequest a;
  a.set_model_config_json("{\"architectures\":[\"X\"]}");
  a.set_plan_epoch(3);
  for (int r = 0; r < 2; ++r) {
    auto* t = a.add_targets();
    t->set_engine_id("e0");
    t->set_rank(r);
    t->set_target_daemon("10.0.0.1:7000");
    *t->mutable_layout() = Layout();
    for (auto& seg : *t->mutable_layout()->mutable_segments()) seg.set_region_descriptor("old-" + std::to_string(r));
  }
  const std::string shape = DeltaBaseShape(a);
  // A restarted target daemon: new regions, a new address, a new plan epoch; the same ranks and bytes.
  v1::ConfigureSourceRequest moved = a;
  moved.set_plan_epoch(4);
  moved.mutable_targets(1)->set_target_daemon("10.0.0.1:7123");
  for (auto& seg : *moved.mutable_targets(1)->mutable_layout()->mutable_segments()) seg.set_region_descriptor("new");
  CHECK(DeltaBaseShape(moved) == shape);
  CHECK(KeepsDeltaBase(shape, 5, DeltaBaseShape(moved)));
  CHECK_FALSE(KeepsDeltaBase(shape, -1, DeltaBaseShape(moved)));  // the base holds no complete version
  CHECK_FALSE(KeepsDeltaBase("", 5, DeltaBaseShape(moved)));      // no plan before
  // What a rank holds changes: another slice of a parameter, a parameter moved, another quantization, a rank more.
  v1::ConfigureSourceRequest sliced = a;
  auto* w = sliced.mutable_targets(0)->add_writes();
  w->set_param("a.weight");
  w->set_length(512);
  CHECK_FALSE(KeepsDeltaBase(shape, 5, DeltaBaseShape(sliced)));
  v1::ConfigureSourceRequest shifted = a;
  shifted.mutable_targets(0)->mutable_layout()->mutable_params(1)->set_offset(2048);
  CHECK_FALSE(KeepsDeltaBase(shape, 5, DeltaBaseShape(shifted)));
  v1::ConfigureSourceRequest fp8 = a;
  fp8.set_quantization("fp8_block");
  CHECK_FALSE(KeepsDeltaBase(shape, 5, DeltaBaseShape(fp8)));
  v1::ConfigureSourceRequest more = a;
  *more.add_targets() = a.targets(0);
  more.mutable_targets(2)->set_engine_id("e1");
  CHECK_FALSE(KeepsDeltaBase(shape, 5, DeltaBaseShape(more)));
}

}  // namespace
}  // namespace wsync::daemon
