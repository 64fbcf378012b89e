#include "runtime/data/indexed_dataset.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "base/error.h"

namespace megacpp::data {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("megacpp_indexed_dataset_test_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

Bytes read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

// Runs `action`, which must throw megacpp::Error, and returns it.
Error expect_error(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    return error;
  }
  ADD_FAILURE() << "expected megacpp::Error, nothing was thrown";
  return Error(ErrorKind::kInternal, "");
}

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

// An independent little-endian encoder for building .idx files by hand.
struct IndexBytes {
  Bytes bytes;
  template <typename T>
  IndexBytes& put(T value) {
    for (std::size_t i = 0; i < sizeof(T); ++i) {
      bytes.push_back(static_cast<unsigned char>(static_cast<std::uint64_t>(value) >> (8 * i)));
    }
    return *this;
  }
  IndexBytes& magic() {
    for (const char c : std::string("MMIDIDX")) bytes.push_back(static_cast<unsigned char>(c));
    bytes.push_back(0);
    bytes.push_back(0);
    return *this;
  }
};

// A valid uint16 pair: sequences of 3 and 2 tokens, two documents.
struct TinyDataset {
  Bytes index;
  Bytes data = {1, 0, 2, 0, 3, 0, 0, 1, 0xff, 0xff};
  TinyDataset() {
    IndexBytes b;
    b.magic().put<std::uint64_t>(1).put<std::uint8_t>(8);
    b.put<std::uint64_t>(2).put<std::uint64_t>(3);
    b.put<std::int32_t>(3).put<std::int32_t>(2);
    b.put<std::int64_t>(0).put<std::int64_t>(6);
    b.put<std::int64_t>(0).put<std::int64_t>(1).put<std::int64_t>(2);
    index = b.bytes;
  }
  void write(const fs::path& prefix) const {
    write_bytes(index_file_path(prefix), index);
    write_bytes(data_file_path(prefix), data);
  }
};

template <typename T>
void set_field(Bytes& bytes, std::size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof(T));
}

TEST(IndexedDataset, IdxBytesMatchHandComputedMegatronLayout) {
  TempDir dir;
  const fs::path prefix = dir.path() / "tiny";
  IndexedDatasetBuilder builder(prefix, TokenDtype::kUint16);
  builder.add_document(std::vector<std::int32_t>{1, 2, 3});
  builder.add_document(std::vector<std::int32_t>{256, 65535});
  builder.finalize();

  // Written out byte by byte from Megatron's _IndexWriter: header, version <Q 1,
  // dtype <B (uint16 = 8), <Q sequence count, <Q document index length, int32 lengths,
  // int64 byte pointers, int64 document index starting at 0.
  const Bytes expected_index = {
      'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0,  // magic
      1,   0,   0,   0,   0,   0,   0,   0,     // version
      8,                                        // dtype code uint16
      2,   0,   0,   0,   0,   0,   0,   0,     // sequence count
      3,   0,   0,   0,   0,   0,   0,   0,     // document index length
      3,   0,   0,   0,   2,   0,   0,   0,     // lengths
      0,   0,   0,   0,   0,   0,   0,   0,     // pointer of sequence 0
      6,   0,   0,   0,   0,   0,   0,   0,     // pointer of sequence 1 (3 tokens x 2 bytes)
      0,   0,   0,   0,   0,   0,   0,   0,     // document index
      1,   0,   0,   0,   0,   0,   0,   0,     //
      2,   0,   0,   0,   0,   0,   0,   0,     //
  };
  const Bytes expected_data = {1, 0, 2, 0, 3, 0, 0, 1, 0xff, 0xff};
  EXPECT_EQ(read_bytes(dir.path() / "tiny.idx"), expected_index);
  EXPECT_EQ(read_bytes(dir.path() / "tiny.bin"), expected_data);
  EXPECT_EQ(expected_index, TinyDataset().index);
  // Nothing but the two published files is left in the directory.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 2);
}

