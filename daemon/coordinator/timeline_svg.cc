#include "daemon/coordinator/timeline_svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace wsync::daemon {
namespace {

constexpr double kLabelWidth = 190;   // the row names' column
constexpr double kRightMargin = 150;  // room for a source row's bytes and rate after its bar
constexpr double kRowHeight = 16;
constexpr double kRowGap = 4;

// One colour per phase the coordinator records (colour-blind safe palette); other names hash into it.
std::string PhaseColor(const std::string& phase) {
  static const std::map<std::string, std::string> known = {
      {"pause", "#f28e2b"},        {"configure", "#bab0ac"},   {"push", "#4e79a7"},     {"apply_delta", "#76b7b2"},
      {"post_process", "#59a14f"}, {"set_version", "#edc948"}, {"continue", "#b07aa1"}, {"verify", "#9c755f"},
      {"switch", "#ff9da7"},       {"prepare", "#d37295"},     {"abort", "#e15759"}};
  if (auto it = known.find(phase); it != known.end()) return it->second;
  static const char* const spare[] = {"#86bcb6", "#d4a6c8", "#fabfd2", "#8cd17d", "#b6992d", "#499894"};
  return spare[std::hash<std::string>()(phase) % (sizeof(spare) / sizeof(spare[0]))];
}

std::string Px(double v) { return absl::StrFormat("%.2f", v); }

std::string Seconds(double s) {
  if (s < 0.01) return absl::StrFormat("%.1f ms", s * 1e3);
  if (s < 10) return absl::StrFormat("%.3f s", s);
  return absl::StrFormat("%.1f s", s);
}

// An axis tick in the one unit the whole axis uses (ms below a second of span, else s), with as many decimals as the
// step needs: a reader compares ticks at a glance.
std::string TickLabel(double t, double step, double span) {
  const bool ms = span < 1;
  const double v = ms ? t * 1e3 : t, st = ms ? step * 1e3 : step;
  const int decimals = st >= 1 ? 0 : st >= 0.1 ? 1 : st >= 0.01 ? 2 : 3;
  return absl::StrFormat("%.*f %s", decimals, v, ms ? "ms" : "s");
}

std::string Bytes(uint64_t b) {
  if (b >= (1ull << 30)) return absl::StrFormat("%.2f GiB", b / 1073741824.0);
  return absl::StrFormat("%.1f MiB", b / 1048576.0);
}

std::string Rate(uint64_t bytes, double seconds) {
  if (seconds <= 0) return "-";
  const double r = bytes / seconds;
  return r >= 1e9 ? absl::StrFormat("%.2f GB/s", r / 1e9) : absl::StrFormat("%.1f MB/s", r / 1e6);
}

// A tick step of 1, 2 or 5 times a power of ten giving at most ~8 ticks over `span` seconds.
double TickStep(double span) {
  const double raw = span / 8;
  const double p = std::pow(10, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (m * p >= raw) return m * p;
  return 10 * p;
}

// Where each phase of `r` starts: its recorded start, or (records kept before starts were recorded) the end of the
// phase before it.
std::vector<double> PhaseStarts(const v1::UpdateRecord& r) {
  std::vector<double> starts;
  double end = 0;
  for (const auto& p : r.phases()) {
    const double s = p.start_seconds() > 0 ? p.start_seconds() : end;
    starts.push_back(s);
    end = s + p.seconds();
  }
  return starts;
}

class Drawing {
 public:
  explicit Drawing(double width) : width_(width), plot_(std::max(100.0, width - kLabelWidth - kRightMargin)) {}

  void Legend(const std::vector<std::string>& phases) {
    double x = 10;
    for (const auto& p : phases) {
      absl::StrAppend(&body_, "<rect class=\"legend\" data-phase=\"", XmlEscape(p), "\" x=\"", Px(x), "\" y=\"", Px(y_),
                      "\" width=\"12\" height=\"12\" fill=\"", PhaseColor(p), "\"/>");
      absl::StrAppend(&body_, "<text x=\"", Px(x + 16), "\" y=\"", Px(y_ + 10), "\">", XmlEscape(p), "</text>");
      x += 24 + 7.0 * p.size();
    }
    y_ += 24;
  }

  void Update(const v1::UpdateRecord& r) {
    const std::vector<double> starts = PhaseStarts(r);
    double span = r.total_seconds();
    for (int i = 0; i < r.phases_size(); ++i) span = std::max(span, starts[i] + r.phases(i).seconds());
    for (const auto& s : r.source_pushes()) {
      for (int i = 0; i < r.phases_size(); ++i)
        if (r.phases(i).phase() == "push") span = std::max(span, starts[i] + s.seconds());
    }
    for (const auto& e : r.engine_phases()) span = std::max(span, e.start_seconds() + e.seconds());
    scale_ = plot_ / (span > 0 ? span : 1);
    const std::string v = absl::StrCat(r.version());
    const std::string outcome = r.success() ? "ok" : (r.aborted() ? "ABORTED" : "FAILED");
    absl::StrAppend(&body_, "<g class=\"update\" data-version=\"", v, "\" data-outcome=\"", outcome, "\">");
    std::string head =
        absl::StrCat("update ", v, " \u00b7 ", outcome, " \u00b7 ", Seconds(r.total_seconds()), " \u00b7 ",
                     Bytes(r.bytes()), " \u00b7 ", r.engines(), " engines, ", r.engine_ranks(), " ranks",
                     r.mode().empty() ? "" : absl::StrCat(" \u00b7 ", r.mode()));
    absl::StrAppend(&body_, "<text class=\"heading\" x=\"10\" y=\"", Px(y_ + 12), "\" font-weight=\"bold\">",
                    XmlEscape(head), "</text>");
    y_ += 18;
    if (!r.success() && !r.error().empty()) {
      std::string err = r.error().size() > 200 ? r.error().substr(0, 200) + "\u2026" : r.error();
      absl::StrAppend(&body_, "<text class=\"error\" x=\"10\" y=\"", Px(y_ + 11), "\" fill=\"#c0392b\">",
                      XmlEscape(err), "<title>", XmlEscape(r.error()), "</title></text>");
      y_ += 16;
    }
    Axis(span);
    Row("update", "update");
    for (int i = 0; i < r.phases_size(); ++i) {
      const auto& p = r.phases(i);
      Bar(v, "update", p.phase(), starts[i], p.seconds(),
          absl::StrCat(p.phase(), ": ", Seconds(p.seconds()), " (from ", Seconds(starts[i]), ")"), true);
    }
    y_ += kRowHeight + kRowGap;
    double push_start = 0;
    for (int i = 0; i < r.phases_size(); ++i)
      if (r.phases(i).phase() == "push") push_start = starts[i];
    for (const auto& s : r.source_pushes()) {
      const std::string row = absl::StrCat("source:", s.node_id());
      Row(row, absl::StrCat("source ", s.node_id()));
      const std::string figures = absl::StrCat(Bytes(s.bytes()), ", ", Rate(s.bytes(), s.seconds()));
      Bar(v, row, "push", push_start, s.seconds(),
          absl::StrCat("push from ", s.node_id(), ": ", Seconds(s.seconds()), ", ", figures, " (ingest ",
                       Seconds(s.ingest_seconds()), ", write ", Seconds(s.write_seconds()), ")"),
          true);
      absl::StrAppend(&body_, "<text class=\"figures\" x=\"", Px(kLabelWidth + (push_start + s.seconds()) * scale_ + 4),
                      "\" y=\"", Px(y_ + 12), "\">", XmlEscape(figures), "</text>");
      y_ += kRowHeight + kRowGap;
    }
    std::set<std::string> engines;
    for (const auto& e : r.engine_phases()) engines.insert(e.engine_id());
    for (const auto& id : engines) {
      const std::string row = absl::StrCat("engine:", id);
      Row(row, absl::StrCat("engine ", id));
      for (const auto& e : r.engine_phases()) {
        if (e.engine_id() != id) continue;
        Bar(v, row, e.phase(), e.start_seconds(), e.seconds(),
            absl::StrCat(e.phase(), " at ", id, ": ", Seconds(e.seconds()), e.ok() ? "" : " (FAILED)"), e.ok());
      }
      y_ += kRowHeight + kRowGap;
    }
    absl::StrAppend(&body_, "</g>");
    y_ += 14;
  }

  void Empty() {
    absl::StrAppend(&body_, "<text class=\"empty\" x=\"10\" y=\"", Px(y_ + 12), "\">no updates recorded yet</text>");
    y_ += 24;
  }

  std::string Finish() const {
    const double h = y_ + 6;
    return absl::StrCat("<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"wsync-timeline\" width=\"", Px(width_),
                        "\" height=\"", Px(h), "\" viewBox=\"0 0 ", Px(width_), " ", Px(h),
                        "\" font-family=\"sans-serif\" font-size=\"12\">", "<rect x=\"0\" y=\"0\" width=\"", Px(width_),
                        "\" height=\"", Px(h), "\" fill=\"#ffffff\"/>", body_, "</svg>\n");
  }

 private:
  void Row(const std::string& row, const std::string& label) {
    absl::StrAppend(&body_, "<text class=\"row\" data-row=\"", XmlEscape(row), "\" x=\"10\" y=\"", Px(y_ + 12), "\">",
                    XmlEscape(label.size() > 28 ? label.substr(0, 27) + "\u2026" : label), "</text>");
    absl::StrAppend(&body_, "<rect x=\"", Px(kLabelWidth), "\" y=\"", Px(y_), "\" width=\"", Px(plot_), "\" height=\"",
                    Px(kRowHeight), "\" fill=\"#f4f4f4\"/>");
  }

  // Width proportional to `seconds`; a bar too short to see still gets a hairline (1 px) so that every call shows.
  void Bar(const std::string& version, const std::string& row, const std::string& phase, double start, double seconds,
           const std::string& title, bool ok) {
    const double w = std::max(1.0, seconds * scale_);
    absl::StrAppend(&body_, "<rect class=\"phase\" data-version=\"", version, "\" data-row=\"", XmlEscape(row),
                    "\" data-phase=\"", XmlEscape(phase), "\" data-seconds=\"", absl::StrFormat("%.6f", seconds),
                    "\" x=\"", Px(kLabelWidth + start * scale_), "\" y=\"", Px(y_ + 1), "\" width=\"", Px(w),
                    "\" height=\"", Px(kRowHeight - 2), "\" fill=\"", PhaseColor(phase), "\"",
                    ok ? "" : " stroke=\"#c0392b\" stroke-width=\"2\"", "><title>", XmlEscape(title),
                    "</title></rect>");
  }

  void Axis(double span) {
    const double step = TickStep(span > 0 ? span : 1);
    for (double t = 0; t <= span * 1.0001 + 1e-12; t += step) {
      const double x = kLabelWidth + t * scale_;
      absl::StrAppend(&body_, "<line x1=\"", Px(x), "\" y1=\"", Px(y_), "\" x2=\"", Px(x), "\" y2=\"", Px(y_ + 4),
                      "\" stroke=\"#888\"/>");
      absl::StrAppend(&body_, "<text class=\"tick\" x=\"", Px(x + 2), "\" y=\"", Px(y_ + 12),
                      "\" fill=\"#666\" font-size=\"10\">", TickLabel(t, step, span), "</text>");
    }
    y_ += 16;
  }

  double width_, plot_;
  double scale_ = 1;  // px per second of the update being drawn
  double y_ = 10;
  std::string body_;
};

}  // namespace

std::string XmlEscape(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 && c != '\n' && c != '\t' && c != '\r') break;
        out += c;
    }
  }
  return out;
}

