#include "service/job_states.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "receipts/records.h"

namespace megacpp {
namespace {

// These spellings are stored in receipt stores and scraped from /metrics: a change to them is a
// change to data already on disk and to dashboards, never a refactoring.
TEST(JobStates, NamesAreTheEnumNamesWithoutPrefixInLowerCase) {
  std::vector<std::string> names;
  for (const v1::JobState state : job_states()) names.push_back(job_state_name(state));
  EXPECT_EQ(names, (std::vector<std::string>{"queued", "running", "succeeded", "failed",
                                             "cancelled", "interrupted", "refused"}));
  EXPECT_EQ(job_state_list(),
            "queued, running, succeeded, failed, cancelled, interrupted, refused");
  EXPECT_EQ(job_state_name(v1::JOB_STATE_UNSPECIFIED), "unspecified");
  EXPECT_EQ(job_state_name(static_cast<v1::JobState>(1000)), "unspecified");
}

TEST(JobStates, EveryStateRoundTripsThroughItsName) {
  for (const v1::JobState state : job_states()) {
    EXPECT_EQ(find_job_state(job_state_name(state)), state) << job_state_name(state);
  }
}

TEST(JobStates, ParsingIgnoresCaseAndRefusesEverythingElse) {
  EXPECT_EQ(find_job_state("RUNNING"), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(find_job_state("Cancelled"), v1::JOB_STATE_CANCELLED);
  for (const char* bad : {"", "unspecified", "run", "job_state_running", "JOB_STATE_RUNNING",
                          "running ", "canceled"}) {
    EXPECT_EQ(find_job_state(bad), std::nullopt) << bad;
  }
}

// The receipt store sits below the proto layer and keeps its own list of the states it accepts;
// a state added to jobs.proto must be added there too, or the daemon cannot record the job.
TEST(JobStates, TheReceiptStoreAcceptsEveryState) {
  for (const v1::JobState state : job_states()) {
    receipts::JobRecord record;
    record.job_id = "job-000001";
    record.state = job_state_name(state);
    EXPECT_NO_THROW(receipts::validate(record)) << record.state;
  }
}

}  // namespace
}  // namespace megacpp
