#pragma once
// FP8 block quantization on the GPU: the same convention as the CPU quantizer (replica/fp8.h) and byte-identical
// output for the same input (tests/cuda/fp8_cuda_test.cc checks it on a GPU). Built only with WSYNC_WITH_CUDA.
//
// All pointers are device pointers; `stream` is a cudaStream_t (nullptr: the default stream). The call only enqueues
// the kernel; errors of the launch are returned, errors of the execution surface at the next synchronization.

#include <cstdint>

#include "absl/status/status.h"
#include "base/dtype.h"
#include "replica/fp8.h"

namespace wsync::replica {

absl::Status QuantizeFp8BlockCuda(DType src_dtype, const void* src, int64_t rows, int64_t cols, int64_t src_stride,
                                  int block_n, int block_k, uint8_t* dst, int64_t dst_stride, float* scale_inv,
                                  int64_t scale_stride, Fp8ScaleFormat format = Fp8ScaleFormat::kFloat32,
                                  void* stream = nullptr);

}  // namespace wsync::replica
