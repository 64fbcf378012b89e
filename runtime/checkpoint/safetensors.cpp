#include "runtime/checkpoint/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <system_error>

#include "base/atomic_file.h"
#include "base/error.h"

namespace megacpp {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; this reader copies it as is");
static_assert(sizeof(float) == 4 && sizeof(double) == 8);

// The reference implementation refuses larger headers; real ones are at most a few MB.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// More dimensions than any real tensor has; bounds what a hostile header can make us allocate.
constexpr int kMaxArrayElements = 64;
constexpr int kMaxProblemsListed = 10;
constexpr std::string_view kMetadataKey = "__metadata__";

enum class Dtype { kF32, kF64, kF16, kBF16 };

struct DtypeInfo {
  std::string_view name;
  Dtype dtype;
  uint64_t size;
};

constexpr DtypeInfo kLoadableDtypes[] = {{"F32", Dtype::kF32, 4},
                                         {"F64", Dtype::kF64, 8},
                                         {"F16", Dtype::kF16, 2},
                                         {"BF16", Dtype::kBF16, 2}};

// Exact: every binary16 value, subnormals, infinities and NaN payloads included, is a float.
float half_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) {
    // Rebias from 15 to 127.
    return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  // Zero or subnormal: mantissa * 2^-24, a product float represents exactly.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return std::bit_cast<float>(sign | std::bit_cast<uint32_t>(magnitude));
}

float bfloat16_to_float(uint16_t value) {
  return std::bit_cast<float>(static_cast<uint32_t>(value) << 16);
}

// An open file read with positioned reads, so a multi-GB checkpoint is never held twice.
class InputFile {
 public:
  explicit InputFile(const fs::path& path) : path_(path) {
    while ((fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC)) < 0 && errno == EINTR) {
    }
    if (fd_ < 0) {
      const int open_errno = errno;
      if (open_errno == ENOENT || open_errno == ENOTDIR) {
        fail(ErrorKind::kNotFound, "cannot read {}: no such file", path.string());
      }
      fail(ErrorKind::kIo, "cannot read {}: {}", path.string(), describe_errno(open_errno));
    }
    struct stat info {};
    if (::fstat(fd_, &info) != 0) {
      const int stat_errno = errno;
      ::close(fd_);
      fail(ErrorKind::kIo, "cannot read {}: {}", path.string(), describe_errno(stat_errno));
    }
    if (!S_ISREG(info.st_mode)) {
      ::close(fd_);
      fail(ErrorKind::kIo, "cannot read {}: not a regular file", path.string());
    }
    size_ = static_cast<uint64_t>(info.st_size);
  }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;
  ~InputFile() { ::close(fd_); }

  uint64_t size() const { return size_; }

  void read_exact(uint64_t offset, void* destination, uint64_t length) const {
    auto* bytes = static_cast<char*>(destination);
    while (length > 0) {
      const uint64_t request = std::min<uint64_t>(length, uint64_t{1} << 30);
      const ssize_t got =
          ::pread(fd_, bytes, static_cast<size_t>(request), static_cast<off_t>(offset));
      if (got < 0) {
        if (errno == EINTR) continue;
        fail(ErrorKind::kIo, "cannot read {} at byte {}: {}", path_.string(), offset,
             describe_errno(errno));
      }
      if (got == 0) {
        fail(ErrorKind::kIo, "cannot read {}: the file shrank to {} bytes while being read",
             path_.string(), offset);
      }
      bytes += got;
      offset += static_cast<uint64_t>(got);
      length -= static_cast<uint64_t>(got);
    }
  }

 private:
  fs::path path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

struct Entry {
  std::string name;
  DtypeInfo dtype;
  std::vector<int64_t> shape;
  uint64_t elements = 0;
  uint64_t begin = 0;  // relative to the start of the data section
  uint64_t end = 0;
};

