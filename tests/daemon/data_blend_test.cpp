// Data blends and SentencePiece datasets through the whole service: `megacpp data prepare`
// (bytes and --tokenizer), `megacpp submit --watch` of a spec naming a blend with relative
// prefixes, the daemon's validation by field, and executors training a few steps on it.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "tests/daemon/daemon_harness.h"
#include "tests/support/sentencepiece.h"

namespace megacpp {
namespace {

namespace v1 = megacpp::v1;
using nlohmann::json;
using testing::CliRun;
using testing::Daemon;
using testing::get_job;
using testing::submit;

// Follows a job with WatchJob to its end; returns its final state.
v1::JobState watch(const Daemon& d, const std::string& id) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
  v1::WatchJobRequest request;
  request.set_id(id);
  auto reader = d.jobs()->WatchJob(&context, request);
  v1::JobEvent event;
  v1::JobState last = v1::JOB_STATE_UNSPECIFIED;
  while (reader->Read(&event)) last = event.job().state();
  EXPECT_TRUE(reader->Finish().ok());
  return last;
}

int64_t step_receipts(const Daemon& d, const std::string& id) {
  grpc::ClientContext context;
  v1::ListStepReceiptsRequest request;
  request.set_job_id(id);
  v1::ListStepReceiptsResponse response;
  EXPECT_TRUE(d.receipts()->ListStepReceipts(&context, request, &response).ok());
  return response.steps_size();
}

// The harness's small model with another vocabulary size.
std::string model_json(int vocab_size) {
  json model = {
      {"d_model", 32},
      {"pattern", "M*"},
      {"d_intermediate", 32},
      {"vocab_size", vocab_size},
      {"ssm_cfg", {{"d_state", 16}, {"headdim", 16}, {"mimo_rank", 2}, {"chunk_size", 8}}},
      {"attn_cfg", {{"num_heads", 2}, {"rotary_emb_dim", 8}}}};
  return model.dump();
}

void expect_refused(const Daemon& d, const v1::JobSpec& spec, const std::string& message) {
  const grpc::Status s = submit(d, spec);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << message;
  EXPECT_NE(s.error_message().find(message), std::string::npos)
      << "wanted: " << message << "\ngot: " << s.error_message();
}

void write_corpus(const std::filesystem::path& dir, uint64_t seed) {
  for (int i = 0; i < 6; ++i) {
    testing::write_text(dir / fmt::format("f{}.txt", i),
                        testing::word_text(seed + static_cast<uint64_t>(i), 60));
  }
}

TEST(DaemonDataBlend, TheCliSubmitsABlendThatTrainsAndBadBlendsAreRefusedByField) {
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  // A second dataset, made by the CLI.
  write_corpus(d.dir() / "prose", 300);
  const CliRun prepared = testing::run_cli(
      d.dir().path(), {"data", "prepare", "--input", (d.dir() / "prose").string(), "--output",
                       (d.dir() / "data/prose").string(), "--valid-fraction", "0.2"});
  ASSERT_EQ(prepared.code, 0) << prepared.err;
  EXPECT_NE(prepared.out.find("tokenizer byte (257 tokens)"), std::string::npos) << prepared.out;

  // Relative prefixes, read against the spec's folder by the CLI.
  const json spec = {{"name", "blend"},
                     {"config_json", model_json(257)},
                     {"train_blend",
                      {{{"prefix", "../data/toy_train"}, {"weight", 3}},
                       {{"prefix", "../data/prose_train"}, {"weight", 1}}}},
                     {"valid_data", "../data/prose_valid"},
                     {"steps", "6"},
                     {"batch", 2},
                     {"seqlen", 32},
                     {"checkpoint_interval", 3},
                     {"threads", 1}};
  testing::write_text(d.dir() / "specs/blend.json", spec.dump(2));
  const CliRun submitted = testing::run_cli(
      d.dir().path(), {"submit", (d.dir() / "specs/blend.json").string(), "--watch", "--daemon",
                       d.grpc_address(), "--timeout", "120"});
  ASSERT_EQ(submitted.code, 0) << submitted.out << submitted.err << d.log();
  const std::string id = submitted.out.substr(0, submitted.out.find('\n'));
  const v1::Job job = get_job(d, id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.error();
  ASSERT_EQ(job.spec().train_blend_size(), 2);
  EXPECT_EQ(job.spec().train_blend(1).prefix(), (d.dir() / "data/prose_train").string());
  EXPECT_EQ(step_receipts(d, id), 6);

  // Every bad blend is refused by its field, and nothing is queued.
  v1::JobSpec good = d.small_job(3);
  good.clear_train_data();
  auto* a = good.add_train_blend();
  a->set_prefix(d.data("train"));
  a->set_weight(3);
  auto* b = good.add_train_blend();
  b->set_prefix((d.dir() / "data/prose_train").string());
  b->set_weight(1);
  struct Case {
    std::function<void(v1::JobSpec&)> breaks;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](v1::JobSpec& s) { s.mutable_train_blend(1)->set_weight(-1); },
       "spec.train_blend[1].weight=-1 must be positive and finite"},
      {[](v1::JobSpec& s) { s.mutable_train_blend(0)->set_weight(0); },
       "spec.train_blend[0].weight=0 must be positive and finite"},
      {[](v1::JobSpec& s) {
         s.mutable_train_blend(1)->set_weight(std::numeric_limits<double>::quiet_NaN());
       },
       "spec.train_blend[1].weight=nan must be positive and finite"},
      {[](v1::JobSpec& s) {
         s.mutable_train_blend(1)->set_weight(std::numeric_limits<double>::infinity());
       },
       "spec.train_blend[1].weight=inf must be positive and finite"},
      {[&](v1::JobSpec& s) {
         s.mutable_train_blend(1)->set_prefix((d.dir() / "data/absent").string());
       },
       "spec.train_blend[1].prefix=\""},
      {[](v1::JobSpec& s) { s.mutable_train_blend(0)->set_prefix("data/toy_train"); },
       "spec.train_blend[0].prefix=\"data/toy_train.idx\""},
      {[](v1::JobSpec& s) { s.mutable_train_blend(0)->clear_prefix(); },
       "spec.train_blend[0].prefix is required"},
      {[&](v1::JobSpec& s) { s.set_train_data(d.data("train")); },
       "spec.train_data and train_blend are exclusive"},
  };
  for (const auto& c : cases) {
    v1::JobSpec broken = good;
    c.breaks(broken);
    expect_refused(d, broken, c.message);
  }
  grpc::ClientContext context;
  v1::ListJobsResponse jobs;
  ASSERT_TRUE(d.jobs()->ListJobs(&context, v1::ListJobsRequest(), &jobs).ok());
  EXPECT_EQ(jobs.jobs_size(), 1);
}

