#include "cli/commands/output.h"

#include <google/protobuf/util/json_util.h>

#include <fmt/format.h>
#include <cstdint>
#include <iostream>

#include "service/job_states.h"

namespace megacpp::cli {

void print(bool as_json, const nlohmann::json& json, const std::string& human) {
  if (as_json) {
    std::cout << json.dump(2) << "\n";
  } else {
    std::cout << human;
  }
}

std::string to_json(const google::protobuf::Message& message) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.add_whitespace = true;
  (void)google::protobuf::util::MessageToJsonString(message, &out, options);
  return out;
}

void print_json(const google::protobuf::Message& message) {
  std::cout << to_json(message) << "\n";
}

std::string duration_text(double seconds) {
  if (seconds < 0 || seconds > 1e7) return "--:--";
  const auto s = static_cast<int64_t>(seconds);
  return s >= 3600 ? fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60)
                   : fmt::format("{}:{:02d}", s / 60, s % 60);
}

void print_job(const v1::Job& job) {
  fmt::print("{}  {}  step {}/{}  loss {:.4f}  {:.0f} tok/s  attempts {}  devices [{}]\n", job.id(),
             job_state_name(job.state()), job.step(), job.total_steps(), job.loss(),
             job.tokens_per_s(), job.attempts(), fmt::join(job.devices(), ","));
  if (!job.error().empty()) fmt::print("  error: {}\n", job.error());
}

}  // namespace megacpp::cli
