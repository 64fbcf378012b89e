#pragma once
// Statistics of a tokenized dataset: the baseline a language model must beat.
#include <cstdint>
#include <vector>

#include "runtime/data/indexed_dataset.h"

namespace megacpp::data {

struct TokenStats {
  std::uint64_t tokens = 0;
  std::uint64_t documents = 0;
  std::vector<std::uint64_t> counts;  // per token id
  // Entropy of the unigram (token-frequency) distribution in nats: the loss of
  // the best model that ignores context.
  double unigram_entropy_nats = 0;
};

TokenStats token_stats(const IndexedDataset& dataset);

}  // namespace megacpp::data
