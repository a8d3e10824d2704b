#pragma once
// CudaDevice: the Device backend over the CUDA runtime (streams, events, cudaMemcpyAsync,
// cudaLaunchHostFunc). Internal; built only when STRATA_HAVE_CUDA, created through
// make_device() (Note [Backend registry]). Every CUDA call goes through STRATA_CUDA_TRY
// (or STRATA_CUDA_CHECK where failure means a strata bug, e.g. in destructors).

#include <cuda_runtime_api.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "strata/common/record_pool.hpp"
#include "strata/memory/device.hpp"
#include "strata/memory/device_factory.hpp"

namespace strata::memory::cuda {

//! Thread-safe: each call first makes the device current on the calling thread.
class CudaDevice final : public Device {
 public:
  //! Opens GPU `options.cuda_ordinal`: Unavailable when there is no driver or no such
  //! device (the message says which), InvalidArgument when device.budget exceeds the
  //! GPU's memory.
  static Result<std::unique_ptr<Device>> open(const DeviceOptions& options);
  ~CudaDevice() override;

  std::string name() const override { return name_; }
  DeviceKind kind() const override { return DeviceKind::kCuda; }
  std::string pci_bus_id() const override { return pci_bus_id_; }
  //! cudaMalloc returns 256-byte aligned memory.
  std::size_t alignment_bytes() const override { return 256; }
  Status synchronize() override;
  Result<HostRegistration> register_host(void* ptr, std::size_t bytes) override;
  Status unregister_host(void* ptr) override;
  std::uint64_t host_function_records() const override;

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
  Status do_check_native(NativeStream /*stream*/) override { return Status::Ok(); }

 private:
  // Note [Copy timing on cuda]: each copy is bracketed by two timing events; completed
  // pairs are harvested (cudaEventElapsedTime) into the copy counters on later calls.
  // At most kTimedCopiesMax pairs are pending; a copy that finds them all pending waits
  // for the oldest (a bounded queue, like the sim's).
  struct TimedCopy {
    cudaEvent_t start = nullptr;
    cudaEvent_t end = nullptr;
    CopyKind kind = CopyKind::kHostToDevice;
    std::size_t bytes = 0;
  };
  static constexpr std::size_t kTimedCopiesMax = 1024;

  //! One launch_host function in flight (Note [Completion records]).
  struct HostFunctionRecord {
    CudaDevice* device = nullptr;
    std::function<void()> fn;
  };
  static void CUDART_CB run_host_function(void* user_data);

  CudaDevice(const DeviceOptions& options, std::string name, std::string pci_bus_id);
  Status make_current() const;
  //! Moves completed timed copies into the counters; with `wait_oldest`, first waits for
  //! the oldest. Caller holds timing_mutex_.
  Status harvest_locked(bool wait_oldest);
  Result<TimedCopy> take_pair_locked();

  const DeviceOptions options_;
  const std::string name_;
  const std::string pci_bus_id_;
  std::atomic<std::size_t> streams_{0};
  std::mutex timing_mutex_;
  std::deque<TimedCopy> pending_;                         // in issue order; <= kTimedCopiesMax
  std::vector<TimedCopy> spare_pairs_;                    // recycled timing events
  RecordPool<HostFunctionRecord> host_function_records_;  // launch_host's (own lock)
};

}  // namespace strata::memory::cuda
