#include "sim/sim_device.hpp"

#include <cstdlib>
#include <cstring>
#include <thread>

#include "sim/sim_stream.hpp"
#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::memory::sim {

// Note [Sim copy throttle]
// Each copy direction (h2d, d2h, d2d) is one modelled link of `bytes_per_s`, shared by
// all streams, as a PCIe direction is. A copy reserves the next window on its link:
// begin = max(ready, link free), end = begin + bytes / bytes_per_s, where `ready` is the
// later of when it was queued and when the stream's previous operation ended in the model
// (a copy's modelled end). Using modelled times, not the moment the worker thread woke
// up, keeps scheduler latency from adding up over back-to-back copies, as a DMA engine
// starts the next queued copy at once. It then does the real
// memcpy and sleeps until `end`, so a copy takes the modelled time, and two streams
// copying in the same direction share the bandwidth. The model only slows copies down:
// when memcpy itself is slower than the link (a slow host, a busy machine), the copy takes
// the memcpy time. With 64 MiB or more and a link at PCIe speeds the sleep dominates and
// the measured rate lands within a few percent of the setting (tests/memory/
// test_sim_throttle.cpp checks +-10%). busy_s counts the modelled window (end - begin),
// or the measured memcpy time when unthrottled or when memcpy overran the window (the
// first overrun per direction is logged: the setting is faster than this host can copy).

namespace {

std::string rate_text(std::uint64_t bytes_per_s) {
  if (bytes_per_s == 0) return "unthrottled";
  return fmt::format("{:.2f} GiB/s", static_cast<double>(bytes_per_s) / static_cast<double>(kGiB));
}

SimStream* as_stream(std::uintptr_t native) {
  return reinterpret_cast<SimStream*>(native);
}
SimEvent* as_event(std::uintptr_t native) {
  return reinterpret_cast<SimEvent*>(native);
}

}  // namespace

SimDevice::SimDevice(const DeviceOptions& options) : Device(options.budget_bytes), options_(options) {
  links_[static_cast<std::size_t>(CopyKind::kHostToDevice)].bytes_per_s = options.h2d_bytes_per_s;
  links_[static_cast<std::size_t>(CopyKind::kDeviceToHost)].bytes_per_s = options.d2h_bytes_per_s;
  links_[static_cast<std::size_t>(CopyKind::kDeviceToDevice)].bytes_per_s = options.d2d_bytes_per_s;
}

SimDevice::~SimDevice() {
  // Every Stream, Event and DeviceAllocation must be gone (Note [Stream and event handles]).
  STRATA_CHECK_MSG(live_handles() == 0, "a Stream, Event or DeviceAllocation outlived its sim Device");
  STRATA_CHECK(streams_.empty());
  STRATA_CHECK(allocations_.empty());
}

std::string SimDevice::name() const {
  return fmt::format("sim (budget {}, h2d {}, d2h {})", format_bytes(options_.budget_bytes),
                     rate_text(options_.h2d_bytes_per_s), rate_text(options_.d2h_bytes_per_s));
}

Result<void*> SimDevice::do_allocate(std::size_t bytes) {
  const std::size_t rounded = align_up(bytes, alignment_bytes());
  void* data = std::aligned_alloc(alignment_bytes(), rounded);
  if (data == nullptr) {
    return out_of_memory("sim device: the host refused {} for device memory; lower device.budget",
                         format_bytes(rounded));
  }
  std::lock_guard lock(allocations_mutex_);
  allocations_.emplace(reinterpret_cast<std::uintptr_t>(data), bytes);
  return data;
}

void SimDevice::do_free(void* data, std::size_t /*bytes*/) {
  {
    std::lock_guard lock(allocations_mutex_);
    std::size_t erased = allocations_.erase(reinterpret_cast<std::uintptr_t>(data));
    STRATA_CHECK(erased == 1);
  }
  std::free(data);
}

Status SimDevice::check_device_range(const void* ptr, std::size_t bytes, std::string_view role,
                                     CopyKind kind) const {
  const auto begin = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard lock(allocations_mutex_);
  auto it = allocations_.upper_bound(begin);
  if (it != allocations_.begin()) {
    --it;
    if (begin >= it->first && bytes <= it->second && begin - it->first <= it->second - bytes) {
      return Status::Ok();
    }
  }
  return invalid_argument(
      "sim device: {} copy {} {} ({}) is not inside one device allocation; pass memory from "
      "Device::allocate() or a DevicePool slot",
      copy_kind_name(kind), role, ptr, format_bytes(bytes));
}

Result<std::uintptr_t> SimDevice::do_create_stream() {
  std::lock_guard lock(streams_mutex_);
  if (streams_.size() >= options_.streams_max) {
    return out_of_budget(
        "sim device: {} streams exist, the limit device.streams_max is {}; destroy a stream "
        "or raise the limit",
        streams_.size(), options_.streams_max);
  }
  auto* stream = new SimStream(options_.stream_queue_depth);
  streams_.insert(stream);
  return reinterpret_cast<std::uintptr_t>(stream);
}

void SimDevice::do_destroy_stream(std::uintptr_t native) {
  SimStream* stream = as_stream(native);
  {
    std::lock_guard lock(streams_mutex_);
    std::size_t erased = streams_.erase(stream);
    STRATA_CHECK(erased == 1);
  }
  delete stream;  // drains and joins
}

Result<std::uintptr_t> SimDevice::do_create_event() {
  return reinterpret_cast<std::uintptr_t>(new SimEvent);
}

void SimDevice::do_destroy_event(std::uintptr_t native) {
  delete as_event(native);
}

