/* The C ABI's ABI 5 additions from C: strata_abort_step and strata_no_gradient (what they do,
 * and bad input -- a NULL handle, an unknown tensor id, a frozen tensor, leases held -- refused
 * with a code and a message, never success), the renamed strata_write_chrome_trace and
 * strata_config_from_json_text / _from_json_file, and their ABI 4 names, still exported.
 * Exit 0 on success; prints the failing check otherwise. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "strata/strata.h"

#define C_CHECK_NAME "test_c_abi_ops"
#include "c_check.h"

#define N 4096

/* `want` with a message that contains `needle`. */
static int refused(strata_status got, strata_status want, const char* needle) {
  return got == want && strata_last_error()[0] != '\0' && strstr(strata_last_error(), needle) != NULL;
}

/* Tensors a and b (trained, one chunk each) and c (frozen). */
static strata_runtime* make_runtime(void) {
  strata_config* cfg = NULL;
  CHECK(strata_config_from_json_text("{\"device\": {\"kind\": \"sim\", \"budget\": \"16MiB\"}, "
                                     "\"budgets\": {\"gpu\": \"1MiB\", \"host\": \"16MiB\"}, "
                                     "\"layout\": {\"chunk_elems\": 4096}, \"threads\": 2, "
                                     "\"optimizer\": {\"name\": \"adamw\", \"lr\": 0.01}}",
                                     &cfg) == STRATA_OK,
        "config_from_json_text");
  return c_runtime_with_tensors(cfg, N, 3, 1u << 2);
}

static int64_t steps_of(strata_runtime* rt, uint32_t t) {
  int64_t steps = -1;
  CHECK(strata_tensor_steps(rt, t, &steps) == STRATA_OK, "tensor_steps %u", t);
  return steps;
}

static void read_param(strata_runtime* rt, uint32_t t, float* out) {
  CHECK(strata_read_tensor(rt, t, STRATA_PARAM, out, N) == STRATA_OK, "read %u", t);
}

/* strata_no_gradient: b gets none in a step where a gets one; b stays as it was. */
static void test_no_gradient(void) {
  CHECK(refused(strata_no_gradient(NULL, 0), STRATA_INVALID_ARGUMENT, "runtime"), "NULL runtime refused");
  strata_runtime* rt = make_runtime();
  CHECK(refused(strata_no_gradient(rt, 99), STRATA_INVALID_ARGUMENT, "99"), "an unknown id is refused");
  CHECK(refused(strata_no_gradient(rt, 2), STRATA_FAILED_PRECONDITION, "frozen"),
        "a frozen tensor is refused");
  static float a0[N], b0[N], a1[N], b1[N];
  read_param(rt, 0, a0);
  read_param(rt, 1, b0);
  for (int step = 0; step < 2; ++step) {
    c_hand_gradient(rt, 0, N);
    CHECK(refused(strata_no_gradient(rt, 0), STRATA_FAILED_PRECONDITION, "already handed over"),
          "a tensor whose gradient was handed over is refused");
    CHECK(strata_no_gradient(rt, 1) == STRATA_OK, "no_gradient b (step %d)", step);
    CHECK(strata_last_error()[0] == '\0', "success clears the message");
    CHECK(refused(strata_no_gradient(rt, 1), STRATA_FAILED_PRECONDITION, "declared absent"),
          "declaring b twice is refused");
    CHECK(strata_step(rt, NULL, 0) == STRATA_OK, "step %d", step);
  }
  read_param(rt, 0, a1);
  read_param(rt, 1, b1);
  CHECK(memcmp(a0, a1, sizeof a0) != 0, "a, which got gradients, was updated");
  CHECK(memcmp(b0, b1, sizeof b0) == 0, "b, declared without a gradient, is unchanged");
  CHECK(steps_of(rt, 0) == 2 && steps_of(rt, 1) == 0, "step counters a %lld, b %lld",
        (long long)steps_of(rt, 0), (long long)steps_of(rt, 1));
  strata_runtime_free(rt);
}

