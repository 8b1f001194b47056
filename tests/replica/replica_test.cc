#include "replica/replica.h"

#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "replica/convert.h"
#include "replica/fp8.h"
#include "replica/layout_plan.h"
#include "tests/replica/test_models.h"

namespace wsync::replica {
namespace {

using Shape = std::vector<int64_t>;

struct Tensor {
  std::string name;
  DType dtype = DType::kBF16;
  Shape shape;
  std::vector<uint8_t> data;
  HfTensor view() const {
    HfTensor t;
    t.name = name;
    t.dtype = dtype;
    t.shape = shape;
    t.data = data.data();
    t.bytes = data.size();
    return t;
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  uint16_t u16(int64_t i) const {
    uint16_t v;
    std::memcpy(&v, data.data() + 2 * i, 2);
    return v;
  }
};

// Raw 16-bit patterns base + flat index: every element is distinguishable after a byte copy.
Tensor Pattern(const std::string& name, Shape shape, uint16_t base) {
  Tensor t{name, DType::kBF16, std::move(shape), {}};
  t.data.resize(t.numel() * 2);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const uint16_t v = static_cast<uint16_t>(base + i);
    std::memcpy(t.data.data() + 2 * i, &v, 2);
  }
  return t;
}

// Random values in [-2, 2) as `dtype` (bf16 or f32).
Tensor Random(const TensorSpec& spec, uint32_t seed) {
  Tensor t{spec.name, spec.dtype, spec.shape, {}};
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  t.data.resize(t.numel() * DTypeSize(spec.dtype));
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float f = u(rng);
    if (spec.dtype == DType::kF32) {
      std::memcpy(t.data.data() + 4 * i, &f, 4);
    } else {
      const uint16_t b = F32ToBf16(f);
      std::memcpy(t.data.data() + 2 * i, &b, 2);
    }
  }
  return t;
}

uint16_t ParamU16(Replica& r, int layout, const std::string& param, int64_t i) {
  const EngineParam* p = r.table(layout).Find(param);
  REQUIRE(p != nullptr);
  uint16_t v;
  std::memcpy(&v, r.data(layout) + p->offset + 2 * i, 2);
  return v;
}

std::vector<std::vector<uint8_t>> Snapshot(Replica& r) {
  std::vector<std::vector<uint8_t>> s;
  for (int l = 0; l < r.num_layouts(); ++l) s.emplace_back(r.data(l), r.data(l) + r.table(l).total_bytes());
  return s;
}

TEST_CASE("qkv shard rows at tp=2 and tp=4 (hand-computed)", "[replica][ingest]") {
  ModelConfig c = testing::TinyQwen3();
  auto r = Replica::Create(c, {RankParallelism::ForTp(2, 1), RankParallelism::ForTp(4, 3), RankParallelism::ForTp(4, 0)},
                           {});
  REQUIRE(r.ok());
  Replica& rep = **r;
  rep.BeginUpdate();
  const std::string a = "model.layers.0.self_attn.";
  Tensor q = Pattern(a + "q_proj.weight", {8, 8}, 0x1000);
  Tensor k = Pattern(a + "k_proj.weight", {4, 8}, 0x2000);
  Tensor v = Pattern(a + "v_proj.weight", {4, 8}, 0x3000);
  auto rq = rep.Ingest(q.view());
  REQUIRE(rq.ok());
  CHECK(rq->empty());
  auto rk = rep.Ingest(k.view());
  REQUIRE(rk.ok());
  CHECK(rk->empty());
  auto rv = rep.Ingest(v.view());
  REQUIRE(rv.ok());
  CHECK(rv->size() == 3);  // qkv_proj complete in all three layouts

  // tp=2 rank 1: q heads 2,3 (rows 4..7), KV head 1 (k rows 2,3 then v rows 2,3).
  const std::vector<uint16_t> tp2r1 = {0x1020, 0x1028, 0x1030, 0x1038, 0x2010, 0x2018, 0x3010, 0x3018};
  // tp=4 rank 3: q head 3 (rows 6,7); 2 KV heads over 4 ranks → rank 3 loads KV head 3 / 2 = 1.
  const std::vector<uint16_t> tp4r3 = {0x1030, 0x1038, 0x2010, 0x2018, 0x3010, 0x3018};
  // tp=4 rank 0: q head 0, KV head 0.
  const std::vector<uint16_t> tp4r0 = {0x1000, 0x1008, 0x2000, 0x2008, 0x3000, 0x3008};
  const std::string qkv = a + "qkv_proj.weight";
  for (int row = 0; row < 8; ++row) {
    for (int col = 0; col < 8; ++col) CHECK(ParamU16(rep, 0, qkv, row * 8 + col) == tp2r1[row] + col);
  }
  for (int row = 0; row < 6; ++row) {
    for (int col = 0; col < 8; ++col) {
      CHECK(ParamU16(rep, 1, qkv, row * 8 + col) == tp4r3[row] + col);
      CHECK(ParamU16(rep, 2, qkv, row * 8 + col) == tp4r0[row] + col);
    }
  }
}

TEST_CASE("full update of a tiny model: rows, columns, padding, readiness", "[replica][ingest]") {
  ModelConfig c = testing::TinyQwen3();
  auto r = Replica::Create(c, {RankParallelism::ForTp(2, 0), RankParallelism::ForTp(2, 1)}, {});
  REQUIRE(r.ok());
  Replica& rep = **r;
  auto list = CheckpointTensors(c);
  REQUIRE(list.ok());
  for (int round = 0; round < 2; ++round) {  // a second update reuses the buffers
    rep.BeginUpdate();
    std::map<std::pair<int, int>, int> ready;
    uint16_t base = 0x0100;
    std::map<std::string, Tensor> sent;
    for (const TensorSpec& s : *list) {
      Tensor t = Pattern(s.name, s.shape, base);
      base = static_cast<uint16_t>(base + 0x0400);
      CHECK(rep.Needs(s.name));
      auto got = rep.Ingest(t.view());
      REQUIRE(got.ok());
      for (const ReadyParam& p : *got) ready[{p.layout, p.param}]++;
      sent.emplace(s.name, std::move(t));
    }
    CHECK(rep.FinishUpdate().ok());
    // Every parameter of both layouts reported ready exactly once.
    CHECK(ready.size() == rep.table(0).params().size() + rep.table(1).params().size());
    for (const auto& [k, n] : ready) CHECK(n == 1);

    const std::string m = "model.layers.1.mlp.";
    const Tensor& gate = sent.at(m + "gate_proj.weight");  // [4, 8]
    const Tensor& up = sent.at(m + "up_proj.weight");
    const Tensor& down = sent.at(m + "down_proj.weight");  // [8, 4]
    // Rank 1: gate rows 2,3 then up rows 2,3.
    for (int col = 0; col < 8; ++col) {
      CHECK(ParamU16(rep, 1, m + "gate_up_proj.weight", 0 * 8 + col) == gate.u16(2 * 8 + col));
      CHECK(ParamU16(rep, 1, m + "gate_up_proj.weight", 1 * 8 + col) == gate.u16(3 * 8 + col));
      CHECK(ParamU16(rep, 1, m + "gate_up_proj.weight", 2 * 8 + col) == up.u16(2 * 8 + col));
      CHECK(ParamU16(rep, 1, m + "gate_up_proj.weight", 3 * 8 + col) == up.u16(3 * 8 + col));
    }
    // Row-parallel down_proj: rank 1 holds input columns 2,3.
    for (int row = 0; row < 8; ++row) {
      CHECK(ParamU16(rep, 1, m + "down_proj.weight", row * 2 + 0) == down.u16(row * 4 + 2));
      CHECK(ParamU16(rep, 1, m + "down_proj.weight", row * 2 + 1) == down.u16(row * 4 + 3));
    }
    // Vocab 100 padded to 128: rank 1 holds rows 64..99, then 28 zero rows.
    const Tensor& emb = sent.at("model.embed_tokens.weight");
    CHECK(ParamU16(rep, 1, "model.embed_tokens.weight", 0) == emb.u16(64 * 8));
    CHECK(ParamU16(rep, 1, "model.embed_tokens.weight", 35 * 8 + 7) == emb.u16(99 * 8 + 7));
    for (int i = 36 * 8; i < 64 * 8; ++i) CHECK(ParamU16(rep, 1, "model.embed_tokens.weight", i) == 0);
    CHECK(ParamU16(rep, 0, "model.norm.weight", 5) == sent.at("model.norm.weight").u16(5));
    CHECK(ParamU16(rep, 1, "model.norm.weight", 5) == sent.at("model.norm.weight").u16(5));
  }
  rep.BeginUpdate();
  auto fin = rep.FinishUpdate();
  CHECK(fin.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(fin.message()), Catch::Contains("model.embed_tokens.weight"));
}

TEST_CASE("float32 and float16 inputs are converted like torch", "[replica][ingest]") {
  ModelConfig c = testing::TinyQwen3();
  auto r = Replica::Create(c, {RankParallelism::ForTp(1, 0)}, {});
  REQUIRE(r.ok());
  (*r)->BeginUpdate();
  // 1 + 2^-8 is halfway between bf16 1.0 and 1.0078125: ties to even (1.0). 1 + 3 * 2^-8 ties up to 1.015625.
  std::vector<float> vals = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -2.5f, 0.0f, 1e-40f, 65504.0f, 3.0e38f, 1.0f};
  Tensor t{"model.norm.weight", DType::kF32, {8}, std::vector<uint8_t>(32)};
  std::memcpy(t.data.data(), vals.data(), 32);
  REQUIRE((*r)->Ingest(t.view()).ok());
  // 1e-40 is a float32 subnormal; bf16 keeps subnormals (0x0001), as torch does.
  const std::vector<uint16_t> want = {0x3F80, 0x3F82, 0xC020, 0x0000, 0x0001, 0x4780, 0x7F62, 0x3F80};
  for (int i = 0; i < 8; ++i) CHECK(ParamU16(**r, 0, "model.norm.weight", i) == want[i]);

