#include "replica/fp8.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

// The vector-typed helpers below are internal and always inlined, so GCC's note that passing such types by value
// differs between ISA levels (-Wpsabi) does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace wsync::replica {
namespace {

#define WSYNC_FP8_INLINE inline __attribute__((always_inline))

// The kernel works on steps of 2·N elements held in GCC/Clang vector types (N 32-bit lanes), so it does not depend on
// the auto-vectorizer's cost model (which at -O2 gives up on these loops). N = 16 fills an AVX-512 register, N = 8 an
// AVX2 one (two SSE registers in the baseline build). Element-wise logic is the same as the scalar helpers in fp8.h;
// the unit tests compare the two.
template <int N>
struct Kernel {
  static constexpr int kStep = 2 * N;
  typedef uint32_t U32v __attribute__((vector_size(4 * N)));
  typedef int32_t I32v __attribute__((vector_size(4 * N)));
  typedef float F32v __attribute__((vector_size(4 * N)));
  typedef int16_t I16v __attribute__((vector_size(4 * N)));  // 2·N 16-bit lanes
  typedef uint16_t U16v __attribute__((vector_size(4 * N)));
  typedef uint8_t U8v __attribute__((vector_size(4 * N)));
  typedef uint16_t U16Half __attribute__((vector_size(2 * N)));
  typedef uint8_t U8Half __attribute__((vector_size(2 * N)));  // kStep codes

  // float32 bits of N f16 values (one per 32-bit lane, in the low half).
  WSYNC_FP8_INLINE static U32v F16BitsToF32Bits(U32v h) {
    const U32v sign = (h & 0x8000u) << 16;
    const U32v mag = h & 0x7FFFu;
    U32v normal = (mag << 13) + (112u << 23);
    normal = mag >= 0x7C00u ? normal + (112u << 23) : normal;
    // Subnormal: 2^-14 · (1 + mag/1024) − 2^-14 = mag · 2^-24, exact (no int→float conversion needed).
    const F32v subf = (F32v)((mag << 13) + (113u << 23)) - 6.103515625e-05f;
    return sign | (mag < 0x0400u ? (U32v)subf : normal);
  }

  // Each source dtype supplies, for kStep elements at p:
  //   Amax(p, m):    folds an integer |x| key per element into m (keys order like |x| for non-NaN; NaN → 0);
  //   Load(p, a, b): float32 bit patterns of the elements in two halves: even/odd elements when kInterleaved (the
  //                  16-bit types, which then need no widening shuffle), else the first/second N elements;
  // and scalar Load/KeyOf/KeyToFloat for ragged block edges.
  struct Bf16Src {
    using T = uint16_t;
    using KeyV = I16v;
    static constexpr bool kInterleaved = true;
    WSYNC_FP8_INLINE static void Amax(const T* p, KeyV* m) {
      KeyV k;
      std::memcpy(&k, p, sizeof(k));
      k &= 0x7FFF;
      k = k > 0x7F80 ? KeyV{} : k;
      *m = k > *m ? k : *m;
    }
    WSYNC_FP8_INLINE static void Load(const T* p, U32v* a, U32v* b) {
      U32v w;
      std::memcpy(&w, p, sizeof(w));
      *a = w << 16;
      *b = w & 0xFFFF0000u;
    }
    WSYNC_FP8_INLINE static float Load(T v) { return Bf16ToFloat(v); }
    WSYNC_FP8_INLINE static int32_t KeyOf(T v) { return (v & 0x7FFF) > 0x7F80 ? 0 : (v & 0x7FFF); }
    WSYNC_FP8_INLINE static float KeyToFloat(int32_t k) { return Bf16ToFloat(static_cast<uint16_t>(k)); }
  };

