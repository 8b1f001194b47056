#pragma once
// Helpers shared by the verbs test files.

#include <cstdio>
#include <cstdlib>

#include "transport/transport.h"

namespace wsync::transport::verbs::testing {

// Hardware tests exit 77 (CTest SKIP_RETURN_CODE) when there is no RDMA device, saying why.
inline void SkipUnlessViable(const Transport& t) {
  if (t.viable()) return;
  std::fprintf(stderr, "SKIP: verbs transport not viable here: %s\n", t.reason().c_str());
  std::fflush(stderr);
  std::exit(77);
}

}  // namespace wsync::transport::verbs::testing
