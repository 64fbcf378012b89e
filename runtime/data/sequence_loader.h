#pragma once
// Training and evaluation windows over an IndexedDataset read as one token stream:
// the documents in order, each already ending in its end-of-document token.
#include <cstdint>
#include <memory>

#include "runtime/data/indexed_dataset.h"

namespace megacpp::data {

// Yields windows of seqlen + 1 consecutive tokens (inputs are the first seqlen,
// targets the last seqlen). Successive windows start seqlen tokens apart, so each
// window's last token is the next window's first, and every token is a target once per
// pass. At the end of the stream it wraps to token 0; a window may straddle the wrap.
class SequenceLoader {
 public:
  // Throws kInvalidArgument for seqlen < 1 and when the dataset holds fewer than
  // seqlen + 1 tokens (the message names the .idx file and both numbers).
  SequenceLoader(std::shared_ptr<const IndexedDataset> dataset, int seqlen);

  // Fills tokens[b * (seqlen + 1) + t] for b < batch, t <= seqlen, and advances.
  void next_batch(int batch, std::int32_t* tokens);

  // Stream position of the next window's first token, in [0, total_tokens()). Saving
  // it and seek()ing to it later resumes the exact same sequence of windows.
  std::uint64_t position() const { return position_; }
  // Throws kInvalidArgument unless position < total_tokens().
  void seek(std::uint64_t position);

  std::uint64_t total_tokens() const { return dataset_->total_tokens(); }
  int seqlen() const { return seqlen_; }
  const IndexedDataset& dataset() const { return *dataset_; }

 private:
  std::shared_ptr<const IndexedDataset> dataset_;
  int seqlen_;
  std::uint64_t position_ = 0;
};

// Evaluation windows: window i is tokens [i * seqlen, i * seqlen + seqlen + 1) with no
// wrap, so the windows' targets tile the stream once without overlap; the tail that
// does not fill a whole window is left out. Both throw kInvalidArgument like the
// SequenceLoader constructor when the dataset is shorter than seqlen + 1 tokens.
std::int64_t num_eval_windows(const IndexedDataset& dataset, int seqlen);
// Writes seqlen + 1 tokens to out; index must be in [0, num_eval_windows).
void eval_window(const IndexedDataset& dataset, std::int64_t index, int seqlen, std::int32_t* out);

}  // namespace megacpp::data
