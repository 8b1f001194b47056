// The update timeline (SVG) and the status page's HTML as pure functions, and the timeline the coordinator records
// (per engine and per source) from an update whose peers take measured times.

#include "daemon/coordinator/status_page.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/timeline_svg.h"
#include "tests/daemon/fake_layouts.h"
#include "tools/cli/history_plot.h"

namespace wsync::daemon {
namespace {

// The attributes of every <rect class="phase" ...> of an SVG, in document order.
std::vector<std::map<std::string, std::string>> PhaseRects(const std::string& svg) {
  std::vector<std::map<std::string, std::string>> out;
  static const std::regex rect(R"(<rect class="phase"([^>]*)>)");
  static const std::regex attr(R"(([a-z-]+)="([^"]*)\")");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), rect); it != std::sregex_iterator(); ++it) {
    const std::string attrs = (*it)[1];
    std::map<std::string, std::string> m;
    for (auto a = std::sregex_iterator(attrs.begin(), attrs.end(), attr); a != std::sregex_iterator(); ++a)
      m[(*a)[1]] = (*a)[2];
    out.push_back(m);
  }
  return out;
}

double Num(const std::string& s) {
  double v = 0;
  REQUIRE(absl::SimpleAtod(s, &v));
  return v;
}

v1::UpdateRecord Record(int64_t version) {
  v1::UpdateRecord r;
  r.set_version(version);
  r.set_success(true);
  r.set_bytes(3ull << 30);
  r.set_engines(2);
  r.set_engine_ranks(4);
  double at = 0;
  for (auto [phase, s] : std::vector<std::pair<const char*, double>>{
           {"pause", 0.5}, {"configure", 0.25}, {"push", 4.0}, {"post_process", 1.0}, {"continue", 0.25}}) {
    auto* p = r.add_phases();
    p->set_phase(phase);
    p->set_seconds(s);
    p->set_start_seconds(at);
    at += s;
  }
  r.set_total_seconds(at);
  for (auto [node, s] : std::vector<std::pair<const char*, double>>{{"train-a", 4.0}, {"train-b", 2.0}}) {
    auto* sp = r.add_source_pushes();
    sp->set_node_id(node);
    sp->set_bytes(1500ull << 20);
    sp->set_seconds(s);
  }
  for (auto [engine, s] : std::vector<std::pair<const char*, double>>{{"eng0", 1.0}, {"eng1", 0.5}}) {
    auto* e = r.add_engine_phases();
    e->set_engine_id(engine);
    e->set_phase("post_process");
    e->set_start_seconds(4.75);
    e->set_seconds(s);
    e->set_ok(true);
  }
  return r;
}

TEST_CASE("timeline: one bar per phase, per source push and per engine call") {
  const std::string svg = TimelineSvg({Record(7)});
  CHECK(absl::StartsWith(svg, "<svg xmlns=\"http://www.w3.org/2000/svg\""));
  const auto rects = PhaseRects(svg);
  std::map<std::string, int> by_row;
  for (const auto& r : rects) {
    CHECK(r.at("data-version") == "7");
    ++by_row[r.at("data-row")];
  }
  CHECK(by_row ==
        std::map<std::string, int>{
            {"update", 5}, {"source:train-a", 1}, {"source:train-b", 1}, {"engine:eng0", 1}, {"engine:eng1", 1}});
  std::vector<std::string> update_phases;
  for (const auto& r : rects)
    if (r.at("data-row") == "update") update_phases.push_back(r.at("data-phase"));
  CHECK(update_phases == std::vector<std::string>{"pause", "configure", "push", "post_process", "continue"});
  // The source rows give bytes and rate: 1500 MiB in 2 s.
  CHECK(absl::StrContains(svg, "1.46 GiB, 786.4 MB/s"));
  CHECK(absl::StrContains(svg, "update 7 \u00b7 ok"));
}

TEST_CASE("timeline: widths proportional to durations, bars placed at their start") {
  const auto rects = PhaseRects(TimelineSvg({Record(1)}, TimelineOptions{1200}));
  std::map<std::string, std::map<std::string, std::string>> by;
  for (const auto& r : rects) by[r.at("data-row") + "/" + r.at("data-phase")] = r;
  const double push = Num(by["update/push"].at("width"));
  const double px_per_s = push / 4.0;
  CHECK(Num(by["update/pause"].at("width")) == Approx(0.5 * px_per_s).epsilon(0.01));
  CHECK(Num(by["update/post_process"].at("width")) == Approx(1.0 * px_per_s).epsilon(0.01));
  CHECK(Num(by["source:train-b/push"].at("width")) == Approx(2.0 * px_per_s).epsilon(0.01));
  CHECK(Num(by["engine:eng1/post_process"].at("width")) == Approx(0.5 * px_per_s).epsilon(0.01));
  // Each starts where its phase does: the push after pause and configure, the engines' calls with post_process.
  const double x0 = Num(by["update/pause"].at("x"));
  CHECK(Num(by["update/push"].at("x")) - x0 == Approx(0.75 * px_per_s).epsilon(0.01));
  CHECK(Num(by["source:train-a/push"].at("x")) == Approx(Num(by["update/push"].at("x"))));
  CHECK(Num(by["engine:eng0/post_process"].at("x")) == Approx(Num(by["update/post_process"].at("x"))));
  // The whole update spans the plot: 6 s over width - label column - right margin.
  CHECK(6.0 * px_per_s == Approx(1200 - 190 - 150).epsilon(0.01));
}

TEST_CASE("timeline: records without start times lay their phases end to end") {
  v1::UpdateRecord r = Record(2);
  for (auto& p : *r.mutable_phases()) p.clear_start_seconds();
  std::map<std::string, double> x;
  for (const auto& b : PhaseRects(TimelineSvg({r})))
    if (b.at("data-row") == "update") x[b.at("data-phase")] = Num(b.at("x"));
  CHECK(x["configure"] > x["pause"]);
  CHECK(x["push"] > x["configure"]);
  CHECK(x["continue"] > x["post_process"]);
}

TEST_CASE("timeline: ids and errors from the cluster are escaped") {
  v1::UpdateRecord r = Record(3);
  r.set_success(false);
  r.set_error("engine <eng\"0'> & co: </svg><script>alert(1)</script>");
  r.mutable_engine_phases(0)->set_engine_id("e<v>\"il&");
  r.mutable_source_pushes(0)->set_node_id("n</text>");
  const std::string svg = TimelineSvg({r});
  CHECK_FALSE(absl::StrContains(svg, "<script"));
  CHECK_FALSE(absl::StrContains(svg, "e<v>"));
  CHECK_FALSE(absl::StrContains(svg, "n</text>"));
  CHECK(absl::StrContains(svg, "data-row=\"engine:e&lt;v&gt;&quot;il&amp;\""));
  CHECK(absl::StrContains(svg, "&lt;/svg&gt;&lt;script&gt;"));
  CHECK(absl::StrContains(svg, "data-outcome=\"FAILED\""));
  CHECK(XmlEscape("a\x01"
                  "b'") == "ab&#39;");
  // Exactly one root element: nothing from the record closed it early.
  CHECK(std::count(svg.begin(), svg.end(), '<') - std::count(svg.begin(), svg.end(), '>') == 0);
  size_t n = 0;
  for (size_t at = svg.find("</svg>"); at != std::string::npos; at = svg.find("</svg>", at + 1)) ++n;
  CHECK(n == 1);
}

// The texts of every axis tick of an SVG, in document order.
std::vector<std::string> Ticks(const std::string& svg) {
  std::vector<std::string> out;
  static const std::regex tick(R"(<text class="tick"[^>]*>([^<]*)</text>)");
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), tick); it != std::sregex_iterator(); ++it)
    out.push_back((*it)[1]);
  return out;
}

