#include "runtime/checkpoint/safetensors.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "base/error.h"

namespace megacpp {
namespace {

namespace fs = std::filesystem;

std::string le64(uint64_t value) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[static_cast<size_t>(i)] = static_cast<char>(value >> (8 * i));
  return bytes;
}

template <typename T>
std::string raw_bytes(const std::vector<T>& values) {
  std::string bytes(values.size() * sizeof(T), '\0');
  if (!values.empty()) std::memcpy(bytes.data(), values.data(), bytes.size());
  return bytes;
}

// A file built byte by byte, independently of the writer under test.
std::string make_file(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

std::vector<uint32_t> bits_of(const std::vector<float>& values) {
  std::vector<uint32_t> bits;
  for (const float v : values) bits.push_back(std::bit_cast<uint32_t>(v));
  return bits;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("megacpp_safetensors_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  fs::path put(const std::string& name, const std::string& bytes) const {
    const fs::path path = dir_ / name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return path;
  }

  static std::string slurp(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  fs::path dir_;
};

template <typename Body>
Error capture_error(Body&& body) {
  try {
    body();
  } catch (const Error& error) {
    return error;
  }
  ADD_FAILURE() << "expected megacpp::Error";
  return Error(ErrorKind::kInternal, "no error thrown");
}

void expect_mentions(const Error& error, const std::vector<std::string>& needles) {
  const std::string message = error.what();
  for (const std::string& needle : needles) {
    EXPECT_NE(message.find(needle), std::string::npos)
        << "message lacks \"" << needle << "\": " << message;
  }
}

TEST_F(SafetensorsTest, ExactBytesForSmallFileMatchTheFormat) {
  const std::vector<float> values = {0, 1, 2, 3, 4, 5};
  const fs::path path = dir_ / "small.safetensors";
  save_safetensors(path, {{"attn.0", {1, 2, 3}, values.data()}});

  const std::string json =
      R"({"__metadata__":{"format":"pt"},"attn.0":{"dtype":"F32","shape":[1,2,3],)"
      R"("data_offsets":[0,24]}})";
  ASSERT_EQ(json.size(), 95u);
  std::string expected = std::string("\x60\0\0\0\0\0\0\0", 8) + json + " ";
  // 0.0f .. 5.0f little-endian.
  const unsigned char data[] = {0, 0, 0,    0,    0, 0, 0x80, 0x3f, 0, 0, 0,    0x40,
                                0, 0, 0x40, 0x40, 0, 0, 0x80, 0x40, 0, 0, 0xa0, 0x40};
  expected.append(reinterpret_cast<const char*>(data), sizeof(data));
  EXPECT_EQ(slurp(path), expected);
}

TEST_F(SafetensorsTest, HeaderIsPaddedWithSpacesToMultipleOfEight) {
  const float one = 1.0f;
  for (int length = 1; length <= 9; ++length) {
    const fs::path path = dir_ / "pad.safetensors";
    save_safetensors(path, {{std::string(static_cast<size_t>(length), 'w'), {}, &one}});
    const std::string bytes = slurp(path);
    uint64_t header_length = 0;
    std::memcpy(&header_length, bytes.data(), 8);
    EXPECT_EQ(header_length % 8, 0u);
    ASSERT_EQ(bytes.size(), 8 + header_length + 4);
    const std::string header = bytes.substr(8, header_length);
    const size_t json_end = header.find_last_of('}') + 1;
    EXPECT_LT(header.size() - json_end, 8u);
    EXPECT_EQ(header.substr(json_end), std::string(header.size() - json_end, ' '));
    EXPECT_TRUE(nlohmann::json::accept(header));
  }
}

TEST_F(SafetensorsTest, RoundTripIsBitwiseIncludingSpecialValues) {
  const std::vector<float> specials = {
      std::bit_cast<float>(0x7fc00000u),  // quiet NaN
      std::bit_cast<float>(0x7fc12345u),  // quiet NaN with payload
      std::bit_cast<float>(0xffa00001u),  // negative signalling NaN with payload
      std::numeric_limits<float>::infinity(),
      -std::numeric_limits<float>::infinity(),
      -0.0f,
      0.0f,
      std::numeric_limits<float>::denorm_min(),
      -std::numeric_limits<float>::min(),
      std::numeric_limits<float>::max(),
      1.0f / 3.0f,
      -7.25f};
  std::vector<float> matrix(6 * 5);
  for (size_t i = 0; i < matrix.size(); ++i) matrix[i] = std::sin(static_cast<float>(i)) * 1e3f;
  const float scalar = -2.5f;
  const std::vector<TensorRef> tensors = {
      {"z.specials", {3, 4}, specials.data()},
      {"a.matrix", {6, 5}, matrix.data()},
      {"scalar", {}, &scalar},
      {"empty", {0}, nullptr},
      {"empty.middle", {2, 0, 3}, nullptr},
  };
  const fs::path path = dir_ / "model.safetensors";
  save_safetensors(path, tensors, {{"step", "1200"}, {"note", "ünïcode ✓"}});

  std::map<std::string, std::string> metadata;
  const auto loaded = load_safetensors(path, &metadata);
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{
                          {"format", "pt"}, {"step", "1200"}, {"note", "ünïcode ✓"}}));
  ASSERT_EQ(loaded.size(), 5u);
  EXPECT_EQ(loaded.at("z.specials").shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(bits_of(loaded.at("z.specials").data), bits_of(specials));
  EXPECT_EQ(loaded.at("a.matrix").shape, (std::vector<int64_t>{6, 5}));
  EXPECT_EQ(bits_of(loaded.at("a.matrix").data), bits_of(matrix));
  EXPECT_TRUE(loaded.at("scalar").shape.empty());
  EXPECT_EQ(bits_of(loaded.at("scalar").data), bits_of({scalar}));
  EXPECT_EQ(loaded.at("empty").shape, (std::vector<int64_t>{0}));
  EXPECT_TRUE(loaded.at("empty").data.empty());
  EXPECT_EQ(loaded.at("empty.middle").shape, (std::vector<int64_t>{2, 0, 3}));
  EXPECT_TRUE(loaded.at("empty.middle").data.empty());
}

TEST_F(SafetensorsTest, TensorsAreLaidOutInTheGivenOrder) {
  const std::vector<float> a(3, 1.0f), b(2, 2.0f), c(1, 3.0f);
  const fs::path path = dir_ / "order.safetensors";
  save_safetensors(path, {{"c", {1}, c.data()}, {"a", {3}, a.data()}, {"b", {2}, b.data()}});
  const std::string bytes = slurp(path);
  uint64_t header_length = 0;
  std::memcpy(&header_length, bytes.data(), 8);
  const auto header = nlohmann::json::parse(bytes.substr(8, header_length));
  EXPECT_EQ(header["c"]["data_offsets"], nlohmann::json({0, 4}));
  EXPECT_EQ(header["a"]["data_offsets"], nlohmann::json({4, 16}));
  EXPECT_EQ(header["b"]["data_offsets"], nlohmann::json({16, 24}));
  const std::string data = bytes.substr(8 + header_length);
  EXPECT_EQ(data, raw_bytes(c) + raw_bytes(a) + raw_bytes(b));
}

TEST_F(SafetensorsTest, CallerMetadataFormatIsKept) {
  const float x = 1.0f;
  const fs::path path = dir_ / "np.safetensors";
  save_safetensors(path, {{"x", {1}, &x}}, {{"format", "np"}});
  std::map<std::string, std::string> metadata;
  load_safetensors(path, &metadata);
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"format", "np"}}));
}