// The checks run while parsing: a duplicate tensor name would otherwise silently replace the
// first entry, and deep nesting or long arrays would let a small file allocate a lot.
Json parse_header(const std::string& header, const std::string& file) {
  // nlohmann's lexer takes a NUL byte for the end of input and would accept anything after
  // it; JSON text never contains one (control characters in strings must be escaped).
  if (const size_t nul = header.find('\0'); nul != std::string::npos) {
    fail(ErrorKind::kCorruptData, "{}: header is not valid JSON: NUL byte at file byte {}", file,
         8 + nul);
  }
  std::set<std::string> seen_names;
  int elements_in_array = 0;
  const Json::parser_callback_t guard = [&](int depth, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (depth > 2) {
          fail(ErrorKind::kCorruptData,
               "{}: header nests JSON values {} levels deep; the safetensors format uses 3", file,
               depth + 1);
        }
        elements_in_array = 0;
        break;
      case Json::parse_event_t::key:
        if (depth == 1 && !seen_names.insert(parsed.get<std::string>()).second) {
          fail(ErrorKind::kCorruptData, "{}: header names tensor {} twice", file,
               parsed.get<std::string>());
        }
        break;
      case Json::parse_event_t::value:
        if (depth == 3 && ++elements_in_array > kMaxArrayElements) {
          fail(ErrorKind::kCorruptData, "{}: header has an array longer than {} elements", file,
               kMaxArrayElements);
        }
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return Json::parse(header, guard);
  } catch (const Json::exception& error) {
    fail(ErrorKind::kCorruptData, "{}: header ({} bytes from byte 8) is not valid JSON: {}", file,
         header.size(), error.what());
  }
}

uint64_t header_uint(const Json& value, const std::string& file, const std::string& tensor,
                     std::string_view field) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer()) {
    fail(ErrorKind::kCorruptData, "{}: tensor {}: {} holds the negative value {}", file, tensor,
         field, value.get<int64_t>());
  }
  fail(ErrorKind::kCorruptData, "{}: tensor {}: {} holds {}, not a non-negative integer", file,
       tensor, field, value.dump());
}

Entry parse_entry(const std::string& name, const Json& info, const std::string& file) {
  if (!info.is_object()) {
    fail(ErrorKind::kCorruptData, "{}: tensor {}: header entry is {}, not an object", file, name,
         info.type_name());
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!info.contains(field)) {
      fail(ErrorKind::kCorruptData, "{}: tensor {}: header entry has no \"{}\"", file, name, field);
    }
  }
  Entry entry;
  entry.name = name;

  const Json& dtype = info["dtype"];
  if (!dtype.is_string()) {
    fail(ErrorKind::kCorruptData, "{}: tensor {}: dtype is {}, not a string", file, name,
         dtype.dump());
  }
  const auto& dtype_name = dtype.get_ref<const std::string&>();
  const auto* known = std::find_if(std::begin(kLoadableDtypes), std::end(kLoadableDtypes),
                                   [&](const DtypeInfo& d) { return d.name == dtype_name; });
  if (known == std::end(kLoadableDtypes)) {
    fail(ErrorKind::kCorruptData,
         "{}: tensor {}: dtype {} cannot be loaded as float (supported: F32, F64, F16, BF16)", file,
         name, dtype.dump());
  }
  entry.dtype = *known;

  const Json& shape = info["shape"];
  if (!shape.is_array()) {
    fail(ErrorKind::kCorruptData, "{}: tensor {}: shape is {}, not an array", file, name,
         shape.dump());
  }
  bool any_zero = false;
  uint64_t elements = 1;
  bool overflow = false;
  for (const Json& dim_value : shape) {
    const uint64_t dim = header_uint(dim_value, file, name, "shape");
    if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) overflow = true;
    entry.shape.push_back(static_cast<int64_t>(dim));
    if (dim == 0) any_zero = true;
    if (dim != 0 && elements > std::numeric_limits<uint64_t>::max() / dim) overflow = true;
    if (!overflow) elements *= dim;
  }
  if (any_zero) {
    elements = 0;
  } else if (overflow || elements > std::numeric_limits<uint64_t>::max() / entry.dtype.size) {
    fail(ErrorKind::kCorruptData, "{}: tensor {}: shape {} has more bytes than fit in 64 bits",
         file, name, shape.dump());
  }
  entry.elements = elements;

  const Json& offsets = info["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    fail(ErrorKind::kCorruptData, "{}: tensor {}: data_offsets is {}, not [begin, end]", file, name,
         offsets.dump());
  }
  entry.begin = header_uint(offsets[0], file, name, "data_offsets");
  entry.end = header_uint(offsets[1], file, name, "data_offsets");
  if (entry.end < entry.begin) {
    fail(ErrorKind::kCorruptData, "{}: tensor {}: data_offsets [{}, {}] end before they begin",
         file, name, entry.begin, entry.end);
  }
  const uint64_t needed = elements * entry.dtype.size;
  if (entry.end - entry.begin != needed) {
    fail(ErrorKind::kCorruptData,
         "{}: tensor {}: data_offsets [{}, {}] span {} bytes but shape {} of {} needs {}", file,
         name, entry.begin, entry.end, entry.end - entry.begin, format_shape(entry.shape),
         entry.dtype.name, needed);
  }
  return entry;
}

