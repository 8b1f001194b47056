#include "client/trainer_client.h"

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/checked_size.h"
#include "base/host_copy.h"
#include "base/status.h"
#include "proto/status_convert.h"
#include "proto/tls.h"

namespace wsync::client {
namespace {

std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d);
}

absl::StatusOr<ScopedFd> ConnectTrainerSocket(const std::string& path, absl::Time deadline,
                                               absl::Duration timeout) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path))
    return absl::InvalidArgumentError(absl::StrCat("trainer socket path '", path, "' is empty or longer than ",
                                                   sizeof(addr.sun_path) - 1, " bytes"));
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size());
  // The daemon may be restarting: retry while nobody listens on the socket, until the deadline.
  while (true) {
    ScopedFd fd(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return absl::ErrnoToStatus(errno, "socket(AF_UNIX)");
    if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
    const int err = errno;
    if (err == EACCES || err == EPERM)
      return absl::PermissionDeniedError(absl::StrCat(
          "connecting to trainer socket ", path, ": ", std::strerror(err),
          " (its mode lets only the daemon's uid and group in; see wsyncd --trainer-uid / --trainer-gid)"));
    // Nothing to wait for when the path is missing: the daemon creates its socket before it serves, so a missing
    // path is a wrong path (or a daemon that is not running), not one that is still starting.
    if (err == ENOENT)
      return absl::NotFoundError(absl::StrCat("trainer socket ", path,
                                              " does not exist: no source wsyncd serves it (check the path against "
                                              "the daemon's --trainer-socket, and that the daemon runs)"));
    const bool retry = err == ECONNREFUSED || err == EAGAIN || err == EINTR;
    const absl::Duration left = deadline - absl::Now();
    if (!retry || left <= absl::ZeroDuration()) {
      const std::string why = absl::StrCat("no source wsyncd answers on trainer socket ", path, " (",
                                           std::strerror(err), ")");
      if (!retry) return absl::UnavailableError(why);
      return absl::DeadlineExceededError(absl::StrCat(why, " within the connect timeout of ",
                                                      absl::FormatDuration(timeout)));
    }
    absl::SleepFor(std::min(left, absl::Milliseconds(50)));
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<TrainerClient>> TrainerClient::Connect(const TrainerOptions& opts) {
  const std::string& path = opts.daemon;
  if (path.find('/') == std::string::npos)
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' is not a Unix socket path: trainer ranks reach their node's source wsyncd through its local "
        "trainer socket (wsyncd --trainer-socket, default /run/wsync/wsyncd.sock), not over TCP"));
  const absl::Time deadline = absl::Now() + opts.connect_timeout;
  std::unique_ptr<TrainerClient> c(new TrainerClient());
  c->opts_ = opts;
  WSYNC_ASSIGN_OR_RETURN(c->handover_, ConnectTrainerSocket(path, deadline, opts.connect_timeout));
  const int fd = c->handover_.get();
  auto set_timeout = [fd, &deadline, &path]() -> absl::Status {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration())
      return absl::DeadlineExceededError(absl::StrCat("trainer socket ", path, ": no answer within the connect timeout"));
    timeval tv = absl::ToTimeval(std::max(left, absl::Milliseconds(1)));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    return absl::OkStatus();
  };
  v1::TrainerHello hello;
  hello.set_type("open");
  hello.set_protocol(1);
  hello.set_local_rank(opts.local_rank);
  hello.set_global_rank(opts.global_rank);
  std::string text;
  google::protobuf::util::JsonPrintOptions po;
  po.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(hello, &text, po);
  WSYNC_RETURN_IF_ERROR(set_timeout());
  // A refused peer's hello may meet a closed socket (EPIPE): the daemon's answer with the reason is read below anyway.
  const absl::Status sent = SendFds(fd, {}, text);
  WSYNC_RETURN_IF_ERROR(set_timeout());
  auto frame = ReceiveFds(fd, 64 * 1024);
  if (!frame.ok()) {
    if (absl::IsDeadlineExceeded(frame.status()))
      return absl::DeadlineExceededError(absl::StrCat("trainer socket ", path, ": the daemon did not answer within "
                                                      "the connect timeout of ", absl::FormatDuration(opts.connect_timeout)));
    return Annotate(sent.ok() ? frame.status() : sent, absl::StrCat("trainer socket ", path, ": opening a session"));
  }
  v1::TrainerOpened opened;
  google::protobuf::util::JsonParseOptions jo;
  jo.ignore_unknown_fields = true;
  if (!google::protobuf::util::JsonStringToMessage(frame->message, &opened, jo).ok())
    return absl::DataLossError(absl::StrCat("trainer socket ", path, ": malformed answer: ", frame->message));
  if (!opened.ok()) {
    const bool denied = opened.error().rfind("permission denied", 0) == 0;
    const std::string msg = absl::StrCat("wsyncd at ", path, " refused the session: ", opened.error());
    return denied ? absl::PermissionDeniedError(msg) : absl::FailedPreconditionError(msg);
  }
  if (frame->fds.size() != 1)
    return absl::DataLossError(absl::StrCat("trainer socket ", path, ": the answer carried ", frame->fds.size(),
                                            " descriptors, not the ring's one"));
  c->session_id_ = opened.session_id();
  c->session_label_ = opened.session();
  WSYNC_ASSIGN_OR_RETURN(RingProducer ring, RingProducer::Attach(frame->fds.front().get()));
  c->ring_ = std::make_unique<RingProducer>(std::move(ring));
  // The session's RPCs: a local gRPC socket the daemon named; connected now, within the same timeout.
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(opened.rpc(), grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(Deadline(std::max(deadline - absl::Now(), absl::ZeroDuration()))))
    return absl::DeadlineExceededError(absl::StrCat("wsyncd at ", path, ": its trainer RPC socket ", opened.rpc(),
                                                    " did not connect within the connect timeout of ",
                                                    absl::FormatDuration(opts.connect_timeout)));
  c->stub_ = v1::TrainerIngest::NewStub(channel);
  c->bucket_limit_ = opts.bucket_bytes > 0 ? std::min(opts.bucket_bytes, c->ring_->capacity() / 2)
                                           : c->ring_->capacity() / 2;
  c->copy_pool_ = std::make_unique<CopyPool>(HostCopyThreads(opts.host_copy_threads, opened.num_local_ranks()));
  return c;
}

