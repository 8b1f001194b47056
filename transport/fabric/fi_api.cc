#include "transport/fabric/fi_api.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/base/call_once.h"
#include "absl/strings/str_cat.h"
#include "base/dl_symbol.h"
#include "spdlog/spdlog.h"

namespace wsync::transport::fabric {
namespace {

absl::once_flag g_once;
FiApi g_api;
absl::Status g_status;


void LoadOnce() {
  const char* lib_name = FabricLibraryName();
  // libfabric's registration cache (ofi_rxm over verbs, efa) keeps an MR the backend closed registered, and hands it
  // out again for the same range: a closed write window, a revoked grant or a source's read-only memory would stay
  // writable through it (measured on verbs;ofi_rxm: every refusal of the fabric suite succeeded). Off before the
  // library reads its parameters.
  if (const char* c = std::getenv("FI_MR_CACHE_MAX_COUNT"); c != nullptr && std::string(c) != "0")
    spdlog::warn("fabric: FI_MR_CACHE_MAX_COUNT={} overridden with 0: a cached MR outlives its revocation", c);
  setenv("FI_MR_CACHE_MAX_COUNT", "0", 1);
  // ofi_rxm (libfabric 1.17 through 2.6.0) closes a connection's MSG endpoint and only then drains the
  // completions still queued for it (rxm_close_conn): a receive among them is re-posted to the freed endpoint and
  // the process crashes (SIGSEGV in the progress thread's fi_cq_read when a peer closes its endpoint, or in
  // fi_close of our own). Fixed upstream after 2.6.0 (commit 697688386, "prov/rxm: fix the msg_ep use-after-free at
  // connection teardown"). With a shared receive context every receive buffer is posted to that context, which outlives
  // the connections, so nothing is re-posted to a freed endpoint. tcp;ofi_rxm uses one by default already;
  // verbs;ofi_rxm does not (the crash was seen there, in the soft-RoCE VM). An explicit setting is kept, with a
  // warning.
  if (const char* c = std::getenv("FI_OFI_RXM_USE_SRX"); c != nullptr && std::string(c) != "1") {
    spdlog::warn(
        "fabric: FI_OFI_RXM_USE_SRX={} kept: ofi_rxm without a shared receive context can crash when a connection "
        "closes (libfabric 1.17's connection teardown re-posts receives to a freed endpoint)",
        c);
  }
  setenv("FI_OFI_RXM_USE_SRX", "1", 0);
  void* lib = dlopen(lib_name, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* err = dlerror();
    g_status = absl::FailedPreconditionError(absl::StrCat("cannot load ", lib_name, " (", err ? err : "unknown error",
                                                          "): install libfabric1 to use the fabric transport"));
    return;
  }
  FiApi api;
  std::string missing;
  ResolveSymbol(lib, "fi_getinfo", api.getinfo, missing);
  ResolveSymbol(lib, "fi_freeinfo", api.freeinfo, missing);
  ResolveSymbol(lib, "fi_dupinfo", api.dupinfo, missing);
  ResolveSymbol(lib, "fi_fabric", api.fabric, missing);
  ResolveSymbol(lib, "fi_strerror", api.strerror, missing);
  ResolveSymbol(lib, "fi_version", api.version, missing);
  if (!missing.empty()) {
    g_status = absl::FailedPreconditionError(
        absl::StrCat(lib_name, " lacks the symbol ", missing, ": not a libfabric the fabric transport can use"));
    dlclose(lib);
    return;
  }
  // The API version this backend is written against (1.9: mr_mode bits, FI_CONTEXT2) must be provided.
  if (api.version() < FI_VERSION(1, 9)) {
    g_status = absl::FailedPreconditionError(absl::StrCat(lib_name, " implements libfabric API ",
                                                          FI_MAJOR(api.version()), ".", FI_MINOR(api.version()),
                                                          "; the fabric transport needs 1.9 or newer"));
    dlclose(lib);
    return;
  }
  g_api = api;  // the library stays loaded for the life of the process
}

}  // namespace

const char* FabricLibraryName() {
  const char* env = std::getenv("WSYNC_FABRIC_LIB");
  return env != nullptr && *env != '\0' ? env : "libfabric.so.1";
}

absl::StatusOr<const FiApi*> LoadFabric() {
  absl::call_once(g_once, LoadOnce);
  if (!g_status.ok()) return g_status;
  return &g_api;
}

const FiApi& Fi() { return g_api; }

std::string FiError(long rc) {
  const int e = static_cast<int>(rc < 0 ? -rc : rc);
  if (g_api.strerror != nullptr) return absl::StrCat(g_api.strerror(e), " (", e, ")");
  return absl::StrCat(std::strerror(e), " (", e, ")");
}

}  // namespace wsync::transport::fabric
