// The RL step model (tools/testdata/rl_steps.h) and the delta codec on its steps: every parameter's delta, bf16 and
// FP8 (codes and scales), applied onto the previous version gives exactly the next step's bytes.

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "replica/delta.h"
#include "replica/fp8.h"
#include "tools/testdata/rl_steps.h"

namespace wsync {
namespace {

const std::string kModels = WSYNC_MODELS_DIR;

std::unique_ptr<tools::RlStepModel> Make(const std::string& model, double lr, uint64_t seed = 1, int64_t layers = 0,
                                         int64_t vocab = 0) {
  tools::RlStepOptions opt;
  opt.lr = lr;
  opt.seed = seed;
  auto m = tools::RlStepModel::Create(kModels + "/" + model + "/config.json", opt, layers, vocab);
  REQUIRE(m.ok());
  return *std::move(m);
}

// Fraction of changed elements per tensor kind between two snapshots, element by element.
std::map<std::string, double> ChangedByKind(const tools::RlStepModel& m,
                                            const std::vector<std::vector<uint8_t>>& prev) {
  std::map<std::string, std::pair<uint64_t, uint64_t>> counts;
  for (size_t i = 0; i < m.tensors().size(); ++i) {
    const size_t es = DTypeSize(m.tensors()[i].dtype);
    auto& c = counts[tools::TensorKind(m.tensors()[i].name)];
    for (size_t e = 0; e < prev[i].size() / es; ++e) {
      c.first += std::memcmp(prev[i].data() + e * es, m.bytes(i).data() + e * es, es) != 0;
      ++c.second;
    }
  }
  std::map<std::string, double> out;
  for (const auto& [k, c] : counts) out[k] = static_cast<double>(c.first) / c.second;
  return out;
}

std::vector<std::vector<uint8_t>> Snapshot(const tools::RlStepModel& m) {
  std::vector<std::vector<uint8_t>> s;
  for (size_t i = 0; i < m.tensors().size(); ++i) s.push_back(m.bytes(i));
  return s;
}

TEST_CASE("rl steps: deterministic, initialised as the config says") {
  auto a = Make("tiny-qwen3", 1e-6), b = Make("tiny-qwen3", 1e-6), c = Make("tiny-qwen3", 1e-6, /*seed=*/2);
  a->Step(), b->Step(), c->Step();
  bool any_differs = false;
  for (size_t i = 0; i < a->tensors().size(); ++i) {
    REQUIRE(a->bytes(i) == b->bytes(i));
    any_differs |= a->bytes(i) != c->bytes(i);
  }
  CHECK(any_differs);

  auto fresh = Make("tiny-qwen3", 1e-6);
  for (size_t i = 0; i < fresh->tensors().size(); ++i) {
    const auto& t = fresh->tensors()[i];
    const std::string kind = tools::TensorKind(t.name);
    const uint16_t* v = reinterpret_cast<const uint16_t*>(fresh->bytes(i).data());
    const size_t n = fresh->bytes(i).size() / 2;
    if (kind == "norm") {
      for (size_t e = 0; e < n; ++e) REQUIRE(v[e] == 0x3F80);  // bf16 1.0
    } else if (n >= 4096) {
      double sum = 0, sq = 0;
      for (size_t e = 0; e < n; ++e) {
        const double x = replica::Bf16ToFloat(v[e]);
        sum += x, sq += x * x;
      }
      CAPTURE(t.name);
      CHECK(std::fabs(sum / n) < 0.002);
      CHECK(std::sqrt(sq / n) == Approx(0.02).epsilon(0.05));  // initializer_range of tiny-qwen3
    }
  }
}

TEST_CASE("rl steps: a small learning rate moves few bf16 elements, norms none; ten times the rate moves more") {
  auto lo = Make("tiny-qwen3", 1e-6), hi = Make("tiny-qwen3", 1e-5);
  const auto lo_prev = Snapshot(*lo), hi_prev = Snapshot(*hi);
  lo->Step(), hi->Step();
  const auto f_lo = ChangedByKind(*lo, lo_prev), f_hi = ChangedByKind(*hi, hi_prev);
  CHECK(f_lo.at("norm") == 0.0);
  for (const char* kind : {"attn", "mlp", "embed"}) {
    CAPTURE(kind, f_lo.at(kind), f_hi.at(kind));
    CHECK(f_lo.at(kind) > 0.002);
    CHECK(f_lo.at(kind) < 0.05);
    CHECK(f_hi.at(kind) > 5 * f_lo.at(kind));
  }
}

// Encodes old→neu as the source does (CopyAndEncode into its replica, dense where not smaller), applies it to the
// target's copy, and checks both against neu; returns the bytes that would be sent.
uint64_t SendRange(std::vector<uint8_t>* replica, std::vector<uint8_t>* target, const uint8_t* neu, uint32_t es) {
  const uint64_t bytes = replica->size();
  std::string enc;
  const auto r = replica::delta::CopyAndEncode(replica->data(), neu, bytes, es, bytes, &enc);
  REQUIRE(std::memcmp(replica->data(), neu, bytes) == 0);
  if (r.dense_smaller) {
    REQUIRE(enc.empty());
    std::memcpy(target->data(), neu, bytes);
    return bytes;
  }
  uint64_t consumed = 0;
  REQUIRE(
      replica::delta::Apply(target->data(), bytes, reinterpret_cast<const uint8_t*>(enc.data()), enc.size(), &consumed)
          .ok());
  REQUIRE(consumed == enc.size());
  REQUIRE(std::memcmp(target->data(), neu, bytes) == 0);
  return enc.size();
}

TEST_CASE("rl steps: every delta, bf16 and FP8 codes and scales, applies exactly onto the previous step") {
  // Qwen3-0.6B's real shapes, cut to one layer and 1024 vocabulary rows.
  auto m = Make("Qwen__Qwen3-0.6B", 1e-6, 1, /*layers=*/1, /*vocab=*/1024);
  auto quantized = tools::Fp8Quantized(m->config(), m->tensors());
  REQUIRE(quantized.ok());
  const size_t n = m->tensors().size();
  REQUIRE(std::count(quantized->begin(), quantized->end(), true) == 7);  // q k v o gate up down

  std::vector<std::vector<uint8_t>> replica = Snapshot(*m), target = replica;
  std::vector<tools::Fp8Tensor> q(n);
  std::vector<std::vector<uint8_t>> codes_replica(n), codes_target(n), scales_replica(n), scales_target(n);
  auto quantize = [&](size_t i, tools::Fp8Tensor* out) {
    const auto& t = m->tensors()[i];
    REQUIRE(tools::QuantizeBf16Fp8(m->bytes(i).data(), t.shape[0], t.shape[1], 128, out).ok());
  };
  for (size_t i = 0; i < n; ++i) {
    if (!(*quantized)[i]) continue;
    quantize(i, &q[i]);
    codes_replica[i] = codes_target[i] = q[i].codes;
    const uint8_t* s = reinterpret_cast<const uint8_t*>(q[i].scales.data());
    scales_replica[i] = scales_target[i] = std::vector<uint8_t>(s, s + q[i].scales.size() * 4);
  }
  for (int step = 1; step <= 3; ++step) {
    m->Step();
    uint64_t dense = 0, sent = 0, fp8_dense = 0, fp8_sent = 0;
    for (size_t i = 0; i < n; ++i) {
      const uint32_t es = static_cast<uint32_t>(DTypeSize(m->tensors()[i].dtype));
      dense += m->bytes(i).size();
      sent += SendRange(&replica[i], &target[i], m->bytes(i).data(), es);
      if (!(*quantized)[i]) continue;
      tools::Fp8Tensor now;
      quantize(i, &now);  // the expectation: an independent quantization of the new step
      fp8_dense += now.codes.size() + now.scales.size() * 4;
      fp8_sent += SendRange(&codes_replica[i], &codes_target[i], now.codes.data(), 1);
      fp8_sent +=
          SendRange(&scales_replica[i], &scales_target[i], reinterpret_cast<const uint8_t*>(now.scales.data()), 4);
      REQUIRE(codes_target[i] == now.codes);
    }
    CAPTURE(step, sent, dense, fp8_sent, fp8_dense);
    CHECK(sent < dense / 20);  // the goal at 1e-6: at most 5 % of dense
    CHECK(fp8_sent < fp8_dense / 20);
  }
}

TEST_CASE("rl steps: a step written as safetensors holds the model's bytes") {
  auto m = Make("tiny-qwen3", 1e-6);
  m->Step();
  char dir[] = "/tmp/wsync-rl-steps-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  const std::string path = std::string(dir) + "/step.safetensors";
  REQUIRE(tools::WriteSafetensors(path, *m).ok());
  std::ifstream in(path, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  rmdir(dir);
  uint64_t hlen = 0;
  REQUIRE(file.size() > 8);
  std::memcpy(&hlen, file.data(), 8);
  REQUIRE(hlen % 8 == 0);
  const auto header = nlohmann::json::parse(file.substr(8, hlen));
  const size_t data = 8 + hlen;
  REQUIRE(header["__metadata__"]["step"] == "1");
  REQUIRE(header.size() == m->tensors().size() + 1);
  for (size_t i = 0; i < m->tensors().size(); ++i) {
    const auto& t = m->tensors()[i];
    const auto& h = header.at(t.name);
    CHECK(h["dtype"] == "BF16");
    CHECK(h["shape"].get<std::vector<int64_t>>() == t.shape);
    const uint64_t b = h["data_offsets"][0], e = h["data_offsets"][1];
    REQUIRE(e - b == m->bytes(i).size());
    REQUIRE(data + e <= file.size());
    REQUIRE(std::memcmp(file.data() + data + b, m->bytes(i).data(), e - b) == 0);
  }
}

}  // namespace
}  // namespace wsync
