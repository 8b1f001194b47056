#pragma once
// Cost model: predicts one weight update's wall time for a plan, a network lower bound, and the NCCL-broadcast
// baseline (one head rank per PP stage sends every full HF tensor of its stage to every engine rank) on the same
// cluster. Rates are inputs; the defaults are the values docs/planner.md derives from the seed's measurements.
//
//   update = fixed + gather + transfer + post_process
//   gather      TP/EP all-gather on the trainer (same for P2P and broadcast)
//   transfer    P2P: max over sources and target NICs (see SourceTime); broadcast: see PredictBroadcast
//   a source    serial: max(load + blocking writes, NIC) + sessions x session_ms; pipelined: max(d2h, load, NIC,
//               sessions x session_ms)
//   a target NIC  bytes in / line rate, plus (serial) or overlapped with (pipelined) the (source, target) sessions
//                 into it x session_ms
//
// All rates are in GB/s (1e9 bytes per second).

#include <cstdint>
#include <string>
#include <vector>

#include "planner/cost_params.h"
#include "planner/plan.h"

namespace wsync::planner {

struct SourceTime {
  int source = 0;  // index into Plan::sources
  double d2h_s = 0, load_s = 0, blocking_send_s = 0, nic_s = 0;
  double session_s = 0;  // sessions x session_ms
  double total_s = 0;
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

// One source's time from its figures, as PredictTransfer computes it: `nic_bytes` is what its NIC carries for all
// `nic_sources` sources on it (they split the line rate `nic_bps`, bytes per second); `blocking_bytes` are the
// writes waited for before the replica buffer is reloaded (every layout but the last); `node_sources`: the active
// sources of its node, which share the node's replica load rate (CostParams::node_load_gbps). Also what the
// planner's automatic source count evaluates without building a plan, so both agree to the bit.
SourceTime PredictSource(const CostParams& params, double nic_bps, int nic_sources, uint64_t nic_bytes,
                         uint64_t push_bytes, uint64_t load_bytes, uint64_t blocking_bytes, int sessions,
                         int node_sources);
// A target NIC's time: `bytes` in at line rate and `sessions` (source, target) pairs writing into it.
double PredictTargetNic(const CostParams& params, double nic_bps, uint64_t bytes, int sessions);
// PredictPlan's P2P transfer part alone (sources, NICs, bounds): gather and fixed terms are left at 0 and
// total_s = transfer_s. What the planner's automatic source count compares.
Prediction PredictTransfer(const PlanInput& input, const Plan& plan, const CostParams& params);
BroadcastPrediction PredictBroadcast(const PlanInput& input, const CostParams& params);

}  // namespace wsync::planner
