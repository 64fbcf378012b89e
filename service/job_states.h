#pragma once
// Job-state names as users, logs, metrics and the receipt store spell them ("running"), derived
// from the JobState enum of jobs.proto (JOB_STATE_RUNNING) rather than written out by hand, so
// a state added to the proto is named the same way in the daemon and the CLI at once. The
// receipt store keeps these names in its jobs table: renaming an enum value renames the state
// in stored rows too, and old rows then recover as JOB_STATE_UNSPECIFIED.
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "megacpp/v1/jobs.pb.h"

namespace megacpp {

// "running" for JOB_STATE_RUNNING; "unspecified" for JOB_STATE_UNSPECIFIED and for any value
// the enum does not define.
const std::string& job_state_name(v1::JobState state);

// The states a job can be in, in enum order; JOB_STATE_UNSPECIFIED is not one of them.
std::span<const v1::JobState> job_states();

// The state `name` spells, in any case ("running", "RUNNING"); nullopt for anything else,
// "unspecified" included, since no job is ever in it.
std::optional<v1::JobState> find_job_state(std::string_view name);

// The names of job_states(), comma separated, for help texts and for errors that must name the
// values a user may give.
std::string job_state_list();

}  // namespace megacpp
