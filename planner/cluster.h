#pragma once
// Cluster shape the planner works on: trainer parallelism, engine deployment, NICs. Pure data plus parsing of the
// CLI's "k=v,k=v" and "8x400Gbps" forms, so the same validation serves the CLI, the daemon and the tests.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace wsync::planner {

// Megatron-style trainer. Rank order is tp-cp-ep-dp-pp (pp outermost), so PP stage p owns the contiguous ranks
// [p*S, (p+1)*S) with S = world / pp; after the TP/EP all-gather every rank of a stage holds that stage's tensors.
struct TrainerSpec {
  int tp = 1, pp = 1, cp = 1, ep = 1, etp = 1;
  int nodes = 1;
  int gpus_per_node = 8;
  int world() const { return nodes * gpus_per_node; }
  int sources_per_stage() const { return world() / pp; }
};

// Inference engines: `instances` identical SGLang engines of `tp` ranks each (ep and dp-attention inside tp).
struct EngineSpec {
  int instances = 1;
  int tp = 1;
  int ep = 1;
  int dp_attention = 1;  // attention DP size; attention is sharded over tp / dp_attention
  int nodes = 1;
  int gpus_per_node() const { return nodes > 0 ? (instances * tp + nodes - 1) / nodes : 0; }
};

// NICs per node, identical on trainer and engine nodes. GPU g of a node uses NIC g * per_node / gpus_per_node.
struct NicSpec {
  int per_node = 8;
  double gbps = 400.0;  // line rate in Gbit/s
  double bytes_per_second() const { return gbps * 1e9 / 8.0; }
};

struct ClusterSpec {
  TrainerSpec trainer;
  EngineSpec engine;
  NicSpec nic;
  absl::Status Validate() const;
};

// "tp=8,pp=8,cp=4,ep=32,nodes=32[,gpus=8][,etp=1]". Unknown keys and malformed values are InvalidArgument.
absl::StatusOr<TrainerSpec> ParseTrainerSpec(absl::string_view text);
// "instances=8,tp=32,ep=32[,dp=1][,nodes=N]"; nodes defaults to instances*tp/8 (at least 1).
absl::StatusOr<EngineSpec> ParseEngineSpec(absl::string_view text);
// "8x400Gbps", "8x400", "4x200Gbps", "1x100Gb/s".
absl::StatusOr<NicSpec> ParseNicSpec(absl::string_view text);

std::string FormatTrainerSpec(const TrainerSpec& t);
std::string FormatEngineSpec(const EngineSpec& e);

}  // namespace wsync::planner
