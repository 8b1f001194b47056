#include "transport/fabric/fabric_wire.h"

#include <cstring>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/byte_codec.h"

namespace wsync::transport::fabric {
namespace {

constexpr uint32_t kConnMagic = 0x46465357;    // "WSFF"
constexpr uint32_t kRegionMagic = 0x52465357;  // "WSFR"
constexpr uint16_t kVersion = 2;               // 2: per-domain keys and the endpoint's domain
constexpr uint32_t kMaxDomains = 64;
constexpr size_t kMaxString = 1024;
constexpr size_t kMaxAddress = 4096;
constexpr uint32_t kMaxGrantedRegions = 1 << 20;
// Other transports' blobs, recognised only to say whose they are.
constexpr uint32_t kVerbsConnMagic = 0x45565357;    // "WSVE"
constexpr uint32_t kVerbsRegionMagic = 0x52565357;  // "WSVR"
constexpr uint32_t kTcpDescMagic = 0x57535444;      // "WSTD"

using Writer = ByteWriter;
using Reader = ByteReader;

// Why `blob` (whose first four bytes are not `want`) is not ours: whose it looks like.
absl::Status Foreign(const char* what, const std::string& blob) {
  std::string whose = "not a fabric transport blob";
  uint32_t magic = 0;
  if (blob.size() >= sizeof(magic)) std::memcpy(&magic, blob.data(), sizeof(magic));
  if (magic == kVerbsConnMagic || magic == kVerbsRegionMagic) {
    whose = "a blob of the verbs transport";
  } else if (magic == kTcpDescMagic || absl::StartsWith(blob, "wsync-tcp")) {
    whose = "a blob of the tcp transport";
  } else if (blob.empty()) {
    whose = "empty";
  }
  return absl::InvalidArgumentError(absl::StrCat("fabric ", what, " is ", whose, " (", blob.size(),
                                                 " bytes): the peer does not run the fabric transport"));
}

absl::Status Malformed(const char* what, const char* detail) {
  return absl::InvalidArgumentError(absl::StrCat("malformed fabric ", what, ": ", detail));
}

}  // namespace

std::string EncodeConnInfo(const ConnInfo& info) {
  Writer w;
  w.Put(kConnMagic);
  w.Put(kVersion);
  w.Put(static_cast<uint16_t>(info.granted ? 1 : 0));
  w.Put(info.transport_id);
  w.PutString(info.owner);
  w.PutString(info.provider);
  w.PutString(info.fabric);
  w.Put(info.addr_format);
  w.PutString(info.address);
  w.Put(info.domain_index);
  w.PutString(info.domain);
  if (info.granted) {
    w.Put(static_cast<uint32_t>(info.grant.size()));
    for (const GrantedRegion& g : info.grant) {
      w.Put(g.region_id);
      w.Put(g.key);
    }
  }
  return w.Take();
}

absl::StatusOr<ConnInfo> DecodeConnInfo(const std::string& blob) {
  Reader r(blob);
  uint32_t magic = 0;
  uint16_t version = 0, flags = 0;
  if (!r.Get(&magic) || magic != kConnMagic) return Foreign("connection info", blob);
  if (!r.Get(&version) || version != kVersion) return Malformed("connection info", "unsupported version");
  if (!r.Get(&flags) || flags > 1) return Malformed("connection info", "bad flags");
  ConnInfo info;
  info.granted = flags == 1;
  if (!r.Get(&info.transport_id) || !r.GetString(&info.owner, kMaxString) || !r.GetString(&info.provider, kMaxString) ||
      !r.GetString(&info.fabric, kMaxString) || !r.Get(&info.addr_format) || !r.GetString(&info.address, kMaxAddress) ||
      !r.Get(&info.domain_index) || !r.GetString(&info.domain, kMaxString)) {
    return Malformed("connection info", "truncated");
  }
  if (info.address.empty()) return Malformed("connection info", "no endpoint address");
  if (info.domain_index >= kMaxDomains) return Malformed("connection info", "bad domain index");
  if (info.granted) {
    uint32_t n = 0;
    if (!r.Get(&n) || n > kMaxGrantedRegions) return Malformed("connection info", "bad granted region count");
    for (uint32_t i = 0; i < n; ++i) {
      GrantedRegion g;
      if (!r.Get(&g.region_id) || !r.Get(&g.key)) return Malformed("connection info", "truncated grant");
      info.grant.push_back(g);
    }
  }
  if (!r.AtEnd()) return Malformed("connection info", "trailing bytes");
  return info;
}

std::string EncodeRegionDesc(const RegionDesc& d) {
  Writer w;
  w.Put(kRegionMagic);
  w.Put(kVersion);
  w.Put(static_cast<uint16_t>(0));
  w.Put(d.transport_id);
  w.PutString(d.owner);
  w.PutString(d.provider);
  w.Put(d.region_id);
  w.Put(d.length);
  w.Put(d.addr_base);
  w.Put(static_cast<uint32_t>(d.keys.size()));
  for (uint64_t k : d.keys) w.Put(k);
  return w.Take();
}

absl::StatusOr<RegionDesc> DecodeRegionDesc(const std::string& blob) {
  Reader r(blob);
  uint32_t magic = 0;
  uint16_t version = 0, flags = 0;
  if (!r.Get(&magic) || magic != kRegionMagic) return Foreign("region descriptor", blob);
  if (!r.Get(&version) || version != kVersion) return Malformed("region descriptor", "unsupported version");
  if (!r.Get(&flags) || flags != 0) return Malformed("region descriptor", "bad flags");
  RegionDesc d;
  if (!r.Get(&d.transport_id) || !r.GetString(&d.owner, kMaxString) || !r.GetString(&d.provider, kMaxString) ||
      !r.Get(&d.region_id) || !r.Get(&d.length) || !r.Get(&d.addr_base)) {
    return Malformed("region descriptor", "truncated");
  }
  uint32_t n = 0;
  if (!r.Get(&n) || n == 0 || n > kMaxDomains) return Malformed("region descriptor", "bad domain key count");
  d.keys.resize(n);
  for (uint64_t& k : d.keys)
    if (!r.Get(&k)) return Malformed("region descriptor", "truncated keys");
  if (!r.AtEnd()) return Malformed("region descriptor", "trailing bytes");
  if (d.addr_base > UINT64_MAX - d.length) return Malformed("region descriptor", "address range overflows");
  return d;
}

}  // namespace wsync::transport::fabric
