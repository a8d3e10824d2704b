/* The C ABI calls a training framework needs, from C: lease waits (host math
 * instead of strata_launch), micro-batches with accumulation, the grad scale,
 * parameter groups with their own lr, and reading/writing optimizer states and
 * step counters (a checkpoint round trip that resumes bit for bit).
 * Exit 0 on success; prints the failing check otherwise. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/strata.h"

#define C_CHECK_NAME "test_c_abi_state"
#include "c_check.h"

#define N 4096

static strata_runtime* make_runtime(const char* optimizer) {
  strata_config* cfg = NULL;
  CHECK(strata_config_new(&cfg) == STRATA_OK, "config_new");
  CHECK(strata_config_set(cfg, "device.kind", "sim") == STRATA_OK, "device.kind");
  CHECK(strata_config_set(cfg, "device.budget", "16MiB") == STRATA_OK, "device.budget");
  /* Three 16 KiB slots for two tensors' param, grad and states: chunks move. */
  CHECK(strata_config_set(cfg, "budgets.gpu", "48KiB") == STRATA_OK, "budgets.gpu");
  CHECK(strata_config_set(cfg, "budgets.host", "16MiB") == STRATA_OK, "budgets.host");
  CHECK(strata_config_set(cfg, "layout.chunk_elems", "4096") == STRATA_OK, "layout.chunk_elems");
  CHECK(strata_config_set(cfg, "optimizer.name", optimizer) == STRATA_OK, "optimizer.name");
  CHECK(strata_config_set(cfg, "optimizer.lr", "0.01") == STRATA_OK, "optimizer.lr");
  CHECK(strata_config_set(cfg, "threads", "2") == STRATA_OK, "threads");
  return c_runtime_with_tensors(cfg, N, 2, 0);
}

/* One step of `micro` micro-batches: the gradient of micro-batch k is param * (k + 1) * scale_in,
 * written on the host thread after strata_lease_wait (no strata_launch). */
static void train_step(strata_runtime* rt, int micro, float scale_in) {
  for (int k = 0; k < micro; ++k) {
    CHECK(strata_begin_micro_batch(rt, k == micro - 1) == STRATA_OK, "begin_micro_batch");
    for (uint32_t t = 0; t < 2; ++t) {
      strata_lease* p = NULL;
      strata_lease* g = NULL;
      if (strata_acquire(rt, t, STRATA_PARAM, STRATA_READ, STRATA_ON_DEVICE, &p) != STRATA_OK) {
        CHECK(0, "acquire param");
        return;
      }
      CHECK(strata_lease_wait(rt, p) == STRATA_OK, "wait param");
      if (strata_acquire(rt, t, STRATA_GRAD, k == 0 ? STRATA_WRITE : STRATA_ACCUMULATE, STRATA_ON_DEVICE,
                         &g) != STRATA_OK) {
        CHECK(0, "acquire grad (micro-batch %d)", k);
        strata_lease_release(p);
        return;
      }
      CHECK(strata_lease_wait(rt, g) == STRATA_OK, "wait grad");
      const float* pv = (const float*)strata_lease_data(p);
      float* gv = (float*)strata_lease_data(g);
      for (int i = 0; i < N; ++i) gv[i] = (k == 0 ? 0.0f : gv[i]) + pv[i] * (float)(k + 1) * scale_in;
      strata_lease_release(g);
      strata_lease_release(p);
    }
  }
  strata_step_stats stats;
  CHECK(strata_step(rt, &stats, sizeof stats) == STRATA_OK, "step");
}

static void read_all(strata_runtime* rt, float* out /* 2 tensors x 3 states x N */, int64_t* steps) {
  for (uint32_t t = 0; t < 2; ++t) {
    CHECK(strata_read_tensor(rt, t, STRATA_MASTER, out + (t * 3 + 0) * N, N) == STRATA_OK, "read master");
    CHECK(strata_read_tensor(rt, t, STRATA_STATE0, out + (t * 3 + 1) * N, N) == STRATA_OK, "read state0");
    CHECK(strata_read_tensor(rt, t, STRATA_STATE1, out + (t * 3 + 2) * N, N) == STRATA_OK, "read state1");
    CHECK(strata_tensor_steps(rt, t, &steps[t]) == STRATA_OK, "tensor_steps");
  }
}

