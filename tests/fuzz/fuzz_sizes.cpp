// libFuzzer target: size and duration suffixes (parse_bytes, parse_seconds) and the
// probe's counts (parse_count: K, M, B, T). Accepted values must print back.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "probe/model.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/duration.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  if (auto bytes = strata::parse_bytes(text, "--size"); bytes.ok()) {
    STRATA_CHECK(!strata::format_bytes(*bytes).empty());
  }
  if (auto seconds = strata::parse_seconds(text, "--seconds"); seconds.ok()) {
    STRATA_CHECK(*seconds >= 0 && *seconds <= strata::kSecondsMax);
  }
  if (auto count = strata::probe::parse_count(text, "--params"); count.ok()) {
    STRATA_CHECK(*count >= 1);
    STRATA_CHECK(!strata::probe::format_count(*count).empty());
  }
  return 0;
}
