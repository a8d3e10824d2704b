/* strata.h: the C ABI of strata, for training frameworks and other languages.
 *
 * Usage (error handling shortened; every call returns a strata_status):
 *
 *   strata_config* cfg;
 *   strata_config_new(&cfg);                                // defaults
 *   strata_config_set(cfg, "device.kind", "sim");           // keys as in docs/config.md
 *   strata_config_set(cfg, "budgets.gpu", "64MiB");
 *   strata_runtime* rt;
 *   if (strata_runtime_new(cfg, &rt) != STRATA_OK) fprintf(stderr, "%s\n", strata_last_error());
 *   strata_config_free(cfg);                                // the runtime keeps a copy
 *   int64_t shape[2] = {64, 64};
 *   uint32_t w;
 *   strata_register_tensor(rt, "w", shape, 2, 0, &w);
 *   strata_init_tensor(rt, w, values, 64 * 64);
 *   for (...) {
 *     strata_lease* p;
 *     strata_acquire(rt, w, STRATA_PARAM, STRATA_READ, STRATA_ON_DEVICE, &p);
 *     strata_launch(rt, forward_fn, &ctx);                  // runs on the compute stream
 *     strata_lease_release(p);                              // frees the handle
 *     ... backward: STRATA_GRAD with STRATA_WRITE ...
 *     strata_step_stats st;
 *     strata_step(rt, &st, sizeof st);                      // the size this header declares
 *   }
 *   strata_runtime_free(rt);
 *
 * Handles are opaque and owned by the caller: each *_new / strata_acquire result
 * is freed exactly once with its *_free / strata_lease_release. Leases must be
 * released before their runtime is freed. No C++ exception crosses this ABI;
 * failures are a strata_status with a message from strata_last_error().
 * Threading: one runtime is driven from one thread (as the C++ API); different
 * runtimes may be used from different threads. The error message is per thread.
 */
#ifndef STRATA_STRATA_H
#define STRATA_STRATA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/** The version of this header's ABI. It rises when a function or struct changes. Structs that the
 * library fills grow only at their end, and the caller passes the size it was compiled with, so an
 * older caller keeps working with a newer library (it gets the fields it knows of). */
#define STRATA_ABI_VERSION 5
/* ABI 5: every operation has one name on every surface (api/ops.py, Note [Public operations]):
 * strata_write_trace is strata_write_chrome_trace, strata_config_from_json / _from_file are
 * strata_config_from_json_text / _from_json_file (the old names stay exported, deprecated);
 * strata_abort_step and strata_no_gradient are new. */

/** Marks a deprecated function: callers still link, and compilers that know the attribute warn. */
#if defined(__GNUC__) || defined(__clang__)
#define STRATA_DEPRECATED(msg) __attribute__((deprecated(msg)))
#else
#define STRATA_DEPRECATED(msg)
#endif

/** Outcome of a call; the values match strata::StatusCode's order and are stable. */
typedef enum strata_status {
  STRATA_OK = 0,
  STRATA_INVALID_ARGUMENT = 1,
  STRATA_OUT_OF_BUDGET = 2,
  STRATA_OUT_OF_MEMORY = 3,
  STRATA_NO_SPACE = 4,
  STRATA_IO_ERROR = 5,
  STRATA_CORRUPT = 6,
  STRATA_NOT_FOUND = 7,
  STRATA_PERMISSION_DENIED = 8,
  STRATA_UNAVAILABLE = 9,
  STRATA_FAILED_PRECONDITION = 10,
  STRATA_CANCELLED = 11,
  STRATA_INTERNAL = 12
} strata_status;

/** Which state of a tensor a lease is on. */
typedef enum strata_state {
  STRATA_PARAM = 0,
  STRATA_GRAD = 1,
  STRATA_MASTER = 2,
  STRATA_STATE0 = 3,
  STRATA_STATE1 = 4
} strata_state;
/** What a lease may do. */
typedef enum strata_access { STRATA_READ = 0, STRATA_WRITE = 1, STRATA_ACCUMULATE = 2 } strata_access;
/** Where the lease's pointer is valid. */
typedef enum strata_where { STRATA_ON_DEVICE = 0, STRATA_ON_HOST = 1 } strata_where;