TEST(IndexedDataset, ReadsHandWrittenMegatronFiles) {
  TempDir dir;
  const fs::path prefix = dir.path() / "tiny";
  TinyDataset().write(prefix);
  const IndexedDataset dataset(prefix);
  EXPECT_EQ(dataset.dtype(), TokenDtype::kUint16);
  EXPECT_EQ(dataset.num_sequences(), 2u);
  EXPECT_EQ(dataset.num_documents(), 2u);
  EXPECT_EQ(dataset.total_tokens(), 5u);
  EXPECT_FALSE(dataset.has_sequence_modes());
  std::vector<std::int32_t> tokens(5, -7);
  dataset.read_stream(0, 5, tokens.data());
  EXPECT_EQ(tokens, (std::vector<std::int32_t>{1, 2, 3, 256, 65535}));
  std::int32_t last = 0;
  dataset.read(1, 1, 1, &last);
  EXPECT_EQ(last, 65535);
}

template <typename Stored>
void round_trip(TokenDtype dtype) {
  TempDir dir;
  const fs::path prefix = dir.path() / "round_trip";
  const auto lo = static_cast<std::int32_t>(std::max<std::int64_t>(
      std::numeric_limits<Stored>::min(), std::numeric_limits<std::int32_t>::min()));
  const auto hi = static_cast<std::int32_t>(std::min<std::int64_t>(
      std::numeric_limits<Stored>::max(), std::numeric_limits<std::int32_t>::max()));
  const std::vector<std::vector<std::int32_t>> documents = {
      {lo, hi, 0, 1},
      {},  // an empty document is a zero-length sequence
      {7},
      {hi, 5, lo, 42, 9, 0, hi},
  };
  {
    IndexedDatasetBuilder builder(prefix, dtype);
    builder.add_document(documents[0]);
    builder.end_document();
    // A document assembled from several add_tokens calls.
    builder.add_tokens(std::vector<std::int32_t>{7});
    builder.end_document();
    builder.add_tokens(std::vector<std::int32_t>{hi, 5});
    builder.add_tokens(std::vector<std::int32_t>{lo, 42, 9, 0, hi});
    builder.end_document();
    EXPECT_EQ(builder.num_documents(), 4u);
    EXPECT_EQ(builder.num_tokens(), 12u);
    builder.finalize();
  }
  const IndexedDataset dataset(prefix);
  ASSERT_EQ(dataset.dtype(), dtype);
  ASSERT_EQ(dataset.num_documents(), documents.size());
  ASSERT_EQ(dataset.num_sequences(), documents.size());
  ASSERT_EQ(dataset.total_tokens(), 12u);
  EXPECT_EQ(fs::file_size(data_file_path(prefix)), 12 * sizeof(Stored));
  std::vector<std::int32_t> stream;
  std::uint64_t start = 0;
  for (std::uint64_t d = 0; d < documents.size(); ++d) {
    const auto& expected = documents[d];
    EXPECT_EQ(dataset.document_sequences(d).begin, d);
    EXPECT_EQ(dataset.document_sequences(d).end, d + 1);
    EXPECT_EQ(dataset.document_tokens(d).begin, start);
    EXPECT_EQ(dataset.document_tokens(d).end, start + expected.size());
    EXPECT_EQ(dataset.sequence_start(d), start);
    ASSERT_EQ(dataset.sequence_length(d), expected.size());
    std::vector<std::int32_t> got(expected.size());
    dataset.read(d, 0, expected.size(), got.data());
    EXPECT_EQ(got, expected) << "document " << d;
    start += expected.size();
    stream.insert(stream.end(), expected.begin(), expected.end());
  }
  std::vector<std::int32_t> middle(3);
  dataset.read(3, 2, 3, middle.data());
  EXPECT_EQ(middle, (std::vector<std::int32_t>{lo, 42, 9}));
  std::vector<std::int32_t> whole(stream.size());
  dataset.read_stream(0, whole.size(), whole.data());
  EXPECT_EQ(whole, stream);
}

TEST(IndexedDataset, RoundTripsEveryTokenDtype) {
  round_trip<std::uint8_t>(TokenDtype::kUint8);
  round_trip<std::int8_t>(TokenDtype::kInt8);
  round_trip<std::int16_t>(TokenDtype::kInt16);
  round_trip<std::uint16_t>(TokenDtype::kUint16);
  round_trip<std::int32_t>(TokenDtype::kInt32);
  round_trip<std::int64_t>(TokenDtype::kInt64);
}

TEST(IndexedDataset, EmptyDatasetOpens) {
  TempDir dir;
  const fs::path prefix = dir.path() / "empty";
  IndexedDatasetBuilder builder(prefix, TokenDtype::kUint16);
  builder.finalize();
  const IndexedDataset dataset(prefix);
  EXPECT_EQ(dataset.num_documents(), 0u);
  EXPECT_EQ(dataset.total_tokens(), 0u);
}

