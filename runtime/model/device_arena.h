#pragma once
// One device allocation carved into named buffers: a job's device memory is planned once (every
// buffer reserved with its size), allocated once, and never grows while steps run.
//
// reserve() records where the buffer's address is to be written; allocate() makes the one
// cudaMalloc and writes every address (each aligned to kAlignment, which cuBLASLt's and the
// vectorized kernels' loads want). The slots must stay where they are until allocate().
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cuda/check.h"

namespace megacpp {

class DeviceArena {
 public:
  static constexpr size_t kAlignment = 256;

  DeviceArena() = default;
  ~DeviceArena() {
    if (base_ != nullptr) cudaFree(base_);
  }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  template <class T>
  void reserve(T** slot, size_t count, std::string what) {
    if (base_ != nullptr)
      fail(ErrorKind::kInternal, "DeviceArena: {} reserved after allocate", what);
    const size_t bytes = (count * sizeof(T) + kAlignment - 1) / kAlignment * kAlignment;
    requests_.push_back({reinterpret_cast<void**>(slot), total_, std::move(what)});
    total_ += bytes;
  }

  void allocate() {
    if (total_ == 0) return;
    const cudaError_t status = cudaMalloc(&base_, total_);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      fail(cuda::detail::error_kind(status),
           "cannot allocate the job's {} bytes of device memory ({}): lower batch or seqlen, or "
           "use a smaller model",
           total_, cudaGetErrorString(status));
    }
    for (const Request& r : requests_) *r.slot = static_cast<char*>(base_) + r.offset;
  }

  size_t bytes() const { return total_; }

 private:
  struct Request {
    void** slot;
    size_t offset;
    std::string what;
  };
  std::vector<Request> requests_;
  size_t total_ = 0;
  void* base_ = nullptr;
};

}  // namespace megacpp
