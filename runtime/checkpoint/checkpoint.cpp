#include "runtime/checkpoint/checkpoint.h"

#include <fmt/format.h>

#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <limits>
#include <utility>

#include "base/atomic_file.h"
#include "base/error.h"
#include "base/json_file.h"
#include "base/version.h"
#include "runtime/checkpoint/safetensors.h"

namespace megacpp {

namespace fs = std::filesystem;

namespace {

constexpr const char* kEmbedding = "backbone.embedding.weight";
constexpr const char* kLmHead = "lm_head.weight";
// The official model's RMSNorm epsilon: MambaConfig has no field for it.
constexpr double kOfficialNormEpsilon = 1e-5;

}  // namespace

// config.json holds MambaConfig's keys, so that MambaConfig(**json) accepts it (the spec's
// checkpoint contract); norm_epsilon stays only when it differs from the official model's fixed
// value, where the official loader then refuses the checkpoint instead of computing another model.
// A tied model's lm_head.weight is written as a copy of the embedding, as the official model's
// state_dict() has it, so that load_state_dict(strict=True) takes the file.
void save_model_checkpoint(const fs::path& dir, const Model<float>& model) {
  fs::create_directories(dir);
  nlohmann::json config = model_config_to_json(model.config());
  if (model.config().norm_epsilon == kOfficialNormEpsilon) config.erase("norm_epsilon");
  save_json_atomically(dir / "config.json", config);
  const auto& params = model.parameters();
  std::vector<TensorRef> tensors;
  for (size_t i = 0; i < params.entries().size(); ++i) {
    const auto& info = params.entries()[i];
    tensors.push_back({info.name, info.shape, params.value(static_cast<int>(i))});
  }
  if (model.config().tie_embeddings) {
    const int embedding = params.find(kEmbedding);
    tensors.push_back({kLmHead, params.info(embedding).shape, params.value(embedding)});
  }
  save_safetensors(dir / "model.safetensors", tensors,
                   {{"format", "pt"}, {"writer", version_string()}});
}

ModelConfig load_checkpoint_config(const fs::path& dir) {
  return load_model_config(dir / "config.json");
}

void load_model_weights(const fs::path& dir, Model<float>& model) {
  const fs::path file = dir / "model.safetensors";
  auto tensors = load_safetensors(file);
  auto& params = model.parameters();
  // A tied model's lm_head.weight is the embedding's copy (checkpoints before it was written
  // have none): it must be exactly that copy, or the file holds two different models.
  if (model.config().tie_embeddings) {
    if (auto it = tensors.find(kLmHead); it != tensors.end()) {
      const auto embedding = tensors.find(kEmbedding);
      const bool same = embedding != tensors.end() && embedding->second.shape == it->second.shape &&
                        std::memcmp(embedding->second.data.data(), it->second.data.data(),
                                    sizeof(float) * it->second.data.size()) == 0;
      if (!same) {
        fail(ErrorKind::kInvalidArgument,
             "{}: the model ties its embeddings, but lm_head.weight is not an exact copy of {}",
             file.string(), kEmbedding);
      }
      tensors.erase(it);
    }
  }
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  for (const auto& info : params.entries()) expected.emplace_back(info.name, info.shape);
  check_tensor_set(tensors, expected, file.string());
  for (size_t i = 0; i < params.entries().size(); ++i) {
    const auto& info = params.entries()[i];
    const auto& data = tensors.at(info.name).data;
    std::memcpy(params.value(static_cast<int>(i)), data.data(), sizeof(float) * data.size());
  }
}

void save_optimizer_state(const fs::path& file, const ParameterSet<float>& params,
                          AdamW<float>& optimizer) {
  std::vector<TensorRef> tensors;
  for (const auto& info : params.entries()) {
    tensors.push_back(
        {"exp_avg." + info.name, info.shape, optimizer.exp_avg().data() + info.offset});
    tensors.push_back(
        {"exp_avg_sq." + info.name, info.shape, optimizer.exp_avg_sq().data() + info.offset});
  }
  save_safetensors(file, tensors, {{"steps_taken", std::to_string(optimizer.steps_taken())}});
}

void load_optimizer_state(const fs::path& file, const ParameterSet<float>& params,
                          AdamW<float>& optimizer) {
  std::map<std::string, std::string> metadata;
  auto tensors = load_safetensors(file, &metadata);
  std::vector<std::pair<std::string, std::vector<int64_t>>> expected;
  for (const auto& info : params.entries()) {
    expected.emplace_back("exp_avg." + info.name, info.shape);
    expected.emplace_back("exp_avg_sq." + info.name, info.shape);
  }
  check_tensor_set(tensors, expected, file.string());
  for (const auto& info : params.entries()) {
    const auto& m = tensors.at("exp_avg." + info.name).data;
    const auto& v = tensors.at("exp_avg_sq." + info.name).data;
    std::memcpy(optimizer.exp_avg().data() + info.offset, m.data(), sizeof(float) * m.size());
    std::memcpy(optimizer.exp_avg_sq().data() + info.offset, v.data(), sizeof(float) * v.size());
  }
  auto it = metadata.find("steps_taken");
  if (it == metadata.end()) {
    fail(ErrorKind::kCorruptData, "{}: metadata lacks steps_taken", file.string());
  }
  // The whole string, a non-negative count: stoll alone took "12abc" as 12 and "-1" (whose next
  // step zeroed Adam's bias correction, and the weights went to inf).
  int64_t steps_taken = -1;
  const std::string& text = it->second;
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), steps_taken);
  if (error != std::errc() || end != text.data() + text.size() || steps_taken < 0) {
    fail(ErrorKind::kCorruptData, "{}: metadata steps_taken=\"{}\" is not a non-negative integer",
         file.string(), text);
  }
  optimizer.set_steps_taken(steps_taken);
}

