#include "service/preconditions/preconditions.h"

#include <grp.h>
#include <gtest/gtest.h>
#include <sqlite3.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "base/plan_cache.h"
#ifdef MEGACPP_HAVE_CUDA
#include "kernels/cuda/gemm_plan_cache.h"
#endif
#include "tests/support/temp_dir.h"

namespace megacpp::preconditions {
namespace {

namespace fs = std::filesystem;
using Status = CheckResult::Status;
using megacpp::testing::TempDir;
using megacpp::testing::write_text;

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << part << "\" not found in: " << text;
}

const CheckResult& find(const std::vector<CheckResult>& results, const std::string& name) {
  for (const CheckResult& r : results) {
    if (r.name == name) return r;
  }
  ADD_FAILURE() << "no check named " << name << " in:\n" << format_report(results);
  static const CheckResult none{"", Status::kSkip, "", ""};
  return none;
}

std::vector<std::string> names(const std::vector<CheckResult>& results) {
  std::vector<std::string> out;
  for (const CheckResult& r : results) out.push_back(r.name);
  return out;
}

const HostEnvironment kNoGpus{0, std::nullopt};

class PreconditionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(tmp_ / "data");
    config_.state_dir = tmp_ / "state";  // missing: must be created
    config_.store_path = tmp_ / "state" / "receipts.db";
    config_.checkpoint_root = tmp_ / "state" / "checkpoints";
    config_.cache_dirs = {tmp_ / "cache0", tmp_ / "cache1"};
    config_.data_roots = {tmp_ / "data"};
    config_.min_free_bytes = 1 << 20;
  }

  // A real store as the daemon keeps it: WAL mode, one table with some rows.
  void make_store(const fs::path& path, int rows) {
    sqlite3* db = nullptr;
    ASSERT_EQ(sqlite3_open(path.c_str(), &db), SQLITE_OK);
    const std::string sql =
        "PRAGMA journal_mode=WAL; CREATE TABLE steps(id INTEGER PRIMARY KEY, loss REAL, note TEXT);"
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i+1 FROM n WHERE i < " +
        std::to_string(rows) + ") INSERT INTO steps SELECT i, i * 0.5, printf('%0200d', i) FROM n;";
    ASSERT_EQ(sqlite3_exec(db, sql.c_str(), nullptr, nullptr, nullptr), SQLITE_OK)
        << sqlite3_errmsg(db);
    sqlite3_close(db);
  }

  TempDir tmp_;
  PreconditionConfig config_;
};

TEST_F(PreconditionsTest, AllPassInATempDirAndCreateMissingDirectories) {
  const auto results = run_preconditions(config_, kNoGpus);
  EXPECT_TRUE(all_passed(results)) << format_report(results);
  EXPECT_EQ(names(results),
            (std::vector<std::string>{
                "state_dir", "checkpoint_root", "cache_dirs[0]", "plan_cache[0]", "cache_dirs[1]",
                "plan_cache[1]", "data_roots[0]", "store_dir", "store_quick_check", "nccl_nvls",
                "cuda_driver", "cuda_kernel_image", "nccl_library"}));
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(results[i].status, Status::kPass) << results[i].name;
  EXPECT_TRUE(contains(find(results, "plan_cache[0]").detail, "no plan cache yet"));
  EXPECT_TRUE(fs::is_directory(config_.state_dir));
  EXPECT_TRUE(fs::is_directory(config_.checkpoint_root));
  EXPECT_TRUE(fs::is_directory(config_.cache_dirs[1]));
  EXPECT_TRUE(contains(find(results, "state_dir").detail, "(created)"));
  EXPECT_TRUE(contains(find(results, "store_quick_check").detail, "does not exist yet"));
  EXPECT_FALSE(fs::exists(config_.store_path)) << "a check must not create the store";
  // The write probes are gone: only the checkpoint directory is left in the state directory.
  EXPECT_TRUE(fs::is_empty(config_.checkpoint_root));
  EXPECT_TRUE(fs::is_empty(config_.cache_dirs[0]));
  std::vector<fs::path> state_entries;
  for (const auto& entry : fs::directory_iterator(config_.state_dir)) {
    state_entries.push_back(entry.path());
  }
  EXPECT_EQ(state_entries, std::vector<fs::path>{config_.checkpoint_root});
  for (const char* cuda_check : {"cuda_driver", "cuda_kernel_image", "nccl_library"}) {
    const CheckResult& r = find(results, cuda_check);
    EXPECT_EQ(r.status, Status::kSkip);
#ifdef MEGACPP_HAVE_CUDA
    EXPECT_TRUE(contains(r.detail, "no NVIDIA GPU"));
#else
    EXPECT_EQ(r.detail, "built without CUDA");
#endif
  }
  // Run twice: existing directories and the remembered layout pass again.
  EXPECT_TRUE(all_passed(run_preconditions(config_, kNoGpus)));
}

