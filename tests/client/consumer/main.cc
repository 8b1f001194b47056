// Uses the installed C++ client: a coordinator that is not there must fail within the dial timeout, with a status.
#include <cstdio>

#include "client/coordinator_client.h"

int main(int argc, char** argv) {
  const char* endpoint = argc > 1 ? argv[1] : "127.0.0.1:1";
  wsync::client::CoordinatorClient c(endpoint, absl::Milliseconds(500));
  auto st = c.Status();
  if (st.ok()) {
    std::printf("consumer: coordinator at %s answered (version '%s')\n", endpoint, st->current_version().c_str());
    return 0;
  }
  std::printf("consumer: %s\n", st.status().ToString().c_str());
  return 3;
}
