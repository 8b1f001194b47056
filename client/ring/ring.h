#pragma once
// Single-producer / single-consumer shared-memory ring that carries HF-named tensors from a trainer rank
// (producer, a separate process using the client library) to its local daemon (consumer).
//
// Backing: a memfd created by the daemon (RingConsumer::Create), mapped MAP_SHARED by both sides. The daemon
// hands the fd to the trainer over its trainer socket (SCM_RIGHTS, base/fd_passing.h; daemon/node/trainer_socket.h).
//
// Layout: one 4 KiB header page (RingHeader), then `capacity` bytes of data. Positions are monotonically
// increasing 64-bit byte counters; the byte at position p lives at data[p % capacity]. Invariants:
//   read <= commit <= write <= read + capacity.
// Everything in [read, commit) is committed and owned by the consumer until it releases it; the producer
// writes only in [commit, read + capacity). The consumer never looks past `commit`, and `commit` is published
// (release ordering) only at the end of a bucket, so a producer that dies mid-tensor or mid-bucket leaves
// nothing visible; the next producer session simply starts writing at `commit` again.
//
// Frames (all 64-byte aligned, never wrapping past the end of the data area):
//   tensor:     FrameHeader + int64 shape[8] (128 bytes) | name | pad to 64 | data | pad to 64
//   bucket end: FrameHeader (64 bytes): bucket seq, tensor count, payload bytes
//   padding:    FrameHeader, total_bytes covers the rest of the data area; the next frame starts at offset 0
// A bucket is its tensor frames followed by one bucket-end frame. A bucket may span at most `capacity` bytes
// (frames, the end frame and any wrap padding inside it): nothing of it can be released before it is committed.
// The client flushes (CommitBucket) before a bucket reaches that; RingProducer::FitsInBucket tells it when.
//
// Threads: a RingProducer and a RingConsumer are each used by one thread at a time (not internally locked);
// the producer and consumer may be in different threads or processes.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "base/dtype.h"
#include "base/fd_passing.h"

namespace wsync {

namespace ring_wire {

inline constexpr uint64_t kRingMagic = 0x474e495243595357ull;  // "WSYCRING" little-endian
inline constexpr uint32_t kRingVersion = 1;
inline constexpr uint64_t kHeaderPageBytes = 4096;
inline constexpr uint64_t kFrameAlign = 64;
inline constexpr uint32_t kFrameMagic = 0x4d415246u;  // "FRAM"
inline constexpr int kMaxDims = 8;
inline constexpr uint32_t kMaxNameBytes = 4096;
// Capacity is a multiple of the page size so the data area maps page-aligned; bounds keep arithmetic sane.
inline constexpr uint64_t kMinCapacity = 4096;
inline constexpr uint64_t kMaxCapacity = uint64_t{1} << 40;

// RingHeader::state bits.
inline constexpr uint32_t kStateProducerAttached = 1u << 0;
inline constexpr uint32_t kStateConsumerClosed = 1u << 1;

// The header page, shared by two processes. Lines written by different sides sit 128 bytes apart (adjacent-line
// prefetch pairs 64-byte lines on x86), so producer and consumer never write into the same cache-line pair.
struct RingHeader {
  // Written once by the creator before the fd is handed out; read-only afterwards.
  uint64_t magic;
  uint32_t version;
  uint32_t header_bytes;  // kHeaderPageBytes: data area offset in the file
  uint64_t capacity;      // data area bytes, multiple of 4096
  int32_t creator_pid;
  uint32_t reserved0;
  char name[64];  // NUL-terminated, for logs on both sides

  // Producer line.
  alignas(128) std::atomic<uint64_t> write;  // end of the producer's (uncommitted) frames; informative only
  std::atomic<uint64_t> commit;              // end of the last committed bucket (release-published)
  std::atomic<uint64_t> next_seq;            // seq the next bucket will carry (for a new producer session)
  std::atomic<uint32_t> commit_futex;        // bumped after every commit; consumer futex-waits on it
  std::atomic<uint32_t> consumer_waiters;    // >0 while the consumer may sleep on commit_futex

  // Consumer line.
  alignas(128) std::atomic<uint64_t> read;  // everything before `read` is free for the producer
  std::atomic<uint32_t> read_futex;         // bumped after every release; producer futex-waits on it
  std::atomic<uint32_t> producer_waiters;   // >0 while the producer may sleep on read_futex