TEST_CASE("timeline: an axis labels every tick in one unit") {
  SECTION("an update of 6 s: seconds") {
    const auto ticks = Ticks(TimelineSvg({Record(4)}));
    REQUIRE(ticks.size() >= 3);
    for (const auto& t : ticks) CHECK(absl::EndsWith(t, " s"));
    CHECK(ticks.front() == "0 s");
  }
  SECTION("an update of 30 ms: milliseconds throughout, zero included") {
    v1::UpdateRecord r = Record(5);
    for (auto& p : *r.mutable_phases()) {
      p.set_seconds(p.seconds() / 200);
      p.set_start_seconds(p.start_seconds() / 200);
    }
    r.set_total_seconds(r.total_seconds() / 200);
    for (auto& sp : *r.mutable_source_pushes()) sp.set_seconds(sp.seconds() / 200);
    for (auto& e : *r.mutable_engine_phases()) {
      e.set_seconds(e.seconds() / 200);
      e.set_start_seconds(e.start_seconds() / 200);
    }
    const auto ticks = Ticks(TimelineSvg({r}));
    REQUIRE(ticks.size() >= 3);
    for (const auto& t : ticks) CHECK(absl::EndsWith(t, " ms"));
    CHECK(ticks.front() == "0 ms");
  }
}

