// libFuzzer target: a GEMM plan cache file's bytes (base/plan_cache.h) through parse_plan_cache,
// as an executor's PlanCache and the daemon's startup check read them. Nothing may throw: bad
// content is reported as problems. What parsed cleanly must survive a rewrite unchanged.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "base/plan_cache.h"
#include "bench/fuzz/fuzz_support.h"

namespace fuzz = megacpp::fuzz;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  fuzz::expect_clean(
      [&] {
        const megacpp::PlanCacheContent content = megacpp::parse_plan_cache("fuzz.plans", bytes);
        if (!content.header_ok && !content.records.empty()) {
          fuzz::bug("records kept from a file whose header was refused");
        }
        if (!content.header_ok && content.problems.empty()) {
          fuzz::bug("a refused header with no problem reported");
        }
        std::size_t held = 0;
        for (const auto& [key, value] : content.records) held += key.size() + value.size();
        if (held > size) fuzz::bug("more record bytes kept than the file has");
        // The repair path: what was kept, written again, reads back whole and the same.
        if (content.header_ok) {
          const std::string rewritten =
              megacpp::serialize_plan_cache(content.scope, content.records);
          const megacpp::PlanCacheContent again =
              megacpp::parse_plan_cache("rewritten.plans", rewritten);
          if (!again.header_ok || !again.problems.empty()) {
            fuzz::bug("a rewritten file has problems: " +
                      (again.problems.empty() ? std::string("bad header") : again.problems[0]));
          }
          if (again.records != content.records || again.scope != content.scope) {
            fuzz::bug("a rewritten file reads back different records");
          }
        }
      },
      {});
  return 0;
}
