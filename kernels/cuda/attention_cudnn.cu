// Causal GQA attention through cuDNN's fused flash attention: see attention_cudnn.h. Host code
// only. The graph below is the one cuDNN's attention engines match; the order of the nodes, the
// virtual tensors' types (fp32 scores, bf16 P and dS where they feed a matmul) and the by-value
// scalars follow how cuDNN documents and recognises scaled dot-product attention.
#include <cuda_runtime.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <sstream>
#include <utility>
#include <vector>

#include "kernels/cuda/attention_cudnn.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/gemm_plan_cache.h"

namespace megacpp::cuda {

namespace {

using detail::refuse;

// Bumped whenever the graphs built below change: a cached plan of another graph is never read.
constexpr int kGraphVersion = 1;
// cuDNN's own workspace beyond the terms cudnn_allowance names.
constexpr size_t kCudnnWorkspaceSlack = size_t{64} << 20;
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) {
  return (bytes + kAlign - 1) / kAlign * kAlign;
}

std::string last_cudnn_error() {
  char text[1024] = {0};
  cudnnGetLastErrorString(text, sizeof(text));
  return text;
}

void check(cudnnStatus_t status, const char* what) {
  if (status == CUDNN_STATUS_SUCCESS) return;
  // cuDNN 9 reports sub-codes (3001 ..., "not supported: this shape", "...: this architecture"):
  // their category says what a user can do about it.
  const ErrorKind kind = CUDNN_STATUS_CATEGORY(status) == CUDNN_STATUS_NOT_SUPPORTED
                             ? ErrorKind::kFailedPrecondition
                             : ErrorKind::kInternal;
  refuse(kind, "CausalAttentionCudnn: cuDNN {} failed: {} ({})", what, cudnnGetErrorString(status),
         last_cudnn_error());
}

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    check(cudnnBackendCreateDescriptor(type, &d_), "descriptor creation");
  }
  ~Desc() {
    if (d_ != nullptr) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(Desc&& other) noexcept : d_(std::exchange(other.d_, nullptr)) {}
  Desc& operator=(Desc&&) = delete;
  Desc(const Desc&) = delete;

  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, int64_t count,
            const void* values) {
    check(cudnnBackendSetAttribute(d_, name, type, count, values), "attribute setting");
    return *this;
  }
  template <class T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T& value) {
    return set(name, type, 1, &value);
  }
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value);
  }
  Desc& finalize(const char* what) {
    check(cudnnBackendFinalize(d_), what);
    return *this;
  }
  cudnnBackendDescriptor_t get() const { return d_; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// The user-visible tensors' ids: the variant pack binds pointers to them.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kDO,
  kDQ,
  kDK,
  kDV,
  kRowDot,
  kDQAccum,
  kScale,
  kMaskValue,
  kOne,
  kFirstVirtual = 100,
};

// A graph under construction: its tensors and operations, kept alive until it is finalised.
class Graph {
 public:
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, Dims dims, Dims strides,
                                  bool is_virtual = false, bool by_value = false) {
    Desc t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data())
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data())
        .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid)
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, alignment)
        .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, is_virtual);
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, true);
    t.finalize("tensor descriptor");
    tensors_.push_back(std::move(t));
    return tensors_.back().get();
  }
  // An intermediate: never in memory, its id only names it inside the graph.
  cudnnBackendDescriptor_t temp(cudnnDataType_t type, Dims dims, Dims strides) {
    return tensor(next_virtual_++, type, dims, strides, true);
  }
  // A by-value fp32 scalar, its value passed in the variant pack.
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                 cudnnBackendDescriptor_t b = nullptr, cudnnBackendDescriptor_t t = nullptr,
                 cudnnDataType_t precision = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    Desc pw(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, mode)
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, precision);
    if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, axis);
    pw.finalize("pointwise descriptor");
    Desc op(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    const float one = 1.0f;
    op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.get())
        .set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, one)
        .set(CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, one);
    if (b != nullptr) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t != nullptr) op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    op.finalize("pointwise operation");
    keep_.push_back(std::move(pw));
    ops_.push_back(std::move(op));
  }

  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    Desc mm(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT)
        .finalize("matmul descriptor");
    Desc op(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
        .set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
        .set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
        .set(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.get())
        .finalize("matmul operation");
    keep_.push_back(std::move(mm));
    ops_.push_back(std::move(op));
  }

  void reduction(cudnnReduceTensorOp_t reduce, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t y) {
    Desc r(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    r.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, reduce)
        .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT);
    if (cudnnGetVersion() >= 91100) {
      r.set(CUDNN_ATTR_REDUCTION_IS_DETERMINISTIC, CUDNN_TYPE_BOOLEAN, false);
    }
    r.finalize("reduction descriptor");
    Desc op(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
        .set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)
        .set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, r.get())
        .finalize("reduction operation");
    keep_.push_back(std::move(r));
    ops_.push_back(std::move(op));
  }

  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    Desc op(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op.set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x)
        .set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y)
        .finalize("reshape operation");
    ops_.push_back(std::move(op));
  }

  Desc finalize(cudnnHandle_t handle) {
    std::vector<cudnnBackendDescriptor_t> ops;
    for (const Desc& op : ops_) ops.push_back(op.get());
    Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph
        .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
             static_cast<int64_t>(ops.size()), ops.data())
        .set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle)
        .finalize("operation graph");
    return graph;
  }

 private:
  std::vector<Desc> tensors_;
  std::vector<Desc> keep_;
  std::vector<Desc> ops_;
  int64_t next_virtual_ = kFirstVirtual;
};

