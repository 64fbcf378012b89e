#include "receipts/sqlite.h"

#include <sqlite3.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "base/error.h"

namespace megacpp::receipts::sqlite {
namespace {

ErrorKind error_kind(int code) {
  switch (code & 0xff) {
    case SQLITE_CORRUPT:
    case SQLITE_NOTADB:
      return ErrorKind::kCorruptData;
    case SQLITE_CONSTRAINT:
    case SQLITE_TOOBIG:
    case SQLITE_MISMATCH:
      return ErrorKind::kInvalidArgument;
    case SQLITE_READONLY:
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
      return ErrorKind::kFailedPrecondition;
    case SQLITE_ERROR:
    case SQLITE_MISUSE:
    case SQLITE_RANGE:
    case SQLITE_INTERNAL:
      return ErrorKind::kInternal;
    default:  // SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN, SQLITE_PERM, SQLITE_NOMEM, ...
      return ErrorKind::kIo;
  }
}

// The statement's first line, enough to tell which one failed.
std::string_view sql_head(std::string_view sql) {
  size_t start = sql.find_first_not_of(" \n");
  if (start == std::string_view::npos) start = 0;
  sql.remove_prefix(start);
  return sql.substr(0, std::min(sql.find('\n'), size_t{72}));
}

}  // namespace

Connection::Connection(const std::filesystem::path& path, bool read_only) : path_(path) {
  // NOMUTEX: a connection is used by one thread at a time (the Store's contract), so SQLite's
  // per-connection mutex would only cost time.
  const int flags =
      (read_only ? SQLITE_OPEN_READONLY : SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE) |
      SQLITE_OPEN_NOMUTEX;
  const int code = sqlite3_open_v2(path.c_str(), &db_, flags, nullptr);
  if (code != SQLITE_OK) {
    const std::string message = db_ != nullptr ? sqlite3_errmsg(db_) : sqlite3_errstr(code);
    sqlite3_close(db_);
    db_ = nullptr;
    fail(error_kind(code), "receipt store {}: cannot open ({}): {}", path.string(),
         read_only ? "read-only" : "read-write", message);
  }
  sqlite3_extended_result_codes(db_, 1);
}

Connection::~Connection() {
  for (auto& [sql, statement] : statements_) sqlite3_finalize(statement);
  sqlite3_close(db_);
}

void Connection::set_busy_timeout(std::chrono::milliseconds timeout) {
  const auto ms = std::min<std::chrono::milliseconds::rep>(timeout.count(), 1 << 30);
  sqlite3_busy_timeout(db_, static_cast<int>(ms < 0 ? 0 : ms));
}

void Connection::raise(int code, std::string_view what) const {
  fail(error_kind(code), "receipt store {}: {} failed: {} (SQLite code {})", path_.string(), what,
       sqlite3_errmsg(db_), code);
}

void Connection::exec(std::string_view sql) {
  const std::string text(sql);
  char* message = nullptr;
  const int code = sqlite3_exec(db_, text.c_str(), nullptr, nullptr, &message);
  if (code != SQLITE_OK) {
    const std::string reason = message != nullptr ? message : sqlite3_errstr(code);
    sqlite3_free(message);
    fail(error_kind(code), "receipt store {}: '{}' failed: {} (SQLite code {})", path_.string(),
         sql_head(sql), reason, code);
  }
}

Query Connection::query(std::string_view sql) {
  auto found = statements_.find(std::string(sql));
  if (found == statements_.end()) {
    sqlite3_stmt* statement = nullptr;
    const int code = sqlite3_prepare_v3(db_, sql.data(), static_cast<int>(sql.size()),
                                        SQLITE_PREPARE_PERSISTENT, &statement, nullptr);
    if (code != SQLITE_OK) raise(code, fmt::format("preparing '{}'", sql_head(sql)));
    found = statements_.emplace(std::string(sql), statement).first;
  }
  return Query(*this, found->second, found->first);
}

std::string Connection::pragma_text(std::string_view sql) {
  Query query = this->query(sql);
  return query.next() ? query.text(0) : std::string();
}

bool Connection::in_transaction() const {
  return sqlite3_get_autocommit(db_) == 0;
}

Query::Query(const Connection& connection, sqlite3_stmt* statement, std::string_view sql)
    : connection_(connection), statement_(statement), sql_(sql) {}

Query::~Query() {
  // reset() repeats the last step's error, which next()/run() already reported.
  sqlite3_reset(statement_);
  sqlite3_clear_bindings(statement_);
}

Query& Query::bind(int index, int64_t value) {
  const int code = sqlite3_bind_int64(statement_, index, static_cast<sqlite3_int64>(value));
  if (code != SQLITE_OK)
    connection_.raise(code, fmt::format("binding ?{} of '{}'", index, sql_head(sql_)));
  return *this;
}

Query& Query::bind(int index, double value) {
  if (std::isnan(value)) return bind_null(index);
  const int code = sqlite3_bind_double(statement_, index, value);
  if (code != SQLITE_OK)
    connection_.raise(code, fmt::format("binding ?{} of '{}'", index, sql_head(sql_)));
  return *this;
}

Query& Query::bind(int index, std::string_view text) {
  // SQLITE_TRANSIENT: SQLite copies the text, so the caller's buffer may go away before step().
  const int code = sqlite3_bind_text64(statement_, index, text.data(), text.size(),
                                       SQLITE_TRANSIENT, SQLITE_UTF8);
  if (code != SQLITE_OK)
    connection_.raise(code, fmt::format("binding ?{} of '{}'", index, sql_head(sql_)));
  return *this;
}

Query& Query::bind_null(int index) {
  const int code = sqlite3_bind_null(statement_, index);
  if (code != SQLITE_OK)
    connection_.raise(code, fmt::format("binding ?{} of '{}'", index, sql_head(sql_)));
  return *this;
}

bool Query::next() {
  const int code = sqlite3_step(statement_);
  if (code == SQLITE_ROW) return true;
  if (code == SQLITE_DONE) return false;
  connection_.raise(code, fmt::format("'{}'", sql_head(sql_)));
}

void Query::run() {
  while (next()) {
  }
}

int64_t Query::int64(int column) const {
  return static_cast<int64_t>(sqlite3_column_int64(statement_, column));
}

int Query::int32(int column) const {
  const int64_t value = int64(column);
  if (value < std::numeric_limits<int>::min() || value > std::numeric_limits<int>::max()) {
    fail(ErrorKind::kCorruptData, "receipt store {}: column {} of '{}' holds {}, out of int range",
         connection_.path().string(), sqlite3_column_name(statement_, column), sql_head(sql_),
         value);
  }
  return static_cast<int>(value);
}

double Query::real(int column) const {
  if (is_null(column)) return std::numeric_limits<double>::quiet_NaN();
  return sqlite3_column_double(statement_, column);
}

std::string Query::text(int column) const {
  const auto* bytes = sqlite3_column_text(statement_, column);
  if (bytes == nullptr) return {};
  return std::string(reinterpret_cast<const char*>(bytes),
                     static_cast<size_t>(sqlite3_column_bytes(statement_, column)));
}

bool Query::is_null(int column) const {
  return sqlite3_column_type(statement_, column) == SQLITE_NULL;
}

}  // namespace megacpp::receipts::sqlite
