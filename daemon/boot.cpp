#include "daemon/boot.h"

#include <fcntl.h>
#include <netdb.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <unistd.h>

#include <dlfcn.h>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <spdlog/spdlog.h>

#include "base/error.h"
#include "base/version.h"

#ifdef MEGACPP_HAVE_CUDA
#include "kernels/cuda/device_query.h"
#endif

namespace megacpp::daemon {

using nlohmann::json;

std::string now_iso8601() {
  return receipts::utc_now();
}

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
                          std::find(config.devices.gpus.begin(), config.devices.gpus.end(),
                                    d.index) != config.devices.gpus.end();
      if (wanted)
        devices.push_back(
            {fmt::format("cuda:{}", d.index), "cuda", d.name, d.total_memory_bytes, ""});
    }
  }
#else
  (void)probe_gpus;
#endif
  return devices;
}

receipts::BootReceipt describe_boot(const std::vector<DeviceSlot>& devices, bool probe_gpus) {
  receipts::BootReceipt b;
  b.started_at = now_iso8601();
  b.version = version_string();
  b.git_revision = git_revision();
  b.compiler = fmt::format("gcc {}.{}.{}", __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__);
#ifdef NDEBUG
  b.build_type = "release";
#else
  b.build_type = "debug";
#endif
#ifdef MEGACPP_HAVE_CUDA
  if (probe_gpus) {
    const auto info = cuda::query_devices();
    b.cuda_runtime = std::to_string(info.runtime_version);
    b.cuda_driver = std::to_string(info.driver_version);
  }
#else
  (void)probe_gpus;
#endif
  b.nccl = library_version("libnccl.so.2", "ncclGetVersion", true);
  b.cudnn = library_version("libcudnn.so.9", "cudnnGetVersion", false);
  b.devices = json::array();
  for (const auto& d : devices) {
    b.devices.push_back(
        {{"id", d.id}, {"kind", d.kind}, {"name", d.name}, {"memory_bytes", d.memory_bytes}});
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  b.hostname = host;
  b.environment = json::object();
  for (const char* name :
       {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
        "NCCL_DEBUG", "LD_LIBRARY_PATH", "MEGACPP_CUDA_SHARED_MEMORY_PER_SM"}) {
    if (const char* v = std::getenv(name)) b.environment[name] = v;
  }
  b.environment["cores"] = ::sysconf(_SC_NPROCESSORS_ONLN);
  b.status = "starting";
  return b;
}

DaemonLock::DaemonLock(const std::filesystem::path& lock_file, std::string what)
    : path_(lock_file) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    fail(ErrorKind::kIo, "{}: cannot open the daemon lock file {}: {}", what, path_.string(),
         std::strerror(errno));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    char buffer[32] = {};
    const ssize_t n = ::pread(fd_, buffer, sizeof(buffer) - 1, 0);
    std::string holder = n > 0 ? std::string(buffer, static_cast<size_t>(n)) : "";
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd_);
    fd_ = -1;
    if (error == EWOULDBLOCK) {
      fail(ErrorKind::kFailedPrecondition,
           "{} is in use by another megacppd ({}; lock file {}): stop that daemon first, or give "
           "this one its own state_dir and store_path",
           what, holder.empty() ? "pid not yet written" : "pid " + holder, path_.string());
    }
    fail(ErrorKind::kIo, "{}: cannot lock {}: {}", what, path_.string(), std::strerror(error));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) != 0 ||
      ::pwrite(fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    spdlog::warn("daemon lock {}: cannot record this daemon's pid: {}", path_.string(),
                 std::strerror(errno));
  }
}

DaemonLock::~DaemonLock() {
  if (fd_ >= 0) ::close(fd_);
}

namespace {

// Inodes of the TCP sockets listening on `port`, from /proc/net/tcp and tcp6 (state 0A).
std::set<std::string> listening_inodes(int port) {
  std::set<std::string> inodes;
  for (const char* table : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(table);
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      fields >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >>
          timeout >> inode;
      const auto colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;
      if (std::stoi(local.substr(colon + 1), nullptr, 16) == port) inodes.insert(inode);
    }
  }
  return inodes;
}

}  // namespace

void check_port_free(const std::string& field, const std::string& address) {
  if (address.starts_with("unix:")) return;
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return;
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (port == "0") return;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0) {
    return;
  }
  bool in_use = false;
  for (const addrinfo* a = found; a != nullptr && !in_use; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    int rc = ::bind(fd, a->ai_addr, a->ai_addrlen);
    if (rc == 0) rc = ::listen(fd, 1);
    in_use = rc != 0 && errno == EADDRINUSE;
    ::close(fd);
  }
  ::freeaddrinfo(found);
  if (in_use) {
    const std::string holder = describe_port_holder(std::stoi(port));
    fail(ErrorKind::kFailedPrecondition,
         "{} {}: the port is in use{}: only one process may serve it (a second megacppd needs "
         "its own ports)",
         field, address, holder.empty() ? "" : " by " + holder);
  }
}

std::string describe_port_holder(int port) {
  try {
    const std::set<std::string> inodes = listening_inodes(port);
    if (inodes.empty()) return "";
    std::error_code ec;
    for (const auto& process : std::filesystem::directory_iterator("/proc", ec)) {
      const std::string pid = process.path().filename();
      if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
      std::error_code fd_ec;
      for (const auto& fd : std::filesystem::directory_iterator(process.path() / "fd", fd_ec)) {
        std::error_code link_ec;
        const std::string target = std::filesystem::read_symlink(fd.path(), link_ec).string();
        if (link_ec || !target.starts_with("socket:[")) continue;
        if (!inodes.count(target.substr(8, target.size() - 9))) continue;
        std::string name;
        std::getline(std::ifstream(process.path() / "comm"), name);
        return fmt::format("pid {} ({})", pid, name);
      }
    }
  } catch (const std::exception&) {
    // Only a better message was at stake.
  }
  return "";
}

}  // namespace megacpp::daemon