  Tensor h{"model.layers.0.input_layernorm.weight", DType::kF16, {8}, std::vector<uint8_t>(16)};
  const std::vector<uint16_t> halves = {0x3C00, 0xC000, 0x0001, 0x7BFF, 0x3555, 0, 0x8000, 0x3C01};
  std::memcpy(h.data.data(), halves.data(), 16);
  REQUIRE((*r)->Ingest(h.view()).ok());
  // 1.0, -2.0, 2^-24, 65504, 0.33325195 (f32 0x3EAAA000 → rounds up to 0x3EAB), 0, -0, 1.0009766 (→ 1.0).
  const std::vector<uint16_t> want_bf = {0x3F80, 0xC000, 0x3380, 0x4780, 0x3EAB, 0x0000, 0x8000, 0x3F80};
  for (int i = 0; i < 8; ++i) CHECK(ParamU16(**r, 0, "model.layers.0.input_layernorm.weight", i) == want_bf[i]);
}

TEST_CASE("bad tensors are rejected by name and write nothing", "[replica][validate]") {
  ModelConfig c = testing::TinyQwen3Moe();
  auto r = Replica::Create(c, {RankParallelism::ForTp(2, 0, 2), RankParallelism::ForTp(2, 1, 2)}, {});
  REQUIRE(r.ok());
  Replica& rep = **r;
  rep.BeginUpdate();
  Tensor ok = Pattern("model.layers.0.mlp.experts.1.up_proj.weight", {4, 8}, 0x100);
  REQUIRE(rep.Ingest(ok.view()).ok());
  const auto before = Snapshot(rep);

  auto expect_error = [&](const Tensor& t, absl::StatusCode code, const std::string& text) {
    INFO(t.name << " expecting " << text);
    absl::Status v = rep.Validate(t.view());
    CHECK(v.code() == code);
    CHECK_THAT(std::string(v.message()), Catch::Contains(t.name));
    CHECK_THAT(std::string(v.message()), Catch::Contains(text));
    auto in = rep.Ingest(t.view());
    REQUIRE_FALSE(in.ok());
    CHECK(in.status().code() == code);
    CHECK(Snapshot(rep) == before);
  };
  expect_error(Pattern("model.layers.0.self_attn.q_proj.weight", {8, 4}, 1), absl::StatusCode::kInvalidArgument,
               "shape [8, 4], expected [8, 8]");
  expect_error(Pattern("model.layers.0.self_attn.qq_proj.weight", {8, 8}, 1), absl::StatusCode::kInvalidArgument,
               "unknown tensor");
  expect_error(Pattern("model.layers.0.mlp.experts.4.up_proj.weight", {4, 8}, 1), absl::StatusCode::kOutOfRange,
               "expert id 4 out of range");
  Tensor i32 = Pattern("model.layers.0.self_attn.k_norm.weight", {2}, 1);
  i32.dtype = DType::kI32;
  i32.data.resize(8);
  // The refusal names the dtype the model holds (and that float32/float16 would have been converted).
  expect_error(i32, absl::StatusCode::kInvalidArgument, "dtype int32 is not accepted: the model holds it as bfloat16");
  expect_error(i32, absl::StatusCode::kInvalidArgument, "float32 and float16 are converted");
  Tensor fp8 = Pattern("model.layers.0.self_attn.k_norm.weight", {2}, 1);
  fp8.dtype = DType::kF8E4M3;
  fp8.data.resize(2);
  expect_error(fp8, absl::StatusCode::kInvalidArgument, "float8_e4m3fn is not accepted");
  // What BeginPush tells a trainer to push: the checkpoint's shape and dtype, nothing for an unknown name.
  auto want = rep.Expected("model.layers.0.self_attn.q_proj.weight");
  REQUIRE(want.has_value());
  CHECK(want->dtype == DType::kBF16);
  CHECK(want->shape == std::vector<int64_t>{8, 8});
  CHECK_FALSE(rep.Expected("model.layers.0.self_attn.qq_proj.weight").has_value());
  Tensor short_data = Pattern("model.layers.0.self_attn.k_norm.weight", {2}, 1);
  short_data.data.resize(2);
  expect_error(short_data, absl::StatusCode::kInvalidArgument, "2 bytes of data, expected 4");
  expect_error(ok, absl::StatusCode::kAlreadyExists, "arrived twice");
  // A 1-D tensor presented as 2-D is a shape error, not a reinterpretation.
  expect_error(Pattern("model.norm.weight", {8, 1}, 1), absl::StatusCode::kInvalidArgument, "shape [8, 1]");

  // After BeginUpdate the same tensor is welcome again.
  rep.BeginUpdate();
  CHECK(rep.Validate(ok.view()).ok());
}

