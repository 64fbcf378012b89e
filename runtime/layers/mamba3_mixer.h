#pragma once
// The Mamba-3 mixer layer: in_proj → preprocessing → scan → out_proj, with its
// parameters registered under backbone.layers.{i}.mixer.*.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kernels/contracts/mamba3_scan.h"
#include "kernels/cpu/linear.h"
#include "kernels/cpu/mamba3_preprocess.h"
#include "kernels/cpu/mamba3_scan_chunked.h"
#include "kernels/cpu/mamba3_scan_recurrent.h"
#include "runtime/config/model_config.h"
#include "runtime/layers/init.h"
#include "runtime/parameters/parameter_set.h"

namespace megacpp {

namespace detail {
template <typename T>
class ScanRunner {
 public:
  virtual ~ScanRunner() = default;
  virtual void forward(const ops::ScanInputs<T>& in, T* y) = 0;
  virtual void backward(const ops::ScanInputs<T>& in, const T* dy, const ops::ScanGrads<T>& g) = 0;
};
template <typename T, typename Impl>
class ScanRunnerOf final : public ScanRunner<T> {
 public:
  explicit ScanRunnerOf(const ops::ScanShape& shape) : impl_(shape) {}
  void forward(const ops::ScanInputs<T>& in, T* y) override { impl_.forward(in, y); }
  void backward(const ops::ScanInputs<T>& in, const T* dy, const ops::ScanGrads<T>& g) override {
    impl_.backward(in, dy, g);
  }

 private:
  Impl impl_;
};
}  // namespace detail

// The preprocessing shape of the config's Mamba-3 mixers over `rows` tokens (0 until planned).
inline ops::Mamba3PreprocessShape mamba3_preprocess_shape(const ModelConfig& config, int rows) {
  ops::Mamba3PreprocessShape s;
  s.rows = rows;
  s.heads = config.ssm_heads();
  s.headdim = config.ssm.headdim;
  s.state = config.ssm.d_state;
  s.groups = config.ssm.ngroups;
  s.rank = config.ssm.mimo_rank;
  s.angles = config.rope_angles();
  s.a_floor = config.ssm.A_floor;
  s.norm_eps = config.norm_epsilon;
  return s;
}

template <typename T>
class Mamba3Mixer {
 public:
  Mamba3Mixer(const ModelConfig& config, int layer, ParameterSet<T>& params, ScanForm form)
      : config_(config), params_(params), form_(form) {
    const std::string p = "backbone.layers." + std::to_string(layer) + ".mixer.";
    shape_ = mamba3_preprocess_shape(config, 0);
    const int64_t h = shape_.heads, r = shape_.rank, n = shape_.state, pd = shape_.headdim;
    in_proj_ = params.add(p + "in_proj.weight", {shape_.columns(), config.d_model}, true);
    dt_bias_ = params.add(p + "dt_bias", {h}, false);
    b_bias_ = params.add(p + "B_bias", {h, r, n}, false);
    c_bias_ = params.add(p + "C_bias", {h, r, n}, false);
    b_norm_ = params.add(p + "B_norm.weight", {n}, false);
    c_norm_ = params.add(p + "C_norm.weight", {n}, false);
    mimo_x_ = params.add(p + "mimo_x", {h, r, pd}, true);
    mimo_z_ = params.add(p + "mimo_z", {h, r, pd}, true);
    mimo_o_ = params.add(p + "mimo_o", {h, r, pd}, true);
    d_ = params.add(p + "D", {h}, false);
    out_proj_ = params.add(p + "out_proj.weight", {config.d_model, shape_.d_inner()}, true);
  }

