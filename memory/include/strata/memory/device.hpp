#pragma once
// Device: the one interface strata uses to talk to an accelerator (ggml-backend style).
//
// Two backends implement it, one folder each: `sim` (memory/src/sim/: host memory under a
// budget, one worker thread per stream, optional PCIe-like copy throttle) and `cuda`
// (memory/src/cuda/: the CUDA runtime). make_device() in device_factory.hpp picks one.
//
// Note [Stream and event handles]
// Streams, events and device allocations are move-only RAII handles that hold the Device
// that made them and an opaque backend value (a SimStream*, a cudaStream_t, ...).
// Destroying a handle releases the object on its device: a stream first drains its queued
// work; an event may be destroyed while work that records or waits on it is still queued
// (that work keeps the event alive). Handles must not outlive their Device (checked,
// always, by the live-handle count when the Device is destroyed). A default-constructed handle is
// empty; passing an empty handle, or one made by another Device, to a Device call is a
// programmer error (STRATA_CHECK).
//
// Note [Event semantics]
// As in CUDA: record(event, stream) captures the work queued on `stream` so far; the event
// completes when that work is done. Recording again replaces the captured point.
// wait(stream, event) makes work queued on `stream` after the call wait for the point the
// event captured at the time of the call. An event never recorded counts as complete.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>

#include "strata/common/status.hpp"
#include "strata/memory/budget_counter.hpp"

namespace strata::memory {

class Device;

//! Which backend a Device is.
enum class DeviceKind : std::uint8_t { kSim, kCuda };

//! "sim" or "cuda".
std::string_view device_kind_name(DeviceKind kind);

//! Direction of a copy. Each direction is one modelled link with its own counters.
enum class CopyKind : std::uint8_t { kHostToDevice = 0, kDeviceToHost = 1, kDeviceToDevice = 2 };
inline constexpr std::size_t kCopyKindCount = 3;

//! "h2d", "d2h" or "d2d".
std::string_view copy_kind_name(CopyKind kind);

//! Throughput counters of one copy direction since the device was created.
struct CopyStats {
  std::uint64_t bytes = 0;   //!< bytes copied (completed copies)
  std::uint64_t copies = 0;  //!< number of completed copies
  double busy_s = 0.0;       //!< seconds the link was busy (modelled time when throttled)
  //! bytes / busy_s in GiB/s, 0 when nothing was copied.
  double gib_per_s() const;
};

//! Device memory budget and use, in bytes.
struct MemoryInfo {
  std::uint64_t budget_bytes = 0;      //!< hard limit for allocate()
  std::uint64_t used_bytes = 0;        //!< bytes currently allocated through allocate()
  std::uint64_t free_bytes = 0;        //!< budget_bytes - used_bytes
  std::uint64_t high_water_bytes = 0;  //!< most bytes ever allocated at once
};

//! What register_host() did.
enum class HostRegistration : std::uint8_t {
  kRegistered,  //!< the range is now page-locked for fast DMA (cudaHostRegister)
  kNotNeeded,   //!< this backend copies from any host memory at full speed (sim)
};

namespace detail {
struct StreamTag {};
struct EventTag {};
}  // namespace detail

//! A move-only handle to a stream or an event of a Device; see Note [Stream and event
//! handles]. Destroying a stream handle drains the stream's queued work (blocks).
template <typename Tag>
class DeviceHandle {
 public:
  DeviceHandle() = default;
  DeviceHandle(DeviceHandle&& other) noexcept
      : device_(std::exchange(other.device_, nullptr)), native_(std::exchange(other.native_, 0)) {}
  DeviceHandle& operator=(DeviceHandle&& other) noexcept {
    if (this != &other) {
      reset();
      device_ = std::exchange(other.device_, nullptr);
      native_ = std::exchange(other.native_, 0);
    }
    return *this;
  }
  DeviceHandle(const DeviceHandle&) = delete;
  DeviceHandle& operator=(const DeviceHandle&) = delete;
  ~DeviceHandle() { reset(); }

  bool valid() const { return device_ != nullptr; }
  Device* device() const { return device_; }
  //! The backend's value (SimStream*, cudaStream_t, ...). For backends only.
  std::uintptr_t native() const { return native_; }

