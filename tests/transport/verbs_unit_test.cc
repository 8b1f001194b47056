// Verbs backend pieces that need no RDMA device: blob encoding and what happens without hardware.
// Runs everywhere; on a machine with RDMA devices the "no device" cases check only what still applies.

#include <catch2/catch.hpp>
#include <cstdlib>
#include <string>

#include "absl/strings/match.h"
#include "transport/transport.h"
#include "transport/verbs/ibv_api.h"
#include "transport/verbs/verbs_transport.h"
#include "transport/verbs/verbs_wire.h"

namespace {

using wsync::transport::CreateTransport;
using wsync::transport::TransportOptions;
using wsync::transport::verbs::ConnInfo;
using wsync::transport::verbs::CreateVerbsTransport;
using wsync::transport::verbs::DecodeConnInfo;
using wsync::transport::verbs::DecodeRegionDesc;
using wsync::transport::verbs::EncodeConnInfo;
using wsync::transport::verbs::EncodeRegionDesc;
using wsync::transport::verbs::RegionDesc;
using wsync::transport::verbs::VerbsOptions;
using wsync::transport::verbs::WireQp;

}  // namespace

TEST_CASE("verbs blobs round-trip and reject garbage", "[verbs_unit]") {
  ConnInfo info;
  info.transport_id = 0x1234567890abcdefull;
  info.owner = "host/pid 1/t0001 [rxe0]";
  for (int i = 0; i < 3; ++i) {
    WireQp qp;
    qp.qpn = 100 + i;
    qp.psn = 0xabcdef;
    qp.gid[15] = static_cast<uint8_t>(i);
    qp.lid = 7;
    qp.port = 1;
    qp.mtu = 3;
    qp.device_index = static_cast<uint8_t>(i);
    info.qps.push_back(qp);
  }
  const std::string blob = EncodeConnInfo(info);
  auto back = DecodeConnInfo(blob);
  REQUIRE(back.ok());
  CHECK(back->transport_id == info.transport_id);
  CHECK(back->owner == info.owner);
  REQUIRE(back->qps.size() == 3);
  CHECK(back->qps[2].qpn == 102);
  CHECK(back->qps[2].gid[15] == 2);
  CHECK(back->qps[2].device_index == 2);
  for (size_t cut = 0; cut < blob.size(); ++cut) {
    INFO("truncated at " << cut);
    CHECK(DecodeConnInfo(blob.substr(0, cut)).status().code() == absl::StatusCode::kInvalidArgument);
  }
  CHECK_FALSE(DecodeConnInfo(blob + "x").ok());
  CHECK_FALSE(back->granted);

  // A granted endpoint's info carries the granted regions' rkeys (in its own protection domain).
  ConnInfo granted = info;
  granted.granted = true;
  wsync::transport::verbs::GrantedRegion g;
  g.base = 0x7f0000001000;
  g.length = 3 * 4096 + 5;
  g.chunk_size = 4096;
  g.num_devices = 1;
  g.num_chunks = 4;
  g.rkeys = {11, 12, 13, 14};
  granted.grant.push_back(g);
  const std::string gblob = EncodeConnInfo(granted);
  auto gback = DecodeConnInfo(gblob);
  REQUIRE(gback.ok());
  CHECK(gback->granted);
  REQUIRE(gback->grant.size() == 1);
  CHECK(gback->grant[0].base == g.base);
  CHECK(gback->grant[0].length == g.length);
  CHECK(gback->grant[0].rkeys == g.rkeys);
  for (size_t cut = blob.size(); cut < gblob.size(); ++cut) {
    INFO("granted blob truncated at " << cut);
    CHECK(DecodeConnInfo(gblob.substr(0, cut)).status().code() == absl::StatusCode::kInvalidArgument);
  }
  ConnInfo bad_chunks = granted;
  bad_chunks.grant[0].num_chunks = 3;  // does not cover the length
  bad_chunks.grant[0].rkeys.pop_back();
  CHECK(DecodeConnInfo(EncodeConnInfo(bad_chunks)).status().code() == absl::StatusCode::kInvalidArgument);

  RegionDesc d;
  d.transport_id = 9;
  d.owner = "peer";
  d.base = 0x7f0000001000;
  d.length = (3 << 20) + 5;
  d.chunk_size = 1 << 20;
  d.num_devices = 2;
  d.num_chunks = 4;
  for (uint32_t i = 0; i < 8; ++i) d.rkeys.push_back(1000 + i);
  const std::string desc = EncodeRegionDesc(d);
  auto dback = DecodeRegionDesc(desc);
  REQUIRE(dback.ok());
  CHECK(dback->base == d.base);
  CHECK(dback->length == d.length);
  CHECK(dback->chunk_size == d.chunk_size);
  CHECK(dback->rkeys == d.rkeys);
  for (size_t cut = 0; cut < desc.size(); ++cut) CHECK_FALSE(DecodeRegionDesc(desc.substr(0, cut)).ok());
  RegionDesc bad = d;
  bad.num_chunks = 3;  // does not cover the length
  bad.rkeys.resize(6);
  CHECK_FALSE(DecodeRegionDesc(EncodeRegionDesc(bad)).ok());
  RegionDesc huge = d;  // a chunk size near 2^64 (device max_mr_size) must not overflow the chunk count
  huge.chunk_size = UINT64_MAX;
  huge.num_chunks = 1;
  huge.rkeys.resize(2);
  CHECK(DecodeRegionDesc(EncodeRegionDesc(huge)).ok());
  CHECK_FALSE(DecodeRegionDesc(blob).ok());  // connection info is not a descriptor
  CHECK_FALSE(DecodeConnInfo(desc).ok());
}

