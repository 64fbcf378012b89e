#include "base/version.h"

#include <fmt/format.h>

namespace megacpp {

std::string version_string() {
#ifdef MEGACPP_HAVE_CUDA
  constexpr const char* cuda = "on";
#else
  constexpr const char* cuda = "off";
#endif
  return fmt::format("megacpp {} (git {}, gcc {}.{}.{}, cuda {})", MEGACPP_VERSION,
                     MEGACPP_GIT_REVISION, __GNUC__, __GNUC_MINOR__, __GNUC_PATCHLEVEL__, cuda);
}

const char* git_revision() {
  return MEGACPP_GIT_REVISION;
}

}  // namespace megacpp