  struct F16Src {
    using T = uint16_t;
    using KeyV = I16v;
    static constexpr bool kInterleaved = true;
    WSYNC_FP8_INLINE static void Amax(const T* p, KeyV* m) {
      KeyV k;
      std::memcpy(&k, p, sizeof(k));
      k &= 0x7FFF;
      k = k > 0x7C00 ? KeyV{} : k;
      *m = k > *m ? k : *m;
    }
    WSYNC_FP8_INLINE static void Load(const T* p, U32v* a, U32v* b) {
      U32v w;
      std::memcpy(&w, p, sizeof(w));
      *a = F16BitsToF32Bits(w & 0xFFFFu);
      *b = F16BitsToF32Bits(w >> 16);
    }
    WSYNC_FP8_INLINE static float Load(T v) { return F16ToFloat(v); }
    WSYNC_FP8_INLINE static int32_t KeyOf(T v) { return (v & 0x7FFF) > 0x7C00 ? 0 : (v & 0x7FFF); }
    WSYNC_FP8_INLINE static float KeyToFloat(int32_t k) { return F16ToFloat(static_cast<uint16_t>(k)); }
  };

  struct F32Src {
    using T = uint32_t;  // bit patterns
    using KeyV = I32v;
    static constexpr bool kInterleaved = false;
    WSYNC_FP8_INLINE static void Amax(const T* p, KeyV* m) {
      KeyV k0, k1;
      std::memcpy(&k0, p, sizeof(k0));
      std::memcpy(&k1, p + N, sizeof(k1));
      k0 &= 0x7FFFFFFF;
      k1 &= 0x7FFFFFFF;
      k0 = k0 > 0x7F800000 ? KeyV{} : k0;
      k1 = k1 > 0x7F800000 ? KeyV{} : k1;
      k0 = k1 > k0 ? k1 : k0;
      *m = k0 > *m ? k0 : *m;
    }
    WSYNC_FP8_INLINE static void Load(const T* p, U32v* a, U32v* b) {
      std::memcpy(a, p, sizeof(*a));
      std::memcpy(b, p + N, sizeof(*b));
    }
    WSYNC_FP8_INLINE static float Load(T v) { return BitsToFloat(v); }
    WSYNC_FP8_INLINE static int32_t KeyOf(T v) {
      const uint32_t k = v & 0x7FFFFFFFu;
      return k > 0x7F800000u ? 0 : static_cast<int32_t>(k);
    }
    WSYNC_FP8_INLINE static float KeyToFloat(int32_t k) { return BitsToFloat(static_cast<uint32_t>(k)); }
  };

  // e4m3fn codes (one per 32-bit lane) of x / scale. Same steps as FloatToE4m3, with two shortcuts that give
  // identical codes: the exponent rebias is folded into the rounding constant, and instead of clamping x / scale to
  // ±448 first the code is capped at 0x7E (every value the clamp would move rounds to a code >= 0x7E).
  WSYNC_FP8_INLINE static U32v Codes(U32v bits, float scale) {
    const U32v u = (U32v)((F32v)bits / scale);
    const U32v sign = (u >> 24) & 0x80u;
    const U32v a = u & 0x7FFFFFFFu;
    const I32v normal = (I32v)((a + ((a >> 20) & 1u) + (0x7FFFFu - (120u << 23))) >> 20);
    const I32v sub = (I32v)((U32v)((F32v)a + 16384.0f) - 0x46800000u);
    I32v code = a < 0x3C800000u ? sub : normal;
    code = code > int32_t{kFp8E4M3MaxCode} ? I32v{} + kFp8E4M3MaxCode : code;
    code = a > 0x7F800000u ? I32v{} + kFp8E4M3NanCode : code;
    return sign | (U32v)code;
  }

  template <size_t... I>
  WSYNC_FP8_INLINE static U16Half EvenU16(U16v v, std::index_sequence<I...>) {
    return __builtin_shufflevector(v, v, (2 * I)...);
  }
  template <size_t... I>
  WSYNC_FP8_INLINE static U8Half EveryFourthU8(U8v a, U8v b, std::index_sequence<I...>) {
    return __builtin_shufflevector(a, b, (4 * I)...);
  }

  // kStep codes in element order (the low byte of each lane; little-endian).
  template <bool kInterleaved>
  WSYNC_FP8_INLINE static U8Half Pack(U32v ca, U32v cb) {
    if constexpr (kInterleaved) {
      const U32v pairs = ca | (cb << 8);
      return (U8Half)EvenU16((U16v)pairs, std::make_index_sequence<N>());
    } else {
      return EveryFourthU8((U8v)ca, (U8v)cb, std::make_index_sequence<2 * N>());
    }
  }

