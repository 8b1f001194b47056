#pragma once
// libfabric, loaded at run time.
//
// Like libibverbs for the verbs backend (transport/verbs/ibv_api.h), libfabric is not linked: wsyncd must start on
// hosts without it, and the fabric transport then reports itself not viable with the loader's message. Almost every
// fi_* call is an inline function of <rdma/fabric.h> and friends that goes through the ops tables of the objects
// (fi_domain, fi_mr_reg, fi_writemsg, fi_cq_read, ...): those need no table entry. Only the few exported functions
// below are resolved with dlsym. Code of this backend never calls an exported fi_* function directly (fi_allocinfo
// included: it calls fi_dupinfo), so the binary has no undefined libfabric symbol.

#include <rdma/fabric.h>

#include "absl/status/statusor.h"

namespace wsync::transport::fabric {

struct FiApi {
  decltype(&::fi_getinfo) getinfo = nullptr;
  decltype(&::fi_freeinfo) freeinfo = nullptr;
  decltype(&::fi_dupinfo) dupinfo = nullptr;
  decltype(&::fi_fabric) fabric = nullptr;
  decltype(&::fi_strerror) strerror = nullptr;
  decltype(&::fi_version) version = nullptr;
};

// The library name tried: $WSYNC_FABRIC_LIB when set (tests point it at a missing file), else "libfabric.so.1".
const char* FabricLibraryName();

// Loads the library once per process (thread-safe) and returns the table, or why it cannot be used ("cannot load
// libfabric.so.1 (...): install libfabric1 to use the fabric transport"). The result is cached.
absl::StatusOr<const FiApi*> LoadFabric();

// The loaded table. Only valid after LoadFabric() succeeded (every handle the backend holds implies it did).
const FiApi& Fi();

// fi_strerror of a (positive or negative) libfabric return code, usable before the library is loaded.
std::string FiError(long rc);

}  // namespace wsync::transport::fabric
