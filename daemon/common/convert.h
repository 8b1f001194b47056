#pragma once
// Conversions between the generated protos and the plain C++ types of the modules.

#include "replica/model_config.h"
#include "wsync/v1/common.pb.h"

namespace wsync::daemon {

replica::RankParallelism FromProto(const v1::RankParallelism& p);
v1::RankParallelism ToProto(const replica::RankParallelism& p);

}  // namespace wsync::daemon