typedef struct strata_config strata_config;   /**< settings (opaque) */
typedef struct strata_runtime strata_runtime; /**< a runtime and its device (opaque) */
typedef struct strata_lease strata_lease;     /**< a pinned view of one tensor state (opaque) */

/** What one step did (see strata::StepStats). Fields are only ever added at the end (see
 * STRATA_ABI_VERSION); strata_step writes as many bytes as its caller says it has room for. */
typedef struct strata_step_stats {
  uint64_t step;
  int applied;
  double step_s;
  double stall_s;
  uint64_t bytes_h2d, bytes_d2h, bytes_disk_read, bytes_disk_write;
  uint64_t gpu_high_water_bytes, host_high_water_bytes, nvme_bytes;
  uint64_t prefetch_errors; /**< failed reads ahead of use this step (not fatal; see strata::StepStats) */
  /** Of bytes_disk_read: NVMe-homed params read for their forward and backward uses, and read again
   * by the optimizer beside their states (ABI 3; see strata::StepStats). */
  uint64_t bytes_disk_read_param_uses, bytes_disk_read_param_updates;
  /** NVMe families whose update this step left to run during the next forward (plan.deferred_updates;
   * ABI 4; see strata::StepStats). */
  uint32_t updates_deferred;
} strata_step_stats;

/* generated from api/ops.py by scripts/gen-api: do not edit (Note [Public operations]) */
/* clang-format off */
/** The ABI version of the library that is loaded (STRATA_ABI_VERSION of the headers it was built with). A
 * caller built against version N needs a library of version N or newer. */
uint32_t strata_abi_version(void);
/** The message of this thread's last failed call ("" when none; a call that returns STRATA_OK clears it).
 * Valid until the next call on this thread. */
const char* strata_last_error(void);
/** "invalid_argument", "out_of_budget", ... ("unknown" for a value that is no strata_status). */
const char* strata_status_name(strata_status status);
/** New settings with defaults (strata::Config()), owned by the caller (strata_config_free). Fails only when
 * out of memory. */
strata_status strata_config_new(strata_config** out);
/** Settings from JSON text (the keys of docs/config.md), owned by the caller. Unknown keys, wrong types and
 * bad values are refused by name (InvalidArgument). Never blocks. (Named strata_config_from_json before ABI
 * 5.) */
strata_status strata_config_from_json_text(const char* text, strata_config** out);
/** Settings from a JSON file, as from_json_text; NotFound / PermissionDenied name the path, InvalidArgument a
 * file that is not regular or larger than 1 MiB. Blocks on the read. (Named strata_config_from_file before
 * ABI 5.) */
strata_status strata_config_from_json_file(const char* path, strata_config** out);
/** Sets one setting from text by its key ("budgets.gpu", "optimizer.name", "nvme.dirs" as a comma list, ...).
 * InvalidArgument names the key and the value and says what is accepted. */
strata_status strata_config_set(strata_config* config, const char* key, const char* value);
/** Frees settings (NULL is ignored). */
void strata_config_free(strata_config* config);
/** Creates a runtime and its device from a copy of `config` (strata::Runtime::create), owned by the caller
 * (strata_runtime_free). Blocks while tiers are reserved. Fails: InvalidArgument naming a setting,
 * Unavailable (cuda forced, no GPU), the NVMe directory's error. */
strata_status strata_runtime_new(const strata_config* config, strata_runtime** out);
/** Waits for background work and frees everything (NULL is ignored). Leases must be released first. */
void strata_runtime_free(strata_runtime* runtime);
/** Registers a tensor of `shape` (a frozen one gets no gradient and no optimizer states); its id is the
 * result. Before the first lease. Fails: InvalidArgument (no elements, a duplicate name), FailedPrecondition
 * after the first lease. The id goes to *id_out; frozen is 0 or 1. */
strata_status strata_register_tensor(strata_runtime* runtime, const char* name, const int64_t* shape,
                                     size_t ndim, int frozen, uint32_t* id_out);
/** Sets a tensor's initial value (as many values as its elements); its optimizer states start at zero.
 * Between steps; blocks (may read and write NVMe). Fails: InvalidArgument (unknown id, wrong count). */
strata_status strata_init_tensor(strata_runtime* runtime, uint32_t tensor, const float* values,
                                 uint64_t count);
