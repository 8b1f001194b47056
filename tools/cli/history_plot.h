#pragma once
// `wsyncctl history --plot FILE`: the coordinator's update timeline (daemon/coordinator/timeline_svg.h, the same
// drawing as the status page) written as SVG, or as PNG through rsvg-convert (Debian's librsvg2-bin) when FILE ends
// in .png (docs/operations.md, "Status page").

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "wsync/v1/coordinator.pb.h"

namespace wsync::tools {

// The records to show: those of `versions` in the order asked, or with none asked the last `limit` (all when
// limit <= 0). NotFound naming the versions the history holds when one asked is not in it. Pure.
absl::StatusOr<std::vector<v1::UpdateRecord>> SelectRecords(const v1::HistoryReply& history,
                                                            const std::vector<int64_t>& versions, int limit);

// "1-3, 5, 9" (ascending, runs joined); "none" when empty. Pure.
std::string DescribeVersions(std::vector<int64_t> versions);

enum class PlotFormat { kSvg, kPng };
// From FILE's extension (.svg or .png, any case); InvalidArgument naming both otherwise. Pure.
absl::StatusOr<PlotFormat> PlotFormatOf(const std::string& path);

// Writes `svg` to `path` as `format`: SVG as is; PNG by piping it through `rsvg-convert -f png -o PATH`.
// FailedPrecondition naming the package when rsvg-convert is not installed; Internal when it fails; the file error
// otherwise.
absl::Status WritePlot(const std::string& path, PlotFormat format, const std::string& svg);

}  // namespace wsync::tools
