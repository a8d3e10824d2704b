/* The C ABI from C: trains y = x . w (one 64x64 weight) toward a target on the
 * sim device, checks the loss falls, and checks errors come back as codes with
 * messages. Exit 0 on success; prints the failing check otherwise. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "strata/strata.h"

#define C_CHECK_NAME "test_c_abi"
#include "c_check.h"

#define N 64
#define BATCH 8

typedef struct {
  float x[BATCH * N];
  float target[BATCH * N];
  float out[BATCH * N];
  float dout[BATCH * N];
  const float* w;
  float* g;
  float loss;
} Model;

static void forward(void* user) {
  Model* m = (Model*)user;
  float loss = 0.0f;
  for (int r = 0; r < BATCH; ++r) {
    for (int j = 0; j < N; ++j) {
      float s = 0.0f;
      for (int k = 0; k < N; ++k) s += m->x[r * N + k] * m->w[k * N + j];
      m->out[r * N + j] = s;
      const float d = s - m->target[r * N + j];
      loss += d * d / (BATCH * N);
      m->dout[r * N + j] = 2.0f * d / (BATCH * N);
    }
  }
  m->loss = loss;
}

static void backward(void* user) {
  Model* m = (Model*)user;
  for (int k = 0; k < N; ++k) {
    for (int j = 0; j < N; ++j) {
      float s = 0.0f;
      for (int r = 0; r < BATCH; ++r) s += m->x[r * N + k] * m->dout[r * N + j];
      m->g[k * N + j] = s;
    }
  }
}

int main(void) {
  /* Errors: codes and messages, never a crash. */
  strata_config* bad = NULL;
  strata_status st = strata_config_from_json_text("{\"budgets\": {\"gpx\": \"1GiB\"}}", &bad);
  CHECK(st == STRATA_INVALID_ARGUMENT, "unknown key gives %s", strata_status_name(st));
  CHECK(strstr(strata_last_error(), "budgets.gpx") != NULL, "message names the key");
  CHECK(bad == NULL, "no handle on failure");

  strata_config* cfg = NULL;
  st = strata_config_new(&cfg);
  CHECK(st == STRATA_OK, "config_new");
  CHECK(strata_config_set(cfg, "device.kind", "sim") == STRATA_OK, "device.kind");
  CHECK(strata_config_set(cfg, "device.budget", "16MiB") == STRATA_OK, "device.budget");
  CHECK(strata_config_set(cfg, "budgets.gpu", "8MiB") == STRATA_OK, "budgets.gpu");
  CHECK(strata_config_set(cfg, "budgets.host", "16MiB") == STRATA_OK, "budgets.host");
  CHECK(strata_config_set(cfg, "optimizer.name", "sgd") == STRATA_OK, "optimizer.name");
  CHECK(strata_config_set(cfg, "optimizer.lr", "2.0") == STRATA_OK, "optimizer.lr");
  CHECK(strata_config_set(cfg, "optimizer.momentum", "0.9") == STRATA_OK, "optimizer.momentum");
  CHECK(strata_config_set(cfg, "threads", "2") == STRATA_OK, "threads");
  CHECK(strata_config_set(cfg, "layout.chunk_elems", "4096") == STRATA_OK, "layout.chunk_elems");
  CHECK(strata_config_set(cfg, "budgets.host", "-3GiB") == STRATA_INVALID_ARGUMENT, "negative size refused");

  strata_runtime* rt = NULL;
  st = strata_runtime_new(cfg, &rt);
  strata_config_free(cfg);
  if (st != STRATA_OK) {
    fprintf(stderr, "test_c_abi: runtime_new failed: %s\n", strata_last_error());
    return 1;
  }

  const int64_t shape[2] = {N, N};
  uint32_t w = 0;
  CHECK(strata_register_tensor(rt, "w", shape, 2, 0, &w) == STRATA_OK, "register");
  uint32_t dup = 0;
  CHECK(strata_register_tensor(rt, "w", shape, 2, 0, &dup) == STRATA_INVALID_ARGUMENT,
        "duplicate name refused");

  static Model m;
  static float init[N * N];
  unsigned seed = 12345u;
  for (int i = 0; i < N * N; ++i) {
    seed = seed * 1103515245u + 12345u;
    init[i] = ((float)((seed >> 16) & 0x7fff) / 32768.0f - 0.5f) * 0.02f;
  }
  for (int i = 0; i < BATCH * N; ++i) {
    seed = seed * 1103515245u + 12345u;
    m.x[i] = (float)((seed >> 16) & 0x7fff) / 32768.0f - 0.5f;
    m.target[i] = 0.25f * sinf((float)i);
  }
  CHECK(strata_init_tensor(rt, w, init, N * N) == STRATA_OK, "init");

  float first = -1.0f, last = -1.0f;
  for (int step = 0; step < 30; ++step) {
    strata_lease* p = NULL;
    st = strata_acquire(rt, w, STRATA_PARAM, STRATA_READ, STRATA_ON_DEVICE, &p);
    CHECK(st == STRATA_OK, "acquire param");
    if (st != STRATA_OK) break;
    CHECK(strata_lease_numel(p) == N * N, "lease numel");
    m.w = (const float*)strata_lease_data(p);
    CHECK(strata_launch(rt, forward, &m) == STRATA_OK, "launch forward");
    strata_lease* g = NULL;
    st = strata_acquire(rt, w, STRATA_GRAD, STRATA_WRITE, STRATA_ON_DEVICE, &g);
    CHECK(st == STRATA_OK, "acquire grad");
    if (st != STRATA_OK) break;
    m.g = (float*)strata_lease_data(g);
    CHECK(strata_launch(rt, backward, &m) == STRATA_OK, "launch backward");
    strata_lease_release(g);
    strata_lease_release(p);
    strata_step_stats stats;
    CHECK(strata_step(rt, &stats, sizeof stats) == STRATA_OK, "step");
    CHECK(stats.step == (uint64_t)step + 1, "step index %llu", (unsigned long long)stats.step);
    if (step == 0) first = m.loss;
    last = m.loss;
  }
  /* ABI: a caller built against an older, smaller strata_step_stats gets the fields it knows of and no
   * byte past them; a size smaller than the first struct is refused before the step runs. */
  CHECK(strata_abi_version() == STRATA_ABI_VERSION, "library ABI %u", (unsigned)strata_abi_version());
  {
    struct {
      strata_step_stats stats;
      unsigned char guard[16];
    } out;
    memset(&out, 0xAB, sizeof out);
    const size_t abi1 = offsetof(strata_step_stats, prefetch_errors);
    CHECK(strata_step(rt, &out.stats, abi1) == STRATA_OK, "step with ABI 1's size");
    CHECK(out.stats.step == 31, "step index %llu", (unsigned long long)out.stats.step);
    const unsigned char* bytes = (const unsigned char*)&out;
    int written_past = 0;
    for (size_t i = abi1; i < sizeof out; ++i) written_past += bytes[i] != 0xAB;
    CHECK(written_past == 0, "%d bytes written past out_size", written_past);
    CHECK(strata_step(rt, &out.stats, 8) == STRATA_INVALID_ARGUMENT, "an out_size of 8 is refused");
    CHECK(strstr(strata_last_error(), "out_size 8") != NULL, "message names the size: %s",
          strata_last_error());
    CHECK(strata_step(rt, &out.stats, sizeof out.stats) == STRATA_OK, "step");
    CHECK(out.stats.step == 32, "the refused call ran no step (step %llu)",
          (unsigned long long)out.stats.step);
    /* ABI 3: the params' share of the disk reads, none here (nothing is on NVMe): the fields are
     * filled, not left as the caller's garbage */
    CHECK(out.stats.bytes_disk_read_param_uses == 0 && out.stats.bytes_disk_read_param_updates == 0,
          "param reads %llu + %llu with nothing on NVMe",
          (unsigned long long)out.stats.bytes_disk_read_param_uses,
          (unsigned long long)out.stats.bytes_disk_read_param_updates);
    /* ABI 4: no update deferred (plan.deferred_updates is 0): filled, not the caller's garbage */
    CHECK(out.stats.updates_deferred == 0, "updates_deferred %u", (unsigned)out.stats.updates_deferred);
  }
  CHECK(strata_flush(rt) == STRATA_OK, "flush");
  CHECK(strata_flush(NULL) != STRATA_OK, "flush(NULL) is an error");
  printf("test_c_abi: loss %.5f -> %.5f over 30 SGD steps\n", first, last);
  CHECK(last < 0.5f * first, "loss falls (%f -> %f)", first, last);

  static float after[N * N];
  CHECK(strata_read_tensor(rt, w, STRATA_PARAM, after, N * N) == STRATA_OK, "read");
  int changed = 0;
  for (int i = 0; i < N * N; ++i) changed += after[i] != init[i];
  CHECK(changed > N * N / 2, "params changed (%d of %d)", changed, N * N);
  CHECK(strata_read_tensor(rt, w, STRATA_PARAM, after, 3) == STRATA_INVALID_ARGUMENT, "wrong count refused");
  CHECK(strata_acquire(rt, 999, STRATA_PARAM, STRATA_READ, STRATA_ON_DEVICE, &(strata_lease*){NULL}) ==
            STRATA_INVALID_ARGUMENT,
        "bad id refused");
  strata_runtime_free(rt);
  if (failures == 0) printf("test_c_abi: ok\n");
  return failures == 0 ? 0 : 1;
}
