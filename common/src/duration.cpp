#include "strata/common/duration.hpp"

#include <cctype>
#include <charconv>
#include <cmath>
#include <string>

namespace strata {
namespace {

struct Unit {
  std::string_view name;
  double seconds;
};
constexpr Unit kUnits[] = {{"", 1.0}, {"s", 1.0}, {"ms", 1e-3}, {"us", 1e-6}, {"m", 60.0}, {"h", 3600.0}};

}  // namespace

Result<double> parse_seconds(std::string_view text, std::string_view setting) {
  auto bad = [&](std::string_view why) {
    return invalid_argument(
        "{} = \"{}\": {}; write a number of seconds with an optional unit, e.g. \"3\", \"3s\", \"500ms\", "
        "\"1.5m\" (units: us, ms, s, m, h; at most one day)",
        setting, text, why);
  };
  std::string_view s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  if (s.empty()) return bad("empty");
  std::size_t end = 0;
  while (end < s.size() && (std::isdigit(static_cast<unsigned char>(s[end])) || s[end] == '.')) ++end;
  if (end == 0) return bad(s.front() == '-' ? "negative" : "not a number");
  double value = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + end, value, std::chars_format::fixed);
  if (ec != std::errc() || ptr != s.data() + end) return bad("not a number");
  std::string_view unit = s.substr(end);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.front()))) unit.remove_prefix(1);
  std::string lower(unit);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const Unit& u : kUnits) {
    if (lower != u.name) continue;
    const double seconds = value * u.seconds;
    if (!std::isfinite(seconds) || seconds > kSecondsMax) return bad("longer than a day");
    return seconds;
  }
  return bad(fmt::format("unknown unit \"{}\"", unit));
}

}  // namespace strata