TEST_F(PreconditionsTest, HealthyWalStorePassesEvenWhileAWriterHoldsIt) {
  fs::create_directories(config_.state_dir);
  make_store(config_.store_path, 500);
  CheckResult r = check_store_file(config_.store_path);
  EXPECT_EQ(r.status, Status::kPass) << r.detail;
  EXPECT_TRUE(contains(r.detail, "quick_check ok"));

  sqlite3* writer = nullptr;
  ASSERT_EQ(sqlite3_open(config_.store_path.c_str(), &writer), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(writer, "BEGIN; INSERT INTO steps VALUES (100000, 1.0, 'x');", nullptr,
                         nullptr, nullptr),
            SQLITE_OK);
  r = check_store_file(config_.store_path);
  EXPECT_EQ(r.status, Status::kPass) << r.detail;
  sqlite3_exec(writer, "COMMIT;", nullptr, nullptr, nullptr);
  sqlite3_close(writer);

  const auto results = run_preconditions(config_, kNoGpus);
  EXPECT_TRUE(all_passed(results)) << format_report(results);
}

TEST_F(PreconditionsTest, UnwritableStateDirFailsWithAFixAndSkipsCuda) {
  // Tests may run as root, for whom permission bits do not bite; a path under a regular file
  // cannot be created by anyone.
  write_text(tmp_ / "file", "not a directory");
  config_.state_dir = tmp_ / "file" / "state";
  const auto results = run_preconditions(config_, kNoGpus);
  EXPECT_FALSE(all_passed(results));
  const CheckResult& state = find(results, "state_dir");
  EXPECT_EQ(state.status, Status::kFail);
  EXPECT_TRUE(contains(state.detail, config_.state_dir.string()));
  EXPECT_TRUE(contains(state.detail, "cannot be created"));
  EXPECT_TRUE(contains(state.fix, "create " + config_.state_dir.string()));
  EXPECT_TRUE(contains(state.fix, "state_dir in the daemon config"));
  // Later checks still run and are reported, so one run shows every problem...
  EXPECT_EQ(find(results, "checkpoint_root").status, Status::kPass);
  EXPECT_EQ(find(results, "nccl_nvls").status, Status::kPass);
  // ...but nothing touches an accelerator after a failure.
  for (const char* cuda_check : {"cuda_driver", "cuda_kernel_image", "nccl_library"}) {
    EXPECT_EQ(find(results, cuda_check).status, Status::kSkip);
    EXPECT_EQ(find(results, cuda_check).detail, "not run: an earlier check failed");
  }
  const std::string report = format_report(results);
  EXPECT_TRUE(contains(report, "FAIL"));
  EXPECT_TRUE(contains(report, state.fix));
  EXPECT_TRUE(contains(report, "1 of 13 checks failed"));
}

