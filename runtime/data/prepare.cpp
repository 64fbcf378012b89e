#include "runtime/data/prepare.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <system_error>
#include <utility>

#include "base/atomic_file.h"
#include "base/error.h"
#include "runtime/data/byte_tokenizer.h"
#include "runtime/data/indexed_dataset.h"
#include "runtime/data/sentencepiece_tokenizer.h"

namespace megacpp::data {
namespace {

constexpr std::size_t kReadChunkBytes = std::size_t{1} << 20;
// A document is one int32-length sequence holding the file's bytes plus the EOD token.
constexpr std::uint64_t kMaxFileBytes =
    static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()) - 1;

struct InputFile {
  std::filesystem::path path;
  std::string sort_key;
  std::uint64_t size = 0;
};

using FileIdentity = std::pair<dev_t, ino_t>;

struct Walk {
  std::vector<std::string> suffixes;
  std::set<FileIdentity> outputs;  // existing outputs of an earlier run, never inputs
  std::vector<InputFile> files;
  PrepareReport& report;

  void skip(const std::filesystem::path& path, std::string_view reason, std::uint64_t bytes) {
    spdlog::warn("prepare: skipping {}: {}", path.string(), reason);
    ++report.files_skipped;
    report.bytes_skipped += bytes;
  }

  bool wanted(const std::filesystem::path& path) const {
    if (suffixes.empty()) return true;
    const std::string name = path.filename().string();
    return std::any_of(suffixes.begin(), suffixes.end(),
                       [&](const std::string& suffix) { return name.ends_with(suffix); });
  }

  // Opens the file once so that an unreadable one is reported now, before the split
  // is fixed, rather than halfway through writing.
  void consider_file(const std::filesystem::path& path, std::string sort_key) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      skip(path, std::strerror(errno), 0);
      return;
    }
    struct stat info {};
    const int stat_result = ::fstat(fd, &info);
    const int error_number = errno;
    ::close(fd);
    if (stat_result != 0) {
      skip(path, std::strerror(error_number), 0);
      return;
    }
    if (!S_ISREG(info.st_mode)) return;
    const auto size = static_cast<std::uint64_t>(info.st_size);
    if (outputs.contains({info.st_dev, info.st_ino})) {
      spdlog::debug("prepare: not reading output file {}", path.string());
      return;
    }
    if (size > kMaxFileBytes) {
      skip(path, fmt::format("{} bytes is over the {}-byte document limit", size, kMaxFileBytes),
           size);
      return;
    }
    files.push_back({path, std::move(sort_key), size});
  }

  void walk_directory(const std::filesystem::path& root) {
    std::vector<std::filesystem::path> pending = {root};
    while (!pending.empty()) {
      const std::filesystem::path directory = std::move(pending.back());
      pending.pop_back();
      std::error_code error;
      std::filesystem::directory_iterator it(directory, error);
      if (error) {
        skip(directory, error.message(), 0);
        continue;
      }
      for (; it != std::filesystem::directory_iterator(); it.increment(error)) {
        if (error) break;
        const std::filesystem::directory_entry& entry = *it;
        const std::filesystem::path& path = entry.path();
        std::error_code entry_error;
        const std::filesystem::file_status own = entry.symlink_status(entry_error);
        if (entry_error) {
          skip(path, entry_error.message(), 0);
          continue;
        }
        std::filesystem::file_status target = own;
        if (std::filesystem::is_symlink(own)) {
          target = std::filesystem::status(path, entry_error);
          if (target.type() == std::filesystem::file_type::not_found) {
            skip(path, "dangling symlink", 0);
            continue;
          }
          if (entry_error) {
            skip(path, "unresolvable symlink (a loop?): " + entry_error.message(), 0);
            continue;
          }
          if (std::filesystem::is_directory(target)) {
            // Not followed: it could lead back into the tree and read files twice.
            skip(path, "symlink to a directory (not followed)", 0);
            continue;
          }
        } else if (std::filesystem::is_directory(own)) {
          pending.push_back(path);
          continue;
        }
        if (!std::filesystem::is_regular_file(target) || !wanted(path)) continue;
        consider_file(path, path.lexically_relative(root).generic_string());
      }
      if (error) skip(directory, "listing failed: " + error.message(), 0);
    }
  }
};

