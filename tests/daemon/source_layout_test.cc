// The source refuses, before any write, an engine whose parameter table is not exactly the replica's for that
// engine's dialect: a worker exporting fewer parameters, one more, a different shape or dtype, or SGLang names sent
// to a vLLM engine. Each error names the engine, the rank and the parameter. The expected tables are the ones real
// vLLM workers attached (tests/data/vllm), not the replica's own output.

#include <catch2/catch.hpp>

#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "daemon/node/source_node.h"
#include "transport/transport.h"

namespace wsync::daemon {
namespace {

std::string Slurp(const std::string& p) {
  std::ifstream f(p);
  REQUIRE(f.good());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int64_t DTypeBytes(const std::string& d) { return d == "float32" ? 4 : 2; }

// A ConfigureSourceRequest for one target whose layout is the recorded vLLM worker table.
v1::ConfigureSourceRequest Request(const std::string& model, const std::string& kind) {
  const std::string dir = WSYNC_VLLM_TABLES_DIR;
  const auto dump = nlohmann::json::parse(Slurp(dir + "/" + model + "-tp1-rank0.json"));
  v1::ConfigureSourceRequest req;
  req.set_model_config_json(Slurp(dir + "/" + model + ".config.json"));
  auto* t = req.add_targets();
  t->set_engine_id("vllm-a");
  t->set_rank(0);
  t->set_target_daemon("127.0.0.1:1");
  t->set_engine_kind(kind);
  auto* l = t->mutable_layout();
  l->set_rank(0);
  auto* par = l->mutable_parallelism();
  for (const char* k : {"tp_size", "ep_size", "moe_tp_size", "attn_tp_size", "attn_dp_size", "pp_size"}) {
    const int v = dump["parallelism"][k];
    const std::string key = k;
    if (key == "tp_size") par->set_tp_size(v);
    if (key == "ep_size") par->set_ep_size(v);
    if (key == "moe_tp_size") par->set_moe_tp_size(v);
    if (key == "attn_tp_size") par->set_attn_tp_size(v);
    if (key == "attn_dp_size") par->set_attn_dp_size(v);
    if (key == "pp_size") par->set_pp_size(v);
  }
  uint64_t off = 0;
  for (const auto& p : dump["params"]) {
    auto* d = l->add_params();
    d->set_name(p["name"].get<std::string>());
    d->set_dtype(p["dtype"].get<std::string>());
    int64_t n = DTypeBytes(d->dtype());
    for (int64_t s : p["shape"]) {
      d->add_shape(s);
      n *= s;
    }
    d->set_bytes(n);
    d->set_offset(off);
    d->set_segment(0);
    off += n;
  }
  auto* seg = l->add_segments();
  seg->set_id(0);
  seg->set_kind("host");
  seg->set_bytes(off);
  l->set_region_bytes(off);
  return req;
}

absl::Status Configure(const v1::ConfigureSourceRequest& req) {
  auto tr = transport::CreateTransport("tcp", {});
  REQUIRE(tr.ok());
  SourceOptions o;
  o.node_id = "src";
  SourceNode node(o, tr->get(), [](const std::string&, const v1::ConnectTargetRequest&) -> absl::StatusOr<std::string> {
    return absl::UnavailableError("no target in this test");
  });
  return node.Configure(req).status();
}

}  // namespace

TEST_CASE("source configure: the recorded vLLM tables pass the layout check", "[source][vllm]") {
  for (const char* model : {"qwen3-dense", "qwen3-moe"}) {
    INFO(model);
    const absl::Status st = Configure(Request(model, "vllm"));
    // The layout check passes; configure then stops at the next check, the target's region descriptor, which this
    // test does not provide.
    CHECK_THAT(st.ToString(), Catch::Contains("engine vllm-a rank 0: segment 0 has no region descriptor"));
    CHECK_THAT(st.ToString(), !Catch::Contains("parameter"));
  }
}

TEST_CASE("source configure: an engine table that is not the replica's is refused naming engine, rank, parameter",
          "[source][vllm]") {
  SECTION("a worker exports one parameter fewer") {
    auto req = Request("qwen3-dense", "vllm");
    auto* params = req.mutable_targets(0)->mutable_layout()->mutable_params();
    const std::string gone = params->Get(3).name();
    params->DeleteSubrange(3, 1);
    const absl::Status st = Configure(req);
    CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(st.ToString(), Catch::Contains("engine vllm-a rank 0") && Catch::Contains(gone));
  }
  SECTION("a worker exports a parameter the replica does not know") {
    auto req = Request("qwen3-dense", "vllm");
    auto* extra = req.mutable_targets(0)->mutable_layout()->add_params();
    *extra = req.targets(0).layout().params(0);
    extra->set_name("model.layers.0.mlp.extra.weight");
    const absl::Status st = Configure(req);
    CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(st.ToString(), Catch::Contains("model.layers.0.mlp.extra.weight"));
  }
  SECTION("a shape differs") {
    auto req = Request("qwen3-dense", "vllm");
    auto* p = req.mutable_targets(0)->mutable_layout()->mutable_params(1);
    p->set_shape(0, p->shape(0) / 2);
    p->set_bytes(p->bytes() / 2);
    const absl::Status st = Configure(req);
    CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(st.ToString(), Catch::Contains(p->name()) && Catch::Contains("engine vllm-a rank 0"));
  }
  SECTION("a dtype differs (float32 router where the replica has bfloat16)") {
    auto req = Request("qwen3-moe", "vllm");
    auto* params = req.mutable_targets(0)->mutable_layout()->mutable_params();
    for (auto& p : *params)
      if (p.name() == "model.layers.0.mlp.gate.weight") {
        p.set_dtype("float32");
        p.set_bytes(p.bytes() * 2);
      }
    const absl::Status st = Configure(req);
    CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(st.ToString(), Catch::Contains("model.layers.0.mlp.gate.weight") && Catch::Contains("float32"));
  }
  SECTION("a vLLM table served as if the engine were SGLang-shaped (wrong engine kind)") {
    const absl::Status st = Configure(Request("qwen3-moe", "sglang"));
    CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(st.ToString(), Catch::Contains("experts"));
  }
  SECTION("an unknown engine kind") {
    const absl::Status st = Configure(Request("qwen3-dense", "tensorrt"));
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(st.ToString(), Catch::Contains("tensorrt") && Catch::Contains("engine vllm-a rank 0"));
  }
}

}  // namespace wsync::daemon
