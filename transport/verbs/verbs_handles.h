#pragma once
// RAII owners for every ibv_* handle the verbs backend creates.
//
// Each handle is a std::unique_ptr with a deleter that calls the matching ibv_destroy/dealloc/dereg/close function,
// logs a failure and never throws. Objects holding several handles declare them in acquisition order (context, pd,
// cq, qp, mr), so C++ member destruction releases them in reverse order, as the verbs API requires.

#include <infiniband/verbs.h>

#include <memory>

#include "transport/verbs/ibv_api.h"

namespace wsync::transport::verbs {

namespace internal {
// Logs a failed release; `what` names the ibv_* call. Defined in verbs_handles.cc (keeps spdlog out of this header).
void LogReleaseFailure(const char* what, int rc) noexcept;
}  // namespace internal

// Deleter for a handle released by `int Release(T*)` (0 on success, else an errno value).
template <typename T, int (*Release)(T*), const char* kWhat>
struct IbvDeleter {
  void operator()(T* handle) const noexcept {
    if (handle == nullptr) return;
    int rc = Release(handle);
    if (rc != 0) internal::LogReleaseFailure(kWhat, rc);
  }
};

namespace internal {
inline constexpr char kCloseDevice[] = "ibv_close_device";
inline constexpr char kDeallocPd[] = "ibv_dealloc_pd";
inline constexpr char kDestroyCq[] = "ibv_destroy_cq";
inline constexpr char kDestroyQp[] = "ibv_destroy_qp";
inline constexpr char kDestroyCompChannel[] = "ibv_destroy_comp_channel";
inline constexpr char kDeregMr[] = "ibv_dereg_mr";
// Some of these are macros or inline wrappers in rdma-core; take the address of a real function.
inline int CloseDevice(ibv_context* c) { return Ibv().close_device(c); }
inline int DeallocPd(ibv_pd* p) { return Ibv().dealloc_pd(p); }
inline int DestroyCq(ibv_cq* c) { return Ibv().destroy_cq(c); }
inline int DestroyQp(ibv_qp* q) { return Ibv().destroy_qp(q); }
inline int DestroyCompChannel(ibv_comp_channel* c) { return Ibv().destroy_comp_channel(c); }
inline int DeregMr(ibv_mr* m) { return Ibv().dereg_mr(m); }
}  // namespace internal

using ContextPtr = std::unique_ptr<ibv_context, IbvDeleter<ibv_context, internal::CloseDevice, internal::kCloseDevice>>;
using PdPtr = std::unique_ptr<ibv_pd, IbvDeleter<ibv_pd, internal::DeallocPd, internal::kDeallocPd>>;
using CqPtr = std::unique_ptr<ibv_cq, IbvDeleter<ibv_cq, internal::DestroyCq, internal::kDestroyCq>>;
using QpPtr = std::unique_ptr<ibv_qp, IbvDeleter<ibv_qp, internal::DestroyQp, internal::kDestroyQp>>;
using CompChannelPtr = std::unique_ptr<
    ibv_comp_channel, IbvDeleter<ibv_comp_channel, internal::DestroyCompChannel, internal::kDestroyCompChannel>>;
using MrPtr = std::unique_ptr<ibv_mr, IbvDeleter<ibv_mr, internal::DeregMr, internal::kDeregMr>>;

// The device list returned by ibv_get_device_list; freed with ibv_free_device_list.
struct DeviceListDeleter {
  void operator()(ibv_device** list) const noexcept {
    if (list != nullptr) Ibv().free_device_list(list);
  }
};
using DeviceListPtr = std::unique_ptr<ibv_device*, DeviceListDeleter>;

}  // namespace wsync::transport::verbs
