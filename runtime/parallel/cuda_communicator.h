#pragma once
// A group of GPU ranks joined by NCCL: the collectives the tensor- and data-parallel step uses.
//
// One world communicator per job, made from a unique id that one process creates
// (new_unique_id: it opens NCCL's bootstrap socket and touches no GPU) and hands to every rank;
// the tensor- and data-parallel groups are split from it (ShardPlan's rank numbering: a TP group
// is tp consecutive world ranks). Every rank of a group must call each collective in the same
// order. Collectives are enqueued on the caller's CUDA stream and return at once.
//
// A rank that fails or hangs would block the others in their next collective: abort() (safe
// from another thread: the collective watchdog) makes every pending and later collective of this
// communicator fail with the abort's reason instead of waiting. With tracking on, each collective
// is bracketed by two CUDA events, which tell the watchdog whether its stream has reached it and
// whether it finished.
//
// Plain C++ (no NCCL or CUDA types in this header).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "runtime/parallel/collective_watchdog.h"

namespace megacpp::parallel {

enum class CollectiveType { kBf16, kFloat, kDouble };
enum class ReduceOp { kSum, kAverage };

// How a group split from a CudaCommunicator runs its collectives (CudaCommunicator::split).
struct GroupOptions {
  // NCCL's zero-CTA policy, under which an all-gather whose buffers both lie in
  // allocate_symmetric's memory runs on the GPUs' copy engines (one node, peer access between
  // all its GPUs), leaving every SM to the kernels beside it; its other collectives run as
  // kernels as ever.
  bool copy_engines = false;
  // The fewest blocks (NCCL's CTAs, one a channel) each collective's kernel runs on; 0: NCCL's
  // own choice (24 on two and on four NVLink-connected H200s, by NCCL_DEBUG=INFO). More take SMs
  // from kernels running beside the collective, and give one that runs alone more of the links'
  // bandwidth. NCCL_MIN_CTAS in the environment overrides it.
  int min_ctas = 0;
  static constexpr int kMaxCtas = 64;  // NCCL's MAXCHANNELS
};

// The tensor-parallel group's min_ctas (the trainer's and the bench's). The forward's all-gathers
// and reduce-scatters run with nothing beside them, so more blocks speed them up: a bench-1.3b
// step at TP = 4 on H200s took 0.8–1.0% less (bench/RESULTS.md, session 24, calls 3 and 4); at
// TP = 2 the change was within the noise; 64 blocks slowed the MLP backward's weight gradients
// beside the backward's collectives at TP = 2.
inline constexpr int kTensorParallelMinCtas = 32;

class CudaCommunicator final : public WatchedGroup {
 public:
  // NCCL's unique id as 256 hex characters, for the launcher to pass to every rank.
  static std::string new_unique_id();

  // Joins the world communicator of `world_size` ranks as `world_rank`, on CUDA device `device`;
  // blocks until every rank has joined. Throws megacpp::Error: kInvalidArgument for a malformed
  // id or rank, kFailedPrecondition when NCCL cannot initialise (naming its error).
  CudaCommunicator(const std::string& unique_id_hex, int world_size, int world_rank, int device);
  ~CudaCommunicator() override;
  CudaCommunicator(const CudaCommunicator&) = delete;
  CudaCommunicator& operator=(const CudaCommunicator&) = delete;

  // The ranks of this communicator with the same `color` form a new one, ordered by `key`.
  // Collective over this communicator. Throws kInvalidArgument for min_ctas outside
  // [0, kMaxCtas], naming it.
  std::unique_ptr<CudaCommunicator> split(int color, int key,
                                          const GroupOptions& options = {}) const;
  bool copy_engines() const { return copy_engines_; }

  // `bytes` of device memory registered with NCCL as one symmetric window of this group: every
  // rank allocates the same size in the same order (collective; it blocks until all have). The
  // ranks vote after allocating and after registering, so that where one rank cannot, every rank
  // throws kFailedPrecondition (naming how many could not) instead of the others waiting; NCCL's
  // registration itself has no timeout (see the definition for what that leaves).
  // free_symmetric gives it back (local); the destructor frees what is left.
  void* allocate_symmetric(size_t bytes);
  void free_symmetric(void* memory);
  size_t symmetric_bytes() const;  // held now: allocated and not yet freed

  int size() const { return size_; }
  int rank() const { return rank_; }
  int device() const { return device_; }

  // In place over `count` elements of device memory, enqueued on `stream`.
  void all_reduce(void* data, int64_t count, CollectiveType type, ReduceOp op, void* stream);
  // `send` holds count elements; `receive` gets size() · count, rank r's at r · count.
  void all_gather(const void* send, void* receive, int64_t count, CollectiveType type,
                  void* stream);
  // `send` holds size() · count elements; `receive` gets count: the reduction over the ranks of
  // their elements [rank() · count, (rank() + 1) · count). In place where receive is send +
  // rank() · count (so is all_gather where send is receive + rank() · count).
  void reduce_scatter(const void* send, void* receive, int64_t count, CollectiveType type,
                      ReduceOp op, void* stream);
  // The sum of `value` over the ranks, on the host: for decisions every rank must take alike
  // (stop after this step). Synchronous, on the communicator's own stream.
  int64_t sum_over_ranks(int64_t value);
  // Collectives between begin_batch() and end_batch() are launched together (ncclGroupStart /
  // ncclGroupEnd): many small reductions cost about one launch. A batch holds this
  // communicator's lock throughout, and its collectives share one stream. Batch ends it also
  // when a collective inside throws.
  void begin_batch();
  void end_batch();
  class Batch {
   public:
    explicit Batch(CudaCommunicator& group);
    ~Batch();
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;
    void end();  // launches the batch; throws what ncclGroupEnd reports

   private:
    CudaCommunicator* group_;
  };

  // Fails this communicator's pending and future collectives; idempotent, any thread. Later
  // calls throw kFailedPrecondition naming `reason`. Returns false when a call of this
  // communicator is blocked inside NCCL, so that the communicator could not be freed yet (ask
  // again later), or when the calling thread is inside a batch of this communicator; the
  // destructor finishes an abort still pending (in the owner's order of destruction).
  bool abort(const std::string& reason) override;
  bool abort() { return abort("aborted by its owner"); }
  bool aborted() const;  // an abort was asked for

  // What failure messages call this group, e.g. "tensor-parallel group (world ranks 0-1)".
  void set_name(std::string name);
  std::string group_name() const override;
  // From now on, two CUDA events (made once, then reused) bracket every collective on its stream,
  // for oldest_unfinished(). Off by default: no event is recorded.
  void track_collectives();
  std::optional<PendingCollective> oldest_unfinished() override;
  std::string asynchronous_error() override;

 private:
  struct Impl;
  CudaCommunicator(std::unique_ptr<Impl> impl, int size, int rank, int device);
  std::unique_ptr<Impl> impl_;
  int size_ = 0;
  int rank_ = 0;
  int device_ = 0;
  bool copy_engines_ = false;
};

}  // namespace megacpp::parallel
