#include "client/c_api.h"

#include <google/protobuf/util/json_util.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/checked_size.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "base/dtype.h"
#include "base/status.h"
#include "client/coordinator_client.h"
#include "client/trainer_client.h"

struct wsync_trainer {
  std::unique_ptr<wsync::client::TrainerClient> client;
  std::string last_error;
};

struct wsync_coordinator {
  std::unique_ptr<wsync::client::CoordinatorClient> client;
  std::string last_error;
};

namespace {

thread_local std::string g_last_error;

// Records `s` for wsync_last_error() (and the handle's own message) and returns its code as the C status.
int Report(const absl::Status& s, std::string* handle_error = nullptr) {
  if (handle_error != nullptr) handle_error->clear();
  if (s.ok()) return WSYNC_OK;
  g_last_error = std::string(s.message());  // the code travels as the return value
  if (handle_error != nullptr) *handle_error = g_last_error;
  return static_cast<int>(s.code());
}

// A malloc'ed NUL-terminated copy the caller releases with wsync_free.
char* CopyOut(const std::string& s) {
  char* p = static_cast<char*>(std::malloc(s.size() + 1));
  if (p == nullptr) return nullptr;
  std::memcpy(p, s.data(), s.size());
  p[s.size()] = '\0';
  return p;
}

// Serializes `msg` as JSON into *out (when out is not null).
absl::Status JsonOut(const google::protobuf::Message& msg, char** out) {
  if (out == nullptr) return absl::OkStatus();
  google::protobuf::util::JsonPrintOptions opts;
  opts.always_print_primitive_fields = true;  // "success": false must not vanish
  opts.preserve_proto_field_names = true;
  std::string json;
  auto st = google::protobuf::util::MessageToJsonString(msg, &json, opts);
  if (!st.ok()) return absl::InternalError(absl::StrCat("encoding a reply as JSON: ", st.ToString()));
  *out = CopyOut(json);
  if (*out == nullptr) return absl::ResourceExhaustedError("out of memory copying a JSON reply");
  return absl::OkStatus();
}

absl::Duration SecondsOr(double s, double fallback) { return absl::Seconds(s > 0 ? s : fallback); }

absl::Status NullArg(absl::string_view what) { return absl::InvalidArgumentError(absl::StrCat(what, " is NULL")); }

// Converts C++ exceptions (bad_alloc, anything thrown below) into a status: nothing may unwind into C.
template <typename F>
int Guard(std::string* handle_error, F&& f) {
  try {
    return Report(f(), handle_error);
  } catch (const std::bad_alloc&) {
    return Report(absl::ResourceExhaustedError("out of memory"), handle_error);
  } catch (const std::exception& e) {
    return Report(absl::InternalError(absl::StrCat("unexpected exception: ", e.what())), handle_error);
  } catch (...) {
    return Report(absl::InternalError("unexpected exception"), handle_error);
  }
}

}  // namespace

