#pragma once
// AdamW over a model's ParameterSet: one moment buffer pair for the flat
// parameter buffer, weight decay off for the spec's no-decay set (the entries
// registered with weight_decay = false).
#include <cmath>
#include <cstdint>
#include <vector>

#include "base/zeroed_vector.h"
#include "kernels/cpu/adamw.h"
#include "runtime/parameters/parameter_set.h"

namespace megacpp {

struct OptimizerConfig {
  double lr = 3e-3;
  double min_lr = 3e-4;
  int warmup_steps = 20;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // global norm; 0 disables
};

template <typename T>
class AdamW {
 public:
  AdamW(ParameterSet<T>& params, const OptimizerConfig& config)
      : params_(params),
        config_(config),
        exp_avg_(static_cast<size_t>(params.total())),
        exp_avg_sq_(static_cast<size_t>(params.total())) {}

  // Applies one update with learning rate lr; the step counter advances first.
  void step(double lr) {
    moments_untouched_ = false;
    ++step_;
    for (const auto& p : params_.entries()) {
      cpu::AdamWHyper h{lr, config_.beta1, config_.beta2, config_.eps,
                        p.weight_decay ? config_.weight_decay : 0.0};
      cpu::adamw_step<T>(p.size, params_.values().data() + p.offset,
                         params_.grads().data() + p.offset, exp_avg_.data() + p.offset,
                         exp_avg_sq_.data() + p.offset, h, step_);
    }
  }

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t step) { step_ = step; }
  // Mutable access may change the moments: from then on they are not known to be zero.
  ZeroedVector<T>& exp_avg() {
    moments_untouched_ = false;
    return exp_avg_;
  }
  ZeroedVector<T>& exp_avg_sq() {
    moments_untouched_ = false;
    return exp_avg_sq_;
  }
  const ZeroedVector<T>& exp_avg() const { return exp_avg_; }
  const ZeroedVector<T>& exp_avg_sq() const { return exp_avg_sq_; }
  // True while both moments are the zeros they were created as (a device copy of them can
  // then be cleared instead of uploaded).
  bool moments_are_zero() const { return moments_untouched_; }

 private:
  ParameterSet<T>& params_;
  OptimizerConfig config_;
  ZeroedVector<T> exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
  bool moments_untouched_ = true;
};

// Linear warmup from 0 to lr over warmup_steps, then cosine decay to min_lr at
// total_steps. `step` counts from 1.
inline double learning_rate(const OptimizerConfig& c, int64_t step, int64_t total_steps) {
  if (c.warmup_steps > 0 && step <= c.warmup_steps) {
    return c.lr * static_cast<double>(step) / c.warmup_steps;
  }
  const double span = static_cast<double>(total_steps - c.warmup_steps);
  const double progress = span > 0 ? static_cast<double>(step - c.warmup_steps) / span : 1.0;
  const double clamped = progress < 0 ? 0 : (progress > 1 ? 1 : progress);
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(M_PI * clamped));
}

}  // namespace megacpp