// The causal mask on `scores` [b, h, sq, skv]: row ≥ column keeps the score, else mask_value.
cudnnBackendDescriptor_t causal_mask(Graph& g, cudnnBackendDescriptor_t scores,
                                     cudnnBackendDescriptor_t mask_value, Dims dims, Dims strides) {
  cudnnBackendDescriptor_t row = g.temp(CUDNN_DATA_INT32, dims, strides);
  cudnnBackendDescriptor_t column = g.temp(CUDNN_DATA_INT32, dims, strides);
  cudnnBackendDescriptor_t keep = g.temp(CUDNN_DATA_BOOLEAN, dims, strides);
  cudnnBackendDescriptor_t masked = g.temp(CUDNN_DATA_FLOAT, dims, strides);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, row, nullptr, nullptr, CUDNN_DATA_FLOAT, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scores, column, nullptr, nullptr, CUDNN_DATA_FLOAT, 3);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, keep, column, nullptr, CUDNN_DATA_BOOLEAN);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, scores, masked, mask_value, keep);
  return masked;
}

// The tensors' shapes and strides, in cuDNN's [batch, heads, rows, columns] order.
struct Geometry {
  int64_t b, s, hq, hkv, d, q_stride, kv_stride;

  Dims q_dims() const { return {b, hq, s, d}; }
  Dims kv_dims() const { return {b, hkv, s, d}; }
  Dims kv_transposed_dims() const { return {b, hkv, d, s}; }
  Dims q_strides() const { return {s * q_stride, d, q_stride, 1}; }
  Dims kv_strides() const { return {s * kv_stride, d, kv_stride, 1}; }
  Dims kv_transposed_strides() const { return {s * kv_stride, d, 1, kv_stride}; }
  Dims o_strides() const { return {s * hq * d, d, hq * d, 1}; }
  Dims score_dims() const { return {b, hq, s, s}; }
  Dims score_strides() const { return {hq * s * s, s * s, s, 1}; }
  Dims score_transposed_dims() const { return {b, hq, s, s}; }
  Dims score_transposed_strides() const { return {hq * s * s, s * s, 1, s}; }
  Dims row_dims() const { return {b, hq, s, 1}; }
  Dims row_strides() const { return {hq * s, s, 1, 1}; }
  Dims full_head_strides() const { return {hq * s * d, s * d, d, 1}; }
};

// The tensors both graphs bind: Q, Kᵀ (K's memory in the order Q·Kᵀ reads it), O, the lse
// statistics and the by-value scale and mask value.
struct Shared {
  cudnnBackendDescriptor_t q, k_t, o, stats, scale, mask_value;
};

Shared shared_tensors(Graph& g, const Geometry& x) {
  return {g.tensor(kQ, CUDNN_DATA_BFLOAT16, x.q_dims(), x.q_strides()),
          g.tensor(kK, CUDNN_DATA_BFLOAT16, x.kv_transposed_dims(), x.kv_transposed_strides()),
          g.tensor(kO, CUDNN_DATA_BFLOAT16, x.q_dims(), x.o_strides()),
          g.tensor(kStats, CUDNN_DATA_FLOAT, x.row_dims(), x.row_strides()),
          g.scalar(kScale),
          g.scalar(kMaskValue)};
}

