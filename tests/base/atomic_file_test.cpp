#include "base/atomic_file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include "base/error.h"

namespace megacpp {
namespace {

namespace fs = std::filesystem;

class AtomicFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("megacpp_atomic_file_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ignored;
    fs::permissions(dir_, fs::perms::owner_all, fs::perm_options::add, ignored);
    fs::remove_all(dir_, ignored);
  }

  std::vector<std::string> entries() const {
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(dir_)) {
      names.push_back(entry.path().filename().string());
    }
    std::sort(names.begin(), names.end());
    return names;
  }

  // Read back without the code under test, so a bug in read_file cannot hide one in the writer.
  static std::string slurp(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  fs::path dir_;
};

template <typename Body>
Error capture_error(Body&& body) {
  try {
    body();
  } catch (const Error& error) {
    return error;
  }
  ADD_FAILURE() << "expected megacpp::Error";
  return Error(ErrorKind::kInternal, "no error thrown");
}

TEST_F(AtomicFileTest, WritesNewFileWithExactBytes) {
  const fs::path target = dir_ / "out.bin";
  std::string bytes = "hello";
  bytes.push_back('\0');
  bytes += "\xff\x01 world";
  write_file_atomically(target, bytes);
  EXPECT_EQ(slurp(target), bytes);
  EXPECT_EQ(entries(), std::vector<std::string>{"out.bin"});
}

TEST_F(AtomicFileTest, WritesEmptyFile) {
  const fs::path target = dir_ / "empty";
  write_file_atomically(target, std::string_view{});
  EXPECT_TRUE(fs::exists(target));
  EXPECT_EQ(fs::file_size(target), 0u);
}

TEST_F(AtomicFileTest, OverwriteReplacesWholeContent) {
  const fs::path target = dir_ / "state.json";
  write_file_atomically(target, std::string(10000, 'a'));
  write_file_atomically(target, "short");
  // No stale tail from the longer first version.
  EXPECT_EQ(slurp(target), "short");
  for (int i = 0; i < 20; ++i) write_file_atomically(target, std::to_string(i));
  EXPECT_EQ(slurp(target), "19");
  EXPECT_EQ(entries(), std::vector<std::string>{"state.json"});
}

TEST_F(AtomicFileTest, StreamingVariantConcatenatesChunks) {
  const fs::path target = dir_ / "big.bin";
  std::string expected;
  write_file_atomically(target, [&expected](const ByteSink& sink) {
    for (int chunk = 0; chunk < 50; ++chunk) {
      std::string piece(100000 + static_cast<size_t>(chunk), static_cast<char>('A' + chunk % 26));
      expected += piece;
      sink(piece);
      sink(std::string_view{});
    }
  });
  EXPECT_EQ(fs::file_size(target), expected.size());
  EXPECT_EQ(slurp(target), expected);
  EXPECT_EQ(entries(), std::vector<std::string>{"big.bin"});
}

TEST_F(AtomicFileTest, ProducerFailureKeepsOldContentAndRemovesTemporary) {
  const fs::path target = dir_ / "model.safetensors";
  write_file_atomically(target, "old content");
  EXPECT_THROW(write_file_atomically(target,
                                     [](const ByteSink& sink) {
                                       sink("partial new content");
                                       throw std::runtime_error("producer gave up");
                                     }),
               std::runtime_error);
  EXPECT_EQ(slurp(target), "old content");
  EXPECT_EQ(entries(), std::vector<std::string>{"model.safetensors"});
}

TEST_F(AtomicFileTest, MissingDirectoryIsIoErrorNamingThePath) {
  const fs::path target = dir_ / "no_such_dir" / "out.bin";
  const Error error = capture_error([&] { write_file_atomically(target, "x"); });
  EXPECT_EQ(error.kind(), ErrorKind::kIo);
  EXPECT_NE(std::string(error.what()).find(target.string()), std::string::npos) << error.what();
  EXPECT_NE(std::string(error.what()).find("No such file or directory"), std::string::npos)
      << error.what();
  EXPECT_TRUE(entries().empty());
}

TEST_F(AtomicFileTest, ParentThatIsAFileIsIoError) {
  write_file_atomically(dir_ / "plain", "x");
  const fs::path target = dir_ / "plain" / "out.bin";
  const Error error = capture_error([&] { write_file_atomically(target, "x"); });
  EXPECT_EQ(error.kind(), ErrorKind::kIo);
  EXPECT_NE(std::string(error.what()).find(target.string()), std::string::npos) << error.what();
  EXPECT_EQ(entries(), std::vector<std::string>{"plain"});
}

TEST_F(AtomicFileTest, TargetThatIsADirectoryIsIoErrorAndLeavesNoTemporary) {
  fs::create_directories(dir_ / "occupied" / "child");
  const fs::path target = dir_ / "occupied";
  const Error error = capture_error([&] { write_file_atomically(target, "x"); });
  EXPECT_EQ(error.kind(), ErrorKind::kIo);
  EXPECT_NE(std::string(error.what()).find(target.string()), std::string::npos) << error.what();
  EXPECT_EQ(entries(), std::vector<std::string>{"occupied"});
  EXPECT_TRUE(fs::is_directory(dir_ / "occupied" / "child"));
}

TEST_F(AtomicFileTest, ReadOnlyDirectoryIsIoErrorNamingThePath) {
  if (::geteuid() == 0) GTEST_SKIP() << "root ignores directory permissions";
  const fs::path locked = dir_ / "locked";
  fs::create_directories(locked);
  fs::permissions(locked, fs::perms::owner_read | fs::perms::owner_exec);
  const fs::path target = locked / "out.bin";
  const Error error = capture_error([&] { write_file_atomically(target, "x"); });
  EXPECT_EQ(error.kind(), ErrorKind::kIo);
  EXPECT_NE(std::string(error.what()).find(target.string()), std::string::npos) << error.what();
  EXPECT_NE(std::string(error.what()).find("Permission denied"), std::string::npos) << error.what();
}

TEST_F(AtomicFileTest, ReadFileReturnsExactBytes) {
  const fs::path target = dir_ / "data";
  std::string bytes;
  for (int i = 0; i < 300000; ++i) bytes.push_back(static_cast<char>(i * 7 + i / 256));
  {
    std::ofstream out(target, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  EXPECT_EQ(read_file(target), bytes);
}

TEST_F(AtomicFileTest, ReadFileOfProcfsFileReadsPastReportedSize) {
  // procfs reports size 0; the content must still come back.
  const std::string content = read_file("/proc/self/status");
  EXPECT_NE(content.find("Name:"), std::string::npos);
}

TEST_F(AtomicFileTest, ReadMissingFileIsNotFoundNamingThePath) {
  const fs::path target = dir_ / "absent.json";
  const Error error = capture_error([&] { read_file(target); });
  EXPECT_EQ(error.kind(), ErrorKind::kNotFound);
  EXPECT_NE(std::string(error.what()).find(target.string()), std::string::npos) << error.what();
}

TEST_F(AtomicFileTest, ReadDirectoryIsIoErrorNamingThePath) {
  const Error error = capture_error([&] { read_file(dir_); });
  EXPECT_EQ(error.kind(), ErrorKind::kIo);
  EXPECT_NE(std::string(error.what()).find(dir_.string()), std::string::npos) << error.what();
}

}  // namespace
}  // namespace megacpp