TEST(DaemonDataBlend, SentencePieceDatasetsTrainWhenTheModelHasRoomForTheirVocabulary) {
  if (testing::find_program("spm_train").empty()) GTEST_SKIP() << testing::kNoSpmTrain;
  Daemon d;
  ASSERT_EQ(d.start(), -1) << d.log();
  const auto model = testing::train_sentencepiece(d.dir().path(), "spm", 320);
  ASSERT_FALSE(model.empty());
  for (const std::string name : {"web", "books"}) {
    write_corpus(d.dir() / name, name == "web" ? 500 : 600);
    const CliRun prepared = testing::run_cli(
        d.dir().path(), {"--json", "data", "prepare", "--input", (d.dir() / name).string(),
                         "--output", (d.dir() / "data" / name).string(), "--tokenizer",
                         model.string(), "--valid-fraction", "0.2"});
    ASSERT_EQ(prepared.code, 0) << prepared.err;
    const json report = json::parse(prepared.out);
    EXPECT_EQ(report["tokenizer"]["type"], "sentencepiece");
    EXPECT_EQ(report["tokenizer"]["vocab_size"], 320);
  }
  const auto prefix = [&](const std::string& name) {
    return (d.dir() / "data" / name).string();
  };
  v1::JobSpec spec = d.small_job(4);
  spec.set_config_json(model_json(320));
  spec.clear_train_data();
  spec.set_valid_data(prefix("web_valid"));
  for (const auto& [name, weight] : {std::pair{"web_train", 2.0}, std::pair{"books_train", 1.0}}) {
    auto* entry = spec.add_train_blend();
    entry->set_prefix(prefix(name));
    entry->set_weight(weight);
  }

  // The model's vocabulary must hold the tokenizer's: 257 < 320 is refused, naming the file.
  v1::JobSpec small = spec;
  small.set_config_json(model_json(257));
  expect_refused(d, small,
                 fmt::format("spec.train_blend[0].prefix: {}.tokenizer.json records the tokenizer "
                             "sentencepiece {} (320 tokens), more ids than the model's "
                             "vocab_size=257 (spec.config_json)",
                             prefix("web_train"), model.string()));
  // A byte dataset does not blend with SentencePiece ones.
  v1::JobSpec mixed = spec;
  mixed.mutable_train_blend(1)->set_prefix(d.data("train"));
  expect_refused(d, mixed,
                 fmt::format("spec.train_blend[1].prefix: {} was made by the tokenizer byte (257 "
                             "tokens)",
                             d.data("train")));

  v1::Job job;
  const grpc::Status s = submit(d, spec, &job);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(watch(d, job.id()), v1::JOB_STATE_SUCCEEDED) << get_job(d, job.id()).error();
  EXPECT_EQ(step_receipts(d, job.id()), 4);
}

}  // namespace
}  // namespace megacpp
