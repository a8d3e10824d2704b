#include "registry.hpp"

#include <algorithm>
#include <fstream>

namespace strata::bench {

std::vector<Entry>& registry() {
  static std::vector<Entry> entries;
  return entries;
}

double median(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  std::size_t n = samples.size();
  if (n == 0) return 0.0;
  return n % 2 == 1 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
}

double load_average_1m() {
  std::ifstream in("/proc/loadavg");
  double load = -1.0;
  if (!(in >> load)) return -1.0;
  return load;
}

}  // namespace strata::bench
