#include "service/config/daemon_config.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>
#include <set>

#include "base/atomic_file.h"
#include "base/error.h"

namespace megacpp {

namespace fs = std::filesystem;
using nlohmann::json;

int DaemonConfig::max_concurrent_jobs_for(int gpu_count) const {
  return limits.max_concurrent_jobs.value_or(devices.cpu_slots + gpu_count);
}

fs::path DaemonConfig::executor_path_for(const fs::path& daemon_binary) const {
  if (!executor_path.empty()) return executor_path;
  return daemon_binary.parent_path() / "megacpp-executor";
}

preconditions::PreconditionConfig DaemonConfig::precondition_config() const {
  preconditions::PreconditionConfig c;
  c.state_dir = state_dir;
  c.store_path = store_path;
  c.checkpoint_root = checkpoint_root;
  c.cache_dirs = cache_dirs;
  c.data_roots = data_roots;
  c.min_free_bytes = min_free_bytes;
  c.allow_nvls = allow_nvls;
  return c;
}

namespace {

// Reads one JSON object's keys with their full dotted names, so every message says which field
// broke which rule; keys never read are refused at the end.
class Fields {
 public:
  Fields(const json& object, std::string prefix, const std::string& source)
      : object_(object), prefix_(std::move(prefix)), source_(source) {
    if (!object_.is_object()) {
      fail(ErrorKind::kInvalidArgument, "{}: {} must be a JSON object, got {}", source_,
           prefix_.empty() ? std::string("the daemon config")
                           : prefix_.substr(0, prefix_.size() - 1),
           object_.dump());
    }
  }

  // The value of `key`, or nullptr when it is absent or null (both mean "use the default").
  const json* get(const std::string& key) {
    seen_.insert(key);
    auto it = object_.find(key);
    if (it == object_.end() || it->is_null()) return nullptr;
    return &*it;
  }

  std::string field(const std::string& key) const { return prefix_ + key; }

  template <typename... Args>
  [[noreturn]] void refuse(const std::string& key, const json& value,
                           fmt::format_string<Args...> rule, Args&&... args) const {
    fail(ErrorKind::kInvalidArgument, "{}: {}={} {}", source_, field(key), value.dump(),
         fmt::format(rule, std::forward<Args>(args)...));
  }

  void refuse_unknown() const {
    for (const auto& [key, value] : object_.items()) {
      if (!seen_.count(key)) {
        fail(ErrorKind::kInvalidArgument, "{}: unknown key {} (value {}): check its spelling",
             source_, field(key), value.dump());
      }
    }
  }

  void read_string(const std::string& key, std::string& target) {
    if (const json* v = get(key)) {
      if (!v->is_string()) refuse(key, *v, "must be a string");
      target = v->get<std::string>();
    }
  }

  void read_bool(const std::string& key, bool& target) {
    if (const json* v = get(key)) {
      if (!v->is_boolean()) refuse(key, *v, "must be true or false");
      target = v->get<bool>();
    }
  }

  // An integer in [min, max]; JSON floats (1.0, 1e9) are refused rather than truncated.
  int64_t integer(const std::string& key, const json& v, int64_t min, int64_t max) const {
    int64_t i = 0;
    if (v.is_number_unsigned()) {
      // Every non-negative JSON integer, 0 included, is stored unsigned: it still needs the
      // lower bound below (max_queued_jobs=0 was accepted).
      const uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(max)) refuse(key, v, "must be at most {}", max);
      i = static_cast<int64_t>(u);
    } else {
      if (!v.is_number_integer()) refuse(key, v, "must be an integer");
      i = v.get<int64_t>();
    }
    if (i < min) {
      if (min == 1) refuse(key, v, "must be positive");
      if (min == 0) refuse(key, v, "must not be negative");
      refuse(key, v, "must be at least {}", min);
    }
    if (i > max) refuse(key, v, "must be at most {}", max);
    return i;
  }

  void read_int(const std::string& key, int& target, int min, int max) {
    if (const json* v = get(key)) target = static_cast<int>(integer(key, *v, min, max));
  }

  void read_bytes(const std::string& key, uint64_t& target, int64_t min, int64_t max) {
    if (const json* v = get(key)) target = static_cast<uint64_t>(integer(key, *v, min, max));
  }

