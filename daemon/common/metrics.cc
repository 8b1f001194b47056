#include "daemon/common/metrics.h"

#include <cerrno>  // program_invocation_short_name
#include <cmath>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/cli.h"
#include "httplib.h"
#include "proto/tls.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {
namespace {

// Label values and help texts escaped as the exposition format asks (backslash, quote, newline).
std::string Escape(const std::string& s, bool quote) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (quote && c == '"') out += "\\\"";
    else out += c;
  }
  return out;
}

std::string Num(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrCat(static_cast<int64_t>(v));
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

std::string LabelText(const Labels& labels, const std::string& extra_key = "", const std::string& extra = "") {
  if (labels.empty() && extra_key.empty()) return "";
  std::string out = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    absl::StrAppend(&out, first ? "" : ",", k, "=\"", Escape(v, true), "\"");
    first = false;
  }
  if (!extra_key.empty()) absl::StrAppend(&out, first ? "" : ",", extra_key, "=\"", extra, "\"");
  return out + "}";
}

}  // namespace

const std::vector<double>& Metrics::DefaultSecondsBuckets() {
  static const std::vector<double> b = {0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                                        600};
  return b;
}

void Metrics::Declare(const std::string& name, const std::string& type, const std::string& help,
                      std::vector<double> buckets) {
  std::lock_guard<std::mutex> l(mu_);
  if (families_.count(name)) return;
  Family f;
  f.type = type;
  f.help = help;
  f.bounds = type == "histogram" ? (buckets.empty() ? DefaultSecondsBuckets() : std::move(buckets))
                                 : std::vector<double>();
  families_.emplace(name, std::move(f));
}

Metrics::Family* Metrics::Find(const std::string& name, const char* want_type) {
  auto it = families_.find(name);
  if (it == families_.end() || it->second.type != want_type) {
    // A programming error; never take the process down for a metric.
    spdlog::debug("metric {} is not a declared {}", name, want_type);
    return nullptr;
  }
  return &it->second;
}

void Metrics::Add(const std::string& name, const Labels& labels, double delta) {
  std::lock_guard<std::mutex> l(mu_);
  if (Family* f = Find(name, "counter"); f != nullptr && delta >= 0) f->series[labels].value += delta;
}

void Metrics::Set(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> l(mu_);
  if (Family* f = Find(name, "gauge")) f->series[labels].value = value;
}

void Metrics::SetCounter(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> l(mu_);
  if (Family* f = Find(name, "counter")) f->series[labels].value = value;
}

void Metrics::Observe(const std::string& name, const Labels& labels, double value) {
  std::lock_guard<std::mutex> l(mu_);
  Family* f = Find(name, "histogram");
  if (f == nullptr) return;
  Series& s = f->series[labels];
  if (s.buckets.empty()) s.buckets.assign(f->bounds.size(), 0);
  for (size_t i = 0; i < f->bounds.size(); ++i)
    if (value <= f->bounds[i]) {
      ++s.buckets[i];  // non-cumulative here; summed up at render time
      break;
    }
  s.value += value;
  ++s.count;
}

void Metrics::Preset(const std::string& name, const std::vector<Labels>& label_sets) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = families_.find(name);
  if (it == families_.end()) {
    spdlog::debug("metric {} is not declared", name);
    return;
  }
  for (const Labels& labels : label_sets) {
    Series& s = it->second.series[labels];
    if (it->second.type == "histogram" && s.buckets.empty()) s.buckets.assign(it->second.bounds.size(), 0);
  }
}

void Metrics::ClearFamily(const std::string& name) {
  std::lock_guard<std::mutex> l(mu_);
  if (auto it = families_.find(name); it != families_.end()) it->second.series.clear();
}

double Metrics::Value(const std::string& name, const Labels& labels) const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = families_.find(name);
  if (it == families_.end()) return 0;
  auto s = it->second.series.find(labels);
  return s == it->second.series.end() ? 0 : s->second.value;
}

void Metrics::OnCollect(std::function<void(Metrics&)> fn) {
  std::lock_guard<std::mutex> l(mu_);
  collect_.push_back(std::move(fn));
}

