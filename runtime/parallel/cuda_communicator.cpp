#include "runtime/parallel/cuda_communicator.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <utility>
#include <vector>

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

const char* type_name(CollectiveType type) {
  switch (type) {
    case CollectiveType::kBf16:
      return "bf16";
    case CollectiveType::kFloat:
      return "fp32";
    case CollectiveType::kDouble:
      return "fp64";
  }
  return "?";
}

size_t type_bytes(CollectiveType type) {
  return type == CollectiveType::kBf16 ? 2 : type == CollectiveType::kFloat ? 4 : 8;
}

std::string describe(const char* what, int64_t count, CollectiveType type) {
  const double mib = static_cast<double>(count) * static_cast<double>(type_bytes(type)) / 1048576.0;
  return fmt::format("{} of {:.1f} MiB {}", what, mib, type_name(type));
}

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
  std::string name = "communicator";
  // NCCL's calls on one communicator must not overlap its abort (which frees it): both hold
  // call_mutex. Held only while enqueueing, never while waiting for the device. Recursive: a
  // batch holds it from begin to end. Timed: an enqueue can itself block (NCCL waiting for room
  // in its queue to the device, whose kernels wait for a hung peer), and abort() must not.
  std::recursive_timed_mutex call_mutex;
  // ncclCommGetAsyncError (the watchdog's thread) and ncclCommAbort (which frees the
  // communicator) never at once; neither waits for call_mutex.
  std::mutex state_mutex;
  // Asked: every later call fails with abort_reason. Done: ncclCommAbort has freed `comm`.
  std::atomic<bool> abort_requested{false};
  std::atomic<bool> aborted{false};
  // The texts failure messages use, read by any thread.
  std::mutex text_mutex;
  std::string abort_reason;
  std::string reason() {
    std::lock_guard lock(text_mutex);
    return abort_reason;
  }
  std::string group_name() {
    std::lock_guard lock(text_mutex);
    return name;
  }
  // sum_over_ranks's device word, pinned host word and stream, made on first use (pinned: its
  // copies never wait for the device inside call_mutex).
  int64_t* word = nullptr;
  int64_t* host_word = nullptr;
  cudaStream_t stream = nullptr;
  // allocate_symmetric's memory and its windows, until free_symmetric or the destructor.
  struct Symmetric {
    void* memory = nullptr;
    ncclWindow_t window = nullptr;
    size_t bytes = 0;
  };
  std::vector<Symmetric> symmetric;
  // Deregisters (while the communicator lives) and frees one symmetric allocation.
  void release(const Symmetric& s) {
    if (s.window != nullptr && !aborted.load()) ncclCommWindowDeregister(comm, s.window);
    ncclMemFree(s.memory);
  }

  // Tracking (track_collectives): each collective's events, oldest first, until seen finished.
  struct Tracked {
    uint64_t sequence = 0;
    std::string description;
    cudaEvent_t began = nullptr, ended = nullptr;
  };
  bool tracking = false;
  std::mutex track_mutex;
  std::deque<Tracked> in_flight;
  std::vector<cudaEvent_t> spare_events;
  uint64_t sequence = 0;
  // The batch being enqueued (between begin_batch and end_batch).
  int batch_depth = 0;
  int64_t batch_collectives = 0;
  double batch_mib = 0;
  cudaStream_t batch_stream = nullptr;
  cudaEvent_t batch_began = nullptr;

  cudaEvent_t take_event() {
    std::lock_guard lock(track_mutex);
    if (!spare_events.empty()) {
      cudaEvent_t e = spare_events.back();
      spare_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    MEGACPP_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  // One collective: refused once an abort was asked for; `call(stream)` enqueues it on NCCL,
  // bracketed by the tracking events. Defined below fail_aborted.
  template <typename Call>
  void enqueue(const char* what, const char* nccl_call, int64_t count, CollectiveType type,
               void* on_stream, Call&& call);
  void give_back(cudaEvent_t e) {
    if (e == nullptr) return;
    std::lock_guard lock(track_mutex);
    spare_events.push_back(e);
  }
  // check_nccl, giving the collective's first event back when it failed.
  void checked(cudaEvent_t began, ncclResult_t status, const char* call) {
    if (status != ncclSuccess) give_back(began);
    check_nccl(status, call);
  }
  void push(std::string description, cudaEvent_t began, cudaEvent_t ended) {
    std::lock_guard lock(track_mutex);
    in_flight.push_back({++sequence, std::move(description), began, ended});
  }
  // Around one collective outside a batch: the event before it, then (after) the one behind it.
  cudaEvent_t mark_before(cudaStream_t s) {
    if (!tracking) return nullptr;
    if (batch_depth > 0) {
      if (batch_began == nullptr) {
        batch_stream = s;
        batch_began = take_event();
        MEGACPP_CUDA_CHECK(cudaEventRecord(batch_began, s));
      } else if (s != batch_stream) {
        fail(ErrorKind::kInternal, "NCCL batch on {} spans two CUDA streams", group_name());
      }
      return nullptr;
    }
    cudaEvent_t began = take_event();
    MEGACPP_CUDA_CHECK(cudaEventRecord(began, s));
    return began;
  }
  void mark_after(cudaStream_t s, cudaEvent_t began, std::string description, double mib) {
    if (!tracking) return;
    if (batch_depth > 0) {
      ++batch_collectives;
      batch_mib += mib;
      return;
    }
    cudaEvent_t ended = take_event();
    MEGACPP_CUDA_CHECK(cudaEventRecord(ended, s));
    push(std::move(description), began, ended);
  }

  ~Impl() {
    if (word != nullptr) cudaFree(word);
    if (host_word != nullptr) cudaFreeHost(host_word);
    if (stream != nullptr) cudaStreamDestroy(stream);
    for (const Tracked& t : in_flight) {
      cudaEventDestroy(t.began);
      cudaEventDestroy(t.ended);
    }
    for (cudaEvent_t e : spare_events) cudaEventDestroy(e);
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
  std::lock_guard lock(impl_->call_mutex);
  std::lock_guard state(impl_->state_mutex);
  cudaSetDevice(device_);
  // Windows go before their communicator; an aborted one took its registrations with it.
  for (const Impl::Symmetric& s : impl_->symmetric) impl_->release(s);
  impl_->symmetric.clear();
  if (impl_->aborted.load()) return;
  // An abort asked for and not yet done: its peers are gone, so no collective teardown.
  if (impl_->abort_requested.load()) {
    ncclCommAbort(impl_->comm);
  } else {
    ncclCommDestroy(impl_->comm);
  }
}

namespace {

[[noreturn]] void fail_aborted(const std::string& name, std::string reason) {
  fail(ErrorKind::kFailedPrecondition, "NCCL {} aborted: {}", name, reason);
}

}  // namespace

std::unique_ptr<CudaCommunicator> CudaCommunicator::split(int color, int key,
                                                          const GroupOptions& options) const {
  if (options.min_ctas < 0 || options.min_ctas > GroupOptions::kMaxCtas) {
    fail(ErrorKind::kInvalidArgument, "GroupOptions.min_ctas={} must be in [0, {}] (0: NCCL's own)",
         options.min_ctas, GroupOptions::kMaxCtas);
  }
  auto impl = std::make_unique<Impl>();
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  std::lock_guard lock(impl_->call_mutex);
  if (impl_->abort_requested.load()) fail_aborted(impl_->group_name(), impl_->reason());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  if (options.copy_engines) config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
  if (options.min_ctas > 0) {
    // NCCL refuses a minimum without a maximum (it does not inherit the parent's here).
    config.minCTAs = options.min_ctas;
    config.maxCTAs = GroupOptions::kMaxCtas;
  }
  const bool configured = options.copy_engines || options.min_ctas > 0;
  check_nccl(ncclCommSplit(impl_->comm, color, key, &impl->comm, configured ? &config : nullptr),
             "ncclCommSplit");
  int size = 0, rank = 0;
  check_nccl(ncclCommCount(impl->comm, &size), "ncclCommCount");
  check_nccl(ncclCommUserRank(impl->comm, &rank), "ncclCommUserRank");
  auto made =
      std::unique_ptr<CudaCommunicator>(new CudaCommunicator(std::move(impl), size, rank, device_));
  made->copy_engines_ = options.copy_engines;
  return made;
}

void* CudaCommunicator::allocate_symmetric(size_t bytes) {
  Impl& m = *impl_;
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
  // The window's registration is collective: a rank that failed alone, and returned, would leave
  // its peers waiting in it (or in their next collective) for good. So the ranks vote after the
  // local allocation and after the registration, and all of them fail together, naming how many
  // could not. A vote that never ends can be ended by an abort (sum_over_ranks); the
  // registration cannot: NCCL gives it no timeout, and a rank inside it holds call_mutex. So a
  // registration that fails on one rank before it reaches its peers, or a rank aborted between
  // the votes (it throws instead of registering), still leaves its peers waiting there.
  Impl::Symmetric s;
  s.bytes = bytes;
  const auto release = [&] {
    if (s.memory == nullptr) return;
    std::lock_guard lock(m.call_mutex);
    std::lock_guard state(m.state_mutex);
    m.release(s);
  };
  // How many ranks failed a step, this rank's own `failed` counted; what it made is released
  // when the vote itself throws (an abort).
  const auto ranks_failing = [&](bool failed) {
    try {
      return sum_over_ranks(failed ? 1 : 0);
    } catch (...) {
      release();
      throw;
    }
  };
  ncclResult_t allocated = ncclSuccess;
  {
    std::lock_guard lock(m.call_mutex);
    if (m.abort_requested.load()) fail_aborted(m.group_name(), m.reason());
    allocated = ncclMemAlloc(&s.memory, bytes);
    if (allocated != ncclSuccess) s.memory = nullptr;
  }
  if (const int64_t failing = ranks_failing(allocated != ncclSuccess); failing != 0) {
    release();
    fail(ErrorKind::kFailedPrecondition,
         "{} of the {}'s {} ranks could not allocate {} bytes of symmetric memory (this rank: "
         "{}); free device memory or run without copy engines",
         failing, m.group_name(), size_, bytes,
         allocated == ncclSuccess ? "allocated" : ncclGetErrorString(allocated));
  }
  ncclResult_t registered = ncclSuccess;
  {
    std::lock_guard lock(m.call_mutex);
    if (m.abort_requested.load()) {
      // Its communicator may be freed already: nothing may be registered with it.
      ncclMemFree(s.memory);
      fail_aborted(m.group_name(), m.reason());
    }
    registered =
        ncclCommWindowRegister(m.comm, s.memory, bytes, &s.window, NCCL_WIN_COLL_SYMMETRIC);
  }
  // NCCL answers success without a window where the group cannot have symmetric memory (a GPU
  // pair without peer access, cuMem off): its collectives would quietly stay kernels.
  const bool has_window = registered == ncclSuccess && s.window != nullptr;
  if (const int64_t failing = ranks_failing(!has_window); failing != 0) {
    release();
    fail(ErrorKind::kFailedPrecondition,
         "the {} cannot have symmetric memory ({} of its {} ranks got no NCCL window; this rank: "
         "{}): every pair of its GPUs needs peer access and NCCL's cuMem support; run it without "
         "copy engines",
         m.group_name(), failing, size_,
         registered != ncclSuccess
             ? fmt::format("ncclCommWindowRegister failed: {}", ncclGetErrorString(registered))
         : has_window ? std::string("registered")
                      : std::string("NCCL registered no window"));
  }
  std::lock_guard lock(m.call_mutex);
  m.symmetric.push_back(s);
  return s.memory;
}

size_t CudaCommunicator::symmetric_bytes() const {
  std::lock_guard lock(impl_->call_mutex);
  size_t bytes = 0;
  for (const Impl::Symmetric& s : impl_->symmetric) bytes += s.bytes;
  return bytes;
}

void CudaCommunicator::free_symmetric(void* memory) {
  Impl& m = *impl_;
  std::lock_guard lock(m.call_mutex);
  std::lock_guard state(m.state_mutex);
  for (auto it = m.symmetric.begin(); it != m.symmetric.end(); ++it) {
    if (it->memory != memory) continue;
    cudaSetDevice(device_);
    m.release(*it);
    m.symmetric.erase(it);
    return;
  }
  fail(ErrorKind::kInternal, "free_symmetric: {} is no symmetric allocation of the {}", memory,
       m.group_name());
}

template <typename Call>
void CudaCommunicator::Impl::enqueue(const char* what, const char* nccl_call, int64_t count,
                                     CollectiveType type, void* on_stream, Call&& call) {
  std::lock_guard lock(call_mutex);
  if (abort_requested.load()) fail_aborted(group_name(), reason());
  const auto s = static_cast<cudaStream_t>(on_stream);
  cudaEvent_t began = mark_before(s);
  checked(began, call(s), nccl_call);
  if (tracking) {
    mark_after(s, began, describe(what, count, type),
               static_cast<double>(count) * static_cast<double>(type_bytes(type)) / 1048576.0);
  }
}

void CudaCommunicator::all_reduce(void* data, int64_t count, CollectiveType type, ReduceOp op,
                                  void* stream) {
  Impl& m = *impl_;
  m.enqueue("all-reduce", "ncclAllReduce", count, type, stream, [&](cudaStream_t s) {
    return ncclAllReduce(data, data, static_cast<size_t>(count), nccl_type(type), nccl_op(op),
                         m.comm, s);
  });
}

void CudaCommunicator::all_gather(const void* send, void* receive, int64_t count,
                                  CollectiveType type, void* stream) {
  Impl& m = *impl_;
  m.enqueue("all-gather", "ncclAllGather", count, type, stream, [&](cudaStream_t s) {
    return ncclAllGather(send, receive, static_cast<size_t>(count), nccl_type(type), m.comm, s);
  });
}

void CudaCommunicator::reduce_scatter(const void* send, void* receive, int64_t count,
                                      CollectiveType type, ReduceOp op, void* stream) {
  Impl& m = *impl_;
  m.enqueue("reduce-scatter", "ncclReduceScatter", count, type, stream, [&](cudaStream_t s) {
    return ncclReduceScatter(send, receive, static_cast<size_t>(count), nccl_type(type),
                             nccl_op(op), m.comm, s);
  });
}

int64_t CudaCommunicator::sum_over_ranks(int64_t value) {
  Impl& m = *impl_;
  {
    std::lock_guard lock(m.call_mutex);
    if (m.abort_requested.load()) fail_aborted(m.group_name(), m.reason());
    MEGACPP_CUDA_CHECK(cudaSetDevice(device_));
    if (m.word == nullptr) {
      MEGACPP_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
      MEGACPP_CUDA_CHECK(cudaMalloc(&m.word, sizeof(int64_t)));
      MEGACPP_CUDA_CHECK(cudaMallocHost(&m.host_word, sizeof(int64_t)));
    }
    *m.host_word = value;  // the previous vote's copy back is done (synchronized below)
    MEGACPP_CUDA_CHECK(
        cudaMemcpyAsync(m.word, m.host_word, sizeof(value), cudaMemcpyHostToDevice, m.stream));
    cudaEvent_t began = m.mark_before(m.stream);
    m.checked(began, ncclAllReduce(m.word, m.word, 1, ncclInt64, ncclSum, m.comm, m.stream),
              "ncclAllReduce");
    m.mark_after(m.stream, began, "the ranks' vote (an all-reduce of one int64)", 0);
    MEGACPP_CUDA_CHECK(
        cudaMemcpyAsync(m.host_word, m.word, sizeof(value), cudaMemcpyDeviceToHost, m.stream));
  }
  // Outside call_mutex: an abort must be able to end this wait.
  MEGACPP_CUDA_CHECK(cudaStreamSynchronize(m.stream));
  if (m.abort_requested.load()) fail_aborted(m.group_name(), m.reason());
  return *m.host_word;
}

void CudaCommunicator::begin_batch() {
  Impl& m = *impl_;
  std::unique_lock lock(m.call_mutex);
  if (m.abort_requested.load()) fail_aborted(m.group_name(), m.reason());
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  if (m.batch_depth++ == 0) {
    m.batch_collectives = 0;
    m.batch_mib = 0;
    m.batch_began = nullptr;
    m.batch_stream = nullptr;
  }
  lock.release();  // held until end_batch
}

void CudaCommunicator::end_batch() {
  Impl& m = *impl_;
  // Unlocks the lock begin_batch took, whatever happens here.
  std::lock_guard lock(m.call_mutex, std::adopt_lock);
  const bool outermost = --m.batch_depth == 0;
  const ncclResult_t status = ncclGroupEnd();
  if (!outermost || m.batch_began == nullptr) {
    check_nccl(status, "ncclGroupEnd");
    return;
  }
  cudaEvent_t began = std::exchange(m.batch_began, nullptr);
  m.checked(began, status, "ncclGroupEnd");
  cudaEvent_t ended = m.take_event();
  MEGACPP_CUDA_CHECK(cudaEventRecord(ended, m.batch_stream));
  m.push(
      fmt::format("a batch of {} collectives, {:.1f} MiB in all", m.batch_collectives, m.batch_mib),
      began, ended);
}

CudaCommunicator::Batch::Batch(CudaCommunicator& group) : group_(&group) {
  group.begin_batch();
}

CudaCommunicator::Batch::~Batch() {
  if (group_ == nullptr) return;
  // Unwinding from a collective of the batch that threw: the batch still ends (the group call
  // closed, the lock released); its own error is the one that propagates.
  try {
    group_->end_batch();
  } catch (const std::exception& e) {
    spdlog::warn("ending an NCCL batch after an error: {}", e.what());
  }
}

void CudaCommunicator::Batch::end() {
  std::exchange(group_, nullptr)->end_batch();
}

bool CudaCommunicator::abort(const std::string& reason) {
  Impl& m = *impl_;
  {
    std::lock_guard lock(m.text_mutex);
    if (m.abort_reason.empty()) m.abort_reason = reason;
  }
  m.abort_requested.store(true);
  if (m.aborted.load()) return true;
  std::unique_lock call(m.call_mutex, std::defer_lock);
  // A call of this communicator blocked inside NCCL holds the lock: freeing the communicator
  // under it is not safe. The caller tries again later.
  if (!call.try_lock_for(std::chrono::seconds(1))) return false;
  // The owner's own thread inside a batch (the lock is recursive): ncclGroupEnd is still to
  // come on this communicator, so it cannot be freed now.
  if (m.batch_depth > 0) return false;
  std::lock_guard state(m.state_mutex);
  if (!m.aborted.load()) {
    cudaSetDevice(device_);
    ncclCommAbort(m.comm);
    m.aborted.store(true);
  }
  return true;
}

bool CudaCommunicator::aborted() const {
  return impl_->abort_requested.load();
}

void CudaCommunicator::set_name(std::string name) {
  std::lock_guard lock(impl_->text_mutex);
  impl_->name = std::move(name);
}

std::string CudaCommunicator::group_name() const {
  return impl_->group_name();
}

void CudaCommunicator::track_collectives() {
  std::lock_guard lock(impl_->call_mutex);
  impl_->tracking = true;
}

std::optional<PendingCollective> CudaCommunicator::oldest_unfinished() {
  Impl& m = *impl_;
  MEGACPP_CUDA_CHECK(cudaSetDevice(device_));  // this thread may be the watchdog's
  std::lock_guard lock(m.track_mutex);
  while (!m.in_flight.empty()) {
    Impl::Tracked& t = m.in_flight.front();
    if (cudaEventQuery(t.ended) != cudaSuccess) {
      PendingCollective p;
      p.sequence = t.sequence;
      p.description = t.description;
      p.started = cudaEventQuery(t.began) == cudaSuccess;
      return p;
    }
    m.spare_events.push_back(t.began);
    m.spare_events.push_back(t.ended);
    m.in_flight.pop_front();
  }
  return std::nullopt;
}

std::string CudaCommunicator::asynchronous_error() {
  Impl& m = *impl_;
  std::lock_guard lock(m.state_mutex);
  if (m.aborted.load()) return {};
  ncclResult_t state = ncclSuccess;
  if (ncclCommGetAsyncError(m.comm, &state) != ncclSuccess) return {};
  if (state == ncclSuccess || state == ncclInProgress) return {};
  return fmt::format("{} ({})", ncclGetErrorString(state), static_cast<int>(state));
}

}  // namespace megacpp::parallel
