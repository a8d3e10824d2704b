/* c_check.h: CHECK for the C ABI's tests, which are C programs (no GoogleTest). A test defines
 * C_CHECK_NAME (its name, for the messages) before including this; CHECK counts a failed
 * condition in `failures`, printing it with strata_last_error(), and goes on. */
#ifndef STRATA_TESTS_API_C_CHECK_H
#define STRATA_TESTS_API_C_CHECK_H

#include <stdio.h>

#include "strata/strata.h"

static int failures = 0;
#define CHECK(cond, ...)                                           \
  do {                                                             \
    if (!(cond)) {                                                 \
      fprintf(stderr, C_CHECK_NAME ": FAIL %s: ", #cond);          \
      fprintf(stderr, __VA_ARGS__);                                \
      fprintf(stderr, " (last error: %s)\n", strata_last_error()); \
      ++failures;                                                  \
    }                                                              \
  } while (0)

#endif /* STRATA_TESTS_API_C_CHECK_H */
