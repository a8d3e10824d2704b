#include "settings.hpp"

#include <charconv>

namespace strata::memory::detail {

Result<std::uint64_t> parse_count(std::string_view setting, std::string_view text) {
  std::uint64_t out = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size()) {
    return invalid_argument("{} = \"{}\": not a whole number; write e.g. {}=64", setting, text, setting);
  }
  return out;
}

Result<bool> parse_bool(std::string_view setting, std::string_view text) {
  if (text == "true" || text == "1" || text == "on" || text == "yes") return true;
  if (text == "false" || text == "0" || text == "off" || text == "no") return false;
  return invalid_argument("{} = \"{}\": not a boolean; write true or false", setting, text);
}

}  // namespace strata::memory::detail
