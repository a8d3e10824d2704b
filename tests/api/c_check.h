/* c_check.h: CHECK and the set-up the C ABI's tests share; they are C programs (no GoogleTest).
 * A test defines C_CHECK_NAME (its name, for the messages) before including this; CHECK counts
 * a failed condition in `failures`, printing it with strata_last_error(), and goes on. */
#ifndef STRATA_TESTS_API_C_CHECK_H
#define STRATA_TESTS_API_C_CHECK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

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

/* A runtime made from cfg (freed here; exit 1 naming the error when it cannot be made) with
 * `count` (at most 3) tensors "a", "b", "c" of n elements, ids 0.., frozen where bit t of
 * `frozen` is set, each initialised to 0.001 * (i % 97) - 0.05. */
static inline strata_runtime* c_runtime_with_tensors(strata_config* cfg, int64_t n, uint32_t count,
                                                     unsigned frozen) {
  static const char* const names[] = {"a", "b", "c"};
  strata_runtime* rt = NULL;
  if (cfg == NULL || count > 3 || strata_runtime_new(cfg, &rt) != STRATA_OK) {
    fprintf(stderr, C_CHECK_NAME ": runtime_new failed: %s\n", strata_last_error());
    exit(1);
  }
  strata_config_free(cfg);
  const int64_t shape[1] = {n};
  float* init = (float*)malloc((size_t)n * sizeof(float));
  if (init == NULL) exit(1);
  for (int64_t i = 0; i < n; ++i) init[i] = 0.001f * (float)(i % 97) - 0.05f;
  for (uint32_t t = 0; t < count; ++t) {
    uint32_t id = 0;
    CHECK(strata_register_tensor(rt, names[t], shape, 1, (frozen >> t) & 1u, &id) == STRATA_OK && id == t,
          "register %s", names[t]);
  }
  for (uint32_t t = 0; t < count; ++t)
    CHECK(strata_init_tensor(rt, t, init, (uint64_t)n) == STRATA_OK, "init %u", t);
  free(init);
  return rt;
}

/* Writes tensor t's gradient (param * 0.5 + 0.01, n elements) on the host thread and hands it over. */
static inline void c_hand_gradient(strata_runtime* rt, uint32_t t, int64_t n) {
  strata_lease* p = NULL;
  strata_lease* g = NULL;
  CHECK(strata_acquire(rt, t, STRATA_PARAM, STRATA_READ, STRATA_ON_DEVICE, &p) == STRATA_OK, "param %u", t);
  CHECK(strata_acquire(rt, t, STRATA_GRAD, STRATA_WRITE, STRATA_ON_DEVICE, &g) == STRATA_OK, "grad %u", t);
  if (p == NULL || g == NULL) exit(1);
  CHECK(strata_lease_wait(rt, p) == STRATA_OK && strata_lease_wait(rt, g) == STRATA_OK, "wait");
  const float* pv = (const float*)strata_lease_data(p);
  float* gv = (float*)strata_lease_data(g);
  for (int64_t i = 0; i < n; ++i) gv[i] = pv[i] * 0.5f + 0.01f;
  strata_lease_release(g);
  strata_lease_release(p);
}

#endif /* STRATA_TESTS_API_C_CHECK_H */
