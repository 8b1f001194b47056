#pragma once
// Shared fixtures for the replica tests: real configs from tests/data/models and tiny hand-sized configs.

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "replica/model_config.h"

namespace wsync::replica::testing {

inline std::string ModelPath(const std::string& model, const std::string& file) {
  return std::string(WSYNC_MODELS_DIR) + "/" + model + "/" + file;
}

inline ModelConfig LoadModel(const std::string& model) {
  auto c = ModelConfig::FromFile(ModelPath(model, "config.json"));
  if (!c.ok()) throw std::runtime_error(std::string(c.status().message()));
  return *c;
}

// Tensor names of a model's index.json (weight_map keys), empty when the model has none.
inline std::vector<std::string> IndexNames(const std::string& model) {
  std::ifstream in(ModelPath(model, "index.json"));
  std::vector<std::string> names;
  if (!in) return names;
  nlohmann::json j = nlohmann::json::parse(in);
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) names.push_back(it.key());
  return names;
}

inline const std::vector<std::string>& AllModels() {
  static const std::vector<std::string> kModels = {
      "Qwen__Qwen3-0.6B",        "Qwen__Qwen3-8B",          "Qwen__Qwen3-30B-A3B",
      "Qwen__Qwen3-235B-A22B",   "THUDM__GLM-Z1-9B-0414",   "deepseek-ai__DeepSeek-V3",
      "meta-llama__Llama-3.1-8B", "moonshotai__Kimi-K2-Instruct", "moonshotai__Moonlight-16B-A3B",
      "zai-org__GLM-4.5-Air",    "zai-org__GLM-4.7-Flash",
  };
  return kModels;
}

// 2-layer Qwen3: hidden 8, 4 heads, 2 KV heads, head_dim 2, intermediate 4, vocab 100.
inline ModelConfig TinyQwen3(bool tied = false) {
  std::string j = R"({"architectures":["Qwen3ForCausalLM"],"hidden_size":8,"num_hidden_layers":2,
    "num_attention_heads":4,"num_key_value_heads":2,"head_dim":2,"intermediate_size":4,"vocab_size":100,
    "torch_dtype":"bfloat16","tie_word_embeddings":)" + std::string(tied ? "true" : "false") + "}";
  return *ModelConfig::FromJson(j);
}

// 2-layer Qwen3-MoE: hidden 8, 4 heads, 2 KV heads, head_dim 2, 4 experts of intermediate 4.
inline ModelConfig TinyQwen3Moe() {
  return *ModelConfig::FromJson(R"({"architectures":["Qwen3MoeForCausalLM"],"hidden_size":8,"num_hidden_layers":2,
    "num_attention_heads":4,"num_key_value_heads":2,"head_dim":2,"intermediate_size":16,"moe_intermediate_size":4,
    "num_experts":4,"vocab_size":100,"torch_dtype":"bfloat16"})");
}

// 2-layer DeepSeek-V3 (layer 0 dense, layer 1 MoE) with q_lora, 1 shared expert, FP8-friendly dims for 2x2 blocks.
inline ModelConfig TinyDeepseek(bool q_lora = true) {
  std::string j = R"({"architectures":["DeepseekV3ForCausalLM"],"hidden_size":8,"num_hidden_layers":2,
    "num_attention_heads":4,"num_key_value_heads":4,"intermediate_size":8,"moe_intermediate_size":4,
    "n_routed_experts":4,"n_shared_experts":1,"first_k_dense_replace":1,"moe_layer_freq":1,
    "kv_lora_rank":4,"qk_nope_head_dim":2,"qk_rope_head_dim":2,"v_head_dim":2,"topk_method":"noaux_tc",
    "num_nextn_predict_layers":1,"vocab_size":100,"torch_dtype":"bfloat16","q_lora_rank":)" +
                  std::string(q_lora ? "4" : "null") + "}";
  return *ModelConfig::FromJson(j);
}

}  // namespace wsync::replica::testing
