#include "runtime/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <string>
#include <utility>

#include "base/error.h"

namespace megacpp::data {
namespace {

static_assert(std::endian::native == std::endian::little,
              "the MMIDIDX format is little-endian; a big-endian host needs byte swapping");

constexpr std::array<unsigned char, 9> kMagic = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
constexpr std::uint64_t kVersion = 1;
constexpr std::uint64_t kVersionOffset = 9;
constexpr std::uint64_t kDtypeOffset = 17;
constexpr std::uint64_t kSequenceCountOffset = 18;
constexpr std::uint64_t kDocumentCountOffset = 26;
constexpr std::uint64_t kHeaderSize = 34;
constexpr std::size_t kWriteBufferBytes = std::size_t{1} << 20;
constexpr std::size_t kReadChunkBytes = std::size_t{1} << 14;

// The .idx arrays start at offset 34, so they are not naturally aligned.
template <typename T>
T load(const unsigned char* bytes) {
  T value;
  std::memcpy(&value, bytes, sizeof(T));
  return value;
}

template <typename T>
void append_le(std::vector<unsigned char>& out, T value) {
  unsigned char bytes[sizeof(T)];
  std::memcpy(bytes, &value, sizeof(T));
  out.insert(out.end(), bytes, bytes + sizeof(T));
}

std::string errno_text(int error_number) {
  return std::strerror(error_number);
}

bool is_token_dtype_code(unsigned code) {
  switch (code) {
    case 1:
    case 2:
    case 3:
    case 4:
    case 5:
    case 8:
      return true;
    default:
      return false;
  }
}

[[noreturn]] void fail_truncated(const std::filesystem::path& file, std::uint64_t offset,
                                 std::uint64_t needed, std::string_view what,
                                 std::uint64_t file_size) {
  fail(ErrorKind::kCorruptData,
       "{}: truncated at offset {}: expected {}-byte {}, file has {} bytes", file.string(), offset,
       needed, what, file_size);
}

// Ensures [offset, offset + count * element_size) lies within the file.
void require_array(const std::filesystem::path& file, std::uint64_t file_size, std::uint64_t offset,
                   std::uint64_t count, std::uint64_t element_size, std::string_view what) {
  std::uint64_t bytes = 0;
  std::uint64_t end = 0;
  if (__builtin_mul_overflow(count, element_size, &bytes) ||
      __builtin_add_overflow(offset, bytes, &end)) {
    fail(ErrorKind::kCorruptData,
         "{}: truncated at offset {}: expected {} ({} entries of {} bytes, more than 2^64 "
         "bytes), file has {} bytes",
         file.string(), offset, what, count, element_size, file_size);
  }
  if (end > file_size) {
    fail(ErrorKind::kCorruptData,
         "{}: truncated at offset {}: expected {}-byte {} ({} entries), file has {} bytes",
         file.string(), offset, bytes, what, count, file_size);
  }
}

// Writes all bytes, retrying short writes and EINTR.
void write_all(int fd, const unsigned char* bytes, std::size_t count,
               const std::filesystem::path& path) {
  while (count > 0) {
    const ssize_t written = ::write(fd, bytes, count);
    if (written < 0) {
      if (errno == EINTR) continue;
      fail(ErrorKind::kIo, "{}: write failed: {}", path.string(), errno_text(errno));
    }
    bytes += written;
    count -= static_cast<std::size_t>(written);
  }
}

// A uniquely named temporary file beside `final_path`, opened for writing.
int create_temp_beside(const std::filesystem::path& final_path, std::filesystem::path* temp_path) {
  const std::filesystem::path directory =
      final_path.has_parent_path() ? final_path.parent_path() : std::filesystem::path(".");
  std::string temp_name = ".";
  temp_name += final_path.filename().string();
  temp_name += ".tmp.XXXXXX";
  std::string pattern = (directory / temp_name).string();
  const int fd = ::mkstemp(pattern.data());
  if (fd < 0) {
    fail(ErrorKind::kIo, "{}: cannot create a temporary file in {}: {}", final_path.string(),
         directory.string(), errno_text(errno));
  }
  // mkstemp creates 0600; published datasets should be readable like any other output.
  ::fchmod(fd, 0644);
  *temp_path = pattern;
  return fd;
}

void sync_and_close(int fd, const std::filesystem::path& path) {
  if (::fsync(fd) != 0) {
    const int error_number = errno;
    ::close(fd);
    fail(ErrorKind::kIo, "{}: fsync failed: {}", path.string(), errno_text(error_number));
  }
  if (::close(fd) != 0) {
    fail(ErrorKind::kIo, "{}: close failed: {}", path.string(), errno_text(errno));
  }
}

void sync_directory(const std::filesystem::path& directory) {
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    fail(ErrorKind::kIo, "{}: cannot open directory to fsync: {}", directory.string(),
         errno_text(errno));
  }
  const int result = ::fsync(fd);
  const int error_number = errno;
  ::close(fd);
  if (result != 0) {
    fail(ErrorKind::kIo, "{}: directory fsync failed: {}", directory.string(),
         errno_text(error_number));
  }
}

template <typename Stored>
void widen_tokens(const unsigned char* bytes, std::uint64_t count, std::int32_t* out,
                  const std::filesystem::path& data_path, std::uint64_t byte_offset) {
  for (std::uint64_t i = 0; i < count; ++i) {
    const Stored value = load<Stored>(bytes + i * sizeof(Stored));
    if constexpr (sizeof(Stored) > sizeof(std::int32_t)) {
      if (value < std::numeric_limits<std::int32_t>::min() ||
          value > std::numeric_limits<std::int32_t>::max()) {
        fail(ErrorKind::kCorruptData, "{}: token at byte offset {} is {}, outside the int32 range",
             data_path.string(), byte_offset + i * sizeof(Stored), value);
      }
    }
    out[i] = static_cast<std::int32_t>(value);
  }
}

template <typename Stored>
void narrow_tokens(std::span<const std::int32_t> tokens, std::vector<unsigned char>& out,
                   const std::filesystem::path& prefix, TokenDtype dtype, std::uint64_t document,
                   std::uint64_t position) {
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    const std::int32_t value = tokens[i];
    if constexpr (sizeof(Stored) < sizeof(std::int32_t)) {
      if (value < std::numeric_limits<Stored>::min() ||
          value > std::numeric_limits<Stored>::max()) {
        fail(ErrorKind::kInvalidArgument,
             "{}: token {} of document {} is {}, which dtype {} cannot represent [{}, {}]",
             prefix.string(), position + i, document, value, token_dtype_name(dtype),
             static_cast<std::int64_t>(std::numeric_limits<Stored>::min()),
             static_cast<std::int64_t>(std::numeric_limits<Stored>::max()));
      }
    }
    append_le<Stored>(out, static_cast<Stored>(value));
  }
}

}  // namespace

