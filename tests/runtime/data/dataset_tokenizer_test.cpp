// The tokenizer record beside a dataset, and the checks a job makes with it: every dataset fits
// the model's vocabulary, and all of them come from one tokenizer.
#include "runtime/data/dataset_tokenizer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "base/error.h"
#include "runtime/data/prepare.h"
#include "tests/support/temp_dir.h"

namespace megacpp::data {
namespace {

using testing::TempDir;

std::string refusal(const std::vector<NamedDataset>& datasets, std::int64_t vocab,
                    const std::string& source) {
  try {
    check_dataset_tokenizers(datasets, vocab, source);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    return e.what();
  }
  return "";
}

DatasetTokenizer pieces(std::int64_t vocab, const std::string& fingerprint) {
  return {"sentencepiece", "/models/m.model", fingerprint, vocab, 2};
}

TEST(DatasetTokenizer, BytePrepareRecordsTheByteTokenizer) {
  TempDir dir;
  testing::write_text(dir / "in/a.txt", "hello");
  testing::write_text(dir / "in/b.txt", "world");
  PrepareOptions options;
  options.input = dir / "in";
  options.output_prefix = dir / "out/x";
  options.valid_fraction = 0.5;
  prepare_dataset(options);
  for (const char* split : {"x_train", "x_valid"}) {
    const auto recorded = read_dataset_tokenizer(dir / "out" / split);
    ASSERT_TRUE(recorded.has_value()) << split;
    EXPECT_TRUE(recorded->same_as(byte_dataset_tokenizer()));
    EXPECT_EQ(recorded->vocab_size, 257);
    EXPECT_EQ(recorded->end_of_document, 256);
  }
}

TEST(DatasetTokenizer, ATokenizerLargerThanTheModelIsRefusedNamingFieldFileAndSizes) {
  TempDir dir;
  write_dataset_tokenizer(dir / "web", pieces(320, "aa"));
  const std::string message =
      refusal({{"spec.train_blend[1].prefix", dir / "web"}}, 257, "spec.config_json");
  EXPECT_NE(message.find(fmt::format("spec.train_blend[1].prefix: {}",
                                     (dir / "web.tokenizer.json").string())),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("(320 tokens)"), std::string::npos) << message;
  EXPECT_NE(message.find("vocab_size=257 (spec.config_json)"), std::string::npos) << message;
  // A model with room for every id takes it; a dataset without a record is not checked.
  EXPECT_EQ(refusal({{"a", dir / "web"}, {"b", dir / "no-record"}}, 320, "x"), "");
}

TEST(DatasetTokenizer, DatasetsOfDifferentTokenizersAreRefusedNamingBoth) {
  TempDir dir;
  write_dataset_tokenizer(dir / "bytes", byte_dataset_tokenizer());
  write_dataset_tokenizer(dir / "spm", pieces(300, "aa"));
  write_dataset_tokenizer(dir / "spm-same", pieces(300, "aa"));
  write_dataset_tokenizer(dir / "spm-other", pieces(300, "bb"));
  EXPECT_EQ(refusal({{"a", dir / "spm"}, {"b", dir / "spm-same"}}, 300, "x"), "");
  std::string message =
      refusal({{"spec.train_data", dir / "spm"}, {"spec.valid_data", dir / "spm-other"}}, 300, "x");
  EXPECT_NE(message.find(fmt::format("spec.valid_data: {}", (dir / "spm-other").string())),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("spec.train_data"), std::string::npos) << message;
  EXPECT_NE(message.find("share one tokenizer"), std::string::npos) << message;
  message = refusal(
      {{"data.train[0].prefix", dir / "bytes"}, {"data.train[1].prefix", dir / "spm"}}, 300, "x");
  EXPECT_NE(message.find("data.train[1].prefix"), std::string::npos) << message;
  EXPECT_NE(message.find("byte (257 tokens)"), std::string::npos) << message;
}

TEST(DatasetTokenizer, AMalformedRecordIsCorruptDataNamingTheFile) {
  TempDir dir;
  for (const std::string& text :
       {std::string("{"), std::string(R"({"type": "bpe", "vocab_size": 5, "end_of_document": 1})"),
        std::string(R"({"type": "byte", "vocab_size": 5, "end_of_document": 9})")}) {
    testing::write_text(dir / "x.tokenizer.json", text);
    try {
      read_dataset_tokenizer(dir / "x");
      ADD_FAILURE() << "accepted " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kCorruptData);
      EXPECT_NE(std::string(e.what()).find("x.tokenizer.json"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace megacpp::data
