#include "runtime/data/token_stats.h"

#include <algorithm>
#include <cmath>

#include "base/error.h"
#include "runtime/config/model_config.h"

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
      // A token no vocabulary has is a corrupt file, not a count: a negative id once wrote
      // before the counts, a huge one asked for gigabytes of them.
      const std::int32_t token = buffer[i];
      if (token < 0 || token >= ModelConfigLimits::kMaxVocab) {
        fail(ErrorKind::kCorruptData,
             "{}: token {} at position {} is outside [0, {}), the ids any vocabulary may have",
             dataset.data_path().string(), token, first + i, ModelConfigLimits::kMaxVocab);
      }
      const auto id = static_cast<std::size_t>(token);
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