fs::path step_checkpoint_dir(const fs::path& run_dir, int64_t step) {
  return run_dir / fmt::format("step-{:08d}", step);
}

void mark_latest_checkpoint(const fs::path& run_dir, int64_t step) {
  write_file_atomically(run_dir / "latest",
                        step_checkpoint_dir(run_dir, step).filename().string() + "\n");
}

namespace {

constexpr const char* kStagingPrefix = ".staging-";
constexpr const char* kReplacedPrefix = ".replaced-";

}  // namespace

fs::path staging_checkpoint_dir(const fs::path& run_dir, int64_t step) {
  return run_dir / (kStagingPrefix + step_checkpoint_dir(run_dir, step).filename().string());
}

void install_checkpoint(const fs::path& run_dir, const fs::path& staging, int64_t step) {
  const fs::path dir = step_checkpoint_dir(run_dir, step);
  const fs::path aside = run_dir / (kReplacedPrefix + dir.filename().string());
  std::error_code ec;
  fs::remove_all(aside, ec);  // a replacement that finished but for this deletion
  const bool replacing = fs::exists(dir, ec);
  if (replacing) rename_durably(dir, aside);
  rename_durably(staging, dir);
  mark_latest_checkpoint(run_dir, step);
  if (replacing) {
    fs::remove_all(aside, ec);
    if (ec) {
      fail(ErrorKind::kIo, "{}: cannot delete the replaced checkpoint {}: {}", run_dir.string(),
           aside.string(), ec.message());
    }
  }
}

std::optional<fs::path> latest_checkpoint(const fs::path& run_dir) {
  const fs::path pointer = run_dir / "latest";
  if (!fs::exists(pointer)) return std::nullopt;
  std::string name = read_file(pointer);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  const fs::path dir = run_dir / name;
  const fs::path aside = run_dir / (kReplacedPrefix + name);
  std::error_code ec;
  if (!name.empty() && name.find('/') == std::string::npos && !fs::exists(dir, ec) &&
      fs::is_directory(aside, ec)) {
    // install_checkpoint stopped between its renames: `latest` still names the replaced one.
    rename_durably(aside, dir);
  }
  if (name.empty() || name.find('/') != std::string::npos || !fs::is_directory(dir)) {
    fail(ErrorKind::kCorruptData, "{}: names \"{}\", which is not a checkpoint directory of {}",
         pointer.string(), name, run_dir.string());
  }
  return dir;
}

