#include "runtime/data/sequence_loader.h"

#include <algorithm>
#include <utility>

#include "base/error.h"

namespace megacpp::data {
namespace {

void require_window_fits(const IndexedDataset& dataset, int seqlen) {
  if (seqlen < 1) {
    fail(ErrorKind::kInvalidArgument, "{}: seqlen must be at least 1, got {}",
         dataset.index_path().string(), seqlen);
  }
  const auto window = static_cast<std::uint64_t>(seqlen) + 1;
  if (dataset.total_tokens() < window) {
    fail(ErrorKind::kInvalidArgument,
         "{}: dataset has {} tokens, fewer than the seqlen + 1 = {} one window needs",
         dataset.index_path().string(), dataset.total_tokens(), window);
  }
}

}  // namespace

SequenceLoader::SequenceLoader(std::shared_ptr<const IndexedDataset> dataset, int seqlen)
    : dataset_(std::move(dataset)), seqlen_(seqlen) {
  if (!dataset_) fail(ErrorKind::kInvalidArgument, "SequenceLoader: dataset is null");
  require_window_fits(*dataset_, seqlen_);
}

void SequenceLoader::next_batch(int batch, std::int32_t* tokens) {
  if (batch < 0) {
    fail(ErrorKind::kInvalidArgument, "{}: batch must be non-negative, got {}",
         dataset_->index_path().string(), batch);
  }
  const std::uint64_t total = dataset_->total_tokens();
  const auto window = static_cast<std::uint64_t>(seqlen_) + 1;
  for (int b = 0; b < batch; ++b) {
    std::int32_t* row = tokens + static_cast<std::size_t>(b) * window;
    const std::uint64_t before_wrap = std::min(window, total - position_);
    dataset_->read_stream(position_, before_wrap, row);
    // total >= window, so the part after the wrap never wraps again.
    if (before_wrap < window) dataset_->read_stream(0, window - before_wrap, row + before_wrap);
    position_ = (position_ + static_cast<std::uint64_t>(seqlen_)) % total;
  }
}

void SequenceLoader::seek(std::uint64_t position) {
  if (position >= dataset_->total_tokens()) {
    fail(ErrorKind::kInvalidArgument, "{}: seek position {} is beyond the dataset's {} tokens",
         dataset_->index_path().string(), position, dataset_->total_tokens());
  }
  position_ = position;
}

std::int64_t num_eval_windows(const IndexedDataset& dataset, int seqlen) {
  require_window_fits(dataset, seqlen);
  return static_cast<std::int64_t>((dataset.total_tokens() - 1) /
                                   static_cast<std::uint64_t>(seqlen));
}

void eval_window(const IndexedDataset& dataset, std::int64_t index, int seqlen, std::int32_t* out) {
  const std::int64_t count = num_eval_windows(dataset, seqlen);
  if (index < 0 || index >= count) {
    fail(ErrorKind::kInvalidArgument, "{}: eval window {} out of range: {} windows of seqlen {}",
         dataset.index_path().string(), index, count, seqlen);
  }
  dataset.read_stream(static_cast<std::uint64_t>(index) * static_cast<std::uint64_t>(seqlen),
                      static_cast<std::uint64_t>(seqlen) + 1, out);
}

}  // namespace megacpp::data