TrainerClient::~TrainerClient() {
  if (in_flight_.valid()) in_flight_.wait();
  device_.reset();  // waits for its copies, then unregisters the ring (and the replica mapping)
  replica_registered_ = false;
  UnmapReplica();
  if (!stub_ || session_id_.empty()) return;
  ring_.reset();
  v1::CloseSessionRequest req;
  req.set_session_id(session_id_);
  v1::CloseSessionReply rep;
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(absl::Seconds(5)));
  stub_->CloseSession(&ctx, req, &rep);  // best effort: the daemon also drops sessions whose rank reconnects
}

absl::StatusOr<std::vector<std::string>> TrainerClient::BeginPush(int64_t version) {
  v1::BeginPushRequest req;
  req.set_session_id(session_id_);
  req.set_version(version);
  v1::BeginPushReply rep;
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(opts_.timeout));  // the daemon answers "no update is open" just before it
  WSYNC_RETURN_IF_ERROR_CTX(FromGrpcStatus(stub_->BeginPush(&ctx, req, &rep)), "begin push of update ", version);
  stats_ = PushStats();
  push_slices_.clear();
  for (const auto& sp : rep.slices()) {
    TensorSlice ts;
    ts.name = sp.name();
    ts.full_shape.assign(sp.shape().begin(), sp.shape().end());
    ts.offsets.assign(sp.offsets().begin(), sp.offsets().end());
    ts.extents.assign(sp.extents().begin(), sp.extents().end());
    WSYNC_RETURN_IF_ERROR_CTX(ValidateSlice(&ts), "push filter of update ", version);
    push_slices_.push_back(std::move(ts));
  }
  fp8_hint_ = rep.fp8();
  expected_ = rep.expected();
  fp8_names_.clear();
  fp8_names_.insert(fp8_hint_.tensor_names().begin(), fp8_hint_.tensor_names().end());
  version_ = version;
  placements_.clear();
  placed_pending_.clear();
  placed_pending_bytes_ = 0;
  placement_generation_ = rep.replica_generation();
  if (opts_.placement)
    for (const auto& p : rep.placements()) placements_[p.name()] = p;
  return std::vector<std::string>(rep.tensor_names().begin(), rep.tensor_names().end());
}

