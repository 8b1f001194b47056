#include "daemon/common/engines/http_exchange.h"

#include "absl/strings/str_cat.h"
#include "httplib.h"
#include "spdlog/spdlog.h"

namespace wsync::daemon {

absl::StatusOr<HttpAnswer> HttpExchange(const std::string& host, int port, const std::string& path,
                                        const std::optional<std::string>& body, absl::Duration timeout,
                                        const std::string& where) {
  httplib::Client cli(host, port);
  const auto t = absl::ToChronoMicroseconds(timeout);
  cli.set_connection_timeout(t);
  cli.set_read_timeout(t);
  cli.set_write_timeout(t);
  cli.set_keep_alive(false);
  const absl::Time start = absl::Now();
  httplib::Result res = body ? cli.Post(path.c_str(), *body, "application/json") : cli.Get(path.c_str());
  const absl::Duration took = absl::Now() - start;
  if (!res) {
    const httplib::Error err = res.error();
    spdlog::debug("{}: no answer after {} ({})", where, absl::FormatDuration(took), httplib::to_string(err));
    if (err == httplib::Error::Connection || err == httplib::Error::ConnectionTimeout)
      return absl::UnavailableError(absl::StrCat(where, ": cannot connect to ", host, ":", port,
                                                 " (refused, or unreachable within ", absl::ToDoubleSeconds(timeout),
                                                 " s)"));
    // httplib 0.11 reports a read or write timeout as a plain Read/Write error; the time taken tells them apart
    // from a connection the server closed.
    if ((err == httplib::Error::Read || err == httplib::Error::Write) && took >= timeout * 0.9)
      return absl::DeadlineExceededError(
          absl::StrCat(where, ": no answer within ", absl::ToDoubleSeconds(timeout), " s"));
    return absl::UnavailableError(absl::StrCat(where, ": the connection failed before an answer (",
                                               httplib::to_string(err), " error after ", absl::FormatDuration(took),
                                               ")"));
  }
  spdlog::debug("{}: HTTP {} in {}", where, res->status, absl::FormatDuration(took));
  return HttpAnswer{res->status, std::move(res->body)};
}

}  // namespace wsync::daemon
