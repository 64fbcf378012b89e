// cuBLASLt plan cache: see gemm_plan_cache.h. Host code only; libfmt's compiled part is not
// linked into this library (check.h), so strings are built with iostreams.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>

#include <iostream>
#include <sstream>
#include <utility>

#include "kernels/cuda/check.h"
#include "kernels/cuda/gemm_plan_cache.h"

namespace megacpp::cuda {

std::string GemmPlanKey::to_string() const {
  std::ostringstream out;
  out << "op=" << op_a << "," << op_b << " types=" << type_a << "," << type_b << "," << type_d
      << " compute=" << compute << " mnk=" << m << "," << n << "," << k << " ld=" << ld_a << ","
      << ld_b << "," << ld_d << " align=" << align_a << "," << align_b << "," << align_d
      << " epilogue=" << epilogue << " workspace=" << workspace_limit;
  // Written only where set: the keys of plans made for every SM stay as they were.
  if (sm_count_target != 0) out << " sms=" << sm_count_target;
  return out.str();
}

std::string plan_scope_prefix() {
  std::ostringstream prefix;
  // cuDNN's version too: the file also holds CausalAttentionCudnn's plans.
  prefix << "cublaslt-" << cublasLtGetVersion() << "/cudnn-" << cudnnGetVersion() << "/";
  return prefix.str();
}

bool is_current_plan_scope(std::string_view scope) {
  const std::string prefix = plan_scope_prefix();
  return scope.substr(0, prefix.size()) == prefix;  // device code is C++17: no starts_with
}

GemmPlanCache::GemmPlanCache(const std::filesystem::path& dir, int device) : device_(device) {
  cudaDeviceProp props{};
  MEGACPP_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
  std::ostringstream scope;
  // The library that chose the algorithms and the GPU they were chosen for: a plan from any
  // other pair is never read.
  scope << plan_scope_prefix() << "sm_" << props.major << props.minor << "/" << props.name;
  scope_ = scope.str();
  if (!dir.empty()) store_ = std::make_unique<PlanCache>(dir, scope_);
}

GemmPlanCache::~GemmPlanCache() {
  try {
    flush();
  } catch (const std::exception& e) {
    // The plans are rebuilt next time; losing them is no reason to fail a finished job.
    std::cerr << "plan cache not written: " << e.what() << "\n";
  }
}

std::filesystem::path GemmPlanCache::file() const {
  return store_ ? store_->file() : std::filesystem::path();
}

std::vector<std::string> GemmPlanCache::problems() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return store_ ? store_->problems() : std::vector<std::string>();
}

PlanLedger GemmPlanCache::ledger() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return ledger_;
}

void GemmPlanCache::flush() {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (store_) store_->flush();
}

std::string GemmPlanCache::find(const GemmPlanKey& key) const {
  return find_text(key.to_string());
}

std::string GemmPlanCache::find_text(const std::string& text) const {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (store_) {
    const std::string* value = store_->find(text);
    return value == nullptr ? std::string() : *value;
  }
  const auto it = memory_.find(text);
  return it == memory_.end() ? std::string() : it->second;
}

void GemmPlanCache::record_hit() {
  const std::lock_guard<std::mutex> lock(mutex_);
  ++ledger_.hits;
}

void GemmPlanCache::record_build(const GemmPlanKey& key, std::string value, const std::string& what,
                                 bool stale) {
  record_build_text(key.to_string(), std::move(value), what, stale);
}

void GemmPlanCache::record_build_text(const std::string& key, std::string value,
                                      const std::string& what, bool stale) {
  const std::lock_guard<std::mutex> lock(mutex_);
  ++ledger_.builds;
  if (stale) ++ledger_.stale;
  ledger_.last_build = what;
  if (value.empty()) return;
  if (store_) {
    store_->put(key, std::move(value));
  } else {
    memory_[key] = std::move(value);
  }
}

}  // namespace megacpp::cuda