// The reference reader requires the tensors to tile the data section exactly; a gap or a
// trailing run of bytes is as suspicious as an overlap (a truncated or spliced file).
void check_tiling(std::vector<const Entry*> by_offset, uint64_t data_bytes, uint64_t data_start,
                  const std::string& file) {
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return std::tie(a->begin, a->end, a->name) < std::tie(b->begin, b->end, b->name);
  });
  uint64_t covered = 0;
  const Entry* previous = nullptr;
  for (const Entry* entry : by_offset) {
    if (entry->end > data_bytes) {
      fail(ErrorKind::kCorruptData,
           "{}: tensor {}: data_offsets [{}, {}] run past the data section, which holds {} "
           "bytes (file bytes [{}, {}))",
           file, entry->name, entry->begin, entry->end, data_bytes, data_start,
           data_start + data_bytes);
    }
    if (entry->begin < covered) {
      fail(ErrorKind::kCorruptData,
           "{}: tensor {}: data_offsets [{}, {}] overlap tensor {} at [{}, {}]", file, entry->name,
           entry->begin, entry->end, previous->name, previous->begin, previous->end);
    }
    if (entry->begin > covered) {
      fail(ErrorKind::kCorruptData,
           "{}: {} unused bytes in the data section at [{}, {}] before tensor {}", file,
           entry->begin - covered, covered, entry->begin, entry->name);
    }
    covered = entry->end;
    previous = entry;
  }
  if (covered != data_bytes) {
    fail(ErrorKind::kCorruptData,
         "{}: the data section holds {} bytes but the tensors cover only [0, {}]; {} bytes "
         "follow the last tensor",
         file, data_bytes, covered, data_bytes - covered);
  }
}

TensorF32 read_tensor(const InputFile& input, const Entry& entry, uint64_t data_start) {
  TensorF32 tensor;
  tensor.shape = entry.shape;
  tensor.data.resize(static_cast<size_t>(entry.elements));
  const uint64_t offset = data_start + entry.begin;
  const uint64_t bytes = entry.end - entry.begin;
  if (entry.dtype.dtype == Dtype::kF32) {
    input.read_exact(offset, tensor.data.data(), bytes);
    return tensor;
  }
  std::vector<unsigned char> raw(static_cast<size_t>(bytes));
  input.read_exact(offset, raw.data(), bytes);
  const size_t count = tensor.data.size();
  switch (entry.dtype.dtype) {
    case Dtype::kF64:
      for (size_t i = 0; i < count; ++i) {
        double value;
        std::memcpy(&value, raw.data() + 8 * i, 8);
        tensor.data[i] = static_cast<float>(value);
      }
      break;
    case Dtype::kF16:
    case Dtype::kBF16:
      for (size_t i = 0; i < count; ++i) {
        uint16_t bits;
        std::memcpy(&bits, raw.data() + 2 * i, 2);
        tensor.data[i] =
            entry.dtype.dtype == Dtype::kF16 ? half_to_float(bits) : bfloat16_to_float(bits);
      }
      break;
    case Dtype::kF32:
      break;
  }
  return tensor;
}

}  // namespace

