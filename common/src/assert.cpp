#include "strata/common/assert.hpp"

#include <cstdio>
#include <cstdlib>

namespace strata::detail {

void check_failed(const char* expr, const char* message, const char* file, int line) {
  // stderr directly, not the logger: the logger may be what is broken, and this
  // must print even during static destruction.
  std::fprintf(stderr, "strata: check failed: %s%s%s%s at %s:%d\n", expr, message[0] ? " (" : "", message,
               message[0] ? ")" : "", file, line);
  std::fflush(stderr);
  std::abort();
}

}  // namespace strata::detail
