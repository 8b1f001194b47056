#pragma once
// The RankLayout an engine rank would register (parallelism, every parameter in segment 0, region bytes, the
// quantization it reports), as the replica planner lays it out: large realistic registrations for control-plane
// tests and benches (message limits, the state store at Kimi-K2 size, bench/control) without starting an engine.
// No segments are filled in.

#include "absl/status/statusor.h"
#include "replica/layout_plan.h"
#include "replica/model_config.h"
#include "wsync/v1/common.pb.h"

namespace wsync::testdata {

absl::StatusOr<v1::RankLayout> PlannedRankLayout(const replica::ModelConfig& cfg, const replica::RankParallelism& par,
                                                 const replica::QuantSpec& quant);

}  // namespace wsync::testdata
