// Uses the installed C API: prints the library version.
#include <cstdio>

#include "client/c_api.h"

int main() {
  std::printf("consumer_c: libwsync_client_c %s\n", wsync_version());
  return 0;
}
