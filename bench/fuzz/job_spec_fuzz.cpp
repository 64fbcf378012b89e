// libFuzzer target: a job spec file as `megacpp submit` reads it (the JSON form of
// megacpp.v1.JobSpec, protobuf's JsonStringToMessage with the CLI's options), then the daemon's
// whole validation as SubmitJob runs it (validate_job_spec), without a daemon: the DaemonConfig
// is built here, with a real data root holding two small datasets so that specs can get past
// the path checks to the model, geometry and trainer rules behind them.
#include <google/protobuf/stubs/logging.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/fuzz/fuzz_support.h"
#include "daemon/job_spec.h"
#include "megacpp/v1/jobs.pb.h"
#include "runtime/data/indexed_dataset.h"
#include "service/config/daemon_config.h"

using megacpp::ErrorKind;
namespace fs = std::filesystem;
namespace fuzz = megacpp::fuzz;

namespace {

// What SubmitJob sees on a machine with two CPU slots and two GPUs.
constexpr int kCpuSlots = 2;
constexpr int kGpus = 2;

void write_dataset(const fs::path& prefix, int documents) {
  megacpp::data::IndexedDatasetBuilder builder(prefix, megacpp::data::TokenDtype::kUint16);
  std::vector<std::int32_t> tokens;
  for (int d = 0; d < documents; ++d) {
    tokens.assign(static_cast<std::size_t>(16 + d), d);
    builder.add_document(tokens);
  }
  builder.finalize();
}

struct Daemon {
  Daemon() {
    fs::create_directories(data_dir);
    write_dataset(data_dir / "train", 8);
    write_dataset(data_dir / "valid", 2);
    const nlohmann::json text = {{"state_dir", (dir.path() / "state").string()},
                                 {"data_roots", {data_dir.string()}}};
    config = megacpp::parse_daemon_config(text, "fuzz harness", dir.path());
    canonical_data_dir = fs::canonical(data_dir);
  }
  fuzz::ScratchDir dir;
  fs::path data_dir = dir.path() / "data";
  fs::path canonical_data_dir;
  megacpp::DaemonConfig config;
};

}  // namespace

// protobuf logs every string field that is not UTF-8 before refusing it; at a million inputs
// that is noise that hides real reports and costs more than the parse.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const Daemon daemon;
  megacpp::v1::JobSpec spec;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  google::protobuf::util::JsonParseOptions options;
  if (!google::protobuf::util::JsonStringToMessage(text, &spec, options).ok()) return 0;
  // As the CLI does before it submits: relative data paths are read against the spec file's
  // folder, here the data root.
  for (auto* path : {spec.mutable_train_data(), spec.mutable_valid_data()}) {
    if (!path->empty() && fs::path(*path).is_relative()) {
      *path = (daemon.data_dir / *path).lexically_normal().string();
    }
  }
  fuzz::expect_clean(
      [&] {
        const megacpp::daemon::ValidatedJob job = megacpp::daemon::validate_job_spec(
            spec, daemon.config, kCpuSlots, kGpus, daemon.config.checkpoint_root / "job-000001");
        // What the job manager and the executor take on trust once a spec is accepted.
        const int available =
            job.device_kind == megacpp::gates::DeviceKind::kCpu ? kCpuSlots : kGpus;
        if (job.device_count < 1 || job.device_count > available) {
          fuzz::bug("an accepted device_count outside [1, available]");
        }
        for (const char* split : {"train", "valid"}) {
          const auto& paths = job.train_job.at("data");
          if (!paths.contains(split)) continue;
          const fs::path prefix(paths.at(split).get<std::string>());
          const auto [root_end, unused] =
              std::mismatch(daemon.canonical_data_dir.begin(), daemon.canonical_data_dir.end(),
                            prefix.begin(), prefix.end());
          if (root_end != daemon.canonical_data_dir.end()) {
            fuzz::bug("an accepted dataset outside the data root: " + prefix.string());
          }
        }
      },
      {ErrorKind::kInvalidArgument});
  return 0;
}
