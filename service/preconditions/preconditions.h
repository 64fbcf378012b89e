#pragma once
// What must hold on this machine before the daemon serves (also `megacpp doctor`). Checks run
// in a fixed order, and every check that could be answered without an accelerator comes before
// the first one that touches it: a violated precondition is reported before any GPU is opened,
// so a misconfigured node never leaves a half-initialised CUDA context or a held device behind.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace megacpp::preconditions {

struct CheckResult {
  enum class Status { kPass, kFail, kSkip };
  std::string name;  // stable across runs, e.g. "state_dir", "cache_dirs[1]", "store_quick_check"
  Status status = Status::kSkip;
  std::string detail;  // what was found
  std::string fix;     // for a failure: what a person should do about it
};

// "pass" / "FAIL" / "skip".
std::string_view to_string(CheckResult::Status status);

struct PreconditionConfig {
  std::filesystem::path state_dir;
  std::filesystem::path store_path;
  std::filesystem::path checkpoint_root;
  std::vector<std::filesystem::path> cache_dirs;
  std::vector<std::filesystem::path> data_roots;
  uint64_t min_free_bytes = 0;
  bool allow_nvls = false;  // multi-GPU machines may leave NCCL's NVLink SHARP path enabled
  bool check_cuda = true;
};

// Facts about the host that are read without initialising CUDA. Separate from the config so
// tests can describe a multi-GPU machine on one without GPUs.
struct HostEnvironment {
  int gpu_count = 0;
  std::optional<std::string> nccl_nvls_enable;  // the NCCL_NVLS_ENABLE variable; nullopt = unset
};

// Reads the real host: count_nvidia_gpus() on /proc/driver/nvidia/gpus, /dev and
// /usr/lib/wsl/lib, and the environment.
HostEnvironment probe_host_environment();

// Counts NVIDIA GPUs without touching the CUDA driver API: one entry per GPU under
// `proc_gpus_dir` (the kernel driver's per-GPU directories) when that directory exists, else the
// /dev/nvidiaN device files in `dev_dir`. Where there are neither, a WSL2 guest reaches its GPUs
// through `dev_dir`/dxg with the host driver's libcuda in `wsl_lib_dir`: that counts as one GPU
// (WSL2 does not say how many without the driver; one is enough for the CUDA checks to run, and
// such a guest has no NVLink multicast for the NVLS check to guard).
int count_nvidia_gpus(const std::filesystem::path& proc_gpus_dir,
                      const std::filesystem::path& dev_dir,
                      const std::filesystem::path& wsl_lib_dir = "/usr/lib/wsl/lib");

// Runs every check, in order: (a) directories (state_dir, checkpoint_root, cache_dirs each
// followed by plan_cache[i], the check and repair of its plans/ folder, then data_roots), (b) the
// store's directory and the store file, (c) NCCL_NVLS_ENABLE on multi-GPU hosts, (d) CUDA
// driver/runtime, per-GPU kernel images and NCCL. (d) is reported as skipped when any earlier check
// failed, when check_cuda is off, when the build has no CUDA, or when the host has no NVIDIA GPU.
// Creates missing state, checkpoint, cache and store directories.
std::vector<CheckResult> run_preconditions(const PreconditionConfig& config);
std::vector<CheckResult> run_preconditions(const PreconditionConfig& config,
                                           const HostEnvironment& host);

// The plan files in `dir` (base/plan_cache.h; GEMM and cuDNN attention plans): a corrupt record
// is dropped and its file rewritten, a file of another format, a broken header or (CUDA builds)
// another cuBLASLt or cuDNN version's plans removed (its plans are rebuilt on demand). Every repair
// passes, named in the detail with what was wrong; only a file that cannot be read, written or
// removed fails. `config_field` names the cache directory in the fix.
CheckResult check_plan_cache(const std::string& name, const std::filesystem::path& dir,
                             std::string_view config_field);

// A directory jobs read training data from: it must already exist (the daemon never invents a
// data root), list, and be searchable (its files opened) by the daemon's user.
CheckResult check_readable_dir(const std::string& name, const std::filesystem::path& dir);

// The NVLS check alone: on a host with more than one GPU, NCCL_NVLS_ENABLE must be "0" unless
// allow_nvls.
CheckResult check_nvls(const HostEnvironment& host, bool allow_nvls);

// Opens `store` read-only and runs PRAGMA quick_check. A missing store passes (the daemon
// creates it).
CheckResult check_store_file(const std::filesystem::path& store);

bool all_passed(const std::vector<CheckResult>& results);  // no kFail (skips are fine)

// A table for people: one row per check with its status, detail and fix.
std::string format_report(const std::vector<CheckResult>& results);

}  // namespace megacpp::preconditions