std::size_t token_dtype_size(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::kUint8:
    case TokenDtype::kInt8:
      return 1;
    case TokenDtype::kInt16:
    case TokenDtype::kUint16:
      return 2;
    case TokenDtype::kInt32:
      return 4;
    case TokenDtype::kInt64:
      return 8;
  }
  fail(ErrorKind::kInvalidArgument, "token dtype code {} is not an integer token type",
       static_cast<unsigned>(dtype));
}

std::string_view token_dtype_name(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::kUint8:
      return "uint8";
    case TokenDtype::kInt8:
      return "int8";
    case TokenDtype::kInt16:
      return "int16";
    case TokenDtype::kInt32:
      return "int32";
    case TokenDtype::kInt64:
      return "int64";
    case TokenDtype::kUint16:
      return "uint16";
  }
  return "unknown";
}

std::filesystem::path index_file_path(const std::filesystem::path& prefix) {
  return std::filesystem::path(prefix.string() + ".idx");
}

std::filesystem::path data_file_path(const std::filesystem::path& prefix) {
  return std::filesystem::path(prefix.string() + ".bin");
}

// ---------------------------------------------------------------------------
// ReadOnlyFile

ReadOnlyFile::ReadOnlyFile(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) {
    const int error_number = errno;
    fail(error_number == ENOENT ? ErrorKind::kNotFound : ErrorKind::kIo, "{}: cannot open: {}",
         path.string(), errno_text(error_number));
  }
  struct stat info {};
  if (::fstat(fd_, &info) != 0) {
    const int error_number = errno;
    release();
    fail(ErrorKind::kIo, "{}: cannot stat: {}", path.string(), errno_text(error_number));
  }
  if (!S_ISREG(info.st_mode)) {
    release();
    fail(ErrorKind::kInvalidArgument, "{}: not a regular file", path.string());
  }
  size_ = static_cast<std::uint64_t>(info.st_size);
  mtime_seconds_ = static_cast<std::int64_t>(info.st_mtim.tv_sec);
  mtime_nanoseconds_ = static_cast<std::int64_t>(info.st_mtim.tv_nsec);
}