// Uniform in [0, bound) by rejection, so the result does not depend on a standard
// library's distribution implementation.
std::uint64_t uniform_below(std::mt19937_64& generator, std::uint64_t bound) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  const std::uint64_t accept_below = kMax - kMax % bound;
  std::uint64_t value = 0;
  do {
    value = generator();
  } while (value >= accept_below);
  return value % bound;
}

void fisher_yates(std::vector<InputFile>& files, std::uint64_t seed) {
  std::mt19937_64 generator(seed);
  for (std::size_t i = files.size(); i > 1; --i) {
    const auto j = static_cast<std::size_t>(uniform_below(generator, i));
    std::swap(files[i - 1], files[j]);
  }
}

std::uint64_t validation_documents(double valid_fraction, std::uint64_t documents) {
  if (documents < 2) return 0;
  const double scaled = valid_fraction * static_cast<double>(documents);
  // Without the slack, 0.1 * 30 = 3.0000000000000004 would round up to 4.
  const auto ceiling = static_cast<std::uint64_t>(std::ceil(scaled - 1e-9 * std::max(1.0, scaled)));
  return std::clamp<std::uint64_t>(ceiling, 1, documents - 1);
}

void append_bytes(const InputFile& file, IndexedDatasetBuilder& builder,
                  std::vector<unsigned char>& bytes, std::vector<std::int32_t>& tokens,
                  PrepareReport& report) {
  const int fd = ::open(file.path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    fail(ErrorKind::kIo, "{}: cannot open for reading: {}", file.path.string(),
         std::strerror(errno));
  }
  bytes.resize(kReadChunkBytes);
  tokens.resize(kReadChunkBytes);
  for (;;) {
    const ssize_t got = ::read(fd, bytes.data(), bytes.size());
    if (got < 0) {
      if (errno == EINTR) continue;
      const int error_number = errno;
      ::close(fd);
      fail(ErrorKind::kIo, "{}: read failed: {}", file.path.string(), std::strerror(error_number));
    }
    if (got == 0) break;
    const auto count = static_cast<std::size_t>(got);
    for (std::size_t i = 0; i < count; ++i) tokens[i] = static_cast<std::int32_t>(bytes[i]);
    try {
      builder.add_tokens(std::span<const std::int32_t>(tokens.data(), count));
    } catch (...) {
      ::close(fd);
      throw;
    }
    report.bytes_read += count;
  }
  ::close(fd);
}

void append_file(const InputFile& file, const SentencePieceTokenizer* pieces,
                 IndexedDatasetBuilder& builder, std::vector<unsigned char>& bytes,
                 std::vector<std::int32_t>& tokens, PrepareReport& report) {
  if (pieces == nullptr) {
    append_bytes(file, builder, bytes, tokens, report);
  } else {
    // SentencePiece encodes a whole text (its normalizer and pieces can span any chunk
    // boundary); a file is at most kMaxFileBytes.
    const std::string text = read_file(file.path);
    builder.add_tokens(pieces->encode(text));
    report.bytes_read += text.size();
  }
  const auto end_of_document = static_cast<std::int32_t>(report.tokenizer.end_of_document);
  builder.add_tokens(std::span<const std::int32_t>(&end_of_document, 1));
  builder.end_document();
}

}  // namespace