TEST_F(PreconditionsTest, ExistingDirectoryThatRefusesWritesFails) {
  // procfs refuses new files even to root: the write probe, not the permission bits, decides.
  if (!fs::is_directory("/proc/self")) GTEST_SKIP() << "no /proc";
  config_.cache_dirs = {"/proc"};
  const auto results = run_preconditions(config_, kNoGpus);
  const CheckResult& cache = find(results, "cache_dirs[0]");
  EXPECT_EQ(cache.status, Status::kFail);
  EXPECT_TRUE(
      contains(cache.detail, "/proc is not writable: cannot create /proc/.megacpp-write-probe"));
  EXPECT_TRUE(contains(cache.fix, "make /proc writable by"));
  EXPECT_TRUE(contains(cache.fix, "cache_dirs[0]"));
  EXPECT_EQ(find(results, "state_dir").status, Status::kPass);
}

TEST_F(PreconditionsTest, StateDirThatIsAFileFails) {
  write_text(tmp_ / "state", "oops");
  const auto results = run_preconditions(config_, kNoGpus);
  const CheckResult& state = find(results, "state_dir");
  EXPECT_EQ(state.status, Status::kFail);
  EXPECT_TRUE(contains(state.detail, "is not a directory"));
  EXPECT_FALSE(state.fix.empty());
}

TEST_F(PreconditionsTest, AbsurdFreeSpaceThresholdFailsEveryWritableDirectory) {
  config_.min_free_bytes = std::numeric_limits<uint64_t>::max() / 2;
  const auto results = run_preconditions(config_, kNoGpus);
  EXPECT_FALSE(all_passed(results));
  for (const char* name : {"state_dir", "checkpoint_root", "cache_dirs[0]", "store_dir"}) {
    const CheckResult& r = find(results, name);
    EXPECT_EQ(r.status, Status::kFail) << name;
    EXPECT_TRUE(contains(r.detail, "less than min_free_bytes")) << name;
    EXPECT_TRUE(contains(r.fix, "lower min_free_bytes")) << name;
  }
  EXPECT_EQ(find(results, "data_roots[0]").status, Status::kPass);  // read-only: no threshold
  EXPECT_EQ(find(results, "cuda_driver").detail, "not run: an earlier check failed");
}

TEST_F(PreconditionsTest, GarbageStoreFailsQuickCheck) {
  fs::create_directories(config_.state_dir);
  std::string garbage(8192, '\0');
  uint32_t x = 12345;
  for (char& c : garbage) {
    x = x * 1664525u + 1013904223u;
    c = static_cast<char>(x >> 24);
  }
  write_text(config_.store_path, garbage);
  const auto results = run_preconditions(config_, kNoGpus);
  EXPECT_FALSE(all_passed(results));
  const CheckResult& store = find(results, "store_quick_check");
  EXPECT_EQ(store.status, Status::kFail);
  EXPECT_TRUE(contains(store.detail, config_.store_path.string()));
  EXPECT_TRUE(contains(store.detail, "not a healthy SQLite database"));
  EXPECT_TRUE(contains(store.fix, "move it aside"));
  EXPECT_EQ(find(results, "store_dir").status, Status::kPass);
  EXPECT_EQ(find(results, "cuda_driver").status, Status::kSkip);
  // Read-only: the check left the damaged file exactly as it was.
  EXPECT_EQ(megacpp::testing::read_bytes(config_.store_path), garbage);
}

