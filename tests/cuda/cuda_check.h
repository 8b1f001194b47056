#pragma once
// CUDA runtime calls in tests and benches: a failure names the call, the device and the sizes involved.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#define WSYNC_CUDA_CHECK(call, what)                                                                      \
  do {                                                                                                    \
    const cudaError_t wsync_e_ = (call);                                                                  \
    if (wsync_e_ != cudaSuccess) {                                                                        \
      int wsync_dev_ = -1;                                                                                \
      cudaGetDevice(&wsync_dev_);                                                                         \
      std::fprintf(stderr, "%s failed on device %d (%s): %s\n", #call, wsync_dev_, std::string(what).c_str(), \
                   cudaGetErrorString(wsync_e_));                                                         \
      std::exit(1);                                                                                       \
    }                                                                                                     \
  } while (0)

// Exit 77 (skipped) with the reason when this machine has no usable CUDA device.
inline void RequireCudaDevice(const char* program) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::printf("%s: skipped: no CUDA device on this machine (%s)\n", program,
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    std::exit(77);
  }
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  std::printf("%s: device 0: %s, %.1f GiB\n", program, p.name, p.totalGlobalMem / 1073741824.0);
}
