#pragma once
// Rates and fixed costs of the cost model (planner/cost.h). Apart from cost.h because the planner itself uses
// them too: the `balanced` strategy's automatic source count (PlanOptions::cost) asks the cost model.
// All rates are in GB/s (1e9 bytes per second).

namespace wsync::planner {

enum class Executor {
  kSerial,     // the seed's: per bucket gather -> load layout 1 -> write it (blocking) -> load layout 2 -> ...;
               // the last layout's writes overlap with the next bucket
  kPipelined,  // hand-over, replica load and writes overlap (wsync's goal): the slowest stage dominates
};

struct CostParams {
  double replica_load_gbps = 4.0;  // HF tensors -> CPU replica (slicing, fusion, copy) per source
  double d2h_gbps = 25.0;          // trainer GPU -> pinned host hand-over of the push filter (pipelined only)
  double nvlink_gbps = 150.0;      // per-GPU all-gather rate inside a node
  double gather_efficiency = 1.0;  // fraction of the NIC line rate the all-gather achieves across nodes
  double bcast_rx_gbps = 25.0;     // what one broadcast receiver absorbs (NCCL recv + GPU load_weights per bucket)
  double fixed_ms = 0.0;           // pause, flush, RPCs
  double post_process_ms = 0.0;    // engine post_process_weights (e.g. MLA w_kc/w_vc, requantization)
  // Per target session of a source, per update: opening the write window and completing it (an RPC round trip
  // and a flush). What makes a tiny share not worth a source; docs/planner.md says where the default comes from.
  double session_ms = 1.0;
  bool include_gather = true;
  Executor executor = Executor::kSerial;
};

}  // namespace wsync::planner