TEST_CASE("push filter and skip rules with expert parallelism", "[replica][needs]") {
  ModelConfig c = testing::TinyQwen3Moe();
  auto r = Replica::Create(c, {RankParallelism::ForTp(2, 1, 2)}, {});  // EP rank 1: experts 2, 3
  REQUIRE(r.ok());
  Replica& rep = **r;
  CHECK(rep.Needs("model.layers.1.mlp.experts.2.gate_proj.weight"));
  CHECK(rep.Needs("model.layers.1.mlp.experts.3.down_proj.weight"));
  CHECK_FALSE(rep.Needs("model.layers.1.mlp.experts.0.gate_proj.weight"));
  CHECK(rep.Needs("model.layers.1.mlp.gate.weight"));
  CHECK(rep.Needs("model.layers.2.self_attn.q_proj.weight"));  // beyond num_layers: skipped by rule
  CHECK(rep.Needs("model.layers.0.self_attn.rotary_emb.inv_freq"));
  CHECK_FALSE(rep.Needs("model.layers.0.self_attn.nope.weight"));
  CHECK(rep.table(0).Find("model.layers.0.mlp.experts.w13_weight")->shape == Shape{2, 8, 8});

  rep.BeginUpdate();
  const auto before = Snapshot(rep);
  // Another EP rank's expert: accepted, ignored.
  auto other = rep.Ingest(Pattern("model.layers.0.mlp.experts.0.gate_proj.weight", {4, 8}, 7).view());
  REQUIRE(other.ok());
  CHECK(other->empty());
  auto mtp = rep.Ingest(Pattern("model.layers.2.whatever.weight", {3}, 7).view());
  REQUIRE(mtp.ok());
  CHECK(mtp->empty());
  CHECK(Snapshot(rep) == before);

  // w13 is ready only when gate and up of both local experts arrived; local index = global - 2.
  const std::string m = "model.layers.0.mlp.experts.";
  int ready = 0;
  for (int e : {2, 3}) {
    for (const char* p : {"gate_proj", "up_proj"}) {
      auto got = rep.Ingest(Pattern(absl::StrCat(m, e, ".", p, ".weight"), {4, 8}, 0x1000 * e + (p[0] == 'u') * 0x800)
                                .view());
      REQUIRE(got.ok());
      ready += static_cast<int>(got->size());
    }
  }
  CHECK(ready == 1);
  // Expert 3 (local 1), moe_tp 1: up rows start at I = 4 → element [1][4][0].
  CHECK(ParamU16(rep, 0, "model.layers.0.mlp.experts.w13_weight", (1 * 8 + 4) * 8) == 0x3800);
  CHECK(ParamU16(rep, 0, "model.layers.0.mlp.experts.w13_weight", (0 * 8 + 3) * 8 + 1) == 0x2000 + 3 * 8 + 1);
}