 private:
  const json& object_;
  std::string prefix_;
  const std::string& source_;
  std::set<std::string> seen_;
};

fs::path resolve(const Fields& fields, const std::string& key, const json& value,
                 const fs::path& base_dir) {
  if (!value.is_string()) fields.refuse(key, value, "must be a path string");
  const std::string text = value.get<std::string>();
  if (text.empty()) fields.refuse(key, value, "must not be empty");
  if (text.front() == '~') {
    fields.refuse(key, value, "starts with ~, which is not expanded: write the full path");
  }
  const fs::path path(text);
  return (path.is_absolute() ? path : base_dir / path).lexically_normal();
}

bool read_path(Fields& fields, const std::string& key, fs::path& target, const fs::path& base_dir) {
  const json* v = fields.get(key);
  if (v == nullptr) return false;
  target = resolve(fields, key, *v, base_dir);
  return true;
}

bool read_path_list(Fields& fields, const std::string& key, std::vector<fs::path>& target,
                    const fs::path& base_dir, bool allow_empty) {
  const json* v = fields.get(key);
  if (v == nullptr) return false;
  if (!v->is_array()) fields.refuse(key, *v, "must be a list of path strings");
  if (v->empty() && !allow_empty) fields.refuse(key, *v, "must list at least one directory");
  target.clear();
  for (size_t i = 0; i < v->size(); ++i) {
    const std::string element = fmt::format("{}[{}]", key, i);
    fs::path path = resolve(fields, element, (*v)[i], base_dir);
    if (std::find(target.begin(), target.end(), path) != target.end()) {
      fields.refuse(element, (*v)[i], "names {} a second time", path.string());
    }
    target.push_back(std::move(path));
  }
  return true;
}

// host:port, [ipv6]:port or unix:/path. Port 0 asks the kernel for a free port (tests).
void check_address(const Fields& fields, const std::string& key, const std::string& address,
                   bool allow_unix) {
  const json value = address;
  if (address.rfind("unix:", 0) == 0) {
    if (!allow_unix) fields.refuse(key, value, "must be host:port (unix sockets are not served)");
    if (address.size() == 5) fields.refuse(key, value, "must name a socket path after unix:");
    return;
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    fields.refuse(key, value, "must be host:port{}", allow_unix ? " or unix:/path" : "");
  }
  const std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  const bool bracketed = host.front() == '[';
  if (bracketed != (host.back() == ']') || (bracketed && host.size() < 3) ||
      (!bracketed && host.find(':') != std::string::npos)) {
    fields.refuse(key, value, "has a malformed host: write an IPv6 address as [addr]:port");
  }
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      std::stoi(port) > 65535) {
    fields.refuse(key, value, "must end in a port number from 0 to 65535");
  }
}

}  // namespace

