#pragma once
// Errors of the CUDA host code: MEGACPP_CUDA_CHECK around every CUDA runtime call,
// MEGACPP_CUDA_CHECK_LAUNCH after every kernel launch, and refuse() for the ops' own refusals
// (bad shapes, null pointers). All throw megacpp::Error.
//
// megacpp::fail formats through libfmt, whose compiled part megacpp_cuda does not link (and whose
// shared library precedes it on link lines): refuse() formats the same "{}" placeholders with
// iostreams instead.
//
// Plain C++ over the CUDA runtime API, so both nvcc (kernels/cuda/*.cu, through common.cuh) and
// the C++ compiler (the GPU tests) can include it.
#include <cuda_runtime.h>

#include <cstring>
#include <sstream>

#include "base/error.h"

namespace megacpp::cuda::detail {

inline void format_into(std::ostringstream& out, const char* format) {
  out << format;
}

template <class First, class... Rest>
void format_into(std::ostringstream& out, const char* format, const First& first,
                 const Rest&... rest) {
  const char* hole = std::strstr(format, "{}");
  if (hole == nullptr) {
    out << format;
    return;
  }
  out.write(format, hole - format);
  out << first;
  format_into(out, hole + 2, rest...);
}

template <class... Args>
[[noreturn]] void refuse(ErrorKind kind, const char* format, const Args&... args) {
  std::ostringstream out;
  format_into(out, format, args...);
  throw Error(kind, out.str());
}

// A status that says this machine cannot run the call (no usable device or driver, no kernel
// image for this GPU, not enough device memory) is a failed precondition a user can act on;
// any other failure means the code broke a rule of the API: an internal error.
inline ErrorKind error_kind(cudaError_t status) {
  switch (status) {
    case cudaErrorMemoryAllocation:
    case cudaErrorStubLibrary:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorNoDevice:
    case cudaErrorDeviceNotLicensed:
    case cudaErrorNoKernelImageForDevice:
    case cudaErrorJitCompilerNotFound:
    case cudaErrorUnsupportedPtxVersion:
    case cudaErrorSystemNotReady:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return ErrorKind::kFailedPrecondition;
    default:
      return ErrorKind::kInternal;
  }
}

// `file` from the source root ("kernels/cuda/x.cu"), not the build's absolute path. The root is
// what precedes kernels/cuda/check.h in this header's own __FILE__.
inline const char* source_path(const char* file) {
  const size_t own = std::strlen(__FILE__), tail = std::strlen("kernels/cuda/check.h");
  const size_t root = own >= tail ? own - tail : 0;
  return std::strncmp(file, __FILE__, root) == 0 ? file + root : file;
}

[[noreturn]] inline void call_failed(cudaError_t status, const char* expression, const char* file,
                                     int line) {
  refuse(error_kind(status), "CUDA call {} failed: {} ({}) at {}:{}", expression,
         cudaGetErrorString(status), cudaGetErrorName(status), source_path(file), line);
}

[[noreturn]] inline void launch_failed(cudaError_t status, const char* kernel, const char* file,
                                       int line) {
  refuse(error_kind(status), "launching kernel {} failed: {} ({}) at {}:{}", kernel,
         cudaGetErrorString(status), cudaGetErrorName(status), source_path(file), line);
}

}  // namespace megacpp::cuda::detail

// Evaluates a CUDA runtime call once; anything but cudaSuccess throws megacpp::Error naming the
// call as written, the runtime's message and the file and line.
#define MEGACPP_CUDA_CHECK(expression)                                                             \
  do {                                                                                             \
    const cudaError_t megacpp_cuda_status_ = (expression);                                         \
    if (megacpp_cuda_status_ != cudaSuccess) {                                                     \
      ::megacpp::cuda::detail::call_failed(megacpp_cuda_status_, #expression, __FILE__, __LINE__); \
    }                                                                                              \
  } while (0)

// Right after a launch: a launch reports its errors (bad configuration, too much shared memory,
// no image for this GPU) only through cudaGetLastError. kernel_name (a const char*) names it in
// the message.
#define MEGACPP_CUDA_CHECK_LAUNCH(kernel_name)                                            \
  do {                                                                                    \
    const cudaError_t megacpp_cuda_status_ = cudaGetLastError();                          \
    if (megacpp_cuda_status_ != cudaSuccess) {                                            \
      ::megacpp::cuda::detail::launch_failed(megacpp_cuda_status_, kernel_name, __FILE__, \
                                             __LINE__);                                   \
    }                                                                                     \
  } while (0)
