#include "transport/tcp/tcp_server.h"

#include <sys/socket.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"
#include "transport/tcp/tcp_frame_reader.h"
#include "transport/tcp/tcp_socket.h"
#include "transport/tcp/tcp_wire.h"

namespace wsync::transport::tcp {
namespace {

std::string ClipMessage(std::string m) {
  if (m.size() > kMaxAckMessage) m.resize(kMaxAckMessage);
  return m;
}

absl::Status SendAck(int fd, uint16_t type, uint64_t batch, uint64_t bytes, const absl::Status& status) {
  std::string msg = ClipMessage(std::string(status.message()));
  Ack ack{kFrameMagic, type, static_cast<uint16_t>(status.code()), batch, bytes,
          static_cast<uint32_t>(msg.size()), 0};
  iovec iov[2] = {{&ack, sizeof(ack)}, {msg.data(), msg.size()}};
  return SendAll(fd, iov, msg.empty() ? 1 : 2);
}

}  // namespace

absl::StatusOr<std::shared_ptr<RegionTable::Grant>> AdmitHello(const Hello& hello, RegionTable& table) {
  if (hello.magic != kFrameMagic || hello.type != kHello || hello.version != kProtocolVersion) {
    table.CountRefused();
    return absl::InvalidArgumentError(
        absl::StrFormat("bad hello (magic %#x type %d version %d)", hello.magic, hello.type, hello.version));
  }
  if (hello.token != table.token()) {
    table.CountRefused();
    return absl::FailedPreconditionError(
        absl::StrFormat("peer info is for transport %016x, this listener belongs to %016x (stale or foreign peer info)",
                        hello.token, table.token()));
  }
  if (hello.secret[0] == 0 && hello.secret[1] == 0) return nullptr;
  std::shared_ptr<RegionTable::Grant> grant = table.FindGrant({hello.secret[0], hello.secret[1]});
  if (grant == nullptr) {
    table.CountRefused();
    return absl::PermissionDeniedError(
        "write secret unknown or expired (revoked at a new plan, or its connection was replaced): ask the target "
        "daemon again (ConnectTarget)");
  }
  return grant;
}

void RejectHello(int fd, const absl::Status& why) {
  const std::string msg = ClipMessage(std::string(why.message()));
  Ack ack{kFrameMagic, kHelloAck, static_cast<uint16_t>(why.code()), 0, 0, static_cast<uint32_t>(msg.size()), 0};
  std::string bytes(reinterpret_cast<const char*>(&ack), sizeof(ack));
  bytes += msg;
  // Best effort: a short count or EAGAIN only loses the reason; the connection is closed either way.
  (void)::send(fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

absl::Status ServeConnection(int fd, RegionTable& table, const std::string& peer,
                             std::shared_ptr<RegionTable::Grant> grant) {
  FrameReader reader(fd);
  // Without a secret the connection is accepted (a peer's endpoint connects back to complete the symmetric
  // handshake) but, when grants are required, every write frame on it is refused.
  const bool ungranted_refused = grant == nullptr && table.require_grants();
  // Counted before the ack, so a peer whose Connect returned is already seen connected (Endpoint::Reusable).
  struct Counted {
    std::shared_ptr<RegionTable::Grant> g;
    ~Counted() {
      if (g) g->connections.fetch_sub(1);
    }
  } counted{grant};
  if (grant) grant->connections.fetch_add(1);
  WSYNC_RETURN_IF_ERROR(SendAck(fd, kHelloAck, 0, 0, absl::OkStatus()));

  absl::Status batch_status;
  uint64_t frames = 0;
  uint64_t bytes = 0;
  std::vector<std::shared_ptr<RegionSink>> sinks;  // sink regions this batch wrote into
  bool large_payloads = false;  // the last write frame was large: expect another one
  for (;;) {
    FrameHeader f;
    WSYNC_RETURN_IF_ERROR(
        reader.Read(&f, sizeof(f), true, large_payloads ? sizeof(FrameHeader) : kRecvBufferBytes));
    if (f.magic != kFrameMagic) {
      absl::Status s = absl::InvalidArgumentError(absl::StrFormat("bad frame magic %#x", f.magic));
      SendAck(fd, kBatchAck, f.batch, bytes, s).IgnoreError();
      return s;
    }
    if (f.type == kWrite) {
      if (f.length > kMaxFramePayload) {
        absl::Status s = absl::InvalidArgumentError(
            absl::StrCat("write frame of ", f.length, " bytes exceeds the limit of ", kMaxFramePayload));
        SendAck(fd, kBatchAck, f.batch, bytes, s).IgnoreError();
        return s;
      }
      std::shared_ptr<RegionTable::Entry> region;
      if (batch_status.ok() && ungranted_refused) {
        table.CountRefused();
        batch_status = absl::PermissionDeniedError(
            "write refused: this receiver accepts writes only on connections authorized by a write secret (minted "
            "by the target daemon's ConnectTarget for a source the coordinator assigned); the batch fails");
      }
      if (batch_status.ok() && grant != nullptr && !grant->live) {
        table.CountRefused();
        batch_status = absl::PermissionDeniedError(absl::StrCat(
            "write refused: the write grant of this connection (", grant->info.peer, ", ", grant->info.scope,
            ") was revoked; the batch fails"));
      }
      if (batch_status.ok() && grant != nullptr && grant->regions.count(f.region) == 0) {
        table.CountRefused();
        batch_status = absl::PermissionDeniedError(absl::StrCat(
            "write refused: region ", f.region, " is not covered by this connection's write grant (", grant->info.peer,
            ", ", grant->info.scope, "); the batch fails"));
      }
      if (batch_status.ok() && !table.window_open()) {
        table.CountRefused();
        batch_status = absl::PermissionDeniedError(
            "write refused: the receiver's write window is closed (writes are accepted only while the coordinator "
            "has an update open); nothing of this batch was written");
      }
      if (batch_status.ok()) {
        region = table.AcquireForWrite(f.region);
        if (region == nullptr) {
          batch_status = absl::NotFoundError(
              absl::StrCat("region ", f.region, " is not registered on the receiver (deregistered?)"));
        } else if (region->read_only) {
          table.CountRefused();
          batch_status = absl::PermissionDeniedError(
              absl::StrCat("write refused: region ", f.region, " is a source's memory (read-only for peers); ",
                           "write from ", peer, " refused, nothing of this batch is written there; the batch fails"));
          table.Release(region);
          region = nullptr;
        } else if (f.offset > region->length || f.length > region->length - f.offset) {
          batch_status = absl::OutOfRangeError(absl::StrCat("write [", f.offset, ", +", f.length,
                                                            ") is outside region ", f.region, " of ",
                                                            region->length, " bytes"));
          table.Release(region);
          region = nullptr;
        }
      }
      if (region == nullptr) {
        WSYNC_RETURN_IF_ERROR(reader.Discard(f.length));
        continue;
      }
      large_payloads = f.length >= kDirectRecvBytes;
      absl::Status s;
      if (region->sink != nullptr) {
        absl::Status sink_error;
        s = ReceiveIntoSink(reader, *region->sink, f.offset, f.length, &sink_error);
        if (!sink_error.ok() && batch_status.ok()) batch_status = sink_error;
        if (std::find(sinks.begin(), sinks.end(), region->sink) == sinks.end()) sinks.push_back(region->sink);
      } else {
        s = reader.Read(region->addr + f.offset, f.length, false);
      }
      table.Release(region);
      WSYNC_RETURN_IF_ERROR(s);
      ++frames;
      bytes += f.length;
    } else if (f.type == kCommit) {
      // The batch is complete only when the staged copies into device memory have finished.
      for (const auto& sink : sinks) {
        absl::Status fs = sink->Flush();
        if (batch_status.ok() && !fs.ok()) batch_status = fs;
      }
      sinks.clear();
      if (batch_status.ok() && (f.region != frames || f.length != bytes)) {
        batch_status = absl::DataLossError(absl::StrCat("batch ", f.batch, ": received ", frames, " frames / ",
                                                        bytes, " bytes, sender sent ", f.region, " / ",
                                                        f.length));
      }
      WSYNC_RETURN_IF_ERROR(SendAck(fd, kBatchAck, f.batch, bytes, batch_status));
      if (!batch_status.ok()) return batch_status;
      frames = 0;
      bytes = 0;
    } else {
      absl::Status s = absl::InvalidArgumentError(absl::StrCat("unknown frame type ", f.type));
      SendAck(fd, kBatchAck, f.batch, bytes, s).IgnoreError();
      return s;
    }
  }
}

}  // namespace wsync::transport::tcp
