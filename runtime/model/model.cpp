#include "runtime/model/model.h"

#include <cstring>

#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rmsnorm.h"

namespace megacpp {

template <typename T>
struct Model<T>::Block {
  std::unique_ptr<Mamba3Mixer<T>> mamba;
  std::unique_ptr<AttentionMixer<T>> attention;
  std::unique_ptr<GatedMlp<T>> mlp;
  int norm = -1, norm2 = -1;
};

template <typename T>
Model<T>::Model(const ModelConfig& config, ModelOptions options)
    : config_(config), options_(options) {
  validate_model_config(config_, "model config");
  const int64_t dm = config_.d_model;
  embedding_ = params_.add("backbone.embedding.weight", {config_.padded_vocab(), dm}, true);
  for (int i = 0; i < config_.n_layer; ++i) {
    auto block = std::make_unique<Block>();
    const std::string p = "backbone.layers." + std::to_string(i) + ".";
    block->norm = params_.add(p + "norm.weight", {dm}, false);
    if (config_.is_attention_layer(i)) {
      block->attention = std::make_unique<AttentionMixer<T>>(config_, i, params_);
    } else {
      block->mamba = std::make_unique<Mamba3Mixer<T>>(config_, i, params_, options_.scan_form);
    }
    if (config_.d_intermediate > 0) {
      block->norm2 = params_.add(p + "norm2.weight", {dm}, false);
      block->mlp = std::make_unique<GatedMlp<T>>(config_, i, params_);
    }
    site_weight_.push_back(block->norm);
    if (block->mlp) site_weight_.push_back(block->norm2);
    blocks_.push_back(std::move(block));
  }
  norm_f_ = params_.add("backbone.norm_f.weight", {dm}, false);
  site_weight_.push_back(norm_f_);
  if (!config_.tie_embeddings) {
    lm_head_ = params_.add("lm_head.weight", {config_.padded_vocab(), dm}, true);
  }
  params_.finalize();
}

template <typename T>
Model<T>::~Model() = default;

template <typename T>
void Model<T>::init_parameters(uint64_t seed) {
  Rng rng(seed);
  // Every value the fills below do not write is 0 (parallel: a serial pass over a few
  // hundred million values is most of a GPU job's time to its first step).
  T* values = params_.values().data();
  const int64_t total = params_.total();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < total; ++i) values[i] = T(0);
  fill_normal(params_.value(embedding_), params_.info(embedding_).size, 0.02, rng);
  const double k = config_.d_intermediate > 0 ? 2.0 : 1.0;
  const double out_divisor = std::sqrt(k * config_.n_layer);
  for (auto& block : blocks_) {
    fill_constant(params_.value(block->norm), config_.d_model, 1.0);
    if (block->mamba) block->mamba->init(rng, out_divisor);
    if (block->attention) block->attention->init(rng, out_divisor);
    if (block->mlp) {
      fill_constant(params_.value(block->norm2), config_.d_model, 1.0);
      block->mlp->init(rng, out_divisor);
    }
  }
  fill_constant(params_.value(norm_f_), config_.d_model, 1.0);
  if (lm_head_ >= 0) {
    fill_uniform(params_.value(lm_head_), params_.info(lm_head_).size,
                 1.0 / std::sqrt(config_.d_model), rng);
  }
}

template <typename T>
void Model<T>::plan(int batch, int seqlen) {
  if (batch <= 0 || seqlen <= 0) {
    fail(ErrorKind::kInvalidArgument, "batch={} and seqlen={} must be positive", batch, seqlen);
  }
  batch_ = batch;
  seqlen_ = seqlen;
  const size_t rows = static_cast<size_t>(batch) * seqlen;
  const size_t dm = static_cast<size_t>(config_.d_model);
  const size_t sites = site_weight_.size();
  residual_.assign(sites, std::vector<T>(rows * dm));
  normed_.assign(sites, std::vector<T>(rows * dm));
  rstd_.assign(sites, std::vector<T>(rows));
  inputs_.assign(rows, 0);
  targets_.assign(rows, 0);
  delta_.assign(rows * dm, T(0));
  dresidual_.assign(rows * dm, T(0));
  dresidual_next_.assign(rows * dm, T(0));
  dnormed_.assign(rows * dm, T(0));
  logits_.assign(rows * static_cast<size_t>(config_.padded_vocab()), T(0));
  dlogits_.assign(logits_.size(), T(0));
  for (auto& block : blocks_) {
    if (block->mamba) block->mamba->plan(batch, seqlen);
    if (block->attention) block->attention->plan(batch, seqlen);
    if (block->mlp) block->mlp->plan(batch * seqlen);
  }
}

template <typename T>
const T* Model<T>::lm_head_weight() const {
  return params_.value(lm_head_ >= 0 ? lm_head_ : embedding_);
}

template <typename T>
T* Model<T>::lm_head_grad() {
  return params_.grad(lm_head_ >= 0 ? lm_head_ : embedding_);
}

