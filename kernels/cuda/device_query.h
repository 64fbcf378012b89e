#pragma once
// The GPUs this process can see, read through the CUDA runtime. Compiled only
// when MEGACPP_CUDA is on; callers test MEGACPP_HAVE_CUDA.
#include <cstddef>
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

// Shared memory as megacpp's own kernels plan with it on one device (cuBLAS and cuDNN read the
// device for themselves).
struct SharedMemoryLimits {
  size_t per_sm = 0;     // cudaDevAttrMaxSharedMemoryPerMultiprocessor
  size_t per_block = 0;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
  bool capped = false;   // lowered by kSharedMemoryCapVariable
};

// Set to a number of bytes, this lowers the shared memory per SM that megacpp's kernels plan
// with (the scan's plans; our attention kernels' fixed needs are checked against it), and the
// opt-in per block with it (less the device's own reservation per block), so that a GPU runs the
// plans of one with less: 167936 on an H100 gives an A100's (167936 per SM, 166912 per block),
// the Ampere plans checked against the oracle where no A100 is lent. Residency, clocks and
// bandwidth stay the GPU's own.
inline constexpr const char* kSharedMemoryCapVariable = "MEGACPP_CUDA_SHARED_MEMORY_PER_SM";

// `device`'s figures lowered to the cap `value` (the variable's text; null or empty: no cap).
// Refuses (megacpp::Error kInvalidArgument, naming the variable, the value and the range) anything
// but a whole number of bytes from 49152 (what any kernel may take without opting in) to the
// device's own figure per SM.
SharedMemoryLimits cap_shared_memory(const SharedMemoryLimits& device, const char* value);

// `device`'s figures, capped by kSharedMemoryCapVariable when it is set (throws like
// cap_shared_memory).
SharedMemoryLimits shared_memory_limits(int device);
// The same for the calling thread's current device (cudaGetDevice).
SharedMemoryLimits current_shared_memory_limits();

// " (capped by MEGACPP_CUDA_SHARED_MEMORY_PER_SM)" for capped limits, else "": the tail of a
// refusal that names what the device allows.
std::string cap_note(const SharedMemoryLimits& limits);

}  // namespace megacpp::cuda