// FP8: quantizing at load equals quantizing the full tensor and slicing whole blocks, and fp8 pass-through of
// those full tensors (weights + weight_scale_inv) produces the same bytes.
TEST_CASE("fp8 block quantization at load and pass-through agree", "[replica][fp8]") {
  ModelConfig c = testing::TinyDeepseek();
  QuantSpec q;
  q.mode = QuantSpec::Mode::kFp8Block;
  q.block_n = q.block_k = 2;
  const std::vector<RankParallelism> ranks = {RankParallelism::ForTp(2, 0), RankParallelism::ForTp(2, 1)};
  auto at_load = Replica::Create(c, ranks, q);
  auto pass = Replica::Create(c, ranks, q);
  REQUIRE(at_load.ok());
  REQUIRE(pass.ok());
  auto trainer = CheckpointTensors(c);
  auto fp8_list = CheckpointTensors(c, CheckpointFormat::kFp8PassThrough, 2, 2);
  REQUIRE(trainer.ok());
  REQUIRE(fp8_list.ok());
  std::map<std::string, DType> fp8_dtype;
  for (const TensorSpec& s : *fp8_list) fp8_dtype[s.name] = s.dtype;

  (*at_load)->BeginUpdate();
  (*pass)->BeginUpdate();
  uint32_t seed = 1;
  for (const TensorSpec& s : *trainer) {
    Tensor t = Random(s, seed++);
    REQUIRE((*at_load)->Ingest(t.view()).ok());
    if (fp8_dtype.at(s.name) != DType::kF8E4M3) {
      REQUIRE((*pass)->Ingest(t.view()).ok());
      continue;
    }
    const int64_t rows = s.shape[0], cols = s.shape[1];
    Tensor w{s.name, DType::kF8E4M3, s.shape, std::vector<uint8_t>(rows * cols)};
    const Shape ss = {(rows + 1) / 2, (cols + 1) / 2};
    Tensor sc{s.name + "_scale_inv", DType::kF32, ss, std::vector<uint8_t>(ss[0] * ss[1] * 4)};
    REQUIRE(QuantizeFp8Block(DType::kBF16, t.data.data(), rows, cols, cols, 2, 2, w.data.data(), cols,
                             reinterpret_cast<float*>(sc.data.data()), ss[1])
                .ok());
    REQUIRE((*pass)->Ingest(w.view()).ok());
    // The scale of a weight that came as fp8 is required; after the weight it completes the pair.
    REQUIRE((*pass)->Ingest(sc.view()).ok());
  }
  CHECK((*at_load)->FinishUpdate().ok());
  CHECK((*pass)->FinishUpdate().ok());
  CHECK(Snapshot(**at_load) == Snapshot(**pass));

  // The published scale of a weight quantized here is refused (it would fill the scale twice).
  (*at_load)->BeginUpdate();
  const TensorSpec& qb = *std::find_if(trainer->begin(), trainer->end(),
                                       [](const TensorSpec& s) { return absl::EndsWith(s.name, "q_b_proj.weight"); });
  REQUIRE((*at_load)->Ingest(Random(qb, 3).view()).ok());
  Tensor qb_scale{qb.name + "_scale_inv", DType::kF32, {(qb.shape[0] + 1) / 2, (qb.shape[1] + 1) / 2}, {}};
  qb_scale.data.resize(qb_scale.numel() * 4);
  auto dup = (*at_load)->Ingest(qb_scale.view());
  CHECK(dup.status().code() == absl::StatusCode::kFailedPrecondition);

  // Without FP8, scales are unknown to the replica.
  auto plain = Replica::Create(c, ranks, {});
  REQUIRE(plain.ok());
  CHECK_FALSE((*plain)->Validate(qb_scale.view()).ok());
}