template <typename T>
double Model<T>::run_forward(const int32_t* tokens) {
  if (batch_ == 0) fail(ErrorKind::kInternal, "Model::forward called before plan()");
  const int rows = batch_ * seqlen_, dm = config_.d_model, vp = config_.padded_vocab();
  for (int b = 0; b < batch_; ++b) {
    for (int t = 0; t < seqlen_; ++t) {
      const int32_t in = tokens[b * (seqlen_ + 1) + t];
      if (in < 0 || in >= config_.vocab_size) {
        fail(ErrorKind::kInvalidArgument,
             "token {} at batch row {}, position {} is outside [0, {})", in, b, t,
             config_.vocab_size);
      }
      inputs_[static_cast<size_t>(b * seqlen_ + t)] = in;
      targets_[static_cast<size_t>(b * seqlen_ + t)] = tokens[b * (seqlen_ + 1) + t + 1];
    }
  }
  const double eps = config_.norm_epsilon;
  cpu::embedding_forward<T>(rows, dm, inputs_.data(), params_.value(embedding_),
                            residual_[0].data());
  size_t site = 0;
  auto norm_site = [&](const T* delta) {
    if (site > 0) residual_[site] = residual_[site - 1];
    cpu::residual_rmsnorm_forward<T>(rows, dm, eps, residual_[site].data(), delta,
                                     params_.value(site_weight_[site]), normed_[site].data(),
                                     rstd_[site].data());
  };
  norm_site(nullptr);
  for (auto& block : blocks_) {
    if (block->mamba) block->mamba->forward(normed_[site].data(), delta_.data());
    if (block->attention) block->attention->forward(normed_[site].data(), delta_.data());
    ++site;
    norm_site(delta_.data());
    if (block->mlp) {
      block->mlp->forward(normed_[site].data(), delta_.data());
      ++site;
      norm_site(delta_.data());
    }
  }
  cpu::linear_forward<T>(rows, dm, vp, normed_[site].data(), lm_head_weight(), nullptr,
                         logits_.data());
  return 0;
}

template <typename T>
double Model<T>::forward(const int32_t* tokens) {
  run_forward(tokens);
  const int rows = batch_ * seqlen_;
  return static_cast<double>(cpu::cross_entropy_forward<T>(
      rows, config_.padded_vocab(), config_.vocab_size, logits_.data(), targets_.data()));
}

template <typename T>
double Model<T>::forward_backward(const int32_t* tokens, double grad_scale) {
  run_forward(tokens);
  const int rows = batch_ * seqlen_, dm = config_.d_model, vp = config_.padded_vocab();
  const double loss = static_cast<double>(cpu::cross_entropy_forward_backward<T>(
      rows, vp, config_.vocab_size, logits_.data(), targets_.data(), dlogits_.data(),
      static_cast<float>(grad_scale)));
  size_t site = site_weight_.size() - 1;
  // logits = h · Wᵀ: dh = dlogits · W, dW += dlogitsᵀ · h.
  cpu::linear_backward<T>(rows, dm, vp, normed_[site].data(), lm_head_weight(), dlogits_.data(),
                          dnormed_.data(), lm_head_grad(), nullptr);
  cpu::residual_rmsnorm_backward<T>(
      rows, dm, residual_[site].data(), params_.value(site_weight_[site]), rstd_[site].data(),
      dnormed_.data(), nullptr, dresidual_.data(), params_.grad(site_weight_[site]));
  // Walk the sublayers in reverse: site k-1 feeds the sublayer whose output is
  // added into the residual of site k, so its output gradient is dresidual(k).
  auto back_through_site = [&](auto& sublayer) {
    --site;
    sublayer.backward(normed_[site].data(), dresidual_.data(), dnormed_.data());
    cpu::residual_rmsnorm_backward<T>(rows, dm, residual_[site].data(),
                                      params_.value(site_weight_[site]), rstd_[site].data(),
                                      dnormed_.data(), dresidual_.data(), dresidual_next_.data(),
                                      params_.grad(site_weight_[site]));
    std::swap(dresidual_, dresidual_next_);
  };
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) {
    Block& block = **it;
    if (block.mlp) back_through_site(*block.mlp);
    if (block.mamba) back_through_site(*block.mamba);
    if (block.attention) back_through_site(*block.attention);
  }
  cpu::embedding_backward<T>(rows, dm, inputs_.data(), dresidual_.data(), params_.grad(embedding_));
  return loss;
}

template <typename T>
double Model<T>::step_flops(int batch, int seqlen) const {
  double matrix_weights =
      static_cast<double>(params_.info(lm_head_ >= 0 ? lm_head_ : embedding_).size);
  double extra_forward_per_token = 0;
  for (const auto& p : params_.entries()) {
    if (p.shape.size() == 2 && p.name != "backbone.embedding.weight" &&
        p.name != "lm_head.weight") {
      matrix_weights += static_cast<double>(p.size);
    }
  }
  for (const auto& block : blocks_) {
    if (block->mamba) extra_forward_per_token += block->mamba->scan_forward_flops_per_token();
    if (block->attention) {
      extra_forward_per_token += block->attention->attention_forward_flops_per_token(seqlen);
    }
  }
  const double tokens = static_cast<double>(batch) * seqlen;
  return tokens * (6.0 * matrix_weights + 3.0 * extra_forward_per_token);
}

template class Model<float>;
template class Model<double>;

}  // namespace megacpp
