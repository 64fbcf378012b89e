#pragma once
// A vector of numbers whose storage starts as zeros without being written. Large buffers
// come from calloc, which hands out untouched zero pages: a model's gradient buffer or an
// optimizer moment that a GPU job never touches on the host then costs neither time nor
// resident memory (zero-filling 1.5 GB took seconds before a job's first step).
//
// Rule that keeps it correct: value-initialization (ZeroedVector<T>(n)) writes nothing and
// relies on the fresh allocation being zero, so a ZeroedVector is sized once, when it is
// constructed. Shrinking and regrowing it in place (resize down, then up) would expose old
// values; assign(n, v) and every other constructing call do write.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace megacpp {

namespace zeroed_detail {
// calloc bypasses operator new: what is live is counted here instead, so that memory
// accounting (the training memory estimate's test) sees these buffers.
inline std::atomic<int64_t> live_bytes{0};
}  // namespace zeroed_detail

// Bytes held by every ZeroedVector of the process now.
inline int64_t zeroed_bytes_in_use() {
  return zeroed_detail::live_bytes.load();
}

template <typename T>
struct ZeroedAllocator {
  static_assert(std::is_arithmetic_v<T>, "all-zero bytes must mean the value 0");
  using value_type = T;
  ZeroedAllocator() = default;
  template <typename U>
  ZeroedAllocator(const ZeroedAllocator<U>&) noexcept {}
  T* allocate(size_t n) {
    void* memory = std::calloc(n, sizeof(T));
    if (memory == nullptr) throw std::bad_alloc();
    zeroed_detail::live_bytes += static_cast<int64_t>(n * sizeof(T));
    return static_cast<T*>(memory);
  }
  void deallocate(T* p, size_t n) noexcept {
    zeroed_detail::live_bytes -= static_cast<int64_t>(n * sizeof(T));
    std::free(p);
  }
  template <typename U>
  void construct(U*) noexcept {}  // the memory is zero already
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <typename U>
  friend bool operator==(const ZeroedAllocator&, const ZeroedAllocator<U>&) noexcept {
    return true;
  }
};

template <typename T>
using ZeroedVector = std::vector<T, ZeroedAllocator<T>>;

}  // namespace megacpp
