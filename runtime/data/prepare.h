#pragma once
// Turns a tree of text files into Megatron indexed datasets: one document per file (its
// tokens, then the end-of-document token), split into PREFIX_train and PREFIX_valid. Tokens are
// the file's bytes (ByteTokenizer) or, with a SentencePiece model, its pieces.
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "runtime/data/dataset_tokenizer.h"

namespace megacpp::data {

struct PrepareOptions {
  std::filesystem::path input;  // a file or a directory tree of text files
  // File name suffixes to take, e.g. {".h", ".hpp"}; a suffix without a leading dot
  // gets one. Empty = every regular file. An input that is itself a file is always taken.
  std::vector<std::string> extensions;
  // Writes PREFIX_train.bin/.idx and PREFIX_valid.bin/.idx; missing parent directories
  // are created.
  std::filesystem::path output_prefix;
  double valid_fraction = 0.05;  // in [0, 1)
  std::uint64_t seed = 1234;
  // Total input bytes to take, 0 = no limit. Files are taken in shuffled order; one
  // that would overflow the budget is left out and later, smaller ones still tried.
  std::uint64_t max_bytes = 0;
  // A SentencePiece model (spm_train's .model); empty: bytes. The vocabulary size and the
  // end-of-document id (the model's eos piece, as Megatron appends it) come from the model.
  std::filesystem::path tokenizer_model;
};

struct SplitReport {
  std::uint64_t documents = 0;
  std::uint64_t tokens = 0;
  std::filesystem::path bin_path;
  std::filesystem::path idx_path;
};

struct PrepareReport {
  std::uint64_t files_read = 0;  // = train.documents + valid.documents
  std::uint64_t bytes_read = 0;
  // Unreadable files and directories, dangling or looping symlinks, symlinks to
  // directories (not followed), files over the format's 2^31 - 2 byte document limit.
  std::uint64_t files_skipped = 0;
  std::uint64_t files_over_limit = 0;  // left out to respect max_bytes
  std::uint64_t bytes_skipped = 0;     // sizes of both kinds above, where known
  SplitReport train;
  SplitReport valid;
  DatasetTokenizer tokenizer;  // also written to each split's PREFIX.tokenizer.json
};

// Files are listed in bytewise order of their path relative to `input`, shuffled by a
// Fisher-Yates pass driven by std::mt19937_64(seed) (same result on every standard
// library), and the first ceil(valid_fraction * n) documents form the validation split,
// clamped to [1, n - 1] when n >= 2 (n = 1 puts the single document in train and
// leaves valid empty). Token dtype uint16 (int32 for a SentencePiece vocabulary beyond 2^16),
// vocabulary ByteTokenizer (257) or the SentencePiece model's.
// Throws kNotFound when input (or the tokenizer model) does not exist, kInvalidArgument when
// it holds no matching file, the model is not a SentencePiece model, or an option is out of
// range, kIo when a read or write fails.
PrepareReport prepare_dataset(const PrepareOptions& options);

}  // namespace megacpp::data
