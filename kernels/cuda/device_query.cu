#include <cuda_runtime.h>

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

}  // namespace megacpp::cuda