TEST_CASE("timeline: no records says so") {
  const std::string svg = TimelineSvg({});
  CHECK(absl::StrContains(svg, "no updates recorded yet"));
  CHECK(PhaseRects(svg).empty());
}

TEST_CASE("status page: membership, engine readiness and the timeline inline") {
  v1::ClusterStatus s;
  s.set_state("idle");
  s.set_current_version("7");
  s.set_open_version(-1);
  s.set_failed_version(-1);
  auto* src = s.add_nodes();
  src->set_node_id("train-a");
  src->set_role("source");
  src->set_reachable(true);
  auto* tgt = s.add_nodes();
  tgt->set_node_id("infer<0>");
  tgt->set_role("target");
  tgt->set_reachable(true);
  for (auto [id, state, version, stale] : std::vector<std::tuple<const char*, const char*, const char*, bool>>{
           {"eng0", "serving", "7", false}, {"eng1", "serving", "6", true}, {"eng2", "paused", "6", false}}) {
    tgt->add_engines(id);
    auto* e = tgt->add_engine_details();
    e->set_engine_id(id);
    e->set_state(state);
    e->set_weight_version(version);
    e->set_stale(stale);
  }
  v1::HistoryReply h;
  *h.add_records() = Record(7);
  const std::string html = StatusPageHtml(s, h, absl::FromUnixSeconds(1700000000));
  CHECK(absl::StrContains(html, "<td>train-a</td><td>source</td>"));
  CHECK(absl::StrContains(html, "<td>infer&lt;0&gt;</td>"));
  CHECK(absl::StrContains(html,
                          "<tr data-engine=\"eng0\"><td>eng0</td><td>infer&lt;0&gt;</td><td>7</td><td>-</td>"
                          "<td class=\"ready\">ready</td>"));
  CHECK(absl::StrContains(html, "<td class=\"stale\">stale</td>"));
  CHECK(absl::StrContains(html, "<td class=\"paused\">paused</td>"));
  CHECK(absl::StrContains(html, "current version <b>7</b>"));
  CHECK(absl::StrContains(html, "<div id=\"timeline\"><svg xmlns="));
  CHECK(PhaseRects(html).size() == 9);
  CHECK_FALSE(absl::StrContains(html, "<script"));
}

