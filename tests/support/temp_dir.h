#pragma once
// A scratch directory removed when the test ends.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>

namespace megacpp::testing {

class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("megacpp-test-" + std::to_string(::getpid()) + "-" + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline void write_text(const std::filesystem::path& file, const std::string& text) {
  std::filesystem::create_directories(file.parent_path());
  std::ofstream(file, std::ios::binary) << text;
}

inline std::string read_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Deterministic pseudo-text: words from a small vocabulary, so a model can learn it.
inline std::string pseudo_text(uint64_t seed, size_t words) {
  static const char* vocab[] = {"int ",
                                "return ",
                                "const ",
                                "x",
                                "y",
                                "(",
                                ")",
                                ";\n",
                                "{\n",
                                "}\n",
                                "template <typename T> ",
                                "std::vector<T> ",
                                "= ",
                                "+ "};
  std::mt19937_64 rng(seed);
  std::string out;
  for (size_t i = 0; i < words; ++i) out += vocab[rng() % (sizeof(vocab) / sizeof(vocab[0]))];
  return out;
}

}  // namespace megacpp::testing
