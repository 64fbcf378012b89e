#pragma once
// Byte-level tokenizer: token t < 256 is the byte t, token 256 ends a document.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/error.h"

namespace megacpp::data {

class ByteTokenizer {
 public:
  static constexpr std::int32_t kEndOfDocument = 256;
  static constexpr std::int32_t kVocabSize = 257;

  // One token per byte; the end-of-document token is appended only when asked.
  static std::vector<std::int32_t> encode(std::string_view text,
                                          bool append_end_of_document = false) {
    std::vector<std::int32_t> tokens;
    tokens.reserve(text.size() + (append_end_of_document ? 1 : 0));
    for (const char byte : text)
      tokens.push_back(static_cast<std::int32_t>(static_cast<unsigned char>(byte)));
    if (append_end_of_document) tokens.push_back(kEndOfDocument);
    return tokens;
  }

  // End-of-document tokens carry no text and are dropped; any id outside the
  // vocabulary (e.g. a padded-vocab logit a sampler picked) throws kInvalidArgument.
  static std::string decode(std::span<const std::int32_t> tokens) {
    std::string text;
    text.reserve(tokens.size());
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const std::int32_t token = tokens[i];
      if (token == kEndOfDocument) continue;
      if (token < 0 || token > 255) {
        fail(ErrorKind::kInvalidArgument,
             "byte tokenizer: token {} at position {} is outside the vocabulary [0, {})", token, i,
             kVocabSize);
      }
      text.push_back(static_cast<char>(static_cast<unsigned char>(token)));
    }
    return text;
  }
};

}  // namespace megacpp::data
