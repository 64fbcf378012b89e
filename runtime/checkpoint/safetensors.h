#pragma once
// The safetensors file format (huggingface/safetensors): an 8-byte little-endian header length
// n, n bytes of JSON mapping each tensor name to {"dtype", "shape", "data_offsets": [begin,
// end]} (offsets relative to the first byte after the header) plus an optional
// "__metadata__" string-to-string map, then the tensor bytes, little-endian, row-major.
//
// Files are read as hostile input: every number in the header is checked against the file
// before it is used, and the tensors must tile the data section exactly (no overlap, no gap,
// nothing after the last tensor), as the reference reader requires.
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace megacpp {

struct TensorF32 {
  std::vector<int64_t> shape;  // empty = scalar (one element)
  std::vector<float> data;     // row-major, product(shape) elements
};

// A tensor to save, borrowed from its owner for the duration of the call.
struct TensorRef {
  std::string name;
  std::vector<int64_t> shape;
  const float* data;  // product(shape) floats; may be null only when that product is 0
};

// Writes `tensors` as F32 in the given order, atomically (see write_file_atomically). The
// header is compact JSON with "__metadata__" first and then the tensors in file order, padded
// with spaces to a multiple of 8 bytes so every tensor starts 8-byte aligned. "format": "pt"
// is added to the metadata unless `metadata` sets "format" itself: transformers'
// from_pretrained refuses safetensors files whose metadata lacks a known format.
// Throws Error(kInvalidArgument) for an empty, reserved or duplicate name, a negative
// dimension, or null data for a non-empty tensor; Error(kIo) when the file cannot be written.
void save_safetensors(const std::filesystem::path& path, const std::vector<TensorRef>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// Reads every tensor of a safetensors file, converting F32, F64, F16 and BF16 to float (F16
// and BF16 exactly, F64 rounded to nearest). Fills `metadata` with "__metadata__" when given.
// Throws Error(kNotFound) / Error(kIo) when the file cannot be opened or read, and
// Error(kCorruptData) naming the file, the tensor and the offending bytes or values for any
// malformed header, unsupported dtype or inconsistent offsets.
std::map<std::string, TensorF32> load_safetensors(
    const std::filesystem::path& path, std::map<std::string, std::string>* metadata = nullptr);

// Checks that `loaded` holds exactly the `expected` tensors (name, shape). Throws
// Error(kInvalidArgument) listing, one per line and each prefixed with `file_label`, every
// missing, unexpected or mis-shaped tensor (the first 10, then a count of the rest), e.g.
// "model.safetensors: tensor backbone.layers.0.mixer.D has shape [8], expected [16]".
void check_tensor_set(const std::map<std::string, TensorF32>& loaded,
                      const std::vector<std::pair<std::string, std::vector<int64_t>>>& expected,
                      const std::string& file_label);

// "[2, 3]"; "[]" for a scalar.
std::string format_shape(const std::vector<int64_t>& shape);

}  // namespace megacpp
