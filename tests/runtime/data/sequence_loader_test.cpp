#include "runtime/data/sequence_loader.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "base/error.h"

namespace megacpp::data {
namespace {

namespace fs = std::filesystem;

class SequenceLoaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("megacpp_sequence_loader_test_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Documents of the given sizes; stream token i has the value 1000 + i.
  std::shared_ptr<const IndexedDataset> make_dataset(const std::vector<int>& document_sizes) {
    const fs::path prefix = dir_ / "stream";
    IndexedDatasetBuilder builder(prefix, TokenDtype::kUint16);
    std::int32_t next = 1000;
    for (const int size : document_sizes) {
      std::vector<std::int32_t> document;
      for (int i = 0; i < size; ++i) document.push_back(next++);
      builder.add_document(document);
    }
    builder.finalize();
    stream_.clear();
    for (std::int32_t v = 1000; v < next; ++v) stream_.push_back(v);
    return std::make_shared<const IndexedDataset>(prefix);
  }

  // Window k of training starts at k * seqlen in the endless repetition of the stream.
  std::vector<std::int32_t> expected_window(std::uint64_t k, int seqlen) const {
    std::vector<std::int32_t> window;
    for (int t = 0; t <= seqlen; ++t) {
      window.push_back(
          stream_[(k * static_cast<std::uint64_t>(seqlen) + static_cast<std::uint64_t>(t)) %
                  stream_.size()]);
    }
    return window;
  }

  fs::path dir_;
  std::vector<std::int32_t> stream_;
};

std::vector<std::int32_t> row(const std::vector<std::int32_t>& batch, int b, int seqlen) {
  const auto width = static_cast<std::ptrdiff_t>(seqlen + 1);
  return std::vector<std::int32_t>(batch.begin() + b * width, batch.begin() + (b + 1) * width);
}

TEST_F(SequenceLoaderTest, ConsecutiveWindowsOverlapByOneTokenAndSpanDocuments) {
  SequenceLoader loader(make_dataset({3, 5, 2}), 3);
  EXPECT_EQ(loader.total_tokens(), 10u);
  EXPECT_EQ(loader.position(), 0u);
  std::vector<std::int32_t> batch(2 * 4, -1);
  loader.next_batch(2, batch.data());
  EXPECT_EQ(row(batch, 0, 3), (std::vector<std::int32_t>{1000, 1001, 1002, 1003}));
  EXPECT_EQ(row(batch, 1, 3), (std::vector<std::int32_t>{1003, 1004, 1005, 1006}));
  EXPECT_EQ(loader.position(), 6u);
  loader.next_batch(2, batch.data());
  EXPECT_EQ(row(batch, 0, 3), (std::vector<std::int32_t>{1006, 1007, 1008, 1009}));
  // This window runs off the end of the stream and continues from token 0.
  EXPECT_EQ(row(batch, 1, 3), (std::vector<std::int32_t>{1009, 1000, 1001, 1002}));
  EXPECT_EQ(loader.position(), 2u);
}

TEST_F(SequenceLoaderTest, ManyEpochsMatchTheModularReference) {
  const int seqlen = 7;
  const int batch_size = 3;
  SequenceLoader loader(make_dataset({5, 1, 9, 4, 3}), seqlen);  // 22 tokens
  std::vector<std::int32_t> batch(static_cast<std::size_t>(batch_size * (seqlen + 1)));
  std::uint64_t k = 0;
  for (int step = 0; step < 40; ++step) {
    loader.next_batch(batch_size, batch.data());
    for (int b = 0; b < batch_size; ++b, ++k) {
      ASSERT_EQ(row(batch, b, seqlen), expected_window(k, seqlen)) << "window " << k;
    }
    EXPECT_EQ(loader.position(), (k * seqlen) % 22);
  }
}

TEST_F(SequenceLoaderTest, SeekToASavedPositionReplaysTheSameBatches) {
  const int seqlen = 4;
  auto dataset = make_dataset({6, 6, 5});
  SequenceLoader loader(dataset, seqlen);
  std::vector<std::int32_t> batch(2 * 5);
  for (int i = 0; i < 3; ++i) loader.next_batch(2, batch.data());
  const std::uint64_t saved = loader.position();
  std::vector<std::int32_t> first(4 * 5);
  loader.next_batch(4, first.data());

  loader.seek(saved);
  EXPECT_EQ(loader.position(), saved);
  std::vector<std::int32_t> again(4 * 5);
  loader.next_batch(4, again.data());
  EXPECT_EQ(again, first);

  // A fresh loader (a restarted trainer) resumes identically from the saved position.
  SequenceLoader resumed(dataset, seqlen);
  resumed.seek(saved);
  std::vector<std::int32_t> from_resume(4 * 5);
  resumed.next_batch(4, from_resume.data());
  EXPECT_EQ(from_resume, first);
  EXPECT_EQ(resumed.position(), loader.position());
}

TEST_F(SequenceLoaderTest, SeekBeyondTheStreamIsRejected) {
  SequenceLoader loader(make_dataset({4, 4}), 3);
  loader.seek(7);
  try {
    loader.seek(8);
    FAIL() << "seek(8) on 8 tokens must throw";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("8 tokens"), std::string::npos) << error.what();
  }
  EXPECT_EQ(loader.position(), 7u);
}

TEST_F(SequenceLoaderTest, DatasetShorterThanOneWindowIsAnErrorNamingBothNumbers) {
  auto dataset = make_dataset({4, 6});
  SequenceLoader exactly_one(dataset, 9);  // 10 tokens = seqlen + 1 is enough
  std::vector<std::int32_t> batch(3 * 10);
  exactly_one.next_batch(3, batch.data());
  EXPECT_EQ(row(batch, 2, 9), expected_window(2, 9));
  try {
    SequenceLoader loader(dataset, 10);
    FAIL() << "10 tokens cannot hold a window of 11";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
    const std::string message = error.what();
    EXPECT_NE(message.find("stream.idx"), std::string::npos) << message;
    EXPECT_NE(message.find("10 tokens"), std::string::npos) << message;
    EXPECT_NE(message.find("11"), std::string::npos) << message;
  }
  EXPECT_THROW(SequenceLoader(dataset, 0), Error);
  EXPECT_THROW(SequenceLoader(nullptr, 4), Error);
}

TEST_F(SequenceLoaderTest, EvalWindowsTileTheStreamWithoutWrap) {
  auto dataset = make_dataset({3, 5, 2});  // 10 tokens
  EXPECT_EQ(num_eval_windows(*dataset, 3), 3);
  EXPECT_EQ(num_eval_windows(*dataset, 4), 2);
  EXPECT_EQ(num_eval_windows(*dataset, 9), 1);
  EXPECT_THROW(num_eval_windows(*dataset, 10), Error);

  std::vector<std::int32_t> targets;
  std::vector<std::int32_t> window(4);
  for (std::int64_t i = 0; i < num_eval_windows(*dataset, 3); ++i) {
    eval_window(*dataset, i, 3, window.data());
    EXPECT_EQ(window, expected_window(static_cast<std::uint64_t>(i), 3)) << "window " << i;
    targets.insert(targets.end(), window.begin() + 1, window.end());
  }
  // Every token after the first is a target exactly once.
  EXPECT_EQ(targets, std::vector<std::int32_t>(stream_.begin() + 1, stream_.end()));

  std::vector<std::int32_t> wide(5);
  eval_window(*dataset, 1, 4, wide.data());
  EXPECT_EQ(wide, (std::vector<std::int32_t>{1004, 1005, 1006, 1007, 1008}));
  EXPECT_THROW(eval_window(*dataset, 2, 4, wide.data()), Error);
  EXPECT_THROW(eval_window(*dataset, -1, 4, wide.data()), Error);
}

}  // namespace
}  // namespace megacpp::data
