#pragma once
// SimDevice: a Device whose memory is aligned host memory under a hard budget, whose
// streams are worker threads, and whose copies may be throttled to a modelled link.
// Internal; created through make_device() (device_factory.hpp).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "strata/memory/device.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::memory::sim {

class SimStream;

//! See Note [Sim copy throttle] in sim_device.cpp. Thread-safe.
class SimDevice final : public Device {
 public:
  //! `options` must have passed DeviceOptions::validate().
  explicit SimDevice(const DeviceOptions& options);
  ~SimDevice() override;

  std::string name() const override;
  DeviceKind kind() const override { return DeviceKind::kSim; }
  //! Page alignment: enough for O_DIRECT and for any vector width.
  std::size_t alignment_bytes() const override { return 4096; }
  Status synchronize() override;
  Result<HostRegistration> register_host(void* ptr, std::size_t bytes) override;
  Status unregister_host(void* ptr) override;

 protected:
  Result<void*> do_allocate(std::size_t bytes) override;
  void do_free(void* data, std::size_t bytes) override;
  Result<std::uintptr_t> do_create_stream() override;
  void do_destroy_stream(std::uintptr_t stream) override;
  Result<std::uintptr_t> do_create_event() override;
  void do_destroy_event(std::uintptr_t event) override;
  Status do_record(std::uintptr_t event, std::uintptr_t stream) override;
  Status do_wait(std::uintptr_t stream, std::uintptr_t event) override;
  Status do_synchronize_event(std::uintptr_t event) override;
  Result<bool> do_query(std::uintptr_t event) override;
  Status do_copy_async(std::uintptr_t stream, void* dst, const void* src, std::size_t bytes,
                       CopyKind kind) override;
  Status do_launch_host(std::uintptr_t stream, std::function<void()> fn) override;
  Status do_synchronize_stream(std::uintptr_t stream) override;
  Status do_check_native(NativeStream stream) override;

 private:
  using Clock = std::chrono::steady_clock;

  //! One direction's modelled link: copies reserve consecutive time windows on it.
  struct Link {
    std::mutex mutex;
    Clock::time_point free_at{};
    std::uint64_t bytes_per_s = 0;  // 0 = unthrottled
    std::atomic<bool> overrun_logged{false};
  };

  //! InvalidArgument unless [ptr, ptr+bytes) lies inside one live allocation.
  Status check_device_range(const void* ptr, std::size_t bytes, std::string_view role, CopyKind kind) const;
  //! Runs on the stream worker: copies, then sleeps until the link's modelled end, which
  //! it returns (or the real end when memcpy overran it). See Note [Sim copy throttle].
  Clock::time_point run_copy(Clock::time_point ready, void* dst, const void* src, std::size_t bytes,
                             CopyKind kind);

  const DeviceOptions options_;
  mutable std::mutex allocations_mutex_;
  std::map<std::uintptr_t, std::size_t> allocations_;  // begin -> bytes
  std::mutex streams_mutex_;
  std::set<SimStream*> streams_;
  Link links_[kCopyKindCount];
};

}  // namespace strata::memory::sim