absl::Status TrainerClient::WaitInFlight() {
  if (!in_flight_.valid()) return absl::OkStatus();
  return in_flight_.get();
}

absl::Status TrainerClient::CommitAsync() {
  if (ring_->bucket_tensors() == 0) return absl::OkStatus();
  // One bucket in flight at a time: the ring then always has room for the next one.
  WSYNC_RETURN_IF_ERROR(WaitInFlight());
  // Device-to-host copies into this bucket's slots must have landed before the daemon may read them.
  if (device_ != nullptr) WSYNC_RETURN_IF_ERROR(device_->Drain());
  WSYNC_ASSIGN_OR_RETURN(uint64_t seq, ring_->CommitBucket());
  ++stats_.buckets;
  in_flight_ = std::async(std::launch::async, [this, seq]() -> absl::Status {
    v1::CommitBucketRequest req;
    req.set_session_id(session_id_);
    req.set_bucket_seq(seq);
    v1::CommitBucketReply rep;
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(opts_.timeout));
    return FromGrpcStatus(stub_->CommitBucket(&ctx, req, &rep));
  });
  return absl::OkStatus();
}

absl::Status TrainerClient::PushWith(absl::string_view name, DType dtype, absl::Span<const int64_t> shape,
                                     uint64_t bytes, const std::function<void(uint8_t*)>& fill) {
  return PushImpl(name, dtype, shape, bytes, [&](uint8_t* dst) {
    fill(dst);
    return absl::OkStatus();
  });
}

absl::Status TrainerClient::PushDevice(absl::string_view name, DType dtype, absl::Span<const int64_t> shape,
                                       const void* data, uint64_t bytes, int device, uint64_t stream) {
  if (device_ == nullptr) {
    WSYNC_ASSIGN_OR_RETURN(device_, DeviceCopier::Create(ring_->data_area(), ring_->capacity(), ring_->name()));
  }
  WSYNC_RETURN_IF_ERROR(device_->Check(name, data, bytes, device));
  if (const v1::TensorPlacement* p = PlacementFor(name, dtype, shape, bytes); p != nullptr) {
    WSYNC_RETURN_IF_ERROR(PlaceDevice(*p, data, bytes, device, stream, false));
    return NotePlaced(name, bytes);
  }
  if (opts_.gpu_fp8 && shape.size() == 2 && (dtype == DType::kBF16 || dtype == DType::kF16 || dtype == DType::kF32) &&
      fp8_names_.contains(name))
    return PushDeviceFp8(name, dtype, shape, data, bytes, device, stream);
  return PushImpl(name, dtype, shape, bytes, [&](uint8_t* dst) {
    return device_->CopyAsync(name, dst, data, bytes, device, stream);
  });
}

