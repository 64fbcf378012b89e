#pragma once
// What the daemon records about itself when it starts: the environment receipt.
#include <string>
#include <vector>

#include "daemon/job_manager.h"
#include "receipts/store.h"

namespace megacpp::daemon {

std::string now_iso8601();

// The boot receipt: build, compiler, CUDA runtime/driver, NCCL, cuDNN, devices,
// host, relevant environment. Never initializes CUDA unless `probe_gpus`.
receipts::BootReceipt describe_boot(const std::vector<DeviceSlot>& devices);

// The device inventory from the config: cpu slots, and GPUs when built with CUDA
// (queried only when probe_gpus, i.e. after the preconditions passed).
std::vector<DeviceSlot> inventory_devices(const DaemonConfig& config, bool probe_gpus);

}  // namespace megacpp::daemon