/** Copies a tensor's state `kind` as fp32 into out (as many values as its elements). Between steps; blocks
 * (flushes, may read NVMe). Fails: InvalidArgument (unknown id, wrong count), FailedPrecondition (a state
 * this optimizer does not keep). */
strata_status strata_read_tensor(strata_runtime* runtime, uint32_t tensor, strata_state kind, float* out,
                                 uint64_t count);
/** Pins state `kind` of a tensor on `where` and returns a lease on it. Blocks only for CPU work the chunk
 * depends on or for a free slot. Fails: InvalidArgument (bad id or kind), FailedPrecondition (a second write
 * lease, a frozen tensor's grad), OutOfBudget (every slot pinned). The lease handle goes to *out, owned by
 * the caller (strata_lease_release). */
strata_status strata_acquire(strata_runtime* runtime, uint32_t tensor, strata_state kind,
                             strata_access access, strata_where where, strata_lease** out);
/** The lease's first element (Lease::data(): device memory on STRATA_ON_DEVICE; host-addressable on the sim
 * device); NULL for a NULL lease. */
void* strata_lease_data(const strata_lease* lease);
/** Elements the lease covers (Lease::numel()); 0 for a NULL lease. */
uint64_t strata_lease_numel(const strata_lease* lease);
/** Releases the pin (Lease::release()) and frees the handle (NULL is ignored). */
void strata_lease_release(strata_lease* lease);
/** Runs fn on the compute stream, after the work of the leases taken so far; its time counts as compute. Does
 * not wait for fn. Fails with the device's error. fn must not longjmp out. */
strata_status strata_launch(strata_runtime* runtime, void (*fn)(void* user), void* user);
/** Ends the step: runs or waits for every optimizer step, re-plans after the warm-up step. Blocks. Fails with
 * the first background error (an NVMe EIO, a corrupt chunk); the last completed step's state is intact and
 * abort_step discards this one. *out (may be NULL) receives its figures. out_size is
 * sizeof(strata_step_stats) as the caller's header declares it: only that many bytes are written. A size
 * smaller than the first published struct (ABI 1, up to nvme_bytes) is refused with STRATA_INVALID_ARGUMENT
 * before the step runs. */
strata_status strata_step(strata_runtime* runtime, strata_step_stats* out, size_t out_size);
/** Discards the step in progress (Note [Failed steps]): waits for background work and launched compute, drops
 * the step's gradients, forgets its trace and clears the runtime's error, so the next step starts clean.
 * Blocks. Fails: FailedPrecondition while leases are held (release them first). (C: ABI 5.) */
strata_status strata_abort_step(strata_runtime* runtime);
/** Waits until the last step's states are on their home tiers (NVMe write-backs outlive step). Returns the
 * first background error. Blocks. read_tensor and freeing the runtime flush by themselves. */
strata_status strata_flush(strata_runtime* runtime);
/** Writes the Chrome trace (chrome://tracing, Perfetto) of the recorded timeline to `path`. Blocks on the
 * write. Fails: the file's error, naming the path. (Named strata_write_trace before ABI 5.) */
strata_status strata_write_chrome_trace(const strata_runtime* runtime, const char* path);

/* --- For training frameworks (the torch binding uses these) -------------------------------------------- */

/** Blocks until a lease's memory holds its tensor, for math run on the calling thread instead of launch
 * (torch CPU ops on the sim device). The lease stays valid. Fails with the device's error. */
strata_status strata_lease_wait(strata_runtime* runtime, const strata_lease* lease);
/** Starts a micro-batch: with last false no optimizer runs and gradients are kept for the next micro-batch to
 * add to (access accumulate). Fails: FailedPrecondition while leases are held. */
strata_status strata_begin_micro_batch(strata_runtime* runtime, int last);
/** Declares that `tensor` gets no gradient in this micro-batch (its branch was unused), so its family's
 * gradients may complete before step; a later write of its gradient in this micro-batch is refused. Fails:
 * InvalidArgument (unknown id), FailedPrecondition (frozen, gradient already handed over or declared absent,
 * data parallelism). (C: ABI 5.) */
strata_status strata_no_gradient(strata_runtime* runtime, uint32_t tensor);
/** Multiplies every gradient by scale (1/loss_scale) from the next optimizer step on; set it before backward.
 * STRATA_INVALID_ARGUMENT for a scale that is not finite and > 0. */