TEST_F(SafetensorsTest, LoadsFileWithoutMetadataInAnyOffsetOrder) {
  // Header order differs from data order, which the format allows.
  const std::string header = R"({"second":{"dtype":"F32","shape":[1],"data_offsets":[8,12]},)"
                             R"("first":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const fs::path path =
      put("order.safetensors", make_file(header, raw_bytes(std::vector<float>{1, 2, 3})));
  std::map<std::string, std::string> metadata = {{"stale", "value"}};
  const auto loaded = load_safetensors(path, &metadata);
  EXPECT_TRUE(metadata.empty());
  EXPECT_EQ(loaded.at("first").data, (std::vector<float>{1, 2}));
  EXPECT_EQ(loaded.at("second").data, (std::vector<float>{3}));
}

TEST_F(SafetensorsTest, DecodesF16Exactly) {
  const std::vector<uint16_t> halves = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x03ff, 0x0400,
                                        0x3555, 0x8000, 0x7c00, 0xfc00, 0x7e00, 0x0000};
  const std::vector<float> expected = {1.0f,
                                       -2.0f,
                                       65504.0f,
                                       std::ldexp(1.0f, -24),
                                       std::ldexp(1023.0f, -24),
                                       std::ldexp(1.0f, -14),
                                       0.333251953125f,
                                       -0.0f,
                                       std::numeric_limits<float>::infinity(),
                                       -std::numeric_limits<float>::infinity(),
                                       std::bit_cast<float>(0x7fc00000u),
                                       0.0f};
  const std::string header = R"({"h":{"dtype":"F16","shape":[3,4],"data_offsets":[0,24]}})";
  const fs::path path = put("half.safetensors", make_file(header, raw_bytes(halves)));
  const auto loaded = load_safetensors(path);
  EXPECT_EQ(loaded.at("h").shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(bits_of(loaded.at("h").data), bits_of(expected));
}

