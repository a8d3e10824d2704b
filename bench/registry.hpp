#pragma once
// How a strata-bench subcommand registers itself: define, in bench_<name>.cpp,
//
//   static strata::bench::Registrar reg{"io", "NVMe tier vs fio", [](CLI::App& app) {
//     auto opts = std::make_shared<IoOptions>();
//     app.add_option("--dir", opts->dir, ...);
//     return [opts] { return run_io(*opts); };   // returns the process exit code
//   }};
//
// Every benchmark prints what it compared, on which backend, with the baseline
// measured in the same run.

#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace strata::bench {

//! Adds options to the subcommand and returns the function that runs it.
using Setup = std::function<std::function<int()>(CLI::App&)>;

struct Entry {
  std::string name;
  std::string description;
  Setup setup;
};

//! All registered subcommands, in registration order.
std::vector<Entry>& registry();

struct Registrar {
  Registrar(std::string name, std::string description, Setup setup) {
    registry().push_back({std::move(name), std::move(description), std::move(setup)});
  }
};

//! Median of a non-empty list of samples.
double median(std::vector<double> samples);

//! The 1-minute load average (/proc/loadavg; -1 when unreadable): every JSON
//! output records it, as the machines these run on are often shared.
double load_average_1m();

}  // namespace strata::bench
