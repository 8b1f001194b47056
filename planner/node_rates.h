#pragma once
// Measured node rates for the cost model: what bench/node measured on a named machine, kept in the tree as a
// result file (bench/node/results/*.json), so every prediction says which measurement it rests on.
//
// File format (JSON object):
//   "machine":   what it ran on (cores, memory, GPU), "date": when, "command": the bench command line(s);
//   "curves": {NAME: {"gbps": [[ranks, GB/s], ...], "tp": engine TP, "source": the file or run it was measured in}}
//             each a node's rate as a function of the trainer ranks pushing at once (increasing ranks): pushed bytes
//             -> every parameter in the node's replica, complete and handed to the transport. NAME is
//             WEIGHTS/TENSORS/PATH (CurveName): WEIGHTS bf16 (bf16 pushed and kept), fp8-passthrough (FP8 codes +
//             scales pushed, Kimi-K2 shapes), fp8-quantize (bf16 pushed, quantized by the node); TENSORS host or
//             cuda (where the trainer's tensors are; cuda: every rank sharing the bench machine's one GPU); PATH ring
//             or placement (zero-copy into the replica, the client's default where the node offers it);
//   "d2h_gbps":        optional: the pinned device-to-host peak of that machine (CUDA tensors' hand-over);
//   older files: "node_load_gbps" [[ranks, GB/s], ...] (host tensors, the path not said) and the optional flat
//   curves "fp8_passthrough_load_gbps", "fp8_quantize_load_gbps", "send_gbps", "cuda_load_gbps": read and checked;
//   node_load_gbps stands in for any curve the file lacks (ChooseNodeCurve says so);
//   further fields (baselines, ratios, the per-case results) are kept for the reader and ignored here.

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/memory_kind.h"
#include "planner/cost_params.h"

namespace wsync::planner {

// One measured curve of a result file.
struct RateCurve {
  std::vector<std::pair<int, double>> gbps;  // increasing ranks, positive rates
  int tp = 0;                                // the engine TP it was measured at (0: not said)
  std::string source;                        // where its figures were taken from (not said: empty)
};

struct NodeRates {
  std::string machine, date, command;
  std::map<std::string, RateCurve> curves;             // by CurveName
  std::vector<std::pair<int, double>> node_load_gbps;  // older files; empty in newer ones
  double d2h_gbps = 0;                                 // 0: not measured
  // The optional curves (empty: not measured), same rules as node_load_gbps.
  std::vector<std::pair<int, double>> fp8_passthrough_load_gbps, fp8_quantize_load_gbps, send_gbps, cuda_load_gbps;
  std::string origin;                                  // the file it was read from
};

// Where the trainer's tensors are when it pushes them (TrainerClient::PushDevice vs Push): the memory kind the
// source and target use too.
using TrainerTensors = MemoryKind;
// What the trainer pushes: bf16 tensors, or FP8 codes with their block scales (`wsyncctl plan --weights fp8`).
enum class PushedWeights { kBf16, kFp8PassThrough };

// "bf16/cuda/placement" and the like (the file format above).
std::string CurveName(absl::string_view weights, TrainerTensors tensors, absl::string_view path);

// The curve a prediction rests on, and what was wanted but not measured.
struct NodeCurveChoice {
  std::string name;  // the curve used ("node_load_gbps" for an older file's only curve)
  RateCurve curve;
  std::string wanted;  // the first preference when it was not in the file; empty when it was
};
// Which measured curve stands for pushes of `weights` from `tensors` (pure): placement (the client's default), else
// the ring, of those weights and tensors; then FP8 pass-through falls back to bf16 of the same tensors (the same
// byte copies without conversion), then the other tensors' curves, then an older file's node_load_gbps. NotFound
// when the file has none of them.
absl::StatusOr<NodeCurveChoice> ChooseNodeCurve(const NodeRates& rates, TrainerTensors tensors, PushedWeights weights);

// Parses a result file's text; `origin` names it in errors and in NodeRates::origin. InvalidArgument on anything
// malformed (missing or non-increasing ranks, non-positive rates, a curve name outside the format, neither
// "curves" nor "node_load_gbps").
absl::StatusOr<NodeRates> ParseNodeRates(absl::string_view json, absl::string_view origin);
absl::StatusOr<NodeRates> LoadNodeRates(const std::string& path);
// The result file compiled into the binaries (bench/node/results/default.json at build time): what `wsyncctl plan`
// uses for wsync's executor unless told otherwise. NotFound when no such file was there at build time.
absl::StatusOr<NodeRates> BuiltinNodeRates();
// Puts the chosen curve into `params` (node_load_gbps; d2h_gbps when measured; rates_origin: the file, its machine
// and date, the curve's name, engine TP and source, and what was wanted where the curve is a stand-in).
void ApplyNodeRates(const NodeRates& rates, const NodeCurveChoice& choice, CostParams* params);
// ChooseNodeCurve, then ApplyNodeRates.
absl::Status ApplyNodeRates(const NodeRates& rates, TrainerTensors tensors, PushedWeights weights, CostParams* params);

}  // namespace wsync::planner
