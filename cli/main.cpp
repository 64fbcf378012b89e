// megacpp: the command-line client. In-process subcommands (no daemon): train,
// eval, data prepare, data stats, doctor; the others talk to megacppd over gRPC
// (cli/commands/). Exit codes: see cli/commands/daemon_commands.h.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "cli/commands/daemon_commands.h"
#include "runtime/common/error.h"
#include "runtime/common/version.h"
#include "runtime/data/indexed_dataset.h"
#include "runtime/data/prepare.h"
#include "runtime/data/token_stats.h"
#include "runtime/trainer/trainer.h"

namespace {

using nlohmann::json;

int exit_code_for(megacpp::ErrorKind kind) {
  switch (kind) {
    case megacpp::ErrorKind::kInvalidArgument:
    case megacpp::ErrorKind::kNotFound:
    case megacpp::ErrorKind::kCorruptData:
    case megacpp::ErrorKind::kFailedPrecondition:
      return 2;
    default:
      return 1;
  }
}

void print(bool as_json, const json& j, const std::string& human) {
  if (as_json) {
    std::cout << j.dump(2) << "\n";
  } else {
    std::cout << human;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megacpp: train hybrid Mamba-3 / attention language models"};
  app.set_version_flag("--version", megacpp::version_string());
  app.require_subcommand(1);
  bool as_json = false;
  app.add_flag("--json", as_json, "machine-readable output");

  // train
  auto* train_cmd = app.add_subcommand("train", "train a model in-process from a job JSON file");
  std::string job_file;
  int64_t stop_at = 0;
  bool no_resume = false;
  bool quiet = false;
  train_cmd->add_option("job", job_file, "job JSON file")->required()->check(CLI::ExistingFile);
  train_cmd->add_option("--stop-at", stop_at, "stop after this step (with a checkpoint)");
  train_cmd->add_flag("--no-resume", no_resume, "ignore existing checkpoints in the checkpoint dir");
  train_cmd->add_flag("--quiet", quiet, "no per-step progress on stderr");

  // eval
  auto* eval_cmd = app.add_subcommand("eval", "mean loss of a checkpoint on a dataset");
  std::string ckpt_dir, eval_data;
  int eval_seqlen = 256, eval_batch = 8;
  int64_t max_windows = 0;
  eval_cmd->add_option("--checkpoint", ckpt_dir, "checkpoint directory (config.json + model.safetensors)")
      ->required();
  eval_cmd->add_option("--data", eval_data, "dataset prefix (PREFIX.bin/.idx)")->required();
  eval_cmd->add_option("--seqlen", eval_seqlen, "window length")->capture_default_str();
  eval_cmd->add_option("--batch", eval_batch, "windows per forward")->capture_default_str();
  eval_cmd->add_option("--max-windows", max_windows, "0 = all")->capture_default_str();

  // data
  auto* data_cmd = app.add_subcommand("data", "datasets");
  data_cmd->require_subcommand(1);
  auto* prepare_cmd = data_cmd->add_subcommand("prepare", "text files -> Megatron indexed dataset");
  megacpp::data::PrepareOptions prepare;
  std::string prepare_input, prepare_output;
  prepare_cmd->add_option("--input", prepare_input, "a text file or a directory tree")->required();
  prepare_cmd->add_option("--output", prepare_output, "output prefix: writes PREFIX_train/_valid")
      ->required();
  prepare_cmd->add_option("--ext", prepare.extensions, "file suffixes to take (default: all)")
      ->delimiter(',');
  prepare_cmd->add_option("--valid-fraction", prepare.valid_fraction)->capture_default_str();
  prepare_cmd->add_option("--seed", prepare.seed)->capture_default_str();
  prepare_cmd->add_option("--max-bytes", prepare.max_bytes, "0 = no limit")->capture_default_str();
  auto* stats_cmd = data_cmd->add_subcommand("stats", "token count and unigram entropy of a dataset");
  std::string stats_prefix;
  stats_cmd->add_option("prefix", stats_prefix, "dataset prefix")->required();

  megacpp::cli::GlobalOptions global;
  const auto run_daemon_command = megacpp::cli::add_daemon_commands(app, global);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error exits 2 like bad input.
    return app.exit(e) == 0 ? 0 : 2;
  }
  spdlog::set_pattern("%H:%M:%S.%e %^%l%$ %v");
  global.json = as_json;
  try {
    if (const int code = run_daemon_command(); code >= 0) return code;
    if (*train_cmd) {
      const megacpp::TrainJob job = megacpp::load_train_job(job_file);
      std::unique_ptr<megacpp::JsonLinesObserver> observer;
      const std::filesystem::path log =
          !job.log.empty() ? job.log
                           : (job.checkpoint_dir.empty() ? std::filesystem::path("/dev/null")
                                                         : job.checkpoint_dir / "steps.jsonl");
      observer = std::make_unique<megacpp::JsonLinesObserver>(log, !quiet);
      megacpp::TrainOptions options;
      options.resume = !no_resume;
      options.stop_at = stop_at;
      const auto summary = megacpp::train(job, *observer, options);
      print(as_json, megacpp::to_json(summary),
            fmt::format("steps {}..{} of {} ({}), {} tokens in {:.1f} s\n"
                        "final loss {:.4f}, validation loss {:.4f}\n"
                        "median step {:.1f} ms, {:.0f} tokens/s, {:.2f} GFLOP/s\n",
                        summary.first_step, summary.last_step, summary.total_steps,
                        summary.stop_reason, summary.tokens, summary.wall_seconds,
                        summary.final_loss, summary.final_val_loss, summary.median_step_ms,
                        summary.tokens_per_s, summary.flops_per_s / 1e9));
    } else if (*eval_cmd) {
      const auto r = megacpp::evaluate_checkpoint(ckpt_dir, eval_data, eval_seqlen, eval_batch,
                                                  max_windows);
      print(as_json, {{"loss", r.loss}, {"windows", r.windows}, {"tokens", r.tokens}},
            fmt::format("loss {:.6f} nats over {} windows ({} tokens)\n", r.loss, r.windows,
                        r.tokens));
    } else if (*prepare_cmd) {
      prepare.input = prepare_input;
      prepare.output_prefix = prepare_output;
      const auto r = megacpp::data::prepare_dataset(prepare);
      print(as_json,
            {{"files_read", r.files_read},
             {"files_skipped", r.files_skipped},
             {"bytes_read", r.bytes_read},
             {"train", {{"documents", r.train.documents}, {"tokens", r.train.tokens}, {"bin", r.train.bin_path}}},
             {"valid", {{"documents", r.valid.documents}, {"tokens", r.valid.tokens}, {"bin", r.valid.bin_path}}}},
            fmt::format("read {} files ({} bytes, {} skipped)\ntrain: {} documents, {} tokens -> {}\n"
                        "valid: {} documents, {} tokens -> {}\n",
                        r.files_read, r.bytes_read, r.files_skipped, r.train.documents,
                        r.train.tokens, r.train.bin_path.string(), r.valid.documents,
                        r.valid.tokens, r.valid.bin_path.string()));
    } else if (*stats_cmd) {
      const megacpp::data::IndexedDataset dataset(stats_prefix);
      const auto s = megacpp::data::token_stats(dataset);
      print(as_json,
            {{"tokens", s.tokens}, {"documents", s.documents}, {"unigram_entropy_nats", s.unigram_entropy_nats}},
            fmt::format("{} tokens in {} documents; unigram entropy {:.4f} nats\n", s.tokens,
                        s.documents, s.unigram_entropy_nats));
    }
  } catch (const megacpp::Error& e) {
    spdlog::error("{}", e.what());
    return exit_code_for(e.kind());
  } catch (const std::exception& e) {
    spdlog::error("internal error: {}", e.what());
    return 1;
  }
  return 0;
}
