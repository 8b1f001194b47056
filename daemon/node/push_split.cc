#include "daemon/node/push_split.h"

#include <algorithm>
#include <numeric>
#include <queue>
#include <tuple>

namespace wsync::daemon {

std::map<int, std::vector<std::string>> SplitPushByBytes(const std::vector<PushItem>& items, int ranks) {
  std::map<int, std::vector<std::string>> out;
  if (ranks < 1) return out;
  for (int r = 0; r < ranks; ++r) out[r];
  std::vector<size_t> order(items.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return items[a].bytes > items[b].bytes; });
  // (bytes so far, rank): the smallest first, the lower rank on ties.
  using Load = std::pair<uint64_t, int>;
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> loads;
  for (int r = 0; r < ranks; ++r) loads.push({0, r});
  std::vector<int> owner(items.size());
  for (size_t i : order) {
    auto [b, r] = loads.top();
    loads.pop();
    owner[i] = r;
    loads.push({b + items[i].bytes, r});
  }
  for (size_t i = 0; i < items.size(); ++i) out[owner[i]].push_back(items[i].name);
  return out;
}

}  // namespace wsync::daemon
