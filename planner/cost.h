#pragma once
// Cost model: predicts one weight update's wall time for a plan, a network lower bound, and the NCCL-broadcast
// baseline (one head rank per PP stage sends every full HF tensor of its stage to every engine rank) on the same
// cluster. Rates are inputs; the defaults are the values docs/planner.md derives from the seed's measurements.
//
//   update = fixed + gather + transfer + post_process
//   gather      TP/EP all-gather on the trainer (same for P2P and broadcast)
//   transfer    P2P: max over sources and target NICs (see SourceTime); broadcast: see PredictBroadcast
//
// All rates are in GB/s (1e9 bytes per second).

#include <cstdint>
#include <string>
#include <vector>

#include "planner/plan.h"

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
  bool include_gather = true;
  Executor executor = Executor::kSerial;
};

struct SourceTime {
  int source = 0;  // index into Plan::sources
  double d2h_s = 0, load_s = 0, blocking_send_s = 0, nic_s = 0, total_s = 0;
};

struct Prediction {
  double gather_s = 0;
  // Trainer-dtype bytes all ranks together receive in the gather: for `local` what its push slices gather, for the
  // other strategies the whole TP/EP all-gather (GatherBytes).
  uint64_t gather_bytes = 0;
  double transfer_s = 0;      // P2P part after the gather
  double total_s = 0;         // fixed + gather + transfer + post
  double bound_s = 0;         // max(bytes out of any sending NIC, bytes into any receiving NIC) / line rate
  double ideal_bound_s = 0;   // plan-independent: max(busiest target NIC, all bytes / all trainer NICs) / rate
  int critical_source = -1;   // slowest source, -1 when a target NIC dominates
  double max_target_nic_s = 0;
  std::vector<SourceTime> sources;  // active sources only
};

struct BroadcastPrediction {
  double gather_s = 0;
  double transfer_s = 0;
  double total_s = 0;
  uint64_t bytes_per_receiver = 0;  // every engine rank receives every full HF tensor
  uint64_t max_stage_bytes = 0;
  uint64_t network_bytes = 0;       // head sends + ring forwards: bytes_per_receiver * engine ranks
};

// TP/EP all-gather time on the trainer (the slowest rank), from HfTensorInfo::train_bytes and expert flags.
// `local` plans gather only what their push slices name (Plan::gather_bytes, per source on NVLink or the NIC).
double PredictGather(const PlanInput& input, const CostParams& params);
// Bytes the full TP/EP all-gather moves, summed over the receiving ranks of every stage.
uint64_t GatherBytes(const PlanInput& input);
Prediction PredictPlan(const PlanInput& input, const Plan& plan, const CostParams& params);
BroadcastPrediction PredictBroadcast(const PlanInput& input, const CostParams& params);

}  // namespace wsync::planner
