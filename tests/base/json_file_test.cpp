#include "base/json_file.h"

#include <gtest/gtest.h>

#include <string>

#include "base/atomic_file.h"
#include "base/error.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

ErrorKind kind_of_loading(const std::filesystem::path& file, std::string* message) {
  try {
    load_json_file(file);
  } catch (const Error& e) {
    *message = e.what();
    return e.kind();
  }
  ADD_FAILURE() << "loaded " << file;
  return ErrorKind::kInternal;
}

TEST(JsonFile, RoundTrips) {
  testing::TempDir dir;
  const nlohmann::json doc = {{"steps", 12}, {"lr", 0.003}, {"name", "tiny"}};
  save_json_atomically(dir / "doc.json", doc);
  EXPECT_EQ(load_json_file(dir / "doc.json"), doc);
}

TEST(JsonFile, MissingFileIsNotFound) {
  testing::TempDir dir;
  std::string message;
  EXPECT_EQ(kind_of_loading(dir / "absent.json", &message), ErrorKind::kNotFound);
  EXPECT_NE(message.find("absent.json"), std::string::npos) << message;
}

TEST(JsonFile, SyntaxErrorNamesTheFileAndByte) {
  testing::TempDir dir;
  write_file_atomically(dir / "bad.json", "{\"steps\": 12,");
  std::string message;
  EXPECT_EQ(kind_of_loading(dir / "bad.json", &message), ErrorKind::kCorruptData);
  EXPECT_NE(message.find("bad.json: invalid JSON at byte"), std::string::npos) << message;
}

// A number no double can hold is an out_of_range exception in nlohmann::json, not a parse_error:
// it must still become the project's error naming the file.
TEST(JsonFile, OverflowingNumberIsCorruptDataNamingTheFile) {
  testing::TempDir dir;
  write_file_atomically(dir / "huge.json", "{\"lr\": 1e400}");
  std::string message;
  EXPECT_EQ(kind_of_loading(dir / "huge.json", &message), ErrorKind::kCorruptData);
  EXPECT_NE(message.find("huge.json"), std::string::npos) << message;
}

}  // namespace
}  // namespace megacpp