 private:
  friend class Device;
  DeviceHandle(Device* device, std::uintptr_t native) : device_(device), native_(native) {}
  void reset();  // defined below Device
  Device* device_ = nullptr;
  std::uintptr_t native_ = 0;
};

//! A queue of device work, executed in order.
using Stream = DeviceHandle<detail::StreamTag>;
//! A point in a stream's work, for ordering streams and the host (Note [Event semantics]).
using Event = DeviceHandle<detail::EventTag>;

// Note [Native streams]
// Another library that computes on the same accelerator (torch) queues its work on streams
// of its own. Its work and strata's are ordered with strata's events: record_native and
// wait_native take such a stream by its backend value, without owning it. On cuda the value
// is a cudaStream_t (torch.cuda.current_stream().cuda_stream; 0 is the legacy default
// stream); the caller keeps it alive for the call, and CUDA's own error is returned for a
// bad one. On sim it must be the native() of a live stream this device made (other values
// are refused: InvalidArgument), so tests can play the other library on a stream of their own.

//! A stream another library owns, by its backend value (Note [Native streams]).
struct NativeStream {
  std::uintptr_t value = 0;
};

//! A block of device memory from Device::allocate(). Move-only; frees on destruction.
//! The hot path does not allocate: DevicePool takes one large block and carves it.
class DeviceAllocation {
 public:
  DeviceAllocation() = default;
  DeviceAllocation(DeviceAllocation&& other) noexcept;
  DeviceAllocation& operator=(DeviceAllocation&& other) noexcept;
  DeviceAllocation(const DeviceAllocation&) = delete;
  DeviceAllocation& operator=(const DeviceAllocation&) = delete;
  ~DeviceAllocation();

  bool valid() const { return device_ != nullptr; }
  //! Device address (dereferenceable on the host only for the sim backend).
  void* data() const { return data_; }
  std::size_t size_bytes() const { return size_bytes_; }
  Device* device() const { return device_; }

 private:
  friend class Device;
  DeviceAllocation(Device* device, void* data, std::size_t size_bytes)
      : device_(device), data_(data), size_bytes_(size_bytes) {}
  void reset();
  Device* device_ = nullptr;
  void* data_ = nullptr;
  std::size_t size_bytes_ = 0;
};

//! An accelerator. The public calls validate their arguments, then call the backend.
//! Thread-safety: every call may be made from any thread concurrently, except that a
//! handle must not be destroyed while another thread uses it. Calls that enqueue work
//! (copy_async, launch_host, record, wait) do not wait for the work, but block while the
//! stream's bounded queue is full (the sim backend's `stream_queue_depth`).
//! Failures are Status values (Note [Errors in three kinds]); misuse of handles is checked.
class Device {
 public:
  virtual ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  //! E.g. "sim (budget 4.00 GiB, h2d 16.00 GiB/s, d2h 16.00 GiB/s)" or "cuda:0 NVIDIA H200".
  virtual std::string name() const = 0;
  virtual DeviceKind kind() const = 0;
  //! PCI bus id of the accelerator ("0000:3b:00.0") for Topology; empty for sim.
  virtual std::string pci_bus_id() const { return {}; }

  //! Device memory of `bytes` (> 0), aligned to at least alignment_bytes(). Fails with
  //! OutOfBudget naming the budget and the request when it would exceed the budget,
  //! OutOfMemory when the system refuses.
  Result<DeviceAllocation> allocate(std::size_t bytes);
  //! The alignment allocate() guarantees (a power of two).
  virtual std::size_t alignment_bytes() const = 0;

  //! A new stream. Fails (OutOfBudget) past the backend's stream limit.
  Result<Stream> create_stream();
  //! A new event (never recorded: complete).
  Result<Event> create_event();

  //! Captures the work queued on `stream` so far in `event` (Note [Event semantics]).
  Status record(const Event& event, const Stream& stream);
  //! Work queued on `stream` after this call waits for `event`'s captured point.
  Status wait(const Stream& stream, const Event& event);
  //! Captures the work queued so far on `stream`, a stream this Device does not own
  //! (Note [Native streams]), in `event`.
  Status record_native(const Event& event, NativeStream stream);
  //! Work queued on the native `stream` after this call waits for `event`'s captured point.
  Status wait_native(NativeStream stream, const Event& event);
  //! Blocks the host until `event`'s captured point is done.
  Status synchronize(const Event& event);
  //! Whether `event`'s captured point is done; never blocks.
  Result<bool> query(const Event& event);

  //! Enqueues a copy of `bytes` from `src` to `dst` on `stream`. Device pointers must lie
  //! inside this device's allocations (the sim backend checks: InvalidArgument); host
  //! pointers must stay valid until the copy is done (synchronize or an event).
  //! bytes == 0 is a no-op.
  Status copy_async(const Stream& stream, void* dst, const void* src, std::size_t bytes, CopyKind kind);

