#pragma once
// Test hooks of the delta codec: the compare runs with the widest vector kernel the CPU has, so a test selects each
// kernel in turn to cover them all on one machine.

#include <string>
#include <vector>

namespace wsync::replica::delta::testing {

// The compare kernels this CPU can run, widest first ("avx512bw", "avx2", "sse2", "scalar").
std::vector<std::string> CompareKernels();

// Makes every later encoding in this process use `name` (false when the CPU cannot run it). Not thread-safe: for
// tests, before they encode.
bool UseCompareKernel(const std::string& name);

}  // namespace wsync::replica::delta::testing
