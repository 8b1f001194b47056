#pragma once
// Resolving the functions of a library opened with dlopen (the transports load libibverbs and libfabric at run time,
// so no binary links them).

#include <dlfcn.h>

#include <string>

namespace wsync {

// Fills `slot` with the library's `name`, or records the first missing symbol in `missing`.
template <typename Fn>
void ResolveSymbol(void* lib, const char* name, Fn& slot, std::string& missing) {
  dlerror();
  void* sym = dlsym(lib, name);
  if (sym == nullptr) {
    if (missing.empty()) missing = name;
    return;
  }
  slot = reinterpret_cast<Fn>(sym);
}

}  // namespace wsync
