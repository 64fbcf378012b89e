#pragma once
// Which kernels compute a CUDA job's attention: a train job's "attention" field, the benches'
// --attention/--engine flags, CudaModelOptions::attention. Header-only so that the CPU-only build
// (which has no CUDA model) still validates a job file that names one.
#include <string>
#include <string_view>

#include "base/error.h"

namespace megacpp {

enum class AttentionEngine {
  kCudnn,    // cuDNN's fused flash attention (kernels/cuda/attention_cudnn.h), the default
  kMegacpp,  // our own flash-style kernels (kernels/cuda/attention.h)
};

inline const char* to_string(AttentionEngine engine) {
  return engine == AttentionEngine::kCudnn ? "cudnn" : "megacpp";
}

// `field` names where the value came from, for the error (Error(kInvalidArgument)).
inline AttentionEngine parse_attention_engine(std::string_view name, std::string_view field) {
  if (name == "cudnn") return AttentionEngine::kCudnn;
  if (name == "megacpp") return AttentionEngine::kMegacpp;
  throw Error(ErrorKind::kInvalidArgument,
              std::string(field) + "=\"" + std::string(name) +
                  "\" must be \"cudnn\" (cuDNN's fused flash attention) or \"megacpp\" "
                  "(megacpp's own kernels)");
}

}  // namespace megacpp
