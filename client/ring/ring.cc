#include "client/ring/ring.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/checked_size.h"
#include "base/status.h"
#include "spdlog/spdlog.h"

namespace wsync {

using ring_wire::FrameHeader;
using ring_wire::FrameKind;
using ring_wire::kFrameAlign;
using ring_wire::kHeaderPageBytes;
using ring_wire::RingHeader;
using ring_wire::TensorFrameHeader;

namespace ring_wire {

uint32_t FrameChecksum(const void* header, size_t len, absl::string_view name) {
  const auto* p = static_cast<const uint8_t*>(header);
  constexpr size_t kSum = offsetof(FrameHeader, checksum);
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < len; ++i) {
    const uint8_t b = (i >= kSum && i < kSum + sizeof(uint32_t)) ? 0 : p[i];
    h = (h ^ b) * 16777619u;
  }
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 16777619u;
  return h;
}

}  // namespace ring_wire

namespace {

// Spin this long before sleeping: a bucket commit or release usually follows within microseconds while both
// sides are busy, and a futex round trip costs more than that. Bounded so an idle side burns no CPU.
constexpr absl::Duration kSpinTime = absl::Microseconds(20);
// Longest single futex sleep; waits re-check their condition (and the closed flag) at least this often.
constexpr absl::Duration kMaxSleep = absl::Milliseconds(100);

absl::Status ErrnoStatus(absl::string_view what, int err) {
  return absl::ErrnoToStatus(err, absl::StrCat(what, ": ", std::strerror(err)));
}

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Shared (not FUTEX_PRIVATE) operations: the word lives in a MAP_SHARED mapping used by two processes.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  struct timespec ts = absl::ToTimespec(timeout);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWake(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// Signals a waiter after the condition it waits for has changed (the change must precede this call).
void Notify(std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters) {
  word->fetch_add(1, std::memory_order_seq_cst);
  if (waiters->load(std::memory_order_seq_cst) > 0) FutexWake(word);
}

// Waits until ready() or the deadline; returns ready(). No lost wake-ups: the waiter reads the futex word before
// re-checking the condition and registers in `waiters` before sleeping; the notifier changes the condition, then
// bumps the word, then checks `waiters` (all seq_cst), so either the waiter sees the new condition, or the futex
// word no longer matches, or the notifier sees the waiter and wakes it.
template <typename Ready>
bool WaitUntil(const Ready& ready, std::atomic<uint32_t>* word, std::atomic<uint32_t>* waiters,
               absl::Time deadline) {
  if (ready()) return true;
  const absl::Time spin_end = std::min(deadline, absl::Now() + kSpinTime);
  do {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      CpuRelax();
    }
  } while (absl::Now() < spin_end);
  while (true) {
    const uint32_t seen = word->load(std::memory_order_seq_cst);
    if (ready()) return true;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return false;
    waiters->fetch_add(1, std::memory_order_seq_cst);
    if (!ready()) FutexWait(word, seen, std::min(left, kMaxSleep));
    waiters->fetch_sub(1, std::memory_order_seq_cst);
  }
}

std::string ShapeString(absl::Span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) absl::StrAppend(&s, i ? "," : "", shape[i]);
  return s + "]";
}

}  // namespace

// ---- RingMapping ----

