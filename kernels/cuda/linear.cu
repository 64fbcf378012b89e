// CUDA linear layer through cuBLASLt: see linear.h for the structure.
//
// cuBLASLt is column-major and our matrices are row-major. A row-major M [r, c] is, in the same
// bytes, the column-major Mᵀ [c, r] with leading dimension c, so each product is computed on the
// transposes (layouts below are column-major [rows, columns, ld] of the bytes as stored):
//   forward  yᵀ [out, rows] = W [out, in] · xᵀ [in, rows]: A = W's bytes [in, out, in] with
//            op T, B = x's bytes [in, rows, in] with op N, D = y's bytes [out, rows, out];
//            m = out, n = rows, k = in. The bias runs along D's rows (out), as the epilogue's does.
//   dx       dxᵀ [in, rows] = Wᵀ [in, out] · dyᵀ [out, rows]: A = W's bytes [in, out, in], op N;
//            B = dy's bytes [out, rows, out], op N; D = dx's bytes [in, rows, in]; k = out.
//   dW       dWᵀ [in, out] = xᵀ [in, rows] · dy [rows, out]: A = x's bytes [in, rows, in], op N;
//            B = dy's bytes [out, rows, out], op T; C = D = dW's bytes [in, out, in]; k = rows.
//
// The bias: cuBLASLt's bias epilogue takes a bias of D's type (cublasLt.h,
// CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE; the exceptions are int8 and fp8 kernels), so it serves the
// fp32 output with our fp32 bias; a bf16 output gets the GEMM and then bias_add_kernel (the sum
// is rounded to bf16 twice, within bf16's tolerance), rather than a bias rounded to bf16.
#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gemm_plan_cache.h"
#include "kernels/cuda/linear.h"

namespace megacpp::cuda {
namespace {

using detail::refuse;

constexpr int kThreads = 256;
// Rows per partial of the bias gradient's column sums.
constexpr int kRowsPerTile = 64;
constexpr int kMaxGridY = 65535;

// cuBLASLt's share of the workspace. NVIDIA recommends 32 MiB on Hopper (4 MiB before it) for
// the split-K and stream-K kernels; linears running in order on one stream share one workspace,
// so this is paid once per model, not once per layer.
constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;
// cuBLASLt asks for a 256-byte aligned workspace; cudaMalloc gives it.
constexpr size_t kWorkspaceAlignment = 256;
// The pointer alignment the algorithms are chosen for: what cudaMalloc and any reasonable arena
// give, and all that Hopper's TMA loads need. Less is promised where a row's bytes are not a
// multiple of it (odd leading dimensions).
constexpr uint32_t kPointerAlignment = 16;

// ---------------------------------------------------------------------------------------------
// cuBLASLt status checks

// Statuses that say this machine or library cannot run the call are a failed precondition; any
// other failure means the call broke an API rule: an internal error.
ErrorKind error_kind(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_NOT_INITIALIZED:
    case CUBLAS_STATUS_ALLOC_FAILED:
    case CUBLAS_STATUS_ARCH_MISMATCH:
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return ErrorKind::kFailedPrecondition;
    default:
      return ErrorKind::kInternal;
  }
}

[[noreturn]] void cublaslt_failed(cublasStatus_t status, const char* expression, const char* gemm,
                                  const char* file, int line) {
  refuse(error_kind(status), "LinearCuda: cuBLASLt call {} failed ({} GEMM): {} ({}): {} at {}:{}",
         expression, gemm, cublasLtGetStatusName(status), static_cast<int>(status),
         cublasLtGetStatusString(status), detail::source_path(file), line);
}

// Evaluates a cuBLASLt call once; anything but success throws megacpp::Error naming the call,
// the GEMM it served (a const char*), the status's name and number, the file and line.
#define MEGACPP_CUBLASLT_CHECK(expression, gemm)                                        \
  do {                                                                                  \
    const cublasStatus_t megacpp_cublaslt_status_ = (expression);                       \
    if (megacpp_cublaslt_status_ != CUBLAS_STATUS_SUCCESS) {                            \
      cublaslt_failed(megacpp_cublaslt_status_, #expression, gemm, __FILE__, __LINE__); \
    }                                                                                   \
  } while (0)

// One cuBLASLt handle per device, made on first use and kept for the life of the process. A
// handle belongs to the device current when it is made and holds neither a stream nor a
// workspace (both are passed per call), so one per device serves every op; making one per op
// would repeat the library's setup for each of a model's many linears. It is never destroyed:
// a destructor run at static destruction could come after the CUDA runtime has torn down.
// The caller has made `device` current.
cublasLtHandle_t handle_for(int device) {
  static std::mutex mutex;
  static std::vector<cublasLtHandle_t> handles;
  const std::lock_guard<std::mutex> lock(mutex);
  if (static_cast<size_t>(device) >= handles.size()) {
    handles.resize(static_cast<size_t>(device) + 1, nullptr);
  }
  cublasLtHandle_t& handle = handles[static_cast<size_t>(device)];
  if (handle == nullptr) MEGACPP_CUBLASLT_CHECK(cublasLtCreate(&handle), "every");
  return handle;
}

// ---------------------------------------------------------------------------------------------
// Kernels

// y [rows, out] bf16 (rows `stride` elements apart) += bias [out], in fp32, rounded once more.
__global__ void __launch_bounds__(kThreads)
    bias_add_kernel(int rows, int out, int stride, const float* __restrict__ bias,
                    bf16* __restrict__ y) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= out) return;
  const float b = bias[c];
  for (int row = blockIdx.y; row < rows; row += gridDim.y) {
    bf16* p = y + static_cast<int64_t>(row) * stride + c;
    *p = __float2bfloat16(to_f(*p) + b);
  }
}

