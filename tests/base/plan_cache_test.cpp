#include "base/plan_cache.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "base/atomic_file.h"
#include "base/error.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

namespace fs = std::filesystem;
using testing::read_bytes;
using testing::TempDir;
using testing::write_text;

constexpr const char* kScope = "cublaslt-120803/sm_90/NVIDIA H100 80GB HBM3";

bool any_problem_contains(const std::vector<std::string>& problems, const std::string& text) {
  for (const auto& problem : problems) {
    if (problem.find(text) != std::string::npos) return true;
  }
  return false;
}

// A plan file under dir holding the record "a" -> "value"; returns its path.
fs::path write_one_record(const fs::path& dir) {
  PlanCache cache(dir, kScope);
  cache.put("a", "value");
  cache.flush();
  return cache.file();
}

TEST(PlanCacheTest, Crc32MatchesTheStandardCheckValue) {
  // The CRC-32/ISO-HDLC check value of "123456789".
  EXPECT_EQ(crc32("123456789"), 0xCBF43926u);
}

TEST(PlanCacheTest, RoundTripsRecordsThroughTheFile) {
  TempDir dir;
  {
    PlanCache cache(dir.path(), kScope);
    EXPECT_EQ(cache.find("m=1"), nullptr);
    cache.put("m=1", std::string("\0\1\2algo", 7));
    cache.put("m=2", "second");
    cache.flush();
  }
  PlanCache again(dir.path(), kScope);
  EXPECT_TRUE(again.problems().empty());
  ASSERT_NE(again.find("m=1"), nullptr);
  EXPECT_EQ(*again.find("m=1"), std::string("\0\1\2algo", 7));
  ASSERT_NE(again.find("m=2"), nullptr);
  EXPECT_EQ(*again.find("m=2"), "second");
  EXPECT_EQ(again.size(), 2u);
}

TEST(PlanCacheTest, FlushWithNothingNewWritesNothing) {
  TempDir dir;
  PlanCache cache(dir.path(), kScope);
  cache.flush();
  EXPECT_FALSE(fs::exists(cache.file()));
}

TEST(PlanCacheTest, CorruptRecordIsReportedDroppedAndRepaired) {
  TempDir dir;
  fs::path file;
  {
    PlanCache cache(dir.path(), kScope);
    cache.put("a", "first-value");
    cache.put("b", "second-value");
    cache.flush();
    file = cache.file();
  }
  std::string bytes = read_bytes(file);
  // The value of the first record ("a" sorts first): flip one byte inside it.
  const size_t at = bytes.find("first-value");
  ASSERT_NE(at, std::string::npos);
  bytes[at] = 'F';
  write_text(file, bytes);

  PlanCache damaged(dir.path(), kScope);
  ASSERT_EQ(damaged.problems().size(), 1u);
  EXPECT_TRUE(any_problem_contains(damaged.problems(), "record 0"));
  EXPECT_TRUE(any_problem_contains(damaged.problems(), "CRC32 mismatch"));
  EXPECT_TRUE(any_problem_contains(damaged.problems(), file.string()));
  EXPECT_EQ(damaged.find("a"), nullptr);
  ASSERT_NE(damaged.find("b"), nullptr);

  const auto repairs = repair_plan_cache_dir(dir.path());
  ASSERT_EQ(repairs.size(), 1u);
  EXPECT_EQ(repairs[0].action, "repaired");
  EXPECT_EQ(repairs[0].records_kept, 1u);
  const auto content = parse_plan_cache(file, read_bytes(file));
  EXPECT_TRUE(content.problems.empty());
  EXPECT_EQ(content.records.size(), 1u);
  const auto again = repair_plan_cache_dir(dir.path());
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].action, "ok");
}

TEST(PlanCacheTest, FlushRepairsADamagedFileItLoaded) {
  TempDir dir;
  const fs::path file = write_one_record(dir.path());
  std::string bytes = read_bytes(file);
  write_text(file, bytes.substr(0, bytes.size() - 3));
  PlanCache damaged(dir.path(), kScope);
  EXPECT_TRUE(any_problem_contains(damaged.problems(), "truncated"));
  damaged.flush();
  EXPECT_TRUE(parse_plan_cache(file, read_bytes(file)).problems.empty());
}

