#pragma once
// The log setup every megacpp program (megacpp, megacppd, megacpp-executor) makes first.
#include <string>

namespace megacpp {

// Makes spdlog's default logger write to stderr with `pattern`, at the level that SPDLOG_LEVEL
// names (spdlog's syntax, e.g. "debug"; info when unset). spdlog's own default writes to stdout,
// where `megacpp --json ...` prints its documents and `megacpp submit` the job id that scripts
// capture: a log line there makes the output unparseable. Call once, before anything logs.
void log_to_stderr(const std::string& pattern);

}  // namespace megacpp
