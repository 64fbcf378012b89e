#include "daemon/boot.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <dlfcn.h>

#include "runtime/common/version.h"

#ifdef MEGACPP_HAVE_CUDA
#include "kernels/cuda/device_query.h"
#endif

namespace megacpp::daemon {

using nlohmann::json;

std::string now_iso8601() { return receipts::utc_now(); }

namespace {

// The version of a shared library's exported get-version function, or "" when the
// library is absent. Loading is harmless: neither library touches a device here.
std::string library_version(const char* library, const char* symbol, bool nccl_style) {
  void* handle = ::dlopen(library, RTLD_LAZY | RTLD_LOCAL);
  if (handle == nullptr) return "";
  std::string out = "present";
  if (void* fn = ::dlsym(handle, symbol)) {
    if (nccl_style) {
      int version = 0;
      if (reinterpret_cast<int (*)(int*)>(fn)(&version) == 0) out = std::to_string(version);
    } else {
      out = std::to_string(reinterpret_cast<size_t (*)()>(fn)());
    }
  }
  ::dlclose(handle);
  return out;
}

}  // namespace

std::vector<DeviceSlot> inventory_devices(const DaemonConfig& config, bool probe_gpus) {
  std::vector<DeviceSlot> devices;
  for (int i = 0; i < config.devices.cpu_slots; ++i) {
    devices.push_back({fmt::format("cpu:{}", i), "cpu", "cpu slot", 0, ""});
  }
#ifdef MEGACPP_HAVE_CUDA
  if (probe_gpus) {
    const auto info = cuda::query_devices();
    for (const auto& d : info.devices) {
      const bool wanted = config.devices.gpus_auto ||
                          std::find(config.devices.gpus.begin(), config.devices.gpus.end(), d.index) !=
                              config.devices.gpus.end();
      if (wanted) devices.push_back({fmt::format("cuda:{}", d.index), "cuda", d.name, d.total_memory_bytes, ""});
    }
  }
#else
  (void)probe_gpus;
#endif
  return devices;
}

receipts::BootReceipt describe_boot(const std::vector<DeviceSlot>& devices) {
  receipts::BootReceipt b;
  b.started_at = now_iso8601();
  b.version = version_string();
  b.git_revision = MEGACPP_GIT_REVISION;
  b.compiler = fmt::format("gcc {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
#ifdef NDEBUG
  b.build_type = "release";
#else
  b.build_type = "debug";
#endif
#ifdef MEGACPP_HAVE_CUDA
  const auto info = cuda::query_devices();
  b.cuda_runtime = std::to_string(info.runtime_version);
  b.cuda_driver = std::to_string(info.driver_version);
#endif
  b.nccl = library_version("libnccl.so.2", "ncclGetVersion", true);
  b.cudnn = library_version("libcudnn.so.9", "cudnnGetVersion", false);
  b.devices = json::array();
  for (const auto& d : devices) {
    b.devices.push_back({{"id", d.id}, {"kind", d.kind}, {"name", d.name}, {"memory_bytes", d.memory_bytes}});
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  b.hostname = host;
  b.environment = json::object();
  for (const char* name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
                           "NCCL_NVLS_ENABLE", "NCCL_DEBUG", "LD_LIBRARY_PATH"}) {
    if (const char* v = std::getenv(name)) b.environment[name] = v;
  }
  b.environment["cores"] = ::sysconf(_SC_NPROCESSORS_ONLN);
  b.status = "starting";
  return b;
}

}  // namespace megacpp::daemon