std::string Metrics::Render() {
  std::vector<std::function<void(Metrics&)>> collect;
  {
    std::lock_guard<std::mutex> l(mu_);
    collect = collect_;
  }
  for (auto& fn : collect) fn(*this);
  std::lock_guard<std::mutex> l(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    absl::StrAppend(&out, "# HELP ", name, " ", Escape(f.help, false), "\n# TYPE ", name, " ", f.type, "\n");
    for (const auto& [labels, s] : f.series) {
      if (f.type != "histogram") {
        absl::StrAppend(&out, name, LabelText(labels), " ", Num(s.value), "\n");
        continue;
      }
      uint64_t cum = 0;
      for (size_t i = 0; i < f.bounds.size(); ++i) {
        cum += s.buckets.empty() ? 0 : s.buckets[i];
        absl::StrAppend(&out, name, "_bucket", LabelText(labels, "le", Num(f.bounds[i])), " ", cum, "\n");
      }
      absl::StrAppend(&out, name, "_bucket", LabelText(labels, "le", "+Inf"), " ", s.count, "\n");
      absl::StrAppend(&out, name, "_sum", LabelText(labels), " ", Num(s.value), "\n");
      absl::StrAppend(&out, name, "_count", LabelText(labels), " ", s.count, "\n");
    }
  }
  return out;
}

void ExportRefusalCounters(Metrics& m, std::function<uint64_t()> refused_writes) {
  m.Declare("wsync_tls_handshake_failures_total", "counter",
            "TLS handshakes of this process's gRPC servers and channels that failed (a peer without a valid "
            "certificate of the cluster CA, or a server whose certificate does not verify).");
  if (refused_writes) {
    m.Declare("wsync_refused_writes_total", "counter",
              "Writes and data connections refused by this node's data listener (outside a write window or grant, "
              "into a source's read-only memory, unknown secrets, connection caps, hello deadlines).");
  }
  m.OnCollect([refused_writes = std::move(refused_writes)](Metrics& mm) {
    mm.SetCounter("wsync_tls_handshake_failures_total", {}, static_cast<double>(tls::HandshakeFailures()));
    if (refused_writes) mm.SetCounter("wsync_refused_writes_total", {}, static_cast<double>(refused_writes()));
  });
}

void PresetCoordinatorSeries(Metrics& m) {
  // The results the coordinator counts an ended update under (docs/operations.md, "Metrics").
  std::vector<Labels> results;
  for (const char* r : {"ok", "failed", "aborted", "not_resumed"}) results.push_back({{"result", r}});
  m.Preset("wsync_updates_total", results);
  // The phases every classic update's record times (the table of docs/operations.md); staged ones appear when used.
  std::vector<Labels> phases;
  for (const char* p :
       {"pause", "configure", "push", "apply_delta", "post_process", "set_version", "continue", "abort"})
    phases.push_back({{"phase", p}});
  m.Preset("wsync_update_phase_seconds", phases);
  for (const char* name : {"wsync_update_bytes_total", "wsync_update_dense_bytes_total",
                           "wsync_update_sent_bytes_total", "wsync_update_seconds"})
    m.Preset(name);
}

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen, Metrics* metrics) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 || !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535)
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", listen, "' is not HOST:PORT"));
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  // Which build answers, on every server (Prometheus' build_info convention: a gauge of 1 with the facts as labels).
  metrics->Declare("wsync_build_info", "gauge", "the build of this process: version, commit and program (always 1)");
  metrics->Set("wsync_build_info",
               {{"version", cli::Version()}, {"commit", cli::GitCommit()}, {"program", program_invocation_short_name}},
               1);
  std::unique_ptr<MetricsServer> s(new MetricsServer());
  s->server_ = std::make_unique<httplib::Server>();
  // SO_REUSEADDR only: the library's default also sets SO_REUSEPORT, which would let a second process share the port.
  s->server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  s->server_->Get("/metrics", [metrics](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics->Render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  s->server_->Get("/healthz", [](const httplib::Request&, httplib::Response& res) { res.set_content("ok\n", "text/plain"); });
  s->port_ = port == 0 ? s->server_->bind_to_any_port(host) : (s->server_->bind_to_port(host, port) ? port : -1);
  if (s->port_ <= 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", listen, " for metrics"));
  httplib::Server* srv = s->server_.get();
  s->thread_ = std::thread([srv] { srv->listen_after_bind(); });
  spdlog::info("metrics on http://{}:{}/metrics", host, s->port_);
  return s;
}

MetricsServer::~MetricsServer() {
  if (server_) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace wsync::daemon