TEST(PlanCacheTest, TruncatedFilesNeverCrashAndNameWhatIsMissing) {
  TempDir dir;
  PlanCache cache(dir.path(), kScope);
  cache.put("key", std::string(100, 'v'));
  cache.put("other", "x");
  cache.flush();
  const std::string bytes = read_bytes(cache.file());
  // Every prefix parses without throwing; any proper prefix is reported.
  for (size_t length = 0; length < bytes.size(); ++length) {
    const auto content = parse_plan_cache(cache.file(), std::string_view(bytes).substr(0, length));
    EXPECT_FALSE(content.problems.empty()) << "prefix of " << length << " bytes";
    EXPECT_LE(content.records.size(), 1u);
  }
  const auto header_only = parse_plan_cache(cache.file(), std::string_view(bytes).substr(0, 5));
  EXPECT_FALSE(header_only.header_ok);
  EXPECT_TRUE(any_problem_contains(header_only.problems, "header"));
}

TEST(PlanCacheTest, WrongFormatVersionIsStaleAndRemovedAtRepair) {
  TempDir dir;
  const fs::path file = write_one_record(dir.path());
  std::string bytes = read_bytes(file);
  bytes[8] = static_cast<char>(kPlanCacheFormatVersion + 1);  // the version's low byte
  write_text(file, bytes);
  PlanCache stale(dir.path(), kScope);
  EXPECT_EQ(stale.find("a"), nullptr);
  EXPECT_TRUE(any_problem_contains(stale.problems(), "format version 2"));

  const auto repairs = repair_plan_cache_dir(dir.path());
  ASSERT_EQ(repairs.size(), 1u);
  EXPECT_EQ(repairs[0].action, "removed");
  EXPECT_FALSE(fs::exists(file));
}

TEST(PlanCacheTest, GarbageFileIsRemovedAtRepair) {
  TempDir dir;
  write_text(dir / "junk.plans", "this is not a plan cache");
  write_text(dir / "unrelated.txt", "left alone");
  const auto repairs = repair_plan_cache_dir(dir.path());
  ASSERT_EQ(repairs.size(), 1u);
  EXPECT_EQ(repairs[0].action, "removed");
  EXPECT_TRUE(any_problem_contains(repairs[0].problems, "magic"));
  EXPECT_TRUE(fs::exists(dir / "unrelated.txt"));
  EXPECT_TRUE(repair_plan_cache_dir(dir / "absent").empty());
}

TEST(PlanCacheTest, RepairRemovesFilesOfAnotherLibraryVersion) {
  TempDir dir;
  for (const char* scope :
       {"cublaslt-120803/sm_90/H100", "cublaslt-120900/sm_90/H100", "cublaslt-120900/sm_80/A100"}) {
    PlanCache cache(dir.path(), scope);
    cache.put("k", "v");
    cache.flush();
  }
  const auto current = [](std::string_view scope) {
    return scope.starts_with("cublaslt-120900/");
  };
  const auto repairs = repair_plan_cache_dir(dir.path(), current);
  ASSERT_EQ(repairs.size(), 3u);
  size_t removed = 0;
  for (const auto& repair : repairs) {
    if (repair.action == "removed") {
      ++removed;
      EXPECT_TRUE(any_problem_contains(repair.problems, "cublaslt-120803"));
      EXPECT_TRUE(any_problem_contains(repair.problems, "another library version"));
    } else {
      EXPECT_EQ(repair.action, "ok");
    }
  }
  EXPECT_EQ(removed, 1u);
  EXPECT_FALSE(fs::exists(dir / plan_cache_file_name("cublaslt-120803/sm_90/H100")));
  EXPECT_TRUE(fs::exists(dir / plan_cache_file_name("cublaslt-120900/sm_80/A100")));
}