TEST_CASE("placement: bytes copied into a shared mapping by PlaceRects equal Load's, readiness once",
          "[replica][placement]") {
  // The FP8 pass-through checkpoint of a tiny DeepSeek (MLA, MoE experts, shared experts) at TP 2: fp8 codes and
  // their scales, bf16 and f32 tensors. One replica loads everything (the reference); the other gets every tensor
  // PlaceRects accepts copied in through its own MAP_SHARED mapping of fd(), as a trainer process does, and the
  // rest loaded.
  ModelConfig c = testing::TinyDeepseek();
  QuantSpec q;
  q.mode = QuantSpec::Mode::kFp8Block;
  q.block_n = q.block_k = 2;
  const std::vector<RankParallelism> ranks = {RankParallelism::ForTp(2, 0), RankParallelism::ForTp(2, 1)};
  auto loaded = Replica::Create(c, ranks, q);
  auto placed = Replica::Create(c, ranks, q);
  REQUIRE(loaded.ok());
  REQUIRE(placed.ok());
  auto list = CheckpointTensors(c, CheckpointFormat::kFp8PassThrough, 2, 2);
  REQUIRE(list.ok());
  std::vector<std::pair<uint8_t*, uint64_t>> maps;
  for (int l = 0; l < (*placed)->num_layouts(); ++l) {
    void* a = mmap(nullptr, (*placed)->mapped_bytes(l), PROT_READ | PROT_WRITE, MAP_SHARED, (*placed)->fd(l), 0);
    REQUIRE(a != MAP_FAILED);
    REQUIRE(a != (*placed)->data(l));
    maps.push_back({static_cast<uint8_t*>(a), (*placed)->mapped_bytes(l)});
  }
  for (int round = 0; round < 2; ++round) {
    (*loaded)->BeginUpdate();
    (*placed)->BeginUpdate();
    std::multiset<std::pair<int, int>> ready_loaded, ready_placed;
    int n_placed = 0;
    uint32_t seed = 11 + round * 1000;
    for (const TensorSpec& s : *list) {
      Tensor t{s.name, s.dtype, s.shape, std::vector<uint8_t>(s.bytes())};
      std::mt19937 rng(seed++);
      for (auto& b : t.data) b = static_cast<uint8_t>(rng() & 0x7e);  // no NaN patterns: compared as bytes anyway
      auto r = (*loaded)->Ingest(t.view());
      REQUIRE(r.ok());
      for (const auto& x : *r) ready_loaded.insert({x.layout, x.param});
      auto rects = (*placed)->PlaceRects(s.name, s.dtype);
      if (!rects.ok() || (*placed)->PlaceableDType(s.name) != s.dtype) {
        auto l = (*placed)->Ingest(t.view());
        REQUIRE(l.ok());
        for (const auto& x : *l) ready_placed.insert({x.layout, x.param});
        continue;
      }
      for (const PlacedRect& pr : *rects) {
        REQUIRE(pr.offset + (pr.rows - 1) * pr.pitch + pr.row_bytes <= maps[pr.layout].second);
        for (int64_t i = 0; i < pr.rows; ++i)
          std::memcpy(maps[pr.layout].first + pr.offset + i * pr.pitch,
                      t.data.data() + pr.src_offset + i * pr.src_pitch, pr.row_bytes);
      }
      HfTensor v = t.view();
      v.data = nullptr;  // the replica must not need the bytes
      REQUIRE((*placed)->ClaimPlaced({v}).ok());
      // A second arrival of it, placed or through Load, is refused.
      CHECK((*placed)->ClaimPlaced({v}).code() == absl::StatusCode::kAlreadyExists);
      CHECK((*placed)->Claim({t.view()}).code() == absl::StatusCode::kAlreadyExists);
      auto m = (*placed)->MarkPlaced(v);
      REQUIRE(m.ok());
      for (const auto& x : *m) ready_placed.insert({x.layout, x.param});
      ++n_placed;
    }
    CHECK(n_placed > static_cast<int>(list->size()) / 2);
    CHECK((*loaded)->FinishUpdate().ok());
    CHECK((*placed)->FinishUpdate().ok());
    CHECK(Snapshot(**loaded) == Snapshot(**placed));
    CHECK(ready_loaded == ready_placed);  // every parameter reported ready exactly once, by both
  }

  // A tensor that converts cannot be placed: a bf16 weight of an FP8 layout is quantized on load.
  const TensorSpec& w =
      *std::find_if(list->begin(), list->end(), [](const TensorSpec& s) { return s.dtype == DType::kF8E4M3; });
  auto bf16 = (*placed)->PlaceRects(w.name, DType::kBF16);
  CHECK(bf16.status().code() == absl::StatusCode::kFailedPrecondition);
  (*placed)->BeginUpdate();
  HfTensor v{w.name, DType::kBF16, w.shape, nullptr, w.bytes() / DTypeSize(w.dtype) * 2};
  CHECK((*placed)->ClaimPlaced({v}).code() == absl::StatusCode::kFailedPrecondition);
  for (auto& [a, n] : maps) munmap(a, n);
}