RingMapping::RingMapping(RingMapping&& other) noexcept
    : fd_(std::move(other.fd_)),
      base_(std::exchange(other.base_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      capacity_(std::exchange(other.capacity_, 0)),
      name_(std::move(other.name_)) {}

RingMapping& RingMapping::operator=(RingMapping&& other) noexcept {
  if (this != &other) {
    Unmap();
    fd_ = std::move(other.fd_);
    base_ = std::exchange(other.base_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
    name_ = std::move(other.name_);
  }
  return *this;
}

RingMapping::~RingMapping() { Unmap(); }  // then fd_ closes: reverse acquisition order

void RingMapping::Unmap() {
  if (base_ != nullptr && ::munmap(base_, map_bytes_) != 0) {
    spdlog::warn("ring '{}': munmap failed: {}", name_, std::strerror(errno));
  }
  base_ = nullptr;
  map_bytes_ = 0;
}

absl::StatusOr<RingMapping> RingMapping::Create(const std::string& name, uint64_t capacity) {
  if (capacity < ring_wire::kMinCapacity || capacity > ring_wire::kMaxCapacity || capacity % 4096 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ring '%s': capacity %d must be a multiple of 4096 in [%d, %d]", name, capacity,
        ring_wire::kMinCapacity, ring_wire::kMaxCapacity));
  }
  const std::string memfd_name = absl::StrCat("wsync-ring:", name).substr(0, 240);
  ScopedFd fd(::memfd_create(memfd_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid()) return ErrnoStatus(absl::StrCat("ring '", name, "': memfd_create"), errno);
  const uint64_t bytes = kHeaderPageBytes + capacity;
  if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) {
    return ErrnoStatus(absl::StrCat("ring '", name, "': ftruncate(", bytes, ")"), errno);
  }
  // A peer that shrank the file would turn the other side's accesses into SIGBUS; seal the size.
  if (::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return ErrnoStatus(absl::StrCat("ring '", name, "': F_ADD_SEALS"), errno);
  }
  // Populate now (prepare once): the data area is all used after the first lap anyway, and page faults in the
  // first lap would otherwise cost more than the copies.
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
  if (base == MAP_FAILED) return ErrnoStatus(absl::StrCat("ring '", name, "': mmap(", bytes, ")"), errno);
  ::madvise(base, bytes, MADV_HUGEPAGE);  // best effort; effective where shmem THP is "advise"

  auto* h = new (base) RingHeader();  // memory is zero-filled; construct the atomics properly
  h->magic = ring_wire::kRingMagic;
  h->version = ring_wire::kRingVersion;
  h->header_bytes = kHeaderPageBytes;
  h->capacity = capacity;
  h->creator_pid = ::getpid();
  std::snprintf(h->name, sizeof(h->name), "%s", name.c_str());

  RingMapping m;
  m.fd_ = std::move(fd);
  m.base_ = base;
  m.map_bytes_ = bytes;
  m.capacity_ = capacity;
  m.name_ = name;
  return m;
}

absl::StatusOr<RingMapping> RingMapping::MapFd(ScopedFd fd, const std::string& what) {
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(absl::StrCat(what, ": fstat"), errno);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kHeaderPageBytes + ring_wire::kMinCapacity) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a wsync ring (file is ", size, " bytes)"));
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd.get(), 0);
  if (base == MAP_FAILED) return ErrnoStatus(absl::StrCat(what, ": mmap(", size, ")"), errno);
  RingMapping m;
  m.fd_ = std::move(fd);
  m.base_ = base;
  m.map_bytes_ = size;
  const RingHeader* h = m.header();
  if (h->magic != ring_wire::kRingMagic) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: not a wsync ring (magic 0x%x)", what, h->magic));
  }
  if (h->version != ring_wire::kRingVersion || h->header_bytes != kHeaderPageBytes) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s: ring version %d / header %d bytes, this build speaks version %d / %d", what, h->version,
        h->header_bytes, ring_wire::kRingVersion, kHeaderPageBytes));
  }
  if (h->capacity % 4096 != 0 || h->capacity + kHeaderPageBytes != size) {
    return absl::DataLossError(
        absl::StrFormat("%s: header capacity %d does not match file size %d", what, h->capacity, size));
  }
  m.capacity_ = h->capacity;
  m.name_ = std::string(h->name, strnlen(h->name, sizeof(h->name)));
  return m;
}

absl::StatusOr<RingMapping> RingMapping::Attach(int fd) {
  WSYNC_ASSIGN_OR_RETURN(ScopedFd dup, DupFd(fd));
  return MapFd(std::move(dup), absl::StrCat("ring fd ", fd));
}

// ---- RingProducer ----

RingProducer::RingProducer(RingMapping map) : map_(std::move(map)) {}

absl::StatusOr<RingProducer> RingProducer::Attach(int fd) { return FromMapping(RingMapping::Attach(fd)); }

absl::StatusOr<RingProducer> RingProducer::FromMapping(absl::StatusOr<RingMapping> map) {
  if (!map.ok()) return map.status();
  RingHeader* h = map->header();
  uint32_t st = h->state.load();
  while (true) {
    if (st & ring_wire::kStateConsumerClosed) {
      return absl::AbortedError(absl::StrCat("ring '", map->name(), "': the consumer closed it"));
    }
    if (st & ring_wire::kStateProducerAttached) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ring '", map->name(), "' already has a producer (pid ", h->producer_pid.load(),
          "); after it exits the consumer must call ResetUncommitted() before a new one attaches"));
    }
    if (h->state.compare_exchange_weak(st, st | ring_wire::kStateProducerAttached)) break;
  }
  h->producer_pid.store(::getpid());
  h->producer_sessions.fetch_add(1);
  RingProducer p(std::move(*map));
  p.commit_ = h->commit.load(std::memory_order_acquire);
  p.write_ = p.bucket_begin_ = p.commit_;
  p.seq_ = h->next_seq.load();
  h->write.store(p.commit_, std::memory_order_relaxed);
  return p;
}

