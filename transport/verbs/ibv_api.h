#pragma once
// libibverbs, loaded at run time.
//
// wsyncd must start on hosts without rdma-core (tcp-only nodes, containers without the RDMA stack), so the verbs
// backend does not link libibverbs: the first use dlopen()s it and fills a table of the exported functions it calls.
// Inline helpers of <infiniband/verbs.h> that only go through a context's ops (ibv_post_send, ibv_poll_cq) need no
// table entry. When the library (or one of its symbols) is missing, the verbs transport reports itself not viable
// with the loader's message.

#include <infiniband/verbs.h>

#include "absl/status/statusor.h"

namespace wsync::transport::verbs {

struct IbvApi {
  decltype(&::ibv_get_device_list) get_device_list = nullptr;
  decltype(&::ibv_free_device_list) free_device_list = nullptr;
  decltype(&::ibv_get_device_name) get_device_name = nullptr;
  decltype(&::ibv_open_device) open_device = nullptr;
  decltype(&::ibv_close_device) close_device = nullptr;
  decltype(&::ibv_query_device) query_device = nullptr;
  decltype(&::ibv_query_port) query_port_compat = nullptr;  // the exported symbol behind the ibv_query_port macro
  decltype(&::ibv_query_gid) query_gid = nullptr;
  decltype(&::_ibv_query_gid_ex) query_gid_ex = nullptr;
  decltype(&::ibv_alloc_pd) alloc_pd = nullptr;
  decltype(&::ibv_dealloc_pd) dealloc_pd = nullptr;
  decltype(&::ibv_reg_mr) reg_mr = nullptr;  // the exported symbol behind the ibv_reg_mr macro
  decltype(&::ibv_dereg_mr) dereg_mr = nullptr;
  // Optional (rdma-core v34+): null when the library lacks it. Registers a dma-buf (GPUDirect RDMA into GPU memory).
  decltype(&::ibv_reg_dmabuf_mr) reg_dmabuf_mr = nullptr;
  decltype(&::ibv_create_cq) create_cq = nullptr;
  // Completion channels: the fd an endpoint's owner sleeps on (Endpoint::CompletionFd).
  decltype(&::ibv_create_comp_channel) create_comp_channel = nullptr;
  decltype(&::ibv_destroy_comp_channel) destroy_comp_channel = nullptr;
  decltype(&::ibv_get_cq_event) get_cq_event = nullptr;
  decltype(&::ibv_ack_cq_events) ack_cq_events = nullptr;
  decltype(&::ibv_destroy_cq) destroy_cq = nullptr;
  decltype(&::ibv_create_qp) create_qp = nullptr;
  decltype(&::ibv_destroy_qp) destroy_qp = nullptr;
  decltype(&::ibv_modify_qp) modify_qp = nullptr;
  decltype(&::ibv_query_qp) query_qp = nullptr;
  decltype(&::ibv_port_state_str) port_state_str = nullptr;
  decltype(&::ibv_wc_status_str) wc_status_str = nullptr;

  // ibv_query_port as the header's inline wrapper does it: the context's extended op when the provider has one,
  // else the exported compat entry point.
  int QueryPort(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) const;
  int QueryGidEx(ibv_context* ctx, uint32_t port, uint32_t index, ibv_gid_entry* entry) const {
    return query_gid_ex(ctx, port, index, entry, 0, sizeof(*entry));
  }
};

// The library name tried: $WSYNC_IBVERBS_LIB when set (tests point it at a missing file), else "libibverbs.so.1".
const char* IbvLibraryName();

// Loads the library once per process (thread-safe) and returns the table, or why it cannot be used, e.g.
// "cannot load libibverbs.so.1 (libibverbs.so.1: cannot open shared object file ...): install rdma-core's
// libibverbs1 to use the verbs transport". The result (success or failure) is cached.
absl::StatusOr<const IbvApi*> LoadIbv();

// The loaded table. Only valid after LoadIbv() succeeded (every handle the backend holds implies it did).
const IbvApi& Ibv();

}  // namespace wsync::transport::verbs