TEST_CASE("FP8 MLA KV-cache scales hold 1.0 and are ready once per update, with kv_b_proj", "[replica][fp8]") {
  QuantSpec q;
  q.mode = QuantSpec::Mode::kFp8Block;
  q.block_n = q.block_k = 2;
  auto r = Replica::Create(testing::TinyDeepseek(), {RankParallelism::ForTp(2, 0), RankParallelism::ForTp(2, 1)}, q);
  REQUIRE(r.ok());
  auto trainer = CheckpointTensors(testing::TinyDeepseek());
  REQUIRE(trainer.ok());
  for (int update = 0; update < 2; ++update) {
    (*r)->BeginUpdate();
    std::map<std::pair<int, int>, int> ready;
    uint32_t seed = 7;
    for (const TensorSpec& s : *trainer) {
      auto got = (*r)->Ingest(Random(s, seed++).view());
      REQUIRE(got.ok());
      for (const ReadyParam& p : *got) ready[{p.layout, p.param}]++;
    }
    CHECK((*r)->FinishUpdate().ok());
    for (int l = 0; l < 2; ++l) {
      const ParamTable& t = (*r)->table(l);
      for (int i = 0; i < static_cast<int>(t.params().size()); ++i) {
        INFO("update " << update << " layout " << l << " " << t.params()[i].name);
        CHECK(ready[{l, i}] == 1);
      }
      for (const char* n : {"attn_mqa.k_scale", "attn_mqa.v_scale", "attn_mha.k_scale", "attn_mha.v_scale"}) {
        const EngineParam* p = t.Find(std::string("model.layers.0.self_attn.") + n);
        REQUIRE(p != nullptr);
        float v = 0;
        std::memcpy(&v, (*r)->data(l) + p->offset, 4);
        CHECK(v == 1.0f);
      }
    }
  }
}

