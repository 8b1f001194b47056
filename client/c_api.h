#ifndef WSYNC_CLIENT_C_API_H_
#define WSYNC_CLIENT_C_API_H_
/* C API of the wsync client library (libwsync_client_c.so), for trainers written in languages other than C++ and
 * for the Python package (ctypes). A thin shell over wsync::client::TrainerClient and CoordinatorClient.
 *
 * Conventions:
 *  - Every call that can fail returns an int status code with absl::StatusCode numbering (WSYNC_OK = 0, ...).
 *    On failure the message is available from wsync_last_error() on the same thread, and from the handle's own
 *    *_last_error() until the next call on that handle.
 *  - Handles are opaque. A handle is used by one thread at a time; different handles are independent.
 *  - Strings returned through `char**` out-parameters are NUL-terminated, owned by the caller, released with
 *    wsync_free(). Strings returned as `const char*` are owned by the library.
 *  - Calls block until the daemon/coordinator answers or their timeout expires.
 *
 *   wsync_trainer* t;
 *   if (wsync_trainer_connect("/run/wsync/wsyncd.sock", 0, 0, 0, 120, &t) != WSYNC_OK) puts(wsync_last_error());
 *   char* names; size_t n;
 *   wsync_trainer_begin_push(t, v, &names, &n);       // '\n'-joined tensor names this rank must push
 *   ... wsync_trainer_push(t, name, "bfloat16", shape, ndim, data, bytes) for each name ...
 *   wsync_free(names);
 *   wsync_trainer_end_push(t, v);
 *   wsync_trainer_close(t);
 */

#include <stddef.h>
#include <stdint.h>

#if defined(__GNUC__)
#define WSYNC_C_EXPORT __attribute__((visibility("default")))
#else
#define WSYNC_C_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes: the numbering of absl::StatusCode (and of gRPC). */
enum {
  WSYNC_OK = 0,
  WSYNC_CANCELLED = 1,
  WSYNC_UNKNOWN = 2,
  WSYNC_INVALID_ARGUMENT = 3,
  WSYNC_DEADLINE_EXCEEDED = 4,
  WSYNC_NOT_FOUND = 5,
  WSYNC_ALREADY_EXISTS = 6,
  WSYNC_PERMISSION_DENIED = 7,
  WSYNC_RESOURCE_EXHAUSTED = 8,
  WSYNC_FAILED_PRECONDITION = 9,
  WSYNC_ABORTED = 10,
  WSYNC_OUT_OF_RANGE = 11,
  WSYNC_UNIMPLEMENTED = 12,
  WSYNC_INTERNAL = 13,
  WSYNC_UNAVAILABLE = 14,
  WSYNC_DATA_LOSS = 15,
  WSYNC_UNAUTHENTICATED = 16,
};

typedef struct wsync_trainer wsync_trainer;
typedef struct wsync_coordinator wsync_coordinator;

/* Library version: the project version, e.g. "0.3.0". */
WSYNC_C_EXPORT const char* wsync_version(void);
/* Message (without the code) of the last failed call on this thread ("" if none). Valid until the next failing
 * call on this thread. */
WSYNC_C_EXPORT const char* wsync_last_error(void);
/* Releases a buffer the library returned through a char** out-parameter. NULL is fine. */
WSYNC_C_EXPORT void wsync_free(void* p);

/* ---- trainer rank ---- */

/* Opens a session with the local source wsyncd through its trainer socket `daemon` (a Unix socket path, wsyncd
 * --trainer-socket; a host:port is refused with WSYNC_INVALID_ARGUMENT). bucket_bytes 0: half the ring.
 * timeout_s bounds connecting (a daemon not answering on the path by then: WSYNC_DEADLINE_EXCEEDED naming it), each
 * bucket hand-over and ring wait (<= 0: 120 s). */
WSYNC_C_EXPORT int wsync_trainer_connect(const char* daemon, int local_rank, int global_rank, uint64_t bucket_bytes,
                                         double timeout_s, wsync_trainer** out);