ReadOnlyFile::~ReadOnlyFile() {
  release();
}

ReadOnlyFile::ReadOnlyFile(ReadOnlyFile&& other) noexcept
    : path_(std::move(other.path_)),
      fd_(std::exchange(other.fd_, -1)),
      size_(std::exchange(other.size_, 0)),
      mtime_seconds_(other.mtime_seconds_),
      mtime_nanoseconds_(other.mtime_nanoseconds_) {}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = std::exchange(other.size_, 0);
    mtime_seconds_ = other.mtime_seconds_;
    mtime_nanoseconds_ = other.mtime_nanoseconds_;
  }
  return *this;
}

void ReadOnlyFile::release() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

void ReadOnlyFile::check_unchanged() const {
  struct stat info {};
  if (::fstat(fd_, &info) != 0) {
    fail(ErrorKind::kIo, "{}: cannot stat: {}", path_.string(), errno_text(errno));
  }
  const auto size = static_cast<std::uint64_t>(info.st_size);
  const auto seconds = static_cast<std::int64_t>(info.st_mtim.tv_sec);
  const auto nanoseconds = static_cast<std::int64_t>(info.st_mtim.tv_nsec);
  if (size != size_ || seconds != mtime_seconds_ || nanoseconds != mtime_nanoseconds_) {
    fail(ErrorKind::kCorruptData,
         "{}: changed while in use: opened with {} bytes modified at {}.{:09d}, now {} bytes "
         "modified at {}.{:09d}; a dataset must not be rewritten while a job reads it",
         path_.string(), size_, mtime_seconds_, mtime_nanoseconds_, size, seconds, nanoseconds);
  }
}

void ReadOnlyFile::read(std::uint64_t offset, std::uint64_t count, unsigned char* out) const {
  if (offset > size_ || count > size_ - offset) {
    fail(ErrorKind::kInvalidArgument, "{}: read of {} bytes at offset {} exceeds its {} bytes",
         path_.string(), count, offset, size_);
  }
  std::uint64_t done = 0;
  while (done < count) {
    const std::size_t want =
        static_cast<std::size_t>(std::min<std::uint64_t>(count - done, std::uint64_t{1} << 30));
    const ssize_t got = ::pread(fd_, out + done, want, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      fail(ErrorKind::kIo, "{}: read of {} bytes at offset {} failed: {}", path_.string(), want,
           offset + done, errno_text(errno));
    }
    if (got == 0) {
      // End of file before the size seen at open: the file was truncated.
      check_unchanged();
      fail(ErrorKind::kCorruptData,
           "{}: changed while in use: ends at offset {}, but had {} bytes when opened",
           path_.string(), offset + done, size_);
    }
    done += static_cast<std::uint64_t>(got);
  }
  // After the read, so that bytes rewritten in place during it are not trusted either.
  check_unchanged();
}

std::vector<unsigned char> ReadOnlyFile::read_all() const {
  std::vector<unsigned char> bytes(static_cast<std::size_t>(size_));
  read(0, size_, bytes.data());
  return bytes;
}

// ---------------------------------------------------------------------------
// IndexedDataset

IndexedDataset::IndexedDataset(const std::filesystem::path& prefix)
    : prefix_(prefix),
      index_path_(index_file_path(prefix)),
      index_(ReadOnlyFile(index_path_).read_all()),
      data_(data_file_path(prefix)) {
  validate();
}