TEST(IndexedDataset, OutOfRangeReadsAreInvalidArgument) {
  TempDir dir;
  const fs::path prefix = dir.path() / "tiny";
  TinyDataset().write(prefix);
  const IndexedDataset dataset(prefix);
  std::vector<std::int32_t> out(8);
  EXPECT_EQ(expect_error([&] { dataset.read(2, 0, 1, out.data()); }).kind(),
            ErrorKind::kInvalidArgument);
  EXPECT_EQ(expect_error([&] { dataset.read(0, 1, 3, out.data()); }).kind(),
            ErrorKind::kInvalidArgument);
  EXPECT_EQ(expect_error([&] { dataset.read(0, 4, 0, out.data()); }).kind(),
            ErrorKind::kInvalidArgument);
  EXPECT_EQ(expect_error([&] { dataset.read_stream(3, 3, out.data()); }).kind(),
            ErrorKind::kInvalidArgument);
  EXPECT_EQ(expect_error([&] {
              dataset.read_stream(std::numeric_limits<std::uint64_t>::max(), 2, out.data());
            }).kind(),
            ErrorKind::kInvalidArgument);
  EXPECT_EQ(expect_error([&] { (void)dataset.document_tokens(2); }).kind(),
            ErrorKind::kInvalidArgument);
  dataset.read(0, 3, 0, out.data());  // an empty read at the end is fine
}

TEST(IndexedDataset, MissingFilesAreNotFound) {
  TempDir dir;
  const fs::path prefix = dir.path() / "absent";
  const Error error = expect_error([&] { IndexedDataset dataset(prefix); });
  EXPECT_EQ(error.kind(), ErrorKind::kNotFound);
  expect_contains(error.what(), "absent.idx");
  write_bytes(index_file_path(prefix), TinyDataset().index);
  const Error missing_bin = expect_error([&] { IndexedDataset dataset(prefix); });
  EXPECT_EQ(missing_bin.kind(), ErrorKind::kNotFound);
  expect_contains(missing_bin.what(), "absent.bin");
}

// Start offset of the field that a file cut to `size` bytes ends inside.
std::size_t field_start(std::size_t size) {
  const std::size_t starts[] = {0, 9, 17, 18, 26, 34, 42, 58};
  std::size_t result = 0;
  for (const std::size_t start : starts) {
    if (size >= start) result = start;
  }
  return result;
}

TEST(IndexedDataset, EveryTruncationOfTheIndexNamesFileAndOffset) {
  TempDir dir;
  const fs::path prefix = dir.path() / "cut";
  const TinyDataset tiny;
  write_bytes(data_file_path(prefix), tiny.data);
  ASSERT_EQ(tiny.index.size(), 82u);
  for (std::size_t size = 0; size < tiny.index.size(); ++size) {
    write_bytes(index_file_path(prefix),
                Bytes(tiny.index.begin(), tiny.index.begin() + static_cast<std::ptrdiff_t>(size)));
    const Error error = expect_error([&] { IndexedDataset dataset(prefix); });
    EXPECT_EQ(error.kind(), ErrorKind::kCorruptData) << "size " << size;
    const std::string message = error.what();
    expect_contains(message, index_file_path(prefix).string());
    expect_contains(message, "truncated at offset " + std::to_string(field_start(size)) + ":");
    expect_contains(message, "file has " + std::to_string(size) + " bytes");
  }
}

TEST(IndexedDataset, TruncationMessageNamesTheField) {
  TempDir dir;
  const fs::path prefix = dir.path() / "cut";
  const TinyDataset tiny;
  tiny.write(prefix);
  write_bytes(index_file_path(prefix), Bytes(tiny.index.begin(), tiny.index.begin() + 30));
  const std::string message = expect_error([&] { IndexedDataset dataset(prefix); }).what();
  EXPECT_EQ(message, index_file_path(prefix).string() +
                         ": truncated at offset 26: expected 8-byte document count, file has 30 "
                         "bytes");
}