TEST_CASE("replica creation errors", "[replica]") {
  ModelConfig c = testing::TinyQwen3();
  CHECK_FALSE(Replica::Create(c, {}, {}).ok());
  CHECK_FALSE(Replica::Create(c, {RankParallelism::ForTp(2, 0), RankParallelism::ForTp(2, 0)}, {}).ok());
  auto bad = Replica::Create(c, {RankParallelism::ForTp(8, 0)}, {});
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()), Catch::Contains("layout 0"));
  auto r = Replica::Create(c, {RankParallelism::ForTp(2, 0)}, {});
  REQUIRE(r.ok());
  CHECK(reinterpret_cast<uintptr_t>((*r)->data(0)) % 4096 == 0);
  const auto s = Snapshot(**r);
  for (uint8_t b : s[0]) REQUIRE(b == 0);
}

// A next-n draft is more layouts of the same replica: one update's tensors fill the target layouts and the draft's
// (the MTP layer, renamed as SGLang's NextN classes name it; their bytes are checked against SGLang itself in
// replica_sglang_oracle_test), and the target's layouts are exactly what they were without the draft.
TEST_CASE("draft layouts beside the target: one update fills both, the target unchanged", "[replica][draft]") {
  const ModelConfig c = testing::TinyDeepseek();
  RankParallelism t0 = RankParallelism::ForTp(2, 0), d0 = t0, d1 = RankParallelism::ForTp(2, 1);
  d0.weights = d1.weights = WeightSet::kDraft;
  auto both = Replica::Create(c, {t0, d0, d1}, QuantSpec{});
  INFO(both.status().ToString());
  REQUIRE(both.ok());
  auto alone = Replica::Create(c, {t0}, QuantSpec{});
  REQUIRE(alone.ok());
  Replica& r = **both;
  const ParamTable& draft = r.table(1);
  CHECK(draft.Find("model.eh_proj.weight") != nullptr);
  CHECK(draft.Find("model.decoder.mlp.experts.w13_weight") != nullptr);
  CHECK(draft.Find("model.embed_tokens.weight") == nullptr);  // the target's, shared by the draft
  CHECK(draft.Find("lm_head.weight") == nullptr);
  CHECK(r.table(0).params().size() == (*alone)->table(0).params().size());

  auto target_specs = CheckpointTensors(c);
  auto draft_specs = CheckpointTensors(c, CheckpointFormat::kTrainer, 128, 128, WeightSet::kDraft);
  REQUIRE(target_specs.ok());
  REQUIRE(draft_specs.ok());
  std::vector<Tensor> tensors;
  uint32_t seed = 1;
  for (const auto* list : {&*target_specs, &*draft_specs}) {
    for (const TensorSpec& spec : *list) tensors.push_back(Random(spec, seed++));
  }
  // The MTP layer's own embedding and head are accepted and dropped.
  tensors.push_back(Random({"model.layers.2.embed_tokens.weight", DType::kBF16, {100, 8}}, seed++));
  tensors.push_back(Random({"model.layers.2.shared_head.head.weight", DType::kBF16, {100, 8}}, seed++));

  r.BeginUpdate();
  (*alone)->BeginUpdate();
  std::map<int, int> ready;
  for (const Tensor& t : tensors) {
    auto got = r.Ingest(t.view());
    INFO(t.name << ": " << got.status().ToString());
    REQUIRE(got.ok());
    for (const ReadyParam& p : *got) ready[p.layout]++;
    REQUIRE((*alone)->Ingest(t.view()).ok());
  }
  CHECK(r.FinishUpdate().ok());
  CHECK((*alone)->FinishUpdate().ok());
  for (int l = 0; l < r.num_layouts(); ++l) CHECK(ready[l] == static_cast<int>(r.table(l).params().size()));
  // The target layout's bytes are the target-only replica's.
  REQUIRE(r.table(0).total_bytes() == (*alone)->table(0).total_bytes());
  CHECK(std::memcmp(r.data(0), (*alone)->data(0), r.table(0).total_bytes()) == 0);
  // Replicated draft parameters are the MTP layer's tensors as they arrived, on both ranks.
  for (const auto& [param, hf] : std::vector<std::pair<std::string, std::string>>{
           {"model.eh_proj.weight", "model.layers.2.eh_proj.weight"},
           {"model.enorm.weight", "model.layers.2.enorm.weight"},
           {"model.shared_head.norm.weight", "model.layers.2.shared_head.norm.weight"},
           {"model.decoder.input_layernorm.weight", "model.layers.2.input_layernorm.weight"}}) {
    INFO(param);
    const Tensor* src = nullptr;
    for (const Tensor& t : tensors) {
      if (t.name == hf) src = &t;
    }
    REQUIRE(src != nullptr);
    for (int l : {1, 2}) {
      const EngineParam* p = r.table(l).Find(param);
      REQUIRE(p != nullptr);
      REQUIRE(p->bytes == src->data.size());
      CHECK(std::memcmp(r.data(l) + p->offset, src->data.data(), p->bytes) == 0);
    }
  }
}