  // Session line (rarely written).
  alignas(128) std::atomic<uint32_t> state;  // kState* bits
  std::atomic<int32_t> producer_pid;         // pid of the attached producer, 0 if none
  std::atomic<uint64_t> producer_sessions;   // number of producer attaches so far
};

// The header is shared between processes, so the atomics must be address-free (lock-free, no hidden lock), and
// the futex words must be plain 32-bit integers in memory.
static_assert(std::atomic<uint64_t>::is_always_lock_free, "64-bit atomics must be lock-free to live in shm");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "32-bit atomics must be lock-free to live in shm");
static_assert(std::atomic<int32_t>::is_always_lock_free, "32-bit atomics must be lock-free to live in shm");
static_assert(sizeof(std::atomic<uint32_t>) == 4, "futex words are 32-bit");
static_assert(std::is_standard_layout_v<RingHeader>, "wire struct: fixed layout, offsetof valid");
static_assert(sizeof(RingHeader) <= kHeaderPageBytes, "header must fit its page");
static_assert(offsetof(RingHeader, write) == 128 && offsetof(RingHeader, read) == 256 &&
                  offsetof(RingHeader, state) == 384,
              "producer, consumer and session lines are 128 bytes apart (no false sharing); layout is versioned");
static_assert(offsetof(RingHeader, commit_futex) % 4 == 0 && offsetof(RingHeader, read_futex) % 4 == 0,
              "futex words must be 4-byte aligned");

enum class FrameKind : uint8_t {
  kTensor = 1,
  kBucketEnd = 2,
  kPadding = 3,
};

// Common 64-byte frame header. Every field is validated by the consumer against the committed region before
// any memory it describes is touched.
struct FrameHeader {
  uint32_t magic;         // kFrameMagic
  uint8_t kind;           // FrameKind
  uint8_t dtype;          // tensor: wsync::DType
  uint8_t ndim;           // tensor: <= kMaxDims
  uint8_t reserved0;
  uint64_t position;      // absolute ring position of this frame: catches stale frames from an earlier lap
  uint64_t total_bytes;   // whole frame (header, name, padding, data), multiple of 64
  uint64_t data_bytes;    // tensor: payload bytes; bucket end: sum of the bucket's payload bytes
  uint64_t seq;           // bucket seq (tensor and bucket end)
  uint32_t name_bytes;    // tensor
  uint32_t data_offset;   // tensor: payload offset from the frame start, multiple of 64
  uint32_t count;         // tensor: index in its bucket; bucket end: number of tensors
  uint32_t header_bytes;  // bytes covered by `checksum`: 64, or 128 for tensors (FrameHeader + shape)
  uint32_t reserved1;
  uint32_t checksum;      // FrameChecksum over header_bytes bytes (this field zero) and the name
};
static_assert(std::is_standard_layout_v<FrameHeader> && std::is_trivially_copyable_v<FrameHeader>,
              "wire struct: copied out of shm with memcpy");
static_assert(sizeof(FrameHeader) == kFrameAlign, "smallest frame; any tail of the data area can hold it");
static_assert(offsetof(FrameHeader, checksum) == 60, "checksum is the last word");

// Tensor frames extend the common header with the shape.
struct TensorFrameHeader {
  FrameHeader frame;
  int64_t shape[kMaxDims];
};
static_assert(sizeof(TensorFrameHeader) == 2 * kFrameAlign, "tensor header is two frame units");
static_assert(std::is_trivially_copyable_v<TensorFrameHeader>, "wire struct: copied out of shm with memcpy");

// FNV-1a over `len` bytes of a frame header (checksum word taken as zero), then over the tensor name (empty for
// other frames): everything the consumer interprets except the payload.
uint32_t FrameChecksum(const void* header, size_t len, absl::string_view name = {});

inline constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Bytes a tensor frame takes in the ring.
inline constexpr uint64_t TensorFrameBytes(uint64_t name_bytes, uint64_t data_bytes) {
  return AlignUp(sizeof(TensorFrameHeader) + name_bytes, kFrameAlign) + AlignUp(data_bytes, kFrameAlign);
}

}  // namespace ring_wire

// Owns the memfd and its MAP_SHARED mapping (header page + data area). Movable; unmaps then closes.
class RingMapping {
 public:
  // Creates a zero-filled memfd named "wsync-ring:<name>" of 4 KiB + `capacity` bytes and initialises the header.
  static absl::StatusOr<RingMapping> Create(const std::string& name, uint64_t capacity);
  // Maps an existing ring; `fd` is duplicated (the caller keeps its own). Validates magic, version, capacity
  // against the file size.
  static absl::StatusOr<RingMapping> Attach(int fd);