TEST_CASE("verbs without a usable device is a result, not a crash", "[verbs_unit]") {
  auto t = CreateTransport("verbs", TransportOptions{});
  REQUIRE(t.ok());
  CHECK((*t)->name() == "verbs");
  if ((*t)->viable()) {
    WARN("an RDMA device exists here; only the missing-device case applies");
  } else {
    INFO((*t)->reason());
    CHECK_FALSE((*t)->reason().empty());
    WARN("verbs not viable here, as expected: " << (*t)->reason());
    int x = 0;
    CHECK((*t)->RegisterMemory(&x, sizeof(x)).status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK((*t)->ImportRegion("x").status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK((*t)->CreateEndpoint().status().code() == absl::StatusCode::kFailedPrecondition);
  }

  TransportOptions opts;
  opts.devices = {"nosuchdev7"};
  auto missing = CreateVerbsTransport(opts);
  REQUIRE(missing.ok());
  CHECK_FALSE((*missing)->viable());
  // Without any device the listing itself fails first; with devices, the reason names the missing one.
  CHECK(((absl::StrContains((*missing)->reason(), "nosuchdev7")) ||
         absl::StrContains((*missing)->reason(), "ibv_get_device_list") ||
         absl::StrContains((*missing)->reason(), "no RDMA devices")));
}

TEST_CASE("malformed verbs settings are configuration errors", "[verbs_unit]") {
  setenv("WSYNC_VERBS_QPS_PER_DEVICE", "many", 1);
  auto t = CreateVerbsTransport(TransportOptions{});
  unsetenv("WSYNC_VERBS_QPS_PER_DEVICE");
  CHECK(t.status().code() == absl::StatusCode::kInvalidArgument);

  VerbsOptions vo;
  vo.retry_cnt = 9;
  CHECK(CreateVerbsTransport(TransportOptions{}, vo).status().code() == absl::StatusCode::kInvalidArgument);
}

// GPUDirect RDMA into device memory needs three things; each one missing chooses the host mirror and says why
// (the choice RegisterSink logs and the target reports per cuda segment). A fake libibverbs table stands in for the
// library: only whether it has ibv_reg_dmabuf_mr matters.
namespace {
ibv_mr* FakeRegDmabufMr(ibv_pd*, uint64_t, size_t, uint64_t, int, int) { return nullptr; }
}  // namespace

TEST_CASE("verbs: GPUDirect is chosen only with ibv_reg_dmabuf_mr, a dma-buf and no opt-out", "[verbs_unit]") {
  using wsync::transport::verbs::ChooseGpuDirect;
  using wsync::transport::verbs::GpuDirectAllowed;
  using wsync::transport::verbs::IbvApi;
  IbvApi with, without;
  with.reg_dmabuf_mr = &FakeRegDmabufMr;
  const absl::Status exported = absl::OkStatus();
  const absl::Status no_dmabuf = absl::FailedPreconditionError("cuda:0 reports no dma-buf support");

  auto c = ChooseGpuDirect(with, exported, nullptr);
  CHECK(c.gpu_direct);
  CHECK(c.reason.empty());
  CHECK(ChooseGpuDirect(with, exported, "1").gpu_direct);

  c = ChooseGpuDirect(without, exported, nullptr);
  CHECK_FALSE(c.gpu_direct);
  CHECK(absl::StrContains(c.reason, "has no ibv_reg_dmabuf_mr"));

  c = ChooseGpuDirect(with, no_dmabuf, nullptr);
  CHECK_FALSE(c.gpu_direct);
  CHECK(absl::StrContains(c.reason, "no dma-buf for the memory: cuda:0 reports no dma-buf support"));

  c = ChooseGpuDirect(with, exported, "0");
  CHECK_FALSE(c.gpu_direct);
  CHECK(absl::StrContains(c.reason, "WSYNC_VERBS_GPUDIRECT=0"));
  CHECK_FALSE(GpuDirectAllowed("0"));
  CHECK(GpuDirectAllowed(nullptr));
  CHECK(GpuDirectAllowed(""));

  // The opt-out wins over everything, then the library, then the driver: the first missing piece is the reason.
  CHECK(absl::StrContains(ChooseGpuDirect(without, no_dmabuf, "0").reason, "WSYNC_VERBS_GPUDIRECT=0"));
  CHECK(absl::StrContains(ChooseGpuDirect(without, no_dmabuf, nullptr).reason, "ibv_reg_dmabuf_mr"));
}

TEST_CASE("verbs: device memory cannot be registered on a transport without devices", "[verbs_unit]") {
  // No RDMA device here (or one present: then the case checks nothing of the no-device path). The sink is never
  // touched: the transport refuses first.
  auto t = CreateVerbsTransport(TransportOptions{}, VerbsOptions{});
  REQUIRE(t.ok());
  if ((*t)->viable()) return;
  auto r = (*t)->RegisterSink(nullptr);
  CHECK(r.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(absl::StrContains(r.status().message(), "not viable"));
}