void build_forward(Graph& g, const Geometry& x) {
  const auto [q, k_t, o, stats, scale, mask_value] = shared_tensors(g, x);
  cudnnBackendDescriptor_t v = g.tensor(kV, CUDNN_DATA_BFLOAT16, x.kv_dims(), x.kv_strides());
  const Dims sd = x.score_dims(), ss = x.score_strides(), rd = x.row_dims(), rs = x.row_strides();

  cudnnBackendDescriptor_t scores = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.matmul(q, k_t, scores);
  cudnnBackendDescriptor_t scaled = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, scaled, scale);
  cudnnBackendDescriptor_t masked = causal_mask(g, scaled, mask_value, sd, ss);
  cudnnBackendDescriptor_t row_max = g.temp(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, row_max);
  cudnnBackendDescriptor_t shifted = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, masked, shifted, row_max);
  cudnnBackendDescriptor_t exps = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, exps);
  cudnnBackendDescriptor_t row_sum = g.temp(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, exps, row_sum);
  cudnnBackendDescriptor_t log_sum = g.temp(CUDNN_DATA_FLOAT, rd, rs);
  g.pointwise(CUDNN_POINTWISE_LOG, row_sum, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, row_max, stats, log_sum);
  // P feeds the second matmul as its A operand, which the engines take in the io type.
  cudnnBackendDescriptor_t probabilities = g.temp(CUDNN_DATA_BFLOAT16, sd, ss);
  g.pointwise(CUDNN_POINTWISE_DIV, exps, probabilities, row_sum);
  g.matmul(probabilities, v, o);
}

void build_backward(Graph& g, const Geometry& x, bool deterministic) {
  const auto [q, k_t, o, stats, scale, mask_value] = shared_tensors(g, x);
  cudnnBackendDescriptor_t v_t =
      g.tensor(kV, CUDNN_DATA_BFLOAT16, x.kv_transposed_dims(), x.kv_transposed_strides());
  cudnnBackendDescriptor_t d_o = g.tensor(kDO, CUDNN_DATA_BFLOAT16, x.q_dims(), x.o_strides());
  cudnnBackendDescriptor_t d_q = g.tensor(kDQ, CUDNN_DATA_BFLOAT16, x.q_dims(), x.q_strides());
  cudnnBackendDescriptor_t d_k = g.tensor(kDK, CUDNN_DATA_BFLOAT16, x.kv_dims(), x.kv_strides());
  cudnnBackendDescriptor_t d_v = g.tensor(kDV, CUDNN_DATA_BFLOAT16, x.kv_dims(), x.kv_strides());
  cudnnBackendDescriptor_t row_dot =
      g.tensor(kRowDot, CUDNN_DATA_FLOAT, x.row_dims(), x.row_strides());
  cudnnBackendDescriptor_t one = g.scalar(kOne);
  const Dims sd = x.score_dims(), ss = x.score_strides(), rd = x.row_dims(), rs = x.row_strides();

  // rowsum(dO ⊙ O), the softmax backward's dot term.
  cudnnBackendDescriptor_t products = g.temp(CUDNN_DATA_FLOAT, x.q_dims(), x.full_head_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, products, o);
  cudnnBackendDescriptor_t dots = g.temp(CUDNN_DATA_FLOAT, rd, rs);
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, products, dots);
  g.pointwise(CUDNN_POINTWISE_MUL, dots, row_dot, one);

  // P recomputed: exp(scale · Q·Kᵀ − lse) under the causal mask.
  cudnnBackendDescriptor_t scores = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.matmul(q, k_t, scores);
  cudnnBackendDescriptor_t scaled = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, scores, scaled, scale);
  cudnnBackendDescriptor_t shifted = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, scaled, shifted, stats);
  cudnnBackendDescriptor_t masked = causal_mask(g, shifted, mask_value, sd, ss);
  cudnnBackendDescriptor_t probabilities = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_EXP, masked, probabilities);

  // A kv-head gradient a·b: with GQA computed per q head and summed over each group.
  const auto kv_gradient = [&](cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                               cudnnBackendDescriptor_t gradient) {
    if (x.hq == x.hkv) {
      g.matmul(a, b, gradient);
      return;
    }
    cudnnBackendDescriptor_t per_q_head =
        g.temp(CUDNN_DATA_BFLOAT16, x.q_dims(), x.full_head_strides());
    g.matmul(a, b, per_q_head);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, per_q_head, gradient);
  };

  // dV = Pᵀ·dO.
  cudnnBackendDescriptor_t p_t =
      g.temp(CUDNN_DATA_BFLOAT16, x.score_transposed_dims(), x.score_transposed_strides());
  g.reshape(probabilities, p_t);
  kv_gradient(p_t, d_o, d_v);

  // dS = P ⊙ (dO·Vᵀ − rowsum) · scale.
  cudnnBackendDescriptor_t d_p = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.matmul(d_o, v_t, d_p);
  cudnnBackendDescriptor_t centred = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_SUB, d_p, centred, row_dot);
  cudnnBackendDescriptor_t weighted = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, centred, weighted, probabilities);
  cudnnBackendDescriptor_t d_s = g.temp(CUDNN_DATA_FLOAT, sd, ss);
  g.pointwise(CUDNN_POINTWISE_MUL, weighted, d_s, scale);

  // dK = dSᵀ·Q.
  cudnnBackendDescriptor_t d_s_t =
      g.temp(CUDNN_DATA_BFLOAT16, x.score_transposed_dims(), x.score_transposed_strides());
  g.reshape(d_s, d_s_t);
  kv_gradient(d_s_t, q, d_k);

  // dQ = dS·K: K is the Kᵀ operand viewed back in its own order.
  cudnnBackendDescriptor_t k = g.temp(CUDNN_DATA_FLOAT, x.kv_dims(), x.kv_strides());
  g.reshape(k_t, k);
  if (deterministic) {
    g.matmul(d_s, k, d_q);
  } else {
    cudnnBackendDescriptor_t accumulator =
        g.tensor(kDQAccum, CUDNN_DATA_FLOAT, x.q_dims(), x.full_head_strides());
    g.matmul(d_s, k, accumulator);
    g.pointwise(CUDNN_POINTWISE_IDENTITY, accumulator, d_q);
  }
}

