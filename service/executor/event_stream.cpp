#include "service/executor/event_stream.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <string_view>

namespace megacpp::executor {
namespace {

// The length of the valid UTF-8 sequence at text[at] (1 to 4), or 0 when none starts there:
// overlong forms, surrogates and code points past U+10FFFF are invalid, as protobuf's check has
// them.
size_t utf8_sequence(std::string_view text, size_t at) {
  const auto byte = [&](size_t i) {
    return static_cast<unsigned char>(text[i]);
  };
  const unsigned char lead = byte(at);
  if (lead < 0x80) return 1;
  size_t length = 0;
  uint32_t code = 0, least = 0;
  if ((lead & 0xE0) == 0xC0) {
    length = 2, code = lead & 0x1Fu, least = 0x80;
  } else if ((lead & 0xF0) == 0xE0) {
    length = 3, code = lead & 0x0Fu, least = 0x800;
  } else if ((lead & 0xF8) == 0xF0) {
    length = 4, code = lead & 0x07u, least = 0x10000;
  } else {
    return 0;
  }
  if (at + length > text.size()) return 0;
  for (size_t i = 1; i < length; ++i) {
    if ((byte(at + i) & 0xC0) != 0x80) return 0;
    code = (code << 6) | (byte(at + i) & 0x3Fu);
  }
  if (code < least || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return 0;
  return length;
}

// `text` with every byte that starts no valid UTF-8 sequence replaced by U+FFFD.
std::string valid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t at = 0; at < text.size();) {
    const size_t length = utf8_sequence(text, at);
    if (length == 0) {
      out += "\xEF\xBF\xBD";
      ++at;
    } else {
      out.append(text.substr(at, length));
      at += length;
    }
  }
  return out;
}

bool is_valid_utf8(std::string_view text) {
  for (size_t at = 0; at < text.size();) {
    const size_t length = utf8_sequence(text, at);
    if (length == 0) return false;
    at += length;
  }
  return true;
}

// Makes every string field of `message` (nested messages included) valid UTF-8. A proto3
// string must be: the daemon's parser refuses a message with one that is not, and the stream
// ended there, losing, for one, a failure's message quoting a corrupt file's bytes.
void make_text_valid(google::protobuf::Message& message) {
  using google::protobuf::FieldDescriptor;
  const auto* descriptor = message.GetDescriptor();
  const auto* reflection = message.GetReflection();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor* field = descriptor->field(i);
    if (field->is_repeated()) {
      const int n = reflection->FieldSize(message, field);
      for (int k = 0; k < n; ++k) {
        if (field->type() == FieldDescriptor::TYPE_STRING) {
          const std::string text = reflection->GetRepeatedString(message, field, k);
          if (!is_valid_utf8(text)) {
            reflection->SetRepeatedString(&message, field, k, valid_utf8(text));
          }
        } else if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
          make_text_valid(*reflection->MutableRepeatedMessage(&message, field, k));
        }
      }
    } else if (field->type() == FieldDescriptor::TYPE_STRING) {
      const std::string text = reflection->GetString(message, field);
      if (!is_valid_utf8(text)) reflection->SetString(&message, field, valid_utf8(text));
    } else if (field->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE &&
               reflection->HasField(message, field)) {
      make_text_valid(*reflection->MutableMessage(&message, field));
    }
  }
}

}  // namespace

bool write_event(int fd, const megacpp::v1::ExecutorEvent& event) {
  megacpp::v1::ExecutorEvent valid = event;
  make_text_valid(valid);
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream raw(&bytes);
    google::protobuf::io::CodedOutputStream out(&raw);
    out.WriteVarint32(static_cast<uint32_t>(valid.ByteSizeLong()));
    valid.SerializeWithCachedSizes(&out);
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
