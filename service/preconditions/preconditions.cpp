#include "service/preconditions/preconditions.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pwd.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "base/error.h"
#include "base/plan_cache.h"

#ifdef MEGACPP_HAVE_CUDA
#include "kernels/cuda/device_query.h"
#include "kernels/cuda/gemm_plan_cache.h"
#endif

namespace megacpp::preconditions {

namespace fs = std::filesystem;
using Status = CheckResult::Status;

std::string_view to_string(Status status) {
  switch (status) {
    case Status::kPass:
      return "pass";
    case Status::kFail:
      return "FAIL";
    case Status::kSkip:
      return "skip";
  }
  return "unknown";
}

namespace {

CheckResult pass(std::string name, std::string detail) {
  return {std::move(name), Status::kPass, std::move(detail), ""};
}
CheckResult failure(std::string name, std::string detail, std::string fix) {
  return {std::move(name), Status::kFail, std::move(detail), std::move(fix)};
}
CheckResult skip(std::string name, std::string detail) {
  return {std::move(name), Status::kSkip, std::move(detail), ""};
}

std::string format_bytes(uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double value = static_cast<double>(bytes);
  size_t unit = 0;
  while (value >= 1024.0 && unit + 1 < std::size(units)) {
    value /= 1024.0;
    ++unit;
  }
  return unit == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", value, units[unit]);
}

// "user alice (uid 1000)": fixes name the account the daemon runs as, since permissions are
// the usual culprit and the operator may not know which user that is.
std::string current_user() {
  const uid_t uid = ::geteuid();
  std::vector<char> buffer(16384);
  passwd entry{};
  passwd* found = nullptr;
  if (::getpwuid_r(uid, &entry, buffer.data(), buffer.size(), &found) == 0 && found != nullptr) {
    return fmt::format("user {} (uid {})", found->pw_name, uid);
  }
  return fmt::format("uid {}", uid);
}

std::string errno_text(int error) {
  return std::strerror(error);
}

// Creates, fills, fsyncs and removes a file: a directory can pass access(W_OK) and still refuse
// writes (read-only mount, full disk, quota, root-squashed NFS), and only a real write shows it.
std::string probe_write(const fs::path& dir) {
  const fs::path probe = dir / fmt::format(".megacpp-write-probe-{}", ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return fmt::format("cannot create {}: {}", probe.string(), errno_text(errno));
  std::string error;
  static constexpr char kContent[] = "megacpp write probe\n";
  const ssize_t written = ::write(fd, kContent, sizeof(kContent) - 1);
  if (written != static_cast<ssize_t>(sizeof(kContent) - 1)) {
    error = fmt::format("cannot write {}: {}", probe.string(),
                        written < 0 ? errno_text(errno) : "short write");
  } else if (::fsync(fd) != 0) {
    error = fmt::format("cannot fsync {}: {}", probe.string(), errno_text(errno));
  }
  if (::close(fd) != 0 && error.empty()) {
    error = fmt::format("cannot close {}: {}", probe.string(), errno_text(errno));
  }
  if (::unlink(probe.c_str()) != 0 && error.empty()) {
    error = fmt::format("cannot remove {}: {}", probe.string(), errno_text(errno));
  }
  return error;
}

// A directory the daemon writes into: exists or can be created, is a directory, takes a real
// write, and has min_free_bytes available to this user.
CheckResult check_writable_dir(const std::string& name, const fs::path& dir,
                               std::string_view config_field, uint64_t min_free_bytes) {
  const std::string user = current_user();
  const std::string set_field = fmt::format(
      "or set {} in the daemon config to a directory that user can write", config_field);
  if (dir.empty()) {
    return failure(name, fmt::format("{} is not configured", config_field),
                   fmt::format("set {} in the daemon config", config_field));
  }
  std::error_code ec;
  const fs::file_status status = fs::status(dir, ec);
  bool created = false;
  if (status.type() == fs::file_type::not_found) {
    fs::create_directories(dir, ec);
    if (ec) {
      return failure(
          name,
          fmt::format("{} does not exist and cannot be created: {}", dir.string(), ec.message()),
          fmt::format("create {} and make it writable by {}, {}", dir.string(), user, set_field));
    }
    created = true;
  } else if (ec) {
    return failure(
        name, fmt::format("cannot inspect {}: {}", dir.string(), ec.message()),
        fmt::format("make {} and its parents accessible to {}, {}", dir.string(), user, set_field));
  } else if (!fs::is_directory(status)) {
    return failure(name, fmt::format("{} exists but is not a directory", dir.string()),
                   fmt::format("remove or rename {}, {}", dir.string(), set_field));
  }
  const std::string write_error = probe_write(dir);
  if (!write_error.empty()) {
    return failure(name, fmt::format("{} is not writable: {}", dir.string(), write_error),
                   fmt::format("make {} writable by {} (chown/chmod, or remount read-write), {}",
                               dir.string(), user, set_field));
  }
  struct statvfs fs_stats {};
  if (::statvfs(dir.c_str(), &fs_stats) != 0) {
    return failure(
        name, fmt::format("cannot read the free space of {}: {}", dir.string(), errno_text(errno)),
        fmt::format("check the filesystem holding {}, {}", dir.string(), set_field));
  }
  const uint64_t available =
      static_cast<uint64_t>(fs_stats.f_bavail) * static_cast<uint64_t>(fs_stats.f_frsize);
  if (available < min_free_bytes) {
    return failure(
        name,
        fmt::format("{} has {} ({} bytes) available, less than min_free_bytes={} ({})",
                    dir.string(), format_bytes(available), available, min_free_bytes,
                    format_bytes(min_free_bytes)),
        fmt::format("free space on the filesystem holding {}, move {} to a larger filesystem, "
                    "or lower min_free_bytes in the daemon config",
                    dir.string(), config_field));
  }
  return pass(name, fmt::format("{}: writable directory{}, {} available", dir.string(),
                                created ? " (created)" : "", format_bytes(available)));
}

bool any_failed(const std::vector<CheckResult>& results) {
  return !all_passed(results);
}

constexpr const char* kCudaCheckNames[] = {"cuda_driver", "cuda_kernel_image", "nccl_library"};

void append_skipped_cuda_checks(std::vector<CheckResult>& results, const std::string& why) {
  for (const char* name : kCudaCheckNames) results.push_back(skip(name, why));
}

#ifdef MEGACPP_HAVE_CUDA
std::string cuda_version_text(int version) {
  return fmt::format("{}.{}", version / 1000, (version % 1000) / 10);
}

CheckResult check_nccl_library() {
  const char* name = "nccl_library";
  const char* fix =
      "install NCCL 2 (e.g. the libnccl2 package) so that libnccl.so.2 is found by the dynamic "
      "loader (ldconfig or LD_LIBRARY_PATH)";
  void* library = ::dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* error = ::dlerror();
    return failure(name, fmt::format("cannot load libnccl.so.2: {}", error ? error : "unknown"),
                   fix);
  }
  using GetVersion = int (*)(int*);  // ncclResult_t ncclGetVersion(int*); ncclSuccess == 0
  auto get_version = reinterpret_cast<GetVersion>(::dlsym(library, "ncclGetVersion"));
  if (get_version == nullptr) {
    ::dlclose(library);
    return failure(name, "libnccl.so.2 loads but has no ncclGetVersion symbol", fix);
  }
  int code = 0;
  const int status = get_version(&code);
  ::dlclose(library);
  if (status != 0) {
    return failure(name, fmt::format("ncclGetVersion failed with ncclResult_t {}", status), fix);
  }
  // NCCL 2.9 changed the encoding from major*1000 + minor*100 + patch to
  // major*10000 + minor*100 + patch.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? (code % 10000) / 100 : (code % 1000) / 100;
  return pass(name, fmt::format("libnccl.so.2 loaded: NCCL {}.{}.{}", major, minor, code % 100));
}

void append_cuda_checks(std::vector<CheckResult>& results) {
  const cuda::RuntimeInfo info = cuda::query_devices();
  const std::string runtime = cuda_version_text(info.runtime_version);
  if (info.driver_version == 0) {
    results.push_back(failure(
        "cuda_driver", "no CUDA driver is installed or loaded",
        fmt::format("install an NVIDIA driver that supports CUDA {} (check with nvidia-smi)",
                    runtime)));
  } else if (info.driver_version < info.runtime_version) {
    results.push_back(failure(
        "cuda_driver",
        fmt::format("the driver supports CUDA {} but this binary needs the CUDA {} runtime",
                    cuda_version_text(info.driver_version), runtime),
        fmt::format("upgrade the NVIDIA driver to one supporting CUDA {}, or rebuild megacpp with "
                    "a CUDA toolkit no newer than {}",
                    runtime, cuda_version_text(info.driver_version))));
  } else if (info.devices.empty()) {
    results.push_back(
        failure("cuda_driver",
                fmt::format("driver CUDA {}, runtime CUDA {}, but no usable GPU: {}",
                            cuda_version_text(info.driver_version), runtime, info.error),
                "check the GPUs with nvidia-smi and that CUDA_VISIBLE_DEVICES does not hide them"));
  } else {
    results.push_back(
        pass("cuda_driver",
             fmt::format("driver CUDA {} supports runtime CUDA {}; {} GPU(s)",
                         cuda_version_text(info.driver_version), runtime, info.devices.size())));
  }
  if (any_failed(results)) {
    results.push_back(skip("cuda_kernel_image", "not run: an earlier check failed"));
  } else {
    for (const cuda::DeviceInfo& device : info.devices) {
      const std::string name = fmt::format("cuda_kernel_image[{}]", device.index);
      const std::string arch = fmt::format("sm_{}{}", device.compute_major, device.compute_minor);
      const std::string error = cuda::probe_kernel_image(device.index);
      if (error.empty()) {
        results.push_back(pass(name, fmt::format("GPU {} ({}, {}): kernel image present",
                                                 device.index, device.name, arch)));
      } else {
        results.push_back(failure(
            name,
            fmt::format("GPU {} ({}, {}): no usable kernel image: {}", device.index, device.name,
                        arch, error),
            fmt::format("rebuild with -DCMAKE_CUDA_ARCHITECTURES including {0}{1} (SASS for this "
                        "GPU), or add a virtual architecture no newer than {0}{1} (e.g. "
                        "{0}{1}-virtual) so the binary carries PTX the driver can compile",
                        device.compute_major, device.compute_minor)));
      }
    }
  }
  // A cap on the shared memory megacpp's kernels plan with is a deliberate slowdown (a smaller
  // GPU's plans): checked here, so a bad value stops the daemon rather than every job, and named
  // in the report.
  if (const char* cap = std::getenv(cuda::kSharedMemoryCapVariable); cap != nullptr && *cap) {
    for (const cuda::DeviceInfo& device : info.devices) {
      const std::string name = fmt::format("cuda_shared_memory[{}]", device.index);
      try {
        const cuda::SharedMemoryLimits limits = cuda::shared_memory_limits(device.index);
        results.push_back(pass(
            name, fmt::format("GPU {}: megacpp's kernels plan with {} bytes per SM, {} per block "
                              "({}={})",
                              device.index, limits.per_sm, limits.per_block,
                              cuda::kSharedMemoryCapVariable, cap)));
      } catch (const Error& e) {
        results.push_back(failure(
            name, e.what(),
            fmt::format("unset {} (it is for checking a smaller GPU's plans) or set it within the "
                        "range named",
                        cuda::kSharedMemoryCapVariable)));
      }
    }
  }
  results.push_back(check_nccl_library());
}
#endif

}  // namespace

int count_nvidia_gpus(const fs::path& proc_gpus_dir, const fs::path& dev_dir,
                      const fs::path& wsl_lib_dir) {
  std::error_code ec;
  if (fs::is_directory(proc_gpus_dir, ec)) {
    int count = 0;
    for (const auto& entry : fs::directory_iterator(proc_gpus_dir, ec)) {
      (void)entry;
      ++count;
    }
    if (!ec) return count;
  }
  int count = 0;
  for (const auto& entry : fs::directory_iterator(dev_dir, ec)) {
    const std::string file = entry.path().filename().string();
    // /dev/nvidia0, /dev/nvidia1, ...; not nvidiactl, nvidia-uvm, nvidia-caps.
    if (file.size() > 6 && file.compare(0, 6, "nvidia") == 0 &&
        std::all_of(file.begin() + 6, file.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      ++count;
    }
  }
  if (count > 0 || !fs::exists(dev_dir / "dxg", ec)) return count;
  for (const auto& entry : fs::directory_iterator(wsl_lib_dir, ec)) {
    if (entry.path().filename().string().starts_with("libcuda.so")) return 1;
  }
  return 0;
}

HostEnvironment probe_host_environment() {
  HostEnvironment host;
  host.gpu_count = count_nvidia_gpus("/proc/driver/nvidia/gpus", "/dev");
  if (const char* value = std::getenv("NCCL_NVLS_ENABLE")) host.nccl_nvls_enable = value;
  return host;
}

CheckResult check_plan_cache(const std::string& name, const fs::path& dir,
                             std::string_view config_field) {
  std::vector<PlanCacheRepair> repairs;
  std::function<bool(std::string_view)> current;
#ifdef MEGACPP_HAVE_CUDA
  // Plans chosen by another cuBLASLt or cuDNN are stale: removed here, rebuilt by the next job.
  current = cuda::is_current_plan_scope;
#endif
  try {
    repairs = repair_plan_cache_dir(dir, current);
  } catch (const Error& e) {
    return failure(name, fmt::format("{}: {}", dir.string(), e.what()),
                   fmt::format("make {} readable and writable by the daemon's user, or remove it "
                               "(plans are rebuilt); it lies in {}",
                               dir.string(), config_field));
  }
  if (repairs.empty()) return pass(name, fmt::format("{}: no plan cache yet", dir.string()));
  std::vector<std::string> parts;
  size_t ok = 0;
  for (const PlanCacheRepair& r : repairs) {
    if (r.action == "ok") {
      ++ok;
      continue;
    }
    // Each repair with what was wrong, so the receipt says why the plans are being rebuilt.
    parts.push_back(fmt::format("{} {} ({} record(s) kept): {}", r.action,
                                r.file.filename().string(), r.records_kept,
                                fmt::join(r.problems, "; ")));
  }
  if (parts.empty()) {
    return pass(name, fmt::format("{}: ok, {} plan file(s) intact", dir.string(), ok));
  }
  return pass(name, fmt::format("{}: {} plan file(s) intact; {}", dir.string(), ok,
                                fmt::join(parts, "; ")));
}

CheckResult check_readable_dir(const std::string& name, const fs::path& dir) {
  const std::string user = current_user();
  const std::string or_remove = "or remove it from data_roots in the daemon config";
  std::error_code ec;
  const fs::file_status status = fs::status(dir, ec);
  if (status.type() == fs::file_type::not_found) {
    return failure(name, fmt::format("data root {} does not exist", dir.string()),
                   fmt::format("create {} and prepare data into it (megacpp data prepare), {}",
                               dir.string(), or_remove));
  }
  if (ec) {
    return failure(
        name, fmt::format("cannot inspect {}: {}", dir.string(), ec.message()),
        fmt::format("make {} and its parents readable by {}, {}", dir.string(), user, or_remove));
  }
  if (!fs::is_directory(status)) {
    return failure(name, fmt::format("data root {} is not a directory", dir.string()),
                   fmt::format("point data_roots at directories, {}", or_remove));
  }
  DIR* listing = ::opendir(dir.c_str());
  int list_error = listing == nullptr ? errno : 0;
  if (listing != nullptr) {
    errno = 0;
    while (::readdir(listing) != nullptr) {
    }
    list_error = errno;
    ::closedir(listing);
  }
  if (list_error != 0) {
    return failure(
        name, fmt::format("cannot list {}: {}", dir.string(), errno_text(list_error)),
        fmt::format("make {} readable by {} (chmod a+rx), {}", dir.string(), user, or_remove));
  }
  // Listing needs read permission; opening the data files in it needs search (x) permission,
  // which a directory can lack while it still lists. Checked with the effective ids, as those
  // opens will be (access() would check the real ones).
  if (::faccessat(AT_FDCWD, dir.c_str(), X_OK, AT_EACCESS) != 0) {
    const int search_error = errno;
    return failure(
        name,
        fmt::format("cannot search {} (open the files in it): {}", dir.string(),
                    errno_text(search_error)),
        fmt::format("make {} searchable by {} (chmod a+rx), {}", dir.string(), user, or_remove));
  }
  return pass(name, fmt::format("{}: readable directory", dir.string()));
}

CheckResult check_nvls(const HostEnvironment& host, bool allow_nvls) {
  const char* name = "nccl_nvls";
  const std::string value =
      host.nccl_nvls_enable ? fmt::format("\"{}\"", *host.nccl_nvls_enable) : "unset";
  if (host.gpu_count <= 1) {
    return pass(name, fmt::format("{} GPU(s): NVLS does not apply (NCCL_NVLS_ENABLE {})",
                                  host.gpu_count, value));
  }
  if (allow_nvls) {
    return pass(name, fmt::format("{} GPUs, allow_nvls=true: NCCL_NVLS_ENABLE {} is accepted",
                                  host.gpu_count, value));
  }
  if (host.nccl_nvls_enable && *host.nccl_nvls_enable == "0") {
    return pass(name, fmt::format("{} GPUs, NCCL_NVLS_ENABLE=\"0\"", host.gpu_count));
  }
  return failure(
      name,
      fmt::format("{} GPUs and NCCL_NVLS_ENABLE is {}: NCCL would try NVLink SHARP (NVLS) "
                  "multicast, which reserves extra GPU memory and fails or hangs where the "
                  "node's multicast fabric is not set up",
                  host.gpu_count, value),
      "start the daemon with NCCL_NVLS_ENABLE=0 in its environment (e.g. Environment= in the "
      "systemd unit), or set allow_nvls: true in the daemon config if NVLS works on this node");
}

std::vector<CheckResult> run_preconditions(const PreconditionConfig& config) {
  return run_preconditions(config, probe_host_environment());
}

std::vector<CheckResult> run_preconditions(const PreconditionConfig& config,
                                           const HostEnvironment& host) {
  std::vector<CheckResult> results;
  const uint64_t min_free = config.min_free_bytes;
  results.push_back(check_writable_dir("state_dir", config.state_dir, "state_dir", min_free));
  results.push_back(
      check_writable_dir("checkpoint_root", config.checkpoint_root, "checkpoint_root", min_free));
  for (size_t i = 0; i < config.cache_dirs.size(); ++i) {
    const std::string field = fmt::format("cache_dirs[{}]", i);
    results.push_back(check_writable_dir(field, config.cache_dirs[i], field, min_free));
    if (results.back().status == Status::kPass) {
      results.push_back(check_plan_cache(fmt::format("plan_cache[{}]", i),
                                         config.cache_dirs[i] / "plans", field));
    }
  }
  for (size_t i = 0; i < config.data_roots.size(); ++i) {
    results.push_back(check_readable_dir(fmt::format("data_roots[{}]", i), config.data_roots[i]));
  }

  if (config.store_path.empty()) {
    results.push_back(failure("store_dir", "store_path is not configured",
                              "set store_path (or state_dir) in the daemon config"));
  } else {
    fs::path store_dir = config.store_path.parent_path();
    if (store_dir.empty()) store_dir = ".";
    results.push_back(check_writable_dir("store_dir", store_dir, "store_path", min_free));
    results.push_back(check_store_file(config.store_path));
  }

  results.push_back(check_nvls(host, config.allow_nvls));

  if (any_failed(results)) {
    append_skipped_cuda_checks(results, "not run: an earlier check failed");
  } else if (!config.check_cuda) {
    append_skipped_cuda_checks(results, "disabled (check_cuda=false)");
  } else {
#ifdef MEGACPP_HAVE_CUDA
    if (host.gpu_count == 0) {
      append_skipped_cuda_checks(
          results,
          "no NVIDIA GPU on this host (none under /proc/driver/nvidia/gpus or /dev, and no WSL2 "
          "/dev/dxg with /usr/lib/wsl/lib/libcuda.so)");
    } else {
      append_cuda_checks(results);
    }
#else
    append_skipped_cuda_checks(results, "built without CUDA");
#endif
  }
  return results;
}

bool all_passed(const std::vector<CheckResult>& results) {
  return std::none_of(results.begin(), results.end(),
                      [](const CheckResult& r) { return r.status == Status::kFail; });
}

std::string format_report(const std::vector<CheckResult>& results) {
  size_t name_width = std::string_view("check").size();
  size_t status_width = std::string_view("status").size();
  size_t detail_width = std::string_view("detail").size();
  for (const CheckResult& r : results) {
    name_width = std::max(name_width, r.name.size());
    status_width = std::max(status_width, to_string(r.status).size());
    detail_width = std::max(detail_width, r.detail.size());
  }
  std::string out;
  auto row = [&](std::string_view name, std::string_view status, std::string_view detail,
                 std::string_view fix) {
    std::string line = fmt::format("{:<{}}  {:<{}}  {:<{}}  {}", name, name_width, status,
                                   status_width, detail, detail_width, fix);
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line;
    out += '\n';
  };
  row("check", "status", "detail", "fix");
  row(std::string(name_width, '-'), std::string(status_width, '-'), std::string(detail_width, '-'),
      "---");
  for (const CheckResult& r : results) row(r.name, to_string(r.status), r.detail, r.fix);
  const size_t failed =
      static_cast<size_t>(std::count_if(results.begin(), results.end(), [](const CheckResult& r) {
        return r.status == Status::kFail;
      }));
  out += failed == 0 ? fmt::format("all {} checks passed or were skipped\n", results.size())
                     : fmt::format("{} of {} checks failed\n", failed, results.size());
  return out;
}

}  // namespace megacpp::preconditions
