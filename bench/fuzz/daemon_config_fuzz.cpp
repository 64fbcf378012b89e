// libFuzzer target: a daemon config file (configs/daemon.json) through load_daemon_config, as
// megacppd reads it at startup and `megacpp doctor` reads it on a user's behalf.
#include <cstddef>
#include <cstdint>
#include <filesystem>

#include "bench/fuzz/fuzz_support.h"
#include "service/config/daemon_config.h"

using megacpp::ErrorKind;
namespace fuzz = megacpp::fuzz;

namespace {

void check_path(const std::filesystem::path& path, bool may_be_empty) {
  if (path.empty() && may_be_empty) return;
  if (!path.is_absolute() || path != path.lexically_normal()) {
    fuzz::bug("a parsed path is not absolute and normal: " + path.string());
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const fuzz::ScratchDir dir;
  static const fuzz::ScratchFile file(dir.path() / "daemon.json");
  file.set(data, size);
  fuzz::expect_clean(
      [&] {
        const megacpp::DaemonConfig config = megacpp::load_daemon_config(file.path());
        // The promises of daemon_config.h that the daemon builds on without checking again.
        for (const auto* path : {&config.state_dir, &config.store_path, &config.checkpoint_root}) {
          check_path(*path, false);
        }
        for (const auto& path : config.data_roots) check_path(path, false);
        for (const auto& path : config.cache_dirs) check_path(path, false);
        for (const auto* path : {&config.executor_path, &config.security.token_file,
                                 &config.security.tls_cert_file, &config.security.tls_key_file}) {
          check_path(*path, true);
        }
        if (config.data_roots.empty()) fuzz::bug("no data root");
        if (config.security.tls_cert_file.empty() != config.security.tls_key_file.empty()) {
          fuzz::bug("a TLS certificate without its key, or the reverse");
        }
        if (config.limits.max_spec_bytes > config.limits.max_message_bytes) {
          fuzz::bug("max_spec_bytes exceeds max_message_bytes");
        }
        // Lower bounds the parser states for the limits a running daemon divides or sizes by.
        if (config.limits.max_queued_jobs < 1 ||
            config.limits.max_concurrent_jobs.value_or(1) < 1 ||
            config.limits.max_message_bytes < 1 || config.limits.max_spec_bytes < 1 ||
            config.devices.cpu_slots < 0) {
          fuzz::bug("a limit below the lower bound the parser states");
        }
        (void)config.precondition_config();
      },
      {ErrorKind::kInvalidArgument});
  return 0;
}
