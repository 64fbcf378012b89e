#include "service/config/daemon_config.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "base/error.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << part << "\" not found in: " << text;
}

const fs::path kBase = "/etc/megacpp";
const std::string kSource = "configs/daemon.json";

DaemonConfig parse(const json& j) {
  return parse_daemon_config(j, kSource, kBase);
}

// The message of the Error(kInvalidArgument) that parsing `j` throws.
std::string refusal(const json& j) {
  try {
    parse(j);
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << j.dump();
  return "";
}

// A minimal valid config with `patch` merged into it (RFC 7386: null deletes).
json with(const json& patch) {
  json j = {{"state_dir", "/srv/megacpp"}};
  j.merge_patch(patch);
  return j;
}

TEST(DaemonConfig, DefaultsFollowStateDir) {
  const DaemonConfig c = parse(with(json::object()));
  EXPECT_EQ(c.source, kSource);
  EXPECT_EQ(c.listen_address, "127.0.0.1:50551");
  EXPECT_EQ(c.http_address, "127.0.0.1:8551");
  EXPECT_EQ(c.state_dir, fs::path("/srv/megacpp"));
  EXPECT_EQ(c.store_path, fs::path("/srv/megacpp/receipts.db"));
  EXPECT_EQ(c.checkpoint_root, fs::path("/srv/megacpp/checkpoints"));
  EXPECT_EQ(c.data_roots, std::vector<fs::path>{"/srv/megacpp/data"});
  EXPECT_EQ(c.cache_dirs, std::vector<fs::path>{"/srv/megacpp/cache"});
  EXPECT_EQ(c.min_free_bytes, 1ull << 30);
  EXPECT_EQ(c.devices.cpu_slots, 1);
  EXPECT_TRUE(c.devices.gpus_auto);
  EXPECT_TRUE(c.devices.gpus.empty());
  EXPECT_EQ(c.limits.max_queued_jobs, 64);
  EXPECT_FALSE(c.limits.max_concurrent_jobs.has_value());
  EXPECT_EQ(c.max_concurrent_jobs_for(0), 1);
  EXPECT_EQ(c.max_concurrent_jobs_for(4), 5);
  EXPECT_EQ(c.limits.max_message_bytes, 4u << 20);
  EXPECT_EQ(c.limits.max_spec_bytes, 256u << 10);
  EXPECT_TRUE(c.security.token_file.empty());
  EXPECT_TRUE(c.security.tls_cert_file.empty());
  EXPECT_TRUE(c.security.tls_key_file.empty());
  EXPECT_FALSE(c.allow_nvls);
  EXPECT_TRUE(c.executor_path.empty());
  EXPECT_EQ(c.executor_path_for("/opt/megacpp/bin/megacppd"),
            fs::path("/opt/megacpp/bin/megacpp-executor"));

  const preconditions::PreconditionConfig p = c.precondition_config();
  EXPECT_EQ(p.state_dir, c.state_dir);
  EXPECT_EQ(p.store_path, c.store_path);
  EXPECT_EQ(p.checkpoint_root, c.checkpoint_root);
  EXPECT_EQ(p.cache_dirs, c.cache_dirs);
  EXPECT_EQ(p.data_roots, c.data_roots);
  EXPECT_EQ(p.min_free_bytes, c.min_free_bytes);
  EXPECT_FALSE(p.allow_nvls);
  EXPECT_TRUE(p.check_cuda);
}

TEST(DaemonConfig, ExplicitValuesAreRead) {
  const DaemonConfig c = parse(json::parse(R"({
    "listen_address": "[::1]:6000", "http_address": "", "state_dir": "/var/lib/m",
    "store_path": "/db/r.db", "checkpoint_root": "/ckpt", "data_roots": ["/d1", "/d2"],
    "cache_dirs": [], "min_free_bytes": 0, "allow_nvls": true, "executor_path": "/bin/exe",
    "devices": {"cpu_slots": 2, "gpus": [0, 2]},
    "limits": {"max_queued_jobs": 5, "max_concurrent_jobs": 3, "max_message_bytes": 1000,
               "max_spec_bytes": 1000},
    "security": {"token_file": "/s/token", "tls_cert_file": "/s/c.pem", "tls_key_file": "/s/k.pem"}
  })"));
  EXPECT_EQ(c.listen_address, "[::1]:6000");
  EXPECT_EQ(c.http_address, "");
  EXPECT_EQ(c.store_path, fs::path("/db/r.db"));
  EXPECT_EQ(c.checkpoint_root, fs::path("/ckpt"));
  EXPECT_EQ(c.data_roots, (std::vector<fs::path>{"/d1", "/d2"}));
  EXPECT_TRUE(c.cache_dirs.empty());
  EXPECT_EQ(c.min_free_bytes, 0u);
  EXPECT_TRUE(c.allow_nvls);
  EXPECT_TRUE(c.precondition_config().allow_nvls);
  EXPECT_EQ(c.executor_path_for("/elsewhere/megacppd"), fs::path("/bin/exe"));
  EXPECT_EQ(c.devices.cpu_slots, 2);
  EXPECT_FALSE(c.devices.gpus_auto);
  EXPECT_EQ(c.devices.gpus, (std::vector<int>{0, 2}));
  EXPECT_EQ(c.limits.max_queued_jobs, 5);
  EXPECT_EQ(c.max_concurrent_jobs_for(8), 3);
  EXPECT_EQ(c.limits.max_message_bytes, 1000u);
  EXPECT_EQ(c.security.token_file, fs::path("/s/token"));
  EXPECT_EQ(c.security.tls_cert_file, fs::path("/s/c.pem"));
  EXPECT_EQ(c.security.tls_key_file, fs::path("/s/k.pem"));

  EXPECT_TRUE(parse(with({{"devices", {{"gpus", "auto"}}}})).devices.gpus_auto);
  const DaemonConfig unix_socket = parse(with({{"listen_address", "unix:/run/megacpp.sock"}}));
  EXPECT_EQ(unix_socket.listen_address, "unix:/run/megacpp.sock");
  EXPECT_EQ(parse(with({{"listen_address", "0.0.0.0:0"}})).listen_address, "0.0.0.0:0");
  // null means "the default", like an absent key.
  EXPECT_EQ(parse(with({{"limits", {{"max_queued_jobs", nullptr}}}})).limits.max_queued_jobs, 64);
}

TEST(DaemonConfig, RelativePathsResolveAgainstTheConfigDirectory) {
  const DaemonConfig c = parse(json::parse(R"({
    "state_dir": "../state", "store_path": "db/./r.db", "data_roots": ["data", "/abs/data"],
    "cache_dirs": ["../state/cache"], "executor_path": "bin/megacpp-executor",
    "security": {"token_file": "secrets/token"}
  })"));
  EXPECT_EQ(c.state_dir, fs::path("/etc/state"));
  EXPECT_EQ(c.store_path, fs::path("/etc/megacpp/db/r.db"));
  EXPECT_EQ(c.checkpoint_root, fs::path("/etc/state/checkpoints"));
  EXPECT_EQ(c.data_roots, (std::vector<fs::path>{"/etc/megacpp/data", "/abs/data"}));
  EXPECT_EQ(c.cache_dirs, std::vector<fs::path>{"/etc/state/cache"});
  EXPECT_EQ(c.executor_path, fs::path("/etc/megacpp/bin/megacpp-executor"));
  EXPECT_EQ(c.security.token_file, fs::path("/etc/megacpp/secrets/token"));
}

TEST(DaemonConfig, LoadResolvesAgainstTheFilesDirectory) {
  testing::TempDir tmp;
  const fs::path file = tmp / "etc" / "daemon.json";
  testing::write_text(file, R"({"state_dir": "state", "data_roots": ["../data"]})");
  const DaemonConfig c = load_daemon_config(file);
  EXPECT_EQ(c.source, file.string());
  EXPECT_EQ(c.state_dir, (tmp.path() / "etc" / "state").lexically_normal());
  EXPECT_EQ(c.data_roots, std::vector<fs::path>{(tmp.path() / "data").lexically_normal()});

  try {
    load_daemon_config(tmp / "missing.json");
    ADD_FAILURE() << "loaded a missing file";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
    EXPECT_TRUE(contains(e.what(), "missing.json"));
  }
  testing::write_text(tmp / "bad.json", R"({"state_dir": "x",})");
  try {
    load_daemon_config(tmp / "bad.json");
    ADD_FAILURE() << "loaded bad JSON";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_TRUE(contains(e.what(), "bad.json: not valid JSON"));
  }
}

TEST(DaemonConfig, TheShippedExampleLoads) {
  const fs::path source_dir = MEGACPP_SOURCE_DIR;
  const DaemonConfig c = load_daemon_config(source_dir / "configs" / "daemon.json");
  const fs::path root = fs::absolute(source_dir).lexically_normal();
  EXPECT_EQ(c.state_dir, root / "state");
  EXPECT_EQ(c.store_path, root / "state" / "receipts.db");
  EXPECT_EQ(c.checkpoint_root, root / "state" / "checkpoints");
  EXPECT_EQ(c.data_roots, std::vector<fs::path>{root / "data"});
  EXPECT_EQ(c.listen_address, "127.0.0.1:50551");
}

TEST(DaemonConfig, QuotesTheSourceFieldValueAndRule) {
  EXPECT_EQ(refusal(with({{"limits", {{"max_queued_jobs", -1}}}})),
            "configs/daemon.json: limits.max_queued_jobs=-1 must be positive");
}

TEST(DaemonConfig, EveryRuleIsEnforced) {
  struct Case {
    json config;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {json::array(), "the daemon config must be a JSON object"},
      {json::object(), "state_dir is required"},
      {with({{"state_dir", ""}}), "state_dir=\"\" must not be empty"},
      {with({{"state_dir", 5}}), "state_dir=5 must be a path string"},
      {with({{"state_dir", "~/megacpp"}}), "not expanded"},
      {with({{"stat_dir", "/x"}}), "unknown key stat_dir"},
      {with({{"limits", {{"max_jobs", 1}}}}), "unknown key limits.max_jobs"},
      {with({{"devices", {{"tpus", 1}}}}), "unknown key devices.tpus"},
      {with({{"security", {{"token", "t"}}}}), "unknown key security.token"},
      {with({{"listen_address", ""}}), "listen_address=\"\" must not be empty"},
      {with({{"listen_address", "localhost"}}), "listen_address=\"localhost\" must be host:port"},
      {with({{"listen_address", ":50551"}}), "must be host:port"},
      {with({{"listen_address", "127.0.0.1:99999"}}), "port number from 0 to 65535"},
      {with({{"listen_address", "127.0.0.1:80x"}}), "port number"},
      {with({{"listen_address", "::1:80"}}), "malformed host"},
      {with({{"listen_address", "unix:"}}), "socket path"},
      {with({{"listen_address", 50551}}), "listen_address=50551 must be a string"},
      {with({{"http_address", "unix:/tmp/s"}}), "http_address=\"unix:/tmp/s\" must be host:port"},
      {with({{"http_address", "127.0.0.1:50551"}}), "two ports"},
      {with({{"data_roots", json::array()}}), "data_roots=[] must list at least one directory"},
      {with({{"data_roots", "/data"}}), "data_roots=\"/data\" must be a list of path strings"},
      {with({{"data_roots", {"/a", "/b/../a"}}}), "data_roots[1]=\"/b/../a\" names /a a second"},
      {with({{"data_roots", {"/a", 3}}}), "data_roots[1]=3 must be a path string"},
      {with({{"cache_dirs", json::array({""})}}), "cache_dirs[0]=\"\" must not be empty"},
      {with({{"min_free_bytes", -1}}), "min_free_bytes=-1 must not be negative"},
      {with({{"min_free_bytes", 1.5}}), "min_free_bytes=1.5 must be an integer"},
      {with({{"min_free_bytes", "1GiB"}}), "min_free_bytes=\"1GiB\" must be an integer"},
      {with({{"allow_nvls", "yes"}}), "allow_nvls=\"yes\" must be true or false"},
      {with({{"executor_path", ""}}), "executor_path=\"\" must not be empty"},
      {with({{"devices", "cpu"}}), "devices must be a JSON object, got \"cpu\""},
      {with({{"devices", {{"cpu_slots", -1}}}}), "devices.cpu_slots=-1 must not be negative"},
      {with({{"devices", {{"cpu_slots", 5000}}}}), "devices.cpu_slots=5000 must be at most 1024"},
      {with({{"devices", {{"gpus", "all"}}}}), "devices.gpus=\"all\" must be \"auto\" or a list"},
      {with({{"devices", {{"gpus", {0, 0}}}}}), "devices.gpus[1]=0 lists GPU 0 a second time"},
      {with({{"devices", {{"gpus", json::array({-1})}}}}),
       "devices.gpus[0]=-1 must not be negative"},
      {with({{"devices", {{"gpus", json::array({0.5})}}}}),
       "devices.gpus[0]=0.5 must be an integer"},
      {with({{"devices", {{"cpu_slots", 0}, {"gpus", json::array()}}}}), "leaves no device"},
      {with({{"limits", {{"max_queued_jobs", 0}}}}), "limits.max_queued_jobs=0 must be positive"},
      {with({{"limits", {{"max_concurrent_jobs", 0}}}}),
       "limits.max_concurrent_jobs=0 must be positive"},
      {with({{"limits", {{"max_message_bytes", 3000000000ll}}}}),
       "limits.max_message_bytes=3000000000 must be at most 2147483647"},
      {with({{"limits", {{"max_message_bytes", 3e9}}}}), "must be an integer"},
      {with({{"limits", {{"max_spec_bytes", 0}}}}), "limits.max_spec_bytes=0 must be positive"},
      {with({{"limits", {{"max_message_bytes", 1000}, {"max_spec_bytes", 1001}}}}),
       "limits.max_spec_bytes=1001 must not exceed limits.max_message_bytes=1000"},
      {with({{"security", {{"tls_cert_file", "/c.pem"}}}}),
       "security.tls_cert_file=\"/c.pem\" needs security.tls_key_file too"},
      {with({{"security", {{"tls_key_file", "/k.pem"}}}}),
       "security.tls_key_file=\"/k.pem\" needs security.tls_cert_file too"},
  };
  for (const Case& c : cases) {
    const std::string message = refusal(c.config);
    EXPECT_TRUE(contains(message, c.expected)) << "config: " << c.config.dump();
    EXPECT_TRUE(contains(message, kSource + ": ")) << message;
  }
}

TEST(DaemonConfig, JobSupervisionAndStreamLimitsHaveDefaultsAndRules) {
  const DaemonConfig d = parse(with(json::object()));
  EXPECT_EQ(d.limits.max_watch_streams, 64);
  EXPECT_EQ(d.limits.job_event_history_bytes, 1u << 20);
  EXPECT_EQ(d.jobs.progress_timeout_seconds, 600);
  EXPECT_EQ(d.jobs.collective_timeout_seconds, 300);
  EXPECT_EQ(d.jobs.cancel_grace_seconds, 30);
  EXPECT_EQ(d.jobs.time_limit_grace_seconds, 300);
  EXPECT_EQ(d.jobs.restart_backoff_seconds, 10);
  EXPECT_EQ(d.jobs.restart_backoff_max_seconds, 300);

  const DaemonConfig c = parse(with(json::parse(R"({
    "limits": {"max_watch_streams": 3, "job_event_history_bytes": 65536},
    "jobs": {"progress_timeout_seconds": 0, "collective_timeout_seconds": 0,
             "cancel_grace_seconds": 2,
             "time_limit_grace_seconds": 5, "restart_backoff_seconds": 1,
             "restart_backoff_max_seconds": 8}
  })")));
  EXPECT_EQ(c.limits.max_watch_streams, 3);
  EXPECT_EQ(c.limits.job_event_history_bytes, 65536u);
  EXPECT_EQ(c.jobs.progress_timeout_seconds, 0);  // the watchdog off
  EXPECT_EQ(c.jobs.collective_timeout_seconds, 0);
  // Unset, it stays below the progress watchdog's.
  EXPECT_EQ(
      parse(with({{"jobs", {{"progress_timeout_seconds", 100}}}})).jobs.collective_timeout_seconds,
      50);
  EXPECT_EQ(
      parse(with({{"jobs", {{"progress_timeout_seconds", 0}}}})).jobs.collective_timeout_seconds,
      300);
  EXPECT_EQ(c.jobs.cancel_grace_seconds, 2);
  EXPECT_EQ(c.jobs.time_limit_grace_seconds, 5);
  EXPECT_EQ(c.jobs.restart_backoff_seconds, 1);
  EXPECT_EQ(c.jobs.restart_backoff_max_seconds, 8);

  const std::vector<std::pair<json, std::string>> cases = {
      {with({{"limits", {{"max_watch_streams", 0}}}}),
       "limits.max_watch_streams=0 must be positive"},
      {with({{"limits", {{"job_event_history_bytes", 100}}}}),
       "limits.job_event_history_bytes=100 must be at least 4096"},
      {with({{"jobs", "fast"}}), "jobs must be a JSON object"},
      {with({{"jobs", {{"watchdog", 1}}}}), "unknown key jobs.watchdog"},
      {with({{"jobs", {{"progress_timeout_seconds", -1}}}}),
       "jobs.progress_timeout_seconds=-1 must not be negative"},
      {with({{"jobs", {{"progress_timeout_seconds", 2.5}}}}),
       "jobs.progress_timeout_seconds=2.5 must be an integer"},
      {with({{"jobs", {{"collective_timeout_seconds", -3}}}}),
       "jobs.collective_timeout_seconds=-3 must not be negative"},
      {with({{"jobs", {{"collective_timeout_seconds", 600}}}}),
       "jobs.collective_timeout_seconds=600 must be below jobs.progress_timeout_seconds=600"},
      {with({{"jobs", {{"cancel_grace_seconds", 0}}}}),
       "jobs.cancel_grace_seconds=0 must be positive"},
      {with({{"jobs", {{"time_limit_grace_seconds", -5}}}}),
       "jobs.time_limit_grace_seconds=-5 must not be negative"},
      {with({{"jobs", {{"restart_backoff_seconds", 10}, {"restart_backoff_max_seconds", 5}}}}),
       "jobs.restart_backoff_max_seconds=5 must not be below jobs.restart_backoff_seconds=10"},
      {with({{"jobs", {{"restart_backoff_max_seconds", 700000}}}}),
       "jobs.restart_backoff_max_seconds=700000 must be at most 604800"},
  };
  for (const auto& [config, expected] : cases) {
    const std::string message = refusal(config);
    EXPECT_TRUE(contains(message, expected)) << "config: " << config.dump();
  }
}

// Caught by bench/fuzz/daemon_config_fuzz from its lower_bounds seed (coverage alone does not
// lead a fuzzer there: 0 took the same branches as 64). In JSON read from text every
// non-negative integer, 0 included, is an unsigned number, and unsigned values skipped the lower
// bound. (A 0 written in C++, as the cases above do, is signed, so they never saw it.)
TEST(DaemonConfig, AZeroReadFromTextMeetsTheLowerBound) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"state_dir": "/s", "limits": {"max_queued_jobs": 0}})",
       "limits.max_queued_jobs=0 must be positive"},
      {R"({"state_dir": "/s", "limits": {"max_concurrent_jobs": 0}})",
       "limits.max_concurrent_jobs=0 must be positive"},
      {R"({"state_dir": "/s", "limits": {"max_spec_bytes": 0}})",
       "limits.max_spec_bytes=0 must be positive"},
      {R"({"state_dir": "/s", "limits": {"job_event_history_bytes": 0}})",
       "limits.job_event_history_bytes=0 must be at least 4096"},
      {R"({"state_dir": "/s", "jobs": {"cancel_grace_seconds": 0}})",
       "jobs.cancel_grace_seconds=0 must be positive"},
  };
  for (const auto& [text, expected] : cases) {
    EXPECT_TRUE(contains(refusal(json::parse(text)), expected)) << "config: " << text;
  }
}

// Found by bench/fuzz/daemon_config_fuzz: a number beyond the double range is nlohmann's
// out_of_range, not a parse_error, and escaped load_daemon_config as a foreign exception.
TEST(DaemonConfig, LoadRefusesANumberBeyondTheDoubleRange) {
  testing::TempDir tmp;
  testing::write_text(tmp / "huge.json", R"({"state_dir": "/s", "min_free_bytes": 3e3333})");
  try {
    load_daemon_config(tmp / "huge.json");
    ADD_FAILURE() << "loaded a number beyond the double range";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_TRUE(contains(e.what(), "huge.json: not valid JSON"));
  }
}

}  // namespace
}  // namespace megacpp