  void init(Rng& rng, double out_proj_divisor) {
    const ModelConfig& c = config_;
    const auto& P = params_;
    fill_uniform(params_.value(in_proj_), P.info(in_proj_).size, 1.0 / std::sqrt(c.d_model), rng);
    T* dt_bias = params_.value(dt_bias_);
    const double lo = std::log(c.ssm.dt_min), hi = std::log(c.ssm.dt_max);
    for (int h = 0; h < shape_.heads; ++h) {
      double dt = std::exp(rng.uniform() * (hi - lo) + lo);
      dt = std::max(dt, c.ssm.dt_init_floor);
      dt_bias[h] = static_cast<T>(dt + std::log(-std::expm1(-dt)));  // inverse softplus
    }
    fill_constant(params_.value(b_bias_), P.info(b_bias_).size, 1.0);
    fill_constant(params_.value(c_bias_), P.info(c_bias_).size, 1.0);
    fill_constant(params_.value(b_norm_), P.info(b_norm_).size, 1.0);
    fill_constant(params_.value(c_norm_), P.info(c_norm_).size, 1.0);
    fill_constant(params_.value(mimo_x_), P.info(mimo_x_).size, 1.0 / shape_.rank);
    fill_constant(params_.value(mimo_z_), P.info(mimo_z_).size, 1.0);
    fill_constant(params_.value(mimo_o_), P.info(mimo_o_).size, 1.0 / shape_.rank);
    fill_constant(params_.value(d_), P.info(d_).size, 1.0);
    fill_uniform(params_.value(out_proj_), P.info(out_proj_).size,
                 1.0 / std::sqrt(shape_.d_inner()) / out_proj_divisor, rng);
  }

  void plan(int batch, int seqlen) {
    batch_ = batch;
    seqlen_ = seqlen;
    shape_.rows = batch * seqlen;
    const size_t rows = static_cast<size_t>(shape_.rows);
    const size_t di = static_cast<size_t>(shape_.d_inner()), bc = shape_.bc_width();
    const size_t h = shape_.heads, an = shape_.angles;
    proj_.assign(rows * shape_.columns(), T(0));
    dproj_.assign(rows * shape_.columns(), T(0));
    // One allocation per side for the scan's inputs and their gradients.
    const size_t scan_size = rows * (2 * di + 2 * bc + 3 * h + an);
    scan_in_.assign(scan_size, T(0));
    scan_grad_.assign(scan_size, T(0));
    in_ = carve(scan_in_.data(), rows, di, bc, h, an);
    grad_ = carve(scan_grad_.data(), rows, di, bc, h, an);
    bc_rstd_.assign(rows * 2 * shape_.rank * shape_.groups, T(0));
    row_scratch_.assign(rows * (h + 2 * shape_.state), T(0));
    y_.assign(rows * di, T(0));
    dy_.assign(rows * di, T(0));
    const size_t per_head = static_cast<size_t>(shape_.rank) * shape_.state;
    param_grad_.assign(2 * h * per_head + 3 * h * shape_.rank * shape_.headdim + h, T(0));
    const ops::ScanShape s = shape_.scan_shape(batch, seqlen, config_.ssm.chunk_size);
    if (form_ == ScanForm::kChunked) {
      scan_ = std::make_unique<detail::ScanRunnerOf<T, cpu::Mamba3ScanChunked<T>>>(s);
    } else {
      scan_ = std::make_unique<detail::ScanRunnerOf<T, cpu::Mamba3ScanRecurrent<T>>>(s);
    }
  }

  void forward(const T* x, T* out) {
    const int rows = shape_.rows, dm = config_.d_model;
    cpu::linear_forward<T>(rows, dm, shape_.columns(), x, params_.value(in_proj_), nullptr,
                           proj_.data());
    cpu::mamba3_preprocess_forward<T>(shape_, proj_.data(), params_.value(dt_bias_),
                                      params_.value(b_norm_), params_.value(c_norm_), in_,
                                      bc_rstd_.data());
    scan_->forward(scan_inputs(), y_.data());
    cpu::linear_forward<T>(rows, shape_.d_inner(), dm, y_.data(), params_.value(out_proj_), nullptr,
                           out);
  }

