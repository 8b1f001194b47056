#pragma once
// Status helpers shared by every module. Debian's Abseil (20220623) has no status macros, so they live here once.

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define WSYNC_STATUS_CONCAT_INNER_(a, b) a##b
#define WSYNC_STATUS_CONCAT_(a, b) WSYNC_STATUS_CONCAT_INNER_(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define WSYNC_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::absl::Status wsync_status_ = (expr);           \
    if (!wsync_status_.ok()) return wsync_status_;   \
  } while (0)

// `lhs` = value of a StatusOr expression, or returns its status.
#define WSYNC_ASSIGN_OR_RETURN(lhs, expr) \
  WSYNC_ASSIGN_OR_RETURN_IMPL_(WSYNC_STATUS_CONCAT_(wsync_statusor_, __LINE__), lhs, expr)
#define WSYNC_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return tmp.status();                \
  lhs = std::move(tmp).value()

namespace wsync {

// Returns `s` with `context` prepended to its message, keeping the code ("context: original message").
inline absl::Status Annotate(const absl::Status& s, absl::string_view context) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(context, ": ", s.message()));
}

}  // namespace wsync

// Like WSYNC_RETURN_IF_ERROR, adding context as the error travels up.
#define WSYNC_RETURN_IF_ERROR_CTX(expr, ...)                                    \
  do {                                                                          \
    ::absl::Status wsync_status_ = (expr);                                      \
    if (!wsync_status_.ok())                                                    \
      return ::wsync::Annotate(wsync_status_, ::absl::StrCat(__VA_ARGS__));     \
  } while (0)
