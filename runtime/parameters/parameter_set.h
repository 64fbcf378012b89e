#pragma once
// All parameters of a model in one flat buffer (and their gradients in another),
// each named as the PyTorch module names it. One buffer keeps the optimizer and
// gradient clipping to a few linear loops, and addresses stay stable.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "base/error.h"
#include "base/zeroed_vector.h"

namespace megacpp {

struct ParameterInfo {
  std::string name;  // e.g. backbone.layers.0.mixer.in_proj.weight
  std::vector<int64_t> shape;
  int64_t offset = 0;
  int64_t size = 0;
  bool weight_decay = true;
};

template <typename T>
class ParameterSet {
 public:
  // Registers a tensor; returns its id. Only before finalize().
  int add(std::string name, std::vector<int64_t> shape, bool weight_decay) {
    if (finalized_) fail(ErrorKind::kInternal, "parameter {} added after finalize()", name);
    int64_t size = 1;
    for (int64_t d : shape) size *= d;
    entries_.push_back({std::move(name), std::move(shape), total_, size, weight_decay});
    total_ += size;
    return static_cast<int>(entries_.size()) - 1;
  }
  void finalize() {
    values_ = ZeroedVector<T>(static_cast<size_t>(total_));
    grads_ = ZeroedVector<T>(static_cast<size_t>(total_));
    finalized_ = true;
  }
  T* value(int id) { return values_.data() + entries_[static_cast<size_t>(id)].offset; }
  const T* value(int id) const { return values_.data() + entries_[static_cast<size_t>(id)].offset; }
  T* grad(int id) { return grads_.data() + entries_[static_cast<size_t>(id)].offset; }
  const ParameterInfo& info(int id) const { return entries_[static_cast<size_t>(id)]; }
  const std::vector<ParameterInfo>& entries() const { return entries_; }
  ZeroedVector<T>& values() { return values_; }
  const ZeroedVector<T>& values() const { return values_; }
  ZeroedVector<T>& grads() { return grads_; }
  int64_t total() const { return total_; }
  void zero_grad() { std::memset(grads_.data(), 0, sizeof(T) * grads_.size()); }
  int find(const std::string& name) const {
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].name == name) return static_cast<int>(i);
    }
    return -1;
  }

 private:
  std::vector<ParameterInfo> entries_;
  ZeroedVector<T> values_;
  ZeroedVector<T> grads_;
  int64_t total_ = 0;
  bool finalized_ = false;
};

}  // namespace megacpp
