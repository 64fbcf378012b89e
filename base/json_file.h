#pragma once
// JSON documents on disk: written with the guarantees of write_file_atomically (the old
// content or the complete new one, never a torn file), read with errors that name the file.
#include <filesystem>
#include <nlohmann/json.hpp>

namespace megacpp {

// Pretty-printed (two-space indent) with a trailing newline.
void save_json_atomically(const std::filesystem::path& file, const nlohmann::json& json);
// Error(kNotFound) when missing, Error(kCorruptData) naming the byte offset when not JSON.
nlohmann::json load_json_file(const std::filesystem::path& file);

}  // namespace megacpp
