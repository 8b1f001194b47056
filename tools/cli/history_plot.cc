#include "tools/cli/history_plot.h"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace wsync::tools {
namespace {

// Whether `name` is an executable file in a directory of $PATH.
bool OnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  for (absl::string_view dir : absl::StrSplit(path, ':')) {
    const std::string f = absl::StrCat(dir.empty() ? "." : dir, "/", name);
    if (access(f.c_str(), X_OK) == 0) return true;
  }
  return false;
}

// Runs argv[0] (looked up on $PATH) with `input` on its stdin; its exit status, or -1 when it could not be started.
int RunWithInput(const std::vector<std::string>& args, const std::string& input) {
  int fds[2];
  if (pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return -1;
  }
  if (pid == 0) {
    dup2(fds[0], STDIN_FILENO);
    close(fds[0]);
    close(fds[1]);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  close(fds[0]);
  // A converter that exits early must not take this process down with SIGPIPE: its exit status says what happened.
  struct sigaction ignore {
  }, old{};
  ignore.sa_handler = SIG_IGN;
  sigaction(SIGPIPE, &ignore, &old);
  size_t done = 0;
  while (done < input.size()) {
    const ssize_t n = write(fds[1], input.data() + done, input.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  close(fds[1]);
  sigaction(SIGPIPE, &old, nullptr);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

std::string DescribeVersions(std::vector<int64_t> versions) {
  if (versions.empty()) return "none";
  std::sort(versions.begin(), versions.end());
  versions.erase(std::unique(versions.begin(), versions.end()), versions.end());
  std::vector<std::string> parts;
  for (size_t i = 0; i < versions.size();) {
    size_t j = i;
    while (j + 1 < versions.size() && versions[j + 1] == versions[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(versions[i]) : absl::StrCat(versions[i], "-", versions[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ", ");
}

absl::StatusOr<std::vector<v1::UpdateRecord>> SelectRecords(const v1::HistoryReply& history,
                                                            const std::vector<int64_t>& versions, int limit) {
  std::vector<v1::UpdateRecord> out;
  if (versions.empty()) {
    const int n = history.records_size();
    for (int i = limit > 0 ? std::max(0, n - limit) : 0; i < n; ++i) out.push_back(history.records(i));
    return out;
  }
  std::vector<int64_t> held, missing;
  for (const auto& r : history.records()) held.push_back(r.version());
  for (int64_t v : versions) {
    auto it = std::find_if(history.records().rbegin(), history.records().rend(),
                           [v](const v1::UpdateRecord& r) { return r.version() == v; });
    if (it == history.records().rend()) {
      missing.push_back(v);
    } else {
      out.push_back(*it);
    }
  }
  if (!missing.empty())
    return absl::NotFoundError(
        absl::StrCat(missing.size() == 1 ? "version " : "versions ", DescribeVersions(missing),
                     missing.size() == 1 ? " is" : " are", " not in the coordinator's history, which holds ",
                     held.empty() ? std::string("no update yet") : absl::StrCat("versions ", DescribeVersions(held)),
                     " (it keeps the last updates only: wsync-coordinator --history)"));
  return out;
}

absl::StatusOr<PlotFormat> PlotFormatOf(const std::string& path) {
  const std::string lower = absl::AsciiStrToLower(path);
  if (absl::EndsWith(lower, ".svg")) return PlotFormat::kSvg;
  if (absl::EndsWith(lower, ".png")) return PlotFormat::kPng;
  return absl::InvalidArgumentError(
      absl::StrCat("--plot ", path, ": the file name must end in .svg (SVG) or .png (PNG, through rsvg-convert)"));
}

absl::Status WritePlot(const std::string& path, PlotFormat format, const std::string& svg) {
  if (format == PlotFormat::kSvg) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) return absl::NotFoundError(absl::StrCat("--plot ", path, ": cannot write: ", std::strerror(errno)));
    f << svg;
    f.close();
    if (!f) return absl::InternalError(absl::StrCat("--plot ", path, ": write failed: ", std::strerror(errno)));
    return absl::OkStatus();
  }
  if (!OnPath("rsvg-convert"))
    return absl::FailedPreconditionError(
        absl::StrCat("--plot ", path,
                     ": PNG needs rsvg-convert, which is not installed (apt-get install "
                     "librsvg2-bin); or write SVG: --plot ",
                     path.substr(0, path.size() - 4), ".svg"));
  const int rc = RunWithInput({"rsvg-convert", "-f", "png", "-o", path}, svg);
  if (rc != 0)
    return absl::InternalError(absl::StrCat("--plot ", path, ": rsvg-convert failed (exit status ", rc, ")"));
  return absl::OkStatus();
}

}  // namespace wsync::tools
