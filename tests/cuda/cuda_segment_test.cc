// `cuda` segments of the target, two processes: a PyTorch engine rank (tests/cuda/cuda_engine.py) holds its
// parameters in CUDA memory and attaches them with legacy IPC handles; an in-process TargetNode imports them once
// and a source (a second tcp transport here) writes every parameter over tcp — through the target's pinned staging
// chunks and asynchronous host-to-device copies — then PostProcess sends the rank its commit, and the engine checks
// both segments on the GPU against its own numpy expectation (parameters bit-exact, the gaps between them still
// zero). Two versions, the second after the first, so stale bytes would show. Then the handles of an engine
// process that has exited are refused naming the engine rank and segment. The target's status names each cuda
// segment's write path. Last, the device half of the verbs paths (host mirror settle, dma-buf export; CheckNicPaths).
// Exit 0 pass, 1 fail, 77 no GPU / no python3 with CUDA torch.
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "base/fd_passing.h"
#include "daemon/node/target_node.h"
#include "daemon/node/target_node_cuda.h"
#include "tests/cuda/cuda_check.h"
#include "transport/transport.h"

extern char** environ;

using namespace wsync;
using Json = nlohmann::json;

namespace {

int failures = 0;
#define CHECK(cond, ...)                  \
  do {                                    \
    if (!(cond)) {                        \
      ++failures;                         \
      std::printf("FAIL: " __VA_ARGS__);  \
      std::printf("\n");                  \
    }                                     \
  } while (0)

uint64_t SplitMix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The bytes cuda_engine.py expects for parameter `index` at `version` (its numpy code is the other implementation).
void Fill(uint8_t* out, uint64_t bytes, int64_t version, int index) {
  const uint64_t seed = SplitMix(static_cast<uint64_t>(version * 1000003 + index));
  for (uint64_t k = 0; k * 8 < bytes; ++k) {
    const uint64_t w = SplitMix(seed + k);
    std::memcpy(out + k * 8, &w, std::min<uint64_t>(8, bytes - k * 8));
  }
}

pid_t Spawn(const std::vector<std::string>& argv) {
  std::vector<char*> a;
  for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawnp(&pid, a[0], nullptr, nullptr, a.data(), environ) != 0) return -1;
  return pid;
}

class EngineAdapterForTest final : public daemon::EngineAdapter {
 public:
  EngineAdapterForTest(std::string id, std::function<absl::Status(const daemon::AttachInfo&)> attach)
      : id_(std::move(id)), attach_(std::move(attach)) {}
  const std::string& kind() const override { return kind_; }
  const std::string& address() const override { return address_; }
  absl::StatusOr<daemon::EngineDescription> Describe() override {
    return daemon::EngineDescription{id_, "fake", 1, "0", false};
  }
  absl::Status RequestAttach(const daemon::AttachInfo& info) override { return attach_(info); }
  absl::Status Pause(const std::string&) override { return absl::OkStatus(); }
  absl::Status PostProcess(const std::string&) override { return absl::OkStatus(); }
  absl::Status SetWeightVersion(const std::string&) override { return absl::OkStatus(); }
  absl::Status Continue() override { return absl::OkStatus(); }

 private:
  std::string id_, kind_ = "fake", address_ = "fake+test://cuda-engine:1";
  std::function<absl::Status(const daemon::AttachInfo&)> attach_;
};

std::vector<Json> ReadResults(const std::string& path) {
  std::vector<Json> out;
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line))
    if (!line.empty()) out.push_back(Json::parse(line));
  return out;
}