/* Opens this rank's part of update `version` (waits until the coordinator began it). *names_out receives the
 * tensor names this rank must push, '\n'-joined without a trailing newline ("" when none); *count_out their number.
 * Either out-parameter may be NULL. */
WSYNC_C_EXPORT int wsync_trainer_begin_push(wsync_trainer* t, int64_t version, char** names_out, size_t* count_out);
/* Copies one tensor into the shared-memory ring. `dtype` is a torch/numpy/safetensors name ("bfloat16", "BF16",
 * "float32", ...). `bytes` must equal the product of `shape` times the element size; `data` must be contiguous. */
WSYNC_C_EXPORT int wsync_trainer_push(wsync_trainer* t, const char* name, const char* dtype, const int64_t* shape,
                                      int ndim, const void* data, uint64_t bytes);
/* Like wsync_trainer_push for a tensor in CUDA memory: `data` is a device pointer of CUDA device `device` (an
 * ordinal of this process), `stream` the cudaStream_t (as an integer; 0 = the legacy default stream) whose queued
 * work produces the tensor (torch: torch.cuda.current_stream(device).cuda_stream). The first such call page-locks
 * the ring once; each call queues an asynchronous device-to-host copy into the ring and returns. The tensor must
 * stay alive and unchanged until the next wsync_trainer_flush / wsync_trainer_end_push returned. Returns
 * WSYNC_UNIMPLEMENTED (12) when the library was built without CUDA, WSYNC_INVALID_ARGUMENT for a pointer that is
 * not device memory of `device`. */
WSYNC_C_EXPORT int wsync_trainer_push_cuda(wsync_trainer* t, const char* name, const char* dtype,
                                           const int64_t* shape, int ndim, const void* data, uint64_t bytes,
                                           int device, uint64_t stream);
/* Turns GPU FP8 quantization on (enable != 0) or off for later wsync_trainer_push_cuda calls (TrainerOptions::gpu_fp8):
 * a tensor the last wsync_trainer_begin_push offered for FP8 (the node's replica stores FP8 block-quantized weights)
 * is then quantized on its GPU and pushed as float8_e4m3fn codes plus float32 `<name>_scale_inv`, byte-identical
 * to the daemon's CPU quantization, with about half the device-to-host bytes. *count_out (may be NULL) receives how
 * many tensors the last begin_push offered. */
WSYNC_C_EXPORT int wsync_trainer_set_gpu_fp8(wsync_trainer* t, int enable, size_t* count_out);
/* Tensors quantized on the GPU since the last begin_push. */
WSYNC_C_EXPORT int wsync_trainer_fp8_quantized(const wsync_trainer* t, uint64_t* count);
/* Pushes a slice of HF tensor `name` whose whole shape is `full_shape` (ndim dims): the data (contiguous, `bytes`
 * bytes) has shape `extents` and starts at `offsets` (both ndim long). Accepted: a range along dim 0 (row ranges,
 * whole experts) or any rectangle of a 2-D tensor. The node's daemon assembles the tensor from its ranks' slices. */
WSYNC_C_EXPORT int wsync_trainer_push_slice(wsync_trainer* t, const char* name, const char* dtype,
                                            const int64_t* full_shape, int ndim, const int64_t* offsets,
                                            const int64_t* extents, const void* data, uint64_t bytes);
/* wsync_trainer_push_slice for data in CUDA memory (see wsync_trainer_push_cuda). */
WSYNC_C_EXPORT int wsync_trainer_push_slice_cuda(wsync_trainer* t, const char* name, const char* dtype,
                                                 const int64_t* full_shape, int ndim, const int64_t* offsets,
                                                 const int64_t* extents, const void* data, uint64_t bytes,
                                                 int device, uint64_t stream);
/* The slices the last wsync_trainer_begin_push asked this rank to push (shard-aware plans), one per line,
 * '\n'-joined: "<name>|<shape, x-joined>|<offsets, comma-joined>|<extents, comma-joined>" ("" when none). */