void IndexedDataset::validate() {
  const std::filesystem::path& file = index_path_;
  const std::uint64_t size = index_.size();
  const unsigned char* bytes = index_.data();

  if (size < kMagic.size()) fail_truncated(file, 0, kMagic.size(), "magic \"MMIDIDX\\0\\0\"", size);
  if (std::memcmp(bytes, kMagic.data(), kMagic.size()) != 0) {
    fail(ErrorKind::kCorruptData,
         "{}: bad magic at offset 0: expected \"MMIDIDX\\0\\0\" (a Megatron mmap indexed dataset)",
         file.string());
  }
  if (size < kDtypeOffset) fail_truncated(file, kVersionOffset, 8, "version", size);
  const auto version = load<std::uint64_t>(bytes + kVersionOffset);
  if (version != kVersion) {
    fail(ErrorKind::kCorruptData, "{}: bad version at offset {}: {} (only version {} exists)",
         file.string(), kVersionOffset, version, kVersion);
  }
  if (size < kSequenceCountOffset) fail_truncated(file, kDtypeOffset, 1, "dtype code", size);
  const unsigned dtype_code = bytes[kDtypeOffset];
  if (!is_token_dtype_code(dtype_code)) {
    fail(ErrorKind::kCorruptData,
         "{}: bad dtype code at offset {}: {} (token dtypes are 1 uint8, 2 int8, 3 int16, "
         "4 int32, 5 int64, 8 uint16)",
         file.string(), kDtypeOffset, dtype_code);
  }
  dtype_ = static_cast<TokenDtype>(dtype_code);
  token_size_ = token_dtype_size(dtype_);
  if (size < kDocumentCountOffset) {
    fail_truncated(file, kSequenceCountOffset, 8, "sequence count", size);
  }
  num_sequences_ = load<std::uint64_t>(bytes + kSequenceCountOffset);
  if (size < kHeaderSize) fail_truncated(file, kDocumentCountOffset, 8, "document count", size);
  document_index_length_ = load<std::uint64_t>(bytes + kDocumentCountOffset);
  if (document_index_length_ == 0) {
    fail(ErrorKind::kCorruptData,
         "{}: document count at offset {} is 0; the document index always holds a leading 0",
         file.string(), kDocumentCountOffset);
  }

  lengths_offset_ = kHeaderSize;
  require_array(file, size, lengths_offset_, num_sequences_, 4, "sequence length array");
  pointers_offset_ = lengths_offset_ + 4 * num_sequences_;
  require_array(file, size, pointers_offset_, num_sequences_, 8, "sequence pointer array");
  document_index_offset_ = pointers_offset_ + 8 * num_sequences_;
  require_array(file, size, document_index_offset_, document_index_length_, 8, "document index");
  const std::uint64_t arrays_end = document_index_offset_ + 8 * document_index_length_;
  const std::uint64_t trailing = size - arrays_end;
  if (trailing == num_sequences_ && trailing > 0) {
    has_sequence_modes_ = true;
  } else if (trailing != 0) {
    fail(ErrorKind::kCorruptData,
         "{}: {} unexpected bytes at offset {} after the document index (a multimodal index "
         "would have exactly {} bytes of modes there)",
         file.string(), trailing, arrays_end, num_sequences_);
  }

  // Every Megatron writer stores sequences back to back from byte 0; requiring that
  // makes the .bin exactly the concatenated token stream.
  const std::filesystem::path& data_file = data_.path();
  std::uint64_t expected_pointer = 0;
  for (std::uint64_t i = 0; i < num_sequences_; ++i) {
    const std::uint64_t length_offset = lengths_offset_ + 4 * i;
    const auto length = load<std::int32_t>(bytes + length_offset);
    if (length < 0) {
      fail(ErrorKind::kCorruptData, "{}: length of sequence {} at offset {} is negative ({})",
           file.string(), i, length_offset, length);
    }
    const std::uint64_t pointer_offset = pointers_offset_ + 8 * i;
    const auto pointer = load<std::int64_t>(bytes + pointer_offset);
    if (pointer < 0 || static_cast<std::uint64_t>(pointer) != expected_pointer) {
      fail(ErrorKind::kCorruptData,
           "{}: pointer of sequence {} at offset {} is {}, expected {} (sequences are stored "
           "back to back: previous pointer + previous length x {} bytes)",
           file.string(), i, pointer_offset, pointer, expected_pointer, token_size_);
    }
    const std::uint64_t end = expected_pointer + static_cast<std::uint64_t>(length) * token_size_;
    if (end > data_.size()) {
      fail(ErrorKind::kCorruptData,
           "{}: truncated at offset {}: sequence {} (length at {} offset {}) needs bytes [{}, {}), "
           "file has {} bytes",
           data_file.string(), data_.size(), i, file.string(), length_offset, expected_pointer, end,
           data_.size());
    }
    expected_pointer = end;
  }
  if (expected_pointer != data_.size()) {
    fail(ErrorKind::kCorruptData,
         "{}: has {} bytes but {} describes {} bytes ({} {} tokens); the .bin and .idx do not "
         "belong together",
         data_file.string(), data_.size(), file.string(), expected_pointer,
         expected_pointer / token_size_, token_dtype_name(dtype_));
  }
  total_tokens_ = expected_pointer / token_size_;

  std::uint64_t previous = 0;
  for (std::uint64_t i = 0; i < document_index_length_; ++i) {
    const std::uint64_t entry_offset = document_index_offset_ + 8 * i;
    const auto entry = load<std::int64_t>(bytes + entry_offset);
    if (i == 0 && entry != 0) {
      fail(ErrorKind::kCorruptData, "{}: document index entry 0 at offset {} is {}, expected 0",
           file.string(), entry_offset, entry);
    }
    if (entry < 0 || static_cast<std::uint64_t>(entry) < previous ||
        static_cast<std::uint64_t>(entry) > num_sequences_) {
      fail(ErrorKind::kCorruptData,
           "{}: document index entry {} at offset {} is {}; entries must be non-decreasing "
           "within [{}, {}]",
           file.string(), i, entry_offset, entry, previous, num_sequences_);
    }
    previous = static_cast<std::uint64_t>(entry);
  }
  if (previous != num_sequences_) {
    fail(ErrorKind::kCorruptData,
         "{}: last document index entry at offset {} is {}, but there are {} sequences (every "
         "sequence must belong to a document)",
         file.string(), document_index_offset_ + 8 * (document_index_length_ - 1), previous,
         num_sequences_);
  }
}

