// The C ABI (strata.h) over strata::Runtime (strata.hpp). Every entry point catches whatever
// might escape (std::bad_alloc, a CLI/JSON library exception) and turns it into
// a status, so no exception crosses the ABI.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <new>
#include <optional>
#include <string>

#include "strata/common/status_names.hpp"
#include "strata/strata.h"
#include "strata/strata.hpp"

struct strata_config {
  strata::Config config;
};
struct strata_runtime {
  std::unique_ptr<strata::Runtime> rt;
};
struct strata_lease {
  strata::Lease lease;
};

namespace {

// strata_state is StateKind's values (the casts below rely on it; so does strata.torch,
// whose constants the binding generates from the enum: tests/torch/test_one_api.py).
static_assert(static_cast<int>(strata::StateKind::kParam) == STRATA_PARAM &&
              static_cast<int>(strata::StateKind::kGrad) == STRATA_GRAD &&
              static_cast<int>(strata::StateKind::kMaster) == STRATA_MASTER &&
              static_cast<int>(strata::StateKind::kState0) == STRATA_STATE0 &&
              static_cast<int>(strata::StateKind::kState1) == STRATA_STATE1 &&
              strata::runtime::kStateKindCount == STRATA_STATE1 + 1);

thread_local std::string last_error;

strata_status fail(const strata::Status& status) {
  last_error = status.to_string();
  static_assert(static_cast<int>(strata::StatusCode::kInternal) == STRATA_INTERNAL);
  return static_cast<strata_status>(status.code());
}

strata_status ok() {
  last_error.clear();
  return STRATA_OK;
}

strata_status null_argument(const char* what) {
  return fail(strata::invalid_argument("{} must not be NULL", what));
}

// Runs fn, mapping a thrown exception to STRATA_INTERNAL / STRATA_OUT_OF_MEMORY.
template <typename Fn>
strata_status guarded(Fn&& fn) noexcept {
  try {
    return fn();
  } catch (const std::bad_alloc&) {
    return fail(strata::out_of_memory("strata: out of host memory"));
  } catch (const std::exception& e) {
    return fail(strata::internal_error("strata: unexpected exception: {}", e.what()));
  } catch (...) {
    return fail(strata::internal_error("strata: unexpected exception"));
  }
}

strata_status from(const strata::Status& s) {
  return s.ok() ? ok() : fail(s);
}

}  // namespace

