// data prepare, data stats: in process, no daemon.
#include <fmt/format.h>
#include <string>

#include "cli/commands/commands.h"
#include "cli/commands/output.h"
#include "runtime/data/indexed_dataset.h"
#include "runtime/data/prepare.h"
#include "runtime/data/token_stats.h"

namespace megacpp::cli {
namespace {

struct PrepareArgs {
  data::PrepareOptions options;
  std::string input;
  std::string output;
};

int prepare(const PrepareArgs& args, const GlobalOptions& global) {
  data::PrepareOptions options = args.options;
  options.input = args.input;
  options.output_prefix = args.output;
  const auto r = data::prepare_dataset(options);
  print(
      global.json,
      {{"files_read", r.files_read},
       {"files_skipped", r.files_skipped},
       {"bytes_read", r.bytes_read},
       {"train",
        {{"documents", r.train.documents}, {"tokens", r.train.tokens}, {"bin", r.train.bin_path}}},
       {"valid",
        {{"documents", r.valid.documents}, {"tokens", r.valid.tokens}, {"bin", r.valid.bin_path}}},
       {"tokenizer",
        {{"type", r.tokenizer.type},
         {"model", r.tokenizer.model.string()},
         {"vocab_size", r.tokenizer.vocab_size},
         {"end_of_document", r.tokenizer.end_of_document}}}},
      fmt::format("read {} files ({} bytes, {} skipped), tokenizer {}\n"
                  "train: {} documents, {} tokens -> {}\nvalid: {} documents, {} tokens -> {}\n",
                  r.files_read, r.bytes_read, r.files_skipped, r.tokenizer.describe(),
                  r.train.documents, r.train.tokens, r.train.bin_path.string(), r.valid.documents,
                  r.valid.tokens, r.valid.bin_path.string()));
  return kExitOk;
}

void add_prepare(CLI::App& data_command, CommandTable& commands) {
  auto* command = data_command.add_subcommand(
      "prepare", "text files -> Megatron indexed dataset (bytes or SentencePiece)");
  auto& args = commands.add(command, prepare);
  command->add_option("--input", args.input, "a text file or a directory tree")->required();
  command->add_option("--output", args.output, "output prefix: writes PREFIX_train/_valid")
      ->required();
  command->add_option("--ext", args.options.extensions, "file suffixes to take (default: all)")
      ->delimiter(',');
  command->add_option("--valid-fraction", args.options.valid_fraction)->capture_default_str();
  command->add_option("--seed", args.options.seed)->capture_default_str();
  command->add_option("--max-bytes", args.options.max_bytes, "0 = no limit")->capture_default_str();
  // No CLI::ExistingFile check: a missing model is "not found" (exit 4), as elsewhere.
  command->add_option("--tokenizer", args.options.tokenizer_model,
                      "a SentencePiece model (spm_train's .model); default: bytes");
}

struct StatsArgs {
  std::string prefix;
};

int stats(const StatsArgs& args, const GlobalOptions& global) {
  const data::IndexedDataset dataset(args.prefix);
  const auto s = data::token_stats(dataset);
  print(global.json,
        {{"tokens", s.tokens},
         {"documents", s.documents},
         {"unigram_entropy_nats", s.unigram_entropy_nats}},
        fmt::format("{} tokens in {} documents; unigram entropy {:.4f} nats\n", s.tokens,
                    s.documents, s.unigram_entropy_nats));
  return kExitOk;
}

void add_stats(CLI::App& data_command, CommandTable& commands) {
  auto* command =
      data_command.add_subcommand("stats", "token count and unigram entropy of a dataset");
  auto& args = commands.add(command, stats);
  command->add_option("prefix", args.prefix, "dataset prefix")->required();
}

}  // namespace

void add_data_commands(CLI::App& app, CommandTable& commands) {
  auto* data_command = app.add_subcommand("data", "datasets");
  data_command->require_subcommand(1);
  add_prepare(*data_command, commands);
  add_stats(*data_command, commands);
}

}  // namespace megacpp::cli