int main(void) {
  static float straight[6 * N], at2[6 * N], resumed[6 * N], one_shot[6 * N], scaled[6 * N];
  int64_t steps_straight[2], steps_at2[2], steps_resumed[2], steps_other[2];

  /* 1. Straight: 4 steps of 2 micro-batches (adamw). */
  strata_runtime* a = make_runtime("adamw");
  train_step(a, 2, 1.0f);
  train_step(a, 2, 1.0f);
  read_all(a, at2, steps_at2);
  train_step(a, 2, 1.0f);
  train_step(a, 2, 1.0f);
  read_all(a, straight, steps_straight);
  CHECK(steps_straight[0] == 4 && steps_straight[1] == 4, "4 steps counted (%lld)",
        (long long)steps_straight[0]);
  strata_runtime_free(a);

  /* 2. Resumed from step 2 through strata_write_tensor / strata_set_tensor_steps. */
  strata_runtime* b = make_runtime("adamw");
  for (uint32_t t = 0; t < 2; ++t) {
    CHECK(strata_write_tensor(b, t, STRATA_MASTER, at2 + (t * 3 + 0) * N, N) == STRATA_OK, "write master");
    CHECK(strata_write_tensor(b, t, STRATA_STATE0, at2 + (t * 3 + 1) * N, N) == STRATA_OK, "write state0");
    CHECK(strata_write_tensor(b, t, STRATA_STATE1, at2 + (t * 3 + 2) * N, N) == STRATA_OK, "write state1");
    CHECK(strata_set_tensor_steps(b, t, steps_at2[t]) == STRATA_OK, "set_tensor_steps");
  }
  CHECK(strata_write_tensor(b, 0, STRATA_GRAD, at2, N) == STRATA_FAILED_PRECONDITION, "grad is not writable");
  CHECK(strata_write_tensor(b, 0, STRATA_STATE0, at2, 3) == STRATA_INVALID_ARGUMENT, "wrong count refused");
  CHECK(strata_set_tensor_steps(b, 0, -2) == STRATA_INVALID_ARGUMENT, "negative step refused");
  train_step(b, 2, 1.0f);
  train_step(b, 2, 1.0f);
  read_all(b, resumed, steps_resumed);
  CHECK(memcmp(resumed, straight, sizeof straight) == 0, "resumed run is bit-identical to the straight run");
  CHECK(steps_resumed[0] == 4, "resumed step counter %lld", (long long)steps_resumed[0]);
  strata_runtime_free(b);

  /* 3. Micro-batches accumulate: 2 micro-batches (grads p, 2p) equal one of 3p. */
  strata_runtime* c = make_runtime("sgd");
  strata_runtime* d = make_runtime("sgd");
  train_step(c, 2, 1.0f);
  train_step(d, 1, 3.0f);
  float pc[N], pd[N];
  CHECK(strata_read_tensor(c, 0, STRATA_PARAM, pc, N) == STRATA_OK, "read c");
  CHECK(strata_read_tensor(d, 0, STRATA_PARAM, pd, N) == STRATA_OK, "read d");
  CHECK(memcmp(pc, pd, sizeof pc) == 0, "2 accumulated micro-batches equal one with the summed gradient");
  strata_runtime_free(c);

  /* 4. The grad scale: grads of 4p scaled by 1/4 (exact) equal grads of p. */
  CHECK(strata_set_grad_scale(d, 0.0f) == STRATA_INVALID_ARGUMENT, "scale 0 refused");
  CHECK(strata_set_grad_scale(d, NAN) == STRATA_INVALID_ARGUMENT, "NaN scale refused");
  strata_runtime* e = make_runtime("sgd");
  strata_runtime* f = make_runtime("sgd");
  CHECK(strata_set_grad_scale(e, 0.25f) == STRATA_OK, "set_grad_scale");
  train_step(e, 1, 4.0f);
  train_step(f, 1, 1.0f);
  CHECK(strata_read_tensor(e, 0, STRATA_PARAM, pc, N) == STRATA_OK, "read e");
  CHECK(strata_read_tensor(f, 0, STRATA_PARAM, pd, N) == STRATA_OK, "read f");
  CHECK(memcmp(pc, pd, sizeof pc) == 0, "a 1/4 grad scale undoes a 4x gradient");
  strata_runtime_free(e);
  strata_runtime_free(f);

  /* 5. Groups: tensor b in group 1 with lr 0 does not move; a (group 0) does. */
  strata_runtime* g = make_runtime("adamw");
  CHECK(strata_set_tensor_group(g, 1, 1) == STRATA_OK, "set_tensor_group");
  CHECK(strata_set_group_hyper(g, 1, 0.0f, 0.0f) == STRATA_OK, "set_group_hyper");
  CHECK(strata_set_group_hyper(g, 1, -1.0f, 0.0f) == STRATA_INVALID_ARGUMENT, "negative lr refused");
  train_step(g, 1, 1.0f);
  read_all(g, one_shot, steps_other);
  float init[N];
  for (int i = 0; i < N; ++i) init[i] = 0.001f * (float)(i % 97) - 0.05f;
  CHECK(memcmp(one_shot + 3 * N, init, sizeof init) == 0, "group 1 (lr 0) unchanged");
  CHECK(memcmp(one_shot, init, sizeof init) != 0, "group 0 updated");
  strata_runtime_free(g);
  (void)scaled;
  strata_runtime_free(d);

  CHECK(strata_lease_wait(NULL, NULL) == STRATA_INVALID_ARGUMENT, "NULL refused");
  if (failures == 0) printf("test_c_abi_state: ok\n");
  return failures == 0 ? 0 : 1;
}