std::uint64_t IndexedDataset::sequence_pointer(std::uint64_t sequence_index) const {
  return static_cast<std::uint64_t>(
      load<std::int64_t>(index_.data() + pointers_offset_ + 8 * sequence_index));
}

std::uint64_t IndexedDataset::document_index_entry(std::uint64_t entry) const {
  return static_cast<std::uint64_t>(
      load<std::int64_t>(index_.data() + document_index_offset_ + 8 * entry));
}

std::uint32_t IndexedDataset::sequence_length(std::uint64_t sequence_index) const {
  if (sequence_index >= num_sequences_) {
    fail(ErrorKind::kInvalidArgument, "{}: sequence index {} out of range: {} sequences",
         index_path_.string(), sequence_index, num_sequences_);
  }
  return static_cast<std::uint32_t>(
      load<std::int32_t>(index_.data() + lengths_offset_ + 4 * sequence_index));
}

std::uint64_t IndexedDataset::sequence_start(std::uint64_t sequence_index) const {
  if (sequence_index >= num_sequences_) {
    fail(ErrorKind::kInvalidArgument, "{}: sequence index {} out of range: {} sequences",
         index_path_.string(), sequence_index, num_sequences_);
  }
  return sequence_pointer(sequence_index) / token_size_;
}

IndexRange IndexedDataset::document_sequences(std::uint64_t document_index) const {
  if (document_index >= num_documents()) {
    fail(ErrorKind::kInvalidArgument, "{}: document {} out of range: {} documents",
         index_path_.string(), document_index, num_documents());
  }
  return {document_index_entry(document_index), document_index_entry(document_index + 1)};
}

IndexRange IndexedDataset::document_tokens(std::uint64_t document_index) const {
  const IndexRange sequences = document_sequences(document_index);
  const auto stream_offset = [&](std::uint64_t sequence) {
    return sequence == num_sequences_ ? total_tokens_ : sequence_pointer(sequence) / token_size_;
  };
  return {stream_offset(sequences.begin), stream_offset(sequences.end)};
}

void IndexedDataset::read(std::uint64_t sequence_index, std::uint64_t offset, std::uint64_t count,
                          std::int32_t* out) const {
  const std::uint64_t length = sequence_length(sequence_index);
  if (offset > length || count > length - offset) {
    fail(ErrorKind::kInvalidArgument,
         "{}: read of {} tokens at offset {} exceeds sequence {} of length {}",
         index_path_.string(), count, offset, sequence_index, length);
  }
  read_stream(sequence_pointer(sequence_index) / token_size_ + offset, count, out);
}

