#pragma once
// The transport conformance suite (conformance_test.cc) runs against whatever MakeTransportUnderTest returns.
// Each backend's test executable links the suite with one factory file that defines it (tcp_factory.cc,
// verbs_factory.cc). The suite calls it several times: each call is an independent transport instance (one per
// side of a connection, as in two separate processes).
//
// A backend that cannot run on this machine should std::exit(77) from MakeTransportUnderTest; CTest reports
// the executable as skipped (SKIP_RETURN_CODE 77).
//
// A transport that gives up on a peer which acknowledges nothing (tcp: TransportOptions::send_progress_timeout) gets
// a progress timeout of 1 s here: the stopped-peer case keeps its peer stopped 2.5 s (a live peer, to be waited for)
// and the [.dead_link] case requires a gone one reported within 6 s.

#include <memory>

#include "transport/transport.h"

std::unique_ptr<wsync::transport::Transport> MakeTransportUnderTest();