strata_status strata_set_grad_scale(strata_runtime* runtime, float scale);
/** Puts a tensor in parameter group `group` (< 65536; 0 by default; Note [Parameter groups]). Before the
 * first lease and between steps. Fails: InvalidArgument (unknown id, group too large). */
strata_status strata_set_tensor_group(strata_runtime* runtime, uint32_t tensor, uint32_t group);
/** Sets a group's lr and weight decay (finite, >= 0), overriding the optimizer's; the values in effect when a
 * family's optimizer starts are used. Between step and the next backward; FailedPrecondition otherwise,
 * InvalidArgument for a bad value. */
strata_status strata_set_group_hyper(strata_runtime* runtime, uint32_t group, float lr, float weight_decay);
/** Overwrites state `kind` of a tensor (param, master, state0/1; not grad) from fp32 values (as many as its
 * elements; a checkpoint's load). Between steps; blocks. Fails: InvalidArgument (unknown id, wrong count),
 * FailedPrecondition (leases held, a state it does not have, grad). */
strata_status strata_write_tensor(strata_runtime* runtime, uint32_t tensor, strata_state kind,
                                  const float* values, uint64_t count);
/** The optimizer steps applied to a tensor (its bias-correction step counter). Fails: InvalidArgument
 * (unknown id). The count goes to *out. */
strata_status strata_tensor_steps(strata_runtime* runtime, uint32_t tensor, int64_t* out);
/** Sets a tensor's step counter (>= 0; a checkpoint's load). Between steps. Fails: InvalidArgument (unknown
 * id, negative). */
strata_status strata_set_tensor_steps(strata_runtime* runtime, uint32_t tensor, int64_t steps);
/** Writes a crash-safe checkpoint of every tensor's param, master, optimizer states and step counter into
 * directory `dir` (created when missing; not inside an NVMe swap directory). A crash or error at any point
 * leaves the previous checkpoint there loadable. Between steps; blocks. Fails: InvalidArgument,
 * FailedPrecondition (leases held), PermissionDenied / NoSpace / IoError naming the file. */
strata_status strata_save_checkpoint(strata_runtime* runtime, const char* dir);
/** Starts a checkpoint of the state as of this call into `dir` and returns at once; training goes on while it
 * is written. Between steps; waits for a save still in flight first (returning its error). Errors of the
 * background save surface in finish_checkpoint / checkpoint_in_flight and leave the previously published
 * checkpoint untouched. */
strata_status strata_begin_checkpoint(strata_runtime* runtime, const char* dir);
/** Waits for the save begun by begin_checkpoint; its outcome (Ok when none). Blocks. */
strata_status strata_finish_checkpoint(strata_runtime* runtime);
/** Polls the save begun by begin_checkpoint: true while it runs, else false; its error when it failed
 * (finish_checkpoint collects it). Never blocks. *in_flight is 1 while it runs, else 0. */
strata_status strata_checkpoint_in_flight(strata_runtime* runtime, int* in_flight);
/** Loads the checkpoint published in `dir` (chunk size, budgets and placement may differ from the saving
 * runtime's). A checkpoint of another model, a newer format, a flipped byte, a truncated file or a missing
 * manifest is refused whole, naming the file. Between steps; blocks. */
strata_status strata_load_checkpoint(strata_runtime* runtime, const char* dir);

/* --- Deprecated names: renamed in ABI 5 (one name per operation on every surface); still
 * exported, so that callers built against ABI 4 keep linking. --- */

/** Deprecated: strata_config_from_json_text under its ABI 4 name (it calls strata_config_from_json_text). */
STRATA_DEPRECATED("use strata_config_from_json_text")
strata_status strata_config_from_json(const char* text, strata_config** out);
/** Deprecated: strata_config_from_json_file under its ABI 4 name (it calls strata_config_from_json_file). */
STRATA_DEPRECATED("use strata_config_from_json_file")
strata_status strata_config_from_file(const char* path, strata_config** out);
/** Deprecated: strata_write_chrome_trace under its ABI 4 name (it calls strata_write_chrome_trace). */
STRATA_DEPRECATED("use strata_write_chrome_trace")
strata_status strata_write_trace(const strata_runtime* runtime, const char* path);
/* clang-format on */
/* end of generated */

#ifdef __cplusplus
}
#endif

#endif /* STRATA_STRATA_H */