Status SimDevice::do_record(std::uintptr_t event, std::uintptr_t stream) {
  std::shared_ptr<SimEventState> state = as_event(event)->state;
  std::uint64_t point = 0;
  {
    std::lock_guard lock(state->mutex);
    point = ++state->recorded;
  }
  as_stream(stream)->enqueue([state, point] {
    {
      std::lock_guard lock(state->mutex);
      // A later record may have completed first (another stream); keep the maximum.
      if (point > state->completed) state->completed = point;
    }
    state->done.notify_all();
  });
  return Status::Ok();
}

Status SimDevice::do_wait(std::uintptr_t stream, std::uintptr_t event) {
  std::shared_ptr<SimEventState> state = as_event(event)->state;
  std::uint64_t point = 0;
  {
    std::lock_guard lock(state->mutex);
    if (state->completed >= state->recorded) return Status::Ok();  // nothing pending to wait for
    point = state->recorded;
  }
  as_stream(stream)->enqueue([state, point] {
    std::unique_lock lock(state->mutex);
    state->done.wait(lock, [&] { return state->completed >= point; });
  });
  return Status::Ok();
}

Status SimDevice::do_synchronize_event(std::uintptr_t event) {
  SimEventState& state = *as_event(event)->state;
  std::unique_lock lock(state.mutex);
  const std::uint64_t point = state.recorded;
  state.done.wait(lock, [&] { return state.completed >= point; });
  return Status::Ok();
}

Result<bool> SimDevice::do_query(std::uintptr_t event) {
  SimEventState& state = *as_event(event)->state;
  std::lock_guard lock(state.mutex);
  return state.completed >= state.recorded;
}

Status SimDevice::do_copy_async(std::uintptr_t stream, void* dst, const void* src, std::size_t bytes,
                                CopyKind kind) {
  if (kind != CopyKind::kHostToDevice) STRATA_RETURN_IF_ERROR(check_device_range(src, bytes, "source", kind));
  if (kind != CopyKind::kDeviceToHost) {
    STRATA_RETURN_IF_ERROR(check_device_range(dst, bytes, "destination", kind));
  }
  SimStream* sim_stream = as_stream(stream);
  const Clock::time_point enqueued = Clock::now();
  sim_stream->enqueue([this, sim_stream, enqueued, dst, src, bytes, kind] {
    // Ready when queued and when the stream's previous operation ended in the model.
    const Clock::time_point ready = std::max(enqueued, sim_stream->previous_finish());
    sim_stream->set_finish(run_copy(ready, dst, src, bytes, kind));
  });
  return Status::Ok();
}

SimDevice::Clock::time_point SimDevice::run_copy(Clock::time_point ready, void* dst, const void* src,
                                                 std::size_t bytes, CopyKind kind) {
  Link& link = links_[static_cast<std::size_t>(kind)];
  if (link.bytes_per_s == 0) {
    const Clock::time_point start = Clock::now();
    std::memmove(dst, src, bytes);
    const Clock::time_point end = Clock::now();
    count_copy(kind, bytes, std::chrono::duration<double>(end - start).count());
    return end;
  }
  const auto window = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) / static_cast<double>(link.bytes_per_s)));
  Clock::time_point begin;
  Clock::time_point end;
  {
    std::lock_guard lock(link.mutex);
    begin = std::max(ready, link.free_at);
    end = begin + window;
    link.free_at = end;
  }
  std::memmove(dst, src, bytes);
  const Clock::time_point copied = Clock::now();
  if (copied > end) {
    // The host could not keep up with the modelled link: the copy took the memcpy time.
    count_copy(kind, bytes, std::chrono::duration<double>(copied - begin).count());
    if (!link.overrun_logged.exchange(true)) {
      STRATA_LOG_WARN(
          "sim device: a {} copy of {} took {:.1f} ms, longer than the {:.1f} ms the {} link models; this "
          "host's memcpy is slower than device.{}_bandwidth, so such copies run at memcpy speed (logged "
          "once)",
          copy_kind_name(kind), format_bytes(bytes),
          std::chrono::duration<double, std::milli>(copied - begin).count(),
          std::chrono::duration<double, std::milli>(window).count(), rate_text(link.bytes_per_s),
          copy_kind_name(kind));
    }
    return copied;
  }
  std::this_thread::sleep_until(end);
  count_copy(kind, bytes, std::chrono::duration<double>(end - begin).count());
  return end;
}

Status SimDevice::do_launch_host(std::uintptr_t stream, std::function<void()> fn) {
  as_stream(stream)->enqueue(std::move(fn));
  return Status::Ok();
}

Status SimDevice::do_check_native(NativeStream stream) {
  std::lock_guard lock(streams_mutex_);
  if (streams_.contains(reinterpret_cast<SimStream*>(stream.value))) return Status::Ok();
  return invalid_argument(
      "sim device: native stream {:#x} is not a live stream of this device; on the sim device a native "
      "stream must be the native() of a stream it made (Note [Native streams] in strata/memory/device.hpp)",
      stream.value);
}

Status SimDevice::do_synchronize_stream(std::uintptr_t stream) {
  as_stream(stream)->synchronize();
  return Status::Ok();
}

Status SimDevice::synchronize() {
  // Holding the registry lock keeps every stream alive while we wait on it; host
  // functions must not create or destroy streams (they must not call the Device).
  std::lock_guard lock(streams_mutex_);
  for (SimStream* stream : streams_) stream->synchronize();
  return Status::Ok();
}

Result<HostRegistration> SimDevice::register_host(void* /*ptr*/, std::size_t /*bytes*/) {
  return HostRegistration::kNotNeeded;
}

Status SimDevice::unregister_host(void* /*ptr*/) {
  return Status::Ok();
}

}  // namespace strata::memory::sim