/* strata_abort_step: refused while a lease is held; discards the step's gradients otherwise. */
static void test_abort_step(void) {
  CHECK(refused(strata_abort_step(NULL), STRATA_INVALID_ARGUMENT, "runtime"), "NULL runtime refused");
  strata_runtime* rt = make_runtime();
  static float before[N], after[N];
  read_param(rt, 0, before);
  /* A first micro-batch of two: no optimizer runs, its gradient waits for the second. */
  CHECK(strata_begin_micro_batch(rt, 0) == STRATA_OK, "begin_micro_batch (not last)");
  c_hand_gradient(rt, 0, N);
  strata_lease* held = NULL;
  CHECK(strata_acquire(rt, 1, STRATA_PARAM, STRATA_READ, STRATA_ON_DEVICE, &held) == STRATA_OK, "hold b");
  CHECK(refused(strata_abort_step(rt), STRATA_FAILED_PRECONDITION, "leases"),
        "refused while a lease is held");
  strata_lease_release(held);
  CHECK(strata_abort_step(rt) == STRATA_OK, "abort_step");
  read_param(rt, 0, after);
  CHECK(memcmp(before, after, sizeof before) == 0, "the aborted step left a as it was");
  CHECK(steps_of(rt, 0) == 0, "no optimizer step counted (%lld)", (long long)steps_of(rt, 0));
  /* The kept gradient is gone: the next micro-batch cannot add to it. */
  CHECK(strata_begin_micro_batch(rt, 1) == STRATA_OK, "begin_micro_batch (last)");
  strata_lease* g = NULL;
  CHECK(refused(strata_acquire(rt, 0, STRATA_GRAD, STRATA_ACCUMULATE, STRATA_ON_DEVICE, &g),
                STRATA_FAILED_PRECONDITION, "no gradient was written"),
        "no gradient left to accumulate into");
  if (g != NULL) strata_lease_release(g);
  /* The runtime trains on: a whole step after the aborted one. */
  c_hand_gradient(rt, 0, N);
  c_hand_gradient(rt, 1, N);
  strata_step_stats stats;
  CHECK(strata_step(rt, &stats, sizeof stats) == STRATA_OK, "step after abort");
  CHECK(stats.applied == 1, "the step after the abort applied");
  CHECK(steps_of(rt, 0) == 1 && steps_of(rt, 1) == 1, "one step counted each");
  CHECK(strata_abort_step(rt) == STRATA_OK, "abort_step with no step in progress");
  strata_runtime_free(rt);
}

/* The renamed functions, and their ABI 4 names (deprecated, still exported). */
static void test_renames(void) {
  CHECK(strata_abi_version() == 5 && STRATA_ABI_VERSION == 5, "ABI 5 (library %u)",
        (unsigned)strata_abi_version());
  char dir[] = "/tmp/strata-c-ops-XXXXXX";
  if (mkdtemp(dir) == NULL) exit(1);
  char trace[sizeof dir + 32], old_trace[sizeof dir + 32], config[sizeof dir + 32];
  snprintf(trace, sizeof trace, "%s/trace.json", dir);
  snprintf(old_trace, sizeof old_trace, "%s/old_trace.json", dir);
  snprintf(config, sizeof config, "%s/config.json", dir);
  FILE* f = fopen(config, "w");
  if (f == NULL) exit(1);
  fputs("{\"device\": {\"kind\": \"sim\"}, \"budgets\": {\"gpu\": \"1MiB\"}}", f);
  fclose(f);

  strata_config* cfg = NULL;
  CHECK(strata_config_from_json_file(config, &cfg) == STRATA_OK, "config_from_json_file");
  strata_config_free(cfg);
  CHECK(refused(strata_config_from_json_text(NULL, &cfg), STRATA_INVALID_ARGUMENT, "NULL"), "NULL text");
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
  cfg = NULL;
  CHECK(strata_config_from_file(config, &cfg) == STRATA_OK && cfg != NULL, "the ABI 4 from_file");
  strata_config_free(cfg);
  cfg = NULL;
  CHECK(strata_config_from_json("{\"threads\": 2}", &cfg) == STRATA_OK && cfg != NULL, "the ABI 4 from_json");
  strata_config_free(cfg);
  CHECK(refused(strata_config_from_json("{\"budgets\": {\"gpx\": 1}}", &cfg), STRATA_INVALID_ARGUMENT,
                "budgets.gpx"),
        "the ABI 4 from_json refuses as the new name does");
  strata_runtime* rt = make_runtime();
  c_hand_gradient(rt, 0, N);
  CHECK(strata_step(rt, NULL, 0) == STRATA_OK, "step");
  CHECK(strata_write_trace(rt, old_trace) == STRATA_OK, "the ABI 4 write_trace");
  CHECK(refused(strata_write_trace(rt, NULL), STRATA_INVALID_ARGUMENT, "path"), "ABI 4 name, NULL path");
#if defined(__GNUC__) || defined(__clang__)
#pragma GCC diagnostic pop
#endif
  CHECK(strata_write_chrome_trace(rt, trace) == STRATA_OK, "write_chrome_trace");
  CHECK(access(trace, R_OK) == 0 && access(old_trace, R_OK) == 0, "both traces written");
  CHECK(refused(strata_write_chrome_trace(NULL, trace), STRATA_INVALID_ARGUMENT, "runtime"), "NULL runtime");
  strata_runtime_free(rt);

  char cmd[sizeof dir + 16];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0) fprintf(stderr, "test_c_abi_ops: could not remove %s\n", dir);
}

int main(void) {
  test_no_gradient();
  test_abort_step();
  test_renames();
  if (failures == 0) printf("test_c_abi_ops: ok\n");
  return failures == 0 ? 0 : 1;
}