// The device half of the verbs paths into cuda memory, which the H200 (no RDMA device) can still run: the host
// mirror a NIC writes without GPUDirect starts as the device's bytes and lands on the device when settled, leaving
// bytes no write touched as they were; and whether the driver exports the memory as a dma-buf (GPUDirect's
// prerequisite) is reported, with the reason when it does not.
void CheckNicPaths() {
  constexpr uint64_t kBytes = (64ull << 20) + 4096 + 123;  // not page-sized: the export rounds to pages
  uint8_t* dev = nullptr;
  if (cudaMalloc(&dev, kBytes + 8192) != cudaSuccess) {
    CHECK(false, "cudaMalloc for the mirror check");
    return;
  }
  uint8_t* seg = dev + 777;  // a segment that starts inside an allocation, off page alignment
  std::vector<uint8_t> before(kBytes), after(kBytes);
  Fill(before.data(), kBytes, 7, 0);
  cudaMemcpy(seg, before.data(), kBytes, cudaMemcpyHostToDevice);
  auto sink = daemon::MakeCudaSink(seg, kBytes, 0, "mirror check on cuda:0");
  CHECK(sink.ok(), "staging sink: %s", sink.status().ToString().c_str());
  if (!sink.ok()) return;
  auto mirror = (*sink)->HostMirror();
  CHECK(mirror.ok(), "host mirror: %s", mirror.status().ToString().c_str());
  if (mirror.ok()) {
    CHECK(std::memcmp(*mirror, before.data(), kBytes) == 0, "the host mirror starts as the device's bytes");
    // A "NIC" writes two ranges into the mirror; the device must not change before the settle, and after it must
    // hold exactly them with every other byte as before.
    std::vector<uint8_t> expect = before;
    Fill(expect.data() + 100, 1 << 20, 8, 1);
    Fill(expect.data() + kBytes - 5000, 5000, 8, 2);
    std::memcpy(*mirror + 100, expect.data() + 100, 1 << 20);
    std::memcpy(*mirror + kBytes - 5000, expect.data() + kBytes - 5000, 5000);
    cudaMemcpy(after.data(), seg, kBytes, cudaMemcpyDeviceToHost);
    CHECK(std::memcmp(after.data(), before.data(), kBytes) == 0, "the device is untouched until the settle");
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status c = (*sink)->CopyMirror();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(c.ok(), "copy of the mirror: %s", c.ToString().c_str());
    cudaMemcpy(after.data(), seg, kBytes, cudaMemcpyDeviceToHost);
    CHECK(std::memcmp(after.data(), expect.data(), kBytes) == 0, "after the settle the device holds the mirror");
    std::printf("host mirror: %.1f MiB settled to the device in %.4f s (%.2f GB/s)\n", kBytes / 1048576.0, s,
                kBytes / s / 1e9);
  }
  auto buf = (*sink)->ExportDmabuf();
  if (buf.ok()) {
    CHECK(buf->fd >= 0 && buf->iova == reinterpret_cast<uint64_t>(seg) && buf->offset == reinterpret_cast<uint64_t>(seg) % 4096,
          "dma-buf export: fd %d, offset %llu, iova matches the segment", buf->fd,
          static_cast<unsigned long long>(buf->offset));
    std::printf("GPUDirect prerequisite: the driver exports the segment as a dma-buf (fd %d, offset %llu)\n",
                buf->fd, static_cast<unsigned long long>(buf->offset));
    close(buf->fd);
  } else {
    CHECK(buf.status().code() == absl::StatusCode::kFailedPrecondition && !buf.status().message().empty(),
          "a refused dma-buf export says why: %s", buf.status().ToString().c_str());
    std::printf("GPUDirect prerequisite missing here (verbs would use the host mirror): %s\n",
                std::string(buf.status().message()).c_str());
  }
  sink->reset();
  cudaFree(dev);
}

}  // namespace

