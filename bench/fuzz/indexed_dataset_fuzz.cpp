// libFuzzer target: a Megatron MMIDIDX pair (PREFIX.idx and PREFIX.bin) through IndexedDataset,
// then every accessor a training run uses, over the ranges the dataset itself reports.
//
// Input layout: a 4-byte little-endian length n, then n bytes of PREFIX.bin (n is clamped to
// what follows), then the rest as PREFIX.idx. The .bin's size matters to validation (the
// sequence pointers must tile it) and its bytes to reading (int64 tokens outside int32).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bench/fuzz/fuzz_support.h"
#include "runtime/data/indexed_dataset.h"

using megacpp::ErrorKind;
namespace fuzz = megacpp::fuzz;
namespace data = megacpp::data;

namespace {

// Bounds the accessor checks so one input stays fast whatever counts the header claims.
constexpr std::uint64_t kMaxChecked = 256;

void check_accessors(const data::IndexedDataset& dataset) {
  const std::uint64_t sequences = dataset.num_sequences();
  const std::uint64_t tokens = dataset.total_tokens();
  std::vector<std::int32_t> buffer;
  std::uint64_t stream = 0;
  for (std::uint64_t i = 0; i < std::min(sequences, kMaxChecked); ++i) {
    const std::uint32_t length = dataset.sequence_length(i);
    if (dataset.sequence_start(i) != stream) fuzz::bug("sequences are not back to back");
    stream += length;
    if (stream > tokens) fuzz::bug("sequence lengths add up to more than total_tokens");
    buffer.resize(length);
    // int64 tokens outside the int32 range are refused when read, not at open.
    fuzz::expect_clean([&] { dataset.read(i, 0, length, buffer.data()); },
                       {ErrorKind::kCorruptData});
  }
  if (sequences <= kMaxChecked && stream != tokens) {
    fuzz::bug("sequence lengths do not add up to total_tokens");
  }
  std::uint64_t previous_end = 0;
  for (std::uint64_t d = 0; d < std::min(dataset.num_documents(), kMaxChecked); ++d) {
    const data::IndexRange seqs = dataset.document_sequences(d);
    const data::IndexRange toks = dataset.document_tokens(d);
    if (seqs.begin > seqs.end || seqs.end > sequences) fuzz::bug("document sequence range");
    if (toks.begin > toks.end || toks.end > tokens || toks.begin != previous_end) {
      fuzz::bug("document token range");
    }
    previous_end = toks.end;
  }
  buffer.resize(std::min<std::uint64_t>(tokens, 1u << 16));
  fuzz::expect_clean([&] { dataset.read_stream(0, buffer.size(), buffer.data()); },
                     {ErrorKind::kCorruptData});
  // Out of range must be refused, not read.
  fuzz::expect_clean([&] { dataset.read_stream(tokens, 1, buffer.data()); },
                     {ErrorKind::kInvalidArgument});
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const fuzz::ScratchDir dir;
  static const fuzz::ScratchFile index(data::index_file_path(dir.path() / "corpus"));
  static const fuzz::ScratchFile bin(data::data_file_path(dir.path() / "corpus"));
  if (size < 4) return -1;
  std::uint32_t bin_size = 0;
  std::memcpy(&bin_size, data, 4);
  const std::size_t bin_bytes = std::min<std::size_t>(bin_size, size - 4);
  bin.set(data + 4, bin_bytes);
  index.set(data + 4 + bin_bytes, size - 4 - bin_bytes);
  fuzz::expect_clean(
      [&] {
        const data::IndexedDataset dataset(dir.path() / "corpus");
        check_accessors(dataset);
      },
      {ErrorKind::kCorruptData});
  return 0;
}
