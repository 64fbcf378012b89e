#pragma once
// A SentencePiece model (what spm_train writes, and what Megatron's SentencePieceTokenizer
// loads), encoded by libsentencepiece in a helper process, megacpp-sentencepiece
// (sentencepiece_helper_main.cpp). Not in this process: Debian's libsentencepiece carries its
// own copy of protobuf-lite and exports it, and loaded beside gRPC's libprotobuf (the CLI, the
// daemon, every test program) the two copies bind to each other's symbols and the process
// crashes while loading.
#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace megacpp::data {

class SentencePieceTokenizer {
 public:
  // Error(kNotFound) when the model does not exist, kInvalidArgument naming it when it is not a
  // SentencePiece model or has no end-of-sentence piece (eos_id=-1 at training): documents need
  // one to end with, as Megatron's preprocess_data.py appends it. kFailedPrecondition when the
  // helper cannot be found (see find_sentencepiece_helper).
  explicit SentencePieceTokenizer(const std::filesystem::path& model);
  ~SentencePieceTokenizer();
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  const std::filesystem::path& model_path() const { return path_; }
  // The number of pieces: ids are in [0, vocab_size).
  std::int32_t vocab_size() const { return vocab_size_; }
  std::int32_t end_of_document() const { return end_of_document_; }
  // FNV-1a of the model file's bytes, in hex: two datasets share a tokenizer exactly when
  // their models have the same bytes.
  const std::string& fingerprint() const { return fingerprint_; }

  // The whole text in one piece sequence, as Megatron encodes a document. Error(kIo) naming the
  // helper when it fails.
  std::vector<std::int32_t> encode(std::string_view text) const;

 private:
  void stop() noexcept;

  std::filesystem::path path_;
  std::filesystem::path helper_;
  std::string fingerprint_;
  std::int32_t vocab_size_ = 0;
  std::int32_t end_of_document_ = -1;
  pid_t pid_ = -1;
  int socket_ = -1;
};

// The megacpp-sentencepiece binary: $MEGACPP_SENTENCEPIECE_HELPER when set, else beside this
// program's executable, else in ../bin from it (test programs live in BUILD/tests), else on
// PATH. Error(kFailedPrecondition) naming the places looked in when there is none.
std::filesystem::path find_sentencepiece_helper();

}  // namespace megacpp::data
