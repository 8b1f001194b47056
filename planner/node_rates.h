#pragma once
// Measured node rates for the cost model: what bench/node measured on a named machine, kept in the tree as a
// result file (bench/node/results/*.json), so every prediction says which measurement it rests on.
//
// File format (JSON object):
//   "machine":   what it ran on (cores, memory, GPU), "date": when, "command": the bench command line;
//   "node_load_gbps": [[ranks, GB/s], ...]  host tensors pushed by R trainer ranks -> every parameter in the node's
//                     replica, complete and handed to the transport (increasing R);
//   "d2h_gbps":        optional: the pinned device-to-host peak of that machine (CUDA tensors' hand-over);
//   optional curves, [[ranks, GB/s], ...] like node_load_gbps, each from its own bench_node case (bench/node):
//   "fp8_passthrough_load_gbps"  FP8 codes + scales pushed (Kimi-K2 shapes, 64x64 blocks) -> replica;
//   "fp8_quantize_load_gbps"     bf16 pushed, quantized to FP8 128x128 by the node (DeepSeek-V3 shapes);
//   "send_gbps"                  host tensors -> the node's tcp transport -> a target's memory over loopback;
//   "cuda_load_gbps"             CUDA tensors (D2H by the ranks, all sharing one GPU) -> replica;
//   they are read and checked here and kept for the reader; the cost model uses node_load_gbps and d2h_gbps;
//   further fields (baselines, ratios, the per-case results) are kept for the reader and ignored here.

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "planner/cost_params.h"

namespace wsync::planner {

struct NodeRates {
  std::string machine, date, command;
  std::vector<std::pair<int, double>> node_load_gbps;  // increasing ranks, positive rates
  double d2h_gbps = 0;                                 // 0: not measured
  // The optional curves (empty: not measured), same rules as node_load_gbps.
  std::vector<std::pair<int, double>> fp8_passthrough_load_gbps, fp8_quantize_load_gbps, send_gbps, cuda_load_gbps;
  std::string origin;                                  // the file it was read from
};

// Parses a result file's text; `origin` names it in errors and in NodeRates::origin. InvalidArgument on anything
// malformed (missing or non-increasing ranks, non-positive rates).
absl::StatusOr<NodeRates> ParseNodeRates(absl::string_view json, absl::string_view origin);
absl::StatusOr<NodeRates> LoadNodeRates(const std::string& path);
// The result file compiled into the binaries (bench/node/results/default.json at build time): what `wsyncctl plan`
// uses for wsync's executor unless told otherwise. NotFound when no such file was there at build time.
absl::StatusOr<NodeRates> BuiltinNodeRates();
// Puts the rates into `params` (node_load_gbps, d2h_gbps when measured, rates_origin).
void ApplyNodeRates(const NodeRates& rates, CostParams* params);

}  // namespace wsync::planner
