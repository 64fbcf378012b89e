#pragma once
// Error messages for the CUDA host code. megacpp::fail formats through libfmt,
// whose compiled part megacpp_cuda does not link (and whose shared library
// precedes it on link lines): these format the same "{}" placeholders with
// iostreams and throw the same megacpp::Error.
#include <cstring>
#include <sstream>

#include "runtime/common/error.h"

namespace megacpp::cuda::detail {

inline void format_into(std::ostringstream& out, const char* format) { out << format; }

template <class First, class... Rest>
void format_into(std::ostringstream& out, const char* format, const First& first,
                 const Rest&... rest) {
  const char* hole = std::strstr(format, "{}");
  if (hole == nullptr) {
    out << format;
    return;
  }
  out.write(format, hole - format);
  out << first;
  format_into(out, hole + 2, rest...);
}

template <class... Args>
[[noreturn]] void refuse(ErrorKind kind, const char* format, const Args&... args) {
  std::ostringstream out;
  format_into(out, format, args...);
  throw Error(kind, out.str());
}

}  // namespace megacpp::cuda::detail
