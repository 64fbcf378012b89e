#pragma once
// Mean cross entropy of the language-model head over a padded vocabulary.
// logits is [rows, vocab_padded]. The softmax runs over all vocab_padded columns, as in the
// official model (shared/spec/model.md): the padded rows of the embedding and lm_head are real
// parameters, so their columns take part in the normalizer and receive gradients. Only the
// targets are limited to the real vocabulary (< vocab_size): no data token maps to a padded
// column. targets[row] is the token to predict at that row (the caller has already shifted them
// for next-token prediction); a negative target marks a row that is ignored. The loss is the mean
// over the rows that are not ignored, 0 when there are none.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "base/error.h"

namespace megacpp::cpu {

namespace cross_entropy_detail {

// Validates the shape and the targets; returns the number of rows counted.
inline int64_t count_valid_rows(int rows, int vocab_padded, int vocab_size,
                                const int32_t* targets) {
  if (rows < 0) fail(ErrorKind::kInvalidArgument, "cross_entropy: rows must be >= 0, got {}", rows);
  if (vocab_size <= 0) {
    fail(ErrorKind::kInvalidArgument, "cross_entropy: vocab_size must be positive, got {}",
         vocab_size);
  }
  if (vocab_padded < vocab_size) {
    fail(ErrorKind::kInvalidArgument, "cross_entropy: vocab_padded ({}) must be >= vocab_size ({})",
         vocab_padded, vocab_size);
  }
  int64_t valid = 0;
  for (int r = 0; r < rows; ++r) {
    if (targets[r] >= vocab_size) {
      fail(ErrorKind::kInvalidArgument,
           "cross_entropy: target of row {} is {}, outside the vocabulary of {} tokens", r,
           targets[r], vocab_size);
    }
    if (targets[r] >= 0) ++valid;
  }
  return valid;
}

// dlogits may be null (forward only).
template <typename T>
T run(int rows, int vocab_padded, int vocab_size, const T* logits, const int32_t* targets,
      T* dlogits, float grad_scale) {
  const int64_t valid = count_valid_rows(rows, vocab_padded, vocab_size, targets);
  // Per-row losses summed afterwards in row order keep the mean deterministic.
  std::vector<double> row_loss(static_cast<size_t>(rows), 0.0);
  const double grad_per_row =
      valid > 0 ? static_cast<double>(grad_scale) / static_cast<double>(valid) : 0.0;
  // Small calls would spend more on starting threads than on the work.
  const bool parallel = static_cast<int64_t>(rows) * vocab_padded >= (int64_t{1} << 14);
#pragma omp parallel for schedule(static) if (parallel)
  for (int r = 0; r < rows; ++r) {
    const T* x = logits + static_cast<int64_t>(r) * vocab_padded;
    T* dx = dlogits ? dlogits + static_cast<int64_t>(r) * vocab_padded : nullptr;
    const int32_t target = targets[r];
    if (target < 0) {
      if (dx) std::fill(dx, dx + vocab_padded, T(0));
      continue;
    }
    const double row_max = static_cast<double>(*std::max_element(x, x + vocab_padded));
    double sum = 0;
    for (int c = 0; c < vocab_padded; ++c) sum += std::exp(static_cast<double>(x[c]) - row_max);
    const double log_sum = row_max + std::log(sum);
    row_loss[r] = log_sum - static_cast<double>(x[target]);
    if (dx) {
      for (int c = 0; c < vocab_padded; ++c) {
        const double prob = std::exp(static_cast<double>(x[c]) - log_sum);
        dx[c] = static_cast<T>(grad_per_row * prob);
      }
      dx[target] =
          static_cast<T>(grad_per_row * (std::exp(static_cast<double>(x[target]) - log_sum) - 1.0));
    }
  }
  if (valid == 0) return T(0);
  double total = 0;
  for (const double loss : row_loss) total += loss;
  return static_cast<T>(total / static_cast<double>(valid));
}

}  // namespace cross_entropy_detail

// Returns the mean loss and writes dlogits = grad_scale * (softmax - onehot) / valid_rows
// ([rows, vocab_padded], every column; zero on ignored rows). Throws
// megacpp::Error (kInvalidArgument) on a bad shape or a target >= vocab_size,
// before writing anything.
template <typename T>
T cross_entropy_forward_backward(int rows, int vocab_padded, int vocab_size, const T* logits,
                                 const int32_t* targets, T* dlogits, float grad_scale) {
  return cross_entropy_detail::run(rows, vocab_padded, vocab_size, logits, targets, dlogits,
                                   grad_scale);
}

// The mean loss alone, for evaluation.
template <typename T>
T cross_entropy_forward(int rows, int vocab_padded, int vocab_size, const T* logits,
                        const int32_t* targets) {
  return cross_entropy_detail::run<T>(rows, vocab_padded, vocab_size, logits, targets, nullptr,
                                      0.0f);
}

}  // namespace megacpp::cpu
