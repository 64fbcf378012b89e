#include "service/logging.h"

#include <spdlog/cfg/env.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

namespace megacpp {

void log_to_stderr(const std::string& pattern) {
  // Colours only where stderr is a terminal; a log file or pipe gets plain text.
  spdlog::set_default_logger(spdlog::stderr_color_mt("megacpp"));
  spdlog::set_pattern(pattern);
  spdlog::cfg::load_env_levels();
}

}  // namespace megacpp
