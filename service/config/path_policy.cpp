#include "service/config/path_policy.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iterator>
#include <optional>

#include "base/error.h"

namespace megacpp {

namespace fs = std::filesystem;

namespace {

// Component-wise, so that /data2 is not taken to be inside /data.
bool is_within(const fs::path& path, const fs::path& root) {
  auto p = path.begin();
  for (auto r = root.begin(); r != root.end(); ++r, ++p) {
    // A trailing separator shows up as an empty last component of the root.
    if (r->empty() && std::next(r) == root.end()) return true;
    if (p == path.end() || *p != *r) return false;
  }
  return true;
}

// The first component of `path` (taken from the root down) that does not exist, if it is a
// symbolic link: weakly_canonical treats a dangling link as a plain name, yet creating a file
// there would create the link's target, wherever it points.
std::optional<fs::path> dangling_link(const fs::path& path) {
  fs::path prefix;
  for (const fs::path& component : path) {
    prefix /= component;
    std::error_code ec;
    if (fs::exists(prefix, ec)) continue;
    if (fs::is_symlink(fs::symlink_status(prefix, ec))) return prefix;
    return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

fs::path resolve_allowed_path(const std::string& requested,
                              const std::vector<fs::path>& allowed_roots, std::string_view field,
                              bool must_exist) {
  std::vector<std::string> root_names;
  for (const fs::path& root : allowed_roots) root_names.push_back(root.string());
  const std::string roots = root_names.empty() ? std::string("(none configured)")
                                               : fmt::format("{}", fmt::join(root_names, ", "));
  // A NUL byte is shown as \0: the message must stay printable text.
  std::string shown;
  for (const char c : requested) {
    if (c == '\0') {
      shown += "\\0";
    } else {
      shown += c;
    }
  }
  auto refuse = [&]<typename... Args>(fmt::format_string<Args...> rule, Args&&... args) {
    fail(ErrorKind::kInvalidArgument, "{}=\"{}\" {} (allowed roots: {})", field, shown,
         fmt::format(rule, std::forward<Args>(args)...), roots);
  };

  if (requested.empty()) refuse("must not be empty");
  // The system calls below stop at the first NUL byte: such a path would be checked, and later
  // opened, as its prefix ("ROOT/\0x" as the root directory itself), not as what was asked for.
  if (requested.find('\0') != std::string::npos) {
    refuse("contains a NUL byte, which no file name can hold");
  }
  const fs::path path(requested);
  if (!path.is_absolute()) {
    refuse("is relative: job paths must be absolute, inside one of the allowed roots");
  }
  for (const fs::path& component : path) {
    if (component == "..") refuse("has a \"..\" component, which is not allowed");
  }
  if (allowed_roots.empty()) refuse("cannot be used: no allowed roots are configured");

  std::error_code ec;
  const fs::path canonical = fs::weakly_canonical(path, ec);
  if (ec) refuse("cannot be resolved: {}", ec.message());
  if (const std::optional<fs::path> link = dangling_link(path)) {
    refuse("passes through the dangling symbolic link {} (-> {})", link->string(),
           fs::read_symlink(*link, ec).string());
  }

  bool inside = false;
  for (const fs::path& root : allowed_roots) {
    const fs::path canonical_root = fs::weakly_canonical(root, ec);
    if (ec)
      refuse("cannot be checked: allowed root {} cannot be resolved: {}", root.string(),
             ec.message());
    if (is_within(canonical, canonical_root)) {
      inside = true;
      break;
    }
  }
  if (!inside) {
    if (canonical != path.lexically_normal()) {
      refuse("resolves to {} (following symbolic links), which is outside every allowed root",
             canonical.string());
    }
    refuse("is outside every allowed root");
  }
  if (must_exist && !fs::exists(canonical, ec)) refuse("does not exist");
  return canonical;
}

}  // namespace megacpp
