#include "runtime/parallel/cuda_communicator.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <atomic>
#include <cstring>
#include <mutex>

#include "base/error.h"
#include "kernels/cuda/check.h"

namespace megacpp::parallel {

namespace {

void check_nccl(ncclResult_t status, const char* call) {
  if (status == ncclSuccess) return;
  // Usage errors are bugs of ours; the rest (system, remote, internal) say this machine or a
  // peer rank cannot take part.
  const ErrorKind kind = status == ncclInvalidArgument || status == ncclInvalidUsage
                             ? ErrorKind::kInternal
                             : ErrorKind::kFailedPrecondition;
  fail(kind, "{} failed: {} ({})", call, ncclGetErrorString(status), static_cast<int>(status));
}

ncclDataType_t nccl_type(CollectiveType type) {
  switch (type) {
    case CollectiveType::kBf16:
      return ncclBfloat16;
    case CollectiveType::kFloat:
      return ncclFloat32;
    case CollectiveType::kDouble:
      return ncclFloat64;
  }
  return ncclFloat32;
}

ncclRedOp_t nccl_op(ReduceOp op) {
  return op == ReduceOp::kAverage ? ncclAvg : ncclSum;
}

constexpr size_t kIdBytes = sizeof(ncclUniqueId);

ncclUniqueId parse_id(const std::string& hex) {
  if (hex.size() != 2 * kIdBytes) {
    fail(ErrorKind::kInvalidArgument, "NCCL unique id has {} hex characters, expected {}",
         hex.size(), 2 * kIdBytes);
  }
  ncclUniqueId id;
  for (size_t i = 0; i < kIdBytes; ++i) {
    unsigned value = 0;
    for (size_t k = 0; k < 2; ++k) {
      const char c = hex[2 * i + k];
      unsigned digit = 0;
      if (c >= '0' && c <= '9') {
        digit = static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        digit = static_cast<unsigned>(c - 'a' + 10);
      } else {
        fail(ErrorKind::kInvalidArgument, "NCCL unique id: character {} ('{}') is not hex digit",
             2 * i + k, c);
      }
      value = value * 16 + digit;
    }
    id.internal[i] = static_cast<char>(value);
  }
  return id;
}

}  // namespace

struct CudaCommunicator::Impl {
  ncclComm_t comm = nullptr;
  std::atomic<bool> aborted{false};
  std::mutex abort_mutex;
  // sum_over_ranks's device word and stream, made on first use.
  int64_t* word = nullptr;
  cudaStream_t stream = nullptr;
  ~Impl() {
    if (word != nullptr) cudaFree(word);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
};

std::string CudaCommunicator::new_unique_id() {
  ncclUniqueId id;
  check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  std::string hex;
  hex.reserve(2 * kIdBytes);
  for (size_t i = 0; i < kIdBytes; ++i) {
    hex += fmt::format("{:02x}", static_cast<unsigned char>(id.internal[i]));
  }
  return hex;
}

CudaCommunicator::CudaCommunicator(const std::string& unique_id_hex, int world_size, int world_rank,
                                   int device)
    : impl_(std::make_unique<Impl>()), size_(world_size), rank_(world_rank), device_(device) {
  if (world_size < 1 || world_rank < 0 || world_rank >= world_size) {
    fail(ErrorKind::kInvalidArgument, "NCCL rank {} of world size {}: rank must be in [0, size)",
         world_rank, world_size);
  }
  const ncclUniqueId id = parse_id(unique_id_hex);
  MEGACPP_CUDA_CHECK(cudaSetDevice(device));
  check_nccl(ncclCommInitRank(&impl_->comm, world_size, id, world_rank), "ncclCommInitRank");
}

CudaCommunicator::CudaCommunicator(std::unique_ptr<Impl> impl, int size, int rank, int device)
    : impl_(std::move(impl)), size_(size), rank_(rank), device_(device) {}

CudaCommunicator::~CudaCommunicator() {
  if (!impl_ || impl_->comm == nullptr) return;
  std::lock_guard<std::mutex> lock(impl_->abort_mutex);
  if (!impl_->aborted.load()) {
    cudaSetDevice(device_);
    ncclCommDestroy(impl_->comm);
  }
}

std::unique_ptr<CudaCommunicator> CudaCommunicator::split(int color, int key) const {
  auto impl = std::make_unique<Impl>();
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  check_nccl(ncclCommSplit(impl_->comm, color, key, &impl->comm, nullptr), "ncclCommSplit");
  int size = 0, rank = 0;
  check_nccl(ncclCommCount(impl->comm, &size), "ncclCommCount");
  check_nccl(ncclCommUserRank(impl->comm, &rank), "ncclCommUserRank");
  return std::unique_ptr<CudaCommunicator>(
      new CudaCommunicator(std::move(impl), size, rank, device_));
}

void CudaCommunicator::all_reduce(void* data, int64_t count, CollectiveType type, ReduceOp op,
                                  void* stream) {
  if (impl_->aborted.load()) fail(ErrorKind::kFailedPrecondition, "NCCL communicator aborted");
  check_nccl(ncclAllReduce(data, data, static_cast<size_t>(count), nccl_type(type), nccl_op(op),
                           impl_->comm, static_cast<cudaStream_t>(stream)),
             "ncclAllReduce");
}

void CudaCommunicator::all_gather(const void* send, void* receive, int64_t count,
                                  CollectiveType type, void* stream) {
  if (impl_->aborted.load()) fail(ErrorKind::kFailedPrecondition, "NCCL communicator aborted");
  check_nccl(ncclAllGather(send, receive, static_cast<size_t>(count), nccl_type(type), impl_->comm,
                           static_cast<cudaStream_t>(stream)),
             "ncclAllGather");
}

int64_t CudaCommunicator::sum_over_ranks(int64_t value) {
  if (impl_->aborted.load()) fail(ErrorKind::kFailedPrecondition, "NCCL communicator aborted");
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  if (impl_->word == nullptr) {
    MEGACPP_CUDA_CHECK(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking));
    MEGACPP_CUDA_CHECK(cudaMalloc(&impl_->word, sizeof(int64_t)));
  }
  MEGACPP_CUDA_CHECK(
      cudaMemcpyAsync(impl_->word, &value, sizeof(value), cudaMemcpyHostToDevice, impl_->stream));
  check_nccl(
      ncclAllReduce(impl_->word, impl_->word, 1, ncclInt64, ncclSum, impl_->comm, impl_->stream),
      "ncclAllReduce");
  int64_t sum = 0;
  MEGACPP_CUDA_CHECK(
      cudaMemcpyAsync(&sum, impl_->word, sizeof(sum), cudaMemcpyDeviceToHost, impl_->stream));
  MEGACPP_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
  return sum;
}

void CudaCommunicator::begin_batch() {
  check_nccl(ncclGroupStart(), "ncclGroupStart");
}

void CudaCommunicator::end_batch() {
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
}

void CudaCommunicator::abort() {
  std::lock_guard<std::mutex> lock(impl_->abort_mutex);
  if (impl_->aborted.exchange(true)) return;
  ncclCommAbort(impl_->comm);
}

bool CudaCommunicator::aborted() const {
  return impl_->aborted.load();
}

}  // namespace megacpp::parallel