// partials [tiles, out]: each column's sum over a tile's rows, in row order.
__global__ void __launch_bounds__(kThreads)
    column_partials_kernel(int rows, int out, int tiles, const bf16* __restrict__ dy,
                           float* __restrict__ partials) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= out) return;
  for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    const int begin = tile * kRowsPerTile;
    const int end = min(rows, begin + kRowsPerTile);
    float sum = 0.f;
    for (int row = begin; row < end; ++row) sum += to_f(dy[static_cast<int64_t>(row) * out + c]);
    partials[static_cast<int64_t>(tile) * out + c] = sum;
  }
}

// One thread per column: the tiles' partials in tile order.
__global__ void __launch_bounds__(kThreads)
    reduce_kernel(int out, int tiles, const float* __restrict__ partials, float* __restrict__ dbias,
                  bool accumulate) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= out) return;
  float sum = accumulate ? dbias[c] : 0.f;
  for (int t = 0; t < tiles; ++t) sum += partials[static_cast<int64_t>(t) * out + c];
  dbias[c] = sum;
}

// ---------------------------------------------------------------------------------------------
// Host helpers

void validate(const LinearShape& s) {
  const auto positive = [](int value, const char* field) {
    if (value <= 0) {
      refuse(ErrorKind::kInvalidArgument, "LinearCuda: LinearShape.{}={} must be positive", field,
             value);
    }
  };
  positive(s.rows, "rows");
  positive(s.in, "in");
  positive(s.out, "out");
  if (s.y_stride != 0 && s.y_stride < s.out) {
    refuse(ErrorKind::kInvalidArgument,
           "LinearCuda: LinearShape.y_stride={} must be 0 (dense) or at least out={}", s.y_stride,
           s.out);
  }
}

template <class T>
void require(const T* pointer, const char* field) {
  if (pointer == nullptr) refuse(ErrorKind::kInvalidArgument, "LinearCuda: {} is null", field);
}

int tiles_of(const LinearShape& s) {
  return (s.rows + kRowsPerTile - 1) / kRowsPerTile;
}

