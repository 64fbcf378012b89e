#pragma once
// A small SentencePiece model for tests, trained here by the spm_train binary (Debian package
// sentencepiece, which deploy/install-deps.sh installs) on text made up here: no model file is
// kept in the tree.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/temp_dir.h"

namespace megacpp::testing {

// The first `name` on PATH; empty when there is none.
inline std::filesystem::path find_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::filesystem::path candidate = std::filesystem::path(dir) / name;
    if (!dir.empty() && ::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return {};
}

// Lines of words over a few hundred made-up words: enough distinct pieces for a vocabulary of
// several hundred, and text a tiny model learns from.
inline std::string word_text(uint64_t seed, size_t lines) {
  std::mt19937_64 words_rng(7);  // one word list for every seed, so every file shares pieces
  std::vector<std::string> words;
  for (int w = 0; w < 600; ++w) {
    std::string word;
    const auto length = 2 + words_rng() % 7;
    for (uint64_t c = 0; c < length; ++c) word.push_back(static_cast<char>('a' + words_rng() % 26));
    words.push_back(word);
  }
  std::mt19937_64 rng(seed);
  std::string out;
  for (size_t l = 0; l < lines; ++l) {
    const auto count = 4 + rng() % 8;
    for (uint64_t w = 0; w < count; ++w) {
      // Zipf-like: the first words are far more frequent, as in real text.
      const auto index = static_cast<size_t>((rng() % words.size()) * (rng() % 100) / 100);
      out += words[index] + (w + 1 < count ? " " : "\n");
    }
  }
  return out;
}

// Why a test that needs spm_train skips.
inline constexpr const char* kNoSpmTrain =
    "spm_train not found on PATH (Debian package sentencepiece; deploy/install-deps.sh installs "
    "it)";

// Trains DIR/NAME.model with `vocab_size` pieces (eos id 2, the default) and returns its path;
// empty, with a test failure, when spm_train fails. Callers first skip where
// find_program("spm_train") is empty, with kNoSpmTrain.
inline std::filesystem::path train_sentencepiece(const std::filesystem::path& dir,
                                                 const std::string& name, int vocab_size) {
  const std::filesystem::path binary = find_program("spm_train");
  const std::filesystem::path text = dir / (name + ".txt");
  write_text(text, word_text(42, 4000));
  const std::filesystem::path prefix = dir / name, log = dir / (name + ".log");
  const std::string command = fmt::format(
      "'{}' --input='{}' --model_prefix='{}' --vocab_size={} --model_type=unigram "
      "--character_coverage=1.0 --num_threads=1 >'{}' 2>&1",
      binary.string(), text.string(), prefix.string(), vocab_size, log.string());
  const int status = std::system(command.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    ADD_FAILURE() << command << " failed:\n" << read_bytes(log);
    return {};
  }
  return prefix.string() + ".model";
}

}  // namespace megacpp::testing