absl::Status TrainerClient::PushDeviceFp8(absl::string_view name, DType dtype, absl::Span<const int64_t> shape,
                                          const void* data, uint64_t bytes, int device, uint64_t stream) {
  WSYNC_ASSIGN_OR_RETURN(const uint64_t want, ShapeBytes(shape, dtype, absl::StrCat("tensor ", name)));
  if (want != bytes)
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": ", bytes, " bytes do not match its shape of ",
                                                   want, " bytes of ", DTypeName(dtype)));
  // Quantized into the copier's device scratch on its stream, then both halves copied into their ring slots on the
  // same stream (so the scratch is not reused before they are read).
  DeviceCopier::Fp8Staged staged;
  WSYNC_RETURN_IF_ERROR(device_->QuantizeFp8Async(name, dtype, data, shape[0], shape[1], fp8_hint_.block_n(),
                                                  fp8_hint_.block_k(), fp8_hint_.ue8m0(), device, stream, &staged));
  const int64_t scale_shape[2] = {(shape[0] + fp8_hint_.block_n() - 1) / fp8_hint_.block_n(),
                                  (shape[1] + fp8_hint_.block_k() - 1) / fp8_hint_.block_k()};
  const std::string scale_name = absl::StrCat(name, "_scale_inv");
  const v1::TensorPlacement* codes_at = PlacementFor(name, DType::kF8E4M3, shape, staged.code_bytes);
  const v1::TensorPlacement* scales_at = PlacementFor(scale_name, DType::kF32, scale_shape, staged.scale_bytes);
  if (codes_at != nullptr && scales_at != nullptr) {
    // Both halves straight from the scratch into their replica slots, on the copier's stream after the quantizer.
    WSYNC_RETURN_IF_ERROR(PlaceDevice(*codes_at, staged.codes, staged.code_bytes, device, 0, true));
    WSYNC_RETURN_IF_ERROR(PlaceDevice(*scales_at, staged.scales, staged.scale_bytes, device, 0, true));
    WSYNC_RETURN_IF_ERROR(NotePlaced(name, staged.code_bytes));
    WSYNC_RETURN_IF_ERROR(NotePlaced(scale_name, staged.scale_bytes));
    --stats_.tensors;
    ++stats_.fp8_quantized;
    return absl::OkStatus();
  }
  WSYNC_RETURN_IF_ERROR(PushImpl(name, DType::kF8E4M3, shape, staged.code_bytes, [&](uint8_t* dst) {
    return device_->CopyStagedAsync(name, dst, staged.codes, staged.code_bytes, device);
  }));
  WSYNC_RETURN_IF_ERROR(PushImpl(scale_name, DType::kF32, scale_shape, staged.scale_bytes, [&](uint8_t* dst) {
    return device_->CopyStagedAsync(scale_name, dst, staged.scales, staged.scale_bytes, device);
  }));
  --stats_.tensors;  // the weight counts once
  ++stats_.fp8_quantized;
  return absl::OkStatus();
}

absl::Status TrainerClient::PushImpl(absl::string_view name, DType dtype, absl::Span<const int64_t> shape,
                                     uint64_t bytes, const std::function<absl::Status(uint8_t*)>& fill) {
  if (bytes > ring_->MaxTensorBytes(name.size()))
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, " has ", bytes, " bytes, more than this ",
                                                   ring_->capacity() >> 20,
                                                   " MiB ring can hold: start wsyncd with a larger --ring-mib"));
  // A tensor larger than a bucket travels alone, after the ring has drained.
  const bool alone = bytes > bucket_limit_;
  if (alone) {
    WSYNC_RETURN_IF_ERROR(Flush());
  } else if (!ring_->FitsInBucket(name.size(), bytes) || ring_->bucket_payload_bytes() + bytes > bucket_limit_) {
    WSYNC_RETURN_IF_ERROR(CommitAsync());
  }
  WSYNC_ASSIGN_OR_RETURN(uint8_t * dst, ring_->BeginTensor(name, dtype, shape, bytes, opts_.timeout));
  if (absl::Status s = fill(dst); !s.ok()) {
    // The slot's bytes are unknown: the open bucket cannot be published. Drop it and say so.
    const uint32_t dropped = ring_->bucket_tensors();
    ring_->AbortBucket();
    return Annotate(s, absl::StrCat("the open bucket (", dropped, " tensors before this one) was dropped; abort this "
                                    "update"));
  }
  WSYNC_RETURN_IF_ERROR(ring_->FinishTensor());
  ++stats_.tensors;
  stats_.bytes += bytes;
  if (alone) WSYNC_RETURN_IF_ERROR(CommitAsync());
  return absl::OkStatus();
}