size_t partials_bytes(const LinearShape& s) {
  const size_t bytes =
      static_cast<size_t>(tiles_of(s)) * static_cast<size_t>(s.out) * sizeof(float);
  return (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
}

int blocks_for(int items) {
  return (items + kThreads - 1) / kThreads;
}

// The alignment a matrix of leading dimension `ld` elements of `element` bytes can promise: its
// pointer's (kPointerAlignment) and that of every column's start after the first.
uint32_t promised_alignment(int64_t ld, size_t element) {
  const uint64_t row_bytes = static_cast<uint64_t>(ld) * element;
  uint32_t alignment = kPointerAlignment;
  while (alignment > 1 && row_bytes % alignment != 0) alignment /= 2;
  return alignment;
}

// A matrix as cuBLASLt sees it: column-major [rows, columns] with leading dimension ld.
struct Matrix {
  cudaDataType_t type;
  int64_t rows;
  int64_t columns;
  int64_t ld;
};

size_t element_bytes(cudaDataType_t type) {
  return type == CUDA_R_16BF ? sizeof(uint16_t) : sizeof(float);
}

// The GEMMs of one op, each with its algorithm chosen once.
enum Gemm { kForwardBf16, kForwardF32, kForwardF32Bias, kDxBf16, kDxF32, kDweight, kGemms };

const char* gemm_name(int gemm) {
  switch (gemm) {
    case kForwardBf16:
      return "forward (bf16 y)";
    case kForwardF32:
      return "forward (fp32 y)";
    case kForwardF32Bias:
      return "forward (fp32 y, bias epilogue)";
    case kDxBf16:
      return "dx = dy W (bf16 dx)";
    case kDxF32:
      return "dx = dy W (fp32 dx)";
    default:
      return "dW = dy^T x";
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Plans: the descriptors and chosen algorithm of every GEMM. In a named namespace so the helpers
// below can take it (LinearCuda::Plans, its private name, derives from it).

namespace linear_detail {

struct GemmPlans {
  struct Plan {
    const char* name = "";
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;  // C is laid out as D
    cublasLtMatmulAlgo_t algo{};
    uint32_t align_a = 0, align_b = 0, align_d = 0;  // what the heuristic was promised

    Plan() = default;
    Plan(const Plan&) = delete;
    Plan& operator=(const Plan&) = delete;
    ~Plan() {
      // Destruction cannot fail in a way worth reporting: statuses ignored.
      if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
      if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
      if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
      if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
    }
  };

  cublasLtHandle_t handle = nullptr;
  std::array<Plan, kGemms> plans;
};

}  // namespace linear_detail

struct LinearCuda::Plans : linear_detail::GemmPlans {};

namespace {

using linear_detail::GemmPlans;

struct PreferenceDeleter {
  void operator()(cublasLtMatmulPreference_t p) const { cublasLtMatmulPreferenceDestroy(p); }
};

// A stand-in bias pointer for the heuristic, which reads the bias pointer's value (never what it
// points to) for its alignment: aligned to kPointerAlignment and no more. forward() sets the real
// one, refusing a less aligned bias.
const void* const kBiasStandIn = reinterpret_cast<const void*>(uintptr_t{kPointerAlignment});

void make_layout(cublasLtMatrixLayout_t* layout, const Matrix& m, const char* gemm) {
  MEGACPP_CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(layout, m.type, static_cast<uint64_t>(m.rows),
                                                    static_cast<uint64_t>(m.columns), m.ld),
                         gemm);
}

template <class T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, const T& value,
              const char* gemm) {
  MEGACPP_CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value)),
                         gemm);
}

template <class T>
void set_preference(cublasLtMatmulPreference_t preference,
                    cublasLtMatmulPreferenceAttributes_t attribute, const T& value,
                    const char* gemm) {
  MEGACPP_CUBLASLT_CHECK(
      cublasLtMatmulPreferenceSetAttribute(preference, attribute, &value, sizeof(value)), gemm);
}

uint32_t algo_alignment(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t cap,
                        const char* gemm) {
  uint32_t value = 0;
  size_t written = 0;
  MEGACPP_CUBLASLT_CHECK(
      cublasLtMatmulAlgoCapGetAttribute(&algo, cap, &value, sizeof(value), &written), gemm);
  return value;
}