RingProducer::RingProducer(RingProducer&& other) noexcept { *this = std::move(other); }

RingProducer& RingProducer::operator=(RingProducer&& other) noexcept {
  if (this != &other) {
    Detach();
    map_ = std::move(other.map_);
    write_ = other.write_;
    commit_ = other.commit_;
    bucket_begin_ = other.bucket_begin_;
    seq_ = other.seq_;
    bucket_tensors_ = other.bucket_tensors_;
    bucket_payload_ = other.bucket_payload_;
    tensor_open_ = other.tensor_open_;
    open_data_bytes_ = other.open_data_bytes_;
  }
  return *this;
}

RingProducer::~RingProducer() { Detach(); }

void RingProducer::Detach() {
  if (!map_.valid()) return;  // moved from
  RingHeader* h = map_.header();
  h->write.store(commit_, std::memory_order_relaxed);
  h->producer_pid.store(0);
  h->state.fetch_and(~ring_wire::kStateProducerAttached);
  map_ = RingMapping();
}

uint64_t RingProducer::PaddingAt(uint64_t pos, uint64_t bytes) const {
  const uint64_t room = map_.capacity() - pos % map_.capacity();
  return room < bytes ? room : 0;
}

uint64_t RingProducer::MaxTensorBytes(size_t name_bytes) const {
  const uint64_t head = ring_wire::AlignUp(sizeof(TensorFrameHeader) + name_bytes, kFrameAlign);
  const uint64_t cap = map_.capacity();
  return cap > head + kFrameAlign ? cap - head - kFrameAlign : 0;
}

bool RingProducer::FitsInBucket(size_t name_bytes, uint64_t data_bytes) const {
  const uint64_t frame = ring_wire::TensorFrameBytes(name_bytes, data_bytes);
  if (frame + kFrameAlign > map_.capacity()) return false;
  if (bucket_tensors_ == 0 && !tensor_open_) return true;  // a leading wrap is published on its own
  return write_ + PaddingAt(write_, frame) + frame + kFrameAlign - bucket_begin_ <= map_.capacity();
}

absl::Status RingProducer::WaitForSpace(uint64_t end, absl::Time deadline, absl::string_view what) {
  RingHeader* h = map_.header();
  const uint64_t cap = map_.capacity();
  auto ready = [&] {
    return end - h->read.load(std::memory_order_seq_cst) <= cap ||
           (h->state.load(std::memory_order_relaxed) & ring_wire::kStateConsumerClosed);
  };
  const absl::Time start = absl::Now();
  const bool ok = WaitUntil(ready, &h->read_futex, &h->producer_waiters, deadline);
  if (h->state.load() & ring_wire::kStateConsumerClosed) {
    return absl::AbortedError(absl::StrCat("ring '", name(), "': the consumer closed it"));
  }
  if (!ok) {
    const uint64_t read = h->read.load();
    return absl::DeadlineExceededError(absl::StrFormat(
        "ring '%s': no space for %s after %s: needs the ring up to position %d free, the consumer has "
        "released up to %d (capacity %d, %d bytes still held)",
        name(), what, absl::FormatDuration(absl::Now() - start), end, read, cap, commit_ - read));
  }
  // ready() loaded `read` seq_cst (acquire), pairing with the consumer's store: its reads of the freed bytes
  // happen before our writes into them.
  return absl::OkStatus();
}

void RingProducer::WritePadding(uint64_t pos, uint64_t bytes) {
  FrameHeader f = {};
  f.magic = ring_wire::kFrameMagic;
  f.kind = static_cast<uint8_t>(FrameKind::kPadding);
  f.position = pos;
  f.total_bytes = bytes;
  f.seq = seq_;
  f.header_bytes = sizeof(FrameHeader);
  f.checksum = ring_wire::FrameChecksum(&f, sizeof(f));
  std::memcpy(map_.data() + pos % map_.capacity(), &f, sizeof(f));
}

