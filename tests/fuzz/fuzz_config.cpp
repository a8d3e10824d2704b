// libFuzzer target: the JSON config loader and the checks Runtime::create applies
// (Config::from_json_text, Config::validate), and Config::set on every key with
// the input as its value. Nothing may crash, hang or leak; refusals are Status.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "strata/strata.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = strata::Config::from_json_text(text);
  if (config.ok()) {
    (void)config->validate().to_string();
  } else {
    (void)config.status().to_string();
  }
  if (size <= 256) {  // the same text as a value of every key, as strata_config_set passes it
    strata::Config c;
    for (const std::string& key : strata::Config::keys()) (void)c.set(key, text);
    (void)c.validate();
  }
  return 0;
}
