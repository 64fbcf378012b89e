#pragma once
// One device allocation carved into named buffers: a job's device memory is planned once (every
// buffer reserved with its size), allocated once, and never grows while steps run.
//
// reserve() records where the buffer's address is to be written; allocate() makes the one
// cudaMalloc and writes every address (each aligned to kAlignment, which cuBLASLt's and the
// vectorized kernels' loads want). The slots must stay where they are until allocate().
#include <cuda_runtime.h>

#include <algorithm>
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
    if (base_ != nullptr && owned_) cudaFree(base_);
  }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;

  template <class T>
  void reserve(T** slot, size_t count, std::string what) {
    if (base_ != nullptr)
      fail(ErrorKind::kInternal, "DeviceArena: {} reserved after allocate", what);
    const size_t bytes = (count * sizeof(T) + kAlignment - 1) / kAlignment * kAlignment;
    requests_.push_back({reinterpret_cast<void**>(slot), total_, bytes, std::move(what)});
    total_ += bytes;
  }

  // Into `memory` (bytes() of it, the caller's to free) where given, else one cudaMalloc.
  void allocate(void* memory = nullptr) {
    if (total_ == 0) return;
    if (memory != nullptr) {
      base_ = memory;
      owned_ = false;
      for (const Request& r : requests_) *r.slot = static_cast<char*>(base_) + r.offset;
      return;
    }
    const cudaError_t status = cudaMalloc(&base_, total_);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      fail(cuda::detail::error_kind(status),
           "cannot allocate the job's {} bytes of device memory ({}; the largest buffers: {}): "
           "lower batch or seqlen, or use a smaller model",
           total_, cudaGetErrorString(status), largest(3));
    }
    for (const Request& r : requests_) *r.slot = static_cast<char*>(base_) + r.offset;
  }

  size_t bytes() const { return total_; }

 private:
  struct Request {
    void** slot;
    size_t offset;
    size_t bytes;
    std::string what;
  };

  // "name N bytes, ..." for the `count` largest reservations: what a refusal should name.
  std::string largest(size_t count) const {
    std::vector<const Request*> sorted;
    for (const Request& r : requests_) sorted.push_back(&r);
    std::sort(sorted.begin(), sorted.end(),
              [](const Request* a, const Request* b) { return a->bytes > b->bytes; });
    std::string out;
    for (size_t i = 0; i < std::min(count, sorted.size()); ++i) {
      out += (i ? ", " : "") + sorted[i]->what + " " + std::to_string(sorted[i]->bytes) + " bytes";
    }
    return out;
  }
  std::vector<Request> requests_;
  size_t total_ = 0;
  void* base_ = nullptr;
  bool owned_ = true;
};

}  // namespace megacpp