// Why `algo` does not fit the plan (empty when it does): a workspace over cuBLASLt's share, or an
// alignment above what the matrices promise. A fresh choice and a cached one meet the same rules.
std::string unmet_need(const GemmPlans::Plan& plan, const cublasLtMatmulAlgo_t& algo,
                       size_t workspace, const char* name) {
  std::ostringstream out;
  if (workspace > kGemmWorkspaceBytes) {
    out << "needs " << workspace << " bytes of workspace, over the " << kGemmWorkspaceBytes
        << " it was allowed";
    return out.str();
  }
  const struct {
    cublasLtMatmulAlgoCapAttributes_t cap;
    uint32_t promised;
    const char* matrix;
  } needs[] = {{CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_A_BYTES, plan.align_a, "A"},
               {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_B_BYTES, plan.align_b, "B"},
               {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_C_BYTES, plan.align_d, "C"},
               {CUBLASLT_ALGO_CAP_MIN_ALIGNMENT_D_BYTES, plan.align_d, "D"}};
  for (const auto& need : needs) {
    const uint32_t required = algo_alignment(algo, need.cap, name);
    if (required > need.promised) {
      out << "needs " << required << "-byte aligned " << need.matrix << ", where only "
          << need.promised << " bytes were promised";
      return out.str();
    }
  }
  return {};
}

// Takes a cached algorithm (its 64 bytes and the workspace it was chosen with) when cuBLASLt
// still accepts it for this plan's descriptors (cublasLtMatmulAlgoCheck) and it meets the rules a
// fresh choice must; false: stale (another library build, a tampered or foreign record).
bool use_cached(const GemmPlans& plans, GemmPlans::Plan& plan, const std::string& stored) {
  cublasLtMatmulAlgo_t algo{};
  uint64_t workspace = 0;
  if (stored.size() != sizeof(algo) + sizeof(workspace)) return false;
  std::memcpy(&algo, stored.data(), sizeof(algo));
  std::memcpy(&workspace, stored.data() + sizeof(algo), sizeof(workspace));
  cublasLtMatmulHeuristicResult_t check{};
  if (cublasLtMatmulAlgoCheck(plans.handle, plan.desc, plan.a, plan.b, plan.d, plan.d, &algo,
                              &check) != CUBLAS_STATUS_SUCCESS ||
      check.state != CUBLAS_STATUS_SUCCESS || check.workspaceSize != workspace) {
    return false;
  }
  // A cached algorithm whose capabilities cannot even be read is as stale as one that fails.
  try {
    if (!unmet_need(plan, algo, check.workspaceSize, plan.name).empty()) return false;
  } catch (const Error&) {
    return false;
  }
  plan.algo = algo;
  return true;
}

