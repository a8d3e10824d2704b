// strata-bench: the project's benchmarks, one subcommand each.
#include <CLI/CLI.hpp>
#include <map>

#include "registry.hpp"
#include "strata/common/log.hpp"

int main(int argc, char** argv) {
  CLI::App app{"strata-bench: strata's benchmarks, each against a baseline measured in the same run"};
  app.require_subcommand(1);
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off")->capture_default_str();

  std::map<CLI::App*, std::function<int()>> runners;
  for (auto& entry : strata::bench::registry()) {
    CLI::App* sub = app.add_subcommand(entry.name, entry.description);
    runners[sub] = entry.setup(*sub);
  }
  CLI11_PARSE(app, argc, argv);
  if (!strata::set_log_level(log_level)) {
    fmt::print(stderr, "strata-bench: --log-level {}: unknown level\n", log_level);
    return 2;
  }
  for (auto& [sub, run] : runners) {
    if (sub->parsed()) return run();
  }
  return 2;
}
