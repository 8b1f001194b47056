// WatchEngines (daemon/coordinator/coordinator_service.h) over a real gRPC server: the interval is clamped both ways,
// a change wakes the stream (no polling), a caller that cancels frees its slot at once, and one identity cannot take
// every slot.

#include <grpcpp/grpcpp.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/common/serve.h"
#include "daemon/coordinator/coordinator.h"
#include "daemon/coordinator/coordinator_service.h"
#include "tests/daemon/fake_layouts.h"
#include "tests/daemon/idle_peers.h"
#include "wsync/v1/coordinator.grpc.pb.h"

namespace wsync::daemon {
namespace {

struct Server {
  Coordinator c{CoordinatorOptions(), std::make_unique<testing::IdlePeers>()};
  CoordinatorService svc{&c};
  Served served;
  std::unique_ptr<v1::Coordinator::Stub> stub;
  Server() {
    auto s = Serve("127.0.0.1:0", {&svc}, "");
    REQUIRE(s.ok());
    served = *std::move(s);
    stub = v1::Coordinator::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", served.port), grpc::InsecureChannelCredentials()));
  }
  ~Server() { served.server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(5))); }
};

struct Stream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReader<v1::EngineStates>> reader;
  Stream(v1::Coordinator::Stub* stub, double interval) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    v1::WatchEnginesRequest req;
    req.set_interval_seconds(interval);
    reader = stub->WatchEngines(&ctx, req);
  }
  grpc::Status Finish() {
    finished = true;
    return reader->Finish();
  }
  ~Stream() {
    if (finished) return;
    ctx.TryCancel();
    reader->Finish();
  }
  bool finished = false;
};

TEST_CASE("watch: the interval is clamped both ways; nonsense takes the default") {
  CHECK(WatchInterval(0) == CoordinatorService::kDefaultWatchInterval);
  CHECK(WatchInterval(-3) == CoordinatorService::kDefaultWatchInterval);
  CHECK(WatchInterval(std::nan("")) == CoordinatorService::kDefaultWatchInterval);
  CHECK(WatchInterval(0.001) == CoordinatorService::kMinWatchInterval);
  CHECK(WatchInterval(1e300) == CoordinatorService::kMaxWatchInterval);
  CHECK(WatchInterval(std::numeric_limits<double>::infinity()) == CoordinatorService::kMaxWatchInterval);
  CHECK(WatchInterval(2) == 2);
}

TEST_CASE("watch: a registration wakes the stream; the new engine is in the next message") {
  Server s;
  Stream w(s.stub.get(), 0.05);
  v1::EngineStates first;
  REQUIRE(w.reader->Read(&first));
  CHECK(first.engines_size() == 0);
  REQUIRE(s.c.RegisterNode(testing::TargetRegistration("t0", "e0", 1)).ok());
  v1::EngineStates next;
  REQUIRE(w.reader->Read(&next));  // bounded by the stream's deadline
  REQUIRE(next.engines_size() == 1);
  CHECK(next.engines(0).engine_id() == "e0");
}

TEST_CASE("watch: one identity holds at most kMaxWatchersPerIdentity streams; a cancelled one frees its slot") {
  Server s;
  std::vector<std::unique_ptr<Stream>> held;
  for (int i = 0; i < CoordinatorService::kMaxWatchersPerIdentity; ++i) {
    // The longest interval there is: the server must still see a cancellation at once.
    held.push_back(std::make_unique<Stream>(s.stub.get(), 1e300));
    v1::EngineStates m;
    REQUIRE(held.back()->reader->Read(&m));
  }
  {
    Stream extra(s.stub.get(), 0.2);
    v1::EngineStates m;
    CHECK_FALSE(extra.reader->Read(&m));
    const grpc::Status st = extra.Finish();
    CHECK(st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(absl::StrContains(st.error_message(), "already holds 4 WatchEngines streams"));
  }
  held.front()->ctx.TryCancel();
  held.front()->Finish();
  held.erase(held.begin());
  // The server notices the cancellation within its wait slice; a new stream gets the freed slot (bounded retries).
  bool opened = false;
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!opened && absl::Now() < deadline) {
    auto again = std::make_unique<Stream>(s.stub.get(), 0.2);
    v1::EngineStates m;
    opened = again->reader->Read(&m);
    if (opened) {
      held.push_back(std::move(again));
    } else {
      again->Finish();
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  CHECK(opened);
}

}  // namespace
}  // namespace wsync::daemon