absl::Status TrainerClient::Push(absl::string_view name, DType dtype, absl::Span<const int64_t> shape,
                                 const void* data, uint64_t bytes) {
  if (const v1::TensorPlacement* p = PlacementFor(name, dtype, shape, bytes); p != nullptr) {
    WSYNC_RETURN_IF_ERROR(PlaceHost(*p, data, bytes));
    return NotePlaced(name, bytes);
  }
  return PushWith(name, dtype, shape, bytes, [&](uint8_t* dst) {
    CopyRect(dst, bytes, static_cast<const uint8_t*>(data), bytes, bytes, 1, copy_pool_.get());
  });
}

absl::StatusOr<std::string> SliceFrameName(absl::string_view name, DType dtype, absl::Span<const int64_t> full_shape,
                                           absl::Span<const int64_t> offsets, absl::Span<const int64_t> extents,
                                           uint64_t bytes) {
  TensorSlice ts;
  ts.name = std::string(name);
  ts.full_shape.assign(full_shape.begin(), full_shape.end());
  ts.offsets.assign(offsets.begin(), offsets.end());
  ts.extents.assign(extents.begin(), extents.end());
  WSYNC_RETURN_IF_ERROR(ValidateSlice(&ts));
  WSYNC_ASSIGN_OR_RETURN(const uint64_t want, ShapeBytes(extents, dtype, absl::StrCat("slice of ", name)));
  if (want != bytes)
    return absl::InvalidArgumentError(absl::StrCat("slice of ", name, ": ", bytes, " bytes do not match extents of ",
                                                   want, " bytes of ", DTypeName(dtype)));
  return EncodeSliceName(name, full_shape, offsets);
}

absl::Status TrainerClient::PushSlice(absl::string_view name, DType dtype, absl::Span<const int64_t> full_shape,
                                      absl::Span<const int64_t> offsets, absl::Span<const int64_t> extents,
                                      const void* data, uint64_t bytes) {
  WSYNC_ASSIGN_OR_RETURN(std::string frame, SliceFrameName(name, dtype, full_shape, offsets, extents, bytes));
  return Push(frame, dtype, extents, data, bytes);
}

absl::Status TrainerClient::PushSliceDevice(absl::string_view name, DType dtype, absl::Span<const int64_t> full_shape,
                                            absl::Span<const int64_t> offsets, absl::Span<const int64_t> extents,
                                            const void* data, uint64_t bytes, int device, uint64_t stream) {
  WSYNC_ASSIGN_OR_RETURN(std::string frame, SliceFrameName(name, dtype, full_shape, offsets, extents, bytes));
  return PushDevice(frame, dtype, extents, data, bytes, device, stream);
}

absl::Status TrainerClient::Flush() {
  WSYNC_RETURN_IF_ERROR(CommitAsync());
  WSYNC_RETURN_IF_ERROR(WaitInFlight());
  return CommitPlacedNow();
}

const v1::TensorPlacement* TrainerClient::PlacementFor(absl::string_view name, DType dtype,
                                                       absl::Span<const int64_t> shape, uint64_t bytes) const {
  if (!opts_.placement) return nullptr;
  auto it = placements_.find(name);
  if (it == placements_.end()) return nullptr;
  const v1::TensorPlacement& p = it->second;
  if (p.dtype() != DTypeName(dtype) || !std::equal(shape.begin(), shape.end(), p.shape().begin(), p.shape().end()))
    return nullptr;
  absl::StatusOr<uint64_t> want = ShapeBytes(shape, dtype, "tensor");
  if (!want.ok() || *want != bytes) return nullptr;
  return &p;
}

void TrainerClient::UnmapReplica() {
  if (replica_registered_ && device_ != nullptr) {
    (void)device_->Drain();
    for (const MappedLayout& m : replica_) device_->UnregisterDestination(m.addr);
  }
  replica_registered_ = false;
  for (const MappedLayout& m : replica_) munmap(m.addr, m.bytes);
  replica_.clear();
  mapped_generation_ = 0;
}

