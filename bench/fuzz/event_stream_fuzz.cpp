// libFuzzer target: the bytes an executor writes to the daemon (varint-length-delimited
// ExecutorEvent messages) through EventReader, as the daemon reads a job's event pipe.
//
// Beyond not crashing, the decoder must agree with the framing it documents: every event it
// returns is one whole frame, parsed from exactly its length-prefixed bytes, in order, and the
// stream ends at the first frame that is malformed or incomplete. A reference decoder over the
// same bytes (whole-frame reads from memory) is the oracle. Decoded events must also survive
// write_event and a second read unchanged.
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/fuzz/fuzz_support.h"
#include "megacpp/v1/executor.pb.h"
#include "service/executor/event_stream.h"

namespace fuzz = megacpp::fuzz;
using megacpp::v1::ExecutorEvent;

namespace {

// The same limit as event_stream.cpp: a frame claiming more ends the stream.
constexpr std::uint32_t kMaxEvent = 16u << 20;

std::vector<std::string> reference_decode(const std::uint8_t* data, std::size_t size) {
  std::vector<std::string> events;
  google::protobuf::io::ArrayInputStream array(data, static_cast<int>(size));
  google::protobuf::io::CodedInputStream in(&array);
  for (;;) {
    std::uint32_t length = 0;
    if (!in.ReadVarint32(&length) || length > kMaxEvent) break;
    std::string frame;
    if (!in.ReadString(&frame, static_cast<int>(length))) break;
    ExecutorEvent event;
    if (!event.ParseFromString(frame)) break;
    events.push_back(event.SerializeAsString());
  }
  return events;
}

std::vector<ExecutorEvent> decode(int fd) {
  std::vector<ExecutorEvent> events;
  megacpp::executor::EventReader reader(fd);
  while (auto event = reader.next()) events.push_back(std::move(*event));
  return events;
}

}  // namespace

// protobuf logs every string field that is not UTF-8 before refusing it; at a million inputs
// that is noise that hides real reports and costs more than the parse.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const fuzz::ScratchDir dir;
  static const fuzz::ScratchFile input(dir.path() / "events");
  static const fuzz::ScratchFile output(dir.path() / "events.rewritten");
  input.set(data, size);
  const std::vector<ExecutorEvent> events = decode(input.rewound_fd());

  const std::vector<std::string> expected = reference_decode(data, size);
  if (events.size() != expected.size()) {
    fuzz::bug("EventReader returned " + std::to_string(events.size()) +
              " events where the framing holds " + std::to_string(expected.size()) + " whole ones");
  }
  for (std::size_t i = 0; i < events.size(); ++i) {
    if (events[i].SerializeAsString() != expected[i]) {
      fuzz::bug("event " + std::to_string(i) + " differs from the bytes of its frame");
    }
  }

  output.set(nullptr, 0);
  const int out_fd = output.rewound_fd();
  for (const ExecutorEvent& event : events) {
    if (!megacpp::executor::write_event(out_fd, event)) fuzz::bug("write_event failed on a file");
  }
  const std::vector<ExecutorEvent> again = decode(output.rewound_fd());
  if (again.size() != events.size()) fuzz::bug("write_event then next() lost events");
  for (std::size_t i = 0; i < events.size(); ++i) {
    if (again[i].SerializeAsString() != expected[i]) fuzz::bug("an event changed in a round trip");
  }
  return 0;
}
