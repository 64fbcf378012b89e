#include "service/job_states.h"

#include <google/protobuf/descriptor.h>

#include <cctype>
#include <vector>

namespace megacpp {

namespace {

struct StateTable {
  std::string unspecified;
  std::vector<v1::JobState> states;  // without JOB_STATE_UNSPECIFIED
  std::vector<std::string> names;    // names[i] belongs to states[i]
  std::string list;
};

std::string lowercase(std::string_view text) {
  std::string out(text);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

const StateTable& table() {
  static const StateTable t = [] {
    constexpr std::string_view kPrefix = "JOB_STATE_";
    StateTable out;
    const google::protobuf::EnumDescriptor* descriptor = v1::JobState_descriptor();
    for (int i = 0; i < descriptor->value_count(); ++i) {
      const google::protobuf::EnumValueDescriptor* value = descriptor->value(i);
      std::string_view name = value->name();
      if (name.substr(0, kPrefix.size()) == kPrefix) name.remove_prefix(kPrefix.size());
      if (value->number() == v1::JOB_STATE_UNSPECIFIED) {
        out.unspecified = lowercase(name);
        continue;
      }
      out.states.push_back(static_cast<v1::JobState>(value->number()));
      out.names.push_back(lowercase(name));
      out.list += (out.list.empty() ? "" : ", ") + out.names.back();
    }
    return out;
  }();
  return t;
}

}  // namespace

const std::string& job_state_name(v1::JobState state) {
  const StateTable& t = table();
  for (size_t i = 0; i < t.states.size(); ++i) {
    if (t.states[i] == state) return t.names[i];
  }
  return t.unspecified;
}

std::span<const v1::JobState> job_states() {
  return table().states;
}

std::optional<v1::JobState> find_job_state(std::string_view name) {
  const StateTable& t = table();
  const std::string wanted = lowercase(name);
  for (size_t i = 0; i < t.names.size(); ++i) {
    if (t.names[i] == wanted) return t.states[i];
  }
  return std::nullopt;
}

std::string job_state_list() {
  return table().list;
}

}  // namespace megacpp