absl::Status TrainerClient::MapReplica() {
  if (!replica_.empty() && mapped_generation_ == placement_generation_) return absl::OkStatus();
  UnmapReplica();
  const absl::Time deadline = absl::Now() + opts_.connect_timeout;
  WSYNC_ASSIGN_OR_RETURN(ScopedFd sock, ConnectTrainerSocket(opts_.daemon, deadline, opts_.connect_timeout));
  timeval tv = absl::ToTimeval(opts_.connect_timeout);
  setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(sock.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  v1::TrainerHello hello;
  hello.set_type("replica");
  hello.set_protocol(1);
  hello.set_local_rank(opts_.local_rank);
  hello.set_session_id(session_id_);
  std::string text;
  google::protobuf::util::JsonPrintOptions po;
  po.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(hello, &text, po);
  WSYNC_RETURN_IF_ERROR_CTX(SendFds(sock.get(), {}, text), "asking for the replica's buffers");
  WSYNC_ASSIGN_OR_RETURN(ReceivedFds frame, ReceiveFds(sock.get(), 64 * 1024));
  v1::TrainerOpened answer;
  google::protobuf::util::JsonParseOptions jo;
  jo.ignore_unknown_fields = true;
  if (!google::protobuf::util::JsonStringToMessage(frame.message, &answer, jo).ok())
    return absl::DataLossError(absl::StrCat("trainer socket: malformed replica answer: ", frame.message));
  if (!answer.ok())
    return absl::FailedPreconditionError(absl::StrCat("wsyncd refused the replica's buffers: ", answer.error()));
  if (answer.replica_generation() != placement_generation_ ||
      frame.fds.size() != static_cast<size_t>(answer.replica_bytes_size()))
    return absl::FailedPreconditionError(
        absl::StrCat("the replica changed since BeginPush (generation ", answer.replica_generation(), ", offered ",
                     placement_generation_, ") or the answer is malformed (", frame.fds.size(), " descriptors)"));
  for (size_t i = 0; i < frame.fds.size(); ++i) {
    const uint64_t n = answer.replica_bytes(static_cast<int>(i));
    void* a = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, frame.fds[i].get(), 0);
    if (a == MAP_FAILED) {
      const int err = errno;
      UnmapReplica();
      return absl::ErrnoToStatus(err, absl::StrCat("mapping replica layout ", i, " (", n, " bytes)"));
    }
    replica_.push_back({static_cast<uint8_t*>(a), n});
  }
  mapped_generation_ = placement_generation_;
  return absl::OkStatus();
}