  WSYNC_FP8_INLINE static uint8_t QuantizeOne(float x, float scale) {
    float v = x / scale;
    v = v < -kFp8E4M3Max ? -kFp8E4M3Max : v;
    v = v > kFp8E4M3Max ? kFp8E4M3Max : v;
    return FloatToE4m3(v);
  }

  // A band of block_n rows is processed in panels of up to kPanelBlocks blocks: one pass over the panel for the
  // per-block amax, one to quantize. Both passes read whole panel rows (contiguous, prefetcher-friendly) and a panel
  // (128 rows x 1024 bf16 = 256 KiB) stays in L2 between the two. Walking one block at a time instead reads 128 rows
  // of 256 bytes at a large stride, which the prefetchers follow poorly and which alias in L1.
  static constexpr int64_t kPanelElems = 1024;
  static constexpr int64_t kPanelBlocks = 16;

  template <typename Src>
  WSYNC_FP8_INLINE static void Quantize(const typename Src::T* __restrict src, int64_t rows, int64_t cols,
                                        int64_t src_stride, int64_t block_n, int64_t block_k, uint8_t* __restrict dst,
                                        int64_t dst_stride, float* __restrict scale_inv, int64_t scale_stride,
                                        Fp8ScaleFormat format) {
    using T = typename Src::T;
    using KeyV = typename Src::KeyV;
    const int64_t panel_blocks = std::max<int64_t>(1, std::min(kPanelBlocks, kPanelElems / block_k));
    KeyV amax_v[kPanelBlocks];
    int32_t amax[kPanelBlocks];
    float inv[kPanelBlocks];
    for (int64_t r0 = 0, rb = 0; r0 < rows; r0 += block_n, ++rb) {
      const int64_t r1 = std::min(rows, r0 + block_n);
      for (int64_t p0 = 0; p0 < cols; p0 += panel_blocks * block_k) {
        const int64_t p1 = std::min(cols, p0 + panel_blocks * block_k);
        const int64_t nb = (p1 - p0 + block_k - 1) / block_k;
        for (int64_t j = 0; j < nb; ++j) {
          amax_v[j] = KeyV{};
          amax[j] = 0;
        }
        for (int64_t r = r0; r < r1; ++r) {
          const T* row = src + r * src_stride;
          for (int64_t j = 0; j < nb; ++j) {
            const int64_t c0 = p0 + j * block_k;
            const int64_t c1 = std::min(p1, c0 + block_k);
            const int64_t v1 = c1 - (c1 - c0) % kStep;
            for (int64_t c = c0; c < v1; c += kStep) Src::Amax(row + c, &amax_v[j]);
            for (int64_t c = v1; c < c1; ++c) amax[j] = std::max(amax[j], Src::KeyOf(row[c]));
          }
        }
        const int64_t cb0 = p0 / block_k;
        for (int64_t j = 0; j < nb; ++j) {
          int32_t m = amax[j];
          for (size_t i = 0; i < sizeof(KeyV) / sizeof(amax_v[j][0]); ++i) m = std::max<int32_t>(m, amax_v[j][i]);
          const float scale = Fp8BlockScale(Src::KeyToFloat(m), format);
          inv[j] = scale;  // divided by, as torch's (w.float() / scale).to(float8_e4m3fn)
          scale_inv[rb * scale_stride + cb0 + j] = scale;
        }
        for (int64_t r = r0; r < r1; ++r) {
          const T* row = src + r * src_stride;
          uint8_t* out = dst + r * dst_stride;
          for (int64_t j = 0; j < nb; ++j) {
            const int64_t c0 = p0 + j * block_k;
            const int64_t c1 = std::min(p1, c0 + block_k);
            const int64_t v1 = c1 - (c1 - c0) % kStep;
            const float s = inv[j];
            for (int64_t c = c0; c < v1; c += kStep) {
              U32v a, b;
              Src::Load(row + c, &a, &b);
              const U8Half q = Pack<Src::kInterleaved>(Codes(a, s), Codes(b, s));
              std::memcpy(out + c, &q, sizeof(q));
            }
            for (int64_t c = v1; c < c1; ++c) out[c] = QuantizeOne(Src::Load(row[c]), s);
          }
        }
      }
    }
  }
};

struct Args {
  const uint8_t* src;
  int64_t rows, cols, src_stride, block_n, block_k;
  uint8_t* dst;
  int64_t dst_stride;
  float* scale_inv;
  int64_t scale_stride;
  Fp8ScaleFormat format;
};

template <int N>
WSYNC_FP8_INLINE void Run(DType dtype, const Args& a) {
  using K = Kernel<N>;
  switch (dtype) {
    case DType::kBF16:
      K::template Quantize<typename K::Bf16Src>(reinterpret_cast<const uint16_t*>(a.src), a.rows, a.cols, a.src_stride,
                                                a.block_n, a.block_k, a.dst, a.dst_stride, a.scale_inv, a.scale_stride, a.format);
      break;
    case DType::kF16:
      K::template Quantize<typename K::F16Src>(reinterpret_cast<const uint16_t*>(a.src), a.rows, a.cols, a.src_stride,
                                               a.block_n, a.block_k, a.dst, a.dst_stride, a.scale_inv, a.scale_stride, a.format);
      break;
    default:
      K::template Quantize<typename K::F32Src>(reinterpret_cast<const uint32_t*>(a.src), a.rows, a.cols, a.src_stride,
                                               a.block_n, a.block_k, a.dst, a.dst_stride, a.scale_inv, a.scale_stride, a.format);
      break;
  }
}

// One build per ISA level; the widest the CPU has is picked once (not per element, not per block).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target("arch=x86-64-v4"))) void RunAvx512(DType dtype, const Args& a) { Run<16>(dtype, a); }
__attribute__((target("arch=x86-64-v3"))) void RunAvx2(DType dtype, const Args& a) { Run<8>(dtype, a); }
void RunBaseline(DType dtype, const Args& a) { Run<8>(dtype, a); }

using RunFn = void (*)(DType, const Args&);
RunFn PickRun() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq")) {
    return &RunAvx512;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2")) {
    return &RunAvx2;
  }
  return &RunBaseline;
}

