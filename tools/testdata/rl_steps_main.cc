// wsync-rl-steps: runs the RL step model (rl_steps.h) over a model config and prints, per tensor kind, the fraction
// of trainer-dtype elements that changed from one step to the next; with --fp8 also the code-level sparsity of the
// engines' 128×128 block FP8 quantization; with --out writes each step as a safetensors file.

#include <cstdio>
#include <cstring>
#include <map>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "base/dtype.h"
#include "tools/testdata/rl_steps.h"

using namespace wsync;

namespace {

struct KindCount {
  uint64_t elems = 0, changed = 0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"RL-like consecutive training steps: changed-element fractions per tensor kind"};
  std::string config;
  int steps = 3;
  int64_t layers = 0, vocab = 0;
  bool fp8 = false;
  std::string out_dir;
  tools::RlStepOptions opt;
  app.add_option("--config", config, "HF config.json of the model")->required();
  app.add_option("--steps", steps, "steps after the initial weights")->check(CLI::PositiveNumber);
  app.add_option("--lr", opt.lr, "learning rate (default 1e-6)");
  app.add_option("--signal", opt.signal, "gradient mean / std per element (default 0.3)");
  app.add_option("--weight-decay", opt.weight_decay, "decoupled weight decay (default 0)");
  app.add_option("--seed", opt.seed, "seed (default 1)");
  app.add_option("--layers", layers, "keep only the first N decoder layers (0: all)");
  app.add_option("--vocab", vocab, "cut the vocabulary to N rows (0: all)");
  app.add_flag("--fp8", fp8, "also measure 128x128 block FP8 quantization of the linear weights");
  app.add_option("--out", out_dir, "write step_NNNNNN.safetensors files (step 0 = the initial weights) here");
  CLI11_PARSE(app, argc, argv);

  auto model = tools::RlStepModel::Create(config, opt, layers, vocab);
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  tools::RlStepModel& m = **model;
  std::vector<bool> quantized(m.tensors().size(), false);
  if (fp8) {
    auto q = tools::Fp8Quantized(m.config(), m.tensors());
    if (!q.ok()) {
      std::fprintf(stderr, "%s\n", q.status().ToString().c_str());
      return 1;
    }
    quantized = *q;
  }
  auto write = [&]() {
    if (out_dir.empty()) return true;
    const std::string path = absl::StrFormat("%s/step_%06d.safetensors", out_dir, m.step());
    const absl::Status s = tools::WriteSafetensors(path, m);
    if (!s.ok()) std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return s.ok();
  };
  std::printf("model %s: %zu tensors, %.1f M elements, lr %g, signal %g\n", config.c_str(), m.tensors().size(),
              m.num_elements() / 1e6, opt.lr, opt.signal);
  if (!write()) return 1;

  std::vector<std::vector<uint8_t>> prev(m.tensors().size());
  std::vector<tools::Fp8Tensor> prev_q(m.tensors().size()), cur_q(m.tensors().size());
  auto quantize = [&](size_t i, tools::Fp8Tensor* q) {
    const auto& t = m.tensors()[i];
    return tools::QuantizeBf16Fp8(m.bytes(i).data(), t.shape[0], t.shape[1], 128, q);
  };
  for (size_t i = 0; i < m.tensors().size(); ++i) {
    prev[i] = m.bytes(i);
    if (quantized[i] && !quantize(i, &prev_q[i]).ok()) return 1;
  }
  std::map<std::string, KindCount> total;
  tools::Fp8Change fp8_total;
  for (int s = 1; s <= steps; ++s) {
    m.Step();
    if (!write()) return 1;
    std::map<std::string, KindCount> kinds;
    tools::Fp8Change fp8_step;
    for (size_t i = 0; i < m.tensors().size(); ++i) {
      const auto& t = m.tensors()[i];
      const size_t es = DTypeSize(t.dtype);
      const std::vector<uint8_t>& cur = m.bytes(i);
      KindCount& k = kinds[tools::TensorKind(t.name)];
      for (size_t e = 0; e < cur.size() / es; ++e) {
        k.changed += std::memcmp(cur.data() + e * es, prev[i].data() + e * es, es) != 0;
      }
      k.elems += cur.size() / es;
      prev[i] = cur;
      if (quantized[i]) {
        if (!quantize(i, &cur_q[i]).ok()) return 1;
        fp8_step += tools::CompareFp8(prev_q[i], cur_q[i]);
        std::swap(prev_q[i], cur_q[i]);
      }
    }
    KindCount all;
    std::printf("step %d:", s);
    for (const auto& [kind, k] : kinds) {
      std::printf("  %s %.4f%%", kind.c_str(), 100.0 * k.changed / k.elems);
      all.elems += k.elems, all.changed += k.changed;
      total[kind].elems += k.elems, total[kind].changed += k.changed;
    }
    std::printf("  | all %.4f%%\n", 100.0 * all.changed / all.elems);
    if (fp8) {
      std::printf("  fp8: codes changed %.4f%%, blocks rescaled %.3f%%\n",
                  100.0 * fp8_step.codes_changed / fp8_step.codes, 100.0 * fp8_step.blocks_rescaled / fp8_step.blocks);
      fp8_total += fp8_step;
    }
  }
  std::printf("\n%-10s %14s %12s\n", "kind", "elements", "changed/step");
  KindCount all;
  for (const auto& [kind, k] : total) {
    std::printf("%-10s %14llu %11.4f%%\n", kind.c_str(), static_cast<unsigned long long>(k.elems / steps),
                100.0 * k.changed / k.elems);
    all.elems += k.elems, all.changed += k.changed;
  }
  std::printf("%-10s %14llu %11.4f%%\n", "all", static_cast<unsigned long long>(all.elems / steps),
              100.0 * all.changed / all.elems);
  if (fp8 && fp8_total.codes > 0) {
    const tools::Fp8Change& f = fp8_total;
    std::printf(
        "\nfp8 (128x128 blocks, %llu codes): codes changed %.4f%%; blocks rescaled %.3f%%;\n"
        "  in rescaled blocks %.2f%% of codes changed; in kept blocks %.4f%%\n",
        static_cast<unsigned long long>(f.codes / steps), 100.0 * f.codes_changed / f.codes,
        100.0 * f.blocks_rescaled / f.blocks,
        f.codes_in_rescaled ? 100.0 * f.codes_changed_in_rescaled / f.codes_in_rescaled : 0.0,
        f.codes_in_kept ? 100.0 * f.codes_changed_in_kept / f.codes_in_kept : 0.0);
  }
  return 0;
}
