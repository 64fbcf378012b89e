#pragma once
// A Megatron data blend: training windows drawn from several datasets in proportion to their
// weights. Each dataset keeps its own SequenceLoader (its windows in stream order, as a job on
// that dataset alone would read them); which dataset gives the next window follows Megatron's
// BlendedDataset rule (helpers.cpp, build_blending_indices): window n comes from the dataset
// whose share so far lags its weight the most, argmax_d(w_d * max(n, 1) - drawn_d), the lowest
// index on a tie. No randomness: the same weights draw the same sequence on every run and
// resume, and after n windows dataset d has given round(w_d * n) of them, within one.
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "runtime/data/indexed_dataset.h"
#include "runtime/data/sequence_loader.h"

namespace megacpp::data {

struct BlendComponent {
  std::shared_ptr<const IndexedDataset> dataset;
  double weight = 1;  // relative; the weights are normalized to sum to 1
};

class BlendedLoader {
 public:
  // Error(kInvalidArgument) naming the dataset's .idx for a weight that is not positive and
  // finite, for no components, and as SequenceLoader for a dataset shorter than one window.
  BlendedLoader(std::vector<BlendComponent> components, int seqlen);

  // Fills tokens[b * (seqlen + 1) + t] for b < batch, t <= seqlen, one window per row.
  void next_batch(int batch, std::int32_t* tokens);

  // Where each dataset stands: the stream position of its next window and the windows it has
  // given. Restoring them resumes the exact same sequence of windows.
  struct Cursor {
    std::uint64_t position = 0;
    std::uint64_t windows = 0;
  };
  std::vector<Cursor> cursors() const;
  // Error(kInvalidArgument) when the count differs from the datasets' or a position is beyond
  // its dataset.
  void restore(std::span<const Cursor> cursors);

  std::size_t size() const { return loaders_.size(); }
  double weight(std::size_t i) const { return weights_[i]; }  // normalized
  const SequenceLoader& loader(std::size_t i) const { return loaders_[i]; }

 private:
  std::size_t choose() const;

  std::vector<SequenceLoader> loaders_;
  std::vector<double> weights_;
  std::vector<std::uint64_t> windows_;
  std::uint64_t drawn_ = 0;
};

}  // namespace megacpp::data