TEST(IndexedDataset, HugeCountsDoNotOverflow) {
  TempDir dir;
  const fs::path prefix = dir.path() / "huge";
  TinyDataset tiny;
  tiny.write(prefix);
  for (const std::uint64_t count :
       {std::uint64_t{1} << 62, std::numeric_limits<std::uint64_t>::max()}) {
    Bytes index = tiny.index;
    set_field<std::uint64_t>(index, 18, count);
    write_bytes(index_file_path(prefix), index);
    Error error = expect_error([&] { IndexedDataset dataset(prefix); });
    EXPECT_EQ(error.kind(), ErrorKind::kCorruptData);
    expect_contains(error.what(), "truncated at offset 34");
    index = tiny.index;
    set_field<std::uint64_t>(index, 26, count);
    write_bytes(index_file_path(prefix), index);
    error = expect_error([&] { IndexedDataset dataset(prefix); });
    EXPECT_EQ(error.kind(), ErrorKind::kCorruptData);
    expect_contains(error.what(), "truncated at offset 58");
  }
}

struct Corruption {
  std::string name;
  std::function<void(Bytes&)> apply;
  std::string expected_part;
};

TEST(IndexedDataset, CorruptHeaderAndArraysAreRejected) {
  const std::vector<Corruption> corruptions = {
      {"bad magic", [](Bytes& b) { b[3] = 'X'; }, "bad magic at offset 0"},
      {"bad version", [](Bytes& b) { set_field<std::uint64_t>(b, 9, 2); },
       "bad version at offset 9: 2"},
      {"dtype 0", [](Bytes& b) { b[17] = 0; }, "bad dtype code at offset 17: 0"},
      {"dtype float64", [](Bytes& b) { b[17] = 6; }, "bad dtype code at offset 17: 6"},
      {"dtype float32", [](Bytes& b) { b[17] = 7; }, "bad dtype code at offset 17: 7"},
      {"dtype 9", [](Bytes& b) { b[17] = 9; }, "bad dtype code at offset 17: 9"},
      {"zero document count",
       [](Bytes& b) {
         set_field<std::uint64_t>(b, 26, 0);
         b.erase(b.end() - 24, b.end());
       },
       "document count at offset 26 is 0"},
      {"negative length", [](Bytes& b) { set_field<std::int32_t>(b, 38, -1); },
       "length of sequence 1 at offset 38 is negative"},
      {"first pointer not 0", [](Bytes& b) { set_field<std::int64_t>(b, 42, 2); },
       "pointer of sequence 0 at offset 42 is 2, expected 0"},
      {"gap between sequences", [](Bytes& b) { set_field<std::int64_t>(b, 50, 8); },
       "pointer of sequence 1 at offset 50 is 8, expected 6"},
      {"document index not from 0", [](Bytes& b) { set_field<std::int64_t>(b, 58, 1); },
       "document index entry 0 at offset 58 is 1"},
      {"document index decreasing",
       [](Bytes& b) {
         set_field<std::int64_t>(b, 66, 2);
         set_field<std::int64_t>(b, 74, 1);
       },
       "document index entry 2 at offset 74 is 1"},
      {"document index past the sequences", [](Bytes& b) { set_field<std::int64_t>(b, 74, 3); },
       "document index entry 2 at offset 74 is 3"},
      {"sequences outside any document", [](Bytes& b) { set_field<std::int64_t>(b, 74, 1); },
       "last document index entry at offset 74 is 1"},
      {"trailing garbage",
       [](Bytes& b) {
         b.insert(b.end(), {1, 2, 3});
       },
       "3 unexpected bytes at offset 82"},
  };
  TempDir dir;
  const fs::path prefix = dir.path() / "bad";
  const TinyDataset tiny;
  write_bytes(data_file_path(prefix), tiny.data);
  for (const Corruption& corruption : corruptions) {
    Bytes index = tiny.index;
    corruption.apply(index);
    write_bytes(index_file_path(prefix), index);
    const Error error = expect_error([&] { IndexedDataset dataset(prefix); });
    EXPECT_EQ(error.kind(), ErrorKind::kCorruptData) << corruption.name;
    expect_contains(error.what(), index_file_path(prefix).string() + ": ");
    expect_contains(error.what(), corruption.expected_part);
  }
}

TEST(IndexedDataset, MultimodalModesAreAccepted) {
  TempDir dir;
  const fs::path prefix = dir.path() / "modes";
  TinyDataset tiny;
  tiny.index.insert(tiny.index.end(), {0, 1});  // one int8 mode per sequence
  tiny.write(prefix);
  const IndexedDataset dataset(prefix);
  EXPECT_TRUE(dataset.has_sequence_modes());
  EXPECT_EQ(dataset.total_tokens(), 5u);
}

