#pragma once
// The contract of the AdamW update shared by kernels/cpu/adamw.h and kernels/cuda/adamw.h: its
// hyperparameters. Decoupled weight decay (Loshchilov & Hutter) shrinks the parameter by
// (1 − lr·weight_decay) outside the adaptive update; the spec's no-decay set (dt_bias, D, norm
// weights, biases) runs with weight_decay = 0. No OpenMP, no CUDA.

namespace megacpp::ops {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;  // 0 for the spec's no-decay set
};

}  // namespace megacpp::ops
