#include "base/json_file.h"

#include "base/atomic_file.h"
#include "base/error.h"

namespace megacpp {

namespace fs = std::filesystem;

void save_json_atomically(const fs::path& file, const nlohmann::json& json) {
  write_file_atomically(file, json.dump(2) + "\n");
}

nlohmann::json load_json_file(const fs::path& file) {
  const std::string text = read_file(file);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail(ErrorKind::kCorruptData, "{}: invalid JSON at byte {}: {}", file.string(), e.byte,
         e.what());
  } catch (const nlohmann::json::exception& e) {
    // Not a syntax error but a value the parser cannot hold (e.g. 1e400 overflows a double).
    fail(ErrorKind::kCorruptData, "{}: invalid JSON: {}", file.string(), e.what());
  }
}

}  // namespace megacpp
