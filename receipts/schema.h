#pragma once
// The receipt store's schema as an ordered list of forward migrations. Migration N takes a
// database from schema version N-1 to N (PRAGMA user_version); each is applied in its own
// transaction together with the version bump, so a crash mid-migration leaves the previous
// version intact. Released migrations are never edited: a change is a new migration.
#include <span>
#include <string_view>

namespace megacpp::receipts {

struct Migration {
  int version;            // the schema version after this migration
  std::string_view name;  // what it does, for logs and errors
  std::string_view sql;   // schema statements only: no values
};

// In order: migrations()[i].version == i + 1.
std::span<const Migration> migrations();
// The schema version this code writes and reads: migrations().back().version.
int latest_schema_version();

}  // namespace megacpp::receipts
