#include "service/executor/event_stream.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <string>

namespace megacpp::executor {
namespace {

using megacpp::v1::ExecutorEvent;

// A pipe whose read end is handed to EventReader after the writer has written and closed.
class Pipe {
 public:
  Pipe() { EXPECT_EQ(::pipe(fds_), 0); }
  ~Pipe() {
    close_write();
    ::close(fds_[0]);
  }
  int read_fd() const { return fds_[0]; }
  int write_fd() const { return fds_[1]; }
  void write_bytes(const std::string& bytes) {
    ASSERT_EQ(::write(fds_[1], bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  }
  void close_write() {
    if (fds_[1] >= 0) ::close(fds_[1]);
    fds_[1] = -1;
  }

 private:
  int fds_[2] = {-1, -1};
};

std::string varint(uint32_t value) {
  std::string out;
  google::protobuf::io::StringOutputStream raw(&out);
  google::protobuf::io::CodedOutputStream coded(&raw);
  coded.WriteVarint32(value);
  coded.Trim();
  return out;
}

ExecutorEvent log_line(const std::string& text) {
  ExecutorEvent event;
  event.set_log_line(text);
  return event;
}

TEST(EventStream, RoundTripsEventsInOrder) {
  Pipe pipe;
  ExecutorEvent step;
  step.mutable_step()->set_step(7);
  step.mutable_step()->set_loss(2.5);
  ASSERT_TRUE(write_event(pipe.write_fd(), step));
  ASSERT_TRUE(write_event(pipe.write_fd(), log_line("hello")));
  pipe.close_write();
  EventReader reader(pipe.read_fd());
  auto first = reader.next();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->step().step(), 7);
  EXPECT_EQ(first->step().loss(), 2.5);
  auto second = reader.next();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->log_line(), "hello");
  EXPECT_FALSE(reader.next().has_value());
}

// A failure's message quoting a corrupt file's bytes (nlohmann's "last read: '...'") is not valid
// UTF-8, which the reader's parser refuses: the stream ended there and the job's error was lost.
// The writer replaces each byte that starts no valid sequence with U+FFFD and keeps the rest.
TEST(EventStream, TextThatIsNotUtf8ArrivesWithReplacementCharacters) {
  Pipe pipe;
  ExecutorEvent failed;
  failed.set_failed("state.json: parse error, last read: '\xff\xfe' \xC3\xA9t\xC3\xA9 \xE2\x82");
  ASSERT_TRUE(write_event(pipe.write_fd(), failed));
  ExecutorEvent checkpoint;
  checkpoint.mutable_checkpoint()->set_dir("/runs/\xC0\xAF/step-1");  // an overlong '/'
  ASSERT_TRUE(write_event(pipe.write_fd(), checkpoint));
  ASSERT_TRUE(write_event(pipe.write_fd(), log_line("after")));
  pipe.close_write();
  EventReader reader(pipe.read_fd());
  auto first = reader.next();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->failed(),
            "state.json: parse error, last read: '\uFFFD\uFFFD' \u00e9t\u00e9 \uFFFD\uFFFD");
  auto second = reader.next();
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->checkpoint().dir(), "/runs/\uFFFD\uFFFD/step-1");
  auto third = reader.next();
  ASSERT_TRUE(third.has_value());
  EXPECT_EQ(third->log_line(), "after");
}

// Found by bench/fuzz/event_stream_fuzz: a frame cut short by end of file (an executor killed
// mid-write) was returned as a whole event holding only the fields before the cut.
TEST(EventStream, RefusesAFrameCutShortByEndOfFile) {
  Pipe pipe;
  ASSERT_TRUE(write_event(pipe.write_fd(), log_line("complete")));
  const std::string cut = log_line("cut").SerializeAsString();
  pipe.write_bytes(varint(static_cast<uint32_t>(cut.size() + 5)) + cut);
  pipe.close_write();
  EventReader reader(pipe.read_fd());
  auto first = reader.next();
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->log_line(), "complete");
  EXPECT_FALSE(reader.next().has_value());
}

TEST(EventStream, EndsAtAMalformedOrOversizedFrame) {
  {
    Pipe pipe;
    pipe.write_bytes(varint(2) + std::string("\xff\xff", 2));  // an invalid tag
    pipe.close_write();
    EventReader reader(pipe.read_fd());
    EXPECT_FALSE(reader.next().has_value());
  }
  {
    Pipe pipe;
    pipe.write_bytes(varint((16u << 20) + 1));
    pipe.close_write();
    EventReader reader(pipe.read_fd());
    EXPECT_FALSE(reader.next().has_value());
  }
}

}  // namespace
}  // namespace megacpp::executor
