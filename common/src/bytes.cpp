#include "strata/common/bytes.hpp"

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

namespace strata {
namespace {

struct Unit {
  std::string_view name;
  std::uint64_t factor;
};

constexpr Unit kUnits[] = {
    {"", 1},
    {"b", 1},
    {"k", kKiB},
    {"kib", kKiB},
    {"m", kMiB},
    {"mib", kMiB},
    {"g", kGiB},
    {"gib", kGiB},
    {"t", kTiB},
    {"tib", kTiB},
    {"kb", 1000ULL},
    {"mb", 1000ULL * 1000},
    {"gb", 1000ULL * 1000 * 1000},
    {"tb", 1000ULL * 1000 * 1000 * 1000},
};

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

Status bad(std::string_view setting, std::string_view text, std::string_view why) {
  return invalid_argument(
      "{} = \"{}\": {}; write a number with an optional unit, e.g. \"8GiB\", \"512MiB\", "
      "\"4096\" (units: B, KiB, MiB, GiB, TiB, or K/M/G/T; KB/MB/GB/TB are decimal)",
      setting, text, why);
}

}  // namespace

Result<std::uint64_t> parse_bytes(std::string_view text, std::string_view setting) {
  std::string_view s = trim(text);
  if (s.empty()) return bad(setting, text, "empty size");
  if (s.front() == '-') return bad(setting, text, "a size cannot be negative");

  std::size_t digits_end = 0;
  bool seen_dot = false;
  while (digits_end < s.size() &&
         (std::isdigit(static_cast<unsigned char>(s[digits_end])) || (s[digits_end] == '.' && !seen_dot))) {
    if (s[digits_end] == '.') seen_dot = true;
    ++digits_end;
  }
  std::string_view number = s.substr(0, digits_end);
  if (number.empty() || number == ".") return bad(setting, text, "no number");

  std::string unit;
  for (char c : trim(s.substr(digits_end)))
    unit.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));

  std::uint64_t factor = 0;
  for (const Unit& u : kUnits) {
    if (u.name == unit) factor = u.factor;
  }
  if (factor == 0) return bad(setting, text, fmt::format("unknown unit \"{}\"", trim(s.substr(digits_end))));

  if (!seen_dot) {
    std::uint64_t value = 0;
    auto [ptr, ec] = std::from_chars(number.data(), number.data() + number.size(), value);
    if (ec != std::errc() || ptr != number.data() + number.size())
      return bad(setting, text, "number too large");
    if (value > std::numeric_limits<std::uint64_t>::max() / factor)
      return bad(setting, text, "size overflows 64 bits");
    return value * factor;
  }

  // Decimal: parse as long double, which holds 64-bit integers exactly.
  std::string copy(number);
  long double value = std::strtold(copy.c_str(), nullptr);
  long double bytes = value * static_cast<long double>(factor);
  if (bytes >= 18446744073709551616.0L) return bad(setting, text, "size overflows 64 bits");
  if (bytes != std::floor(bytes)) return bad(setting, text, "not a whole number of bytes");
  return static_cast<std::uint64_t>(bytes);
}

std::string format_bytes(std::uint64_t bytes) {
  if (bytes < kKiB) return fmt::format("{} B", bytes);
  constexpr const char* kNames[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double value = static_cast<double>(bytes) / 1024.0;
  int index = 0;
  while (value >= 1024.0 && index < 5) {
    value /= 1024.0;
    ++index;
  }
  return fmt::format("{:.2f} {}", value, kNames[index]);
}

}  // namespace strata
