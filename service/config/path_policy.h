#pragma once
// Which files a job may name. A job spec comes from a network client, and the daemon runs with
// the rights of the machine's training service account, so a data or checkpoint path must stay
// inside the directories the operator configured: neither `..` nor a symbolic link may lead
// out of them.
//
// Relative paths are refused, not resolved against a root: the client wrote the spec relative
// to its own working directory, which the daemon cannot see, so any guess would silently pick a
// different file than the one meant. The CLI makes paths absolute before it submits a spec.
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace megacpp {

// Returns the canonical form of `requested` (symbolic links resolved, no `.` or `..`): the path
// the daemon must use from then on, so that what was checked is what gets opened. A root itself
// counts as inside. Throws Error(kInvalidArgument) naming `field`, the path and the allowed
// roots when `requested` is empty or relative, has a `..` component, resolves to a place outside
// every root, passes through a dangling symbolic link (which would be followed when the file is
// created), or, with `must_exist`, does not exist.
//
// This checks the file system as it is now; a directory inside a root that someone later swaps
// for a symbolic link is beyond its reach, which is why the roots should be writable only by the
// daemon's user.
std::filesystem::path resolve_allowed_path(const std::string& requested,
                                           const std::vector<std::filesystem::path>& allowed_roots,
                                           std::string_view field, bool must_exist);

}  // namespace megacpp
