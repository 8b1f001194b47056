#include "transport/verbs/ibv_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "base/dl_symbol.h"

namespace wsync::transport::verbs {
namespace {

absl::once_flag g_once;
IbvApi g_api;
absl::Status g_status;


void LoadOnce() {
  const char* lib_name = IbvLibraryName();
  void* lib = dlopen(lib_name, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    g_status = absl::FailedPreconditionError(absl::StrCat("cannot load ", lib_name, " (", err ? err : "unknown error",
                                                          "): install rdma-core's libibverbs1 to use the verbs "
                                                          "transport"));
    return;
  }
  IbvApi api;
  std::string missing;
  ResolveSymbol(lib, "ibv_get_device_list", api.get_device_list, missing);
  ResolveSymbol(lib, "ibv_free_device_list", api.free_device_list, missing);
  ResolveSymbol(lib, "ibv_get_device_name", api.get_device_name, missing);
  ResolveSymbol(lib, "ibv_open_device", api.open_device, missing);
  ResolveSymbol(lib, "ibv_close_device", api.close_device, missing);
  ResolveSymbol(lib, "ibv_query_device", api.query_device, missing);
  ResolveSymbol(lib, "ibv_query_port", api.query_port_compat, missing);
  ResolveSymbol(lib, "ibv_query_gid", api.query_gid, missing);
  ResolveSymbol(lib, "_ibv_query_gid_ex", api.query_gid_ex, missing);
  ResolveSymbol(lib, "ibv_alloc_pd", api.alloc_pd, missing);
  ResolveSymbol(lib, "ibv_dealloc_pd", api.dealloc_pd, missing);
  ResolveSymbol(lib, "ibv_reg_mr", api.reg_mr, missing);
  ResolveSymbol(lib, "ibv_dereg_mr", api.dereg_mr, missing);
  ResolveSymbol(lib, "ibv_create_cq", api.create_cq, missing);
  ResolveSymbol(lib, "ibv_destroy_cq", api.destroy_cq, missing);
  ResolveSymbol(lib, "ibv_create_comp_channel", api.create_comp_channel, missing);
  ResolveSymbol(lib, "ibv_destroy_comp_channel", api.destroy_comp_channel, missing);
  ResolveSymbol(lib, "ibv_get_cq_event", api.get_cq_event, missing);
  ResolveSymbol(lib, "ibv_ack_cq_events", api.ack_cq_events, missing);
  ResolveSymbol(lib, "ibv_create_qp", api.create_qp, missing);
  ResolveSymbol(lib, "ibv_destroy_qp", api.destroy_qp, missing);
  ResolveSymbol(lib, "ibv_modify_qp", api.modify_qp, missing);
  ResolveSymbol(lib, "ibv_query_qp", api.query_qp, missing);
  ResolveSymbol(lib, "ibv_port_state_str", api.port_state_str, missing);
  ResolveSymbol(lib, "ibv_wc_status_str", api.wc_status_str, missing);
  std::string optional_missing;  // reg_dmabuf_mr stays null: device memory then goes through a host mirror
  ResolveSymbol(lib, "ibv_reg_dmabuf_mr", api.reg_dmabuf_mr, optional_missing);
  if (!missing.empty()) {
    // An rdma-core too old for this build (e.g. no _ibv_query_gid_ex before v32): refuse rather than crash later.
    g_status = absl::FailedPreconditionError(
        absl::StrCat(lib_name, " lacks the symbol ", missing, ": rdma-core is too old for the verbs transport"));
    dlclose(lib);
    return;
  }
  g_api = api;  // the library stays loaded for the life of the process
}

}  // namespace

int IbvApi::QueryPort(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) const {
  verbs_context* vctx = verbs_get_ctx_op(ctx, query_port);
  if (vctx == nullptr) {
    std::memset(attr, 0, sizeof(*attr));
    return query_port_compat(ctx, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
  }
  return vctx->query_port(ctx, port, attr, sizeof(*attr));
}

const char* IbvLibraryName() {
  const char* env = std::getenv("WSYNC_IBVERBS_LIB");
  return env != nullptr && *env != '\0' ? env : "libibverbs.so.1";
}

absl::StatusOr<const IbvApi*> LoadIbv() {
  absl::call_once(g_once, LoadOnce);
  if (!g_status.ok()) return g_status;
  return &g_api;
}

const IbvApi& Ibv() { return g_api; }

}  // namespace wsync::transport::verbs