TEST_F(PreconditionsTest, DamagedPagesInARealStoreFailQuickCheck) {
  fs::create_directories(config_.state_dir);
  make_store(config_.store_path, 2000);
  {
    // Checkpointed by the close above; scribble over the b-tree pages past the header page.
    std::fstream file(config_.store_path, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(file);
    const size_t size = static_cast<size_t>(fs::file_size(config_.store_path));
    ASSERT_GT(size, 40000u);
    for (size_t offset = 4096; offset + 64 < size; offset += 4096) {
      file.seekp(static_cast<std::streamoff>(offset + 8));
      file.write("\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8\xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8", 16);
    }
  }
  const CheckResult r = check_store_file(config_.store_path);
  EXPECT_EQ(r.status, Status::kFail) << r.detail;
  EXPECT_FALSE(r.fix.empty());
}

TEST_F(PreconditionsTest, StorePathThatIsADirectoryFails) {
  fs::create_directories(config_.store_path);
  const CheckResult r = check_store_file(config_.store_path);
  EXPECT_EQ(r.status, Status::kFail);
  EXPECT_TRUE(contains(r.detail, "not a regular file"));
  EXPECT_TRUE(contains(r.fix, "store_path"));
}

TEST_F(PreconditionsTest, MissingOrFileDataRootFails) {
  write_text(tmp_ / "a_file", "x");
  config_.data_roots = {tmp_ / "data", tmp_ / "nope", tmp_ / "a_file"};
  const auto results = run_preconditions(config_, kNoGpus);
  EXPECT_EQ(find(results, "data_roots[0]").status, Status::kPass);
  const CheckResult& missing = find(results, "data_roots[1]");
  EXPECT_EQ(missing.status, Status::kFail);
  EXPECT_TRUE(contains(missing.detail, "does not exist"));
  EXPECT_TRUE(contains(missing.fix, "data_roots"));
  EXPECT_FALSE(fs::exists(tmp_ / "nope")) << "data roots are never created";
  EXPECT_EQ(find(results, "data_roots[2]").status, Status::kFail);
  EXPECT_TRUE(contains(find(results, "data_roots[2]").detail, "not a directory"));
}

// A data root that lists but cannot be searched (mode 0444: r without x) fails: a job could see
// its file names and open none of them. Root searches any directory, so as root the check runs in
// a child that has become the unprivileged user "nobody" (65534); where that user cannot be
// become, or cannot reach the temporary directory (a TMPDIR under a private parent), the test
// skips rather than fail for the wrong reason.
TEST_F(PreconditionsTest, DataRootThatListsButCannotBeSearchedFails) {
  const fs::path searchable = tmp_ / "searchable", unsearchable = tmp_ / "unsearchable";
  fs::create_directories(searchable);
  fs::create_directories(unsearchable);
  write_text(unsearchable / "train.bin", "x");
  const fs::perms open_dir = fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                             fs::perms::others_read | fs::perms::others_exec;
  fs::permissions(tmp_.path(), open_dir);
  fs::permissions(searchable, open_dir);
  fs::permissions(unsearchable,
                  fs::perms::owner_read | fs::perms::group_read | fs::perms::others_read);
  // 0 both as expected, 1 the searchable root failed, 2 the unsearchable one passed or its
  // failure did not say why; from the child also 3 (could not become nobody), 4 (nobody cannot
  // reach the temporary directory), 5 (the check threw).
  const auto check_both = [&] {
    const CheckResult ok = check_readable_dir("data_roots[0]", searchable);
    const CheckResult bad = check_readable_dir("data_roots[1]", unsearchable);
    if (ok.status != Status::kPass) return 1;
    if (bad.status != Status::kFail || !contains(bad.detail, "cannot search") ||
        !contains(bad.fix, "chmod a+rx") || !contains(bad.fix, "data_roots")) {
      return 2;
    }
    return 0;
  };
  int outcome = 0;
  if (::geteuid() != 0) {
    outcome = check_both();
  } else {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      if (::setgroups(0, nullptr) != 0 || ::setgid(65534) != 0 || ::setuid(65534) != 0) {
        ::_exit(3);
      }
      if (::access(searchable.c_str(), X_OK) != 0) ::_exit(4);
      try {
        ::_exit(check_both());
      } catch (...) {
        ::_exit(5);
      }
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ASSERT_TRUE(WIFEXITED(status));
    outcome = WEXITSTATUS(status);
  }
  fs::permissions(unsearchable, fs::perms::owner_all);  // so the temp dir can be removed
  if (outcome == 3) GTEST_SKIP() << "running as root, but could not become nobody (65534)";
  if (outcome == 4) GTEST_SKIP() << "nobody cannot reach " << tmp_.path() << " (its parents)";
  EXPECT_EQ(outcome, 0) << "1: the searchable root failed; 2: the unsearchable root passed or "
                           "its failure named no search permission; 5: the check threw";
}

TEST_F(PreconditionsTest, UnconfiguredPathsFail) {
  config_.state_dir.clear();
  config_.store_path.clear();
  const auto results = run_preconditions(config_, kNoGpus);
  EXPECT_EQ(find(results, "state_dir").status, Status::kFail);
  EXPECT_TRUE(contains(find(results, "state_dir").fix, "set state_dir"));
  EXPECT_EQ(find(results, "store_dir").status, Status::kFail);
}

TEST(Nvls, OnlyMultiGpuHostsNeedItDisabled) {
  struct Case {
    int gpus;
    std::optional<std::string> value;
    bool allow;
    Status expected;
  };
  const std::vector<Case> cases = {
      {0, std::nullopt, false, Status::kPass}, {1, std::nullopt, false, Status::kPass},
      {1, "1", false, Status::kPass},          {2, std::nullopt, false, Status::kFail},
      {2, "1", false, Status::kFail},          {8, "", false, Status::kFail},
      {8, "false", false, Status::kFail},      {2, "0", false, Status::kPass},
      {8, "0", false, Status::kPass},          {8, std::nullopt, true, Status::kPass},
      {8, "1", true, Status::kPass},
  };
  for (const Case& c : cases) {
    const CheckResult r = check_nvls({c.gpus, c.value}, c.allow);
    EXPECT_EQ(r.name, "nccl_nvls");
    EXPECT_EQ(r.status, c.expected)
        << c.gpus << " GPUs, NCCL_NVLS_ENABLE=" << c.value.value_or("(unset)")
        << ", allow=" << c.allow;
    if (r.status == Status::kFail) {
      EXPECT_TRUE(contains(r.fix, "NCCL_NVLS_ENABLE=0"));
      EXPECT_TRUE(contains(r.fix, "allow_nvls"));
      EXPECT_TRUE(contains(r.detail, std::to_string(c.gpus) + " GPUs"));
    }
  }
}

TEST_F(PreconditionsTest, NvlsViolationOnMultiGpuHostSkipsCudaChecks) {
  auto results = run_preconditions(config_, {4, std::nullopt});
  EXPECT_FALSE(all_passed(results));
  EXPECT_EQ(find(results, "nccl_nvls").status, Status::kFail);
  EXPECT_EQ(find(results, "cuda_driver").detail, "not run: an earlier check failed");
  EXPECT_EQ(find(results, "nccl_library").detail, "not run: an earlier check failed");

  config_.allow_nvls = true;
  results = run_preconditions(config_, {4, std::nullopt});
  EXPECT_EQ(find(results, "nccl_nvls").status, Status::kPass);
  EXPECT_NE(find(results, "cuda_driver").detail, "not run: an earlier check failed");
}

TEST_F(PreconditionsTest, CudaChecksCanBeDisabled) {
  config_.check_cuda = false;
  const auto results = run_preconditions(config_, {2, std::string("0")});
  EXPECT_TRUE(all_passed(results)) << format_report(results);
  EXPECT_EQ(find(results, "cuda_driver").status, Status::kSkip);
  EXPECT_EQ(find(results, "cuda_driver").detail, "disabled (check_cuda=false)");
}

TEST(CountGpus, PrefersTheDriversProcEntriesElseDeviceFiles) {
  TempDir tmp;
  const fs::path proc = tmp / "proc_gpus";
  const fs::path dev = tmp / "dev";
  for (const char* file : {"nvidia0", "nvidia1", "nvidia12", "nvidiactl", "nvidia-uvm",
                           "nvidia-modeset", "nvidia", "sda"}) {
    write_text(dev / file, "");
  }
  EXPECT_EQ(count_nvidia_gpus(proc, dev), 3);  // no proc directory: device files
  for (const char* bus : {"0000:18:00.0", "0000:2a:00.0"}) fs::create_directories(proc / bus);
  EXPECT_EQ(count_nvidia_gpus(proc, dev), 2);
  EXPECT_EQ(count_nvidia_gpus(tmp / "none", tmp / "none"), 0);
  const HostEnvironment host = probe_host_environment();
  EXPECT_GE(host.gpu_count, 0);
}

// A WSL2 guest has no /proc/driver/nvidia or /dev/nvidiaN: its GPU is /dev/dxg with the host's
// libcuda under /usr/lib/wsl/lib. Counted as one GPU there, so the CUDA checks run (they once
// skipped, while the serving daemon found the GPU); /dev/dxg without an NVIDIA libcuda (another
// vendor's GPU) is none.
TEST(CountGpus, AWsl2GuestsGpuIsCountedThroughDxgAndTheHostsLibcuda) {
  TempDir tmp;
  const fs::path dev = tmp / "dev", wsl = tmp / "wsl_lib";
  write_text(dev / "dxg", "");
  fs::create_directories(wsl);
  EXPECT_EQ(count_nvidia_gpus(tmp / "none", dev, wsl), 0);
  write_text(wsl / "libd3d12.so", "");
  EXPECT_EQ(count_nvidia_gpus(tmp / "none", dev, wsl), 0);
  write_text(wsl / "libcuda.so.1", "");
  EXPECT_EQ(count_nvidia_gpus(tmp / "none", dev, wsl), 1);
  fs::remove(dev / "dxg");
  EXPECT_EQ(count_nvidia_gpus(tmp / "none", dev, wsl), 0);  // libcuda alone is no GPU
  write_text(dev / "dxg", "");
  write_text(dev / "nvidia0", "");
  write_text(dev / "nvidia1", "");
  EXPECT_EQ(count_nvidia_gpus(tmp / "none", dev, wsl), 2);  // device files when there are some
}

TEST(Report, IsATableWithEveryRowAndAllPassedIgnoresSkips) {
  const std::vector<CheckResult> results = {
      {"alpha", Status::kPass, "fine", ""},
      {"beta_long_name", Status::kFail, "broken thing", "do the fix"},
      {"gamma", Status::kSkip, "not run", ""},
  };
  const std::string report = format_report(results);
  EXPECT_TRUE(contains(report, "check"));
  EXPECT_TRUE(contains(report, "status"));
  EXPECT_TRUE(contains(report, "detail"));
  EXPECT_TRUE(contains(report, "fix"));
  EXPECT_TRUE(contains(report, "beta_long_name  FAIL    broken thing  do the fix"));
  EXPECT_TRUE(contains(report, "alpha           pass    fine"));
  EXPECT_TRUE(contains(report, "gamma           skip    not run"));
  EXPECT_TRUE(contains(report, "1 of 3 checks failed"));
  EXPECT_FALSE(all_passed(results));
  EXPECT_TRUE(all_passed({results[0], results[2]}));
  EXPECT_TRUE(all_passed({}));
}

// A scope this build's daemon keeps: a CUDA build removes plan files of another cuBLASLt.
std::string current_scope(const std::string& tail) {
#ifdef MEGACPP_HAVE_CUDA
  return cuda::plan_scope_prefix() + tail;
#else
  return tail;
#endif
}

// Plan caches under each cache directory's plans/ are checked before any job: intact files pass
// as "ok", a corrupt record is dropped and its file rewritten, a stale-format file removed, each
// named in its row with what was wrong.
TEST_F(PreconditionsTest, PlanCachesAreCheckedAndRepairedAtStartup) {
  const fs::path plans = config_.cache_dirs[1] / "plans";
  {
    PlanCache intact(plans, current_scope("scope-intact"));
    intact.put("k", "v");
    intact.flush();
    PlanCache damaged(plans, current_scope("scope-damaged"));
    damaged.put("a", "first-value");
    damaged.put("b", "second-value");
    damaged.flush();
  }
  const fs::path damaged_file = plans / plan_cache_file_name(current_scope("scope-damaged"));
  std::string bytes = testing::read_bytes(damaged_file);
  bytes[bytes.find("first-value")] = 'F';
  write_text(damaged_file, bytes);
  std::string stale = serialize_plan_cache("scope-stale", {{"k", "v"}});
  stale[8] = static_cast<char>(kPlanCacheFormatVersion + 1);
  write_text(plans / plan_cache_file_name("scope-stale"), stale);

  const auto results = run_preconditions(config_, kNoGpus);
  EXPECT_TRUE(all_passed(results)) << format_report(results);
  EXPECT_TRUE(contains(find(results, "plan_cache[0]").detail, "no plan cache yet"));
  const CheckResult& row = find(results, "plan_cache[1]");
  EXPECT_EQ(row.status, Status::kPass);
  EXPECT_TRUE(contains(row.detail, "1 plan file(s) intact"));
  EXPECT_TRUE(contains(row.detail, "repaired " + damaged_file.filename().string()));
  EXPECT_TRUE(contains(row.detail, "record 0"));
  EXPECT_TRUE(contains(row.detail, "CRC32 mismatch"));
  EXPECT_TRUE(contains(row.detail, "removed " + plan_cache_file_name("scope-stale")));
  EXPECT_TRUE(contains(row.detail, "format version 2"));
  EXPECT_FALSE(fs::exists(plans / plan_cache_file_name("scope-stale")));
  EXPECT_TRUE(parse_plan_cache(damaged_file, testing::read_bytes(damaged_file)).problems.empty());

  // Repaired once: the next start finds every file intact.
  const auto again = run_preconditions(config_, kNoGpus);
  EXPECT_TRUE(contains(find(again, "plan_cache[1]").detail, "ok, 2 plan file(s) intact"))
      << find(again, "plan_cache[1]").detail;
}

#ifdef MEGACPP_HAVE_CUDA
// Plans chosen by another cuBLASLt are stale in a CUDA build: the file is removed, and said so.
TEST_F(PreconditionsTest, PlanFilesOfAnotherCublasLtAreRemoved) {
  const fs::path plans = config_.cache_dirs[0] / "plans";
  {
    PlanCache old_library(plans, "cublaslt-1/sm_90/old device");
    old_library.put("k", "v");
    old_library.flush();
  }
  const fs::path file = plans / plan_cache_file_name("cublaslt-1/sm_90/old device");
  ASSERT_TRUE(fs::exists(file));
  const auto results = run_preconditions(config_, kNoGpus);
  const CheckResult& row = find(results, "plan_cache[0]");
  EXPECT_EQ(row.status, Status::kPass) << row.detail;
  EXPECT_TRUE(contains(row.detail, "removed " + file.filename().string())) << row.detail;
  EXPECT_TRUE(contains(row.detail, "another library version")) << row.detail;
  EXPECT_FALSE(fs::exists(file));
}
#endif

// A plan file the daemon cannot read (here a directory by that name, which even root cannot read
// as a file) fails its row with the fix.
TEST_F(PreconditionsTest, UnreadablePlanCacheFails) {
  const fs::path plans = config_.cache_dirs[0] / "plans";
  fs::create_directories(plans / "x.plans");
  const auto results = run_preconditions(config_, kNoGpus);
  const CheckResult& row = find(results, "plan_cache[0]");
  EXPECT_EQ(row.status, Status::kFail) << row.detail;
  EXPECT_TRUE(contains(row.detail, "x.plans"));
  EXPECT_TRUE(contains(row.fix, "cache_dirs[0]"));
}

}  // namespace
}  // namespace megacpp::preconditions