PrepareReport prepare_dataset(const PrepareOptions& options) {
  if (!std::isfinite(options.valid_fraction) || options.valid_fraction < 0.0 ||
      options.valid_fraction >= 1.0) {
    fail(ErrorKind::kInvalidArgument, "prepare: valid_fraction must be in [0, 1), got {}",
         options.valid_fraction);
  }
  if (options.output_prefix.empty() || !options.output_prefix.has_filename()) {
    fail(ErrorKind::kInvalidArgument,
         "prepare: output_prefix '{}' must name a file prefix such as out/data",
         options.output_prefix.string());
  }
  PrepareReport report;
  // Loaded before anything is read or written: a bad model is reported at once.
  std::unique_ptr<SentencePieceTokenizer> pieces;
  if (options.tokenizer_model.empty()) {
    report.tokenizer = byte_dataset_tokenizer();
  } else {
    pieces = std::make_unique<SentencePieceTokenizer>(options.tokenizer_model);
    report.tokenizer = {"sentencepiece", std::filesystem::absolute(options.tokenizer_model),
                        pieces->fingerprint(), pieces->vocab_size(), pieces->end_of_document()};
  }
  const std::string prefix = options.output_prefix.string();
  const std::filesystem::path train_prefix = prefix + "_train";
  const std::filesystem::path valid_prefix = prefix + "_valid";
  report.train.bin_path = data_file_path(train_prefix);
  report.train.idx_path = index_file_path(train_prefix);
  report.valid.bin_path = data_file_path(valid_prefix);
  report.valid.idx_path = index_file_path(valid_prefix);

  Walk walk{{}, {}, {}, report};
  for (const std::string& extension : options.extensions) {
    if (extension.empty()) {
      fail(ErrorKind::kInvalidArgument, "prepare: extensions must not contain an empty string");
    }
    walk.suffixes.push_back(extension.front() == '.' ? extension : "." + extension);
  }
  for (const auto& output :
       {report.train.bin_path, report.train.idx_path, report.valid.bin_path, report.valid.idx_path,
        tokenizer_file_path(train_prefix), tokenizer_file_path(valid_prefix)}) {
    struct stat info {};
    if (::stat(output.c_str(), &info) == 0) walk.outputs.insert({info.st_dev, info.st_ino});
  }

  std::error_code error;
  const std::filesystem::file_status input_status = std::filesystem::status(options.input, error);
  if (error && error != std::errc::no_such_file_or_directory) {
    fail(ErrorKind::kIo, "{}: cannot stat input: {}", options.input.string(), error.message());
  }
  if (!std::filesystem::exists(input_status)) {
    fail(ErrorKind::kNotFound, "{}: input path does not exist", options.input.string());
  }
  if (std::filesystem::is_directory(input_status)) {
    walk.walk_directory(options.input);
  } else if (std::filesystem::is_regular_file(input_status)) {
    walk.consider_file(options.input, options.input.filename().generic_string());
  } else {
    fail(ErrorKind::kInvalidArgument, "{}: input is neither a regular file nor a directory",
         options.input.string());
  }

  std::vector<InputFile> files = std::move(walk.files);
  if (files.empty()) {
    std::string filter = "all files";
    if (!walk.suffixes.empty())
      filter = fmt::format("extensions {}", fmt::join(walk.suffixes, " "));
    fail(ErrorKind::kInvalidArgument, "{}: no readable input files ({}; {} skipped)",
         options.input.string(), filter, report.files_skipped);
  }
  std::sort(files.begin(), files.end(),
            [](const InputFile& a, const InputFile& b) { return a.sort_key < b.sort_key; });
  fisher_yates(files, options.seed);

  if (options.max_bytes > 0) {
    std::vector<InputFile> taken;
    std::uint64_t budget_used = 0;
    for (InputFile& file : files) {
      if (file.size <= options.max_bytes - budget_used) {
        budget_used += file.size;
        taken.push_back(std::move(file));
      } else {
        ++report.files_over_limit;
        report.bytes_skipped += file.size;
      }
    }
    if (taken.empty()) {
      fail(ErrorKind::kInvalidArgument, "{}: max_bytes {} is smaller than every input file",
           options.input.string(), options.max_bytes);
    }
    files = std::move(taken);
  }

  const std::uint64_t valid_count = validation_documents(options.valid_fraction, files.size());
  const std::filesystem::path output_directory = options.output_prefix.parent_path();
  if (!output_directory.empty()) {
    std::filesystem::create_directories(output_directory, error);
    if (error) {
      fail(ErrorKind::kIo, "{}: cannot create output directory: {}", output_directory.string(),
           error.message());
    }
  }

  // Megatron's rule (DType.optimal_dtype), so that both tools write the same files.
  const TokenDtype dtype =
      report.tokenizer.vocab_size < 65500 ? TokenDtype::kUint16 : TokenDtype::kInt32;
  IndexedDatasetBuilder valid_builder(valid_prefix, dtype);
  IndexedDatasetBuilder train_builder(train_prefix, dtype);
  std::vector<unsigned char> bytes;
  std::vector<std::int32_t> tokens;
  for (std::size_t i = 0; i < files.size(); ++i) {
    append_file(files[i], pieces.get(), i < valid_count ? valid_builder : train_builder, bytes,
                tokens, report);
  }
  valid_builder.finalize();
  train_builder.finalize();
  write_dataset_tokenizer(valid_prefix, report.tokenizer);
  write_dataset_tokenizer(train_prefix, report.tokenizer);

  report.files_read = files.size();
  report.valid.documents = valid_builder.num_documents();
  report.valid.tokens = valid_builder.num_tokens();
  report.train.documents = train_builder.num_documents();
  report.train.tokens = train_builder.num_tokens();
  return report;
}

}  // namespace megacpp::data