void RingProducer::Publish(uint64_t new_commit) {
  RingHeader* h = map_.header();
  commit_ = new_commit;
  h->write.store(write_, std::memory_order_relaxed);
  // seq_cst (a release store and more): frames written before become visible with it; see Notify/WaitUntil.
  h->commit.store(new_commit, std::memory_order_seq_cst);
  Notify(&h->commit_futex, &h->consumer_waiters);
}

absl::StatusOr<uint8_t*> RingProducer::BeginTensor(absl::string_view name, DType dtype,
                                                    absl::Span<const int64_t> shape, uint64_t data_bytes,
                                                    absl::Duration timeout) {
  if (!map_.valid()) return absl::FailedPreconditionError("RingProducer: not attached");
  if (tensor_open_) {
    return absl::FailedPreconditionError(
        absl::StrCat("ring '", this->name(), "': BeginTensor('", name, "') while a tensor is open"));
  }
  if (name.empty() || name.size() > ring_wire::kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("ring '", this->name(), "': tensor name of ", name.size(),
                                                   " bytes (must be 1..", ring_wire::kMaxNameBytes, ")"));
  }
  const size_t elem = DTypeSize(dtype);
  if (elem == 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "': invalid dtype ", static_cast<int>(dtype)));
  }
  if (shape.size() > static_cast<size_t>(ring_wire::kMaxDims)) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", name, "': ", shape.size(), " dims, at most ", ring_wire::kMaxDims));
  }
  WSYNC_ASSIGN_OR_RETURN(const uint64_t expect, ShapeBytes(shape, dtype, absl::StrCat("tensor '", name, "'")));
  if (expect != data_bytes) {
    return absl::InvalidArgumentError(absl::StrFormat("tensor '%s': shape %s of %s is %d bytes, not %d", name,
                                                      ShapeString(shape), DTypeName(dtype), expect, data_bytes));
  }
  const uint64_t cap = map_.capacity();
  // data_bytes is checked first: the frame arithmetic would wrap for sizes near 2^64.
  const uint64_t frame =
      data_bytes < cap ? ring_wire::TensorFrameBytes(name.size(), data_bytes) : UINT64_MAX - kFrameAlign;
  if (frame + kFrameAlign > cap) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "tensor '%s' (%d bytes) does not fit ring '%s': its frame takes %d bytes, the ring holds %d "
        "(at most %d data bytes per tensor with this name)",
        name, data_bytes, this->name(), frame, cap, MaxTensorBytes(name.size())));
  }
  const absl::Time deadline = absl::Now() + timeout;
  const std::string what = absl::StrCat("tensor '", name, "' (", frame, " bytes)");

  uint64_t pos = write_;
  uint64_t pad = PaddingAt(pos, frame);
  RingHeader* h = map_.header();
  if (pad > 0 && bucket_tensors_ == 0 && commit_ == pos && h->read.load(std::memory_order_seq_cst) == pos) {
    // Drained ring (everything committed is released; the consumer holds nothing and stores no release mark until
    // the next bucket): skip to the wrap point by moving the release mark there ourselves. A padding frame would
    // deadlock a frame longer than the room before the wrap: the consumer parses padding only together with the next
    // bucket, and this frame, part of that bucket, would need the padding's space released first (and would
    // overwrite its header). RingConsumer::LoadCommit adopts the skip.
    write_ = bucket_begin_ = pos + pad;
    h->read.store(write_, std::memory_order_seq_cst);
    Publish(write_);
    pos = write_;
    pad = 0;
  } else if (pad > 0 && bucket_tensors_ == 0) {
    // Wrap before the bucket starts and publish the padding alone, so it does not count against the bucket.
    WSYNC_RETURN_IF_ERROR(WaitForSpace(pos + pad, deadline, what));
    WritePadding(pos, pad);
    write_ = bucket_begin_ = pos + pad;
    Publish(write_);
    pos = write_;
    pad = 0;
  }
  const uint64_t end = pos + pad + frame + kFrameAlign;  // the bucket-end frame is reserved now
  if (end - bucket_begin_ > cap) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ring '%s': bucket seq %d (%d tensors, %d bytes of frames) cannot take tensor '%s' (%d bytes of frame): "
        "a bucket spans at most the ring capacity %d; commit the bucket first",
        this->name(), seq_, bucket_tensors_, pos - bucket_begin_, name, frame, cap));
  }
  WSYNC_RETURN_IF_ERROR(WaitForSpace(end, deadline, what));
  if (pad > 0) {
    WritePadding(pos, pad);
    pos += pad;
  }

  TensorFrameHeader t = {};
  FrameHeader& f = t.frame;
  f.magic = ring_wire::kFrameMagic;
  f.kind = static_cast<uint8_t>(FrameKind::kTensor);
  f.dtype = static_cast<uint8_t>(dtype);
  f.ndim = static_cast<uint8_t>(shape.size());
  f.position = pos;
  f.total_bytes = frame;
  f.data_bytes = data_bytes;
  f.seq = seq_;
  f.name_bytes = static_cast<uint32_t>(name.size());
  f.data_offset = static_cast<uint32_t>(ring_wire::AlignUp(sizeof(TensorFrameHeader) + name.size(), kFrameAlign));
  f.count = bucket_tensors_;
  f.header_bytes = sizeof(TensorFrameHeader);
  std::copy(shape.begin(), shape.end(), t.shape);
  f.checksum = ring_wire::FrameChecksum(&t, sizeof(t), name);
  uint8_t* dst = map_.data() + pos % cap;
  std::memcpy(dst, &t, sizeof(t));
  std::memcpy(dst + sizeof(t), name.data(), name.size());

  write_ = pos + frame;
  map_.header()->write.store(write_, std::memory_order_relaxed);
  tensor_open_ = true;
  open_data_bytes_ = data_bytes;
  return dst + f.data_offset;
}