std::string TimelineSvg(const std::vector<v1::UpdateRecord>& records, const TimelineOptions& options) {
  Drawing d(options.width);
  std::vector<std::string> phases;  // in the order they first appear
  for (const auto& r : records) {
    for (const auto& p : r.phases())
      if (std::find(phases.begin(), phases.end(), p.phase()) == phases.end()) phases.push_back(p.phase());
  }
  if (records.empty()) {
    d.Empty();
    return d.Finish();
  }
  d.Legend(phases);
  for (const auto& r : records) d.Update(r);
  return d.Finish();
}

void AddEnginePhases(v1::UpdateRecord* rec, const std::vector<EngineCallEnd>& ends,
                     const std::map<std::string, std::string>& engine_ids, int max_engines) {
  const absl::Time started = absl::FromUnixMillis(rec->started_unix_ms());
  const std::vector<double> starts = PhaseStarts(*rec);
  // Beyond max_engines, the engines whose last call ended latest: where the update waited.
  std::map<std::string, absl::Time> last_end;
  for (const auto& e : ends) last_end[e.address] = std::max(last_end[e.address], e.end);
  std::set<std::string> kept;
  if (last_end.size() > static_cast<size_t>(std::max(max_engines, 0))) {
    std::vector<std::pair<absl::Time, std::string>> by_end;
    for (const auto& [a, t] : last_end) by_end.emplace_back(t, a);
    std::sort(by_end.rbegin(), by_end.rend());
    for (int i = 0; i < max_engines; ++i) kept.insert(by_end[i].second);
  } else {
    for (const auto& [a, t] : last_end) kept.insert(a);
  }
  for (const auto& e : ends) {
    if (!kept.count(e.address)) continue;
    int at = -1;
    for (int i = 0; i < rec->phases_size(); ++i)
      if (rec->phases(i).phase() == e.phase) at = i;  // the last one of that name: the one this call belongs to
    if (at < 0) continue;
    auto* p = rec->add_engine_phases();
    auto id = engine_ids.find(e.address);
    p->set_engine_id(id == engine_ids.end() ? e.address : id->second);
    p->set_phase(e.phase);
    p->set_start_seconds(starts[at]);
    p->set_seconds(std::max(0.0, absl::ToDoubleSeconds(e.end - started) - starts[at]));
    p->set_ok(e.ok);
  }
}

void AddSourcePushes(v1::UpdateRecord* rec, const std::vector<std::pair<std::string, v1::FinishUpdateReply>>& finished,
                     const std::map<std::string, absl::Time>& done, const std::map<std::string, std::string>& node_ids,
                     absl::Time push_start) {
  for (const auto& [addr, reply] : finished) {
    auto* s = rec->add_source_pushes();
    auto id = node_ids.find(addr);
    s->set_node_id(id == node_ids.end() ? addr : id->second);
    s->set_bytes(reply.bytes_written());
    auto d = done.find(addr);
    s->set_seconds(d == done.end() ? 0 : std::max(0.0, absl::ToDoubleSeconds(d->second - push_start)));
    s->set_ingest_seconds(reply.ingest_seconds());
    s->set_write_seconds(reply.write_seconds());
  }
  // Sources answer in any order; the record lists them by node id.
  std::sort(rec->mutable_source_pushes()->begin(), rec->mutable_source_pushes()->end(),
            [](const v1::SourcePush& a, const v1::SourcePush& b) { return a.node_id() < b.node_id(); });
}

}  // namespace wsync::daemon
