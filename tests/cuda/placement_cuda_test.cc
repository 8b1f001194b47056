// Zero-copy placement from CUDA memory (the path TrainerClient::PushDevice takes when the node offers a placement):
// the replica's layout buffers are mapped through their memfds as a trainer process maps them, page-locked once
// (DeviceCopier::RegisterDestination), and every tensor the replica may take unconverted is copied from device memory
// straight into its regions with cudaMemcpy2DAsync (Replica::PlaceRects: fused q/k/v and gate/up slots, row and
// column shards at TP 2, whole experts, vocabulary shards), then committed (ClaimPlaced + MarkPlaced) once the copies
// drained. The expectation is independent of the GPU: a second replica loads the same host bytes with Load. With an
// FP8 replica the weights are quantized on the GPU and their codes and scales placed from the quantizer's scratch;
// the expectation is the CPU quantizer's. Exit 0 pass, 1 fail, 77 no CUDA device.
#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "client/device_copy.h"
#include "client/ring/ring.h"
#include "replica/convert.h"
#include "replica/replica.h"
#include "tests/cuda/cuda_check.h"
#include "tests/replica/test_models.h"

using namespace wsync;
using namespace wsync::replica;

namespace {

int failures = 0;
#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) {                       \
      ++failures;                        \
      std::printf("FAIL: " __VA_ARGS__); \
      std::printf("\n");                 \
    }                                    \
  } while (0)

