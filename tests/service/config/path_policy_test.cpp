#include "service/config/path_policy.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "base/error.h"
#include "tests/support/temp_dir.h"

namespace megacpp {
namespace {

namespace fs = std::filesystem;

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << part << "\" not found in: " << text;
}

class PathPolicyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The temp directory itself may sit behind a symbolic link (/tmp on some systems), so every
    // expectation is in canonical form.
    base_ = fs::canonical(tmp_.path());
    root_ = base_ / "data";
    testing::write_text(root_ / "train" / "tokens.bin", "t");
    testing::write_text(base_ / "data2" / "other.bin", "o");
    testing::write_text(base_ / "outside" / "secret", "s");
    roots_ = {root_};
  }

  // The message of the Error(kInvalidArgument) refusing `requested`.
  std::string refusal(const std::string& requested, bool must_exist) {
    try {
      const fs::path accepted = resolve_allowed_path(requested, roots_, "data.train", must_exist);
      ADD_FAILURE() << requested << " accepted as " << accepted;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
      const std::string message = e.what();
      EXPECT_TRUE(contains(message, "data.train=\"" + requested + "\""));
      EXPECT_TRUE(contains(message, "allowed roots: " + root_.string()));
      return message;
    }
    return "";
  }

  testing::TempDir tmp_;
  fs::path base_;
  fs::path root_;
  std::vector<fs::path> roots_;
};

TEST_F(PathPolicyTest, InsideARootIsAcceptedInCanonicalForm) {
  const fs::path file = root_ / "train" / "tokens.bin";
  EXPECT_EQ(resolve_allowed_path(file.string(), roots_, "data.train", true), file);
  EXPECT_EQ(resolve_allowed_path((root_ / "." / "train" / "tokens.bin").string(), roots_,
                                 "data.train", true),
            file);
  EXPECT_EQ(resolve_allowed_path(root_.string() + "//train/", roots_, "data.train", true),
            root_ / "train");
  EXPECT_EQ(resolve_allowed_path(root_.string(), roots_, "data.train", true), root_);
}

TEST_F(PathPolicyTest, MissingPathIsAcceptedUnlessItMustExist) {
  const fs::path fresh = root_ / "runs" / "job-7" / "ckpt";
  EXPECT_EQ(resolve_allowed_path(fresh.string(), roots_, "checkpoint.dir", false), fresh);
  EXPECT_TRUE(contains(refusal(fresh.string(), true), "does not exist"));
}

TEST_F(PathPolicyTest, DotDotIsRefusedEvenWhenItStaysInside) {
  EXPECT_TRUE(contains(refusal((root_ / "train" / ".." / "train" / "tokens.bin").string(), true),
                       "\"..\" component"));
  EXPECT_TRUE(
      contains(refusal((root_ / ".." / "outside" / "secret").string(), false), "\"..\" component"));
}

TEST_F(PathPolicyTest, OutsideEveryRootIsRefused) {
  EXPECT_TRUE(contains(refusal((base_ / "outside" / "secret").string(), true),
                       "outside every allowed root"));
  // A sibling whose name merely starts with the root's name is not inside it.
  EXPECT_TRUE(contains(refusal((base_ / "data2" / "other.bin").string(), true),
                       "outside every allowed root"));
  EXPECT_TRUE(contains(refusal("/etc/passwd", true), "outside every allowed root"));
}

TEST_F(PathPolicyTest, SymlinkEscapeIsRefused) {
  fs::create_directory_symlink(base_ / "outside", root_ / "escape_dir");
  fs::create_symlink(base_ / "outside" / "secret", root_ / "escape_file");
  std::string message = refusal((root_ / "escape_dir" / "secret").string(), true);
  EXPECT_TRUE(contains(message, "resolves to " + (base_ / "outside" / "secret").string()));
  EXPECT_TRUE(contains(message, "outside every allowed root"));
  message = refusal((root_ / "escape_file").string(), true);
  EXPECT_TRUE(contains(message, "resolves to " + (base_ / "outside" / "secret").string()));
  // Writing a new file under an escaping directory is refused too.
  EXPECT_TRUE(contains(refusal((root_ / "escape_dir" / "new" / "ckpt").string(), false),
                       "outside every allowed root"));
}

TEST_F(PathPolicyTest, DanglingSymlinkIsRefusedSinceCreatingItWouldEscape) {
  fs::create_symlink(base_ / "outside" / "planted", root_ / "dangling");
  EXPECT_TRUE(contains(refusal((root_ / "dangling").string(), false), "dangling symbolic link"));
  EXPECT_TRUE(
      contains(refusal((root_ / "dangling" / "child").string(), false), "dangling symbolic link"));
  EXPECT_FALSE(fs::exists(base_ / "outside" / "planted"));
}

TEST_F(PathPolicyTest, SymlinksThatStayInsideAreFollowed) {
  fs::create_directory_symlink(root_ / "train", root_ / "alias");
  EXPECT_EQ(
      resolve_allowed_path((root_ / "alias" / "tokens.bin").string(), roots_, "data.train", true),
      root_ / "train" / "tokens.bin");
  // A root given through a symbolic link is compared in its canonical form, both ways round.
  fs::create_directory_symlink(root_, base_ / "data_link");
  const std::vector<fs::path> linked_roots = {base_ / "data_link"};
  EXPECT_EQ(resolve_allowed_path((root_ / "train" / "tokens.bin").string(), linked_roots,
                                 "data.train", true),
            root_ / "train" / "tokens.bin");
  EXPECT_EQ(resolve_allowed_path((base_ / "data_link" / "train" / "tokens.bin").string(),
                                 linked_roots, "data.train", true),
            root_ / "train" / "tokens.bin");
}

TEST_F(PathPolicyTest, AnyOfSeveralRootsWillDo) {
  const std::vector<fs::path> two = {root_, base_ / "data2"};
  EXPECT_EQ(resolve_allowed_path((base_ / "data2" / "other.bin").string(), two, "data.valid", true),
            base_ / "data2" / "other.bin");
}

TEST_F(PathPolicyTest, RelativeEmptyAndRootlessAreRefused) {
  EXPECT_TRUE(contains(refusal("train/tokens.bin", true), "is relative"));
  EXPECT_TRUE(contains(refusal("", false), "must not be empty"));
  roots_.clear();
  try {
    resolve_allowed_path((root_ / "train").string(), roots_, "data.train", false);
    ADD_FAILURE() << "accepted without roots";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_TRUE(contains(e.what(), "no allowed roots"));
  }
}

// Found by bench/fuzz/job_spec_fuzz: the system calls stop at a NUL byte, so "ROOT/\0x.idx"
// passed the existence check as ROOT itself and a spec naming it was accepted.
TEST_F(PathPolicyTest, NulByteIsRefusedAndShownEscaped) {
  const std::string requested = (root_ / "train").string() + std::string("\0x", 2);
  try {
    const fs::path accepted = resolve_allowed_path(requested, roots_, "data.train", true);
    ADD_FAILURE() << "accepted as " << accepted;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    const std::string message = e.what();
    EXPECT_TRUE(contains(message, "data.train=\"" + (root_ / "train").string() + "\\0x\""));
    EXPECT_TRUE(contains(message, "contains a NUL byte"));
    EXPECT_EQ(message.find('\0'), std::string::npos);
  }
}

}  // namespace
}  // namespace megacpp
