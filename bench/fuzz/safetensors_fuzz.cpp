// libFuzzer target: a whole safetensors file (8-byte header length, JSON header, tensor bytes)
// through load_safetensors, as a checkpoint load reads it.
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>

#include "bench/fuzz/fuzz_support.h"
#include "runtime/checkpoint/safetensors.h"

using megacpp::ErrorKind;
namespace fuzz = megacpp::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const fuzz::ScratchDir dir;
  static const fuzz::ScratchFile file(dir.path() / "model.safetensors");
  file.set(data, size);
  fuzz::expect_clean(
      [&] {
        std::map<std::string, std::string> metadata;
        const auto tensors = megacpp::load_safetensors(file.path(), &metadata);
        // What a caller relies on once the load succeeded: every tensor holds exactly the
        // values its shape promises, and they came out of this file.
        std::uint64_t total = 0;
        for (const auto& [name, tensor] : tensors) {
          std::uint64_t elements = 1;
          for (const std::int64_t dim : tensor.shape) {
            if (dim < 0) fuzz::bug("tensor " + name + " loaded with a negative dimension");
            elements *= static_cast<std::uint64_t>(dim);
          }
          if (tensor.data.size() != elements) {
            fuzz::bug("tensor " + name + " holds a different number of values than its shape");
          }
          total += elements;
        }
        // Every loadable dtype takes at least 2 bytes per value.
        if (total * 2 > size) fuzz::bug("more values loaded than the file has bytes for");
      },
      {ErrorKind::kCorruptData});
  return 0;
}