// Describes D = op_a(A) · op_b(B) (C laid out as D) and picks its algorithm: cuBLASLt's first
// choice for this problem, within cuBLASLt's share of the workspace and the alignment the
// matrices can promise. With a cache, a cached choice that still passes is taken instead and a
// fresh one is stored.
void plan_gemm(GemmPlans& plans, int gemm, const LinearShape& shape, cublasOperation_t op_a,
               const Matrix& a, cublasOperation_t op_b, const Matrix& b, const Matrix& d, bool bias,
               GemmPlanCache* cache, int32_t sm_count_target = 0) {
  auto& plan = plans.plans[static_cast<size_t>(gemm)];
  bool stale = false;
  const char* name = gemm_name(gemm);
  plan.name = name;
  MEGACPP_CUBLASLT_CHECK(cublasLtMatmulDescCreate(&plan.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F),
                         name);
  set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA, static_cast<int32_t>(op_a), name);
  set_desc(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB, static_cast<int32_t>(op_b), name);
  if (bias) {
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
             static_cast<uint32_t>(CUBLASLT_EPILOGUE_BIAS), name);
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(CUDA_R_32F),
             name);
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, kBiasStandIn, name);
  }
  if (sm_count_target > 0) {
    set_desc(plan.desc, CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, sm_count_target, name);
  }
  make_layout(&plan.a, a, name);
  make_layout(&plan.b, b, name);
  make_layout(&plan.d, d, name);
  plan.align_a = promised_alignment(a.ld, element_bytes(a.type));
  plan.align_b = promised_alignment(b.ld, element_bytes(b.type));
  plan.align_d = promised_alignment(d.ld, element_bytes(d.type));

  cublasLtMatmulPreference_t raw = nullptr;
  MEGACPP_CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&raw), name);
  const std::unique_ptr<std::remove_pointer_t<cublasLtMatmulPreference_t>, PreferenceDeleter>
      preference(raw);
  set_preference(raw, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, uint64_t{kGemmWorkspaceBytes},
                 name);
  set_preference(raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, plan.align_a, name);
  set_preference(raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, plan.align_b, name);
  set_preference(raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, plan.align_d, name);
  set_preference(raw, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, plan.align_d, name);

  GemmPlanKey key;
  if (cache != nullptr) {
    key = GemmPlanKey{
        static_cast<int>(op_a),
        static_cast<int>(op_b),
        static_cast<int>(a.type),
        static_cast<int>(b.type),
        static_cast<int>(d.type),
        static_cast<int>(CUBLAS_COMPUTE_32F),
        d.rows,
        d.columns,
        op_a == CUBLAS_OP_N ? a.columns : a.rows,
        a.ld,
        b.ld,
        d.ld,
        plan.align_a,
        plan.align_b,
        plan.align_d,
        static_cast<uint32_t>(bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT),
        uint64_t{kGemmWorkspaceBytes},
        sm_count_target};
    const std::string stored = cache->find(key);
    if (!stored.empty() && use_cached(plans, plan, stored)) {
      cache->record_hit();
      return;
    }
    stale = !stored.empty();
  }

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      plans.handle, plan.desc, plan.a, plan.b, plan.d, plan.d, raw, 1, &result, &found);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) {
    refuse(ErrorKind::kFailedPrecondition,
           "LinearCuda: cuBLASLt has no algorithm for the {} GEMM of LinearShape rows={}, in={}, "
           "out={} (bf16 operands, fp32 compute, {} bytes of workspace)",
           name, shape.rows, shape.in, shape.out, kGemmWorkspaceBytes);
  }
  MEGACPP_CUBLASLT_CHECK(status, name);
  MEGACPP_CUBLASLT_CHECK(result.state, name);
  // The heuristic was told the workspace limit and what alignment the matrices promise; check
  // the algorithm it chose asks for no more, rather than trusting it.
  const std::string unmet = unmet_need(plan, result.algo, result.workspaceSize, name);
  if (!unmet.empty()) {
    refuse(ErrorKind::kInternal,
           "LinearCuda: cuBLASLt chose an algorithm for the {} GEMM of LinearShape rows={}, "
           "in={}, out={} that {}",
           name, shape.rows, shape.in, shape.out, unmet);
  }
  plan.algo = result.algo;
  if (cache != nullptr) {
    // The workspace stored is what cublasLtMatmulAlgoCheck reports for the algorithm, the value
    // a later lookup's check is compared with (the heuristic's own figure need not be the same).
    uint64_t workspace = result.workspaceSize;
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(plans.handle, plan.desc, plan.a, plan.b, plan.d, plan.d,
                                &result.algo, &check) == CUBLAS_STATUS_SUCCESS &&
        check.state == CUBLAS_STATUS_SUCCESS) {
      workspace = check.workspaceSize;
    }
    std::string value(reinterpret_cast<const char*>(&result.algo), sizeof(result.algo));
    value.append(reinterpret_cast<const char*>(&workspace), sizeof(workspace));
    std::ostringstream what;
    what << "LinearCuda " << name << " GEMM of LinearShape rows=" << shape.rows
         << ", in=" << shape.in << ", out=" << shape.out << " (m=" << key.m << ", n=" << key.n
         << ", k=" << key.k << ")";
    cache->record_build(key, std::move(value), what.str(), stale);
  }
}

void require_aligned(const void* pointer, uint32_t alignment, const char* gemm, const char* what) {
  if (reinterpret_cast<uintptr_t>(pointer) % alignment != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "LinearCuda: {} GEMM: {} must be {}-byte aligned (its algorithm was chosen for that), "
           "got address {}",
           gemm, what, alignment, pointer);
  }
}