TEST_F(SafetensorsTest, DecodesBF16Exactly) {
  const std::vector<uint16_t> brains = {0x3f80, 0x4049, 0xc2f7, 0x0001, 0x7f7f,
                                        0x8000, 0x7f80, 0xff80, 0x7fc1};
  const std::vector<float> expected = {1.0f,
                                       3.140625f,
                                       -123.5f,
                                       std::ldexp(1.0f, -133),
                                       std::bit_cast<float>(0x7f7f0000u),
                                       -0.0f,
                                       std::numeric_limits<float>::infinity(),
                                       -std::numeric_limits<float>::infinity(),
                                       std::bit_cast<float>(0x7fc10000u)};
  const std::string header = R"({"b":{"dtype":"BF16","shape":[9],"data_offsets":[0,18]}})";
  const fs::path path = put("bf16.safetensors", make_file(header, raw_bytes(brains)));
  const auto loaded = load_safetensors(path);
  EXPECT_EQ(bits_of(loaded.at("b").data), bits_of(expected));
}

TEST_F(SafetensorsTest, ConvertsF64ToNearestFloat) {
  const std::vector<double> doubles = {1.0 / 3.0, -1e300, 1e-50, 0.1, 2.0};
  const std::string header = R"({"d":{"dtype":"F64","shape":[5],"data_offsets":[0,40]}})";
  const fs::path path = put("f64.safetensors", make_file(header, raw_bytes(doubles)));
  const auto loaded = load_safetensors(path);
  const std::vector<float> expected = {1.0f / 3.0f, -std::numeric_limits<float>::infinity(), 0.0f,
                                       0.1f, 2.0f};
  EXPECT_EQ(bits_of(loaded.at("d").data), bits_of(expected));
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  const fs::path path = dir_ / "absent.safetensors";
  const Error error = capture_error([&] { load_safetensors(path); });
  EXPECT_EQ(error.kind(), ErrorKind::kNotFound);
  expect_mentions(error, {path.string()});
}

struct CorruptCase {
  std::string label;
  std::string bytes;
  std::vector<std::string> mentions;  // besides the file name
};

