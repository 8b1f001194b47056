#pragma once
// Conversions between the generated protos and the plain C++ types of the modules.

#include "replica/model_config.h"
#include "wsync/v1/common.pb.h"

namespace wsync::daemon {

replica::RankParallelism FromProto(const v1::RankParallelism& p);
v1::RankParallelism ToProto(const replica::RankParallelism& p);

// The weight set an engine rank's layout holds: kAll (its target and its speculative draft, one table) when some
// segment holds the draft (MemorySegment.weights), else kTarget.
replica::WeightSet WeightSetOfLayout(const v1::RankLayout& layout);

}  // namespace wsync::daemon