// D = A·B (+ beta·D) with the plan's algorithm: the same algorithm and workspace size every call,
// hence the same bits.
void run(const GemmPlans& plans, int gemm, const void* a, const char* a_name, const void* b,
         const char* b_name, void* d, const char* d_name, float beta, void* workspace,
         cudaStream_t stream) {
  const auto& plan = plans.plans[static_cast<size_t>(gemm)];
  require_aligned(a, plan.align_a, plan.name, a_name);
  require_aligned(b, plan.align_b, plan.name, b_name);
  require_aligned(d, plan.align_d, plan.name, d_name);
  const float alpha = 1.f;
  MEGACPP_CUBLASLT_CHECK(
      cublasLtMatmul(plans.handle, plan.desc, &alpha, a, plan.a, b, plan.b, &beta, d, plan.d, d,
                     plan.d, &plan.algo, workspace, kGemmWorkspaceBytes, stream),
      plan.name);
}

}  // namespace

size_t LinearCuda::workspace_bytes(const LinearShape& shape) {
  validate(shape);
  return kGemmWorkspaceBytes + partials_bytes(shape);
}

LinearCuda::LinearCuda(const LinearShape& shape, void* workspace, size_t bytes,
                       GemmPlanCache* cache, int weight_gradient_sms)
    : shape_(shape), workspace_(workspace), workspace_bytes_(bytes) {
  validate(shape);
  if (weight_gradient_sms < 0) {
    refuse(ErrorKind::kInvalidArgument,
           "LinearCuda: weight_gradient_sms={} must be 0 (every SM) or a count of SMs",
           weight_gradient_sms);
  }
  const size_t needed = workspace_bytes(shape);
  if (workspace == nullptr || bytes < needed) {
    refuse(ErrorKind::kInvalidArgument,
           "LinearCuda needs workspace_bytes(shape) = {} bytes of workspace, got {} bytes at {}",
           needed, bytes, workspace);
  }
  if (reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlignment != 0) {
    refuse(ErrorKind::kInvalidArgument,
           "LinearCuda: the workspace must be {}-byte aligned (cuBLASLt's), got address {}",
           kWorkspaceAlignment, workspace);
  }
  MEGACPP_CUDA_CHECK(cudaGetDevice(&device_));
  if (cache != nullptr && cache->device() != device_) {
    refuse(ErrorKind::kInvalidArgument,
           "LinearCuda: the plan cache is device {}'s (scope {}), the op is on device {}",
           cache->device(), cache->scope(), device_);
  }
  auto plans = std::make_unique<Plans>();
  plans->handle = handle_for(device_);
  const int64_t rows = shape.rows, in = shape.in, out = shape.out, y_ld = shape.y_row_stride();
  const Matrix w{CUDA_R_16BF, in, out, in};      // W [out, in] row-major
  const Matrix x{CUDA_R_16BF, in, rows, in};     // x [rows, in] row-major
  const Matrix dy{CUDA_R_16BF, out, rows, out};  // dy [rows, out] row-major
  for (const bool f32 : {false, true}) {
    const cudaDataType_t type = f32 ? CUDA_R_32F : CUDA_R_16BF;
    plan_gemm(*plans, f32 ? kForwardF32 : kForwardBf16, shape, CUBLAS_OP_T, w, CUBLAS_OP_N, x,
              Matrix{type, out, rows, y_ld}, false, cache);
    plan_gemm(*plans, f32 ? kDxF32 : kDxBf16, shape, CUBLAS_OP_N, w, CUBLAS_OP_N, dy,
              Matrix{type, in, rows, in}, false, cache);
  }
  plan_gemm(*plans, kForwardF32Bias, shape, CUBLAS_OP_T, w, CUBLAS_OP_N, x,
            Matrix{CUDA_R_32F, out, rows, y_ld}, true, cache);
  plan_gemm(*plans, kDweight, shape, CUBLAS_OP_N, x, CUBLAS_OP_T, dy,
            Matrix{CUDA_R_32F, in, out, in}, false, cache, weight_gradient_sms);
  plans_ = plans.release();
}

LinearCuda::~LinearCuda() {
  delete plans_;
}

