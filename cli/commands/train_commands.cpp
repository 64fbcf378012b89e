// train, eval: in process, no daemon.
#include <fmt/format.h>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "cli/commands/commands.h"
#include "cli/commands/output.h"
#include "runtime/trainer/trainer.h"

namespace megacpp::cli {
namespace {

struct TrainArgs {
  std::string job_file;
  int64_t stop_at = 0;
  bool no_resume = false;
  bool quiet = false;
};

int train(const TrainArgs& args, const GlobalOptions& global) {
  const TrainJob job = load_train_job(args.job_file);
  const std::filesystem::path log =
      !job.log.empty() ? job.log
                       : (job.checkpoint_dir.empty() ? std::filesystem::path("/dev/null")
                                                     : job.checkpoint_dir / "steps.jsonl");
  JsonLinesObserver observer(log, !args.quiet);
  TrainOptions options;
  options.resume = !args.no_resume;
  options.stop_at = args.stop_at;
  const auto summary = megacpp::train(job, observer, options);
  print(
      global.json, megacpp::to_json(summary),
      fmt::format("steps {}..{} of {} ({}), {} tokens in {:.1f} s\n"
                  "final loss {:.4f}, validation loss {:.4f}\n"
                  "median step {:.1f} ms, {:.0f} tokens/s, {:.2f} GFLOP/s\n",
                  summary.first_step, summary.last_step, summary.total_steps, summary.stop_reason,
                  summary.tokens, summary.wall_seconds, summary.final_loss, summary.final_val_loss,
                  summary.median_step_ms, summary.tokens_per_s, summary.flops_per_s / 1e9));
  return kExitOk;
}

void add_train(CLI::App& app, CommandTable& commands) {
  auto* command = app.add_subcommand("train", "train a model in-process from a job JSON file");
  auto& args = commands.add(command, train);
  // No CLI::ExistingFile check: a missing job file is "not found" (exit 4) from the loader, like
  // a missing file anywhere else, not a usage error.
  command->add_option("job", args.job_file, "job JSON file")->required();
  command->add_option("--stop-at", args.stop_at, "stop after this step (with a checkpoint)");
  command->add_flag("--no-resume", args.no_resume,
                    "ignore existing checkpoints in the checkpoint dir");
  command->add_flag("--quiet", args.quiet, "no per-step progress on stderr");
}

struct EvalArgs {
  std::string checkpoint_dir;
  std::string data;
  int seqlen = 256;
  int batch = 8;
  int64_t max_windows = 0;
};

int eval(const EvalArgs& args, const GlobalOptions& global) {
  const auto r = evaluate_checkpoint(args.checkpoint_dir, args.data, args.seqlen, args.batch,
                                     args.max_windows);
  print(global.json, {{"loss", r.loss}, {"windows", r.windows}, {"tokens", r.tokens}},
        fmt::format("loss {:.6f} nats over {} windows ({} tokens)\n", r.loss, r.windows, r.tokens));
  return kExitOk;
}

void add_eval(CLI::App& app, CommandTable& commands) {
  auto* command = app.add_subcommand("eval", "mean loss of a checkpoint on a dataset");
  auto& args = commands.add(command, eval);
  command
      ->add_option("--checkpoint", args.checkpoint_dir,
                   "checkpoint directory (config.json + model.safetensors)")
      ->required();
  command->add_option("--data", args.data, "dataset prefix (PREFIX.bin/.idx)")->required();
  command->add_option("--seqlen", args.seqlen, "window length")->capture_default_str();
  command->add_option("--batch", args.batch, "windows per forward")->capture_default_str();
  command->add_option("--max-windows", args.max_windows, "0 = all")->capture_default_str();
}

}  // namespace

void add_train_commands(CLI::App& app, CommandTable& commands) {
  add_train(app, commands);
  add_eval(app, commands);
}

}  // namespace megacpp::cli
