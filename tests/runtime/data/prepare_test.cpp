#include "runtime/data/prepare.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"
#include "runtime/data/byte_tokenizer.h"
#include "runtime/data/indexed_dataset.h"

namespace megacpp::data {
namespace {

namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_text(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// The documents of a dataset, EOD included, in stored order.
std::vector<std::vector<std::int32_t>> documents_of(const fs::path& prefix) {
  const IndexedDataset dataset(prefix);
  EXPECT_EQ(dataset.dtype(), TokenDtype::kUint16);
  std::vector<std::vector<std::int32_t>> documents;
  for (std::uint64_t d = 0; d < dataset.num_documents(); ++d) {
    const IndexRange range = dataset.document_tokens(d);
    std::vector<std::int32_t> tokens(range.size());
    dataset.read_stream(range.begin, range.size(), tokens.data());
    documents.push_back(std::move(tokens));
  }
  return documents;
}

class PrepareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::temp_directory_path() /
            ("megacpp_prepare_test_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(root_);
    input_ = root_ / "input";
    output_ = root_ / "out";
    fs::create_directories(input_);
  }
  void TearDown() override {
    fs::permissions(root_, fs::perms::owner_all, fs::perm_options::add);
    fs::remove_all(root_);
  }

  // 20 text files in a small tree, contents all distinct, one empty and some with
  // bytes >= 0x80; returns relative path -> content.
  std::map<std::string, std::string> make_tree() {
    std::map<std::string, std::string> files;
    for (int i = 0; i < 20; ++i) {
      const std::string directory = i % 3 == 0 ? "" : (i % 3 == 1 ? "src/" : "src/deep/");
      const std::string name = directory + "file" + std::to_string(i) + (i % 2 ? ".h" : ".txt");
      std::string content = "document " + std::to_string(i) + "\n";
      content += std::string(static_cast<std::size_t>(i * 5 % 23), static_cast<char>('a' + i));
      if (i % 4 == 1) content += "\xff\x80\x01";
      if (i == 7) content.clear();
      files[name] = content;
      write_text(input_ / name, content);
    }
    return files;
  }

  PrepareOptions options(std::uint64_t seed = 1234) const {
    PrepareOptions result;
    result.input = input_;
    result.output_prefix = output_ / "ds";
    result.seed = seed;
    return result;
  }

  fs::path root_;
  fs::path input_;
  fs::path output_;
};

// The documented order, computed independently: bytewise-sorted relative paths, then
// Fisher-Yates with std::mt19937_64 and rejection sampling.
std::vector<std::string> reference_order(const std::map<std::string, std::string>& files,
                                         std::uint64_t seed) {
  std::vector<std::string> order;
  for (const auto& [path, content] : files) order.push_back(path);
  std::sort(order.begin(), order.end());
  std::mt19937_64 generator(seed);
  for (std::size_t n = order.size(); n > 1; --n) {
    const std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
    std::uint64_t value = 0;
    do {
      value = generator();
    } while (value >= max - max % n);
    std::swap(order[n - 1], order[static_cast<std::size_t>(value % n)]);
  }
  return order;
}

TEST_F(PrepareTest, SplitsEveryFileIntoOneDocumentEndingInEod) {
  const auto files = make_tree();
  PrepareOptions opts = options();
  opts.valid_fraction = 0.1;
  const PrepareReport report = prepare_dataset(opts);

  std::uint64_t total_bytes = 0;
  for (const auto& [path, content] : files) total_bytes += content.size();
  EXPECT_EQ(report.files_read, 20u);
  EXPECT_EQ(report.bytes_read, total_bytes);
  EXPECT_EQ(report.files_skipped, 0u);
  EXPECT_EQ(report.valid.documents, 2u);  // ceil(0.1 * 20), exactly 2 despite rounding
  EXPECT_EQ(report.train.documents, 18u);
  EXPECT_EQ(report.train.tokens + report.valid.tokens, total_bytes + 20);
  EXPECT_EQ(report.train.bin_path, output_ / "ds_train.bin");
  EXPECT_EQ(report.train.idx_path, output_ / "ds_train.idx");
  EXPECT_EQ(report.valid.bin_path, output_ / "ds_valid.bin");
  EXPECT_EQ(report.valid.idx_path, output_ / "ds_valid.idx");

  const auto valid = documents_of(output_ / "ds_valid");
  const auto train = documents_of(output_ / "ds_train");
  ASSERT_EQ(valid.size(), 2u);
  ASSERT_EQ(train.size(), 18u);
  EXPECT_EQ(IndexedDataset(output_ / "ds_train").total_tokens(), report.train.tokens);

  // Stored order = valid split first, then train, in the reference shuffle order.
  std::vector<std::vector<std::int32_t>> stored = valid;
  stored.insert(stored.end(), train.begin(), train.end());
  const std::vector<std::string> order = reference_order(files, 1234);
  for (std::size_t i = 0; i < stored.size(); ++i) {
    const std::vector<std::int32_t>& document = stored[i];
    ASSERT_FALSE(document.empty());
    EXPECT_EQ(document.back(), ByteTokenizer::kEndOfDocument);
    EXPECT_EQ(std::count(document.begin(), document.end(), ByteTokenizer::kEndOfDocument), 1);
    const std::string text = ByteTokenizer::decode(document);
    EXPECT_EQ(text, files.at(order[i])) << "document " << i << " should be " << order[i];
  }
}

TEST_F(PrepareTest, SameSeedIsByteIdenticalAndAnotherSeedIsNot) {
  make_tree();
  PrepareOptions first = options(7);
  first.output_prefix = output_ / "first";
  PrepareOptions second = options(7);
  second.output_prefix = output_ / "second";
  PrepareOptions other = options(8);
  other.output_prefix = output_ / "other";
  prepare_dataset(first);
  prepare_dataset(second);
  prepare_dataset(other);
  for (const std::string split : {"_train", "_valid"}) {
    for (const std::string ext : {".bin", ".idx"}) {
      EXPECT_EQ(read_text(output_ / ("first" + split + ext)),
                read_text(output_ / ("second" + split + ext)))
          << split << ext;
    }
  }
  EXPECT_NE(read_text(output_ / "first_train.bin"), read_text(output_ / "other_train.bin"));
  // Same documents overall, only the order differs.
  auto sorted_documents = [&](const std::string& name) {
    auto documents = documents_of(output_ / (name + "_train"));
    const auto valid = documents_of(output_ / (name + "_valid"));
    documents.insert(documents.end(), valid.begin(), valid.end());
    std::sort(documents.begin(), documents.end());
    return documents;
  };
  EXPECT_EQ(sorted_documents("first"), sorted_documents("other"));
}

TEST_F(PrepareTest, ValidationSplitSize) {
  make_tree();
  const std::vector<std::pair<double, std::uint64_t>> cases = {{0.0, 1},  {0.05, 1}, {0.06, 2},
                                                               {0.25, 5}, {0.3, 6},  {0.99, 19}};
  for (const auto& [fraction, expected] : cases) {
    PrepareOptions opts = options();
    opts.valid_fraction = fraction;
    const PrepareReport report = prepare_dataset(opts);
    EXPECT_EQ(report.valid.documents, expected) << "valid_fraction " << fraction;
    EXPECT_EQ(report.train.documents, 20 - expected) << "valid_fraction " << fraction;
    EXPECT_EQ(IndexedDataset(output_ / "ds_valid").num_documents(), expected);
  }
  for (const double bad : {-0.1, 1.0, std::numeric_limits<double>::quiet_NaN()}) {
    PrepareOptions opts = options();
    opts.valid_fraction = bad;
    EXPECT_THROW(prepare_dataset(opts), Error) << bad;
  }
}

TEST_F(PrepareTest, SingleFileInputGoesToTrain) {
  write_text(input_ / "only.txt", "hello");
  PrepareOptions opts = options();
  opts.input = input_ / "only.txt";
  const PrepareReport report = prepare_dataset(opts);
  EXPECT_EQ(report.train.documents, 1u);
  EXPECT_EQ(report.valid.documents, 0u);
  EXPECT_EQ(documents_of(output_ / "ds_train"),
            (std::vector<std::vector<std::int32_t>>{{'h', 'e', 'l', 'l', 'o', 256}}));
  EXPECT_EQ(IndexedDataset(output_ / "ds_valid").total_tokens(), 0u);
}

TEST_F(PrepareTest, ExtensionFilter) {
  const auto files = make_tree();
  write_text(input_ / "x.hpp", "template");
  write_text(input_ / "graph", "no extension");
  PrepareOptions opts = options();
  opts.extensions = {".h", "hpp"};
  const PrepareReport report = prepare_dataset(opts);
  EXPECT_EQ(report.files_read, 11u);  // ten odd-numbered .h files and x.hpp
  std::uint64_t bytes = 8;
  for (const auto& [path, content] : files) {
    if (path.ends_with(".h")) bytes += content.size();
  }
  EXPECT_EQ(report.bytes_read, bytes);
}

TEST_F(PrepareTest, SkipsBrokenSymlinksAndUnreadableFilesWithACount) {
  make_tree();
  fs::create_symlink("loop", input_ / "loop");            // resolves to itself
  fs::create_symlink("missing", input_ / "dangling");     // resolves to nothing
  fs::create_symlink("src", input_ / "src_again");        // a directory: not followed
  fs::create_symlink("file0.txt", input_ / "alias.txt");  // a file: taken
  std::uint64_t expected_skipped = 3;
  if (::geteuid() != 0) {  // root reads anything, so permissions only bite for other users
    write_text(input_ / "secret.txt", "hidden");
    fs::permissions(input_ / "secret.txt", fs::perms::none);
    ++expected_skipped;
  }
  const PrepareReport report = prepare_dataset(options());
  EXPECT_EQ(report.files_skipped, expected_skipped);
  EXPECT_EQ(report.files_read, 21u);
  EXPECT_EQ(report.train.documents + report.valid.documents, 21u);
}

TEST_F(PrepareTest, MaxBytesLimitsTheInput) {
  const auto files = make_tree();
  std::uint64_t total = 0;
  for (const auto& [path, content] : files) total += content.size();
  PrepareOptions opts = options();
  opts.max_bytes = total / 2;
  const PrepareReport report = prepare_dataset(opts);
  EXPECT_LE(report.bytes_read, total / 2);
  EXPECT_GT(report.files_over_limit, 0u);
  EXPECT_EQ(report.files_read + report.files_over_limit, 20u);
  EXPECT_EQ(report.bytes_read + report.bytes_skipped, total);
  EXPECT_EQ(report.train.tokens + report.valid.tokens, report.bytes_read + report.files_read);
}

TEST_F(PrepareTest, OutputsInsideTheInputTreeAreNotReadBack) {
  make_tree();
  PrepareOptions opts = options();
  opts.output_prefix = input_ / "ds";
  const PrepareReport first = prepare_dataset(opts);
  const PrepareReport second = prepare_dataset(opts);
  EXPECT_EQ(first.files_read, 20u);
  EXPECT_EQ(second.files_read, 20u);
  EXPECT_EQ(second.bytes_read, first.bytes_read);
}

TEST_F(PrepareTest, EmptyOrMissingInputIsAnErrorNamingThePath) {
  try {
    prepare_dataset(options());
    FAIL() << "an empty directory must be refused";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find(input_.string()), std::string::npos) << error.what();
  }
  write_text(input_ / "a.txt", "text");
  PrepareOptions filtered = options();
  filtered.extensions = {".cpp"};
  EXPECT_THROW(prepare_dataset(filtered), Error);

  PrepareOptions missing = options();
  missing.input = root_ / "nowhere";
  try {
    prepare_dataset(missing);
    FAIL() << "a missing input must be refused";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), ErrorKind::kNotFound);
    EXPECT_NE(std::string(error.what()).find("nowhere"), std::string::npos) << error.what();
  }
  EXPECT_FALSE(fs::exists(output_ / "ds_train.idx"));
}

}  // namespace
}  // namespace megacpp::data
