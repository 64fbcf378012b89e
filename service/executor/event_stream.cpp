#include "service/executor/event_stream.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl.h>
#include <unistd.h>

#include <cerrno>
#include <string>

namespace megacpp::executor {

bool write_event(int fd, const megacpp::v1::ExecutorEvent& event) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream raw(&bytes);
    google::protobuf::io::CodedOutputStream out(&raw);
    out.WriteVarint32(static_cast<uint32_t>(event.ByteSizeLong()));
    event.SerializeWithCachedSizes(&out);
  }
  // One write per message where the pipe allows it (≤ PIPE_BUF is atomic); loop
  // for larger ones.
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

struct EventReader::Impl {
  explicit Impl(int fd) : file(fd) {}
  google::protobuf::io::FileInputStream file;
};

EventReader::EventReader(int fd) : impl_(new Impl(fd)) {}
EventReader::~EventReader() {
  delete impl_;
}

std::optional<megacpp::v1::ExecutorEvent> EventReader::next() {
  google::protobuf::io::CodedInputStream in(&impl_->file);
  uint32_t size = 0;
  if (!in.ReadVarint32(&size)) return std::nullopt;
  constexpr uint32_t kMaxEvent = 16u << 20;
  if (size > kMaxEvent) return std::nullopt;
  // The whole frame before parsing: under a pushed limit protobuf takes end of file for a
  // legitimate end of message, so an executor killed mid-write would hand over the fields it
  // got out (a cut log line or summary) as a complete event.
  std::string frame;
  if (!in.ReadString(&frame, static_cast<int>(size))) return std::nullopt;
  megacpp::v1::ExecutorEvent event;
  if (!event.ParseFromString(frame)) return std::nullopt;
  return event;
}

}  // namespace megacpp::executor