extern "C" {

const char* wsync_version(void) { return WSYNC_VERSION; }  // the project version (CMakeLists.txt)

const char* wsync_last_error(void) { return g_last_error.c_str(); }

void wsync_free(void* p) { std::free(p); }

int wsync_trainer_connect(const char* daemon, int local_rank, int global_rank, uint64_t bucket_bytes, double timeout_s,
                          wsync_trainer** out) {
  return Guard(nullptr, [&]() -> absl::Status {
    if (out == nullptr) return NullArg("out");
    *out = nullptr;
    if (daemon == nullptr) return NullArg("daemon");
    wsync::client::TrainerOptions o;
    o.daemon = daemon;
    o.local_rank = local_rank;
    o.global_rank = global_rank;
    o.bucket_bytes = bucket_bytes;
    o.timeout = SecondsOr(timeout_s, 120);
    o.connect_timeout = o.timeout;
    auto c = wsync::client::TrainerClient::Connect(o);
    if (!c.ok()) return c.status();
    auto t = std::make_unique<wsync_trainer>();
    t->client = *std::move(c);
    *out = t.release();
    return absl::OkStatus();
  });
}

int wsync_trainer_begin_push(wsync_trainer* t, int64_t version, char** names_out, size_t* count_out) {
  if (names_out != nullptr) *names_out = nullptr;
  if (count_out != nullptr) *count_out = 0;
  if (t == nullptr) return Report(NullArg("trainer handle"));
  return Guard(&t->last_error, [&]() -> absl::Status {
    auto names = t->client->BeginPush(version);
    if (!names.ok()) return names.status();
    if (names_out != nullptr) {
      *names_out = CopyOut(absl::StrJoin(*names, "\n"));
      if (*names_out == nullptr) return absl::ResourceExhaustedError("out of memory copying tensor names");
    }
    if (count_out != nullptr) *count_out = names->size();
    return absl::OkStatus();
  });
}

namespace {

// The checks every push does before the tensor reaches the client, where the caller can still tell which tensor.
absl::StatusOr<wsync::DType> CheckPush(const char* name, const char* dtype, const int64_t* shape, int ndim,
                                       const void* data, uint64_t bytes) {
  if (name == nullptr) return NullArg("tensor name");
  if (dtype == nullptr) return NullArg(absl::StrCat("dtype of tensor ", name));
  if (ndim < 0 || (ndim > 0 && shape == nullptr))
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": bad shape (ndim ", ndim, ")"));
  if (data == nullptr && bytes > 0) return NullArg(absl::StrCat("data of tensor ", name));
  auto dt = wsync::ParseDType(dtype);
  if (!dt.ok()) return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": ", dt.status().message()));
  WSYNC_ASSIGN_OR_RETURN(const uint64_t want, wsync::ShapeBytes(absl::MakeConstSpan(shape, static_cast<size_t>(ndim)),
                                                                 *dt, absl::StrCat("tensor ", name)));
  if (want != bytes)
    return absl::InvalidArgumentError(absl::StrCat("tensor ", name, ": ", bytes, " bytes given, its shape and ",
                                                   wsync::DTypeName(*dt), " need ", want));
  return *dt;
}

}  // namespace

int wsync_trainer_push(wsync_trainer* t, const char* name, const char* dtype, const int64_t* shape, int ndim,
                       const void* data, uint64_t bytes) {
  if (t == nullptr) return Report(NullArg("trainer handle"));
  return Guard(&t->last_error, [&]() -> absl::Status {
    WSYNC_ASSIGN_OR_RETURN(wsync::DType dt, CheckPush(name, dtype, shape, ndim, data, bytes));
    return t->client->Push(name, dt, absl::Span<const int64_t>(shape, static_cast<size_t>(ndim)), data, bytes);
  });
}

int wsync_trainer_push_cuda(wsync_trainer* t, const char* name, const char* dtype, const int64_t* shape, int ndim,
                            const void* data, uint64_t bytes, int device, uint64_t stream) {
  if (t == nullptr) return Report(NullArg("trainer handle"));
  return Guard(&t->last_error, [&]() -> absl::Status {
    WSYNC_ASSIGN_OR_RETURN(wsync::DType dt, CheckPush(name, dtype, shape, ndim, data, bytes));
    return t->client->PushDevice(name, dt, absl::Span<const int64_t>(shape, static_cast<size_t>(ndim)), data, bytes,
                                 device, stream);
  });
}

int wsync_trainer_set_gpu_fp8(wsync_trainer* t, int enable, size_t* count_out) {
  if (t == nullptr) return Report(NullArg("trainer handle"));
  t->client->set_gpu_fp8(enable != 0);
  if (count_out != nullptr) *count_out = static_cast<size_t>(t->client->fp8_hint().tensor_names_size());
  return WSYNC_OK;
}

int wsync_trainer_fp8_quantized(const wsync_trainer* t, uint64_t* count) {
  if (t == nullptr) return Report(NullArg("trainer handle"));
  if (count == nullptr) return Report(NullArg("count"));
  *count = t->client->stats().fp8_quantized;
  return WSYNC_OK;
}

