// token_stats: counts and unigram entropy of a dataset, and a clear error for a token id no
// vocabulary has (negative, or past any vocabulary a model may have).
#include "runtime/data/token_stats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "base/error.h"
#include "runtime/config/model_config.h"
#include "runtime/data/indexed_dataset.h"
#include "tests/support/temp_dir.h"

namespace megacpp::data {
namespace {

namespace fs = std::filesystem;

fs::path write_dataset(const fs::path& dir, const std::vector<std::int32_t>& tokens) {
  const fs::path prefix = dir / "stats";
  IndexedDatasetBuilder builder(prefix, TokenDtype::kInt32);
  builder.add_document(tokens);
  builder.finalize();
  return prefix;
}

TEST(TokenStats, CountsEveryIdAndTheUnigramEntropy) {
  testing::TempDir dir;
  const TokenStats stats = token_stats(IndexedDataset(write_dataset(dir.path(), {3, 1, 3, 3})));
  EXPECT_EQ(stats.tokens, 4u);
  EXPECT_EQ(stats.documents, 1u);
  EXPECT_EQ(stats.counts, (std::vector<std::uint64_t>{0, 1, 0, 3}));
  const double expected = -(0.25 * std::log(0.25) + 0.75 * std::log(0.75));
  EXPECT_NEAR(stats.unigram_entropy_nats, expected, 1e-12);
}

TEST(TokenStats, IdsNoVocabularyHasAreCorruptDataNamingTheFileAndPosition) {
  for (const std::int32_t bad : {-1, ModelConfigLimits::kMaxVocab}) {
    testing::TempDir dir;
    const fs::path prefix = write_dataset(dir.path(), {5, 7, bad, 2});
    const IndexedDataset dataset(prefix);
    try {
      token_stats(dataset);
      ADD_FAILURE() << "token " << bad << " was counted";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::kCorruptData);
      const std::string message = error.what();
      EXPECT_NE(message.find(dataset.data_path().string()), std::string::npos) << message;
      EXPECT_NE(message.find("token " + std::to_string(bad) + " at position 2"), std::string::npos)
          << message;
    }
  }
}

}  // namespace
}  // namespace megacpp::data
