// The store check opens the SQLite file read-only: a precondition check must never modify the
// store it is judging (no journal replay, no schema migration), and a daemon that is still
// running elsewhere on the same file keeps working.
#include <sqlite3.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <memory>
#include <string>
#include <vector>

#include "runtime/preconditions/preconditions.h"

namespace megacpp::preconditions {

namespace fs = std::filesystem;

namespace {

struct CloseDatabase {
  void operator()(sqlite3* db) const { sqlite3_close_v2(db); }
};
struct FinalizeStatement {
  void operator()(sqlite3_stmt* statement) const { sqlite3_finalize(statement); }
};

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

  sqlite3* raw_db = nullptr;
  const int open_status = sqlite3_open_v2(store.c_str(), &raw_db, SQLITE_OPEN_READONLY, nullptr);
  std::unique_ptr<sqlite3, CloseDatabase> db(raw_db);
  if (open_status != SQLITE_OK) {
    return damaged(store, fmt::format("cannot open it: {}",
                                      db ? sqlite3_errmsg(db.get()) : sqlite3_errstr(open_status)));
  }
  // A daemon may be checkpointing the WAL right now; wait for it rather than report damage.
  sqlite3_busy_timeout(db.get(), 5000);

  sqlite3_stmt* raw_statement = nullptr;
  if (sqlite3_prepare_v2(db.get(), "PRAGMA quick_check", -1, &raw_statement, nullptr) !=
      SQLITE_OK) {
    return damaged(store, sqlite3_errmsg(db.get()));
  }
  std::unique_ptr<sqlite3_stmt, FinalizeStatement> statement(raw_statement);
  std::vector<std::string> rows;
  int step = SQLITE_ROW;
  while ((step = sqlite3_step(statement.get())) == SQLITE_ROW) {
    const unsigned char* text = sqlite3_column_text(statement.get(), 0);
    if (rows.size() < kMaxReportedProblems) {
      rows.emplace_back(text ? reinterpret_cast<const char*>(text) : "(null)");
    }
  }
  if (step != SQLITE_DONE) return damaged(store, sqlite3_errmsg(db.get()));
  if (rows.size() == 1 && rows[0] == "ok") {
    return {kName, CheckResult::Status::kPass,
            fmt::format("{}: quick_check ok ({} bytes)", store.string(), fs::file_size(store, ec)),
            ""};
  }
  return damaged(store, fmt::format("quick_check reports: {}", fmt::join(rows, "; ")));
}

}  // namespace megacpp::preconditions