TEST(IndexedDataset, BinShorterOrLongerThanTheIndexIsRejected) {
  TempDir dir;
  const fs::path prefix = dir.path() / "bin";
  const TinyDataset tiny;
  write_bytes(index_file_path(prefix), tiny.index);
  for (std::size_t size = 0; size < tiny.data.size(); ++size) {
    write_bytes(data_file_path(prefix),
                Bytes(tiny.data.begin(), tiny.data.begin() + static_cast<std::ptrdiff_t>(size)));
    const Error error = expect_error([&] { IndexedDataset dataset(prefix); });
    EXPECT_EQ(error.kind(), ErrorKind::kCorruptData) << "size " << size;
    expect_contains(error.what(), data_file_path(prefix).string() + ": truncated at offset " +
                                      std::to_string(size) + ":");
    // The sequence that does not fit and where the index declares it.
    expect_contains(error.what(), size < 6 ? "sequence 0" : "sequence 1");
    expect_contains(error.what(), index_file_path(prefix).string());
  }
  Bytes longer = tiny.data;
  longer.push_back(0);
  longer.push_back(0);
  write_bytes(data_file_path(prefix), longer);
  const Error error = expect_error([&] { IndexedDataset dataset(prefix); });
  EXPECT_EQ(error.kind(), ErrorKind::kCorruptData);
  expect_contains(error.what(), data_file_path(prefix).string() + ": has 12 bytes");
}

TEST(IndexedDataset, Int64TokensOutsideInt32AreCorruptOnRead) {
  TempDir dir;
  const fs::path prefix = dir.path() / "wide";
  IndexBytes b;
  b.magic().put<std::uint64_t>(1).put<std::uint8_t>(5).put<std::uint64_t>(1).put<std::uint64_t>(2);
  b.put<std::int32_t>(2).put<std::int64_t>(0).put<std::int64_t>(0).put<std::int64_t>(1);
  write_bytes(index_file_path(prefix), b.bytes);
  IndexBytes tokens;
  tokens.put<std::int64_t>(17).put<std::int64_t>(std::int64_t{1} << 40);
  write_bytes(data_file_path(prefix), tokens.bytes);
  const IndexedDataset dataset(prefix);
  std::int32_t out[2] = {0, 0};
  dataset.read(0, 0, 1, out);
  EXPECT_EQ(out[0], 17);
  const Error error = expect_error([&] { dataset.read(0, 0, 2, out); });
  EXPECT_EQ(error.kind(), ErrorKind::kCorruptData);
  expect_contains(error.what(), "byte offset 8 is 1099511627776");
}

// A dataset rewritten under a reader (a job's data replaced while it trains) is an
// Error naming the .bin: never SIGBUS from a mapping whose pages the truncation took,
// and never tokens silently different from those the run started with.
TEST(IndexedDataset, BinTruncatedWhileOpenIsAnErrorNamingTheFile) {
  TempDir dir;
  const fs::path prefix = dir.path() / "big";
  // Many pages, so that a mapped reader would touch pages the truncation removed.
  std::vector<std::int32_t> tokens(std::size_t{1} << 16);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>(i % 251);
  IndexedDatasetBuilder builder(prefix, TokenDtype::kUint16);
  builder.add_document(tokens);
  builder.finalize();
  const IndexedDataset dataset(prefix);
  std::vector<std::int32_t> out(1024);
  dataset.read_stream(60000, out.size(), out.data());
  EXPECT_EQ(out[0], static_cast<std::int32_t>(60000 % 251));
  ASSERT_EQ(::truncate(data_file_path(prefix).c_str(), 4096), 0);
  for (const std::uint64_t first : {std::uint64_t{60000}, std::uint64_t{0}}) {
    const Error error = expect_error([&] { dataset.read_stream(first, out.size(), out.data()); });
    EXPECT_EQ(error.kind(), ErrorKind::kCorruptData);
    expect_contains(error.what(), data_file_path(prefix).string() + ": changed while in use");
    expect_contains(error.what(), "opened with 131072 bytes");
  }
}