namespace {

absl::StatusOr<wsync::DType> CheckSlice(const char* name, const char* dtype, const int64_t* full_shape, int ndim,
                                        const int64_t* offsets, const int64_t* extents, const void* data,
                                        uint64_t bytes) {
  if (ndim <= 0 || offsets == nullptr || extents == nullptr)
    return absl::InvalidArgumentError(absl::StrCat("slice of ", name == nullptr ? "?" : name,
                                                   ": needs ndim > 0 and offsets and extents"));
  return CheckPush(name, dtype, full_shape, ndim, data, bytes);
}

absl::Span<const int64_t> Dims(const int64_t* p, int ndim) { return {p, static_cast<size_t>(ndim)}; }

}  // namespace

int wsync_trainer_push_slice(wsync_trainer* t, const char* name, const char* dtype, const int64_t* full_shape,
                             int ndim, const int64_t* offsets, const int64_t* extents, const void* data,
                             uint64_t bytes) {
  if (t == nullptr) return Report(NullArg("trainer handle"));
  return Guard(&t->last_error, [&]() -> absl::Status {
    WSYNC_ASSIGN_OR_RETURN(wsync::DType dt, CheckSlice(name, dtype, full_shape, ndim, offsets, extents, data, bytes));
    return t->client->PushSlice(name, dt, Dims(full_shape, ndim), Dims(offsets, ndim), Dims(extents, ndim), data,
                                bytes);
  });
}

int wsync_trainer_push_slice_cuda(wsync_trainer* t, const char* name, const char* dtype, const int64_t* full_shape,
                                  int ndim, const int64_t* offsets, const int64_t* extents, const void* data,
                                  uint64_t bytes, int device, uint64_t stream) {
  if (t == nullptr) return Report(NullArg("trainer handle"));
  return Guard(&t->last_error, [&]() -> absl::Status {
    WSYNC_ASSIGN_OR_RETURN(wsync::DType dt, CheckSlice(name, dtype, full_shape, ndim, offsets, extents, data, bytes));
    return t->client->PushSliceDevice(name, dt, Dims(full_shape, ndim), Dims(offsets, ndim), Dims(extents, ndim),
                                      data, bytes, device, stream);
  });
}

int wsync_trainer_push_slices(wsync_trainer* t, char** slices_out, size_t* count_out) {
  if (slices_out != nullptr) *slices_out = nullptr;
  if (count_out != nullptr) *count_out = 0;
  if (t == nullptr) return Report(NullArg("trainer handle"));
  return Guard(&t->last_error, [&]() -> absl::Status {
    std::vector<std::string> lines;
    for (const auto& s : t->client->push_slices())
      lines.push_back(absl::StrCat(s.name, "|", absl::StrJoin(s.full_shape, "x"), "|", absl::StrJoin(s.offsets, ","),
                                   "|", absl::StrJoin(s.extents, ",")));
    if (slices_out != nullptr) {
      *slices_out = CopyOut(absl::StrJoin(lines, "\n"));
      if (*slices_out == nullptr) return absl::ResourceExhaustedError("out of memory copying slices");
    }
    if (count_out != nullptr) *count_out = lines.size();
    return absl::OkStatus();
  });
}

int wsync_trainer_flush(wsync_trainer* t) {
  if (t == nullptr) return Report(NullArg("trainer handle"));
  return Guard(&t->last_error, [&]() { return t->client->Flush(); });
}

int wsync_trainer_end_push(wsync_trainer* t, int64_t version) {
  if (t == nullptr) return Report(NullArg("trainer handle"));
  return Guard(&t->last_error, [&]() { return t->client->EndPush(version); });
}

int wsync_trainer_stats(const wsync_trainer* t, uint64_t* tensors, uint64_t* bytes, uint64_t* buckets) {
  if (t == nullptr) return Report(NullArg("trainer handle"));
  const wsync::client::PushStats& s = t->client->stats();
  if (tensors != nullptr) *tensors = s.tensors;
  if (bytes != nullptr) *bytes = s.bytes;
  if (buckets != nullptr) *buckets = s.buckets;
  return WSYNC_OK;
}

