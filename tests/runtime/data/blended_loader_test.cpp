// Data blends: windows drawn from several datasets in proportion to their weights, by Megatron's
// rule, deterministically, and resumable from the saved cursors.
#include "runtime/data/blended_loader.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "base/error.h"
#include "tests/support/temp_dir.h"

namespace megacpp::data {
namespace {

using testing::TempDir;

constexpr int kSeqlen = 4;
constexpr std::size_t kWindow = kSeqlen + 1;

// Dataset `id`: stream token i is id * 1000 + i % 500, so a window tells its dataset and place.
std::shared_ptr<const IndexedDataset> make_dataset(const TempDir& dir, int id, int tokens) {
  const auto prefix = dir / fmt::format("d{}", id);
  IndexedDatasetBuilder builder(prefix, TokenDtype::kInt32);
  std::vector<std::int32_t> document;
  for (int i = 0; i < tokens; ++i) document.push_back(id * 1000 + i % 500);
  builder.add_document(document);
  builder.finalize();
  return std::make_shared<const IndexedDataset>(prefix);
}

// The dataset of each window of `windows` drawn one batch of `batch` at a time.
std::vector<int> draw(BlendedLoader& loader, int windows, int batch,
                      std::vector<std::int32_t>* tokens = nullptr) {
  std::vector<int> sources;
  std::vector<std::int32_t> buffer(static_cast<std::size_t>(batch) * kWindow);
  for (int done = 0; done < windows; done += batch) {
    loader.next_batch(batch, buffer.data());
    for (int b = 0; b < batch; ++b) sources.push_back(buffer[b * kWindow] / 1000);
    if (tokens) tokens->insert(tokens->end(), buffer.begin(), buffer.end());
  }
  return sources;
}

TEST(BlendedLoader, DrawsInProportionToTheWeightsAtEveryPoint) {
  TempDir dir;
  const std::vector<double> weights = {3, 1, 0.5};
  std::vector<BlendComponent> components;
  for (int d = 0; d < 3; ++d) components.push_back({make_dataset(dir, d + 1, 97), weights[d]});
  BlendedLoader loader(components, kSeqlen);
  const std::vector<int> sources = draw(loader, 900, 3);
  std::vector<double> counts(3, 0);
  for (std::size_t n = 0; n < sources.size(); ++n) {
    counts[static_cast<std::size_t>(sources[n] - 1)] += 1;
    for (std::size_t d = 0; d < 3; ++d) {
      const double expected = weights[d] / 4.5 * static_cast<double>(n + 1);
      ASSERT_LE(std::abs(counts[d] - expected), 1.0) << "dataset " << d << " after " << n + 1;
    }
  }
  EXPECT_EQ(counts, (std::vector<double>{600, 200, 100}));
  // Each dataset gives its own windows in stream order, as a loader of it alone would.
  const auto cursors = loader.cursors();
  EXPECT_EQ(cursors[0].windows, 600u);
  EXPECT_EQ(cursors[0].position, (600u * kSeqlen) % 97u);
}

TEST(BlendedLoader, TheSameWeightsDrawTheSameWindowsAndCursorsResumeThem) {
  TempDir dir;
  const std::vector<BlendComponent> components = {{make_dataset(dir, 1, 50), 0.7},
                                                  {make_dataset(dir, 2, 61), 0.3}};
  BlendedLoader straight(components, kSeqlen), again(components, kSeqlen);
  std::vector<std::int32_t> a, b;
  draw(straight, 120, 4, &a);
  draw(again, 120, 4, &b);
  EXPECT_EQ(a, b);

  BlendedLoader first(components, kSeqlen);
  std::vector<std::int32_t> resumed;
  draw(first, 52, 4, &resumed);
  BlendedLoader second(components, kSeqlen);
  second.restore(first.cursors());
  draw(second, 68, 4, &resumed);
  EXPECT_EQ(resumed, a);
}

TEST(BlendedLoader, OneDatasetReadsExactlyAsASequenceLoader) {
  TempDir dir;
  const auto dataset = make_dataset(dir, 1, 37);
  BlendedLoader blend({{dataset, 2.5}}, kSeqlen);
  SequenceLoader plain(dataset, kSeqlen);
  std::vector<std::int32_t> x(3 * kWindow), y(3 * kWindow);
  for (int i = 0; i < 20; ++i) {
    blend.next_batch(3, x.data());
    plain.next_batch(3, y.data());
    ASSERT_EQ(x, y) << "batch " << i;
  }
}

TEST(BlendedLoader, BadWeightsAndCursorsAreRefusedNamingTheDataset) {
  TempDir dir;
  const auto good = make_dataset(dir, 1, 40), other = make_dataset(dir, 2, 40);
  for (const double weight : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(),
                              std::numeric_limits<double>::infinity()}) {
    try {
      BlendedLoader({{good, 1}, {other, weight}}, kSeqlen);
      ADD_FAILURE() << "weight " << weight << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("d2.idx: blend weight"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(BlendedLoader({}, kSeqlen), Error);
  BlendedLoader loader({{good, 1}, {other, 1}}, kSeqlen);
  const std::vector<BlendedLoader::Cursor> one = {{0, 0}};
  EXPECT_THROW(loader.restore(one), Error);
  const std::vector<BlendedLoader::Cursor> beyond = {{0, 0}, {40, 1}};
  EXPECT_THROW(loader.restore(beyond), Error);
}

}  // namespace
}  // namespace megacpp::data
