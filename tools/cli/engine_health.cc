#include "tools/cli/engine_health.h"

#include <httplib.h>

#include <thread>

#include "absl/strings/str_cat.h"

namespace wsync::tools {

HealthAnswer EngineHealth(const v1::EngineStates& states, bool have_states, const std::string& id) {
  if (!have_states) return {503, "no engine states from the coordinator yet"};
  for (const auto& e : states.engines()) {
    if (e.engine_id() != id) continue;
    if (e.ready()) return {200, absl::StrCat("ready version ", e.weight_version())};
    if (e.stale())
      return {503, absl::StrCat("stale: serves version ", e.weight_version(), ", the current one is ",
                                states.current_version())};
    if (e.paused()) return {503, absl::StrCat(e.state(), ": not serving")};
    return {503, absl::StrCat("not ready: ", e.state(), ", version ", e.weight_version(), " (current ",
                              states.current_version(), ")")};
  }
  return {404, absl::StrCat("no engine ", id)};
}

struct EngineHealthServer::Impl {
  httplib::Server server;
  std::thread thread;
  int port = 0;
  std::mutex mu;
  v1::EngineStates states;
  bool have = false;
};

absl::StatusOr<std::unique_ptr<EngineHealthServer>> EngineHealthServer::Start(const std::string& host, int port) {
  auto impl = std::make_unique<Impl>();
  Impl* p = impl.get();
  p->server.Get(R"(/engines/([^/]+)/ready)", [p](const httplib::Request& req, httplib::Response& res) {
    HealthAnswer a;
    {
      std::lock_guard<std::mutex> l(p->mu);
      a = EngineHealth(p->states, p->have, req.matches[1]);
    }
    res.status = a.code;
    res.set_content(a.body + "\n", "text/plain");
  });
  p->port = port == 0 ? p->server.bind_to_any_port(host) : (p->server.bind_to_port(host, port) ? port : -1);
  if (p->port <= 0) return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", port));
  p->thread = std::thread([p] { p->server.listen_after_bind(); });
  return std::unique_ptr<EngineHealthServer>(new EngineHealthServer(std::move(impl)));
}

EngineHealthServer::EngineHealthServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

EngineHealthServer::~EngineHealthServer() {
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

int EngineHealthServer::port() const { return impl_->port; }

void EngineHealthServer::Update(const v1::EngineStates& states) {
  std::lock_guard<std::mutex> l(impl_->mu);
  impl_->states = states;
  impl_->have = true;
}

}  // namespace wsync::tools