bool engine_is_nondeterministic(cudnnBackendDescriptor_t config) {
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t e = engine.get();
  int64_t count = 0;
  check(cudnnBackendGetAttribute(config, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                 1, &count, &e),
        "engine query");
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
  check(cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                 static_cast<int64_t>(notes.size()), &count, notes.data()),
        "engine numerical notes");
  for (int64_t i = 0; i < count; ++i) {
    if (notes[static_cast<size_t>(i)] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) return true;
  }
  return false;
}

int64_t engine_index(cudnnBackendDescriptor_t plan) {
  Desc config(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
  Desc engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  cudnnBackendDescriptor_t c = config.get(), e = engine.get();
  int64_t count = 0, index = -1;
  if (cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG,
                               CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &count,
                               &c) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendGetAttribute(c, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                               &count, &e) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendGetAttribute(e, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &count,
                               &index) != CUDNN_STATUS_SUCCESS) {
    return -1;
  }
  return index;
}

int64_t plan_workspace(cudnnBackendDescriptor_t plan) {
  int64_t count = 0, bytes = 0;
  check(cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64,
                                 1, &count, &bytes),
        "plan workspace query");
  return bytes;
}

std::string plan_json(cudnnBackendDescriptor_t plan) {
  int64_t size = 0;
  if (cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                               0, &size, nullptr) != CUDNN_STATUS_SUCCESS ||
      size <= 0) {
    return {};
  }
  std::string text(static_cast<size_t>(size), '\0');
  if (cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                               size, &size, text.data()) != CUDNN_STATUS_SUCCESS) {
    return {};
  }
  text.resize(static_cast<size_t>(size));
  while (!text.empty() && text.back() == '\0') text.pop_back();
  return text;
}

// One cuDNN handle per device for the life of the process: creating one costs milliseconds and
// device memory, and every attention op of a model runs on the same stream anyway. A handle may
// not be used by two threads at once (building plans, executing): its mutex is held for both.
struct DeviceHandle {
  cudnnHandle_t handle = nullptr;
  std::mutex mutex;
};

