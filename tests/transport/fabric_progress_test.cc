// The fabric progress thread's pacing decision (ProgressPacer): when it reads again at once, when it spins through
// empty reads, when it backs off. Pure: no provider, no clock (the reads' times and costs are given).

#include "transport/fabric/fabric_progress.h"

#include <catch2/catch.hpp>
#include <chrono>

namespace {

using std::chrono::microseconds;
using std::chrono::nanoseconds;
using wsync::transport::fabric::ProgressPacer;
using wsync::transport::fabric::ProgressRead;
using Clock = std::chrono::steady_clock;

constexpr nanoseconds kEmptyCost{300};  // what an empty read costs in these cases
constexpr nanoseconds kBusyCost{20000};

using Step = ProgressPacer::Step;

// Feeds reads to a pacer on a simulated clock: every read advances the clock by its cost plus the pause it got.
class Sim {
 public:
  explicit Sim(ProgressPacer::Options opts = {}) : pacer_(opts), now_(Clock::time_point{} + std::chrono::hours(1)) {}

  Step Read(nanoseconds cost, bool entries = false, bool driven = false) {
    now_ += cost;
    ProgressRead r;
    r.entries_or_error = entries;
    r.cpu = cost;
    r.now = now_;
    r.driven = driven;
    r.expected = expected_;
    const Step step = pacer_.Next(r);
    if (step.kind == Step::kPause) now_ += step.pause;
    return step;
  }
  Step Empty(bool driven = false) { return Read(kEmptyCost, false, driven); }
  Step Busy(bool driven = false) { return Read(kBusyCost, false, driven); }
  void Advance(microseconds d) { now_ += d; }
  // The write window: open (writes expected) or closed, for the reads that follow.
  void SetExpected(bool expected) { expected_ = expected; }
  const ProgressPacer& pacer() const { return pacer_; }

 private:
  ProgressPacer pacer_;
  Clock::time_point now_;
  bool expected_ = false;
};

bool IsRead(const Step& s) { return s.kind == Step::kRead; }
bool IsYield(const Step& s) { return s.kind == Step::kYield; }
microseconds PauseOf(const Step& s) { return s.kind == Step::kPause ? s.pause : microseconds(0); }

// Lets any spin run out, settles the empty-read estimate and backs the pacer off to its longest pause, as on an
// idle domain.
void Idle(Sim& sim) {
  sim.Advance(std::chrono::seconds(1));
  for (int i = 0; i < 64; ++i) sim.Empty();
}

// Starts a flow after an idle spell: the first busy read follows a pause and is only read on from; the second,
// right after it, shows the flow.
void StartFlow(Sim& sim) {
  REQUIRE(IsRead(sim.Busy()));
  REQUIRE_FALSE(sim.pacer().spinning());
  REQUIRE(IsRead(sim.Busy()));
  REQUIRE(sim.pacer().spinning());
}

}  // namespace

TEST_CASE("an idle domain backs off to the longest pause, doubling from the shortest", "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  CHECK(PauseOf(sim.Empty()) == o.min_pause);
  CHECK(PauseOf(sim.Empty()) == 2 * o.min_pause);
  CHECK(PauseOf(sim.Empty()) == 4 * o.min_pause);
  Idle(sim);
  CHECK(PauseOf(sim.Empty()) == o.max_pause);
  CHECK_FALSE(sim.pacer().spinning());
}

TEST_CASE("a read that returned entries or an error, or cost clearly more than an empty one, is followed at once",
          "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  CHECK(IsRead(sim.Read(kEmptyCost, /*entries=*/true)));
  CHECK(sim.pacer().spinning());  // entries are work for certain
  Idle(sim);
  CHECK(IsRead(sim.Busy()));
  // After it the pause starts again from the shortest: the flow may be starting.
  CHECK(PauseOf(sim.Empty()) == o.min_pause);
  Idle(sim);
  // Dearer than usual but under the floor (a few hundred ns of noise): not work.
  CHECK(PauseOf(sim.Read(nanoseconds(1500))) == o.max_pause);
}

