#pragma once
// Whole-file writes that either leave the complete new content on disk or leave the old file
// untouched: a crash or power loss mid-checkpoint must never leave a truncated file under the
// final name. The content goes to a uniquely named temporary file in the target's directory
// (rename is only atomic within one filesystem), which is fsynced, renamed over the target,
// and then the directory is fsynced so the rename itself survives a power loss.
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace megacpp {

// Receives the next chunk of the file's content; may be called any number of times.
using ByteSink = std::function<void(std::string_view chunk)>;

// Writes `bytes` as the new content of `path`. Throws Error(kIo) naming the path and the
// operating system's reason; on failure no temporary file is left behind and an existing file
// at `path` keeps its old content.
void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

// Same guarantees, for content too large to hold in memory at once: `produce` is called once
// and hands the content to the sink chunk by chunk. An exception thrown by `produce` removes
// the temporary file and propagates unchanged.
void write_file_atomically(const std::filesystem::path& path,
                           const std::function<void(const ByteSink& sink)>& produce);

// Renames `from` to `to` (a file, or a directory whole; `to` must not be a non-empty directory)
// and fsyncs the directory, so the rename survives a power loss. Both in one directory. Throws
// Error(kIo) naming both paths and the operating system's reason.
void rename_durably(const std::filesystem::path& from, const std::filesystem::path& to);

// The whole content of `path`. Throws Error(kNotFound) when it does not exist and Error(kIo)
// when it cannot be read, naming the path.
std::string read_file(const std::filesystem::path& path);

}  // namespace megacpp
