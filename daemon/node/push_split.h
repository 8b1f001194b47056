#pragma once
// Which local trainer rank pushes which checkpoint tensor when the plan names none (no push filter): the node's
// ranks copy in parallel, so an update's hand-over ends when the rank with the most bytes ends. Tensors are dealt out
// largest first to the rank with the fewest bytes so far (longest-processing-time rule: the heaviest rank carries at
// most 4/3 of the optimum, and in practice the mean plus a fraction of one tensor), then each rank pushes its share in
// the order given (model order: engines' parameters complete layer by layer).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace wsync::daemon {

struct PushItem {
  std::string name;
  uint64_t bytes = 0;
};

// `items` in push order; `ranks` >= 1. Every rank gets a list (possibly empty); ties go to the lower rank, so the
// split is a function of its inputs alone (every restart of a daemon deals the same way).
std::map<int, std::vector<std::string>> SplitPushByBytes(const std::vector<PushItem>& items, int ranks);

}  // namespace wsync::daemon