void IndexedDataset::read_stream(std::uint64_t first, std::uint64_t count,
                                 std::int32_t* out) const {
  if (first > total_tokens_ || count > total_tokens_ - first) {
    fail(ErrorKind::kInvalidArgument,
         "{}: read of {} tokens at stream position {} exceeds {} tokens", data_.path().string(),
         count, first, total_tokens_);
  }
  const std::filesystem::path& file = data_.path();
  // Bounded chunks: a read of the whole stream (statistics, preparation checks) needs
  // no buffer the size of the dataset.
  std::array<unsigned char, kReadChunkBytes> buffer;
  const std::uint64_t chunk_tokens = kReadChunkBytes / token_size_;
  std::uint64_t done = 0;
  while (done < count) {
    const std::uint64_t tokens = std::min(chunk_tokens, count - done);
    const std::uint64_t byte_offset = (first + done) * token_size_;
    data_.read(byte_offset, tokens * token_size_, buffer.data());
    std::int32_t* chunk_out = out + done;
    switch (dtype_) {
      case TokenDtype::kUint8:
        widen_tokens<std::uint8_t>(buffer.data(), tokens, chunk_out, file, byte_offset);
        break;
      case TokenDtype::kInt8:
        widen_tokens<std::int8_t>(buffer.data(), tokens, chunk_out, file, byte_offset);
        break;
      case TokenDtype::kInt16:
        widen_tokens<std::int16_t>(buffer.data(), tokens, chunk_out, file, byte_offset);
        break;
      case TokenDtype::kUint16:
        widen_tokens<std::uint16_t>(buffer.data(), tokens, chunk_out, file, byte_offset);
        break;
      case TokenDtype::kInt32:
        widen_tokens<std::int32_t>(buffer.data(), tokens, chunk_out, file, byte_offset);
        break;
      case TokenDtype::kInt64:
        widen_tokens<std::int64_t>(buffer.data(), tokens, chunk_out, file, byte_offset);
        break;
    }
    done += tokens;
  }
}

// ---------------------------------------------------------------------------
// IndexedDatasetBuilder

IndexedDatasetBuilder::IndexedDatasetBuilder(std::filesystem::path prefix, TokenDtype dtype)
    : prefix_(std::move(prefix)), dtype_(dtype) {
  if (!is_token_dtype_code(static_cast<unsigned>(dtype_))) {
    fail(ErrorKind::kInvalidArgument, "{}: dtype code {} is not an integer token type",
         prefix_.string(), static_cast<unsigned>(dtype_));
  }
  buffer_.reserve(kWriteBufferBytes + 8);
  data_fd_ = create_temp_beside(data_file_path(prefix_), &data_temp_path_);
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() {
  if (!finalized_) discard();
}

void IndexedDatasetBuilder::discard() noexcept {
  if (data_fd_ >= 0) {
    ::close(data_fd_);
    data_fd_ = -1;
  }
  if (!data_temp_path_.empty()) {
    ::unlink(data_temp_path_.c_str());
    data_temp_path_.clear();
  }
}

void IndexedDatasetBuilder::add_tokens(std::span<const std::int32_t> tokens) {
  if (finalized_) {
    fail(ErrorKind::kFailedPrecondition, "{}: add_tokens after finalize", prefix_.string());
  }
  const std::uint64_t document = sequence_lengths_.size();
  // Megatron stores each sequence length as int32.
  if (current_length_ + tokens.size() >
      static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max())) {
    fail(ErrorKind::kInvalidArgument,
         "{}: document {} would hold {} tokens, more than the format's int32 length limit",
         prefix_.string(), document, current_length_ + tokens.size());
  }
  std::size_t done = 0;
  while (done < tokens.size()) {
    const std::size_t room = kWriteBufferBytes / token_dtype_size(dtype_);
    const std::size_t chunk = std::min(room, tokens.size() - done);
    const auto part = tokens.subspan(done, chunk);
    const std::uint64_t position = current_length_ + done;
    switch (dtype_) {
      case TokenDtype::kUint8:
        narrow_tokens<std::uint8_t>(part, buffer_, prefix_, dtype_, document, position);
        break;
      case TokenDtype::kInt8:
        narrow_tokens<std::int8_t>(part, buffer_, prefix_, dtype_, document, position);
        break;
      case TokenDtype::kInt16:
        narrow_tokens<std::int16_t>(part, buffer_, prefix_, dtype_, document, position);
        break;
      case TokenDtype::kUint16:
        narrow_tokens<std::uint16_t>(part, buffer_, prefix_, dtype_, document, position);
        break;
      case TokenDtype::kInt32:
        narrow_tokens<std::int32_t>(part, buffer_, prefix_, dtype_, document, position);
        break;
      case TokenDtype::kInt64:
        narrow_tokens<std::int64_t>(part, buffer_, prefix_, dtype_, document, position);
        break;
    }
    done += chunk;
    if (buffer_.size() >= kWriteBufferBytes) flush_buffer();
  }
  current_length_ += tokens.size();
  tokens_written_ += tokens.size();
}

