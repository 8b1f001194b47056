#pragma once
// The transport conformance suite (conformance_test.cc) runs against whatever MakeTransportUnderTest returns.
// Each backend's test executable links the suite with one factory file that defines it (tcp_factory.cc,
// verbs_factory.cc, fabric_factory.cc, fault_factory.cc, mooncake_factory.cc). The suite calls it several times:
// each call is an independent transport instance (one per side of a connection, as in two separate processes).
//
// A backend that cannot run on this machine should std::exit(77) from MakeTransportUnderTest; CTest reports
// the executable as skipped (SKIP_RETURN_CODE 77).
//
// A transport that gives up on a peer which acknowledges nothing (tcp: TransportOptions::send_progress_timeout) gets
// a progress timeout of 1 s here: the stopped-peer case keeps its peer stopped 2.5 s (a live peer, to be waited for)
// and the [.dead_link] case requires a gone one reported within 6 s.
//
// A backend whose receiving side is not a wsync transport (mooncake: the engine's own Transfer Engine) also defines
// MakePeerReceiverUnderTest: every case then writes into a PeerReceiver, a process of its own that holds the
// destination memory and reads it back, and the cases that need a wsync receiving transport (write windows, grants,
// Reusable) say by name that they do not apply. The suite's default (a weak definition) returns null: the receiving
// side is another instance from MakeTransportUnderTest.

#include <cstdint>
#include <memory>
#include <string>

#include "transport/transport.h"

std::unique_ptr<wsync::transport::Transport> MakeTransportUnderTest();

namespace wsync::transport::testing {

// The receiving side in a process of its own. One instance is one receiving process (as one transport instance is
// one receiving side); the suite calls it from one thread at a time, Kill from another thread too.
class PeerReceiver {
 public:
  virtual ~PeerReceiver() = default;
  // `length` bytes of the peer's memory, every one `fill`, writable by the sender: the descriptor the sender's
  // ImportRegion takes. Called before the sender connects (a peer may publish its memory at connection time).
  virtual std::string AddRegion(uint64_t length, uint8_t fill) = 0;
  // The region's bytes (of a descriptor AddRegion returned) as the peer's memory holds them now.
  virtual std::string Read(const std::string& descriptor) = 0;
  // Every byte of the region set to `fill`.
  virtual void Fill(const std::string& descriptor, uint8_t fill) = 0;
  // What the sender's Endpoint::Connect takes (nothing travels the other way).
  virtual std::string ConnectInfo() const = 0;
  // The whole process stopped (SIGSTOP: nothing it holds answers) and resumed; killed (gone for good).
  virtual void Stop() = 0;
  virtual void Resume() = 0;
  virtual void Kill() = 0;
  // The most bytes the sender may still have on the wire when Cancel returns (requests it had handed to the
  // network: bounded by its connections times its request size); nothing beyond them lands afterwards.
  virtual uint64_t InFlightBound() const = 0;
};

}  // namespace wsync::transport::testing

// Null (the default): the receiving side is a transport instance from MakeTransportUnderTest.
std::unique_ptr<wsync::transport::testing::PeerReceiver> MakePeerReceiverUnderTest();