  RingMapping() = default;
  RingMapping(RingMapping&& other) noexcept;
  RingMapping& operator=(RingMapping&& other) noexcept;
  RingMapping(const RingMapping&) = delete;
  RingMapping& operator=(const RingMapping&) = delete;
  ~RingMapping();

  bool valid() const { return base_ != nullptr; }
  int fd() const { return fd_.get(); }
  uint64_t capacity() const { return capacity_; }
  const std::string& name() const { return name_; }
  ring_wire::RingHeader* header() const { return reinterpret_cast<ring_wire::RingHeader*>(base_); }
  uint8_t* data() const { return static_cast<uint8_t*>(base_) + ring_wire::kHeaderPageBytes; }

 private:
  static absl::StatusOr<RingMapping> MapFd(ScopedFd fd, const std::string& what);
  void Unmap();

  ScopedFd fd_;
  void* base_ = nullptr;
  size_t map_bytes_ = 0;
  uint64_t capacity_ = 0;
  std::string name_;
};

// Trainer side. Writes tensors straight into shared memory:
//   WSYNC_ASSIGN_OR_RETURN(uint8_t* dst, producer.BeginTensor(name, dtype, shape, bytes, timeout));
//   memcpy(dst, src, bytes);            // the only copy on the trainer side
//   WSYNC_RETURN_IF_ERROR(producer.FinishTensor());
//   ... more tensors ...
//   WSYNC_ASSIGN_OR_RETURN(uint64_t seq, producer.CommitBucket());   // now visible to the daemon
// One producer may be attached to a ring at a time; after a producer dies the consumer must call
// ResetUncommitted() before a new one can attach.
class RingProducer {
 public:
  static absl::StatusOr<RingProducer> Attach(int fd);

  RingProducer(RingProducer&& other) noexcept;
  RingProducer& operator=(RingProducer&& other) noexcept;
  // Detaches: discards an uncommitted bucket, clears the attached flag.
  ~RingProducer();

  // Reserves a frame for one tensor of the current bucket and returns where its `data_bytes` bytes go (64-byte
  // aligned, valid until FinishTensor). Blocks while the ring lacks space, up to `timeout`:
  //   DeadlineExceeded  - the consumer did not release enough space in time;
  //   InvalidArgument   - bad name/dtype/shape, shape x dtype size != data_bytes, the tensor can never fit, or
  //                       the current bucket plus this tensor would exceed capacity (commit the bucket first);
  //   FailedPrecondition- a tensor is already open; Aborted - the consumer closed the ring.
  absl::StatusOr<uint8_t*> BeginTensor(absl::string_view name, DType dtype, absl::Span<const int64_t> shape,
                                       uint64_t data_bytes, absl::Duration timeout);
  // Marks the open tensor's data as written.
  absl::Status FinishTensor();
  // Publishes the current bucket (release ordering) and wakes the consumer; never blocks (BeginTensor reserved
  // the bucket-end frame). Returns the bucket's seq. FailedPrecondition if a tensor is open or the bucket is empty.
  absl::StatusOr<uint64_t> CommitBucket();
  // Drops the current uncommitted bucket (including an open tensor).
  void AbortBucket();

  // Whether a tensor of this size can still join the current bucket (else commit first). Exact, including wrap
  // padding at the current position.
  bool FitsInBucket(size_t name_bytes, uint64_t data_bytes) const;
  // Largest payload a single tensor with a `name_bytes` name can have in this ring.
  uint64_t MaxTensorBytes(size_t name_bytes) const;

  uint64_t capacity() const { return map_.capacity(); }
  const std::string& name() const { return map_.name(); }
  // The data area in this process (what a CUDA client page-locks once): every slot BeginTensor returns lies inside
  // [data_area(), + capacity()).
  uint8_t* data_area() const { return map_.data(); }
  uint64_t next_seq() const { return seq_; }
  uint32_t bucket_tensors() const { return bucket_tensors_; }
  uint64_t bucket_payload_bytes() const { return bucket_payload_; }