const char* wsync_trainer_last_error(const wsync_trainer* t) { return t == nullptr ? "" : t->last_error.c_str(); }

// ~TrainerClient waits for a bucket in flight and closes the session (best effort).
void wsync_trainer_close(wsync_trainer* t) { delete t; }

int wsync_coordinator_open(const char* endpoint, double dial_timeout_s, wsync_coordinator** out) {
  return Guard(nullptr, [&]() -> absl::Status {
    if (out == nullptr) return NullArg("out");
    *out = nullptr;
    if (endpoint == nullptr) return NullArg("endpoint");
    auto c = std::make_unique<wsync_coordinator>();
    c->client = std::make_unique<wsync::client::CoordinatorClient>(endpoint, SecondsOr(dial_timeout_s, 5));
    *out = c.release();
    return absl::OkStatus();
  });
}

int wsync_coordinator_begin_update(wsync_coordinator* c, int64_t version, const char* pause_mode, char** json_out) {
  return wsync_coordinator_begin_update_mode(c, version, pause_mode, nullptr, json_out);
}

int wsync_coordinator_begin_update_mode(wsync_coordinator* c, int64_t version, const char* pause_mode,
                                        const char* mode, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  if (c == nullptr) return Report(NullArg("coordinator handle"));
  return Guard(&c->last_error, [&]() -> absl::Status {
    auto r = c->client->BeginUpdate(version, pause_mode == nullptr ? "" : pause_mode, mode == nullptr ? "" : mode);
    if (!r.ok()) return r.status();
    return JsonOut(*r, json_out);
  });
}

int wsync_coordinator_commit_update(wsync_coordinator* c, int64_t version, double timeout_s, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  if (c == nullptr) return Report(NullArg("coordinator handle"));
  return Guard(&c->last_error, [&]() -> absl::Status {
    // The client derives the call's deadline from timeout_s and the server's worst case (coordinator_client.h).
    auto r = c->client->CommitUpdate(version, timeout_s > 0 ? timeout_s : wsync::client::kDefaultCommitTimeoutSeconds);
    if (!r.ok()) return r.status();
    return JsonOut(*r, json_out);
  });
}

int wsync_coordinator_abort_update(wsync_coordinator* c, int64_t version, const char* reason, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  if (c == nullptr) return Report(NullArg("coordinator handle"));
  return Guard(&c->last_error, [&]() -> absl::Status {
    auto r = c->client->AbortUpdate(version, reason == nullptr ? "" : reason);
    if (!r.ok()) return r.status();
    return JsonOut(*r, json_out);
  });
}

int wsync_coordinator_resume_engines(wsync_coordinator* c, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  if (c == nullptr) return Report(NullArg("coordinator handle"));
  return Guard(&c->last_error, [&]() -> absl::Status {
    auto r = c->client->ResumeEngines();
    if (!r.ok()) return r.status();
    return JsonOut(*r, json_out);
  });
}

int wsync_coordinator_status(wsync_coordinator* c, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  if (c == nullptr) return Report(NullArg("coordinator handle"));
  return Guard(&c->last_error, [&]() -> absl::Status {
    auto r = c->client->Status();
    if (!r.ok()) return r.status();
    return JsonOut(*r, json_out);
  });
}

int wsync_coordinator_history(wsync_coordinator* c, int limit, char** json_out) {
  if (json_out != nullptr) *json_out = nullptr;
  if (c == nullptr) return Report(NullArg("coordinator handle"));
  return Guard(&c->last_error, [&]() -> absl::Status {
    auto r = c->client->History(limit);
    if (!r.ok()) return r.status();
    return JsonOut(*r, json_out);
  });
}

const char* wsync_coordinator_last_error(const wsync_coordinator* c) {
  return c == nullptr ? "" : c->last_error.c_str();
}

void wsync_coordinator_close(wsync_coordinator* c) { delete c; }

}  // extern "C"
