// `megacpp --json ...` against a real daemon with every log at debug: stdout carries the command's
// JSON document and nothing else, so that scripts can parse it; log lines, progress and errors go
// to stderr. The in-process commands (data prepare, train, eval) log through the same logger.
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cctype>
#include <cstdlib>
#include <string>
#include <vector>

#include "tests/daemon/daemon_harness.h"

namespace megacpp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::CliRun;
using testing::Daemon;

// `megacpp --json ARGS`.
CliRun megacpp_json(const fs::path& dir, std::vector<std::string> args) {
  args.insert(args.begin(), "--json");
  return testing::run_cli(dir, args);
}

std::string describe(const std::vector<std::string>& args, const CliRun& r) {
  std::string text = "megacpp --json";
  for (const auto& a : args) text += " " + a;
  return text + " (exit " + std::to_string(r.code) + ")\nstdout:\n" + r.out + "\nstderr:\n" + r.err;
}

// Runs the command, expects exit 0 and the whole of stdout to be one JSON value (a log line
// before or after it fails the parse); the value, or a discarded one.
json run_json(const fs::path& dir, const std::vector<std::string>& args) {
  const CliRun r = megacpp_json(dir, args);
  EXPECT_EQ(r.code, 0) << describe(args, r);
  json value = json::parse(r.out, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(value.is_discarded()) << "stdout is not one JSON document: " << describe(args, r);
  return value;
}

TEST(CliJsonOutput, StdoutIsOnlyJsonWithDebugLoggingOn) {
  // Inherited by the daemon, its executors and every CLI run below.
  ASSERT_EQ(::setenv("SPDLOG_LEVEL", "debug", 1), 0);
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  ASSERT_EQ(::setenv("MEGACPP_DAEMON", d.grpc_address().c_str(), 1), 0);
  const testing::TempDir work;

  std::string spec_text;
  google::protobuf::util::JsonPrintOptions print_options;
  print_options.preserve_proto_field_names = true;
  ASSERT_TRUE(
      google::protobuf::util::MessageToJsonString(d.small_job(3), &spec_text, print_options).ok());
  const fs::path spec = work / "job.json";
  testing::write_text(spec, spec_text);

  // With --watch, stdout is the watch's final document alone (not the job id first).
  const json watched = run_json(work.path(), {"submit", "--watch", spec.string()});
  ASSERT_TRUE(watched.is_object()) << watched;
  const std::string first = watched["job"].value("id", "");
  ASSERT_FALSE(first.empty()) << watched;
  EXPECT_EQ(watched["job"].value("state", ""), "JOB_STATE_SUCCEEDED") << watched;
  EXPECT_TRUE(watched["summary"].is_object()) << watched;

  const json submitted = run_json(work.path(), {"submit", spec.string()});
  const std::string second = submitted.is_object() ? submitted.value("id", "") : "";
  ASSERT_FALSE(second.empty()) << submitted;
  EXPECT_EQ(run_json(work.path(), {"watch", second})["job"].value("state", ""),
            "JOB_STATE_SUCCEEDED");

  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"jobs"},
                                             {"job", first},
                                             {"status"},
                                             {"receipts", "boots"},
                                             {"receipts", "checks"},
                                             {"receipts", "gates", first},
                                             {"receipts", "steps", first},
                                             {"receipts", "runs", first},
                                             {"compare", first, second}}) {
    run_json(work.path(), args);
  }

  // A refused call: nothing on stdout, the reason on stderr.
  const std::vector<std::string> missing = {"job", "no-such-job"};
  const CliRun not_found = megacpp_json(work.path(), missing);
  EXPECT_EQ(not_found.code, 4) << describe(missing, not_found);
  EXPECT_EQ(not_found.out, "") << describe(missing, not_found);
  EXPECT_NE(not_found.err, "") << describe(missing, not_found);

  // In process: the second prepare into its own input folder logs, at debug, each output of the
  // first that it leaves out; train logs every step. Those lines must reach stderr, not stdout.
  for (int i = 0; i < 3; ++i) {
    testing::write_text(work / ("corpus/f" + std::to_string(i) + ".txt"),
                        testing::pseudo_text(static_cast<uint64_t>(i), 400));
  }
  const std::vector<std::string> prepare = {"data",
                                            "prepare",
                                            "--input",
                                            (work / "corpus").string(),
                                            "--output",
                                            (work / "corpus/toy").string(),
                                            "--valid-fraction",
                                            "0.34"};
  run_json(work.path(), prepare);
  const CliRun again = megacpp_json(work.path(), prepare);
  EXPECT_NE(again.err.find("not reading output file"), std::string::npos)
      << "the debug log is not on stderr: " << describe(prepare, again);
  EXPECT_FALSE(json::parse(again.out, nullptr, false).is_discarded()) << describe(prepare, again);

  const json train_job = {{"model", {{"config", json::parse(d.small_job(1).config_json())}}},
                          {"data",
                           {{"train", (work / "corpus/toy_train").string()},
                            {"valid", (work / "corpus/toy_valid").string()}}},
                          {"steps", 3},
                          {"batch", 2},
                          {"seqlen", 32},
                          {"threads", 1},
                          {"eval", {{"interval", 0}, {"batches", 1}}},
                          {"checkpoint", {{"dir", (work / "run").string()}}}};
  testing::write_text(work / "train.json", train_job.dump(2));
  const std::vector<std::string> train = {"train", (work / "train.json").string()};
  const CliRun trained = megacpp_json(work.path(), train);
  EXPECT_EQ(trained.code, 0) << describe(train, trained);
  // The per-step progress line (runtime/trainer/observer.cpp): "step     1  loss ...".
  EXPECT_NE(trained.err.find("  loss "), std::string::npos)
      << "no step log on stderr: " << describe(train, trained);
  const json summary = json::parse(trained.out, nullptr, false);
  EXPECT_FALSE(summary.is_discarded()) << describe(train, trained);

  std::string latest = testing::read_bytes(work / "run/latest");
  while (!latest.empty() && std::isspace(static_cast<unsigned char>(latest.back())))
    latest.pop_back();
  const json evaluated =
      run_json(work.path(), {"eval", "--checkpoint", (work / "run" / latest).string(), "--data",
                             (work / "corpus/toy_valid").string(), "--seqlen", "32", "--batch", "2",
                             "--max-windows", "2"});
  EXPECT_TRUE(evaluated.is_object() && evaluated.contains("loss")) << evaluated;

  // An error raised in process is logged (spdlog) on stderr; stdout stays empty.
  const std::vector<std::string> bad_eval = {"eval", "--checkpoint",
                                             (work / "no-such-checkpoint").string(), "--data",
                                             (work / "corpus/toy_valid").string()};
  const CliRun failed = megacpp_json(work.path(), bad_eval);
  EXPECT_NE(failed.code, 0) << describe(bad_eval, failed);
  EXPECT_EQ(failed.out, "") << describe(bad_eval, failed);
  EXPECT_NE(failed.err.find("no-such-checkpoint"), std::string::npos) << describe(bad_eval, failed);

  EXPECT_EQ(d.stop(SIGTERM), 0) << d.log();
}

}  // namespace
}  // namespace megacpp