DeviceHandle& handle_for(int device) {
  static std::mutex mutex;
  static std::map<int, DeviceHandle> handles;  // nodes stay put: references outlive the lock
  const std::lock_guard<std::mutex> lock(mutex);
  DeviceHandle& h = handles[device];
  if (h.handle == nullptr) {
    int previous = 0;
    MEGACPP_CUDA_CHECK(cudaGetDevice(&previous));
    MEGACPP_CUDA_CHECK(cudaSetDevice(device));
    const cudnnStatus_t status = cudnnCreate(&h.handle);
    MEGACPP_CUDA_CHECK(cudaSetDevice(previous));
    check(status, "handle creation (cudnnCreate)");
  }
  return h;
}

}  // namespace

int cudnn_runtime_version() {
  return static_cast<int>(cudnnGetVersion());
}

struct CausalAttentionCudnn::Plans {
  struct Plan {
    std::unique_ptr<Desc> plan;
    int64_t workspace = 0;
    int64_t engine = -1;
    bool cached = false;
  };
  DeviceHandle* handle = nullptr;
  Plan forward, backward;
  float scale = 0, mask_value = 0, one = 1;
  char* workspace = nullptr;  // the op's: [row dots][dQ accumulator][cuDNN's]
  float* row_dot = nullptr;
  float* dq_accumulator = nullptr;
  char* cudnn_workspace = nullptr;
  size_t cudnn_workspace_bytes = 0;
  // Runtimes before 9.6 expect the dQ accumulator zeroed by the caller before each backward:
  // its bytes then, else 0 (decided once, not per call).
  size_t accumulator_bytes_to_zero = 0;
};

namespace {

size_t row_dot_bytes(const AttentionShape& s) {
  return align_up(static_cast<size_t>(s.batch) * s.q_heads * s.seqlen * sizeof(float));
}
size_t accumulator_bytes(const AttentionShape& s, bool deterministic) {
  return deterministic ? 0
                       : align_up(static_cast<size_t>(s.batch) * s.q_heads * s.seqlen * s.head_dim *
                                  sizeof(float));
}
// What cuDNN 9.19's engines asked for on an H100 (bench/RESULTS.md), as a bound: with GQA an
// fp32 [batch, q heads, seqlen, head_dim] buffer (the per-head gradients before the group sum),
// and in the deterministic backward dS (bf16; cuDNN pads rows to 128 and columns to 64, this
// bound pads both to 128).
size_t cudnn_allowance(const AttentionShape& s, bool deterministic) {
  size_t bytes = kCudnnWorkspaceSlack;
  bytes += static_cast<size_t>(s.batch) * s.q_heads * s.seqlen * s.head_dim * sizeof(float);
  if (deterministic) {
    const size_t padded = (static_cast<size_t>(s.seqlen) + 127) / 128 * 128;
    bytes += static_cast<size_t>(s.batch) * s.q_heads * padded * padded * 2;
  }
  return bytes;
}

void validate(const AttentionShape& s, const char* who) {
  validate_attention_shape(s, who);
  if (s.head_dim % 8 != 0 || s.head_dim > 256) {
    refuse(ErrorKind::kInvalidArgument,
           "{}: AttentionShape.head_dim={} must be a multiple of 8 in [8, 256] (cuDNN's fused "
           "attention)",
           who, s.head_dim);
  }
  if (s.seqlen < 2) {
    refuse(ErrorKind::kInvalidArgument,
           "{}: AttentionShape.seqlen={} must be at least 2 (cuDNN's attention backward refuses a "
           "single token)",
           who, s.seqlen);
  }
  // What the cuDNN loaded can run: checked here, before any device is touched, so that a job's
  // submit-time memory plan refuses what its executor would.
  const int version = cudnn_runtime_version();
  if (version < 90000 || (version >= 91000 && version < 91002)) {
    refuse(ErrorKind::kFailedPrecondition,
           "{}: the cuDNN loaded is version {}; fused attention needs 9.0 or newer and not "
           "9.10.0 or 9.10.1 (their bf16 attention is refused by NVIDIA)",
           who, version);
  }
  if (version < 91600 && s.seqlen % 128 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "{}: with the cuDNN loaded ({}), the attention backward needs AttentionShape.seqlen a "
           "multiple of 128 (got {}); cuDNN 9.16 or newer takes any length above 1",
           who, version, s.seqlen);
  }
}

}  // namespace

