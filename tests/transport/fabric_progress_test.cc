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

// Feeds reads to a pacer on a simulated clock: every read advances the clock by its cost plus the pause it got.
class Sim {
 public:
  explicit Sim(ProgressPacer::Options opts = {}) : pacer_(opts), now_(Clock::time_point{} + std::chrono::hours(1)) {}

  microseconds Read(nanoseconds cost, bool entries = false, bool driven = false) {
    now_ += cost;
    ProgressRead r;
    r.entries_or_error = entries;
    r.cpu = cost;
    r.now = now_;
    r.driven = driven;
    const microseconds pause = pacer_.Next(r);
    now_ += pause;
    return pause;
  }
  microseconds Empty(bool driven = false) { return Read(kEmptyCost, false, driven); }
  microseconds Busy(bool driven = false) { return Read(kBusyCost, false, driven); }
  void Advance(microseconds d) { now_ += d; }
  const ProgressPacer& pacer() const { return pacer_; }

 private:
  ProgressPacer pacer_;
  Clock::time_point now_;
};

// Lets any spin run out, settles the empty-read estimate and backs the pacer off to its longest pause, as on an
// idle domain.
void Idle(Sim& sim) {
  sim.Advance(std::chrono::seconds(1));
  for (int i = 0; i < 64; ++i) sim.Empty();
}

}  // namespace

TEST_CASE("an idle domain backs off to the longest pause, doubling from the shortest", "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  CHECK(sim.Empty() == o.min_pause);
  CHECK(sim.Empty() == 2 * o.min_pause);
  CHECK(sim.Empty() == 4 * o.min_pause);
  Idle(sim);
  CHECK(sim.Empty() == o.max_pause);
  CHECK_FALSE(sim.pacer().last_busy());
}

TEST_CASE("a read that returned entries or an error, or cost clearly more than an empty one, is followed at once",
          "[fabric][progress]") {
  Sim sim;
  Idle(sim);
  CHECK(sim.Read(kEmptyCost, /*entries=*/true) == microseconds(0));
  CHECK(sim.pacer().last_busy());
  Idle(sim);
  // After a pause a dear read is checked by another at once; the second, dear too, is work.
  CHECK(sim.Busy() == microseconds(0));
  CHECK_FALSE(sim.pacer().last_busy());
  CHECK(sim.Busy() == microseconds(0));
  CHECK(sim.pacer().last_busy());
  Idle(sim);
  // Dearer than usual but under the floor (a few hundred ns of noise): not work.
  CHECK(sim.Read(nanoseconds(1500)) > microseconds(0));
  CHECK_FALSE(sim.pacer().last_busy());
}

TEST_CASE("while writes arrive, the empty reads between busy ones do not pause the thread", "[fabric][progress]") {
  // A flow as ofi_rxm shows it: a busy read, then a few empty ones until the next message is in.
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  REQUIRE(sim.Busy() == microseconds(0));  // the first after the idle pause: checked at once
  for (int msg = 0; msg < 1000; ++msg) {
    INFO("message " << msg);
    REQUIRE(sim.Busy() == microseconds(0));
    for (int i = 0; i < 20; ++i) REQUIRE(sim.Empty() == microseconds(0));
  }
  // A gap shorter than the spin still spins; one longer ends it, and the thread backs off from the shortest pause.
  sim.Advance(o.spin / 2);
  CHECK(sim.Empty() == microseconds(0));
  sim.Advance(o.spin);
  CHECK(sim.Empty() == o.min_pause);
  CHECK(sim.Empty() == 2 * o.min_pause);
}

TEST_CASE("the spin lasts `spin` after the last busy read, not longer", "[fabric][progress]") {
  ProgressPacer::Options o;
  o.spin = microseconds(1000);
  Sim sim(o);
  Idle(sim);
  REQUIRE(sim.Busy() == microseconds(0));
  REQUIRE(sim.Busy() == microseconds(0));
  int spun = 0;
  while (sim.Empty() == microseconds(0)) ++spun;
  // Every empty read advances the clock by kEmptyCost: the spin ended within one read of its budget.
  CHECK(spun == o.spin / kEmptyCost);
  // Backed off now, and stays so.
  for (int i = 0; i < 64; ++i) REQUIRE(sim.Empty() > microseconds(0));
  CHECK(sim.Empty() == o.max_pause);
}

TEST_CASE("a thread driving its own endpoint keeps the progress thread from spinning beside it", "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  // Busy reads are still followed at once (other endpoints of the domain may be receiving) ...
  CHECK(sim.Busy(/*driven=*/true) == microseconds(0));
  CHECK(sim.Busy(/*driven=*/true) == microseconds(0));
  // ... but empty ones pause, backing off as on an idle domain.
  CHECK(sim.Empty(/*driven=*/true) == o.min_pause);
  CHECK(sim.Empty(/*driven=*/true) == 2 * o.min_pause);
  // Once nobody drives, a read inside the spin after recent work spins again.
  CHECK(sim.Busy() == microseconds(0));
  CHECK(sim.Empty() == microseconds(0));
}

TEST_CASE("a lasting rise of the empty read's cost is caught up with, not taken for work from then on",
          "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  // The provider's empty read becomes dearer for good (many more endpoints bound to the queue): 4 us, > 3x before.
  const nanoseconds dearer(4000);
  int busy = 0;
  for (int i = 0; i < 2000; ++i) {
    sim.Read(dearer);
    busy += sim.pacer().last_busy() ? 1 : 0;
  }
  // Taken for work while the estimate climbs (2 % a read: about 130 reads from 300 ns to 4 us), then no more.
  CHECK(busy > 0);
  CHECK(busy < 200);
  CHECK(sim.Read(dearer) == o.max_pause);
  CHECK_FALSE(sim.pacer().last_busy());
}

TEST_CASE("busy reads do not raise the empty-read estimate while cheap reads lie between them", "[fabric][progress]") {
  Sim sim;
  Idle(sim);
  REQUIRE(sim.Busy() == microseconds(0));  // the first after the idle pause: checked at once
  // A long flow: two busy reads to one empty one. Every busy read must still be seen as work.
  for (int i = 0; i < 5000; ++i) {
    INFO("read " << i);
    REQUIRE(sim.Busy() == microseconds(0));
    REQUIRE(sim.pacer().last_busy());
    REQUIRE(sim.Busy() == microseconds(0));
    REQUIRE(sim.pacer().last_busy());
    REQUIRE(sim.Empty() == microseconds(0));
  }
}

TEST_CASE("a dear first read after every pause (cold caches) neither spins the thread nor shortens its pause",
          "[fabric][progress]") {
  ProgressPacer::Options o;
  Sim sim(o);
  Idle(sim);
  // An idle domain as tcp;ofi_rxm showed it: the read after each pause costs 5 us, the one right after 300 ns.
  for (int i = 0; i < 1000; ++i) {
    INFO("pause " << i);
    REQUIRE(sim.Busy() == microseconds(0));
    REQUIRE_FALSE(sim.pacer().last_busy());
    REQUIRE(sim.Empty() == o.max_pause);
  }
}
