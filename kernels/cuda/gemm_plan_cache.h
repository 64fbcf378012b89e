#pragma once
// cuBLASLt algorithm choices and cuDNN execution plans kept across processes (base/plan_cache.h's
// store), so that a job restarted or repeated on the same machine skips the heuristics and
// cuDNN's kernel compilation: the scope of the file is the cuBLASLt and cuDNN versions
// (cublasLtGetVersion, cudnnGetVersion), the GPU's architecture (sm_XY) and its name, the key
// inside it everything the heuristic was asked (LinearCuda's GemmPlanKey: transposes, types,
// m/n/k, leading dimensions, the alignments promised, the epilogue and the workspace limit; for
// CausalAttentionCudnn its graph, shape, strides and determinism).
//
// A cached plan is not trusted: LinearCuda checks an algorithm with cublasLtMatmulAlgoCheck and
// the same workspace and alignment rules a fresh choice must meet, CausalAttentionCudnn has cuDNN
// finalise a plan's JSON again and checks its workspace; one that fails is stale, dropped and
// rebuilt (counted). Every build is counted in the ledger the trainer holds to its recompile
// budget.
//
// Plain C++ (no CUDA types), so host code compiled by the C++ compiler can include it. Thread
// safe: the ops of one model may be constructed from several threads.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "base/plan_cache.h"

namespace megacpp::cuda {

// The fields of one cuBLASLt GEMM the chosen algorithm depends on. Enums are stored as their
// cuBLASLt numbers.
struct GemmPlanKey {
  int op_a = 0, op_b = 0;
  int type_a = 0, type_b = 0, type_d = 0, compute = 0;
  int64_t m = 0, n = 0, k = 0;
  int64_t ld_a = 0, ld_b = 0, ld_d = 0;
  uint32_t align_a = 0, align_b = 0, align_d = 0;
  uint32_t epilogue = 0;
  uint64_t workspace_limit = 0;
  int32_t sm_count_target = 0;  // CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET; 0: the GPU's own

  std::string to_string() const;
};

// "cublaslt-<cublasLtGetVersion()>/cudnn-<cudnnGetVersion()>/": how every scope made by this
// build begins. A plan file whose scope begins otherwise was made by another cuBLASLt or cuDNN
// and is stale (the daemon's startup check removes it). Reads the libraries' versions only:
// touches no device.
std::string plan_scope_prefix();
// Whether a plan file's scope was written by this build's cuBLASLt and cuDNN (else its plans are
// stale).
bool is_current_plan_scope(std::string_view scope);

class GemmPlanCache {
 public:
  // The cache of `device` (the libraries' versions, its architecture and name make the scope), in
  // `dir`; an empty dir keeps plans in memory only (the ledger still counts). Problems found in
  // the file are in problems(); they are repaired at the next flush().
  GemmPlanCache(const std::filesystem::path& dir, int device);
  // Flushes what was built, reporting (not throwing) a failed write on stderr.
  ~GemmPlanCache();
  GemmPlanCache(const GemmPlanCache&) = delete;
  GemmPlanCache& operator=(const GemmPlanCache&) = delete;

  int device() const { return device_; }
  const std::string& scope() const { return scope_; }
  // The file plans are kept in; empty when in memory only.
  std::filesystem::path file() const;
  std::vector<std::string> problems() const;
  PlanLedger ledger() const;
  // Writes the plans built so far (merged with other processes' under the file's lock). Throws
  // Error(kIo) naming the file.
  void flush();

  // For LinearCuda: the stored bytes of `key` (empty when absent), and the outcome of a lookup.
  std::string find(const GemmPlanKey& key) const;
  void record_hit();
  // A plan was built (on a miss, or after a stale entry: `stale`); `what` names the GEMM and
  // its shape for the ledger.
  void record_build(const GemmPlanKey& key, std::string value, const std::string& what, bool stale);
  // The same for plans keyed by their own text (CausalAttentionCudnn's cuDNN plans, whose key
  // begins with the cuDNN version). An empty value is counted but not stored.
  std::string find_text(const std::string& key) const;
  void record_build_text(const std::string& key, std::string value, const std::string& what,
                         bool stale);

 private:
  int device_ = 0;
  std::string scope_;
  mutable std::mutex mutex_;
  std::unique_ptr<PlanCache> store_;  // null: memory only
  std::map<std::string, std::string> memory_;
  PlanLedger ledger_;
};

}  // namespace megacpp::cuda
