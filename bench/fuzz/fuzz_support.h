#pragma once
// What the libFuzzer harnesses share: scratch files for the readers that take a path, and the
// rule for what counts as a bug.
//
// The readers open, stat, pread and mmap their files themselves, so each harness writes its
// input to a real file and hands over the path: the code under test is exactly what runs on a
// user's file. One file per harness is rewritten in place for every input (a few syscalls),
// in a private scratch directory (ScratchDir).
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <string_view>
#include <typeinfo>

#include "base/error.h"

namespace megacpp::fuzz {

// Prints why and aborts: libFuzzer saves the input that got here as a crash.
[[noreturn]] inline void bug(std::string_view what) {
  std::fprintf(stderr, "fuzz: BUG: %.*s\n", static_cast<int>(what.size()), what.data());
  std::abort();
}

inline std::string_view kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument:
      return "kInvalidArgument";
    case ErrorKind::kNotFound:
      return "kNotFound";
    case ErrorKind::kCorruptData:
      return "kCorruptData";
    case ErrorKind::kFailedPrecondition:
      return "kFailedPrecondition";
    case ErrorKind::kIo:
      return "kIo";
    case ErrorKind::kInternal:
      return "kInternal";
  }
  return "unknown";
}

// Runs `body`. Bad input must come back as an Error of one of the `allowed` kinds with a message
// (the daemon turns those into INVALID_ARGUMENT naming the field); any other exception escaping a
// parser (a JSON type_error, out_of_range, bad_alloc, an Error of another kind) becomes INTERNAL
// with no useful message, or kills the process, so it is a bug.
template <typename Body>
void expect_clean(Body&& body, std::initializer_list<ErrorKind> allowed) {
  try {
    body();
  } catch (const Error& e) {
    for (const ErrorKind kind : allowed) {
      if (e.kind() == kind) {
        if (std::string_view(e.what()).empty()) bug("an Error with an empty message");
        return;
      }
    }
    bug(std::string("an Error of kind ") + std::string(kind_name(e.kind())) + ": " + e.what());
  } catch (const std::exception& e) {
    bug(std::string("a ") + typeid(e).name() + " escaped the parser: " + e.what());
  }
}

// A private directory, removed with everything in it at a normal exit: under
// $MEGACPP_FUZZ_SCRATCH when set (run.sh sets it, and removes it after a crash, which skips
// destructors), else in /dev/shm where there is one (rewriting a file a million times on a disk
// file system is I/O bound), else in $TMPDIR.
class ScratchDir {
 public:
  ScratchDir() {
    std::error_code ec;
    std::filesystem::path base = std::filesystem::temp_directory_path();
    if (const char* scratch = std::getenv("MEGACPP_FUZZ_SCRATCH"); scratch && *scratch) {
      base = scratch;
    } else if (std::filesystem::is_directory("/dev/shm", ec) && ::access("/dev/shm", W_OK) == 0) {
      base = "/dev/shm";
    }
    std::string pattern = (base / "megacpp-fuzz-XXXXXX").string();
    if (::mkdtemp(pattern.data()) == nullptr) bug("cannot create a scratch directory");
    path_ = pattern;
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A file whose whole content is replaced by set(); kept open so that costs no open/close.
class ScratchFile {
 public:
  explicit ScratchFile(std::filesystem::path path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd_ < 0) bug("cannot create a scratch file");
  }
  ~ScratchFile() { ::close(fd_); }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

  // Overwrites, then cuts to length: truncating to 0 first would make ext4 flush the file to
  // disk each time a reader closes it (its replace-via-truncate heuristic).
  void set(const std::uint8_t* data, std::size_t size) const {
    std::size_t done = 0;
    while (done < size) {
      const ssize_t n = ::pwrite(fd_, data + done, size - done, static_cast<off_t>(done));
      if (n <= 0) bug("cannot write a scratch file");
      done += static_cast<std::size_t>(n);
    }
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) bug("cannot truncate a scratch file");
  }
  const std::filesystem::path& path() const { return path_; }
  // Positioned at offset 0, for readers that take a descriptor.
  int rewound_fd() const {
    if (::lseek(fd_, 0, SEEK_SET) != 0) bug("cannot rewind a scratch file");
    return fd_;
  }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace megacpp::fuzz