TEST_CASE("a draft-only replica: the target's tensors are not needed and dropped", "[replica][draft][needs]") {
  const ModelConfig c = testing::TinyDeepseek();
  RankParallelism d = RankParallelism::ForTp(1, 0);
  d.weights = WeightSet::kDraft;
  auto rep = Replica::Create(c, {d}, QuantSpec{});
  INFO(rep.status().ToString());
  REQUIRE(rep.ok());
  Replica& r = **rep;
  CHECK(r.Needs("model.layers.2.self_attn.kv_b_proj.weight"));
  CHECK_FALSE(r.Needs("model.layers.1.self_attn.kv_b_proj.weight"));
  CHECK_FALSE(r.Needs("model.embed_tokens.weight"));
  CHECK_FALSE(r.Needs("model.layers.2.embed_tokens.weight"));
  auto draft_specs = CheckpointTensors(c, CheckpointFormat::kTrainer, 128, 128, WeightSet::kDraft);
  REQUIRE(draft_specs.ok());
  r.BeginUpdate();
  const Tensor target = Random({"model.layers.1.self_attn.kv_b_proj.weight", DType::kBF16, {16, 4}}, 7);
  auto dropped = r.Ingest(target.view());
  REQUIRE(dropped.ok());
  CHECK(dropped->empty());
  CHECK_FALSE(r.FinishUpdate().ok());  // the draft's own tensors are still missing
  uint32_t seed = 100;
  for (const TensorSpec& spec : *draft_specs) REQUIRE(r.Ingest(Random(spec, seed++).view()).ok());
  CHECK(r.FinishUpdate().ok());
  // A tensor neither model has is still an error.
  const Tensor bad = Random({"model.layers.2.self_attn.foo_proj.weight", DType::kBF16, {4, 8}}, 9);
  CHECK_FALSE(r.Ingest(bad.view()).ok());
}

TEST_CASE("draft layouts that are not supported are refused", "[replica][draft]") {
  RankParallelism v = RankParallelism::ForTp(1, 0);
  v.weights = WeightSet::kDraft;
  v.dialect = EngineDialect::kVllm;
  // vLLM's DeepSeek-V3 draft is planned, bf16 and FP8 (replica_vllm_oracle_test); FP8 of other vLLM models is not.
  CHECK(PlanLayout(testing::TinyDeepseek(), v, QuantSpec{QuantSpec::Mode::kFp8Block, 2, 2}).ok());
  RankParallelism vt = RankParallelism::ForTp(1, 0);
  vt.dialect = EngineDialect::kVllm;
  CHECK(PlanLayout(testing::TinyQwen3(), vt, QuantSpec{QuantSpec::Mode::kFp8Block, 16, 16}).status().code() ==
        absl::StatusCode::kUnimplemented);
  // A dense model with a next-n layer declared: SGLang has no NextN class for it.
  ModelConfig q = testing::TinyQwen3();
  q.num_nextn_predict_layers = 1;
  RankParallelism d = RankParallelism::ForTp(1, 0);
  d.weights = WeightSet::kDraft;
  auto plan = PlanLayout(q, d, QuantSpec{});
  CHECK(plan.status().code() == absl::StatusCode::kUnimplemented);
  CHECK_THAT(std::string(plan.status().message()), Catch::Contains("Qwen3ForCausalLM"));
  // A model without a draft, through the replica.
  auto none = Replica::Create(testing::TinyQwen3(), {d}, QuantSpec{});
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(none.status().message()), Catch::Contains("has no draft"));
}

}  // namespace
}  // namespace wsync::replica