TEST_CASE("while writes arrive, the empty reads between busy ones only yield", "[fabric][progress]") {
  // A flow as ofi_rxm shows it: a busy read, then a few empty ones until the next message is in.
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  StartFlow(sim);
  for (int msg = 0; msg < 1000; ++msg) {
    INFO("message " << msg);
    REQUIRE(IsRead(sim.Busy()));
    for (int i = 0; i < 20; ++i) REQUIRE(IsYield(sim.Empty()));
  }
  // A gap shorter than the spin still spins; one longer ends it, and the thread backs off from the shortest pause.
  sim.Advance(o.spin / 2);
  CHECK(IsYield(sim.Empty()));
  sim.Advance(o.spin);
  CHECK(PauseOf(sim.Empty()) == o.min_pause);
  CHECK(PauseOf(sim.Empty()) == 2 * o.min_pause);
  CHECK_FALSE(sim.pacer().spinning());
}

TEST_CASE("the spin lasts `spin` after the flow was last seen, not longer", "[fabric][progress]") {
  ProgressPacer::Options o;
  o.spin = microseconds(1000);
  Sim sim(o);
  Idle(sim);
  StartFlow(sim);
  int spun = 0;
  while (IsYield(sim.Empty())) ++spun;
  // Every empty read advances the clock by kEmptyCost: the spin ended within one read of its budget.
  CHECK(spun == o.spin / kEmptyCost);
  // Backed off now, and stays so.
  for (int i = 0; i < 64; ++i) REQUIRE(PauseOf(sim.Empty()) > microseconds(0));
  CHECK(PauseOf(sim.Empty()) == o.max_pause);
}

TEST_CASE("a thread driving its own endpoint keeps the progress thread from spinning beside it", "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  // Busy reads are still followed at once (other endpoints of the domain may be receiving) ...
  CHECK(IsRead(sim.Busy(/*driven=*/true)));
  CHECK(IsRead(sim.Busy(/*driven=*/true)));
  // ... but empty ones pause, backing off as on an idle domain.
  CHECK(PauseOf(sim.Empty(/*driven=*/true)) == o.min_pause);
  CHECK(PauseOf(sim.Empty(/*driven=*/true)) == 2 * o.min_pause);
  // Once nobody drives, an empty read inside the spin after a flow spins again.
  CHECK(IsRead(sim.Busy()));
  CHECK(IsYield(sim.Empty()));
}

TEST_CASE("a dear first read after every pause (cold caches) does not start a spin", "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  // An idle domain as tcp;ofi_rxm can show it: the read after each pause costs 5 us, the one right after 300 ns.
  for (int i = 0; i < 1000; ++i) {
    INFO("pause " << i);
    REQUIRE(IsRead(sim.Read(nanoseconds(5000))));
    REQUIRE_FALSE(sim.pacer().spinning());
    REQUIRE(PauseOf(sim.Empty()) > microseconds(0));
  }
}

TEST_CASE("busy reads do not raise the empty-read average: in a long flow every one is still seen as work",
          "[fabric][progress]") {
  Sim sim;
  Idle(sim);
  StartFlow(sim);
  // A long flow: two busy reads to one empty one. Every busy read must still be seen as work.
  for (int i = 0; i < 5000; ++i) {
    INFO("read " << i);
    REQUIRE(IsRead(sim.Busy()));
    REQUIRE(IsRead(sim.Busy()));
    REQUIRE(IsYield(sim.Empty()));
  }
}

TEST_CASE("while the write window is open the thread never pauses, whatever its reads cost; closed, it backs off",
          "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  sim.SetExpected(true);
  // Long past any spin, with reads that each handled a message too cheaply to be told from empty ones (the state
  // that paced tcp;ofi_rxm at one 16 KiB message per pause in a run of the bench).
  for (int i = 0; i < 100000; ++i) {
    INFO("read " << i);
    REQUIRE(IsYield(sim.Read(nanoseconds(i % 2 == 0 ? 300 : 700))));
  }
  CHECK(IsRead(sim.Busy()));
  CHECK(IsYield(sim.Empty()));
  sim.SetExpected(false);
  sim.Advance(2 * o.spin);
  CHECK(PauseOf(sim.Empty()) == o.min_pause);
  CHECK(PauseOf(sim.Empty()) == 2 * o.min_pause);
}

TEST_CASE("an open window does not make the progress thread spin beside a thread driving its endpoint",
          "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  sim.SetExpected(true);
  for (int i = 0; i < 8; ++i) CHECK(PauseOf(sim.Empty(/*driven=*/true)) == o.max_pause);
  CHECK(IsYield(sim.Empty()));
}
