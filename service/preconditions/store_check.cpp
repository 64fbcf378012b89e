// The store check opens the SQLite file read-only: a precondition check must never modify the
// store it is judging (no journal replay, no schema migration), and a daemon that is still
// running elsewhere on the same file keeps working.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <string>
#include <vector>

#include "base/error.h"
#include "receipts/sqlite.h"
#include "service/preconditions/preconditions.h"

namespace megacpp::preconditions {

namespace fs = std::filesystem;

namespace {

constexpr const char* kName = "store_quick_check";
constexpr size_t kMaxReportedProblems = 5;

CheckResult damaged(const fs::path& store, const std::string& problem) {
  return {kName, CheckResult::Status::kFail,
          fmt::format("{} is not a healthy SQLite database: {}", store.string(), problem),
          fmt::format("stop anything using it, move it aside (mv {0} {0}.damaged, with any -wal "
                      "and -shm files) so the daemon starts a new store, or restore it from a "
                      "backup; `sqlite3 {0}.damaged .recover` may salvage receipts",
                      store.string())};
}

}  // namespace

CheckResult check_store_file(const fs::path& store) {
  std::error_code ec;
  const fs::file_status status = fs::status(store, ec);
  if (status.type() == fs::file_type::not_found) {
    return {kName, CheckResult::Status::kPass,
            fmt::format("{} does not exist yet: the daemon will create it", store.string()), ""};
  }
  if (ec) {
    return {kName, CheckResult::Status::kFail,
            fmt::format("cannot inspect {}: {}", store.string(), ec.message()),
            fmt::format("make {} and its directory accessible to the daemon's user, or set "
                        "store_path in the daemon config",
                        store.string())};
  }
  if (!fs::is_regular_file(status)) {
    return {
        kName, CheckResult::Status::kFail,
        fmt::format("{} exists but is not a regular file", store.string()),
        fmt::format("remove or rename {}, or set store_path in the daemon config", store.string())};
  }

  std::vector<std::string> rows;
  try {
    receipts::sqlite::Connection db(store, /*read_only=*/true);
    // A daemon may be checkpointing the WAL right now; wait for it rather than report damage.
    db.set_busy_timeout(std::chrono::milliseconds(5000));
    auto query = db.query("PRAGMA quick_check");
    while (query.next()) {
      if (rows.size() < kMaxReportedProblems) rows.push_back(query.text(0));
    }
  } catch (const Error& e) {
    return damaged(store, e.what());
  }
  if (rows.size() == 1 && rows[0] == "ok") {
    return {kName, CheckResult::Status::kPass,
            fmt::format("{}: quick_check ok ({} bytes)", store.string(), fs::file_size(store, ec)),
            ""};
  }
  return damaged(store, fmt::format("quick_check reports: {}", fmt::join(rows, "; ")));
}

}  // namespace megacpp::preconditions
