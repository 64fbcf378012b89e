#pragma once
// A small durable store of compiled plans (key string -> opaque bytes), kept under the daemon's
// cache directory so that a job's GEMM algorithm choices survive the process and a restarted or
// repeated job skips the heuristics. One file per scope: the scope names what makes a plan
// valid at all (library version, GPU architecture, device name), so a new library or another GPU
// never reads plans made for a different one; the key inside it names the problem (shape,
// types, ...).
//
// File layout (integers little-endian u32):
//   header  "MCPPLAN1" magic, format version, scope length, record count, scope bytes, CRC32 of
//           the four fields after the magic (the count catches a cut between two records)
//   record  key length, value length, key bytes, value bytes, CRC32 of the four fields before it
// Records are independent: one corrupt record is dropped and the rest kept. A wrong magic, a
// format version other than kPlanCacheFormatVersion or a header CRC mismatch makes the whole file
// stale: its records are ignored and it is rebuilt.
//
// Writes go through write_file_atomically (temporary file, fsync, rename) under an exclusive
// flock on a sibling "<file>.lock": a writer re-reads the file under the lock and merges its new
// records into what is there, so two executor processes sharing a cache lose neither's records.
// Reading never throws for bad content: what is wrong is reported as problems naming the file,
// the record and the rule it broke.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace megacpp {

inline constexpr uint32_t kPlanCacheFormatVersion = 1;
// Bounds that a sane record keeps; a length beyond them is taken as corruption rather than a
// request to allocate gigabytes. A value may be a cuDNN execution plan's JSON form, which carries
// its compiled kernels.
inline constexpr uint32_t kPlanCacheMaxKeyBytes = 4096;
inline constexpr uint32_t kPlanCacheMaxValueBytes = 16u << 20;

// CRC-32 (IEEE 802.3, the polynomial zlib uses), continuing from `crc` (0 to start).
uint32_t crc32(std::string_view bytes, uint32_t crc = 0);

// What a file's bytes hold. `header_ok` false: the file is stale or unreadable as a whole and
// `records` is empty. Each problem names the file, the record (index and byte offset) and the
// rule.
struct PlanCacheContent {
  bool header_ok = false;
  std::string scope;
  std::map<std::string, std::string> records;
  std::vector<std::string> problems;
};

// Parses `bytes` read from `file` (the name is used in problems only). Never throws.
PlanCacheContent parse_plan_cache(const std::filesystem::path& file, std::string_view bytes);

// The bytes of a file holding `records` under `scope`.
std::string serialize_plan_cache(std::string_view scope,
                                 const std::map<std::string, std::string>& records);

// The file name for a scope: its characters outside [A-Za-z0-9._-] replaced by '_', plus the
// scope's CRC32 so that two scopes differing only in replaced characters do not share a file.
std::string plan_cache_file_name(std::string_view scope);

// One file's check at startup (repair_plan_cache_dir).
struct PlanCacheRepair {
  std::filesystem::path file;
  std::string action;  // "ok", "repaired" (corrupt records dropped, file rewritten), "removed"
  size_t records_kept = 0;
  std::vector<std::string> problems;
};

// Checks every "*.plans" file in `dir` (absent: nothing to check) under each file's lock:
// a file whose header is bad, or whose scope `current` (when given) rejects, e.g. one made by
// another library version, is removed (its plans are rebuilt on demand); one with corrupt
// records is rewritten with the good ones. Throws Error(kIo) when a file cannot be read, written
// or removed.
std::vector<PlanCacheRepair> repair_plan_cache_dir(
    const std::filesystem::path& dir,
    const std::function<bool(std::string_view scope)>& current = {});

// What a process's plan lookups came to: the trainer reads it to hold the job to its recompile
// budget, the run summary reports it.
struct PlanLedger {
  uint64_t hits = 0;
  uint64_t builds = 0;     // every plan made by the library's heuristic: misses and stale entries
  uint64_t stale = 0;      // of the builds: a cached entry the library no longer accepted
  std::string last_build;  // what the newest build was for (the GEMM and its shape)
};

class PlanCache {
 public:
  // Loads dir/plan_cache_file_name(scope) if it exists. Bad content is not an error: it is
  // listed in problems() and repaired at the next flush(). Throws Error(kIo) only when an
  // existing file cannot be read.
  PlanCache(std::filesystem::path dir, std::string scope);

  // The value stored under `key`, or null.
  const std::string* find(const std::string& key) const;
  // Stores `value` under `key` in memory; flush() makes it durable.
  void put(const std::string& key, std::string value);
  // Writes the pending records (and any repair) to disk, merged under the file lock with what
  // other writers have stored since this cache loaded. Nothing to write: no I/O. Throws
  // Error(kIo) naming the file.
  void flush();

  const std::filesystem::path& file() const { return file_; }
  const std::string& scope() const { return scope_; }
  const std::vector<std::string>& problems() const { return problems_; }
  size_t size() const { return records_.size(); }

 private:
  std::filesystem::path dir_;
  std::string scope_;
  std::filesystem::path file_;
  std::map<std::string, std::string> records_;
  std::map<std::string, std::string> pending_;
  std::vector<std::string> problems_;
  bool needs_repair_ = false;
};

}  // namespace megacpp
