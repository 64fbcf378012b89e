#include <cuda_runtime.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>

#include "kernels/cuda/check.h"
#include "kernels/cuda/device_query.h"

namespace megacpp::cuda {

RuntimeInfo query_devices() {
  RuntimeInfo info;
  cudaDriverGetVersion(&info.driver_version);
  cudaRuntimeGetVersion(&info.runtime_version);
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    info.error = cudaGetErrorString(status);
    return info;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    info.devices.push_back(
        {i, prop.name, prop.major, prop.minor, prop.totalGlobalMem, prop.multiProcessorCount});
  }
  return info;
}

namespace {
__global__ void vector_add_kernel(const float* a, float* b, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] += a[i];
}
}  // namespace

std::string vector_add_on_device(int device, const std::vector<float>& a, std::vector<float>& b) {
  if (a.size() != b.size()) return "vector_add_on_device: sizes differ";
  cudaError_t status = cudaSetDevice(device);
  const size_t bytes = a.size() * sizeof(float);
  float* da = nullptr;
  float* db = nullptr;
  if (status == cudaSuccess) status = cudaMalloc(&da, bytes);
  if (status == cudaSuccess) status = cudaMalloc(&db, bytes);
  if (status == cudaSuccess) status = cudaMemcpy(da, a.data(), bytes, cudaMemcpyHostToDevice);
  if (status == cudaSuccess) status = cudaMemcpy(db, b.data(), bytes, cudaMemcpyHostToDevice);
  if (status == cudaSuccess) {
    const int n = static_cast<int>(a.size());
    vector_add_kernel<<<(n + 255) / 256, 256>>>(da, db, n);
    status = cudaGetLastError();
  }
  if (status == cudaSuccess) status = cudaMemcpy(b.data(), db, bytes, cudaMemcpyDeviceToHost);
  cudaFree(da);
  cudaFree(db);
  return status == cudaSuccess ? std::string() : std::string(cudaGetErrorString(status));
}

std::string probe_kernel_image(int device) {
  cudaError_t status = cudaSetDevice(device);
  if (status == cudaSuccess) {
    cudaFuncAttributes attributes{};
    status = cudaFuncGetAttributes(&attributes, vector_add_kernel);
  }
  if (status == cudaSuccess) return std::string();
  return std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
}

SharedMemoryLimits cap_shared_memory(const SharedMemoryLimits& device, const char* value) {
  if (value == nullptr || *value == '\0') return device;
  constexpr size_t kLeast = 48 * 1024;
  const char* end = value + std::strlen(value);
  unsigned long long bytes = 0;
  const auto [stop, error] = std::from_chars(value, end, bytes);
  if (error != std::errc() || stop != end || bytes < kLeast || bytes > device.per_sm) {
    detail::refuse(ErrorKind::kInvalidArgument,
                   "{}='{}' must be a whole number of bytes from {} to this device's {} per SM",
                   kSharedMemoryCapVariable, value, kLeast, device.per_sm);
  }
  SharedMemoryLimits capped = device;
  capped.per_sm = static_cast<size_t>(bytes);
  // The device keeps back per_sm − per_block for each block (1 KiB on Ampere and Hopper).
  const size_t reserved = device.per_sm > device.per_block ? device.per_sm - device.per_block : 0;
  capped.per_block = std::min(device.per_block, capped.per_sm - reserved);
  capped.capped = true;
  return capped;
}

SharedMemoryLimits shared_memory_limits(int device) {
  int per_sm = 0, per_block = 0;
  MEGACPP_CUDA_CHECK(
      cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device));
  MEGACPP_CUDA_CHECK(
      cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return cap_shared_memory({static_cast<size_t>(per_sm), static_cast<size_t>(per_block), false},
                           std::getenv(kSharedMemoryCapVariable));
}

SharedMemoryLimits current_shared_memory_limits() {
  int device = 0;
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device));
  return shared_memory_limits(device);
}

std::string cap_note(const SharedMemoryLimits& limits) {
  return limits.capped ? std::string(" (capped by ") + kSharedMemoryCapVariable + ")" : "";
}

}  // namespace megacpp::cuda
