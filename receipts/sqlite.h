#pragma once
// A thin layer over the SQLite C API for the receipt store: one connection with a cache of
// prepared statements, and a cursor that binds values by parameter index (never by pasting them
// into SQL text) and resets its statement when it goes out of scope. Every SQLite failure
// becomes a megacpp::Error naming the database file and what was being done.
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

struct sqlite3;
struct sqlite3_stmt;

namespace megacpp::receipts::sqlite {

class Query;

class Connection {
 public:
  // read_only: SQLITE_OPEN_READONLY; otherwise the file is created when missing.
  Connection(const std::filesystem::path& path, bool read_only);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Runs SQL that takes no values (schema, PRAGMAs, BEGIN/COMMIT); may hold several statements.
  void exec(std::string_view sql);
  // A cursor over the cached statement for `sql`, prepared on first use.
  Query query(std::string_view sql);
  // The first column of the first row of a value-free statement, as text ("" when no row).
  std::string pragma_text(std::string_view sql);
  // How long a statement waits for another connection's lock before failing with SQLITE_BUSY.
  void set_busy_timeout(std::chrono::milliseconds timeout);
  // Whether a transaction is open.
  bool in_transaction() const;

  const std::filesystem::path& path() const { return path_; }
  sqlite3* handle() const { return db_; }
  // Throws the Error for SQLite result `code`, naming the file, `what`, and SQLite's message.
  [[noreturn]] void raise(int code, std::string_view what) const;

 private:
  std::filesystem::path path_;
  sqlite3* db_ = nullptr;
  std::unordered_map<std::string, sqlite3_stmt*> statements_;
};

class Query {
 public:
  Query(const Connection& connection, sqlite3_stmt* statement, std::string_view sql);
  ~Query();
  Query(const Query&) = delete;
  Query& operator=(const Query&) = delete;

  // Parameters are numbered from 1, as in SQLite (?1, ?2, ...).
  Query& bind(int index, int64_t value);
  Query& bind(int index, int value) { return bind(index, static_cast<int64_t>(value)); }
  // NaN binds as NULL: SQLite would store it as NULL anyway, and real() reads NULL as NaN.
  Query& bind(int index, double value);
  Query& bind(int index, std::string_view text);
  Query& bind(int index, const std::string& text) { return bind(index, std::string_view(text)); }
  Query& bind(int index, const char* text) { return bind(index, std::string_view(text)); }
  Query& bind_null(int index);

  // Advances to the next row: true when there is one, false when the statement is done.
  bool next();
  // Runs a statement that returns no rows.
  void run();

  // Columns are numbered from 0.
  int64_t int64(int column) const;
  int int32(int column) const;
  double real(int column) const;  // NULL reads as NaN
  std::string text(int column) const;
  bool is_null(int column) const;

 private:
  const Connection& connection_;
  sqlite3_stmt* statement_;
  std::string_view sql_;
};

}  // namespace megacpp::receipts::sqlite
