// The memory estimate against what the real Model, AdamW and plan() allocate: every
// heap byte of this program goes through the counting operator new below, so the
// estimate is checked exactly (up to the few bookkeeping objects it leaves out), for
// both scan forms, tied and untied embeddings, with and without the MLP, and several
// attention thread counts.
#include "runtime/model/memory_estimate.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <cstdlib>
#include <new>

#include "base/zeroed_vector.h"
#include "runtime/model/model.h"
#include "runtime/optimizer/adamw.h"

namespace {

std::atomic<int64_t> g_live_bytes{0};

// A 16-byte header keeps the caller's block aligned as malloc's is and remembers its size.
constexpr std::size_t kHeader = 16;

void* counted_new(std::size_t size) {
  void* block = std::malloc(size + kHeader);
  if (block == nullptr) throw std::bad_alloc();
  *static_cast<std::size_t*>(block) = size;
  g_live_bytes += static_cast<int64_t>(size);
  return static_cast<char*>(block) + kHeader;
}

void counted_delete(void* pointer) noexcept {
  if (pointer == nullptr) return;
  void* block = static_cast<char*>(pointer) - kHeader;
  g_live_bytes -= static_cast<int64_t>(*static_cast<std::size_t*>(block));
  std::free(block);
}

}  // namespace

void* operator new(std::size_t size) {
  return counted_new(size);
}
void* operator new[](std::size_t size) {
  return counted_new(size);
}
void operator delete(void* pointer) noexcept {
  counted_delete(pointer);
}
void operator delete[](void* pointer) noexcept {
  counted_delete(pointer);
}
void operator delete(void* pointer, std::size_t) noexcept {
  counted_delete(pointer);
}
void operator delete[](void* pointer, std::size_t) noexcept {
  counted_delete(pointer);
}