  // dx is overwritten with the gradient w.r.t. x; parameter gradients accumulate.
  void backward(const T* x, const T* dout, T* dx) {
    const int rows = shape_.rows, dm = config_.d_model;
    cpu::linear_backward<T>(rows, shape_.d_inner(), dm, y_.data(), params_.value(out_proj_), dout,
                            dy_.data(), params_.grad(out_proj_), nullptr);
    const size_t h = shape_.heads, rn = static_cast<size_t>(shape_.rank) * shape_.state;
    const size_t rp = static_cast<size_t>(shape_.rank) * shape_.headdim;
    T* pg = param_grad_.data();
    ops::ScanGrads<T> g{grad_.q,
                        grad_.k,
                        grad_.x,
                        grad_.z,
                        grad_.adt,
                        grad_.dt,
                        grad_.trap,
                        grad_.angles,
                        pg,
                        pg + h * rn,
                        pg + 2 * h * rn,
                        pg + 2 * h * rn + h * rp,
                        pg + 2 * h * rn + 2 * h * rp,
                        pg + 2 * h * rn + 3 * h * rp};
    scan_->backward(scan_inputs(), dy_.data(), g);
    accumulate(c_bias_, g.q_bias);
    accumulate(b_bias_, g.k_bias);
    accumulate(mimo_x_, g.mimo_x);
    accumulate(mimo_z_, g.mimo_z);
    accumulate(mimo_o_, g.mimo_o);
    accumulate(d_, g.d);
    const ops::Mamba3ScanBuffers<const T> grad_view{grad_.z,   grad_.x,  grad_.k,    grad_.q,
                                                    grad_.adt, grad_.dt, grad_.trap, grad_.angles};
    cpu::mamba3_preprocess_backward<T>(
        shape_, proj_.data(), params_.value(dt_bias_), params_.value(b_norm_),
        params_.value(c_norm_), bc_rstd_.data(), grad_view, dproj_.data(), params_.grad(dt_bias_),
        params_.grad(b_norm_), params_.grad(c_norm_), row_scratch_.data());
    cpu::linear_backward<T>(rows, dm, shape_.columns(), x, params_.value(in_proj_), dproj_.data(),
                            dx, params_.grad(in_proj_), nullptr);
  }

  // Forward FLOPs of the scan per (batch·seqlen) token, counting the chunked
  // algorithm's products: intra-chunk scores and values, inter-chunk q·S and
  // the state update.
  double scan_forward_flops_per_token() const {
    const double c = config_.ssm.chunk_size, r = shape_.rank, n = shape_.state, p = shape_.headdim;
    const double rows = c * r;
    const double per_chunk = 2 * rows * rows * (n + p) / 2 + 4 * rows * p * n;
    return per_chunk / c * shape_.heads;
  }

 private:
  ops::Mamba3ScanBuffers<T> carve(T* base, size_t rows, size_t di, size_t bc, size_t h, size_t an) {
    ops::Mamba3ScanBuffers<T> b;
    b.z = base;
    b.x = b.z + rows * di;
    b.k = b.x + rows * di;
    b.q = b.k + rows * bc;
    b.adt = b.q + rows * bc;
    b.dt = b.adt + rows * h;
    b.trap = b.dt + rows * h;
    b.angles = b.trap + rows * h;
    (void)an;
    return b;
  }
  ops::ScanInputs<T> scan_inputs() const {
    ops::ScanInputs<T> s;
    s.q = in_.q;
    s.k = in_.k;
    s.v = in_.x;
    s.z = in_.z;
    s.adt = in_.adt;
    s.dt = in_.dt;
    s.trap = in_.trap;
    s.angles = in_.angles;
    s.q_bias = params_.value(c_bias_);
    s.k_bias = params_.value(b_bias_);
    s.mimo_x = params_.value(mimo_x_);
    s.mimo_z = params_.value(mimo_z_);
    s.mimo_o = params_.value(mimo_o_);
    s.d = params_.value(d_);
    return s;
  }
  void accumulate(int id, const T* g) {
    T* dst = params_.grad(id);
    const int64_t n = params_.info(id).size;
    for (int64_t i = 0; i < n; ++i) dst[i] += g[i];
  }

  const ModelConfig& config_;
  ParameterSet<T>& params_;
  ScanForm form_;
  ops::Mamba3PreprocessShape shape_;
  int batch_ = 0, seqlen_ = 0;
  int in_proj_, dt_bias_, b_bias_, c_bias_, b_norm_, c_norm_, mimo_x_, mimo_z_, mimo_o_, d_,
      out_proj_;
  std::vector<T> proj_, dproj_, scan_in_, scan_grad_, bc_rstd_, row_scratch_, y_, dy_, param_grad_;
  ops::Mamba3ScanBuffers<T> in_{}, grad_{};
  std::unique_ptr<detail::ScanRunner<T>> scan_;
};

}  // namespace megacpp