TEST_CASE("history --plot: versions asked, the last N, and a version not in the history") {
  v1::HistoryReply h;
  for (int64_t v : {3, 4, 5, 9}) *h.add_records() = Record(v);
  auto last = tools::SelectRecords(h, {}, 2);
  REQUIRE(last.ok());
  REQUIRE(last->size() == 2);
  CHECK((*last)[0].version() == 5);
  CHECK((*last)[1].version() == 9);
  auto asked = tools::SelectRecords(h, {9, 3}, 0);
  REQUIRE(asked.ok());
  CHECK((*asked)[0].version() == 9);
  auto missing = tools::SelectRecords(h, {4, 7}, 0);
  REQUIRE(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK(absl::StrContains(missing.status().message(), "version 7 is not in the coordinator's history"));
  CHECK(absl::StrContains(missing.status().message(), "holds versions 3-5, 9"));
  CHECK(absl::StrContains(tools::SelectRecords(v1::HistoryReply(), {1}, 0).status().message(), "no update yet"));
  CHECK(tools::PlotFormatOf("a/b.SVG").value() == tools::PlotFormat::kSvg);
  CHECK(tools::PlotFormatOf("t.png").value() == tools::PlotFormat::kPng);
  CHECK(tools::PlotFormatOf("t.pdf").status().code() == absl::StatusCode::kInvalidArgument);
}

// Peers that answer at once except where a test makes an engine's or a source's call take a while.
class TimedPeers : public Peers {
 public:
  std::map<std::string, double> post_process_s;  // engine control address -> seconds its PostProcess takes
  std::map<std::string, double> finish_s;        // source address -> seconds its FinishUpdate takes

  absl::StatusOr<v1::ConfigureSourceReply> ConfigureSource(const std::string&,
                                                           const v1::ConfigureSourceRequest&) override {
    return v1::ConfigureSourceReply();
  }
  absl::Status StartUpdate(const std::string&, const v1::StartUpdateRequest&) override { return absl::OkStatus(); }
  absl::StatusOr<v1::FinishUpdateReply> FinishUpdate(const std::string& addr, const v1::FinishUpdateRequest&) override {
    Sleep(finish_s, addr);
    v1::FinishUpdateReply r;
    r.set_bytes_written(addr == "s1:1" ? 3000 : 1000);
    r.set_write_seconds(0.01);
    return r;
  }
  absl::StatusOr<v1::AbortSourceUpdateReply> AbortSourceUpdate(const std::string&,
                                                               const v1::AbortSourceUpdateRequest&) override {
    return v1::AbortSourceUpdateReply();
  }
  absl::StatusOr<v1::EngineInfo> EngineInfo(const std::string&) override {
    v1::EngineInfo i;
    i.set_model_config_json(testing::TinyConfigJson());
    return i;
  }
  absl::Status Pause(const std::string&, const std::string&) override { return absl::OkStatus(); }
  absl::Status PostProcess(const std::string& addr, const std::string&) override {
    Sleep(post_process_s, addr);
    return absl::OkStatus();
  }
  absl::Status SetWeightVersion(const std::string&, const std::string&) override { return absl::OkStatus(); }
  absl::Status Continue(const std::string&) override { return absl::OkStatus(); }

 private:
  static void Sleep(const std::map<std::string, double>& m, const std::string& addr) {
    auto it = m.find(addr);
    if (it != m.end()) std::this_thread::sleep_for(std::chrono::duration<double>(it->second));
  }
};

TEST_CASE("coordinator: the history record holds each engine's calls and each source's push as they took") {
  auto p = std::make_unique<TimedPeers>();
  p->post_process_s["e1:2"] = 0.3;
  p->finish_s["s1:1"] = 0.25;
  CoordinatorOptions o;
  o.strategy = "seed";
  Coordinator c(o, std::move(p));
  for (const char* id : {"s0", "s1"}) {
    v1::RegisterNodeRequest r;
    r.set_node_id(id);
    r.set_role("source");
    r.set_address(absl::StrCat(id, ":1"));
    r.set_trainer_ranks(1);
    REQUIRE(c.RegisterNode(r).ok());
  }
  for (const char* id : {"e0", "e1"}) {
    v1::RegisterNodeRequest r;
    r.set_node_id(absl::StrCat("t-", id));
    r.set_role("target");
    r.set_address(absl::StrCat("t-", id, ":1"));
    auto* e = r.add_engines();
    e->set_engine_id(id);
    e->set_control_address(absl::StrCat(id, ":2"));
    e->set_kind("reference");
    testing::FillLayout(e->add_ranks(), 1, 0);
    REQUIRE(c.RegisterNode(r).ok());
  }
  v1::BeginUpdateRequest b;
  b.set_version(1);
  REQUIRE(c.BeginUpdate(b).ok());
  v1::CommitUpdateRequest cr;
  cr.set_version(1);
  REQUIRE(c.CommitUpdate(cr).ok());
  const v1::HistoryReply h = c.History(v1::HistoryRequest());
  REQUIRE(h.records_size() == 1);
  const v1::UpdateRecord& r = h.records(0);

  std::map<std::string, const v1::PhaseTiming*> phases;
  for (const auto& ph : r.phases()) phases[ph.phase()] = &ph;
  REQUIRE(phases.count("push"));
  REQUIRE(phases.count("post_process"));
  // Phases start in order, each after the one before it ended.
  double end = 0;
  for (const auto& ph : r.phases()) {
    CHECK(ph.start_seconds() >= end - 1e-3);
    end = ph.start_seconds() + ph.seconds();
  }
  CHECK(end <= r.total_seconds() + 1e-3);

  REQUIRE(r.source_pushes_size() == 2);
  CHECK(r.source_pushes(0).node_id() == "s0");
  CHECK(r.source_pushes(1).node_id() == "s1");
  CHECK(r.source_pushes(1).bytes() == 3000);
  CHECK(r.source_pushes(1).write_seconds() == Approx(0.01));
  CHECK(r.source_pushes(1).seconds() >= 0.25);
  CHECK(r.source_pushes(0).seconds() < 0.2);
  CHECK(r.source_pushes(1).seconds() <= phases["push"]->seconds() + 1e-3);

  std::map<std::string, const v1::EnginePhase*> pp;  // engine -> its post_process call
  int pauses = 0;
  for (const auto& e : r.engine_phases()) {
    CHECK(e.ok());
    pauses += e.phase() == "pause";
    if (e.phase() == "post_process") pp[e.engine_id()] = &e;
  }
  CHECK(pauses == 2);
  REQUIRE(pp.size() == 2);
  CHECK(pp["e1"]->seconds() >= 0.3);
  CHECK(pp["e0"]->seconds() < 0.2);
  CHECK(pp["e1"]->start_seconds() == Approx(phases["post_process"]->start_seconds()));
  CHECK(pp["e1"]->seconds() <= phases["post_process"]->seconds() + 1e-3);

  // Drawn: e1's post_process bar is wider than e0's, in proportion to their times.
  std::map<std::string, double> width;
  for (const auto& b : PhaseRects(TimelineSvg({r})))
    if (b.at("data-phase") == "post_process") width[b.at("data-row")] = Num(b.at("width"));
  CHECK(width["engine:e1"] / std::max(width["engine:e0"], 1.0) >= 2.0);
}

TEST_CASE("coordinator: the timeline keeps at most max_engines engines, those that ended last") {
  v1::UpdateRecord r = Record(1);
  r.clear_engine_phases();
  const absl::Time t0 = absl::FromUnixMillis(1700000000000);
  r.set_started_unix_ms(absl::ToUnixMillis(t0));
  std::vector<EngineCallEnd> ends;
  std::map<std::string, std::string> ids;
  for (int i = 0; i < 10; ++i) {
    const std::string a = absl::StrCat("10.0.0.", i, ":2");
    ids[a] = absl::StrCat("eng", i);
    ends.push_back({a, "post_process", t0 + absl::Seconds(4.75 + 0.1 * i), true});
    ends.push_back({a, "pause", t0 + absl::Seconds(0.1), true});
  }
  ends.push_back({"unknown:2", "no_such_phase", t0 + absl::Seconds(1), true});
  AddEnginePhases(&r, ends, ids, 3);
  std::set<std::string> kept;
  for (const auto& e : r.engine_phases()) kept.insert(e.engine_id());
  CHECK(kept == std::set<std::string>{"eng7", "eng8", "eng9"});
  CHECK(r.engine_phases_size() == 6);
  for (const auto& e : r.engine_phases())
    if (e.engine_id() == "eng9" && e.phase() == "post_process") CHECK(e.seconds() == Approx(0.9));
}

}  // namespace
}  // namespace wsync::daemon