void IndexedDatasetBuilder::end_document() {
  if (finalized_) {
    fail(ErrorKind::kFailedPrecondition, "{}: end_document after finalize", prefix_.string());
  }
  sequence_lengths_.push_back(static_cast<std::int32_t>(current_length_));
  current_length_ = 0;
}

void IndexedDatasetBuilder::flush_buffer() {
  write_all(data_fd_, buffer_.data(), buffer_.size(), data_temp_path_);
  buffer_.clear();
}

void IndexedDatasetBuilder::finalize() {
  if (finalized_) {
    fail(ErrorKind::kFailedPrecondition, "{}: finalize called twice", prefix_.string());
  }
  if (current_length_ > 0) {
    fail(ErrorKind::kFailedPrecondition,
         "{}: {} tokens were added after the last end_document(); close the document first",
         prefix_.string(), current_length_);
  }
  flush_buffer();
  const int data_fd = std::exchange(data_fd_, -1);
  sync_and_close(data_fd, data_temp_path_);

  const std::uint64_t num_sequences = sequence_lengths_.size();
  std::vector<unsigned char> index;
  index.reserve(kHeaderSize + 20 * num_sequences + 8);
  index.insert(index.end(), kMagic.begin(), kMagic.end());
  append_le<std::uint64_t>(index, kVersion);
  index.push_back(static_cast<unsigned char>(dtype_));
  append_le<std::uint64_t>(index, num_sequences);
  append_le<std::uint64_t>(index, num_sequences + 1);
  for (const std::int32_t length : sequence_lengths_) append_le<std::int32_t>(index, length);
  std::int64_t pointer = 0;
  const auto token_size = static_cast<std::int64_t>(token_dtype_size(dtype_));
  for (const std::int32_t length : sequence_lengths_) {
    append_le<std::int64_t>(index, pointer);
    pointer += static_cast<std::int64_t>(length) * token_size;
  }
  for (std::uint64_t i = 0; i <= num_sequences; ++i) {
    append_le<std::int64_t>(index, static_cast<std::int64_t>(i));
  }

  const std::filesystem::path index_path = index_file_path(prefix_);
  std::filesystem::path index_temp_path;
  const int index_fd = create_temp_beside(index_path, &index_temp_path);
  try {
    write_all(index_fd, index.data(), index.size(), index_temp_path);
  } catch (...) {
    ::close(index_fd);
    ::unlink(index_temp_path.c_str());
    throw;
  }
  try {
    sync_and_close(index_fd, index_temp_path);  // closes the descriptor even when it throws
  } catch (...) {
    ::unlink(index_temp_path.c_str());
    throw;
  }

  // The .idx goes last: a reader that sees the new .idx also sees the new .bin.
  const std::filesystem::path data_path = data_file_path(prefix_);
  if (::rename(data_temp_path_.c_str(), data_path.c_str()) != 0) {
    const int error_number = errno;
    ::unlink(index_temp_path.c_str());
    fail(ErrorKind::kIo, "{}: cannot rename {} into place: {}", data_path.string(),
         data_temp_path_.string(), errno_text(error_number));
  }
  data_temp_path_.clear();
  if (::rename(index_temp_path.c_str(), index_path.c_str()) != 0) {
    const int error_number = errno;
    ::unlink(index_temp_path.c_str());
    fail(ErrorKind::kIo, "{}: cannot rename {} into place: {}", index_path.string(),
         index_temp_path.string(), errno_text(error_number));
  }
  finalized_ = true;
  sync_directory(index_path.has_parent_path() ? index_path.parent_path()
                                              : std::filesystem::path("."));
}

}  // namespace megacpp::data