size_t CausalAttentionCudnn::workspace_bytes(const AttentionShape& shape, bool deterministic) {
  validate(shape, "CausalAttentionCudnn");
  return row_dot_bytes(shape) + accumulator_bytes(shape, deterministic) +
         cudnn_allowance(shape, deterministic);
}

namespace {

std::string plan_key(const char* pass, const AttentionShape& s, int q_stride, int kv_stride,
                     bool deterministic, size_t allowance) {
  std::ostringstream key;
  key << "cudnn-" << cudnnGetVersion() << " sdpa-graph-" << kGraphVersion << " " << pass
      << (deterministic ? " deterministic" : " nondeterministic") << " b=" << s.batch
      << " s=" << s.seqlen << " hq=" << s.q_heads << " hkv=" << s.kv_heads << " d=" << s.head_dim
      << " strides=" << q_stride << "," << kv_stride << " workspace<=" << allowance;
  return key.str();
}

// A plan loaded from cuDNN's JSON form; null when cuDNN no longer accepts it.
std::unique_ptr<Desc> load_plan(cudnnHandle_t handle, const std::string& json) {
  auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
  if (cudnnBackendSetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1,
                               &handle) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendSetAttribute(plan->get(), CUDNN_ATTR_EXECUTION_PLAN_JSON_REPRESENTATION,
                               CUDNN_TYPE_CHAR, static_cast<int64_t>(json.size()),
                               json.data()) != CUDNN_STATUS_SUCCESS ||
      cudnnBackendFinalize(plan->get()) != CUDNN_STATUS_SUCCESS) {
    return nullptr;
  }
  return plan;
}

// Heuristic mode A's engine configurations in order; the first that finalises within the
// allowance (and, when asked, is deterministic) is the plan. `rejected` says why the others
// were passed over.
std::unique_ptr<Desc> build_plan(cudnnHandle_t handle, const Desc& graph, bool deterministic,
                                 size_t allowance, std::string& rejected) {
  Desc heuristics(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  heuristics.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, graph.get())
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, mode)
      .finalize("engine heuristics");
  int64_t count = 0;
  check(cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                 CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr),
        "engine heuristics count");
  std::vector<Desc> configs;
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
    raw.push_back(configs.back().get());
  }
  if (count > 0) {
    check(cudnnBackendGetAttribute(heuristics.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                   CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count, raw.data()),
          "engine heuristics results");
  }
  std::ostringstream why;
  why << count << " engine configuration(s) from heuristic mode A";
  for (int64_t i = 0; i < count; ++i) {
    if (deterministic && engine_is_nondeterministic(raw[static_cast<size_t>(i)])) {
      why << "; #" << i << " is nondeterministic";
      continue;
    }
    auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    // The handle is deprecated on a plan in recent headers (the graph's is used), but 9.x
    // releases before them expect it.
    plan->set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[static_cast<size_t>(i)])
        .set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle);
    const cudnnStatus_t status = cudnnBackendFinalize(plan->get());
    if (status != CUDNN_STATUS_SUCCESS) {
      why << "; #" << i << " did not finalise (" << cudnnGetErrorString(status) << ": "
          << last_cudnn_error() << ")";
      continue;
    }
    const int64_t bytes = plan_workspace(plan->get());
    if (bytes < 0 || static_cast<size_t>(bytes) > allowance) {
      why << "; #" << i << " wants " << bytes << " bytes of workspace, more than " << allowance;
      continue;
    }
    return plan;
  }
  rejected = why.str();
  return nullptr;
}

}  // namespace