int main(int argc, char** argv) {
  RequireCudaDevice("cuda_segment_test");
  const std::string script = argc > 1 ? argv[1] : "tests/cuda/cuda_engine.py";
  const std::string python = getenv("WSYNC_TEST_PYTHON") ? getenv("WSYNC_TEST_PYTHON") : "python3";
  if (std::system((python + " -c 'import torch, numpy, sys; sys.exit(0 if torch.cuda.is_available() else 1)' "
                   ">/dev/null 2>&1").c_str()) != 0) {
    std::printf("cuda_segment_test: skipped: %s has no CUDA-enabled torch (or numpy) for the engine process\n",
                python.c_str());
    return 77;
  }
  char tmpl[] = "/tmp/wsync-cuda-seg.XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string result = dir + "/result.jsonl";

  auto target_tr = transport::CreateTransport("tcp", {});
  auto source_tr = transport::CreateTransport("tcp", {});
  if (!target_tr.ok() || !source_tr.ok()) {
    std::printf("FAIL: tcp transports\n");
    return 1;
  }
  daemon::TargetOptions o;
  o.node_id = "cuda-target";
  o.engine_socket = dir + "/engines.sock";
  o.attach_timeout = absl::Seconds(60);
  o.facade_host = "";
  auto node = std::make_unique<daemon::TargetNode>(o, target_tr->get());
  if (!node->Start().ok()) {
    std::printf("FAIL: target start\n");
    return 1;
  }

  pid_t engine = -1;
  const auto t_attach = std::chrono::steady_clock::now();
  absl::Status added = node->AddEngine(std::make_unique<EngineAdapterForTest>(
      "cudaeng", [&](const daemon::AttachInfo& info) -> absl::Status {
        engine = Spawn({python, script, "--socket", info.socket_path, "--engine-id", info.engine_id, "--token",
                        info.token, "--result", result});
        return engine > 0 ? absl::OkStatus() : absl::InternalError("cannot start the engine process");
      }));
  CHECK(added.ok(), "the engine attaches its cuda segments: %s", std::string(added.message()).c_str());
  if (!added.ok()) return 1;
  std::printf("engine attached in %.2f s (process start, CUDA init, IPC export and import)\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t_attach).count());

  auto regs = node->Registrations();
  CHECK(regs.size() == 1 && regs[0].ranks_size() == 1, "one engine, one rank registered");
  const v1::RankLayout& layout = regs[0].ranks(0);
  CHECK(layout.segments_size() == 2 && layout.segments(0).kind() == "cuda" && layout.segments(1).kind() == "cuda",
        "two cuda segments");

  // The target says how writes reach each cuda segment: over tcp, through its staging chunks (never GPUDirect).
  {
    const v1::NodeStatus st = node->Status();
    CHECK(st.cuda_segments_size() == 2 && !st.gpu_direct(), "two cuda segments in the status, not GPUDirect");
    for (const auto& p : st.cuda_segments()) {
      CHECK(p.find("engine cudaeng rank 0 segment ") == 0 && p.find(": staging (tcp)") != std::string::npos,
            "status of a cuda segment names it and its path: %s", p.c_str());
      std::printf("status: %s\n", p.c_str());
    }
  }

  // The source: all parameters of a version in one host buffer, written with one batch per version.
  uint64_t total = 0;
  for (const auto& p : layout.params()) total += p.bytes();
  std::vector<uint8_t> src(total);
  auto local = (*source_tr)->RegisterMemory(src.data(), src.size());
  std::vector<std::unique_ptr<transport::RemoteRegion>> remote;
  std::map<int, const transport::RemoteRegion*> by_id;
  for (const auto& s : layout.segments()) {
    auto r = (*source_tr)->ImportRegion(s.region_descriptor());
    CHECK(r.ok(), "import segment %d", s.id());
    if (!r.ok()) return 1;
    by_id[s.id()] = r->get();
    remote.push_back(*std::move(r));
  }
  auto ep = (*source_tr)->CreateEndpoint();
  v1::ConnectTargetRequest creq;
  creq.set_engine_id("cudaeng");
  creq.set_rank(0);
  creq.set_source_endpoint_info((*ep)->LocalInfo());
  auto cinfo = node->ConnectTarget(creq);
  CHECK(cinfo.ok(), "connect target");
  if (!cinfo.ok() || !(*ep)->Connect(cinfo->target_endpoint_info(), absl::Seconds(10)).ok()) return 1;

  // The coordinator opens the write window while an update is open; this test plays the coordinator.
  v1::SetWriteWindowRequest open_window;
  open_window.set_open(true);
  open_window.set_version(1);
  node->SetWriteWindow(open_window);
  for (int64_t version = 1; version <= 2; ++version) {
    std::vector<transport::WriteRequest> writes;
    uint64_t off = 0;
    for (int i = 0; i < layout.params_size(); ++i) {
      const auto& p = layout.params(i);
      Fill(src.data() + off, p.bytes(), version, i);
      writes.push_back({local->get(), off, by_id[p.segment()], p.offset(), p.bytes()});
      off += p.bytes();
    }
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status w = (*ep)->Write(writes, absl::Seconds(60));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(w.ok(), "version %lld written: %s", static_cast<long long>(version), std::string(w.message()).c_str());
    std::printf("version %lld: %.1f MiB over tcp into cuda segments in %.3f s (%.2f GB/s, acknowledged after the "
                "H2D copies)\n", static_cast<long long>(version), total / 1048576.0, s, total / s / 1e9);
    absl::Status pp = node->PostProcess("cudaeng", std::to_string(version));
    CHECK(pp.ok(), "post-process %lld: %s", static_cast<long long>(version), std::string(pp.message()).c_str());
    std::vector<Json> res;
    for (int i = 0; i < 600 && res.size() < static_cast<size_t>(version); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      res = ReadResults(result);
    }
    CHECK(res.size() == static_cast<size_t>(version), "the engine reported version %lld",
          static_cast<long long>(version));
    if (res.size() == static_cast<size_t>(version)) {
      const Json& r = res.back();
      CHECK(r["version"] == version && r["ok"] == true, "engine check of version %lld: %s",
            static_cast<long long>(version), r.dump().c_str());
      std::printf("engine: %s\n", r.dump().c_str());
    }
  }

  // The handles of a process that has exited: refused at attach, naming engine rank and segment.
  const std::string handoff = dir + "/handoff.json";
  Json refused;
  absl::Status dead = node->AddEngine(std::make_unique<EngineAdapterForTest>(
      "deadeng", [&](const daemon::AttachInfo& info) -> absl::Status {
        pid_t p = Spawn({python, script, "--socket", info.socket_path, "--engine-id", info.engine_id, "--token",
                         info.token, "--result", result, "--handoff", handoff});
        int st = 0;
        waitpid(p, &st, 0);
        std::ifstream f(handoff);
        std::stringstream ss;
        ss << f.rdbuf();
        ScopedFd sock(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        std::strncpy(addr.sun_path, info.socket_path.c_str(), sizeof(addr.sun_path) - 1);
        if (connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
          return absl::InternalError("connect");
        if (!SendFds(sock.get(), {}, ss.str()).ok()) return absl::InternalError("send");
        timeval tv{30, 0};
        setsockopt(sock.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        auto r = ReceiveFds(sock.get(), 1 << 20);
        if (r.ok()) refused = Json::parse(r->message);
        return absl::FailedPreconditionError("the engine process is gone");
      }));
  const std::string err = refused.value("error", "");
  CHECK(!dead.ok() && refused.value("ok", true) == false && err.find("deadeng rank 0 segment") != std::string::npos,
        "the handles of an exited process are refused naming the rank and segment: %s", refused.dump().c_str());
  std::printf("dead engine: %s\n", err.c_str());

  CheckNicPaths();

  node.reset();
  if (engine > 0) {
    kill(engine, SIGTERM);
    waitpid(engine, nullptr, 0);
  }
  std::system(("rm -rf " + dir).c_str());
  std::printf("cuda_segment_test: %s\n", failures == 0 ? "pass" : "FAIL");
  return failures == 0 ? 0 : 1;
}