WSYNC_C_EXPORT int wsync_trainer_push_slices(wsync_trainer* t, char** slices_out, size_t* count_out);
/* Commits the current bucket and waits until the daemon took every committed bucket. A daemon-side error for an
 * earlier bucket (e.g. a tensor of the wrong shape) is returned here at the latest. */
WSYNC_C_EXPORT int wsync_trainer_flush(wsync_trainer* t);
/* Flush, then tells the daemon this rank is done with `version`. */
WSYNC_C_EXPORT int wsync_trainer_end_push(wsync_trainer* t, int64_t version);
/* Counters of the current update (since the last begin_push). Any out-parameter may be NULL. */
WSYNC_C_EXPORT int wsync_trainer_stats(const wsync_trainer* t, uint64_t* tensors, uint64_t* bytes, uint64_t* buckets);
/* Message of the last failed call on this handle ("" if the last call succeeded). Owned by the handle. */
WSYNC_C_EXPORT const char* wsync_trainer_last_error(const wsync_trainer* t);
/* Closes the session (waits for a bucket in flight) and frees the handle. NULL is fine. */
WSYNC_C_EXPORT void wsync_trainer_close(wsync_trainer* t);

/* ---- coordinator ---- */

/* Creates a client of the coordinator at `endpoint` (host:port); connects lazily. dial_timeout_s <= 0: 5 s.
 * `endpoint` may list several coordinators sharing one etcd state store ("h1:p1,h2:p2"): calls go to the leader and
 * are repeated on the new leader after a fail-over (up to 20 s of looking for one). */
WSYNC_C_EXPORT int wsync_coordinator_open(const char* endpoint, double dial_timeout_s, wsync_coordinator** out);
/* Pauses every engine and opens update `version`. pause_mode NULL or "": the coordinator's default.
 * *json_out (may be NULL) receives the BeginUpdateReply as JSON. */
WSYNC_C_EXPORT int wsync_coordinator_begin_update(wsync_coordinator* c, int64_t version, const char* pause_mode,
                                                  char** json_out);
/* The same with the update's mode: NULL, "" or "classic" as above; "staged": the engines serve on while the update is
 * staged and switch together at the commit (docs/operations.md, "Staged updates"). */
WSYNC_C_EXPORT int wsync_coordinator_begin_update_mode(wsync_coordinator* c, int64_t version, const char* pause_mode,
                                                       const char* mode, char** json_out);
/* Waits for every source (at most timeout_s; <= 0: 120 s), post-processes, sets the version and resumes the
 * engines. *json_out receives the UpdateRecord as JSON. A failed update returns WSYNC_ABORTED (the engines stay
 * paused at their old version; its record, "success": false, is in the history). */
WSYNC_C_EXPORT int wsync_coordinator_commit_update(wsync_coordinator* c, int64_t version, double timeout_s,
                                                   char** json_out);
/* Closes the open update `version` without committing it; reason may be NULL. *json_out receives the
 * AbortUpdateReply as JSON (record, bytes_written, engines_resumable). The engines stay paused. */
WSYNC_C_EXPORT int wsync_coordinator_abort_update(wsync_coordinator* c, int64_t version, const char* reason,
                                                  char** json_out);
/* Resumes paused engines at their current version (refused with WSYNC_FAILED_PRECONDITION while they may hold
 * partial writes of a failed or aborted update). *json_out receives the ResumeEnginesReply as JSON. */
WSYNC_C_EXPORT int wsync_coordinator_resume_engines(wsync_coordinator* c, char** json_out);
/* ClusterStatus as JSON. */
WSYNC_C_EXPORT int wsync_coordinator_status(wsync_coordinator* c, char** json_out);
/* HistoryReply (the last `limit` updates; <= 0: all kept) as JSON. */
WSYNC_C_EXPORT int wsync_coordinator_history(wsync_coordinator* c, int limit, char** json_out);
WSYNC_C_EXPORT const char* wsync_coordinator_last_error(const wsync_coordinator* c);
WSYNC_C_EXPORT void wsync_coordinator_close(wsync_coordinator* c);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* WSYNC_CLIENT_C_API_H_ */