CausalAttentionCudnn::CausalAttentionCudnn(const AttentionShape& shape, int q_stride, int kv_stride,
                                           bool deterministic, void* workspace, size_t bytes,
                                           int device, GemmPlanCache* cache)
    : shape_(shape), deterministic_(deterministic) {
  const char* who = "CausalAttentionCudnn";
  validate(shape, who);
  const int q_width = shape.q_heads * shape.head_dim, kv_width = shape.kv_heads * shape.head_dim;
  if (q_stride < q_width || q_stride % 8 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "{}: q_stride must be at least q_heads·head_dim ({}) and a multiple of 8 elements "
           "(16-byte rows), got {}",
           who, q_width, q_stride);
  }
  if (kv_stride < kv_width || kv_stride % 8 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "{}: kv_stride must be at least kv_heads·head_dim ({}) and a multiple of 8 elements "
           "(16-byte rows), got {}",
           who, kv_width, kv_stride);
  }
  const size_t needed = workspace_bytes(shape, deterministic);
  if (workspace == nullptr || bytes < needed) {
    refuse(ErrorKind::kInvalidArgument,
           "{}: the workspace must be workspace_bytes(shape, deterministic) = {} bytes of device "
           "memory, got {} bytes at {}",
           who, needed, bytes, workspace);
  }
  if (reinterpret_cast<uintptr_t>(workspace) % kAlign != 0) {
    refuse(ErrorKind::kInvalidArgument, "{}: the workspace must be {}-byte aligned, got {}", who,
           kAlign, workspace);
  }
  if (device < 0) {
    refuse(ErrorKind::kInvalidArgument, "{}: device must be a CUDA ordinal, got {}", who, device);
  }
  const int version = cudnn_runtime_version();

  plans_ = std::make_unique<Plans>();
  Plans& p = *plans_;
  p.handle = &handle_for(device);
  const std::lock_guard<std::mutex> lock(p.handle->mutex);
  p.scale = static_cast<float>(shape.softmax_scale);
  p.mask_value = version >= 91000 ? -std::numeric_limits<float>::infinity()
                                  : std::numeric_limits<float>::lowest();
  p.workspace = static_cast<char*>(workspace);
  p.row_dot = reinterpret_cast<float*>(p.workspace);
  const size_t accumulator = accumulator_bytes(shape, deterministic);
  p.dq_accumulator =
      deterministic ? nullptr : reinterpret_cast<float*>(p.workspace + row_dot_bytes(shape));
  p.accumulator_bytes_to_zero = version < 90600 ? accumulator : 0;
  p.cudnn_workspace = p.workspace + row_dot_bytes(shape) + accumulator;
  p.cudnn_workspace_bytes = cudnn_allowance(shape, deterministic);

  const Geometry geometry{shape.batch,    shape.seqlen, shape.q_heads, shape.kv_heads,
                          shape.head_dim, q_stride,     kv_stride};
  const auto make = [&](const char* pass, Plans::Plan& out, auto&& build) {
    const std::string key =
        plan_key(pass, shape, q_stride, kv_stride, deterministic, p.cudnn_workspace_bytes);
    bool stale = false;
    if (cache != nullptr) {
      const std::string stored = cache->find_text(key);
      if (!stored.empty()) {
        out.plan = load_plan(p.handle->handle, stored);
        out.workspace = out.plan != nullptr ? plan_workspace(out.plan->get()) : -1;
        if (out.workspace >= 0 && static_cast<size_t>(out.workspace) <= p.cudnn_workspace_bytes) {
          out.engine = engine_index(out.plan->get());
          out.cached = true;
          cache->record_hit();
          return;
        }
        stale = true;
      }
    }
    Graph graph;
    build(graph);
    const Desc op_graph = graph.finalize(p.handle->handle);
    std::string rejected;
    out.plan =
        build_plan(p.handle->handle, op_graph, deterministic, p.cudnn_workspace_bytes, rejected);
    if (out.plan == nullptr) {
      refuse(ErrorKind::kFailedPrecondition,
             "{}: cuDNN {} has no {} {} attention engine for batch {}, seqlen {}, {} q / {} kv "
             "heads of {} within {} bytes of workspace: {}",
             who, version, deterministic ? "deterministic" : "nondeterministic", pass, shape.batch,
             shape.seqlen, shape.q_heads, shape.kv_heads, shape.head_dim, p.cudnn_workspace_bytes,
             rejected);
    }
    out.workspace = plan_workspace(out.plan->get());
    out.engine = engine_index(out.plan->get());
    if (cache != nullptr) {
      std::ostringstream what;
      what << who << " " << pass << " plan (cuDNN engine " << out.engine << ") of batch "
           << shape.batch << ", seqlen " << shape.seqlen << ", " << shape.q_heads << "/"
           << shape.kv_heads << " heads of " << shape.head_dim;
      cache->record_build_text(key, plan_json(out.plan->get()), what.str(), stale);
    }
  };
  make("forward", p.forward, [&](Graph& g) { build_forward(g, geometry); });
  make("backward", p.backward, [&](Graph& g) { build_backward(g, geometry, deterministic); });
}