namespace megacpp {
namespace {

// The unique_ptrs, scan runner objects and vector headers plan() creates beside the
// buffers it sizes: a few hundred bytes per layer.
constexpr int64_t kBookkeepingPerLayer = 1024;

struct Case {
  const char* name;
  nlohmann::json config;
  int batch, seqlen, threads;
  ScanForm form;
};

nlohmann::json base_config() {
  return {{"d_model", 32},
          {"pattern", "M*M"},
          {"d_intermediate", 40},
          {"vocab_size", 257},
          {"ssm_cfg", {{"d_state", 16}, {"headdim", 16}, {"mimo_rank", 2}, {"chunk_size", 8}}},
          {"attn_cfg", {{"num_heads", 4}, {"num_heads_kv", 2}, {"rotary_emb_dim", 8}}}};
}

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back({"chunked", base_config(), 2, 32, 1, ScanForm::kChunked});
  out.push_back({"recurrent", base_config(), 2, 32, 1, ScanForm::kRecurrent});
  out.push_back({"three threads", base_config(), 3, 20, 3, ScanForm::kChunked});
  auto untied = base_config();
  untied["tie_embeddings"] = false;
  untied["d_intermediate"] = 0;
  untied["ssm_cfg"]["ngroups"] = 2;
  untied["ssm_cfg"]["expand"] = 3;
  untied["ssm_cfg"]["rope_fraction"] = 1.0;
  out.push_back({"untied, no MLP, groups", untied, 1, 13, 2, ScanForm::kChunked});
  auto no_bias = base_config();
  no_bias["pattern"] = "*M**";
  no_bias["attn_cfg"]["qkv_proj_bias"] = false;
  no_bias["attn_cfg"]["out_proj_bias"] = false;
  no_bias["attn_cfg"]["head_dim"] = 12;
  no_bias["ssm_cfg"]["chunk_size"] = 64;  // longer than seqlen
  out.push_back({"no biases, long chunk", no_bias, 2, 70, 2, ScanForm::kChunked});
  auto mamba_only = base_config();
  mamba_only["pattern"] = "MM";
  mamba_only["attn_cfg"] = nlohmann::json::object();
  out.push_back({"mamba only", mamba_only, 2, 9, 1, ScanForm::kRecurrent});
  return out;
}

// Heap bytes through operator new plus the zero-page buffers (calloc) of ZeroedVector.
int64_t live_bytes() {
  return g_live_bytes.load() + zeroed_bytes_in_use();
}

TEST(MemoryEstimate, MatchesWhatTheModelAllocates) {
  const int saved_threads = omp_get_max_threads();
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const ModelConfig config = parse_model_config(c.config, c.name);
    TrainingShape shape;
    shape.batch = c.batch;
    shape.seqlen = c.seqlen;
    shape.threads = c.threads;
    shape.scan_form = c.form;
    const MemoryEstimate estimate = estimate_training_memory(config, shape);
    omp_set_num_threads(c.threads);

    const int64_t start = live_bytes();
    auto model = std::make_unique<Model<float>>(config, ModelOptions{c.form});
    const int64_t after_model = live_bytes();
    ASSERT_EQ(estimate.parameter_count, static_cast<uint64_t>(model->parameters().total()));
    EXPECT_EQ(count_parameters(config), estimate.parameter_count);
    // Weights and gradients, plus the names and shapes of the entries.
    const int64_t model_bytes = after_model - start;
    const auto weights_and_grads = static_cast<int64_t>(estimate.parameters + estimate.gradients);
    EXPECT_GE(model_bytes, weights_and_grads);
    EXPECT_LE(model_bytes - weights_and_grads, 64 << 10);

    auto optimizer = std::make_unique<AdamW<float>>(model->parameters(), OptimizerConfig{});
    EXPECT_EQ(live_bytes() - after_model - static_cast<int64_t>(sizeof(AdamW<float>)),
              static_cast<int64_t>(estimate.optimizer));

    const int64_t before_plan = live_bytes();
    model->plan(c.batch, c.seqlen);
    const int64_t planned = live_bytes() - before_plan;
    EXPECT_GE(planned, static_cast<int64_t>(estimate.activations));
    EXPECT_LE(planned - static_cast<int64_t>(estimate.activations),
              kBookkeepingPerLayer * config.n_layer)
        << "plan() allocated " << planned << " bytes, the estimate says " << estimate.activations;
    // Training steps allocate only per-call scratch, which the workspace bounds: after a
    // first step (which may start the thread pool and the BLAS), a step keeps nothing.
    std::vector<int32_t> tokens(static_cast<size_t>(c.batch) * (c.seqlen + 1), 5);
    model->init_parameters(3);
    model->forward_backward(tokens.data(), 1.0);
    const int64_t after_first_step = live_bytes();
    model->forward_backward(tokens.data(), 1.0);
    EXPECT_EQ(live_bytes(), after_first_step) << "a step kept memory";
    EXPECT_GT(estimate.workspace, 0u);
  }
  omp_set_num_threads(saved_threads);
}

TEST(MemoryEstimate, AbsurdSizesSaturateInsteadOfWrapping) {
  ModelConfig config = parse_model_config(base_config(), "test");
  config.d_model = ModelConfigLimits::kMaxDModel;
  TrainingShape shape;
  shape.batch = int64_t{1} << 16;
  shape.seqlen = int64_t{1} << 16;
  shape.threads = 1024;
  const MemoryEstimate huge = estimate_training_memory(config, shape);
  EXPECT_GT(huge.activations, uint64_t{1} << 50);
  EXPECT_GT(huge.total(), huge.activations);
  shape.batch = std::numeric_limits<int64_t>::max();
  shape.seqlen = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(estimate_training_memory(config, shape).total(), std::numeric_limits<uint64_t>::max());
  const std::string text = huge.describe();
  EXPECT_NE(text.find("activations"), std::string::npos) << text;
  EXPECT_NE(text.find("AdamW moments"), std::string::npos) << text;
}

TEST(MemoryEstimate, HostMemoryIsRead) {
  const HostMemory host = read_host_memory();
  EXPECT_GT(host.total, 0u);
  EXPECT_GT(host.available, 0u);
  EXPECT_LE(host.available, host.total);
}

}  // namespace
}  // namespace megacpp
