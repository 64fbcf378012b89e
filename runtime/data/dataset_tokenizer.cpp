#include "runtime/data/dataset_tokenizer.h"

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "base/atomic_file.h"
#include "base/error.h"
#include "runtime/data/byte_tokenizer.h"

namespace megacpp::data {

using nlohmann::json;

std::string DatasetTokenizer::describe() const {
  if (type == "sentencepiece") {
    return fmt::format("sentencepiece {} ({} tokens)", model.string(), vocab_size);
  }
  return fmt::format("{} ({} tokens)", type, vocab_size);
}

bool DatasetTokenizer::same_as(const DatasetTokenizer& other) const {
  // The model's path may differ between machines; its bytes may not.
  return type == other.type && vocab_size == other.vocab_size &&
         end_of_document == other.end_of_document && model_fingerprint == other.model_fingerprint;
}

DatasetTokenizer byte_dataset_tokenizer() {
  return {"byte", {}, {}, ByteTokenizer::kVocabSize, ByteTokenizer::kEndOfDocument};
}

std::filesystem::path tokenizer_file_path(const std::filesystem::path& prefix) {
  return std::filesystem::path(prefix.string() + ".tokenizer.json");
}

void write_dataset_tokenizer(const std::filesystem::path& prefix, const DatasetTokenizer& info) {
  json j = {{"type", info.type},
            {"vocab_size", info.vocab_size},
            {"end_of_document", info.end_of_document}};
  if (!info.model.empty()) {
    j["model"] = info.model.string();
    j["model_fnv1a64"] = info.model_fingerprint;
  }
  write_file_atomically(tokenizer_file_path(prefix), j.dump(2) + "\n");
}

std::optional<DatasetTokenizer> read_dataset_tokenizer(const std::filesystem::path& prefix) {
  const std::filesystem::path path = tokenizer_file_path(prefix);
  std::error_code error;
  if (!std::filesystem::exists(path, error)) return std::nullopt;
  DatasetTokenizer out;
  try {
    const json j = json::parse(read_file(path));
    out.type = j.at("type").get<std::string>();
    out.vocab_size = j.at("vocab_size").get<std::int64_t>();
    out.end_of_document = j.at("end_of_document").get<std::int64_t>();
    if (j.contains("model")) out.model = j.at("model").get<std::string>();
    if (j.contains("model_fnv1a64"))
      out.model_fingerprint = j.at("model_fnv1a64").get<std::string>();
  } catch (const json::exception& e) {
    fail(ErrorKind::kCorruptData, "{}: not a tokenizer record: {}", path.string(), e.what());
  }
  if (out.type != "byte" && out.type != "sentencepiece") {
    fail(ErrorKind::kCorruptData, "{}: type \"{}\" is not byte or sentencepiece", path.string(),
         out.type);
  }
  if (out.vocab_size < 1 || out.end_of_document < 0 || out.end_of_document >= out.vocab_size) {
    fail(ErrorKind::kCorruptData, "{}: vocab_size={} and end_of_document={} do not fit together",
         path.string(), out.vocab_size, out.end_of_document);
  }
  return out;
}

void check_dataset_tokenizers(std::span<const NamedDataset> datasets, std::int64_t model_vocab_size,
                              std::string_view model_source) {
  std::optional<DatasetTokenizer> first;
  const NamedDataset* first_dataset = nullptr;
  for (const NamedDataset& dataset : datasets) {
    const auto tokenizer = read_dataset_tokenizer(dataset.prefix);
    if (!tokenizer) continue;
    if (tokenizer->vocab_size > model_vocab_size) {
      fail(ErrorKind::kInvalidArgument,
           "{}: {} records the tokenizer {}, more ids than the model's vocab_size={} ({}): use a "
           "model whose vocab_size is at least {}, or a dataset made with a smaller vocabulary",
           dataset.field, tokenizer_file_path(dataset.prefix).string(), tokenizer->describe(),
           model_vocab_size, model_source, tokenizer->vocab_size);
    }
    if (!first) {
      first = tokenizer;
      first_dataset = &dataset;
    } else if (!first->same_as(*tokenizer)) {
      fail(ErrorKind::kInvalidArgument,
           "{}: {} was made by the tokenizer {}, but {} ({}) by {}: the datasets of one job must "
           "share one tokenizer",
           dataset.field, dataset.prefix.string(), tokenizer->describe(), first_dataset->field,
           first_dataset->prefix.string(), first->describe());
    }
  }
}

}  // namespace megacpp::data