 private:
  explicit RingProducer(RingMapping map);
  void Detach();
  static absl::StatusOr<RingProducer> FromMapping(absl::StatusOr<RingMapping> map);
  // Space needed from `pos` for a frame of `bytes` (padding to the lap end if it would not fit contiguously).
  uint64_t PaddingAt(uint64_t pos, uint64_t bytes) const;
  // Waits until [.., end) is free (end - read <= capacity).
  absl::Status WaitForSpace(uint64_t end, absl::Time deadline, absl::string_view what);
  void WritePadding(uint64_t pos, uint64_t bytes);
  void Publish(uint64_t new_commit);

  RingMapping map_;
  uint64_t write_ = 0;         // end of frames written so far (absolute)
  uint64_t commit_ = 0;        // last published commit
  uint64_t bucket_begin_ = 0;  // first frame of the current bucket
  uint64_t seq_ = 0;           // seq of the current bucket
  uint32_t bucket_tensors_ = 0;
  uint64_t bucket_payload_ = 0;
  bool tensor_open_ = false;
  uint64_t open_data_bytes_ = 0;
};

struct TensorView {
  absl::string_view name;  // points into shared memory; valid until the bucket is released
  DType dtype = DType::kInvalid;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // shared memory, 64-byte aligned
  uint64_t bytes = 0;
};

struct BucketView {
  uint64_t seq = 0;
  std::vector<TensorView> tensors;
  uint64_t payload_bytes = 0;
  uint64_t begin = 0;  // ring positions of the bucket's first frame and one past its end frame
  uint64_t end = 0;
};

// Daemon side. Creates the ring, hands out its fd, reads buckets in place.
class RingConsumer {
 public:
  static absl::StatusOr<RingConsumer> Create(const std::string& name, uint64_t capacity);

  RingConsumer(RingConsumer&& other) noexcept;
  RingConsumer& operator=(RingConsumer&& other) noexcept;
  // Marks the ring closed (a waiting producer gets Aborted) and unmaps.
  ~RingConsumer();

  // The memfd to pass to the producer (owned by this object).
  int fd() const { return map_.fd(); }
  const std::string& name() const { return map_.name(); }
  uint64_t capacity() const { return map_.capacity(); }
  // The data area in this process: every view NextBucket returns lies inside [data_area(), + capacity()).
  const uint8_t* data_area() const { return map_.data(); }

  // Returns the next committed bucket, waiting up to `timeout` (zero: poll). Views point into shared memory
  // and stay valid until Release. Several buckets may be held at once; they must be released in order.
  //   DeadlineExceeded - nothing committed in time;
  //   DataLoss         - a torn or corrupt frame (offset and reason in the message). The ring is then
  //                      unusable: every later call returns the same error; recreate the ring.
  absl::StatusOr<BucketView> NextBucket(absl::Duration timeout);
  // Gives the bucket's space back to the producer. Buckets must be released in the order NextBucket returned
  // them (FailedPrecondition otherwise).
  absl::Status Release(const BucketView& bucket);

  // Recovery after the producer died (the daemon sees its session end): forgets the dead producer's uncommitted
  // bytes and its attachment so a new producer can attach and continue at the committed position with the next
  // bucket seq. Committed buckets stay readable. Returns the number of uncommitted bytes discarded.
  absl::StatusOr<uint64_t> ResetUncommitted();

  bool producer_attached() const;
  int producer_pid() const;

 private:
  explicit RingConsumer(RingMapping map) : map_(std::move(map)) {}
  void Close();
  // Reads and validates the frame at `pos`; `limit` is the committed end.
  absl::Status ReadFrame(uint64_t pos, uint64_t limit, ring_wire::TensorFrameHeader* out) const;
  // Parses one bucket starting at parse_ (skipping padding). Sets *complete=false if the committed data ends
  // before a bucket starts (only padding was committed).
  absl::StatusOr<BucketView> ParseBucket(uint64_t commit, bool* complete);
  absl::Status LoadCommit(uint64_t* commit);
  void StoreRead(uint64_t pos);
  absl::Status Fail(absl::Status s);

  RingMapping map_;
  uint64_t parse_ = 0;       // end of what NextBucket has returned (plus skipped padding)
  uint64_t read_ = 0;        // mirror of header->read
  uint64_t last_commit_ = 0;
  uint64_t next_seq_ = 0;    // seq expected next
  uint64_t release_seq_ = 0; // seq expected by the next Release
  uint64_t outstanding_ = 0; // buckets returned but not released
  absl::Status broken_;
};

}  // namespace wsync
