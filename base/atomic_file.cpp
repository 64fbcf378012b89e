#include "base/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <string>
#include <system_error>
#include <utility>

#include "base/error.h"

namespace megacpp {
namespace {

namespace fs = std::filesystem;

[[noreturn]] void fail_write(const fs::path& path, std::string_view step, int error_number) {
  fail(ErrorKind::kIo, "cannot write {}: {}: {}", path.string(), step,
       describe_errno(error_number));
}

// Linux refuses single writes above about 2 GiB; smaller calls also keep EINTR retries cheap.
constexpr std::size_t kMaxWriteCall = std::size_t{1} << 30;

// The temporary file, removed on every path that does not end in a successful rename.
class TemporaryFile {
 public:
  explicit TemporaryFile(const fs::path& target) : target_(target) {
    fs::path directory = target.parent_path();
    if (directory.empty()) directory = ".";
    // Long target names are cut so the temporary name stays under NAME_MAX.
    const std::string stem = target.filename().string().substr(0, 100);
    static std::atomic<unsigned long> counter{0};
    for (int attempt = 0; attempt < 100; ++attempt) {
      const auto clock_ticks = std::chrono::steady_clock::now().time_since_epoch().count();
      path_ = directory / fmt::format(".{}.tmp.{}.{}.{}", stem, static_cast<long>(::getpid()),
                                      counter.fetch_add(1), clock_ticks);
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd_ >= 0) return;
      if (errno != EEXIST && errno != EINTR) {
        fail_write(target_, fmt::format("cannot create temporary file {}", path_.string()), errno);
      }
    }
    fail(ErrorKind::kIo, "cannot write {}: no unused temporary file name in {}", target_.string(),
         directory.string());
  }

  TemporaryFile(const TemporaryFile&) = delete;
  TemporaryFile& operator=(const TemporaryFile&) = delete;

  ~TemporaryFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!renamed_) ::unlink(path_.c_str());
  }

  void write(std::string_view chunk) {
    while (!chunk.empty()) {
      const std::size_t request = chunk.size() < kMaxWriteCall ? chunk.size() : kMaxWriteCall;
      const ssize_t written = ::write(fd_, chunk.data(), request);
      if (written < 0) {
        if (errno == EINTR) continue;
        fail_write(target_, fmt::format("write to {}", path_.string()), errno);
      }
      if (written == 0) {
        // A zero-byte write for a non-empty request would otherwise loop forever.
        fail_write(target_, fmt::format("write to {} made no progress", path_.string()), ENOSPC);
      }
      chunk.remove_prefix(static_cast<std::size_t>(written));
    }
  }

  void sync_close_and_rename() {
    while (::fsync(fd_) != 0) {
      if (errno != EINTR) fail_write(target_, fmt::format("fsync {}", path_.string()), errno);
    }
    const int fd = std::exchange(fd_, -1);
    // Linux releases the descriptor even when close reports EINTR, so it is not retried; other
    // errors (for example a deferred EIO on network filesystems) mean the data may be lost.
    if (::close(fd) != 0 && errno != EINTR) {
      fail_write(target_, fmt::format("close {}", path_.string()), errno);
    }
    if (::rename(path_.c_str(), target_.c_str()) != 0) {
      fail_write(target_, fmt::format("rename {} over it", path_.string()), errno);
    }
    renamed_ = true;
  }

 private:
  fs::path target_;
  fs::path path_;
  int fd_ = -1;
  bool renamed_ = false;
};

void sync_directory_of(const fs::path& target) {
  fs::path directory = target.parent_path();
  if (directory.empty()) directory = ".";
  const int fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    fail_write(target, fmt::format("open directory {} to sync the rename", directory.string()),
               errno);
  }
  int result = 0;
  while ((result = ::fsync(fd)) != 0 && errno == EINTR) {
  }
  const int sync_errno = errno;
  ::close(fd);
  // Some filesystems cannot sync a directory at all; there is nothing more to be done there.
  if (result != 0 && sync_errno != EINVAL && sync_errno != ENOTSUP) {
    fail_write(target, fmt::format("fsync directory {}", directory.string()), sync_errno);
  }
}

}  // namespace

void write_file_atomically(const fs::path& path,
                           const std::function<void(const ByteSink& sink)>& produce) {
  {
    TemporaryFile temporary(path);
    const ByteSink sink = [&temporary](std::string_view chunk) {
      temporary.write(chunk);
    };
    produce(sink);
    temporary.sync_close_and_rename();
  }
  sync_directory_of(path);
}

void rename_durably(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    fail_write(to, fmt::format("rename {} to it", from.string()), errno);
  }
  sync_directory_of(to);
}

void write_file_atomically(const fs::path& path, std::string_view bytes) {
  write_file_atomically(path, [bytes](const ByteSink& sink) { sink(bytes); });
}

std::string read_file(const fs::path& path) {
  int fd = -1;
  while ((fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC)) < 0 && errno == EINTR) {
  }
  if (fd < 0) {
    const int open_errno = errno;
    if (open_errno == ENOENT || open_errno == ENOTDIR) {
      fail(ErrorKind::kNotFound, "cannot read {}: no such file", path.string());
    }
    fail(ErrorKind::kIo, "cannot read {}: {}", path.string(), describe_errno(open_errno));
  }
  std::string content;
  struct stat info {};
  if (::fstat(fd, &info) == 0 && info.st_size > 0) {
    content.resize(static_cast<std::size_t>(info.st_size));
  }
  // Fill the size fstat reported, then keep reading until end of file rather than trusting it:
  // the file may have grown, and pipes or procfs files report no size at all.
  std::size_t filled = 0;
  char overflow[1 << 16];
  for (;;) {
    const bool in_reported_size = filled < content.size();
    char* destination = in_reported_size ? content.data() + filled : overflow;
    const std::size_t room = in_reported_size ? content.size() - filled : sizeof(overflow);
    const ssize_t got = ::read(fd, destination, room);
    if (got < 0) {
      if (errno == EINTR) continue;
      const int read_errno = errno;
      ::close(fd);
      fail(ErrorKind::kIo, "cannot read {}: {}", path.string(), describe_errno(read_errno));
    }
    if (got == 0) break;
    if (in_reported_size) {
      filled += static_cast<std::size_t>(got);
    } else {
      content.append(overflow, static_cast<std::size_t>(got));
      filled = content.size();
    }
  }
  content.resize(filled);
  ::close(fd);
  return content;
}

}  // namespace megacpp