TEST(IndexedDataset, BinRewrittenInPlaceWhileOpenIsAnError) {
  TempDir dir;
  const fs::path prefix = dir.path() / "tiny";
  TinyDataset().write(prefix);
  const IndexedDataset dataset(prefix);
  std::int32_t out[5] = {};
  dataset.read_stream(0, 5, out);
  EXPECT_EQ(out[0], 1);
  {
    std::fstream file(data_file_path(prefix), std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(0);
    file.put(9);
  }
  // Same size, other bytes; a modification time that differs even on a coarse clock.
  const struct timespec times[2] = {{0, UTIME_OMIT}, {12345, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, data_file_path(prefix).c_str(), times, 0), 0);
  const Error error = expect_error([&] { dataset.read_stream(0, 5, out); });
  EXPECT_EQ(error.kind(), ErrorKind::kCorruptData);
  expect_contains(error.what(), data_file_path(prefix).string() + ": changed while in use");
}

TEST(IndexedDataset, PairReplacedByRenameKeepsServingTheOpenedFiles) {
  TempDir dir;
  const fs::path prefix = dir.path() / "tiny";
  TinyDataset().write(prefix);
  const IndexedDataset dataset(prefix);
  IndexedDatasetBuilder builder(prefix, TokenDtype::kUint16);
  builder.add_document(std::vector<std::int32_t>{7, 7, 7, 7, 7, 7, 7});
  builder.finalize();
  std::int32_t out[5] = {};
  dataset.read_stream(0, 5, out);
  EXPECT_EQ(std::vector<std::int32_t>(out, out + 5),
            (std::vector<std::int32_t>{1, 2, 3, 256, 65535}));
}

TEST(IndexedDatasetBuilder, RejectsTokensTheDtypeCannotHold) {
  TempDir dir;
  IndexedDatasetBuilder builder(dir.path() / "narrow", TokenDtype::kUint16);
  Error error = expect_error([&] { builder.add_tokens(std::vector<std::int32_t>{1, 65536}); });
  EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
  expect_contains(error.what(), "65536");
  expect_contains(error.what(), "uint16");
  error = expect_error([&] { builder.add_tokens(std::vector<std::int32_t>{-1}); });
  EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
}

TEST(IndexedDatasetBuilder, UnfinishedBuilderLeavesNoFiles) {
  TempDir dir;
  {
    IndexedDatasetBuilder builder(dir.path() / "abandoned", TokenDtype::kInt32);
    builder.add_document(std::vector<std::int32_t>{1, 2, 3});
    EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 0);
}

TEST(IndexedDatasetBuilder, FinalizeRefusesAnOpenDocumentAndASecondCall) {
  TempDir dir;
  IndexedDatasetBuilder builder(dir.path() / "open", TokenDtype::kInt32);
  builder.add_tokens(std::vector<std::int32_t>{1});
  EXPECT_EQ(expect_error([&] { builder.finalize(); }).kind(), ErrorKind::kFailedPrecondition);
  builder.end_document();
  builder.finalize();
  EXPECT_EQ(expect_error([&] { builder.finalize(); }).kind(), ErrorKind::kFailedPrecondition);
}

TEST(IndexedDatasetBuilder, ReplacesAnExistingDataset) {
  TempDir dir;
  const fs::path prefix = dir.path() / "replace";
  {
    IndexedDatasetBuilder builder(prefix, TokenDtype::kInt32);
    builder.add_document(std::vector<std::int32_t>{1, 2, 3, 4});
    builder.finalize();
  }
  const IndexedDataset old_dataset(prefix);  // stays readable: its mapping outlives the rename
  {
    IndexedDatasetBuilder builder(prefix, TokenDtype::kInt32);
    builder.add_document(std::vector<std::int32_t>{9});
    builder.finalize();
  }
  const IndexedDataset dataset(prefix);
  ASSERT_EQ(dataset.total_tokens(), 1u);
  std::int32_t token = 0;
  dataset.read(0, 0, 1, &token);
  EXPECT_EQ(token, 9);
  std::vector<std::int32_t> old_tokens(4);
  old_dataset.read_stream(0, 4, old_tokens.data());
  EXPECT_EQ(old_tokens, (std::vector<std::int32_t>{1, 2, 3, 4}));
}

TEST(IndexedDatasetBuilder, MissingDirectoryIsAnIoError) {
  TempDir dir;
  const Error error = expect_error([&] {
    IndexedDatasetBuilder builder(dir.path() / "no" / "such" / "dir", TokenDtype::kInt32);
  });
  EXPECT_EQ(error.kind(), ErrorKind::kIo);
  expect_contains(error.what(), "dir.bin");
}

}  // namespace
}  // namespace megacpp::data
