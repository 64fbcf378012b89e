// The boot statuses a daemon's life can end in: a --check run ("checked") and a daemon that never
// reached "stopped" because it was killed ("crashed", marked by the next start).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "base/error.h"
#include "receipts/batched_writer.h"
#include "receipts/store.h"
#include "tests/support/temp_dir.h"

namespace megacpp::receipts {
namespace {

BootReceipt boot_with_status(const std::string& status) {
  BootReceipt boot;
  // Copied from strings rather than assigned short literals: GCC 12 at -O3 warns falsely
  // (-Wrestrict) on the latter.
  const std::string started_at = "2026-11-22T08:00:00.125Z", version = "0.1.0", host = "host";
  boot.started_at = started_at;
  boot.version = version;
  boot.devices = nlohmann::json::array();
  boot.environment = nlohmann::json::object();
  boot.hostname = host;
  boot.status = status;
  return boot;
}

TEST(BootStatus, CheckedAndCrashedAreStatusesTheStoreAccepts) {
  testing::TempDir dir;
  Store store(dir / "receipts.db", OpenMode::kReadWrite);
  const int64_t checked = store.insert_boot(boot_with_status("checked"));
  EXPECT_EQ(store.get_boot(checked)->status, "checked");
  const int64_t other = store.insert_boot(boot_with_status("starting"));
  store.update_boot_status(other, "crashed");
  EXPECT_EQ(store.get_boot(other)->status, "crashed");
  {  // through the daemon's writer too, which validates before queueing
    BatchedWriter writer(store);
    EXPECT_NO_THROW(writer.enqueue(BootStatusUpdate{other, "checked"}));
    writer.flush();
  }
  EXPECT_EQ(store.get_boot(other)->status, "checked");
  // Anything else is still refused by name.
  try {
    store.insert_boot(boot_with_status("sleeping"));
    ADD_FAILURE() << "status 'sleeping' was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'status'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("checked"), std::string::npos) << e.what();
  }
}

TEST(BootStatus, UnfinishedBootsButTheCurrentOneAreMarkedCrashed) {
  testing::TempDir dir;
  Store store(dir / "receipts.db", OpenMode::kReadWrite);
  std::vector<int64_t> ids;
  for (const char* status : {"stopped", "serving", "refused", "starting", "checked", "serving"}) {
    ids.push_back(store.insert_boot(boot_with_status(status)));
  }
  const int64_t current = store.insert_boot(boot_with_status("starting"));
  EXPECT_EQ(store.mark_unfinished_boots_crashed(current), 3);
  const std::vector<std::string> expected = {"stopped", "crashed", "refused",
                                             "crashed", "checked", "crashed"};
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(store.get_boot(ids[i])->status, expected[i]) << "boot " << ids[i];
  }
  EXPECT_EQ(store.get_boot(current)->status, "starting");
  EXPECT_EQ(store.mark_unfinished_boots_crashed(current), 0);  // idempotent

  Store reader(dir / "receipts.db", OpenMode::kReadOnly);
  try {
    reader.mark_unfinished_boots_crashed(current);
    ADD_FAILURE() << "a read-only store wrote";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace megacpp::receipts