uint64_t training_checkpoint_bytes(const ParameterSet<float>& params) {
  // Per tensor and file, a safetensors header entry is the name (with "exp_avg_sq." at
  // most) plus dtype, shape and offsets: 160 bytes beyond the name covers any shape.
  uint64_t headers = 0;
  for (const auto& info : params.entries()) headers += 3 * (info.name.size() + 11 + 160);
  // A tied lm_head's copy of the embedding is at most the largest tensor again.
  int64_t largest = 0;
  for (const auto& info : params.entries()) largest = std::max(largest, info.size);
  constexpr uint64_t kJsonFiles = 64 << 10;  // config.json, trainer_state.json, latest
  return 3 * sizeof(float) * static_cast<uint64_t>(params.total()) +
         sizeof(float) * static_cast<uint64_t>(largest) + headers + kJsonFiles;
}

void require_free_space_for_checkpoint(const fs::path& run_dir, uint64_t bytes,
                                       uint64_t min_free_bytes) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) {
    fail(ErrorKind::kIo, "{}: cannot create the checkpoint directory: {}", run_dir.string(),
         ec.message());
  }
  struct statvfs stats {};
  if (::statvfs(run_dir.c_str(), &stats) != 0) {
    fail(ErrorKind::kIo, "{}: cannot read the file system's free space: {}", run_dir.string(),
         std::strerror(errno));
  }
  // f_bavail: what an unprivileged writer may use, as the daemon's startup check counts.
  const uint64_t free_bytes =
      static_cast<uint64_t>(stats.f_bavail) * static_cast<uint64_t>(stats.f_frsize);
  if (free_bytes < bytes || free_bytes - bytes < min_free_bytes) {
    fail(ErrorKind::kFailedPrecondition,
         "{}: a checkpoint of about {} bytes would cross the free-space floor: the file system "
         "has {} bytes free and must keep min_free_bytes={}; free space or lower the floor",
         run_dir.string(), bytes, free_bytes, min_free_bytes);
  }
}

namespace {

// The step of a "step-NNNNNNNN" name, or -1 for any other name.
int64_t checkpoint_step(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step-") != 0) return -1;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || step > (std::numeric_limits<int64_t>::max() - 9) / 10)
      return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

constexpr const char* kPruningPrefix = ".pruning-";

}  // namespace

std::vector<fs::path> prune_checkpoints(const fs::path& run_dir, int keep_last,
                                        int64_t final_step) {
  std::vector<fs::path> removed;
  std::error_code ec;
  std::vector<std::pair<int64_t, fs::path>> steps;
  for (const auto& entry : fs::directory_iterator(run_dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool superseded =
        name.rfind(kReplacedPrefix, 0) == 0 &&
        fs::is_directory(run_dir / name.substr(std::string(kReplacedPrefix).size()), ec);
    if (name.rfind(kPruningPrefix, 0) == 0 || name.rfind(kStagingPrefix, 0) == 0 || superseded) {
      // Left by a run that died while deleting, while writing a checkpoint it never installed,
      // or after installing one over an older before deleting that: finish the job.
      fs::remove_all(entry.path(), ec);
      continue;
    }
    const int64_t step = checkpoint_step(name);
    if (step >= 0 && entry.is_directory(ec)) steps.emplace_back(step, entry.path());
  }
  if (keep_last <= 0 || steps.size() <= static_cast<size_t>(keep_last)) return removed;
  std::sort(steps.begin(), steps.end());
  const auto latest = latest_checkpoint(run_dir);
  const size_t old = steps.size() - static_cast<size_t>(keep_last);
  for (size_t i = 0; i < old; ++i) {
    const auto& [step, dir] = steps[i];
    if (step == final_step || (latest && latest->filename() == dir.filename())) continue;
    const fs::path doomed = run_dir / (kPruningPrefix + dir.filename().string());
    fs::rename(dir, doomed, ec);
    if (ec) {
      fail(ErrorKind::kIo, "{}: cannot retire old checkpoint {}: {}", run_dir.string(),
           dir.filename().string(), ec.message());
    }
    fs::remove_all(doomed, ec);
    if (ec) {
      fail(ErrorKind::kIo, "{}: cannot delete old checkpoint {}: {}", run_dir.string(),
           doomed.string(), ec.message());
    }
    removed.push_back(dir);
  }
  return removed;
}

}  // namespace megacpp