DaemonConfig parse_daemon_config(const json& j, const std::string& source,
                                 const fs::path& base_dir) {
  const fs::path base = fs::absolute(base_dir).lexically_normal();
  DaemonConfig c;
  c.source = source;
  Fields top(j, "", source);

  top.read_string("listen_address", c.listen_address);
  if (c.listen_address.empty()) {
    top.refuse("listen_address", c.listen_address, "must not be empty: the daemon serves gRPC");
  }
  check_address(top, "listen_address", c.listen_address, /*allow_unix=*/true);
  top.read_string("http_address", c.http_address);
  if (!c.http_address.empty()) {
    check_address(top, "http_address", c.http_address, /*allow_unix=*/false);
    if (c.http_address == c.listen_address && !c.http_address.ends_with(":0")) {
      top.refuse("http_address", c.http_address, "is also listen_address: they need two ports");
    }
  }

  if (!read_path(top, "state_dir", c.state_dir, base)) {
    fail(ErrorKind::kInvalidArgument,
         "{}: state_dir is required: the directory for the store, checkpoints and caches", source);
  }
  if (!read_path(top, "store_path", c.store_path, base)) c.store_path = c.state_dir / "receipts.db";
  if (!read_path(top, "checkpoint_root", c.checkpoint_root, base)) {
    c.checkpoint_root = c.state_dir / "checkpoints";
  }
  if (!read_path_list(top, "data_roots", c.data_roots, base, /*allow_empty=*/false)) {
    c.data_roots = {c.state_dir / "data"};
  }
  if (!read_path_list(top, "cache_dirs", c.cache_dirs, base, /*allow_empty=*/true)) {
    c.cache_dirs = {c.state_dir / "cache"};
  }
  top.read_bytes("min_free_bytes", c.min_free_bytes, 0, INT64_MAX);
  top.read_bool("allow_nvls", c.allow_nvls);
  read_path(top, "executor_path", c.executor_path, base);

  if (const json* v = top.get("devices")) {
    Fields devices(*v, "devices.", source);
    devices.read_int("cpu_slots", c.devices.cpu_slots, 0, 1024);
    if (const json* gpus = devices.get("gpus")) {
      if (gpus->is_string() && gpus->get<std::string>() == "auto") {
        c.devices.gpus_auto = true;
      } else if (gpus->is_array()) {
        c.devices.gpus_auto = false;
        for (size_t i = 0; i < gpus->size(); ++i) {
          const std::string element = fmt::format("gpus[{}]", i);
          const int index = static_cast<int>(devices.integer(element, (*gpus)[i], 0, 1023));
          if (std::find(c.devices.gpus.begin(), c.devices.gpus.end(), index) !=
              c.devices.gpus.end()) {
            devices.refuse(element, (*gpus)[i], "lists GPU {} a second time", index);
          }
          c.devices.gpus.push_back(index);
        }
      } else {
        devices.refuse("gpus", *gpus, "must be \"auto\" or a list of GPU indices");
      }
    }
    devices.refuse_unknown();
    if (c.devices.cpu_slots == 0 && !c.devices.gpus_auto && c.devices.gpus.empty()) {
      devices.refuse("cpu_slots", json(0), "leaves no device at all: devices.gpus is empty too");
    }
  }

  if (const json* v = top.get("limits")) {
    Fields limits(*v, "limits.", source);
    limits.read_int("max_queued_jobs", c.limits.max_queued_jobs, 1, 1'000'000);
    if (const json* m = limits.get("max_concurrent_jobs")) {
      c.limits.max_concurrent_jobs =
          static_cast<int>(limits.integer("max_concurrent_jobs", *m, 1, 1'000'000));
    }
    // gRPC takes the message limit as an int.
    limits.read_bytes("max_message_bytes", c.limits.max_message_bytes, 1, INT_MAX);
    limits.read_bytes("max_spec_bytes", c.limits.max_spec_bytes, 1, INT_MAX);
    limits.read_int("max_watch_streams", c.limits.max_watch_streams, 1, 100'000);
    // Below a few KiB not even one event with its job would fit.
    limits.read_bytes("job_event_history_bytes", c.limits.job_event_history_bytes, 4096,
                      int64_t{1} << 40);
    limits.refuse_unknown();
    if (c.limits.max_spec_bytes > c.limits.max_message_bytes) {
      limits.refuse("max_spec_bytes", json(c.limits.max_spec_bytes),
                    "must not exceed limits.max_message_bytes={}: a spec travels in one message",
                    c.limits.max_message_bytes);
    }
  }

  if (const json* v = top.get("jobs")) {
    Fields jobs(*v, "jobs.", source);
    constexpr int kWeek = 7 * 24 * 3600;
    jobs.read_int("progress_timeout_seconds", c.jobs.progress_timeout_seconds, 0, kWeek);
    jobs.read_int("collective_timeout_seconds", c.jobs.collective_timeout_seconds, 0, kWeek);
    jobs.read_int("cancel_grace_seconds", c.jobs.cancel_grace_seconds, 1, 3600);
    jobs.read_int("time_limit_grace_seconds", c.jobs.time_limit_grace_seconds, 0, kWeek);
    jobs.read_int("restart_backoff_seconds", c.jobs.restart_backoff_seconds, 0, kWeek);
    jobs.read_int("restart_backoff_max_seconds", c.jobs.restart_backoff_max_seconds, 0, kWeek);
    jobs.refuse_unknown();
    if (c.jobs.restart_backoff_max_seconds < c.jobs.restart_backoff_seconds) {
      jobs.refuse("restart_backoff_max_seconds", json(c.jobs.restart_backoff_max_seconds),
                  "must not be below jobs.restart_backoff_seconds={}: it caps the backoff",
                  c.jobs.restart_backoff_seconds);
    }
    if (!v->contains("collective_timeout_seconds") && c.jobs.progress_timeout_seconds > 0) {
      // Unset: below the progress watchdog's, whatever that is.
      c.jobs.collective_timeout_seconds =
          std::min(c.jobs.collective_timeout_seconds, c.jobs.progress_timeout_seconds / 2);
      // (A progress timeout of 1 s leaves no whole second below it: the collective watchdog is
      // then off, and the progress watchdog alone ends a hung rank.)
    }
    if (c.jobs.collective_timeout_seconds > 0 && c.jobs.progress_timeout_seconds > 0 &&
        c.jobs.collective_timeout_seconds >= c.jobs.progress_timeout_seconds) {
      jobs.refuse("collective_timeout_seconds", json(c.jobs.collective_timeout_seconds),
                  "must be below jobs.progress_timeout_seconds={} (or either 0): the rank waiting "
                  "for a hung one must report it before the progress watchdog stops the job",
                  c.jobs.progress_timeout_seconds);
    }
  }

  if (const json* v = top.get("security")) {
    Fields security(*v, "security.", source);
    read_path(security, "token_file", c.security.token_file, base);
    const bool cert = read_path(security, "tls_cert_file", c.security.tls_cert_file, base);
    const bool key = read_path(security, "tls_key_file", c.security.tls_key_file, base);
    security.read_bool("public_metrics", c.security.public_metrics);
    security.refuse_unknown();
    if (cert != key) {
      const std::string given = cert ? "tls_cert_file" : "tls_key_file";
      const std::string missing = cert ? "tls_key_file" : "tls_cert_file";
      security.refuse(given,
                      json((cert ? c.security.tls_cert_file : c.security.tls_key_file).string()),
                      "needs security.{} too: TLS takes both files or neither", missing);
    }
  }

  if (const json* v = top.get("http")) {
    Fields http(*v, "http.", source);
    http.read_int("workers", c.http.workers, 1, 4096);
    http.read_int("idle_timeout_seconds", c.http.idle_timeout_seconds, 1, 3600);
    http.read_int("io_timeout_seconds", c.http.io_timeout_seconds, 1, 3600);
    http.refuse_unknown();
  }

  top.refuse_unknown();
  return c;
}

DaemonConfig load_daemon_config(const fs::path& path) {
  const std::string text = read_file(path);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    // Not only parse_error: a number beyond the double range (1e400) is out_of_range.
    fail(ErrorKind::kInvalidArgument, "{}: not valid JSON: {}", path.string(), e.what());
  }
  return parse_daemon_config(j, path.string(), fs::absolute(path).parent_path());
}

}  // namespace megacpp