CausalAttentionCudnn::~CausalAttentionCudnn() = default;

std::string CausalAttentionCudnn::describe() const {
  std::ostringstream out;
  const auto one = [&](const char* pass, const Plans::Plan& plan) {
    out << pass << ": cuDNN engine " << plan.engine << ", " << plan.workspace
        << " bytes of workspace" << (plan.cached ? " (plan from the cache)" : "");
  };
  out << "cuDNN " << cudnn_runtime_version() << (deterministic_ ? ", deterministic; " : "; ");
  one("forward", plans_->forward);
  out << "; ";
  one("backward", plans_->backward);
  return out.str();
}

namespace {

void require_aligned(const void* pointer, const char* name) {
  if (pointer == nullptr || reinterpret_cast<uintptr_t>(pointer) % 16 != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "CausalAttentionCudnn: {} must be a 16-byte aligned device pointer, got {}", name,
           pointer);
  }
}

void execute(DeviceHandle& handle, const Desc& plan, const std::vector<int64_t>& uids,
             const std::vector<void*>& pointers, void* workspace, void* stream, const char* what) {
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()),
           uids.data())
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
           static_cast<int64_t>(pointers.size()), pointers.data())
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, workspace)
      .finalize("variant pack");
  const std::lock_guard<std::mutex> lock(handle.mutex);
  check(cudnnSetStream(handle.handle, static_cast<cudaStream_t>(stream)), "cudnnSetStream");
  check(cudnnBackendExecute(handle.handle, plan.get(), pack.get()), what);
}

}  // namespace

void CausalAttentionCudnn::forward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                   uint16_t* out, float* lse, void* stream) const {
  require_aligned(q, "q");
  require_aligned(k, "k");
  require_aligned(v, "v");
  require_aligned(out, "out");
  require_aligned(lse, "lse");
  Plans& p = *plans_;
  execute(*p.handle, *p.forward.plan, {kQ, kK, kV, kO, kStats, kScale, kMaskValue},
          {const_cast<uint16_t*>(q), const_cast<uint16_t*>(k), const_cast<uint16_t*>(v), out, lse,
           &p.scale, &p.mask_value},
          p.cudnn_workspace, stream, "attention forward");
}

void CausalAttentionCudnn::backward(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                                    const uint16_t* out, const uint16_t* dout, const float* lse,
                                    uint16_t* dq, uint16_t* dk, uint16_t* dv, void* stream) const {
  require_aligned(q, "q");
  require_aligned(k, "k");
  require_aligned(v, "v");
  require_aligned(out, "out");
  require_aligned(dout, "dout");
  require_aligned(lse, "lse");
  require_aligned(dq, "dq");
  require_aligned(dk, "dk");
  require_aligned(dv, "dv");
  Plans& p = *plans_;
  std::vector<int64_t> uids{kQ,  kK,  kV,      kO,     kDO,        kStats, kDQ,
                            kDK, kDV, kRowDot, kScale, kMaskValue, kOne};
  std::vector<void*> pointers{const_cast<uint16_t*>(q),
                              const_cast<uint16_t*>(k),
                              const_cast<uint16_t*>(v),
                              const_cast<uint16_t*>(out),
                              const_cast<uint16_t*>(dout),
                              const_cast<float*>(lse),
                              dq,
                              dk,
                              dv,
                              p.row_dot,
                              &p.scale,
                              &p.mask_value,
                              &p.one};
  if (!deterministic_) {
    uids.push_back(kDQAccum);
    pointers.push_back(p.dq_accumulator);
    if (p.accumulator_bytes_to_zero > 0) {
      MEGACPP_CUDA_CHECK(cudaMemsetAsync(p.dq_accumulator, 0, p.accumulator_bytes_to_zero,
                                         static_cast<cudaStream_t>(stream)));
    }
  }
  execute(*p.handle, *p.backward.plan, uids, pointers, p.cudnn_workspace, stream,
          "attention backward");
}

}  // namespace megacpp::cuda
