#pragma once
// The attention mixer (MHA of the spec): packed qkv projection with bias, rotary
// on q and k, causal grouped-query softmax attention, out projection with bias.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/rotary.h"
#include "runtime/config/model_config.h"
#include "runtime/layers/init.h"
#include "runtime/parameters/parameter_set.h"

namespace megacpp {

template <typename T>
class AttentionMixer {
 public:
  AttentionMixer(const ModelConfig& config, int layer, ParameterSet<T>& params)
      : config_(config), params_(params) {
    const std::string p = "backbone.layers." + std::to_string(layer) + ".mixer.";
    hq_ = config.attn.num_heads;
    hkv_ = config.attn_kv_heads();
    hd_ = config.attn_head_dim();
    width_ = (hq_ + 2 * hkv_) * hd_;
    in_proj_ = params.add(p + "in_proj.weight", {width_, config.d_model}, true);
    if (config.attn.qkv_proj_bias) in_bias_ = params.add(p + "in_proj.bias", {width_}, false);
    out_proj_ = params.add(p + "out_proj.weight", {config.d_model, hq_ * hd_}, true);
    if (config.attn.out_proj_bias)
      out_bias_ = params.add(p + "out_proj.bias", {config.d_model}, false);
  }

  void init(Rng& rng, double out_proj_divisor) {
    fill_uniform(params_.value(in_proj_), params_.info(in_proj_).size,
                 1.0 / std::sqrt(config_.d_model), rng);
    fill_uniform(params_.value(out_proj_), params_.info(out_proj_).size,
                 1.0 / std::sqrt(hq_ * hd_) / out_proj_divisor, rng);
    // Biases start at zero (the parameter buffer is zero-initialized).
  }

  void plan(int batch, int seqlen) {
    batch_ = batch;
    seqlen_ = seqlen;
    const size_t rows = static_cast<size_t>(batch) * seqlen;
    qkv_.assign(rows * width_, T(0));
    dqkv_.assign(rows * width_, T(0));
    ctx_.assign(rows * hq_ * hd_, T(0));
    dctx_.assign(rows * hq_ * hd_, T(0));
    cpu::AttentionShape s{batch, seqlen, hq_, hkv_, hd_, config_.attn_softmax_scale()};
    attention_ = std::make_unique<cpu::CausalAttention<T>>(s);
  }

  void forward(const T* x, T* out) {
    const int rows = batch_ * seqlen_, dm = config_.d_model;
    cpu::linear_forward<T>(rows, dm, width_, x, params_.value(in_proj_), bias(in_bias_),
                           qkv_.data());
    rotate(qkv_.data(), /*backward=*/false);
    T* q = qkv_.data();
    attention_->forward(q, q + hq_ * hd_, q + (hq_ + hkv_) * hd_, width_, width_, ctx_.data());
    cpu::linear_forward<T>(rows, hq_ * hd_, dm, ctx_.data(), params_.value(out_proj_),
                           bias(out_bias_), out);
  }

  void backward(const T* x, const T* dout, T* dx) {
    const int rows = batch_ * seqlen_, dm = config_.d_model;
    cpu::linear_backward<T>(rows, hq_ * hd_, dm, ctx_.data(), params_.value(out_proj_), dout,
                            dctx_.data(), params_.grad(out_proj_), grad(out_bias_));
    T* q = qkv_.data();
    T* dq = dqkv_.data();
    attention_->backward(q, q + hq_ * hd_, q + (hq_ + hkv_) * hd_, width_, width_, dctx_.data(), dq,
                         dq + hq_ * hd_, dq + (hq_ + hkv_) * hd_);
    rotate(dq, /*backward=*/true);
    cpu::linear_backward<T>(rows, dm, width_, x, params_.value(in_proj_), dq, dx,
                            params_.grad(in_proj_), grad(in_bias_));
  }

  // Forward FLOPs per token of the causal score and value products.
  double attention_forward_flops_per_token(int seqlen) const {
    return 2.0 * 2.0 * hq_ * hd_ * (seqlen + 1) / 2.0;
  }

 private:
  void rotate(T* buf, bool backward) {
    const int rd = config_.attn.rotary_emb_dim;
    if (rd == 0) return;
    const double base = config_.attn.rotary_emb_base;
    if (backward) {
      cpu::rotary_backward<T>(batch_, seqlen_, width_, 0, hq_, hd_, rd, base, buf);
      cpu::rotary_backward<T>(batch_, seqlen_, width_, hq_ * hd_, hkv_, hd_, rd, base, buf);
    } else {
      cpu::rotary_forward<T>(batch_, seqlen_, width_, 0, hq_, hd_, rd, base, buf);
      cpu::rotary_forward<T>(batch_, seqlen_, width_, hq_ * hd_, hkv_, hd_, rd, base, buf);
    }
  }
  const T* bias(int id) const { return id < 0 ? nullptr : params_.value(id); }
  T* grad(int id) { return id < 0 ? nullptr : params_.grad(id); }

  const ModelConfig& config_;
  ParameterSet<T>& params_;
  int hq_, hkv_, hd_, width_;
  int in_proj_, in_bias_ = -1, out_proj_, out_bias_ = -1;
  int batch_ = 0, seqlen_ = 0;
  std::vector<T> qkv_, dqkv_, ctx_, dctx_;
  std::unique_ptr<cpu::CausalAttention<T>> attention_;
};

}  // namespace megacpp
