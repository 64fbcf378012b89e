#pragma once
// The executor → daemon protocol: ExecutorEvent messages (proto/megacpp/v1/
// executor.proto), each preceded by its varint length, over a pipe.
#include <optional>

#include "megacpp/v1/executor.pb.h"

namespace megacpp::executor {

// Writes one event, its text made valid UTF-8 first (a byte that starts no valid sequence
// becomes U+FFFD: the reader's parser refuses a string that is not, and its stream ends there).
// Returns false when the reader is gone (EPIPE): the daemon died, and the executor should
// checkpoint and stop.
bool write_event(int fd, const megacpp::v1::ExecutorEvent& event);

// Reads events from a pipe until end of file. Blocking; one reader per fd.
class EventReader {
 public:
  explicit EventReader(int fd);
  ~EventReader();
  EventReader(const EventReader&) = delete;
  EventReader& operator=(const EventReader&) = delete;
  // The next event, or nullopt at end of stream (or on a malformed message,
  // which ends the stream: the writer is not trusted to resynchronize).
  std::optional<megacpp::v1::ExecutorEvent> next();

 private:
  struct Impl;
  Impl* impl_;
};

}  // namespace megacpp::executor
