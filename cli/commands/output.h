#pragma once
// How commands print: a human form on stdout by default, JSON with --json.
#include <google/protobuf/message.h>

#include <nlohmann/json.hpp>
#include <string>

#include "megacpp/v1/jobs.pb.h"

namespace megacpp::cli {

// `json` pretty-printed when as_json, else `human` as it is.
void print(bool as_json, const nlohmann::json& json, const std::string& human);

// A reply in the proto's JSON form with the .proto field names, so --json output matches the
// names in proto/megacpp/v1/ and in job spec files.
std::string to_json(const google::protobuf::Message& message);
void print_json(const google::protobuf::Message& message);

// "m:ss", or "h:mm:ss" from an hour on; "--:--" when unknown (negative) or absurd.
std::string duration_text(double seconds);

// A job on one line (id, state, progress, devices), and its error on a second one.
void print_job(const v1::Job& job);

}  // namespace megacpp::cli