void Dispatch(DType dtype, const Args& a) {
  static const RunFn run = PickRun();
  run(dtype, a);
}
#else
void Dispatch(DType dtype, const Args& a) { Run<8>(dtype, a); }
#endif

}  // namespace

absl::Status QuantizeFp8Block(DType src_dtype, const uint8_t* src, int64_t rows, int64_t cols, int64_t src_stride,
                              int block_n, int block_k, uint8_t* dst, int64_t dst_stride, float* scale_inv,
                              int64_t scale_stride, Fp8ScaleFormat format) {
  if (src_dtype != DType::kBF16 && src_dtype != DType::kF16 && src_dtype != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat("fp8 quantization source must be bfloat16, float16 or float32, got ", DTypeName(src_dtype)));
  }
  if (block_n <= 0 || block_k <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("fp8 block size must be positive, got ", block_n, "x", block_k));
  }
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(absl::StrCat("fp8 quantization of a negative shape [", rows, ", ", cols, "]"));
  }
  if (rows == 0 || cols == 0) return absl::OkStatus();
  const int64_t scale_cols = (cols + block_k - 1) / block_k;
  if (src_stride < cols || dst_stride < cols || scale_stride < scale_cols) {
    return absl::InvalidArgumentError(absl::StrCat("fp8 quantization strides too small: src ", src_stride, ", dst ",
                                                   dst_stride, ", scale ", scale_stride, " for [", rows, ", ", cols,
                                                   "] with block ", block_n, "x", block_k));
  }
  if (src == nullptr || dst == nullptr || scale_inv == nullptr) {
    return absl::InvalidArgumentError("fp8 quantization given a null buffer");
  }
  Dispatch(src_dtype,
           Args{src, rows, cols, src_stride, block_n, block_k, dst, dst_stride, scale_inv, scale_stride, format});
  return absl::OkStatus();
}

}  // namespace wsync::replica