absl::Status RingProducer::FinishTensor() {
  if (!tensor_open_) return absl::FailedPreconditionError(absl::StrCat("ring '", name(), "': no tensor is open"));
  tensor_open_ = false;
  ++bucket_tensors_;
  bucket_payload_ += open_data_bytes_;
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> RingProducer::CommitBucket() {
  if (!map_.valid()) return absl::FailedPreconditionError("RingProducer: not attached");
  if (tensor_open_) {
    return absl::FailedPreconditionError(
        absl::StrCat("ring '", name(), "': CommitBucket with a tensor still open (call FinishTensor)"));
  }
  if (bucket_tensors_ == 0) {
    return absl::FailedPreconditionError(absl::StrCat("ring '", name(), "': CommitBucket on an empty bucket"));
  }
  FrameHeader f = {};
  f.magic = ring_wire::kFrameMagic;
  f.kind = static_cast<uint8_t>(FrameKind::kBucketEnd);
  f.position = write_;
  f.total_bytes = sizeof(FrameHeader);
  f.data_bytes = bucket_payload_;
  f.seq = seq_;
  f.count = bucket_tensors_;
  f.header_bytes = sizeof(FrameHeader);
  f.checksum = ring_wire::FrameChecksum(&f, sizeof(f));
  // Aligned frames leave at least 64 contiguous bytes before the lap end, so the end frame never needs a wrap.
  std::memcpy(map_.data() + write_ % map_.capacity(), &f, sizeof(f));
  write_ += sizeof(FrameHeader);

  const uint64_t seq = seq_++;
  map_.header()->next_seq.store(seq_, std::memory_order_relaxed);
  Publish(write_);
  bucket_begin_ = write_;
  bucket_tensors_ = 0;
  bucket_payload_ = 0;
  return seq;
}

void RingProducer::AbortBucket() {
  tensor_open_ = false;
  bucket_tensors_ = 0;
  bucket_payload_ = 0;
  write_ = bucket_begin_ = commit_;
  if (map_.valid()) map_.header()->write.store(write_, std::memory_order_relaxed);
}

// ---- RingConsumer ----

absl::StatusOr<RingConsumer> RingConsumer::Create(const std::string& name, uint64_t capacity) {
  WSYNC_ASSIGN_OR_RETURN(RingMapping map, RingMapping::Create(name, capacity));
  return RingConsumer(std::move(map));
}

RingConsumer::RingConsumer(RingConsumer&& other) noexcept { *this = std::move(other); }

RingConsumer& RingConsumer::operator=(RingConsumer&& other) noexcept {
  if (this != &other) {
    Close();
    map_ = std::move(other.map_);
    parse_ = other.parse_;
    read_ = other.read_;
    last_commit_ = other.last_commit_;
    next_seq_ = other.next_seq_;
    release_seq_ = other.release_seq_;
    outstanding_ = other.outstanding_;
    broken_ = std::move(other.broken_);
  }
  return *this;
}

RingConsumer::~RingConsumer() { Close(); }

void RingConsumer::Close() {
  if (!map_.valid()) return;  // moved from
  RingHeader* h = map_.header();
  h->state.fetch_or(ring_wire::kStateConsumerClosed);
  Notify(&h->read_futex, &h->producer_waiters);
  map_ = RingMapping();
}

bool RingConsumer::producer_attached() const {
  return map_.valid() && (map_.header()->state.load() & ring_wire::kStateProducerAttached);
}

int RingConsumer::producer_pid() const { return map_.valid() ? map_.header()->producer_pid.load() : 0; }

absl::Status RingConsumer::Fail(absl::Status s) {
  if (absl::IsDataLoss(s)) {
    broken_ = s;
    spdlog::error("{}", std::string(s.message()));
  }
  return s;
}

void RingConsumer::StoreRead(uint64_t pos) {
  read_ = pos;
  RingHeader* h = map_.header();
  // Release: our reads of the freed bytes complete before the producer may overwrite them.
  h->read.store(pos, std::memory_order_seq_cst);
  Notify(&h->read_futex, &h->producer_waiters);
}

absl::Status RingConsumer::LoadCommit(uint64_t* commit) {
  RingHeader* h = map_.header();
  const uint64_t c = h->commit.load(std::memory_order_acquire);
  if (outstanding_ == 0) {
    // A producer that finds the ring drained skips the rest of the lap by moving the release mark to the wrap point
    // itself (RingProducer::BeginTensor): nothing is held then, and a padding frame would only be parsed with the
    // next bucket, which may be the very frame waiting for that space. Adopt such a skip: it ends on a wrap point,
    // is shorter than a lap, and lies within what is committed (the mark is stored before the commit that covers it).
    const uint64_t r = h->read.load(std::memory_order_acquire);
    const uint64_t cap = map_.capacity();
    if (r > parse_ && r <= c && r % cap == 0 && r - parse_ < cap && parse_ == read_) parse_ = read_ = r;
  }
  if (c % kFrameAlign != 0 || c < last_commit_ || c - read_ > map_.capacity()) {
    return absl::DataLossError(absl::StrFormat(
        "ring '%s': invalid commit position %d (previous commit %d, read %d, capacity %d)", name(), c,
        last_commit_, read_, map_.capacity()));
  }
  last_commit_ = c;
  *commit = c;
  return absl::OkStatus();
}

absl::Status RingConsumer::ReadFrame(uint64_t pos, uint64_t limit, TensorFrameHeader* out) const {
  const uint64_t cap = map_.capacity();
  const uint64_t off = pos % cap;
  const uint64_t left = limit - pos;
  auto loss = [&](const std::string& why) {
    return absl::DataLossError(
        absl::StrFormat("ring '%s': corrupt frame at position %d (offset %d): %s", name(), pos, off, why));
  };
  if (pos % kFrameAlign != 0) return loss("misaligned frame position");
  if (left < sizeof(FrameHeader)) {
    return loss(absl::StrCat("only ", left, " committed bytes left, a frame header needs 64"));
  }
  const uint8_t* src = map_.data() + off;
  // Validate a private copy: the shared bytes could change under us.
  std::memcpy(&out->frame, src, sizeof(FrameHeader));
  const FrameHeader& f = out->frame;
  if (f.magic != ring_wire::kFrameMagic) return loss(absl::StrFormat("bad magic 0x%08x", f.magic));
  if (f.header_bytes != sizeof(FrameHeader) && f.header_bytes != sizeof(TensorFrameHeader)) {
    return loss(absl::StrCat("bad header length ", f.header_bytes));
  }
  if (f.header_bytes > left || f.header_bytes > cap - off) {
    return loss(absl::StrCat("header of ", f.header_bytes, " bytes runs past the committed region"));
  }
  absl::string_view name;
  if (f.header_bytes == sizeof(TensorFrameHeader)) {
    std::memcpy(out->shape, src + sizeof(FrameHeader), sizeof(out->shape));
    if (f.name_bytes == 0 || f.name_bytes > ring_wire::kMaxNameBytes ||
        sizeof(TensorFrameHeader) + f.name_bytes > std::min(left, cap - off)) {
      return loss(absl::StrCat("bad name length ", f.name_bytes));
    }
    name = absl::string_view(reinterpret_cast<const char*>(src) + sizeof(TensorFrameHeader), f.name_bytes);
  }
  const uint32_t sum = ring_wire::FrameChecksum(out, f.header_bytes, name);
  if (sum != f.checksum) {
    return loss(absl::StrFormat("header checksum mismatch (stored 0x%08x, computed 0x%08x)", f.checksum, sum));
  }
  if (f.position != pos) return loss(absl::StrCat("stale frame written for position ", f.position));
  if (f.total_bytes < f.header_bytes || f.total_bytes % kFrameAlign != 0 || f.total_bytes > left ||
      f.total_bytes > cap - off) {
    return loss(absl::StrFormat("frame length %d is invalid or runs past the committed region (%d bytes) or "
                                "the data area end (%d bytes)",
                                f.total_bytes, left, cap - off));
  }
  switch (static_cast<FrameKind>(f.kind)) {
    case FrameKind::kPadding:
      if (f.header_bytes != sizeof(FrameHeader) || f.total_bytes != cap - off) {
        return loss("padding frame does not run to the end of the data area");
      }
      return absl::OkStatus();
    case FrameKind::kBucketEnd:
      if (f.header_bytes != sizeof(FrameHeader) || f.total_bytes != sizeof(FrameHeader)) {
        return loss("bad bucket-end frame length");
      }
      return absl::OkStatus();
    case FrameKind::kTensor: {
      if (f.header_bytes != sizeof(TensorFrameHeader)) return loss("tensor frame without shape");
      if (f.ndim > ring_wire::kMaxDims) return loss(absl::StrCat("ndim ", f.ndim, " > ", ring_wire::kMaxDims));
      const size_t elem = f.dtype <= static_cast<uint8_t>(DType::kF64) ? DTypeSize(static_cast<DType>(f.dtype)) : 0;
      if (elem == 0) return loss(absl::StrCat("invalid dtype ", f.dtype));
      if (f.data_offset % kFrameAlign != 0 || f.data_offset < sizeof(TensorFrameHeader) + f.name_bytes ||
          f.data_offset > f.total_bytes || f.data_bytes > f.total_bytes - f.data_offset) {
        return loss(absl::StrFormat("data (offset %d, %d bytes) or name (%d bytes) outside the %d-byte frame",
                                    f.data_offset, f.data_bytes, f.name_bytes, f.total_bytes));
      }
      absl::StatusOr<uint64_t> expect =
          ShapeBytes(absl::MakeConstSpan(out->shape, f.ndim), static_cast<DType>(f.dtype), "tensor frame");
      if (!expect.ok()) return loss(std::string(expect.status().message()));
      if (*expect != f.data_bytes) {
        return loss(absl::StrCat("shape needs ", *expect, " bytes, frame says ", f.data_bytes));
      }
      return absl::OkStatus();
    }
  }
  return loss(absl::StrCat("unknown frame kind ", f.kind));
}

absl::StatusOr<BucketView> RingConsumer::ParseBucket(uint64_t commit, bool* complete) {
  BucketView b;
  b.seq = next_seq_;
  uint64_t p = parse_;
  bool started = false;
  *complete = false;
  while (true) {
    if (p == commit) {
      if (!started) return b;  // only padding was committed
      return absl::DataLossError(absl::StrFormat(
          "ring '%s': commit position %d lies inside bucket seq %d (%d tensors, no bucket-end frame)", name(),
          commit, b.seq, b.tensors.size()));
    }
    TensorFrameHeader t;
    WSYNC_RETURN_IF_ERROR(ReadFrame(p, commit, &t));
    const FrameHeader& f = t.frame;
    const uint64_t off = p % map_.capacity();
    auto loss = [&](const std::string& why) {
      return absl::DataLossError(
          absl::StrFormat("ring '%s': frame at position %d (offset %d): %s", name(), p, off, why));
    };
    switch (static_cast<FrameKind>(f.kind)) {
      case FrameKind::kPadding:
        p += f.total_bytes;
        if (!started) parse_ = p;
        continue;
      case FrameKind::kTensor: {
        if (f.seq != b.seq || f.count != b.tensors.size()) {
          return loss(absl::StrFormat("tensor seq %d index %d, expected seq %d index %d", f.seq, f.count, b.seq,
                                      b.tensors.size()));
        }
        if (!started) {
          started = true;
          b.begin = p;
        }
        const uint8_t* base = map_.data() + off;
        TensorView v;
        v.name = absl::string_view(reinterpret_cast<const char*>(base) + sizeof(TensorFrameHeader), f.name_bytes);
        v.dtype = static_cast<DType>(f.dtype);
        v.shape.assign(t.shape, t.shape + f.ndim);
        v.data = base + f.data_offset;
        v.bytes = f.data_bytes;
        b.payload_bytes += f.data_bytes;
        b.tensors.push_back(std::move(v));
        p += f.total_bytes;
        continue;
      }
      case FrameKind::kBucketEnd:
        if (!started) return loss("bucket-end frame without tensors");
        if (f.seq != b.seq || f.count != b.tensors.size() || f.data_bytes != b.payload_bytes) {
          return loss(absl::StrFormat("bucket end says seq %d, %d tensors, %d bytes; parsed seq %d, %d, %d", f.seq,
                                      f.count, f.data_bytes, b.seq, b.tensors.size(), b.payload_bytes));
        }
        b.end = p + f.total_bytes;
        parse_ = b.end;
        ++next_seq_;
        *complete = true;
        return b;
    }
    return loss("unexpected frame kind");  // ReadFrame rejects unknown kinds; kept for -Wreturn-type
  }
}

absl::StatusOr<BucketView> RingConsumer::NextBucket(absl::Duration timeout) {
  if (!map_.valid()) return absl::FailedPreconditionError("RingConsumer: moved from");
  if (!broken_.ok()) return broken_;
  RingHeader* h = map_.header();
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    uint64_t commit;
    WSYNC_RETURN_IF_ERROR(Fail(LoadCommit(&commit)));
    if (commit != parse_) {
      bool complete;
      absl::StatusOr<BucketView> b = ParseBucket(commit, &complete);
      if (!b.ok()) return Fail(b.status());
      // With nothing held, padding skipped in front of the bucket can go back to the producer right away
      // (it may be waiting for exactly that space).
      if (outstanding_ == 0) {
        const uint64_t free_to = complete ? b->begin : parse_;
        if (free_to > read_) StoreRead(free_to);
      }
      if (complete) {
        ++outstanding_;
        return b;
      }
    }
    const uint64_t parsed = parse_;
    auto ready = [h, parsed] { return h->commit.load(std::memory_order_seq_cst) != parsed; };
    if (!WaitUntil(ready, &h->commit_futex, &h->consumer_waiters, deadline)) {
      return absl::DeadlineExceededError(absl::StrFormat(
          "ring '%s': no bucket committed within %s (waiting for seq %d)", name(), absl::FormatDuration(timeout),
          next_seq_));
    }
  }
}