std::vector<CorruptCase> corrupt_cases() {
  const std::string good_entry = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string eight = std::string(8, '\x11');
  std::string hundred_ones = "1";
  for (int i = 1; i < 100; ++i) hundred_ones += ",1";
  auto one = [&](const std::string& entry, const std::string& data) {
    return make_file("{" + entry + "}", data);
  };
  return {
      {"empty_file", "", {"0 bytes", "8-byte"}},
      {"five_bytes", std::string("\x05\0\0\0\0", 5), {"5 bytes"}},
      {"header_past_end", le64(100) + "{}", {"header length 100", "10 bytes"}},
      {"header_length_huge", le64(uint64_t{1} << 63) + "{}", {"9223372036854775808"}},
      {"invalid_json", make_file(R"({"w":{"dtype":)", ""), {"not valid JSON"}},
      {"nul_padding",
       make_file(std::string("{}\0\0\0\0\0\0", 8), ""),
       {"not valid JSON", "byte 10"}},
      {"nul_then_garbage", make_file(std::string("{}\0[[[[[", 8), ""), {"not valid JSON"}},
      {"json_array", make_file("[1,2]", ""), {"array"}},
      {"entry_not_object", one(R"("w":7)", ""), {"tensor w", "number"}},
      {"missing_dtype",
       one(R"("w":{"shape":[2],"data_offsets":[0,8]})", eight),
       {"tensor w", "dtype"}},
      {"missing_shape",
       one(R"("w":{"dtype":"F32","data_offsets":[0,8]})", eight),
       {"tensor w", "shape"}},
      {"missing_offsets",
       one(R"("w":{"dtype":"F32","shape":[2]})", eight),
       {"tensor w", "data_offsets"}},
      {"dtype_not_string",
       one(R"("w":{"dtype":4,"shape":[1],"data_offsets":[0,4]})", "abcd"),
       {"tensor w", "dtype"}},
      {"unsupported_dtype",
       one(R"("w":{"dtype":"I64","shape":[1],"data_offsets":[0,8]})", eight),
       {"tensor w", "I64"}},
      {"unknown_dtype",
       one(R"("w":{"dtype":"F99","shape":[1],"data_offsets":[0,8]})", eight),
       {"tensor w", "F99"}},
      {"negative_dim",
       one(R"("w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]})", eight),
       {"tensor w", "-2"}},
      {"fractional_dim",
       one(R"("w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]})", eight),
       {"tensor w", "1.5"}},
      {"shape_not_array",
       one(R"("w":{"dtype":"F32","shape":2,"data_offsets":[0,8]})", eight),
       {"tensor w", "shape"}},
      {"shape_overflow",
       one(R"("w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})", eight),
       {"tensor w", "64 bits"}},
      {"offsets_three",
       one(R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,4,8]})", eight),
       {"tensor w", "data_offsets"}},
      {"offsets_negative",
       one(R"("w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]})", eight),
       {"tensor w", "-8"}},
      {"offsets_reversed",
       one(R"("w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]})", eight),
       {"tensor w", "[8, 0]"}},
      {"size_mismatch",
       one(R"("w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]})", eight),
       {"tensor w", "[0, 8]", "8 bytes", "[3]", "12"}},
      {"bf16_size_mismatch",
       one(R"("w":{"dtype":"BF16","shape":[2],"data_offsets":[0,8]})", eight),
       {"tensor w", "BF16", "needs 4"}},
      {"past_data_section",
       one(R"("w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]})", eight),
       {"tensor w", "[0, 16]", "holds 8 bytes"}},
      {"huge_offsets",
       one(R"("w":{"dtype":"F32","shape":[1],)"
           R"("data_offsets":[18446744073709551608,18446744073709551612]})",
           eight),
       {"tensor w", "18446744073709551612"}},
      {"overlap",
       make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                 std::string(12, 'x')),
       {"tensor b", "overlap tensor a", "[4, 12]", "[0, 8]"}},
      {"same_range",
       make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                 eight),
       {"overlap"}},
      {"hole",
       make_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                 R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                 std::string(12, 'x')),
       {"4 unused bytes", "[4, 8]", "tensor b"}},
      {"hole_at_start",
       one(R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]})", eight),
       {"[0, 4]", "tensor w"}},
      {"trailing_bytes", one(good_entry, eight + "xyz"), {"11 bytes", "[0, 8]", "3 bytes"}},
      {"truncated_data", one(good_entry, "abcde"), {"tensor w", "holds 5 bytes"}},
      {"no_tensors_but_data", make_file("{}", "junk"), {"4 bytes"}},
      {"duplicate_name", one(good_entry + "," + good_entry, eight), {"tensor w twice"}},
      {"metadata_not_object", one(R"("__metadata__":[1])", ""), {"__metadata__"}},
      {"metadata_value_not_string",
       one(R"("__metadata__":{"step":12})", ""),
       {"__metadata__", "step", "12"}},
      {"deep_nesting", make_file("{\"w\":{\"shape\":[[[[[1]]]]]}}", ""), {"levels deep"}},
      {"long_shape",
       one(R"("w":{"dtype":"F32","shape":[)" + hundred_ones + R"(],"data_offsets":[0,4]})", "abcd"),
       {"longer than 64"}},
      {"invalid_utf8_name", make_file("{\"w\xff\":{}}", ""), {"not valid JSON"}},
  };
}