// A record the reader would drop (and every record after it) is refused when it is put, naming
// the limit; a scope the header cannot hold is refused at construction.
TEST(PlanCacheTest, RefusesRecordsAndScopesPastTheFormatsLimits) {
  TempDir dir;
  PlanCache cache(dir.path(), kScope);
  try {
    cache.put(std::string(kPlanCacheMaxKeyBytes + 1, 'k'), "v");
    FAIL() << "an oversized key was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(std::to_string(kPlanCacheMaxKeyBytes)), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(cache.put("k", std::string(kPlanCacheMaxValueBytes + 1, 'v')), Error);
  EXPECT_EQ(cache.find("k"), nullptr);
  EXPECT_THROW(PlanCache(dir.path(), std::string(kPlanCacheMaxKeyBytes + 1, 's')), Error);
}

// A cache directory that cannot be inspected is an error, never "no plan cache yet".
TEST(PlanCacheTest, RepairOfAnUninspectableDirectoryFails) {
  TempDir dir;
  write_text(dir.path() / "file", "x");
  // A path through a regular file: ENOTDIR, not ENOENT.
  EXPECT_THROW(repair_plan_cache_dir(dir.path() / "file" / "plans", {}), Error);
  EXPECT_TRUE(repair_plan_cache_dir(dir.path() / "absent", {}).empty());
}

TEST(PlanCacheTest, ScopesKeepDistinctFilesAndKeys) {
  TempDir dir;
  // The library version, the architecture and the device name each make another scope.
  const std::string scopes[] = {"cublaslt-120803/sm_90/H100", "cublaslt-120900/sm_90/H100",
                                "cublaslt-120803/sm_80/H100", "cublaslt-120803/sm_90/H200"};
  for (const auto& scope : scopes) {
    PlanCache cache(dir.path(), scope);
    EXPECT_EQ(cache.find("shape"), nullptr) << scope;
    cache.put("shape", scope);
    cache.flush();
  }
  for (const auto& scope : scopes) {
    PlanCache cache(dir.path(), scope);
    ASSERT_NE(cache.find("shape"), nullptr) << scope;
    EXPECT_EQ(*cache.find("shape"), scope);
  }
  // Scopes differing only in characters a file name cannot hold still get their own files.
  EXPECT_NE(plan_cache_file_name("a/b"), plan_cache_file_name("a b"));
}

TEST(PlanCacheTest, FileWithAnotherScopeIsStale) {
  TempDir dir;
  PlanCache cache(dir.path(), kScope);
  write_text(cache.file(), serialize_plan_cache("another scope", {{"k", "v"}}));
  PlanCache reloaded(dir.path(), kScope);
  EXPECT_EQ(reloaded.find("k"), nullptr);
  EXPECT_TRUE(any_problem_contains(reloaded.problems(), "scope"));
}

TEST(PlanCacheTest, TwoWritersMergeTheirRecords) {
  TempDir dir;
  // Both load the empty cache before either writes, as two executors starting together would.
  PlanCache first(dir.path(), kScope);
  PlanCache second(dir.path(), kScope);
  first.put("first", "1");
  second.put("second", "2");
  first.flush();
  second.flush();
  PlanCache reloaded(dir.path(), kScope);
  ASSERT_NE(reloaded.find("first"), nullptr);
  ASSERT_NE(reloaded.find("second"), nullptr);
}

TEST(PlanCacheTest, ConcurrentProcessesLoseNoRecords) {
  TempDir dir;
  constexpr int kProcesses = 4;
  constexpr int kRecordsEach = 25;
  for (int p = 0; p < kProcesses; ++p) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int status = 0;
      try {
        for (int r = 0; r < kRecordsEach; ++r) {
          PlanCache cache(dir.path(), kScope);
          cache.put(std::to_string(p) + "/" + std::to_string(r), "value");
          cache.flush();
        }
      } catch (...) {
        status = 1;
      }
      ::_exit(status);
    }
  }
  for (int p = 0; p < kProcesses; ++p) {
    int status = 0;
    ASSERT_GT(::wait(&status), 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  PlanCache reloaded(dir.path(), kScope);
  EXPECT_TRUE(reloaded.problems().empty());
  EXPECT_EQ(reloaded.size(), static_cast<size_t>(kProcesses * kRecordsEach));
}

}  // namespace
}  // namespace megacpp
