// `data prepare` with a SentencePiece model trained here by spm_train: the tokens are the
// model's (as spm_encode gives them), the vocabulary and end-of-document id come from it and are
// recorded beside the dataset, and a file that is no model is refused by name.
#include "runtime/data/sentencepiece_tokenizer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "base/error.h"
#include "runtime/data/dataset_tokenizer.h"
#include "runtime/data/indexed_dataset.h"
#include "runtime/data/prepare.h"
#include "tests/support/sentencepiece.h"
#include "tests/support/temp_dir.h"

namespace megacpp::data {
namespace {

using testing::TempDir;

class SentencePieceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::find_program("spm_train").empty()) GTEST_SKIP() << testing::kNoSpmTrain;
    model_ = testing::train_sentencepiece(dir_.path(), "spm", 320);
    ASSERT_FALSE(model_.empty());
    for (int i = 0; i < 6; ++i) {
      testing::write_text(dir_ / fmt::format("corpus/doc{}.txt", i),
                          testing::word_text(static_cast<uint64_t>(100 + i), 30));
    }
  }

  TempDir dir_;
  std::filesystem::path model_;
};

TEST_F(SentencePieceTest, TheModelGivesTheVocabularyAndTheEndOfDocumentAndSpmEncodesAgree) {
  const SentencePieceTokenizer tokenizer(model_);
  EXPECT_EQ(tokenizer.vocab_size(), 320);
  EXPECT_EQ(tokenizer.end_of_document(), 2);  // spm_train's default eos_id
  // The library's own command-line encoder gives the same ids for a line of text.
  const std::string line = testing::word_text(9, 1);
  testing::write_text(dir_ / "line.txt", line);
  const std::string command =
      fmt::format("spm_encode --model='{}' --output_format=id < '{}' > '{}'", model_.string(),
                  (dir_ / "line.txt").string(), (dir_ / "line.ids").string());
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::vector<std::int32_t> expected;
  std::istringstream ids(testing::read_bytes(dir_ / "line.ids"));
  for (std::int32_t id = 0; ids >> id;) expected.push_back(id);
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(tokenizer.encode(line.substr(0, line.size() - 1)), expected);
  EXPECT_TRUE(tokenizer.encode("").empty());
  // One helper serves any number of documents, long ones included.
  const std::string book = testing::word_text(10, 5000);
  const auto pieces = tokenizer.encode(book);
  EXPECT_GT(pieces.size(), 5000u);
  for (const auto id : pieces) ASSERT_TRUE(id >= 0 && id < 320) << id;
}

TEST_F(SentencePieceTest, PrepareWritesTheModelsTokensAndRecordsTheTokenizer) {
  PrepareOptions options;
  options.input = dir_ / "corpus";
  options.output_prefix = dir_ / "data/spm";
  options.valid_fraction = 0.2;
  options.tokenizer_model = model_;
  const PrepareReport report = prepare_dataset(options);
  EXPECT_EQ(report.tokenizer.type, "sentencepiece");
  EXPECT_EQ(report.tokenizer.vocab_size, 320);
  EXPECT_EQ(report.tokenizer.end_of_document, 2);
  EXPECT_EQ(report.files_read, 6u);

  // Every document is the model's encoding of one file, then the eos id.
  const SentencePieceTokenizer tokenizer(model_);
  std::vector<std::vector<std::int32_t>> expected;
  for (int i = 0; i < 6; ++i) {
    auto ids = tokenizer.encode(testing::read_bytes(dir_ / fmt::format("corpus/doc{}.txt", i)));
    ids.push_back(2);
    expected.push_back(ids);
  }
  std::uint64_t documents = 0;
  for (const char* split : {"train", "valid"}) {
    const std::filesystem::path prefix = dir_ / (std::string("data/spm_") + split);
    const IndexedDataset dataset(prefix);
    EXPECT_EQ(dataset.dtype(), TokenDtype::kUint16);
    for (std::uint64_t d = 0; d < dataset.num_documents(); ++d) {
      const IndexRange range = dataset.document_tokens(d);
      std::vector<std::int32_t> tokens(range.size());
      dataset.read_stream(range.begin, range.size(), tokens.data());
      EXPECT_NE(std::find(expected.begin(), expected.end(), tokens), expected.end())
          << split << " document " << d << " is no file's encoding";
      ++documents;
    }
    const auto recorded = read_dataset_tokenizer(prefix);
    ASSERT_TRUE(recorded.has_value()) << split;
    EXPECT_TRUE(recorded->same_as(report.tokenizer)) << recorded->describe();
    EXPECT_EQ(recorded->model, std::filesystem::absolute(model_));
  }
  EXPECT_EQ(documents, 6u);
  // A second run over the same tree does not read its own outputs (tokenizer records
  // included) as input.
  options.output_prefix = dir_ / "corpus/out";
  EXPECT_EQ(prepare_dataset(options).files_read, 6u);
  EXPECT_EQ(prepare_dataset(options).files_read, 6u);
}

TEST_F(SentencePieceTest, AMissingOrInvalidModelIsRefusedByName) {
  PrepareOptions options;
  options.input = dir_ / "corpus";
  options.output_prefix = dir_ / "data/bad";
  options.tokenizer_model = dir_ / "absent.model";
  try {
    prepare_dataset(options);
    FAIL() << "a missing model was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
    EXPECT_NE(std::string(e.what()).find("absent.model"), std::string::npos) << e.what();
  }
  testing::write_text(dir_ / "text.model", "this is not a model\n");
  options.tokenizer_model = dir_ / "text.model";
  try {
    prepare_dataset(options);
    FAIL() << "a text file was taken for a model";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("text.model: not a SentencePiece model"),
              std::string::npos)
        << e.what();
  }
  // Nothing was written: the model is loaded before any input is read.
  EXPECT_FALSE(std::filesystem::exists(dir_ / "data/bad_train.bin"));
}

}  // namespace
}  // namespace megacpp::data
