#include "base/plan_cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <system_error>
#include <thread>
#include <utility>

#include "base/atomic_file.h"
#include "base/error.h"

namespace megacpp {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kMagic = "MCPPLAN1";

constexpr std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kCrcTable = make_crc_table();

void put_u32(std::string& out, uint32_t value) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFFu));
}

uint32_t get_u32(std::string_view bytes, size_t at) {
  uint32_t value = 0;
  for (int i = 0; i < 4; ++i) {
    value |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + static_cast<size_t>(i)]))
             << (8 * i);
  }
  return value;
}

// An exclusive flock on "<file>.lock", held for its lifetime. The lock is on a sibling rather
// than the file itself because each write renames a new inode over the file. A holder keeps it
// for one read-merge-write of a small file, so a lock still held after kLockWait belongs to a
// stuck process: waiting on it forever would hang the daemon's startup check or a job with no
// word of why, so the wait ends in an error naming the lock file.
class FileLock {
 public:
  static constexpr std::chrono::seconds kLockWait{30};

  explicit FileLock(const fs::path& file) {
    const fs::path lock = fs::path(file.string() + ".lock");
    while ((fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666)) < 0 && errno == EINTR) {
    }
    if (fd_ < 0) fail(ErrorKind::kIo, "cannot open {}: {}", lock.string(), describe_errno(errno));
    const auto deadline = std::chrono::steady_clock::now() + kLockWait;
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int flock_errno = errno;
      if (flock_errno == EINTR) continue;
      if (flock_errno == EWOULDBLOCK && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      ::close(fd_);
      if (flock_errno == EWOULDBLOCK) {
        fail(ErrorKind::kIo,
             "{} is still locked after {} s: another megacpp process holds it (stuck?); stop it, "
             "or remove the lock file if no process uses this plan cache",
             lock.string(), kLockWait.count());
      }
      fail(ErrorKind::kIo, "cannot lock {}: {}", lock.string(), describe_errno(flock_errno));
    }
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock() { ::close(fd_); }  // closing releases the lock

 private:
  int fd_ = -1;
};

// Reads the file into `bytes`; false when it does not exist.
bool read_if_exists(const fs::path& file, std::string& bytes) {
  try {
    bytes = read_file(file);
    return true;
  } catch (const Error& error) {
    if (error.kind() == ErrorKind::kNotFound) return false;
    throw;
  }
}

}  // namespace

uint32_t crc32(std::string_view bytes, uint32_t crc) {
  crc = ~crc;
  for (const char ch : bytes) {
    crc = kCrcTable[(crc ^ static_cast<unsigned char>(ch)) & 0xFFu] ^ (crc >> 8);
  }
  return ~crc;
}