extern "C" {

const char* strata_last_error(void) {
  return last_error.c_str();
}

const char* strata_status_name(strata_status status) {
  // The one status-name table (strata/common/status_names.hpp); its names are
  // literals, so .data() is a NUL-terminated string that lives forever.
  const std::optional<strata::StatusCode> code = strata::status_code_from_int(static_cast<int>(status));
  return code ? strata::status_code_id(*code).data() : "unknown";
}

strata_status strata_config_new(strata_config** out) {
  if (out == nullptr) return null_argument("out");
  return guarded([&] {
    *out = new strata_config{};
    return ok();
  });
}

strata_status strata_config_from_json_text(const char* text, strata_config** out) {
  if (text == nullptr) return null_argument("text");
  if (out == nullptr) return null_argument("out");
  return guarded([&] {
    auto c = strata::Config::from_json_text(text);
    if (!c.ok()) return fail(c.status());
    *out = new strata_config{std::move(c).value()};
    return ok();
  });
}

strata_status strata_config_from_json_file(const char* path, strata_config** out) {
  if (path == nullptr) return null_argument("path");
  if (out == nullptr) return null_argument("out");
  return guarded([&] {
    auto c = strata::Config::from_json_file(path);
    if (!c.ok()) return fail(c.status());
    *out = new strata_config{std::move(c).value()};
    return ok();
  });
}

strata_status strata_config_set(strata_config* config, const char* key, const char* value) {
  if (config == nullptr) return null_argument("config");
  if (key == nullptr || value == nullptr) return null_argument("key and value");
  return guarded([&] { return from(config->config.set(key, value)); });
}

void strata_config_free(strata_config* config) {
  delete config;
}

strata_status strata_runtime_new(const strata_config* config, strata_runtime** out) {
  if (config == nullptr) return null_argument("config");
  if (out == nullptr) return null_argument("out");
  return guarded([&] {
    auto rt = strata::Runtime::create(config->config);
    if (!rt.ok()) return fail(rt.status());
    *out = new strata_runtime{std::move(rt).value()};
    return ok();
  });
}

void strata_runtime_free(strata_runtime* runtime) {
  delete runtime;
}

void* strata_lease_data(const strata_lease* lease) {
  return lease == nullptr ? nullptr : lease->lease.data();
}

uint64_t strata_lease_numel(const strata_lease* lease) {
  return lease == nullptr ? 0 : lease->lease.numel();
}

void strata_lease_release(strata_lease* lease) {
  delete lease;
}

strata_status strata_step(strata_runtime* runtime, strata_step_stats* out, size_t out_size) {
  if (runtime == nullptr) return null_argument("runtime");
  // ABI 1's struct ended at nvme_bytes; a caller must have room for at least that much.
  constexpr size_t kAbi1Size = offsetof(strata_step_stats, nvme_bytes) + sizeof(uint64_t);
  if (out != nullptr && out_size < kAbi1Size) {
    return fail(strata::invalid_argument(
        "strata_step: out_size {} is smaller than the smallest strata_step_stats ({} bytes); pass "
        "sizeof(strata_step_stats) from strata.h",
        out_size, kAbi1Size));
  }
  return guarded([&] {
    auto st = runtime->rt->step();
    if (!st.ok()) return fail(st.status());
    if (out != nullptr) {
      const strata_step_stats full{st->step,
                                   st->applied ? 1 : 0,
                                   st->step_s,
                                   st->stall_s,
                                   st->bytes_h2d,
                                   st->bytes_d2h,
                                   st->bytes_disk_read,
                                   st->bytes_disk_write,
                                   st->gpu_high_water_bytes,
                                   st->host_high_water_bytes,
                                   st->nvme_bytes,
                                   st->prefetch_errors,
                                   st->bytes_disk_read_param_uses,
                                   st->bytes_disk_read_param_updates,
                                   st->updates_deferred};
      std::memcpy(out, &full, std::min(out_size, sizeof full));
    }
    return ok();
  });
}

uint32_t strata_abi_version(void) {
  return STRATA_ABI_VERSION;
}

// generated from api/ops.py by scripts/gen-api: do not edit (Note [Public operations])
// clang-format off
strata_status strata_register_tensor(strata_runtime* runtime, const char* name, const int64_t* shape,
                                     size_t ndim, int frozen, uint32_t* id_out) {
  if (runtime == nullptr || name == nullptr || id_out == nullptr)
    return null_argument("runtime, name and id_out");
  if (shape == nullptr && ndim > 0) return null_argument("shape");
  return guarded([&] {
    auto r = runtime->rt->register_tensor(name, std::vector<std::int64_t>(shape, shape + ndim), frozen != 0);
    if (!r.ok()) return fail(r.status());
    *id_out = *r;
    return ok();
  });
}

strata_status strata_init_tensor(strata_runtime* runtime, uint32_t tensor, const float* values,
                                 uint64_t count) {
  if (runtime == nullptr || values == nullptr) return null_argument("runtime and values");
  return guarded([&] {
    return from(runtime->rt->init_tensor(tensor, std::span<const float>(values, count)));
  });
}

strata_status strata_read_tensor(strata_runtime* runtime, uint32_t tensor, strata_state kind, float* out,
                                 uint64_t count) {
  if (runtime == nullptr || out == nullptr) return null_argument("runtime and out");
  if (kind < STRATA_PARAM || kind > STRATA_STATE1)
    return fail(strata::invalid_argument("state {} is not a strata_state", static_cast<int>(kind)));
  return guarded([&] {
    return from(runtime->rt->read_tensor(tensor, static_cast<strata::StateKind>(kind),
                                         std::span<float>(out, count)));
  });
}

strata_status strata_acquire(strata_runtime* runtime, uint32_t tensor, strata_state kind,
                             strata_access access, strata_where where, strata_lease** out) {
  if (runtime == nullptr || out == nullptr) return null_argument("runtime and out");
  if (kind < STRATA_PARAM || kind > STRATA_STATE1 || access < STRATA_READ || access > STRATA_ACCUMULATE ||
      where < STRATA_ON_DEVICE || where > STRATA_ON_HOST) {
    return fail(strata::invalid_argument("strata_acquire: state {}, access {} or where {} out of range",
                                         static_cast<int>(kind), static_cast<int>(access),
                                         static_cast<int>(where)));
  }
  return guarded([&] {
    auto r = runtime->rt->acquire(tensor, static_cast<strata::StateKind>(kind),
                                  static_cast<strata::Access>(access), static_cast<strata::Where>(where));
    if (!r.ok()) return fail(r.status());
    *out = new strata_lease{std::move(r).value()};
    return ok();
  });
}

strata_status strata_launch(strata_runtime* runtime, void (*fn)(void* user), void* user) {
  if (runtime == nullptr || fn == nullptr) return null_argument("runtime and fn");
  return guarded([&] { return from(runtime->rt->launch([fn, user] { fn(user); })); });
}

strata_status strata_abort_step(strata_runtime* runtime) {
  if (runtime == nullptr) return null_argument("runtime");
  return guarded([&] { return from(runtime->rt->abort_step()); });
}

strata_status strata_flush(strata_runtime* runtime) {
  if (runtime == nullptr) return null_argument("runtime");
  return guarded([&] { return from(runtime->rt->flush()); });
}

strata_status strata_write_chrome_trace(const strata_runtime* runtime, const char* path) {
  if (runtime == nullptr || path == nullptr) return null_argument("runtime and path");
  return guarded([&] { return from(runtime->rt->write_chrome_trace(path)); });
}

strata_status strata_lease_wait(strata_runtime* runtime, const strata_lease* lease) {
  if (runtime == nullptr || lease == nullptr) return null_argument("runtime and lease");
  return guarded([&] { return from(runtime->rt->wait(lease->lease)); });
}

strata_status strata_begin_micro_batch(strata_runtime* runtime, int last) {
  if (runtime == nullptr) return null_argument("runtime");
  return guarded([&] { return from(runtime->rt->begin_micro_batch(last != 0)); });
}

strata_status strata_no_gradient(strata_runtime* runtime, uint32_t tensor) {
  if (runtime == nullptr) return null_argument("runtime");
  return guarded([&] { return from(runtime->rt->no_gradient(tensor)); });
}

strata_status strata_set_grad_scale(strata_runtime* runtime, float scale) {
  if (runtime == nullptr) return null_argument("runtime");
  if (!std::isfinite(scale) || scale <= 0.0f)
    return fail(strata::invalid_argument("strata_set_grad_scale: scale {} must be finite and > 0", scale));
  return guarded([&] {
    runtime->rt->set_grad_scale(scale);
    return ok();
  });
}

strata_status strata_set_tensor_group(strata_runtime* runtime, uint32_t tensor, uint32_t group) {
  if (runtime == nullptr) return null_argument("runtime");
  return guarded([&] { return from(runtime->rt->set_tensor_group(tensor, group)); });
}

strata_status strata_set_group_hyper(strata_runtime* runtime, uint32_t group, float lr, float weight_decay) {
  if (runtime == nullptr) return null_argument("runtime");
  return guarded([&] { return from(runtime->rt->set_group_hyper(group, lr, weight_decay)); });
}

strata_status strata_write_tensor(strata_runtime* runtime, uint32_t tensor, strata_state kind,
                                  const float* values, uint64_t count) {
  if (runtime == nullptr || values == nullptr) return null_argument("runtime and values");
  if (kind < STRATA_PARAM || kind > STRATA_STATE1)
    return fail(strata::invalid_argument("state {} is not a strata_state", static_cast<int>(kind)));
  return guarded([&] {
    return from(runtime->rt->write_tensor(tensor, static_cast<strata::StateKind>(kind),
                                          std::span<const float>(values, count)));
  });
}

strata_status strata_tensor_steps(strata_runtime* runtime, uint32_t tensor, int64_t* out) {
  if (runtime == nullptr || out == nullptr) return null_argument("runtime and out");
  return guarded([&] {
    auto r = runtime->rt->tensor_steps(tensor);
    if (!r.ok()) return fail(r.status());
    *out = *r;
    return ok();
  });
}

strata_status strata_set_tensor_steps(strata_runtime* runtime, uint32_t tensor, int64_t steps) {
  if (runtime == nullptr) return null_argument("runtime");
  return guarded([&] { return from(runtime->rt->set_tensor_steps(tensor, steps)); });
}

strata_status strata_save_checkpoint(strata_runtime* runtime, const char* dir) {
  if (runtime == nullptr || dir == nullptr) return null_argument("runtime and dir");
  return guarded([&] { return from(runtime->rt->save_checkpoint(dir)); });
}

strata_status strata_begin_checkpoint(strata_runtime* runtime, const char* dir) {
  if (runtime == nullptr || dir == nullptr) return null_argument("runtime and dir");
  return guarded([&] { return from(runtime->rt->begin_checkpoint(dir)); });
}

strata_status strata_finish_checkpoint(strata_runtime* runtime) {
  if (runtime == nullptr) return null_argument("runtime");
  return guarded([&] { return from(runtime->rt->finish_checkpoint()); });
}

strata_status strata_checkpoint_in_flight(strata_runtime* runtime, int* in_flight) {
  if (runtime == nullptr || in_flight == nullptr) return null_argument("runtime and in_flight");
  return guarded([&] {
    auto r = runtime->rt->checkpoint_in_flight();
    if (!r.ok()) return fail(r.status());
    *in_flight = *r ? 1 : 0;
    return ok();
  });
}

strata_status strata_load_checkpoint(strata_runtime* runtime, const char* dir) {
  if (runtime == nullptr || dir == nullptr) return null_argument("runtime and dir");
  return guarded([&] { return from(runtime->rt->load_checkpoint(dir)); });
}

// Deprecated: the ABI 4 name of strata_config_from_json_text.
strata_status strata_config_from_json(const char* text, strata_config** out) {
  return strata_config_from_json_text(text, out);
}

// Deprecated: the ABI 4 name of strata_config_from_json_file.
strata_status strata_config_from_file(const char* path, strata_config** out) {
  return strata_config_from_json_file(path, out);
}

// Deprecated: the ABI 4 name of strata_write_chrome_trace.
strata_status strata_write_trace(const strata_runtime* runtime, const char* path) {
  return strata_write_chrome_trace(runtime, path);
}
// clang-format on
// end of generated

}  // extern "C"
