#pragma once
// Reader and writer of the Megatron-LM "MMIDIDX" indexed dataset: PREFIX.bin holds
// the token ids back to back, PREFIX.idx the layout, all little-endian:
//
//   offset 0   9 bytes  magic "MMIDIDX\0\0"
//   offset 9   u64      version, always 1
//   offset 17  u8       token dtype code (TokenDtype)
//   offset 18  u64      sequence count S
//   offset 26  u64      document index length D (= documents + 1, it starts with 0)
//   offset 34  i32[S]   tokens per sequence
//              i64[S]   byte offset of each sequence in the .bin
//              i64[D]   document index: document d is sequences [doc[d], doc[d+1])
//              (i8[S]   per-sequence modes, only in Megatron's multimodal datasets)
//
// The files are byte-compatible with what Megatron's IndexedDatasetBuilder and
// tools/preprocess_data.py write, in both directions.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

namespace megacpp::data {

// Megatron's DType codes. Codes 6 (float64) and 7 (float32) exist in the format but
// cannot hold token ids, so they are refused.
enum class TokenDtype : std::uint8_t {
  kUint8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kUint16 = 8,
};

std::size_t token_dtype_size(TokenDtype dtype);
std::string_view token_dtype_name(TokenDtype dtype);

// PREFIX + ".idx" and PREFIX + ".bin" (appended, never replacing an extension).
std::filesystem::path index_file_path(const std::filesystem::path& prefix);
std::filesystem::path data_file_path(const std::filesystem::path& prefix);

// A regular file opened read-only and read with pread. Not a memory mapping: a mapped
// file that another process truncates kills the reader with SIGBUS on its next touch of
// a lost page, and a job's dataset may be rewritten while the job trains. Every read
// checks that the file still has the size and modification time it had when opened, so
// a changed file is an Error naming it instead of a crash or silently different tokens.
class ReadOnlyFile {
 public:
  explicit ReadOnlyFile(const std::filesystem::path& path);
  ~ReadOnlyFile();
  ReadOnlyFile(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile& operator=(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // The size when opened.
  std::uint64_t size() const { return size_; }

  // Copies bytes [offset, offset + count) to out. Error(kCorruptData) naming the file when
  // it changed since it was opened (size, modification time, or a short read), kIo when
  // the system refuses the read, kInvalidArgument for a range beyond the opened size.
  void read(std::uint64_t offset, std::uint64_t count, unsigned char* out) const;
  std::vector<unsigned char> read_all() const;
  // Error(kCorruptData) naming the file when it changed since it was opened.
  void check_unchanged() const;

 private:
  void release() noexcept;

  std::filesystem::path path_;
  int fd_ = -1;
  std::uint64_t size_ = 0;
  std::int64_t mtime_seconds_ = 0;
  std::int64_t mtime_nanoseconds_ = 0;
};

// Half-open range [begin, end).
struct IndexRange {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t size() const { return end - begin; }
};

// Opens PREFIX.idx and PREFIX.bin and validates every field before returning; a
// malformed or mismatched pair throws Error(kCorruptData) naming the file and byte
// offset. The sequences are stored back to back from byte 0 (as every Megatron writer
// does), so the dataset is also one concatenated token stream.
//
// The .idx is read into memory at open; the .bin is read with pread on demand, and a
// .bin that changes under a reader (truncated, rewritten in place) makes the next read
// throw Error(kCorruptData) naming it. A pair replaced by rename keeps serving the files
// that were opened.
class IndexedDataset {
 public:
  explicit IndexedDataset(const std::filesystem::path& prefix);

  const std::filesystem::path& prefix() const { return prefix_; }
  const std::filesystem::path& index_path() const { return index_path_; }
  const std::filesystem::path& data_path() const { return data_.path(); }
  TokenDtype dtype() const { return dtype_; }

  std::uint64_t num_sequences() const { return num_sequences_; }
  std::uint64_t num_documents() const { return document_index_length_ - 1; }
  std::uint64_t total_tokens() const { return total_tokens_; }
  // True when the .idx carries Megatron's multimodal per-sequence modes (ignored here).
  bool has_sequence_modes() const { return has_sequence_modes_; }

  std::uint32_t sequence_length(std::uint64_t sequence_index) const;
  // Position of the sequence's first token in the concatenated stream.
  std::uint64_t sequence_start(std::uint64_t sequence_index) const;
  // The sequences of document `document_index`.
  IndexRange document_sequences(std::uint64_t document_index) const;
  // The tokens of document `document_index` in the concatenated stream.
  IndexRange document_tokens(std::uint64_t document_index) const;

  // Copies tokens [offset, offset + count) of one sequence, widened to int32.
  // Out-of-range requests throw Error(kInvalidArgument).
  void read(std::uint64_t sequence_index, std::uint64_t offset, std::uint64_t count,
            std::int32_t* out) const;
  // Copies tokens [first, first + count) of the concatenated stream.
  void read_stream(std::uint64_t first, std::uint64_t count, std::int32_t* out) const;

 private:
  void validate();
  std::uint64_t sequence_pointer(std::uint64_t sequence_index) const;
  std::uint64_t document_index_entry(std::uint64_t entry) const;

  std::filesystem::path prefix_;
  std::filesystem::path index_path_;
  std::vector<unsigned char> index_;  // the whole .idx
  ReadOnlyFile data_;
  TokenDtype dtype_ = TokenDtype::kUint16;
  std::size_t token_size_ = 2;
  std::uint64_t num_sequences_ = 0;
  std::uint64_t document_index_length_ = 1;
  std::uint64_t total_tokens_ = 0;
  std::uint64_t lengths_offset_ = 0;
  std::uint64_t pointers_offset_ = 0;
  std::uint64_t document_index_offset_ = 0;
  bool has_sequence_modes_ = false;
};

// Writes PREFIX.bin and PREFIX.idx with one sequence per document, the layout
// Megatron's preprocess_data.py produces without sentence splitting. Tokens stream to
// a temporary file beside PREFIX.bin; finalize() fsyncs and renames both files into
// place and fsyncs the directory, so readers never see a half-written pair. A builder
// destroyed before finalize() removes its temporary files.
class IndexedDatasetBuilder {
 public:
  IndexedDatasetBuilder(std::filesystem::path prefix, TokenDtype dtype);
  ~IndexedDatasetBuilder();
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;

  // Appends tokens to the current document; a token that the dtype cannot represent
  // throws Error(kInvalidArgument).
  void add_tokens(std::span<const std::int32_t> tokens);
  // Closes the current document (possibly empty).
  void end_document();
  void add_document(std::span<const std::int32_t> tokens) {
    add_tokens(tokens);
    end_document();
  }

  std::uint64_t num_documents() const { return sequence_lengths_.size(); }
  std::uint64_t num_tokens() const { return tokens_written_; }

  // Tokens added since the last end_document() are an error, not silently dropped.
  void finalize();

 private:
  void flush_buffer();
  void discard() noexcept;

  std::filesystem::path prefix_;
  TokenDtype dtype_;
  std::filesystem::path data_temp_path_;
  int data_fd_ = -1;
  std::vector<unsigned char> buffer_;
  std::vector<std::int32_t> sequence_lengths_;
  std::uint64_t current_length_ = 0;
  std::uint64_t tokens_written_ = 0;
  bool finalized_ = false;
};

}  // namespace megacpp::data