PlanCacheContent parse_plan_cache(const fs::path& file, std::string_view bytes) {
  PlanCacheContent content;
  const std::string name = file.string();
  if (bytes.size() < kMagic.size() + 16 || bytes.substr(0, kMagic.size()) != kMagic) {
    content.problems.push_back(fmt::format(
        "{}: header: not a plan cache file (no \"{}\" magic in its first bytes, {} bytes long)",
        name, kMagic, bytes.size()));
    return content;
  }
  size_t at = kMagic.size();
  const uint32_t version = get_u32(bytes, at);
  const uint32_t scope_bytes = get_u32(bytes, at + 4);
  const uint32_t record_count = get_u32(bytes, at + 8);
  if (version != kPlanCacheFormatVersion) {
    content.problems.push_back(
        fmt::format("{}: header: format version {}, this build reads version {} (stale, rebuilt)",
                    name, version, kPlanCacheFormatVersion));
    return content;
  }
  if (scope_bytes > kPlanCacheMaxKeyBytes || bytes.size() - at - 12 < size_t{scope_bytes} + 4) {
    content.problems.push_back(
        fmt::format("{}: header: truncated (scope of {} bytes, {} bytes left in the file)", name,
                    scope_bytes, bytes.size() - at - 12));
    return content;
  }
  const std::string_view checked = bytes.substr(at, 12 + size_t{scope_bytes});
  const uint32_t header_crc = get_u32(bytes, at + 12 + scope_bytes);
  if (crc32(checked) != header_crc) {
    content.problems.push_back(
        fmt::format("{}: header: CRC32 mismatch (stored {:08x}, computed {:08x})", name, header_crc,
                    crc32(checked)));
    return content;
  }
  content.scope = std::string(bytes.substr(at + 12, scope_bytes));
  content.header_ok = true;
  at += 12 + size_t{scope_bytes} + 4;
  size_t index = 0;
  for (; at < bytes.size(); ++index) {
    if (bytes.size() - at < 8) {
      content.problems.push_back(fmt::format(
          "{}: record {} at byte {}: truncated ({} bytes left, a record header needs 8)", name,
          index, at, bytes.size() - at));
      break;
    }
    const uint32_t key_bytes = get_u32(bytes, at);
    const uint32_t value_bytes = get_u32(bytes, at + 4);
    if (key_bytes > kPlanCacheMaxKeyBytes || value_bytes > kPlanCacheMaxValueBytes) {
      // The lengths themselves are damaged: nothing after this point can be framed.
      content.problems.push_back(fmt::format(
          "{}: record {} at byte {}: key of {} bytes or value of {} bytes over the limits ({}, "
          "{}); the rest of the file is dropped",
          name, index, at, key_bytes, value_bytes, kPlanCacheMaxKeyBytes, kPlanCacheMaxValueBytes));
      break;
    }
    const size_t total = 8 + size_t{key_bytes} + size_t{value_bytes} + 4;
    if (bytes.size() - at < total) {
      content.problems.push_back(
          fmt::format("{}: record {} at byte {}: truncated ({} bytes left, the record needs {})",
                      name, index, at, bytes.size() - at, total));
      break;
    }
    const uint32_t stored = get_u32(bytes, at + total - 4);
    const uint32_t computed = crc32(bytes.substr(at, total - 4));
    if (stored != computed) {
      content.problems.push_back(fmt::format(
          "{}: record {} at byte {}: CRC32 mismatch (stored {:08x}, computed {:08x}); dropped",
          name, index, at, stored, computed));
    } else {
      content.records[std::string(bytes.substr(at + 8, key_bytes))] =
          std::string(bytes.substr(at + 8 + key_bytes, value_bytes));
    }
    at += total;
  }
  // A cut exactly between two records leaves every remaining record intact: only the count
  // shows it.
  if (content.problems.empty() && index != record_count) {
    content.problems.push_back(
        fmt::format("{}: {} records in the file, its header says {} (truncated or appended to)",
                    name, index, record_count));
  }
  return content;
}

std::string serialize_plan_cache(std::string_view scope,
                                 const std::map<std::string, std::string>& records) {
  std::string out(kMagic);
  std::string header;
  put_u32(header, kPlanCacheFormatVersion);
  put_u32(header, static_cast<uint32_t>(scope.size()));
  put_u32(header, static_cast<uint32_t>(records.size()));
  header.append(scope);
  out += header;
  put_u32(out, crc32(header));
  for (const auto& [key, value] : records) {
    std::string record;
    put_u32(record, static_cast<uint32_t>(key.size()));
    put_u32(record, static_cast<uint32_t>(value.size()));
    record += key;
    record += value;
    out += record;
    put_u32(out, crc32(record));
  }
  return out;
}

std::string plan_cache_file_name(std::string_view scope) {
  std::string name;
  for (const char ch : scope) {
    const bool keep = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                      (ch >= '0' && ch <= '9') || ch == '.' || ch == '_' || ch == '-';
    name.push_back(keep ? ch : '_');
  }
  // Keeps the name well under NAME_MAX whatever the device name's length.
  if (name.size() > 160) name.resize(160);
  return fmt::format("{}-{:08x}.plans", name, crc32(scope));
}

