/* strata_save_checkpoint / strata_begin_checkpoint / strata_load_checkpoint from C: a run saved at step 2
 * and loaded into a fresh runtime with another chunk size continues bit for bit
 * like the straight run; a missing manifest and a NULL directory are refused.
 * Exit 0 on success; prints the failing check otherwise. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "strata/strata.h"

#define C_CHECK_NAME "test_c_abi_checkpoint"
#include "c_check.h"

#define N 4096

static strata_runtime* make_runtime(const char* chunk_elems) {
  strata_config* cfg = NULL;
  CHECK(strata_config_new(&cfg) == STRATA_OK, "config_new");
  CHECK(strata_config_set(cfg, "device.kind", "sim") == STRATA_OK, "device.kind");
  CHECK(strata_config_set(cfg, "device.budget", "16MiB") == STRATA_OK, "device.budget");
  CHECK(strata_config_set(cfg, "budgets.gpu", "96KiB") == STRATA_OK, "budgets.gpu");
  CHECK(strata_config_set(cfg, "budgets.host", "16MiB") == STRATA_OK, "budgets.host");
  CHECK(strata_config_set(cfg, "layout.chunk_elems", chunk_elems) == STRATA_OK, "layout.chunk_elems");
  CHECK(strata_config_set(cfg, "optimizer.name", "adamw") == STRATA_OK, "optimizer.name");
  CHECK(strata_config_set(cfg, "optimizer.lr", "0.01") == STRATA_OK, "optimizer.lr");
  CHECK(strata_config_set(cfg, "threads", "2") == STRATA_OK, "threads");
  return c_runtime_with_tensors(cfg, N, 2, 0);
}

/* One step; the gradient is param * 0.5 + 0.01, written on the host thread. */
static void train_step(strata_runtime* rt) {
  for (uint32_t t = 0; t < 2; ++t) c_hand_gradient(rt, t, N);
  CHECK(strata_step(rt, NULL, 0) == STRATA_OK, "step");
}

static void read_all(strata_runtime* rt, float* out /* 2 tensors x 3 states x N */, int64_t* steps) {
  const strata_state kinds[3] = {STRATA_MASTER, STRATA_STATE0, STRATA_STATE1};
  for (uint32_t t = 0; t < 2; ++t) {
    for (int k = 0; k < 3; ++k)
      CHECK(strata_read_tensor(rt, t, kinds[k], out + (t * 3 + k) * N, N) == STRATA_OK, "read");
    CHECK(strata_tensor_steps(rt, t, &steps[t]) == STRATA_OK, "tensor_steps");
  }
}

/* Loads `dir` into a fresh runtime with both tensors in one chunk (8192 elements), trains two
 * steps and checks that it equals `straight` (the 4-step straight run) bit for bit. */
static void check_resume(const char* dir, const float* straight, const char* what) {
  static float resumed[6 * N];
  int64_t steps[2];
  strata_runtime* rt = make_runtime("8192");
  CHECK(strata_load_checkpoint(rt, dir) == STRATA_OK, "load %s", what);
  train_step(rt);
  train_step(rt);
  read_all(rt, resumed, steps);
  CHECK(memcmp(resumed, straight, sizeof resumed) == 0, "resumed from %s: bit-identical to the straight run",
        what);
  CHECK(steps[0] == 4 && steps[1] == 4, "step counters %lld %lld", (long long)steps[0], (long long)steps[1]);
  strata_runtime_free(rt);
}

int main(void) {
  static float straight[6 * N];
  int64_t steps_straight[2];
  char dir[] = "/tmp/strata-c-ckpt-XXXXXX";
  if (mkdtemp(dir) == NULL) return 1;

  strata_runtime* a = make_runtime("4096");
  train_step(a);
  train_step(a);
  CHECK(strata_save_checkpoint(a, dir) == STRATA_OK, "save");
  CHECK(strata_save_checkpoint(a, NULL) == STRATA_INVALID_ARGUMENT, "NULL dir refused");
  train_step(a);
  train_step(a);
  read_all(a, straight, steps_straight);
  strata_runtime_free(a);

  /* Both tensors in one chunk there (8192 elements), one each in the saving runtime. */
  check_resume(dir, straight, "the blocking save");

  /* The overlapped save: begun at step 2, two steps run while it is in flight; it
   * holds the state at step 2 and the training it overlaps is unchanged. */
  char dir2[] = "/tmp/strata-c-ckpt2-XXXXXX";
  if (mkdtemp(dir2) == NULL) return 1;
  static float overlapped[6 * N];
  int64_t steps_overlapped[2];
  strata_runtime* c = make_runtime("4096");
  train_step(c);
  train_step(c);
  CHECK(strata_begin_checkpoint(c, dir2) == STRATA_OK, "begin_checkpoint");
  train_step(c);
  train_step(c);
  CHECK(strata_finish_checkpoint(c) == STRATA_OK, "finish_checkpoint");
  int in_flight = 1;
  CHECK(strata_checkpoint_in_flight(c, &in_flight) == STRATA_OK && in_flight == 0, "nothing in flight");
  CHECK(strata_checkpoint_in_flight(c, NULL) == STRATA_INVALID_ARGUMENT, "NULL in_flight refused");
  read_all(c, overlapped, steps_overlapped);
  CHECK(memcmp(overlapped, straight, sizeof straight) == 0, "the save does not change the training");
  strata_runtime_free(c);
  check_resume(dir2, straight, "the overlapped save");
  char cmd2[sizeof dir2 + 16];
  snprintf(cmd2, sizeof cmd2, "rm -rf %s", dir2);
  if (system(cmd2) != 0) fprintf(stderr, "test_c_abi_checkpoint: could not remove %s\n", dir2);

  strata_runtime* b = make_runtime("8192");
  char manifest[sizeof dir + 32];
  snprintf(manifest, sizeof manifest, "%s/manifest.json", dir);
  CHECK(unlink(manifest) == 0, "unlink manifest");
  CHECK(strata_load_checkpoint(b, dir) == STRATA_NOT_FOUND, "a missing manifest is refused");
  CHECK(strstr(strata_last_error(), "manifest.json") != NULL, "the error names the manifest: %s",
        strata_last_error());
  strata_runtime_free(b);

  char cmd[sizeof dir + 16];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0) fprintf(stderr, "test_c_abi_checkpoint: could not remove %s\n", dir);
  if (failures == 0) printf("test_c_abi_checkpoint: ok\n");
  return failures == 0 ? 0 : 1;
}