namespace {

// Whether every region of `p` lies inside the mapped layouts and the tensor of `bytes` bytes: the daemon's offsets
// are trusted only as far as this process's own memory goes.
absl::Status CheckRegions(const v1::TensorPlacement& p, uint64_t bytes, const std::vector<uint64_t>& layout_bytes) {
  for (const auto& r : p.regions()) {
    if (r.rows() <= 0 || r.row_bytes() == 0) continue;
    const uint64_t last = static_cast<uint64_t>(r.rows() - 1);
    const bool ok = r.layout() >= 0 && static_cast<size_t>(r.layout()) < layout_bytes.size() &&
                    (r.rows() == 1 || (r.row_bytes() <= r.pitch() && r.row_bytes() <= r.src_pitch())) &&
                    r.offset() + last * r.pitch() + r.row_bytes() <= layout_bytes[r.layout()] &&
                    r.src_offset() + last * r.src_pitch() + r.row_bytes() <= bytes;
    if (!ok)
      return absl::InternalError(absl::StrCat("tensor ", p.name(),
                                              ": the daemon offered a region outside the "
                                              "replica or the tensor (layout ",
                                              r.layout(), ", offset ", r.offset(), ", ", r.rows(), " x ", r.row_bytes(),
                                              " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status TrainerClient::PlaceHost(const v1::TensorPlacement& p, const void* data, uint64_t bytes) {
  WSYNC_RETURN_IF_ERROR(MapReplica());
  std::vector<uint64_t> sizes;
  for (const MappedLayout& m : replica_) sizes.push_back(m.bytes);
  WSYNC_RETURN_IF_ERROR(CheckRegions(p, bytes, sizes));
  // Every region of the tensor at once: column shards (TP > 1) are written from one pass over the tensor's rows.
  std::vector<PlacedCopy> copies;
  copies.reserve(p.regions_size());
  for (const auto& r : p.regions())
    copies.push_back(
        {replica_[r.layout()].addr + r.offset(), r.pitch(), r.src_offset(), r.src_pitch(), r.row_bytes(), r.rows()});
  CopyPlaced(copies, static_cast<const uint8_t*>(data), copy_pool_.get());
  return absl::OkStatus();
}

absl::Status TrainerClient::PlaceDevice(const v1::TensorPlacement& p, const void* data, uint64_t bytes, int device,
                                        uint64_t stream, bool staged) {
  WSYNC_RETURN_IF_ERROR(MapReplica());
  std::vector<uint64_t> sizes;
  for (const MappedLayout& m : replica_) sizes.push_back(m.bytes);
  WSYNC_RETURN_IF_ERROR(CheckRegions(p, bytes, sizes));
  if (!replica_registered_) {
    for (size_t i = 0; i < replica_.size(); ++i)
      WSYNC_RETURN_IF_ERROR(
          device_->RegisterDestination(replica_[i].addr, replica_[i].bytes, absl::StrCat("replica layout ", i)));
    replica_registered_ = true;
  }
  const auto* src = static_cast<const uint8_t*>(data);
  for (const auto& r : p.regions()) {
    WSYNC_RETURN_IF_ERROR(device_->Copy2DAsync(p.name(), replica_[r.layout()].addr + r.offset(), r.pitch(),
                                               src + r.src_offset(), r.src_pitch(), r.row_bytes(), r.rows(), device,
                                               stream, staged));
  }
  return absl::OkStatus();
}

absl::Status TrainerClient::NotePlaced(absl::string_view name, uint64_t bytes) {
  placed_pending_.emplace_back(name);
  placed_pending_bytes_ += bytes;
  ++stats_.tensors;
  ++stats_.placed;
  stats_.bytes += bytes;
  stats_.placed_bytes += bytes;
  // Committed in bucket-sized batches, so the daemon posts writes while this rank keeps copying.
  if (placed_pending_bytes_ >= bucket_limit_) return CommitPlacedNow();
  return absl::OkStatus();
}

absl::Status TrainerClient::CommitPlacedNow() {
  if (placed_pending_.empty()) return absl::OkStatus();
  // CUDA copies must have landed before the daemon may send what they wrote.
  if (device_ != nullptr) WSYNC_RETURN_IF_ERROR(device_->Drain());
  v1::CommitPlacedRequest req;
  req.set_session_id(session_id_);
  req.set_version(version_);
  req.set_replica_generation(mapped_generation_);
  for (auto& n : placed_pending_) req.add_names(std::move(n));
  placed_pending_.clear();
  placed_pending_bytes_ = 0;
  v1::CommitPlacedReply rep;
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(opts_.timeout));
  return Annotate(FromGrpcStatus(stub_->CommitPlaced(&ctx, req, &rep)),
                  absl::StrCat("committing ", req.names_size(), " placed tensors of update ", version_));
}

absl::Status TrainerClient::EndPush(int64_t version) {
  WSYNC_RETURN_IF_ERROR(Flush());
  v1::EndPushRequest req;
  req.set_session_id(session_id_);
  req.set_version(version);
  v1::EndPushReply rep;
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(absl::Seconds(30)));
  return Annotate(FromGrpcStatus(stub_->EndPush(&ctx, req, &rep)), absl::StrCat("end push of update ", version));
}

}  // namespace wsync::client
