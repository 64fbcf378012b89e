#pragma once
// What the daemon records about itself when it starts: the environment receipt.
#include <filesystem>
#include <string>
#include <vector>

#include "daemon/job_manager.h"
#include "receipts/store.h"

namespace megacpp::daemon {

std::string now_iso8601();

// The boot receipt: build, compiler, CUDA runtime/driver, NCCL, cuDNN, devices,
// host, relevant environment. The CUDA versions are asked of CUDA (which opens the driver)
// only when `probe_gpus`, i.e. after the preconditions passed: a refused or checked boot
// records them empty and touches no GPU.
receipts::BootReceipt describe_boot(const std::vector<DeviceSlot>& devices, bool probe_gpus);

// The device inventory from the config: cpu slots, and GPUs when built with CUDA
// (queried only when probe_gpus, i.e. after the preconditions passed).
std::vector<DeviceSlot> inventory_devices(const DaemonConfig& config, bool probe_gpus);

// One daemon per state directory and per store: an exclusive flock on a lock file, held for the
// process's life and released by the kernel however it ends (kill -9 included), so a stale lock
// never blocks a restart. The file holds the holder's pid, for the message a second daemon
// prints. The descriptor is close-on-exec: executors, which outlive a killed daemon, must not
// keep holding it.
class DaemonLock {
 public:
  // `what` names the guarded thing in messages ("state_dir /srv/megacpp"). Throws
  // Error(kFailedPrecondition) naming it, the holder's pid and the lock file when another process
  // holds the lock, Error(kIo) when the file cannot be opened or locked.
  DaemonLock(const std::filesystem::path& lock_file, std::string what);
  ~DaemonLock();
  DaemonLock(const DaemonLock&) = delete;
  DaemonLock& operator=(const DaemonLock&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

// Throws Error(kFailedPrecondition) naming `field`, the address and the port's holder when the
// TCP address (host:port, as the config allows) cannot be bound exclusively right now. unix:
// addresses and port 0 are not checked; an address that does not resolve is left to the server.
void check_port_free(const std::string& field, const std::string& address);

// The process listening on TCP `port` (this host, any address), as "pid N (name)", or "" when
// none is visible (another user's process, or no listener).
std::string describe_port_holder(int port);

}  // namespace megacpp::daemon