absl::Status RingConsumer::Release(const BucketView& bucket) {
  if (!map_.valid()) return absl::FailedPreconditionError("RingConsumer: moved from");
  if (outstanding_ == 0 || bucket.seq != release_seq_) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "ring '%s': Release(seq %d) out of order: %d buckets held, next to release is seq %d", name(), bucket.seq,
        outstanding_, release_seq_));
  }
  --outstanding_;
  ++release_seq_;
  // parse_ also covers padding skipped after the last returned bucket.
  StoreRead(outstanding_ == 0 ? parse_ : bucket.end);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> RingConsumer::ResetUncommitted() {
  if (!map_.valid()) return absl::FailedPreconditionError("RingConsumer: moved from");
  if (!broken_.ok()) return broken_;
  RingHeader* h = map_.header();
  uint64_t commit;
  WSYNC_RETURN_IF_ERROR(Fail(LoadCommit(&commit)));
  // The dead producer may have died between storing next_seq and publishing commit; derive the next seq from
  // what is actually committed: the seq we expect plus the bucket ends not parsed yet.
  uint64_t seq = next_seq_;
  for (uint64_t p = parse_; p < commit;) {
    TensorFrameHeader t;
    WSYNC_RETURN_IF_ERROR(Fail(ReadFrame(p, commit, &t)));
    if (static_cast<FrameKind>(t.frame.kind) == FrameKind::kBucketEnd) seq = t.frame.seq + 1;
    p += t.frame.total_bytes;
  }
  const uint64_t write = h->write.load();
  const uint64_t discarded = write > commit ? write - commit : 0;
  h->next_seq.store(seq);
  h->write.store(commit);
  h->producer_pid.store(0);
  h->state.fetch_and(~ring_wire::kStateProducerAttached);
  if (discarded > 0) {
    spdlog::info("ring '{}': discarded {} uncommitted bytes of a dead producer; next bucket seq {}", name(),
                 discarded, seq);
  }
  return discarded;
}

}  // namespace wsync
