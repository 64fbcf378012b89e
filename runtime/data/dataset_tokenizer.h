#pragma once
// Which tokenizer made a dataset. Megatron's .idx does not say, yet a model must have room for
// every id of it, and the datasets of one job must share it (a blend of two tokenizers would
// train on ids that mean different things). `megacpp data prepare` therefore writes
// PREFIX.tokenizer.json beside PREFIX.bin/.idx:
//
//   {"type": "byte" | "sentencepiece", "model": "/abs/m.model", "model_fnv1a64": "…",
//    "vocab_size": 320, "end_of_document": 2}
//
// Datasets from other tools have no such file and are taken as they are; the cross entropy still
// refuses any target id beyond the model's vocabulary when it meets one.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace megacpp::data {

struct DatasetTokenizer {
  std::string type;               // "byte" or "sentencepiece"
  std::filesystem::path model;    // the SentencePiece model file; empty for bytes
  std::string model_fingerprint;  // SentencePieceTokenizer::fingerprint(); empty for bytes
  std::int64_t vocab_size = 0;    // ids are in [0, vocab_size)
  std::int64_t end_of_document = 0;

  // "sentencepiece m.model (320 tokens)".
  std::string describe() const;
  bool same_as(const DatasetTokenizer& other) const;
};

DatasetTokenizer byte_dataset_tokenizer();

// PREFIX + ".tokenizer.json".
std::filesystem::path tokenizer_file_path(const std::filesystem::path& prefix);
void write_dataset_tokenizer(const std::filesystem::path& prefix, const DatasetTokenizer& info);
// nullopt when PREFIX.tokenizer.json does not exist; Error(kCorruptData) naming the file when it
// is malformed.
std::optional<DatasetTokenizer> read_dataset_tokenizer(const std::filesystem::path& prefix);

// One dataset as the job names it: field "spec.train_blend[1].prefix", prefix "/data/web_train".
struct NamedDataset {
  std::string field;
  std::filesystem::path prefix;
};

// Error(kInvalidArgument) when a dataset's tokenizer has more ids than the model's vocabulary
// (naming the dataset's field, its tokenizer file, the tokenizer's vocab size and the model
// config's vocab_size with where the config came from, `model_source`: "spec.config_json",
// "preset tiny"), or when two datasets were made by different tokenizers (naming both fields
// and tokenizers).
void check_dataset_tokenizers(std::span<const NamedDataset> datasets, std::int64_t model_vocab_size,
                              std::string_view model_source);

}  // namespace megacpp::data