std::string format_shape(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

void save_safetensors(const fs::path& path, const std::vector<TensorRef>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  const std::string file = path.string();
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  std::map<std::string, std::string> full_metadata = metadata;
  full_metadata.emplace("format", "pt");
  header[std::string(kMetadataKey)] = full_metadata;

  std::set<std::string_view> names;
  std::vector<uint64_t> tensor_bytes;
  uint64_t offset = 0;
  for (const TensorRef& tensor : tensors) {
    if (tensor.name.empty() || tensor.name == kMetadataKey) {
      fail(ErrorKind::kInvalidArgument, "cannot save {}: invalid tensor name \"{}\"", file,
           tensor.name);
    }
    if (!names.insert(tensor.name).second) {
      fail(ErrorKind::kInvalidArgument, "cannot save {}: tensor {} is listed twice", file,
           tensor.name);
    }
    uint64_t elements = 1;
    for (const int64_t dim : tensor.shape) {
      if (dim < 0) {
        fail(ErrorKind::kInvalidArgument, "cannot save {}: tensor {} has negative shape {}", file,
             tensor.name, format_shape(tensor.shape));
      }
      const auto udim = static_cast<uint64_t>(dim);
      if (udim != 0 && elements > (uint64_t{1} << 60) / udim) {
        fail(ErrorKind::kInvalidArgument, "cannot save {}: tensor {} shape {} is too large", file,
             tensor.name, format_shape(tensor.shape));
      }
      elements *= udim;
    }
    if (elements > 0 && tensor.data == nullptr) {
      fail(ErrorKind::kInvalidArgument, "cannot save {}: tensor {} of shape {} has no data", file,
           tensor.name, format_shape(tensor.shape));
    }
    const uint64_t bytes = elements * sizeof(float);
    header[tensor.name] = {
        {"dtype", "F32"}, {"shape", tensor.shape}, {"data_offsets", {offset, offset + bytes}}};
    tensor_bytes.push_back(bytes);
    offset += bytes;
  }

  std::string header_text;
  try {
    header_text = header.dump();
  } catch (const nlohmann::ordered_json::exception& error) {
    fail(ErrorKind::kInvalidArgument,
         "cannot save {}: a tensor name or metadata entry is not valid UTF-8: {}", file,
         error.what());
  }
  // Padding keeps every tensor 8-byte aligned in a memory-mapped file.
  header_text.append((8 - header_text.size() % 8) % 8, ' ');
  if (header_text.size() > kMaxHeaderBytes) {
    fail(ErrorKind::kInvalidArgument, "cannot save {}: header of {} bytes exceeds the {} limit",
         file, header_text.size(), kMaxHeaderBytes);
  }

  write_file_atomically(path, [&](const ByteSink& sink) {
    const uint64_t header_length = header_text.size();
    char length_bytes[8];
    std::memcpy(length_bytes, &header_length, 8);
    sink(std::string_view(length_bytes, 8));
    sink(header_text);
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensor_bytes[i] == 0) continue;
      sink(std::string_view(reinterpret_cast<const char*>(tensors[i].data),
                            static_cast<size_t>(tensor_bytes[i])));
    }
  });
}