TEST_F(SafetensorsTest, EveryCorruptionIsCorruptDataNamingFileAndDetails) {
  for (const CorruptCase& test : corrupt_cases()) {
    SCOPED_TRACE(test.label);
    const fs::path path = put(test.label + ".safetensors", test.bytes);
    const Error error = capture_error([&] { load_safetensors(path); });
    EXPECT_EQ(error.kind(), ErrorKind::kCorruptData) << error.what();
    std::vector<std::string> mentions = test.mentions;
    mentions.push_back(path.string());
    expect_mentions(error, mentions);
  }
}

TEST_F(SafetensorsTest, TruncationsAndBitFlipsNeverCrash) {
  std::vector<float> values(40);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) - 7.5f;
  const fs::path source = dir_ / "source.safetensors";
  save_safetensors(source, {{"a", {4, 5}, values.data()}, {"b", {20}, values.data() + 20}},
                   {{"k", "v"}});
  const std::string good = slurp(source);

  int rejected = 0;
  for (size_t length = 0; length < good.size(); ++length) {
    // Fresh names: rewriting one file in place makes ext4 flush it to disk every time.
    const fs::path path = put(fmt::format("cut{}.safetensors", length), good.substr(0, length));
    EXPECT_THROW(load_safetensors(path), Error) << "length " << length;
    fs::remove(path);
    ++rejected;
  }
  std::mt19937 rng(1234);
  int accepted = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::string bytes = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      // Mostly the header, where the interesting parsing is.
      const size_t limit = rng() % 4 == 0 ? bytes.size() : std::min<size_t>(bytes.size(), 120);
      bytes[rng() % limit] = static_cast<char>(rng());
    }
    const fs::path path = put(fmt::format("flip{}.safetensors", trial), bytes);
    try {
      const auto loaded = load_safetensors(path);
      for (const auto& [name, tensor] : loaded) {
        uint64_t elements = 1;
        for (const int64_t dim : tensor.shape) elements *= static_cast<uint64_t>(dim);
        EXPECT_EQ(tensor.data.size(), elements) << name;
      }
      ++accepted;
    } catch (const Error& error) {
      EXPECT_EQ(error.kind(), ErrorKind::kCorruptData) << error.what();
      ++rejected;
    }
    fs::remove(path);
  }
  EXPECT_GT(accepted, 0);  // flips inside the data section stay loadable
  EXPECT_GT(rejected, 0);
}

TEST_F(SafetensorsTest, SaveRefusesBadInput) {
  const float x[2] = {1, 2};
  const fs::path path = dir_ / "bad.safetensors";
  const Error duplicate = capture_error([&] {
    save_safetensors(path, {{"w", {1}, x}, {"w", {1}, x + 1}});
  });
  EXPECT_EQ(duplicate.kind(), ErrorKind::kInvalidArgument);
  expect_mentions(duplicate, {path.string(), "tensor w"});

  const Error negative = capture_error([&] { save_safetensors(path, {{"w", {2, -1}, x}}); });
  EXPECT_EQ(negative.kind(), ErrorKind::kInvalidArgument);
  expect_mentions(negative, {"tensor w", "[2, -1]"});

  const Error null_data = capture_error([&] { save_safetensors(path, {{"w", {2}, nullptr}}); });
  EXPECT_EQ(null_data.kind(), ErrorKind::kInvalidArgument);

  const Error reserved = capture_error([&] { save_safetensors(path, {{"__metadata__", {1}, x}}); });
  EXPECT_EQ(reserved.kind(), ErrorKind::kInvalidArgument);

  EXPECT_FALSE(fs::exists(path));
}