#define MUST(expr)                                                                \
  do {                                                                            \
    const absl::Status must_ = (expr);                                            \
    if (!must_.ok()) {                                                            \
      std::printf("FAIL: %s: %s\n", #expr, std::string(must_.message()).c_str()); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

std::vector<uint8_t> RandomBytes(const TensorSpec& s, uint32_t seed) {
  std::vector<uint8_t> out(s.bytes());
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  const uint64_t n = s.bytes() / DTypeSize(s.dtype);
  for (uint64_t i = 0; i < n; ++i) {
    const float f = u(rng);
    if (s.dtype == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &f, 4);
    } else {
      const uint16_t b = F32ToBf16(f);
      std::memcpy(out.data() + 2 * i, &b, 2);
    }
  }
  return out;
}

std::vector<std::vector<uint8_t>> Snapshot(Replica& r) {
  std::vector<std::vector<uint8_t>> s;
  for (int l = 0; l < r.num_layouts(); ++l) s.emplace_back(r.data(l), r.data(l) + r.table(l).total_bytes());
  return s;
}

void Run(client::DeviceCopier& copier, const ModelConfig& c, const char* mode, bool fp8) {
  QuantSpec q;
  if (fp8) {
    q.mode = QuantSpec::Mode::kFp8Block;
    q.block_n = q.block_k = 2;
  }
  const std::vector<RankParallelism> ranks = {RankParallelism::ForTp(2, 0), RankParallelism::ForTp(2, 1)};
  auto loaded = Replica::Create(c, ranks, q);
  auto placed = Replica::Create(c, ranks, q);
  MUST(loaded.status());
  MUST(placed.status());
  std::vector<std::pair<uint8_t*, uint64_t>> maps;
  for (int l = 0; l < (*placed)->num_layouts(); ++l) {
    void* a = mmap(nullptr, (*placed)->mapped_bytes(l), PROT_READ | PROT_WRITE, MAP_SHARED, (*placed)->fd(l), 0);
    CHECK(a != MAP_FAILED, "mapping layout %d", l);
    if (a == MAP_FAILED) return;
    maps.push_back({static_cast<uint8_t*>(a), (*placed)->mapped_bytes(l)});
    MUST(copier.RegisterDestination(a, (*placed)->mapped_bytes(l), "replica layout " + std::to_string(l)));
  }
  auto list = CheckpointTensors(c);
  MUST(list.status());
  cudaStream_t producer;
  WSYNC_CUDA_CHECK(cudaStreamCreate(&producer), "producer stream");
  for (int round = 0; round < 2; ++round) {
    (*loaded)->BeginUpdate();
    (*placed)->BeginUpdate();
    std::vector<void*> device;
    std::vector<std::pair<std::string, std::pair<DType, std::vector<int64_t>>>> pending;
    uint32_t seed = 100 + 1000 * round;
    auto place = [&](const std::string& name, DType dtype, const std::vector<int64_t>& shape, const void* src,
                     bool staged) -> bool {
      auto rects = (*placed)->PlaceRects(name, dtype);
      if (!rects.ok() || rects->empty()) return false;
      for (const PlacedRect& r : *rects)
        MUST(copier.Copy2DAsync(name, maps[r.layout].first + r.offset, r.pitch,
                                static_cast<const uint8_t*>(src) + r.src_offset, r.src_pitch, r.row_bytes, r.rows, 0,
                                reinterpret_cast<uint64_t>(producer), staged));
      pending.push_back({name, {dtype, shape}});
      return true;
    };
    for (const TensorSpec& s : *list) {
      const std::vector<uint8_t> host = RandomBytes(s, seed++);
      HfTensor t{s.name, s.dtype, s.shape, host.data(), host.size()};
      MUST((*loaded)->Ingest(t).status());
      void* dev = nullptr;
      WSYNC_CUDA_CHECK(cudaMalloc(&dev, std::max<uint64_t>(host.size(), 1)), s.name);
      WSYNC_CUDA_CHECK(cudaMemcpy(dev, host.data(), host.size(), cudaMemcpyHostToDevice), s.name);
      device.push_back(dev);
      const DType stored = (*placed)->PlaceableDType(s.name);
      bool done = false;
      if (stored == s.dtype) {
        done = place(s.name, s.dtype, s.shape, dev, false);
      } else if (fp8 && stored == DType::kF8E4M3 && s.shape.size() == 2) {
        client::DeviceCopier::Fp8Staged st;
        MUST(copier.QuantizeFp8Async(s.name, s.dtype, dev, s.shape[0], s.shape[1], 2, 2, false, 0,
                                     reinterpret_cast<uint64_t>(producer), &st));
        const std::vector<int64_t> sshape = {(s.shape[0] + 1) / 2, (s.shape[1] + 1) / 2};
        done = place(s.name, DType::kF8E4M3, s.shape, st.codes, true);
        CHECK(done, "%s: fp8 codes not placeable", s.name.c_str());
        CHECK(place(s.name + "_scale_inv", DType::kF32, sshape, st.scales, true), "%s: scales not placeable",
              s.name.c_str());
        // The scratch is reused by the next quantization only after these copies (one stream), but the next
        // tensor's upload is synchronous: drain so the test's own order is simple.
        MUST(copier.Drain());
      }
      if (!done) MUST((*placed)->Ingest(t).status());
    }
    MUST(copier.Drain());  // every copy landed: now the commit
    for (const auto& [name, ds] : pending) {
      uint64_t bytes = DTypeSize(ds.first);
      for (int64_t d : ds.second) bytes *= static_cast<uint64_t>(d);
      HfTensor t{name, ds.first, ds.second, nullptr, bytes};
      MUST((*placed)->ClaimPlaced({t}));
      MUST((*placed)->MarkPlaced(t).status());
    }
    CHECK(pending.size() > list->size() / 2, "%s: only %zu of %zu tensors placed", mode, pending.size(), list->size());
    CHECK((*loaded)->FinishUpdate().ok(), "%s: reference incomplete", mode);
    const absl::Status fin = (*placed)->FinishUpdate();
    CHECK(fin.ok(), "%s: placed replica incomplete: %s", mode, std::string(fin.message()).c_str());
    const auto want = Snapshot(**loaded), got = Snapshot(**placed);
    for (size_t l = 0; l < want.size(); ++l) {
      size_t diff = 0;
      for (size_t i = 0; i < want[l].size(); ++i) diff += want[l][i] != got[l][i];
      CHECK(diff == 0, "%s round %d layout %zu: %zu bytes differ from Load's", mode, round, l, diff);
    }
    std::printf("%s, round %d: %zu of %zu tensors placed from device memory, bit-exact\n", mode, round, pending.size(),
                list->size());
    for (void* d : device) cudaFree(d);
  }
  MUST(copier.Drain());
  for (auto& [a, n] : maps) {
    copier.UnregisterDestination(a);
    munmap(a, n);
  }
  cudaStreamDestroy(producer);
}

}  // namespace

int main() {
  RequireCudaDevice("placement_cuda_test");
  auto consumer = RingConsumer::Create("placement-cuda-test", 8 << 20);
  MUST(consumer.status());
  auto producer = RingProducer::Attach(consumer->fd());
  MUST(producer.status());
  auto copier = client::DeviceCopier::Create(producer->data_area(), producer->capacity(), producer->name());
  MUST(copier.status());
  Run(**copier, replica::testing::TinyQwen3(), "qwen3 bf16 (fused qkv and gate_up)", false);
  Run(**copier, replica::testing::TinyDeepseek(), "deepseek-v3 bf16 (MLA, experts)", false);
  Run(**copier, replica::testing::TinyDeepseek(), "deepseek-v3 fp8 (GPU-quantized codes and scales)", true);
  // A destination outside every registered mapping is refused before anything is queued.
  uint8_t stray[64];
  void* dev = nullptr;
  WSYNC_CUDA_CHECK(cudaMalloc(&dev, 64), "stray");
  CHECK(!(*copier)->Copy2DAsync("stray", stray, 64, dev, 64, 64, 1, 0, 0, false).ok(),
        "a copy into unregistered memory was accepted");
  cudaFree(dev);
  std::printf("%s\n", failures == 0 ? "PASS" : "FAILED");
  return failures == 0 ? 0 : 1;
}