std::map<std::string, TensorF32> load_safetensors(const fs::path& path,
                                                  std::map<std::string, std::string>* metadata) {
  const std::string file = path.string();
  const InputFile input(path);
  if (input.size() < 8) {
    fail(ErrorKind::kCorruptData,
         "{}: file is {} bytes, shorter than the 8-byte header length that starts it", file,
         input.size());
  }
  uint64_t header_length = 0;
  input.read_exact(0, &header_length, 8);
  if (header_length > kMaxHeaderBytes) {
    fail(ErrorKind::kCorruptData, "{}: header length {} exceeds the {}-byte limit", file,
         header_length, kMaxHeaderBytes);
  }
  if (header_length > input.size() - 8) {
    fail(ErrorKind::kCorruptData,
         "{}: header length {} runs past the end of the file ({} bytes, {} after the length)", file,
         header_length, input.size(), input.size() - 8);
  }
  std::string header_text(static_cast<size_t>(header_length), '\0');
  input.read_exact(8, header_text.data(), header_length);
  const Json header = parse_header(header_text, file);
  if (!header.is_object()) {
    fail(ErrorKind::kCorruptData, "{}: header is a JSON {}, not an object", file,
         header.type_name());
  }

  const uint64_t data_start = 8 + header_length;
  const uint64_t data_bytes = input.size() - data_start;
  std::vector<Entry> entries;
  std::map<std::string, std::string> file_metadata;
  for (const auto& [name, info] : header.items()) {
    if (name == kMetadataKey) {
      if (!info.is_object()) {
        fail(ErrorKind::kCorruptData, "{}: __metadata__ is {}, not an object", file,
             info.type_name());
      }
      for (const auto& [key, value] : info.items()) {
        if (!value.is_string()) {
          fail(ErrorKind::kCorruptData, "{}: __metadata__ entry {} is {}, not a string", file, key,
               value.dump());
        }
        file_metadata[key] = value.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(name, info, file));
  }
  std::vector<const Entry*> by_offset;
  by_offset.reserve(entries.size());
  for (const Entry& entry : entries) by_offset.push_back(&entry);
  check_tiling(std::move(by_offset), data_bytes, data_start, file);

  std::map<std::string, TensorF32> tensors;
  for (const Entry& entry : entries) {
    tensors.emplace(entry.name, read_tensor(input, entry, data_start));
  }
  if (metadata != nullptr) *metadata = std::move(file_metadata);
  return tensors;
}

void check_tensor_set(const std::map<std::string, TensorF32>& loaded,
                      const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected,
                      const std::string& file_label) {
  std::vector<std::string> problems;
  std::set<std::string_view> expected_names;
  for (const auto& [name, shape] : expected) {
    if (!expected_names.insert(name).second) {
      fail(ErrorKind::kInternal, "{}: the expected tensor list names {} twice", file_label, name);
    }
    const auto found = loaded.find(name);
    if (found == loaded.end()) {
      problems.push_back(
          fmt::format("missing tensor {} (expected shape {})", name, format_shape(shape)));
      continue;
    }
    const TensorF32& tensor = found->second;
    if (tensor.shape != shape) {
      problems.push_back(fmt::format("tensor {} has shape {}, expected {}", name,
                                     format_shape(tensor.shape), format_shape(shape)));
      continue;
    }
    uint64_t elements = 1;
    for (const int64_t dim : shape) elements *= static_cast<uint64_t>(dim);
    if (tensor.data.size() != elements) {
      problems.push_back(fmt::format("tensor {} of shape {} holds {} values instead of {}", name,
                                     format_shape(shape), tensor.data.size(), elements));
    }
  }
  for (const auto& [name, tensor] : loaded) {
    if (!expected_names.contains(name)) {
      problems.push_back(
          fmt::format("unexpected tensor {} of shape {}", name, format_shape(tensor.shape)));
    }
  }
  if (problems.empty()) return;

  std::string message;
  const size_t listed = std::min<size_t>(problems.size(), kMaxProblemsListed);
  for (size_t i = 0; i < listed; ++i) {
    if (i > 0) message += '\n';
    message += fmt::format("{}: {}", file_label, problems[i]);
  }
  if (problems.size() > listed) {
    message += fmt::format("\n{}: ... and {} more problems", file_label, problems.size() - listed);
  }
  throw Error(ErrorKind::kInvalidArgument, message);
}

}  // namespace megacpp