TEST_F(SafetensorsTest, SaveIntoMissingDirectoryIsIoError) {
  const float x = 1;
  const fs::path path = dir_ / "missing" / "model.safetensors";
  const Error error = capture_error([&] { save_safetensors(path, {{"w", {1}, &x}}); });
  EXPECT_EQ(error.kind(), ErrorKind::kIo);
  expect_mentions(error, {path.string()});
}

std::map<std::string, TensorF32> tensors_with_shapes(
    const std::vector<std::pair<std::string, std::vector<int64_t>>>& shapes) {
  std::map<std::string, TensorF32> tensors;
  for (const auto& [name, shape] : shapes) {
    size_t elements = 1;
    for (const int64_t dim : shape) elements *= static_cast<size_t>(dim);
    tensors[name] = TensorF32{shape, std::vector<float>(elements, 0.5f)};
  }
  return tensors;
}

TEST(CheckTensorSet, AcceptsExactMatch) {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> expected = {
      {"backbone.embedding.weight", {16, 8}}, {"backbone.norm_f.weight", {8}}, {"scalar", {}}};
  EXPECT_NO_THROW(check_tensor_set(tensors_with_shapes(expected), expected, "model.safetensors"));
}

TEST(CheckTensorSet, NamesMisShapedTensorAndBothShapes) {
  const auto loaded = tensors_with_shapes({{"backbone.layers.0.mixer.D", {8}}});
  const Error error = capture_error([&] {
    check_tensor_set(loaded, {{"backbone.layers.0.mixer.D", {16}}}, "model.safetensors");
  });
  EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
  EXPECT_STREQ(error.what(),
               "model.safetensors: tensor backbone.layers.0.mixer.D has shape [8], expected [16]");
}

TEST(CheckTensorSet, NamesMissingAndUnexpectedTensors) {
  const auto loaded = tensors_with_shapes({{"extra.bias", {3}}});
  const Error error = capture_error([&] {
    check_tensor_set(loaded, {{"lm_head.weight", {4, 2}}}, "ckpt/model.safetensors");
  });
  EXPECT_EQ(error.kind(), ErrorKind::kInvalidArgument);
  expect_mentions(error, {"ckpt/model.safetensors: missing tensor lm_head.weight", "[4, 2]",
                          "ckpt/model.safetensors: unexpected tensor extra.bias"});
}

TEST(CheckTensorSet, ReportsEveryProblemUpToTen) {
  const auto loaded = tensors_with_shapes({{"a", {2, 3}}, {"b", {1}}, {"x", {1}}});
  const Error error = capture_error([&] {
    check_tensor_set(loaded, {{"a", {3, 2}}, {"b", {1}}, {"c", {5}}}, "m.safetensors");
  });
  expect_mentions(error, {"tensor a has shape [2, 3], expected [3, 2]", "missing tensor c",
                          "unexpected tensor x"});
  EXPECT_EQ(std::string(error.what()).find("tensor b"), std::string::npos) << error.what();

  std::vector<std::pair<std::string, std::vector<int64_t>>> many;
  for (int i = 0; i < 25; ++i) many.push_back({fmt::format("t{}", 100 + i), {1}});
  const Error capped = capture_error([&] { check_tensor_set({}, many, "m.safetensors"); });
  const std::string message = capped.what();
  EXPECT_NE(message.find("missing tensor t109"), std::string::npos) << message;
  EXPECT_EQ(message.find("missing tensor t110"), std::string::npos) << message;
  EXPECT_NE(message.find("15 more"), std::string::npos) << message;
}

TEST(CheckTensorSet, RefusesDataThatDisagreesWithShape) {
  std::map<std::string, TensorF32> loaded;
  loaded["w"] = TensorF32{{2, 2}, std::vector<float>(3)};
  const Error error = capture_error([&] { check_tensor_set(loaded, {{"w", {2, 2}}}, "m"); });
  expect_mentions(error, {"tensor w", "3 values", "4"});
}

}  // namespace
}  // namespace megacpp