  //! Enqueues `fn` to run on the host in stream order: it starts after the work queued
  //! before it and the work queued after it starts when it returns. The sim backend's
  //! "kernels" are such functions. fn must not call this Device (on sim it runs on the
  //! stream's worker, which a full queue or a synchronize would deadlock); on cuda it runs
  //! via cudaLaunchHostFunc and must not call CUDA at all. fn must not throw.
  Status launch_host(const Stream& stream, std::function<void()> fn);
  //! Records launch_host has created to carry functions in flight (the cuda backend's
  //! pool; Note [Completion records] in strata/common/record_pool.hpp): at most the
  //! most host functions in flight at once, so a launch whose `fn` std::function keeps
  //! in place allocates nothing past that. 0 where none are kept (sim stores each
  //! queued operation in place). Thread-safe.
  virtual std::uint64_t host_function_records() const { return 0; }

  //! Blocks until all work queued on `stream` is done.
  Status synchronize(const Stream& stream);
  //! Blocks until all work on all streams of this device is done.
  virtual Status synchronize() = 0;

  //! Budget, use and high-water of allocate(). Thread-safe, never blocks.
  MemoryInfo memory_info() const;
  //! Counters of one copy direction (completed copies). Thread-safe, never blocks. The
  //! sim backend counts a copy when it ends; cuda counts it once a synchronize() or a later
  //! copy_async() finds its timing events complete (Note [Copy timing on cuda]).
  CopyStats copy_stats(CopyKind kind) const;

  //! Page-locks host memory [ptr, ptr+bytes) for fast copies when the backend needs it
  //! (cuda: cudaHostRegister); sim returns kNotNeeded. Undo with unregister_host(ptr).
  virtual Result<HostRegistration> register_host(void* ptr, std::size_t bytes) = 0;
  //! Undoes a kRegistered register_host(ptr, ...). No-op for kNotNeeded.
  virtual Status unregister_host(void* ptr) = 0;

 protected:
  //! `budget_bytes` (> 0) is the hard limit of allocate().
  explicit Device(std::uint64_t budget_bytes);

  //! Backends call this when a copy completes; busy_s is the time the link was busy.
  void count_copy(CopyKind kind, std::uint64_t bytes, double busy_s);

  // Backend hooks; arguments are validated by the public calls above.
  virtual Result<void*> do_allocate(std::size_t bytes) = 0;
  virtual void do_free(void* data, std::size_t bytes) = 0;
  virtual Result<std::uintptr_t> do_create_stream() = 0;
  virtual void do_destroy_stream(std::uintptr_t stream) = 0;
  virtual Result<std::uintptr_t> do_create_event() = 0;
  virtual void do_destroy_event(std::uintptr_t event) = 0;
  virtual Status do_record(std::uintptr_t event, std::uintptr_t stream) = 0;
  virtual Status do_wait(std::uintptr_t stream, std::uintptr_t event) = 0;
  virtual Status do_synchronize_event(std::uintptr_t event) = 0;
  virtual Result<bool> do_query(std::uintptr_t event) = 0;
  virtual Status do_copy_async(std::uintptr_t stream, void* dst, const void* src, std::size_t bytes,
                               CopyKind kind) = 0;
  virtual Status do_launch_host(std::uintptr_t stream, std::function<void()> fn) = 0;
  virtual Status do_synchronize_stream(std::uintptr_t stream) = 0;
  //! Whether `stream` may be passed to do_record/do_wait (Note [Native streams]).
  virtual Status do_check_native(NativeStream stream) = 0;

  //! Live handles made by this device; a backend's destructor asserts it is zero.
  std::int64_t live_handles() const { return live_handles_.load(std::memory_order_relaxed); }

 private:
  friend class DeviceHandle<detail::StreamTag>;
  friend class DeviceHandle<detail::EventTag>;
  //! Destroys a handle's backend object (stream or event) and drops the live count.
  void release(detail::StreamTag, std::uintptr_t native);
  void release(detail::EventTag, std::uintptr_t native);
  friend class DeviceAllocation;
  void check_stream(const Stream& stream) const;
  void check_event(const Event& event) const;
  std::atomic<std::int64_t> live_handles_{0};
  BudgetCounter budget_;
  struct CopyCounters {
    std::atomic<std::uint64_t> bytes{0};
    std::atomic<std::uint64_t> copies{0};
    std::atomic<std::uint64_t> busy_ns{0};
  };
  CopyCounters copy_counters_[kCopyKindCount];
};

template <typename Tag>
void DeviceHandle<Tag>::reset() {
  if (device_ == nullptr) return;
  device_->release(Tag{}, native_);
  device_ = nullptr;
  native_ = 0;
}

}  // namespace strata::memory