void LinearCuda::forward(const uint16_t* x, const uint16_t* weight, const float* bias, RowsOut y,
                         void* stream) const {
  require(x, "forward: x");
  require(weight, "forward: weight");
  if ((y.bf16 == nullptr) == (y.f32 == nullptr)) {
    refuse(ErrorKind::kInvalidArgument,
           "LinearCuda: forward: y needs exactly one of its bf16 and fp32 pointers");
  }
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (y.f32 != nullptr) {
    if (bias != nullptr) {
      require_aligned(bias, kPointerAlignment, gemm_name(kForwardF32Bias), "bias");
      // The descriptor is the op's own: one op is driven from one host thread at a time.
      set_desc(plans_->plans[kForwardF32Bias].desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias,
               gemm_name(kForwardF32Bias));
      run(*plans_, kForwardF32Bias, weight, "weight", x, "x", y.f32, "y", 0.f, workspace_, s);
    } else {
      run(*plans_, kForwardF32, weight, "weight", x, "x", y.f32, "y", 0.f, workspace_, s);
    }
    return;
  }
  run(*plans_, kForwardBf16, weight, "weight", x, "x", y.bf16, "y", 0.f, workspace_, s);
  if (bias != nullptr) {
    const dim3 grid(static_cast<unsigned>(blocks_for(shape_.out)),
                    static_cast<unsigned>(shape_.rows < kMaxGridY ? shape_.rows : kMaxGridY));
    bias_add_kernel<<<grid, kThreads, 0, s>>>(shape_.rows, shape_.out, shape_.y_row_stride(), bias,
                                              reinterpret_cast<bf16*>(y.bf16));
    MEGACPP_CUDA_CHECK_LAUNCH("bias_add_kernel");
  }
}

void LinearCuda::backward(const uint16_t* x, const uint16_t* weight, const uint16_t* dy, RowsOut dx,
                          float* dweight, float* dbias, bool accumulate, void* stream) const {
  require(x, "backward: x");
  require(dweight, "backward: dweight");
  backward_input(weight, dy, dx, stream);
  backward_weights(x, dy, dweight, dbias, accumulate, stream);
}

void LinearCuda::backward_input(const uint16_t* weight, const uint16_t* dy, RowsOut dx,
                                void* stream) const {
  require(weight, "backward: weight");
  require(dy, "backward: dy");
  if (dx.bf16 != nullptr && dx.f32 != nullptr) {
    refuse(ErrorKind::kInvalidArgument,
           "LinearCuda: backward: dx has both a bf16 and an fp32 pointer");
  }
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dx.bf16 != nullptr) {
    run(*plans_, kDxBf16, weight, "weight", dy, "dy", dx.bf16, "dx", 0.f, workspace_, s);
  } else if (dx.f32 != nullptr) {
    run(*plans_, kDxF32, weight, "weight", dy, "dy", dx.f32, "dx", 0.f, workspace_, s);
  }
}

void LinearCuda::backward_weights(const uint16_t* x, const uint16_t* dy, float* dweight,
                                  float* dbias, bool accumulate, void* stream) const {
  require(x, "backward: x");
  require(dy, "backward: dy");
  require(dweight, "backward: dweight");
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  run(*plans_, kDweight, x, "x", dy, "dy", dweight, "dweight", accumulate ? 1.f : 0.f, workspace_,
      s);
  if (dbias == nullptr) return;
  float* partials =
      reinterpret_cast<float*>(static_cast<unsigned char*>(workspace_) + kGemmWorkspaceBytes);
  const int tiles = tiles_of(shape_);
  const dim3 grid(static_cast<unsigned>(blocks_for(shape_.out)),
                  static_cast<unsigned>(tiles < kMaxGridY ? tiles : kMaxGridY));
  column_partials_kernel<<<grid, kThreads, 0, s>>>(shape_.rows, shape_.out, tiles,
                                                   reinterpret_cast<const bf16*>(dy), partials);
  MEGACPP_CUDA_CHECK_LAUNCH("column_partials_kernel");
  reduce_kernel<<<blocks_for(shape_.out), kThreads, 0, s>>>(shape_.out, tiles, partials, dbias,
                                                            accumulate);
  MEGACPP_CUDA_CHECK_LAUNCH("reduce_kernel");
}

}  // namespace megacpp::cuda
