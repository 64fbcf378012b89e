#pragma once
#include <string>

namespace megacpp {

// "megacpp 0.1.0 (git abc123, gcc 12.2.0, cuda on|off)": printed by --version and
// recorded in every run's receipt.
std::string version_string();
// The short git commit the binary was built from ("unknown" outside a checkout).
const char* git_revision();

}  // namespace megacpp