std::vector<PlanCacheRepair> repair_plan_cache_dir(
    const fs::path& dir, const std::function<bool(std::string_view scope)>& current) {
  std::vector<PlanCacheRepair> repairs;
  std::error_code error;
  if (!fs::is_directory(dir, error)) {
    // Absent is "no cache yet"; anything else (EACCES on a parent, say) must not pass as that.
    if (error && error != std::errc::no_such_file_or_directory) {
      fail(ErrorKind::kIo, "cannot inspect {}: {}", dir.string(), error.message());
    }
    return repairs;
  }
  std::vector<fs::path> files;
  // error_code forms throughout: the range-for's increment would throw filesystem_error, which
  // callers (the daemon's startup check) do not expect from here.
  fs::directory_iterator entries(dir, error);
  for (; !error && entries != fs::directory_iterator(); entries.increment(error)) {
    if (entries->path().extension() == ".plans") files.push_back(entries->path());
  }
  if (error) fail(ErrorKind::kIo, "cannot list {}: {}", dir.string(), error.message());
  std::sort(files.begin(), files.end());
  for (const fs::path& file : files) {
    const FileLock lock(file);
    PlanCacheRepair repair;
    repair.file = file;
    std::string bytes;
    if (!read_if_exists(file, bytes)) continue;  // removed by another process meanwhile
    PlanCacheContent content = parse_plan_cache(file, bytes);
    if (content.header_ok && current && !current(content.scope)) {
      content.header_ok = false;
      content.problems.push_back(
          fmt::format("{}: header: scope \"{}\" is not this build's (another library version; "
                      "stale, rebuilt)",
                      file.string(), content.scope));
    }
    repair.problems = content.problems;
    repair.records_kept = content.records.size();
    if (!content.header_ok) {
      if (!fs::remove(file, error) && error) {
        fail(ErrorKind::kIo, "cannot remove stale plan cache {}: {}", file.string(),
             error.message());
      }
      repair.action = "removed";
      repair.records_kept = 0;
    } else if (!content.problems.empty()) {
      write_file_atomically(file, serialize_plan_cache(content.scope, content.records));
      repair.action = "repaired";
    } else {
      repair.action = "ok";
    }
    repairs.push_back(std::move(repair));
  }
  return repairs;
}

PlanCache::PlanCache(fs::path dir, std::string scope)
    : dir_(std::move(dir)), scope_(std::move(scope)) {
  if (scope_.size() > kPlanCacheMaxKeyBytes) {
    fail(ErrorKind::kInvalidArgument, "plan cache scope of {} bytes; the limit is {} bytes",
         scope_.size(), kPlanCacheMaxKeyBytes);
  }
  file_ = dir_ / plan_cache_file_name(scope_);
  std::string bytes;
  if (!read_if_exists(file_, bytes)) return;
  PlanCacheContent content = parse_plan_cache(file_, bytes);
  problems_ = std::move(content.problems);
  if (content.header_ok && content.scope != scope_) {
    problems_.push_back(fmt::format("{}: header: scope \"{}\", expected \"{}\" (stale, rebuilt)",
                                    file_.string(), content.scope, scope_));
    content.records.clear();
  }
  records_ = std::move(content.records);
  needs_repair_ = !problems_.empty();
}

const std::string* PlanCache::find(const std::string& key) const {
  const auto it = records_.find(key);
  return it == records_.end() ? nullptr : &it->second;
}

void PlanCache::put(const std::string& key, std::string value) {
  // The reader drops a record past these limits, and everything after it: refuse to write one.
  if (key.size() > kPlanCacheMaxKeyBytes || value.size() > kPlanCacheMaxValueBytes) {
    fail(ErrorKind::kInvalidArgument,
         "plan cache {}: record \"{}\" has a {}-byte key and a {}-byte value; the limits are {} "
         "and {} bytes",
         file_.string(), key.substr(0, 80), key.size(), value.size(), kPlanCacheMaxKeyBytes,
         kPlanCacheMaxValueBytes);
  }
  records_[key] = value;
  pending_[key] = std::move(value);
}

void PlanCache::flush() {
  if (pending_.empty() && !needs_repair_) return;
  std::error_code error;
  fs::create_directories(dir_, error);
  if (error)
    fail(ErrorKind::kIo, "cannot create plan cache directory {}: {}", dir_.string(),
         error.message());
  const FileLock lock(file_);
  // Another process may have written since this cache loaded: its records are kept, ours win
  // for keys both hold (ours were built or validated by this process just now).
  std::map<std::string, std::string> merged;
  std::string bytes;
  if (read_if_exists(file_, bytes)) {
    PlanCacheContent content = parse_plan_cache(file_, bytes);
    if (content.header_ok && content.scope == scope_) merged = std::move(content.records);
  }
  for (auto& [key, value] : pending_) merged[key] = value;
  write_file_atomically(file_, serialize_plan_cache(scope_, merged));
  records_ = std::move(merged);
  pending_.clear();
  needs_repair_ = false;
}

}  // namespace megacpp
