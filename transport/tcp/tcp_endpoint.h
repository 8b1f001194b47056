#pragma once
// The sending side: endpoint info strings and the tcp Endpoint.

#include <cstdint>
#include <memory>
#include <string>

#include "transport/tcp/tcp_region_table.h"
#include "transport/transport.h"

namespace wsync::transport::tcp {

// An endpoint's LocalInfo: "wsync-tcp/1 HOST PORT TOKEN".
std::string FormatInfo(const std::string& host, int port, uint64_t token);

// A granted endpoint's info: FormatInfo plus " SECRET" (32 hex digits).
std::string FormatGrantedInfo(const std::string& info, const RegionTable::Secret& sec);

// A new unconnected endpoint whose LocalInfo is `local_info`. With `grant_table`, a granted endpoint
// (Transport::CreateGrantedEndpoint): destroying it revokes the grant `secret`.
std::unique_ptr<Endpoint> NewTcpEndpoint(std::string local_info, const TransportOptions& opts,
                                         std::shared_ptr<RegionTable> grant_table = nullptr,
                                         RegionTable::Secret secret = {0, 0});

}  // namespace wsync::transport::tcp
