#pragma once
// The hybrid Mamba-3 / attention language model of shared/spec/model.md on the
// CPU, templated on the scalar type (double for the gradient checks, float for
// training). Activation memory is planned once per (batch, seqlen) by plan().
#include <cstdint>
#include <memory>
#include <vector>

#include "base/rng.h"
#include "runtime/config/model_config.h"
#include "runtime/layers/attention_mixer.h"
#include "runtime/layers/mamba3_mixer.h"
#include "runtime/layers/mlp.h"
#include "runtime/parameters/parameter_set.h"

namespace megacpp {

struct ModelOptions {
  ScanForm scan_form = ScanForm::kChunked;
};

template <typename T>
class Model {
 public:
  explicit Model(const ModelConfig& config, ModelOptions options = {});
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  ParameterSet<T>& parameters() { return params_; }
  const ParameterSet<T>& parameters() const { return params_; }

  // Initializes every parameter as the spec prescribes, from `seed`.
  void init_parameters(uint64_t seed);
  // Allocates the activations for micro-batches of [batch, seqlen] tokens.
  void plan(int batch, int seqlen);
  int planned_batch() const { return batch_; }
  int planned_seqlen() const { return seqlen_; }

  // tokens is [batch, seqlen + 1]: inputs are tokens[:, :-1], targets tokens[:, 1:]
  // (a target < 0 is ignored). Returns the mean cross entropy. forward_backward
  // accumulates grad_scale · dloss/dθ into parameters().grads().
  double forward(const int32_t* tokens);
  double forward_backward(const int32_t* tokens, double grad_scale);

  // Model FLOPs of one forward+backward over [batch, seqlen] tokens: 6 per
  // weight per token for every matrix product with a weight (lm_head included,
  // the embedding lookup not), plus 3× the forward FLOPs of attention's score
  // and value products and of the chunked scan's products.
  double step_flops(int batch, int seqlen) const;

 private:
  struct Block;
  const T* lm_head_weight() const;
  T* lm_head_grad();
  double run_forward(const int32_t* tokens);

  ModelConfig config_;
  ModelOptions options_;
  ParameterSet<T> params_;
  int embedding_ = -1, norm_f_ = -1, lm_head_ = -1;
  std::vector<std::unique_ptr<Block>> blocks_;
  int batch_ = 0, seqlen_ = 0;
  // Norm sites: one before every mixer, one before every MLP, and norm_f last.
  // residual_[k] is the residual stream entering site k, normed_[k] its output.
  std::vector<std::vector<T>> residual_, normed_, rstd_;
  std::vector<int> site_weight_;
  std::vector<int32_t> inputs_, targets_;
  std::vector<T> delta_, dresidual_, dresidual_next_, dnormed_, logits_, dlogits_;
};

extern template class Model<float>;
extern template class Model<double>;

}  // namespace megacpp
