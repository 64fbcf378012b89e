#pragma once
// The GPUs this process can see, read through the CUDA runtime. Compiled only
// when MEGACPP_CUDA is on; callers test MEGACPP_HAVE_CUDA.
#include <string>
#include <vector>

namespace megacpp::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int compute_major = 0;
  int compute_minor = 0;
  size_t total_memory_bytes = 0;
  int multiprocessors = 0;
};

struct RuntimeInfo {
  int driver_version = 0;   // e.g. 13000; 0 when no driver is installed
  int runtime_version = 0;  // the CUDA runtime this binary was built with
  std::vector<DeviceInfo> devices;
  std::string error;  // why no device is usable, when devices is empty
};

RuntimeInfo query_devices();

// Adds a to b elementwise on device `device`: a minimal real kernel the GPU tests
// use to prove that the binary carries code for the device's architecture.
// Returns an empty string on success, else the CUDA error.
std::string vector_add_on_device(int device, const std::vector<float>& a, std::vector<float>& b);

// Asks the runtime for the attributes of a kernel in this binary on `device` without launching
// it: fails exactly when the binary carries neither SASS for the device's compute capability nor
// PTX the driver can compile for it. Returns an empty string when the kernel image is usable,
// else the CUDA error (cudaErrorNoKernelImageForDevice or cudaErrorInvalidDeviceFunction for a
// missing image; any other error, e.g. an invalid device index, is returned as well).
std::string probe_kernel_image(int device);

}  // namespace megacpp::cuda
