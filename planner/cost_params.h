#pragma once
#include <string>
#include <utility>
#include <vector>

// Rates and fixed costs of the cost model (planner/cost.h). Apart from cost.h because the planner itself uses
// them too: the `balanced` strategy's automatic source count (PlanOptions::cost) asks the cost model.
// All rates are in GB/s (1e9 bytes per second).

namespace wsync::planner {

enum class Executor {
  kSerial,     // the seed's: per bucket gather -> load layout 1 -> write it (blocking) -> load layout 2 -> ...;
               // the last layout's writes overlap with the next bucket
  kPipelined,  // hand-over, replica load and writes overlap (wsync's goal): the slowest stage dominates
};

// What an executor's formulas assume the source daemon does. tests/planner/executor_binding_test.cc measures the
// daemon (daemon/node/source_node.h) and fails when it no longer does what TraitsOf(kWsyncExecutor) says, so a
// prediction for wsync never rests on an executor the daemon does not run.
struct ExecutorTraits {
  // A node's ranks load their buckets into the replica at the same time: each source's time is its own (the
  // prediction is the max over sources, not their sum). Both executors assume it (the seed's ranks load their own
  // replicas in their own processes; wsync's ranks share one node replica with no node-wide lock on the data path).
  bool parallel_rank_loads = false;
  // A rank hands over its next bucket (D2H / copy into the ring) while the node loads the previous one: the
  // hand-over is a stage of its own (max(d2h, load, ...)), not part of the load.
  bool handover_overlaps_load = false;
  // A bucket's writes are posted and the node goes on loading the next bucket without waiting for them; the
  // seed's executor waits for every layout's writes but the last before it reloads its buffer.
  bool writes_overlap_loads = false;
  bool operator==(const ExecutorTraits& o) const {
    return parallel_rank_loads == o.parallel_rank_loads && handover_overlaps_load == o.handover_overlaps_load &&
           writes_overlap_loads == o.writes_overlap_loads;
  }
};
constexpr ExecutorTraits TraitsOf(Executor e) {
  return e == Executor::kSerial ? ExecutorTraits{true, false, false} : ExecutorTraits{true, true, true};
}
// The executor wsync's source daemon runs: what `wsyncctl plan --executor pipelined` predicts with, together with
// the measured node rates (planner/node_rates.h).
constexpr Executor kWsyncExecutor = Executor::kPipelined;

struct CostParams {
  double replica_load_gbps = 4.0;  // HF tensors -> CPU replica (slicing, fusion, copy) per source
  // How fast one node loads its replica as a function of how many of its ranks push at once: (ranks, GB/s) points,
  // increasing ranks, measured by bench/node (planner/node_rates.h reads its result files). When set, the ranks
  // of a node share it (each active source loads at NodeLoadGbps(R) / R, R = the node's active sources) and
  // replica_load_gbps is not used: what wsync's source daemon does, one replica per node fed by all its ranks.
  // Empty: every source loads at replica_load_gbps on its own (the seed's executor: each rank loads its own replica
  // in its own process).
  std::vector<std::pair<int, double>> node_load_gbps;
  std::string rates_origin;        // where the rates come from (printed by `wsyncctl plan`)
  double d2h_gbps = 25.0;          // trainer GPU -> pinned host hand-over of the push filter (pipelined only)
  double nvlink_gbps = 150.0;      // per-GPU all-gather rate inside a node
  double gather_efficiency = 1.0;  // fraction of the NIC line rate the all-gather achieves across nodes
  double bcast_rx_gbps = 25.0;     // what one broadcast receiver absorbs (NCCL recv + GPU load_weights per bucket)
  double fixed_ms = 0.0;           // pause, flush, RPCs
  double post_process_ms = 0.0;    // engine post_process_weights (e.g. MLA w_kc/w_vc, requantization)
  // Per target session of a source, per update: opening the write window and completing it (an RPC round trip
  // and a flush). What makes a tiny share not worth a source; docs/planner.md says where the default comes from.
  double session_ms = 1.0;
  // Relay plans (planner/relay.h): what a hop adds per chunk beyond the chunk's bytes on the relay's NIC: the relay
  // learning that the chunk landed and checking it, then posting its forward. An assumption, not calibrated
  // (docs/planner.md, "Relay plans").
  double relay_hop_ms = 0.5;
  bool include_gather = true;
  Executor executor = Executor::kSerial;
};

// The node's replica load rate (GB/s) with `ranks` ranks loading at once: linear between measured points, the
// nearest measured point outside them (never extrapolated beyond what was measured). node_load_gbps must be set.
double NodeLoadGbps(const CostParams& params, int ranks);
// One source's replica load rate (bytes per second) when `node_sources` sources of its node load at once.
double SourceLoadRate(const CostParams& params, int node_sources);
// The highest rate any one source can load at (for lower bounds): max over R of SourceLoadRate(R).
double MaxSourceLoadRate(const CostParams& params);

}  // namespace wsync::planner
