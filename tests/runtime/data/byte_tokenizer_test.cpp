#include "runtime/data/byte_tokenizer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace megacpp::data {
namespace {

TEST(ByteTokenizer, VocabularyIsBytesPlusEod) {
  EXPECT_EQ(ByteTokenizer::kEndOfDocument, 256);
  EXPECT_EQ(ByteTokenizer::kVocabSize, 257);
}

TEST(ByteTokenizer, EncodesEachByteAsItsUnsignedValue) {
  const std::string text("A\n\0\x7f\x80\xff", 6);
  EXPECT_EQ(ByteTokenizer::encode(text), (std::vector<std::int32_t>{65, 10, 0, 127, 128, 255}));
  EXPECT_EQ(ByteTokenizer::encode(text, true),
            (std::vector<std::int32_t>{65, 10, 0, 127, 128, 255, 256}));
  EXPECT_TRUE(ByteTokenizer::encode("").empty());
  EXPECT_EQ(ByteTokenizer::encode("", true), (std::vector<std::int32_t>{256}));
}

TEST(ByteTokenizer, RoundTripsAllByteValues) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  all += "\xc3\xa9t\xc3\xa9 UTF-8 stays bytes";
  const std::vector<std::int32_t> tokens = ByteTokenizer::encode(all, true);
  ASSERT_EQ(tokens.size(), all.size() + 1);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(tokens[static_cast<std::size_t>(b)], b);
  EXPECT_EQ(ByteTokenizer::decode(tokens), all);
}

TEST(ByteTokenizer, DecodeDropsEodAndRefusesUnknownIds) {
  EXPECT_EQ(ByteTokenizer::decode(std::vector<std::int32_t>{104, 256, 105, 256}), "hi");
  for (const std::int32_t bad : {257, 263, -1}) {
    try {
      ByteTokenizer::decode(std::vector<std::int32_t>{104, bad});
      FAIL() << "token " << bad << " must be refused";
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
      EXPECT_NE(std::string(error.what()).find("position 1"), std::string::npos) << error.what();
    }
  }
}

}  // namespace
}  // namespace megacpp::data
