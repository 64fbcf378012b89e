// megacpp-sentencepiece MODEL: encodes texts with a SentencePiece model for `megacpp data
// prepare` (runtime/data/sentencepiece_tokenizer.h says why in a process of its own). It links
// libsentencepiece and nothing that brings libprotobuf.
//
// On stdin and stdout, little-endian: first one line of JSON, {"vocab_size": N, "eos_id": E} or
// {"error": MESSAGE} (then it exits 2); then for each request, a u64 byte count and the text,
// answered by a u64 id count and the ids as i32. It exits 0 at the end of its input.
#include <sentencepiece_processor.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace {

// false at the end of the input (before any byte) or on an error.
bool read_exactly(void* out, size_t size) {
  auto* bytes = static_cast<char*>(out);
  while (size > 0) {
    const ssize_t got = ::read(0, bytes, size);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    bytes += got;
    size -= static_cast<size_t>(got);
  }
  return true;
}

bool write_exactly(const void* data, size_t size) {
  const auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t put = ::write(1, bytes, size);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    bytes += put;
    size -= static_cast<size_t>(put);
  }
  return true;
}

bool write_line(const nlohmann::json& j) {
  const std::string line = j.dump() + "\n";
  return write_exactly(line.data(), line.size());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: megacpp-sentencepiece MODEL (started by megacpp data prepare)\n");
    return 2;
  }
  sentencepiece::SentencePieceProcessor processor;
  if (const auto status = processor.Load(argv[1]); !status.ok()) {
    write_line({{"error", status.ToString()}});
    return 2;
  }
  if (!write_line({{"vocab_size", processor.GetPieceSize()}, {"eos_id", processor.eos_id()}})) {
    return 1;
  }
  std::string text;
  std::vector<int> ids;
  for (uint64_t size = 0; read_exactly(&size, sizeof size);) {
    text.resize(size);
    if (!read_exactly(text.data(), size)) return 1;
    if (const auto status = processor.Encode(text, &ids); !status.ok()) {
      std::fprintf(stderr, "megacpp-sentencepiece: %s\n", status.ToString().c_str());
      return 1;
    }
    const uint64_t count = ids.size();
    std::vector<int32_t> out(ids.begin(), ids.end());
    if (!write_exactly(&count, sizeof count) ||
        !write_exactly(out.data(), out.size() * sizeof(int32_t))) {
      return 1;
    }
  }
  return 0;
}
