#include "transport/verbs/verbs_wire.h"

#include <cstring>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/byte_codec.h"

namespace wsync::transport::verbs {
namespace {

constexpr uint32_t kConnMagic = 0x45565357;    // "WSVE"
constexpr uint32_t kRegionMagic = 0x52565357;  // "WSVR"
constexpr uint16_t kVersion = 1;
constexpr uint16_t kGrantedConnVersion = 2;  // connection info of a granted endpoint: version 1 + the granted regions
constexpr uint32_t kMaxGrantedRegions = 1 << 20;
constexpr size_t kMaxOwner = 1024;
constexpr uint32_t kMaxQps = 4096;
constexpr uint32_t kMaxDevices = 64;

using Writer = ByteWriter;
using Reader = ByteReader;

absl::Status Malformed(const char* what, const char* detail) {
  return absl::InvalidArgumentError(absl::StrCat("malformed verbs ", what, ": ", detail));
}

}  // namespace

std::string EncodeConnInfo(const ConnInfo& info) {
  Writer w;
  w.Put(kConnMagic);
  w.Put(info.granted ? kGrantedConnVersion : kVersion);
  w.Put(static_cast<uint16_t>(0));
  w.Put(info.transport_id);
  w.PutString(info.owner);
  w.Put(static_cast<uint32_t>(info.qps.size()));
  for (const WireQp& qp : info.qps) w.Put(qp);
  if (info.granted) {
    w.Put(static_cast<uint32_t>(info.grant.size()));
    for (const GrantedRegion& g : info.grant) {
      w.Put(g.base);
      w.Put(g.length);
      w.Put(g.chunk_size);
      w.Put(g.num_devices);
      w.Put(g.num_chunks);
      for (uint32_t k : g.rkeys) w.Put(k);
    }
  }
  return w.Take();
}

absl::StatusOr<ConnInfo> DecodeConnInfo(const std::string& blob) {
  Reader r(blob);
  uint32_t magic = 0, nqps = 0;
  uint16_t version = 0, pad = 0;
  ConnInfo info;
  if (!r.Get(&magic) || magic != kConnMagic) return Malformed("connection info", "bad magic (not a verbs endpoint?)");
  if (!r.Get(&version) || (version != kVersion && version != kGrantedConnVersion) || !r.Get(&pad))
    return Malformed("connection info", "unknown version");
  // Reserved: zero in every blob this version writes; anything else is not a blob of this version.
  if (pad != 0) return Malformed("connection info", "reserved field is not zero");
  if (!r.Get(&info.transport_id) || !r.GetString(&info.owner, kMaxOwner) || !r.Get(&nqps) || nqps == 0 ||
      nqps > kMaxQps) {
    return Malformed("connection info", "truncated header");
  }
  info.qps.resize(nqps);
  for (WireQp& qp : info.qps) {
    if (!r.Get(&qp)) return Malformed("connection info", "truncated queue pair list");
  }
  if (version == kGrantedConnVersion) {
    info.granted = true;
    uint32_t n = 0;
    if (!r.Get(&n) || n > kMaxGrantedRegions || n > blob.size() / 32)
      return Malformed("connection info", "bad granted region count");
    info.grant.resize(n);
    for (GrantedRegion& g : info.grant) {
      if (!r.Get(&g.base) || !r.Get(&g.length) || !r.Get(&g.chunk_size) || !r.Get(&g.num_devices) ||
          !r.Get(&g.num_chunks))
        return Malformed("connection info", "truncated granted region");
      if (g.num_devices == 0 || g.num_devices > kMaxDevices)
        return Malformed("connection info", "bad device count of a granted region");
      uint64_t expect_chunks = 0;
      if (g.length > 0) {
        if (g.chunk_size == 0) return Malformed("connection info", "zero chunk size of a granted region");
        expect_chunks = (g.length - 1) / g.chunk_size + 1;
      }
      if (g.num_chunks != expect_chunks)
        return Malformed("connection info", "chunk count of a granted region does not match its length");
      if (g.base + g.length < g.base) return Malformed("connection info", "granted address range wraps");
      uint64_t nkeys = static_cast<uint64_t>(g.num_devices) * g.num_chunks;
      if (nkeys > blob.size() / sizeof(uint32_t)) return Malformed("connection info", "truncated granted rkey list");
      g.rkeys.resize(nkeys);
      for (uint32_t& k : g.rkeys) {
        if (!r.Get(&k)) return Malformed("connection info", "truncated granted rkey list");
      }
    }
  }
  if (!r.AtEnd()) return Malformed("connection info", "trailing bytes");
  return info;
}

std::string EncodeRegionDesc(const RegionDesc& desc) {
  Writer w;
  w.Put(kRegionMagic);
  w.Put(kVersion);
  w.Put(static_cast<uint16_t>(0));
  w.Put(desc.transport_id);
  w.PutString(desc.owner);
  w.Put(desc.base);
  w.Put(desc.length);
  w.Put(desc.chunk_size);
  w.Put(desc.num_devices);
  w.Put(desc.num_chunks);
  for (uint32_t k : desc.rkeys) w.Put(k);
  return w.Take();
}

absl::StatusOr<RegionDesc> DecodeRegionDesc(const std::string& blob) {
  Reader r(blob);
  uint32_t magic = 0;
  uint16_t version = 0, pad = 0;
  RegionDesc d;
  if (!r.Get(&magic) || magic != kRegionMagic) return Malformed("region descriptor", "bad magic (not a verbs region?)");
  if (!r.Get(&version) || version != kVersion || !r.Get(&pad)) return Malformed("region descriptor", "unknown version");
  if (pad != 0) return Malformed("region descriptor", "reserved field is not zero");
  if (!r.Get(&d.transport_id) || !r.GetString(&d.owner, kMaxOwner) || !r.Get(&d.base) || !r.Get(&d.length) ||
      !r.Get(&d.chunk_size) || !r.Get(&d.num_devices) || !r.Get(&d.num_chunks)) {
    return Malformed("region descriptor", "truncated header");
  }
  if (d.num_devices == 0 || d.num_devices > kMaxDevices) return Malformed("region descriptor", "bad device count");
  uint64_t expect_chunks = 0;
  if (d.length > 0) {
    if (d.chunk_size == 0) return Malformed("region descriptor", "zero chunk size");
    expect_chunks = (d.length - 1) / d.chunk_size + 1;  // no overflow for huge chunk sizes
  }
  if (d.num_chunks != expect_chunks) return Malformed("region descriptor", "chunk count does not match length");
  if (d.base + d.length < d.base) return Malformed("region descriptor", "address range wraps");
  uint64_t nkeys = static_cast<uint64_t>(d.num_devices) * d.num_chunks;
  // Bound the allocation by what the blob can hold before reserving.
  if (nkeys > blob.size() / sizeof(uint32_t)) return Malformed("region descriptor", "truncated rkey list");
  d.rkeys.resize(nkeys);
  for (uint32_t& k : d.rkeys) {
    if (!r.Get(&k)) return Malformed("region descriptor", "truncated rkey list");
  }
  if (!r.AtEnd()) return Malformed("region descriptor", "trailing bytes");
  return d;
}

}  // namespace wsync::transport::verbs
