#include "runtime/data/token_stats.h"

#include <algorithm>
#include <cmath>

namespace megacpp::data {

TokenStats token_stats(const IndexedDataset& dataset) {
  TokenStats stats;
  stats.tokens = dataset.total_tokens();
  stats.documents = dataset.num_documents();
  constexpr std::uint64_t kBlock = 1 << 16;
  std::vector<std::int32_t> buffer(kBlock);
  for (std::uint64_t first = 0; first < stats.tokens; first += kBlock) {
    const std::uint64_t count = std::min(kBlock, stats.tokens - first);
    dataset.read_stream(first, count, buffer.data());
    for (std::uint64_t i = 0; i < count; ++i) {
      const auto id = static_cast<std::size_t>(buffer[i]);
      if (id >= stats.counts.size()) stats.counts.resize(id + 1, 0);
      ++stats.counts[id];
    }
  }
  double entropy = 0;
  for (std::uint64_t c : stats.counts) {
    if (c == 0) continue;
    const double p = static_cast<double>(c) / static_cast<double>(stats.tokens);
    entropy -= p * std::log(p);
  }
  stats.unigram_entropy_nats = entropy;
  return stats;
}

}  // namespace megacpp::data
