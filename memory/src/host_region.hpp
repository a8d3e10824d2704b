#pragma once
// HostRegion: one anonymous mapping reserved at start (huge pages when available),
// then pinned: cudaHostRegister through the Device, else mlock, else left unpinned.
// Internal to memory/; PinnedHostPool owns one.

#include <cstddef>
#include <functional>
#include <string>

#include "strata/common/status.hpp"
#include "strata/memory/device.hpp"
#include "strata/memory/pinned_host_pool.hpp"

namespace strata::memory {

//! Owns [data, data + size_bytes). Move-only; unpins and unmaps on destruction.
class HostRegion {
 public:
  //! Maps `bytes` (a multiple of 4096) aligned to `alignment_bytes` (a power of two >=
  //! 4096), runs `bind` on it before any page is touched (may be empty), then pins it.
  //! Logs the page kind and the pinning mode with their reasons. Fails (OutOfMemory)
  //! only when the mapping itself is refused; pinning failures fall back (logged).
  static Result<HostRegion> map(std::size_t bytes, std::size_t alignment_bytes, bool try_huge_pages,
                                bool try_pin, Device* device,
                                const std::function<void(void*, std::size_t)>& bind);

  HostRegion() = default;
  HostRegion(HostRegion&& other) noexcept;
  HostRegion& operator=(HostRegion&& other) noexcept;
  HostRegion(const HostRegion&) = delete;
  HostRegion& operator=(const HostRegion&) = delete;
  ~HostRegion();

  std::byte* data() const { return data_; }
  std::size_t size_bytes() const { return size_bytes_; }
  PinningMode pinning() const { return pinning_; }
  const std::string& pinning_reason() const { return pinning_reason_; }
  HugePageMode huge_pages() const { return huge_pages_; }
  const std::string& huge_pages_reason() const { return huge_pages_reason_; }

 private:
  void release();
  std::byte* data_ = nullptr;
  std::size_t size_bytes_ = 0;
  void* mapping_ = nullptr;  // what munmap gets (may start before data_ for alignment)
  std::size_t mapping_bytes_ = 0;
  Device* device_ = nullptr;  // set when registered with the device
  PinningMode pinning_ = PinningMode::kUnpinned;
  std::string pinning_reason_;
  HugePageMode huge_pages_ = HugePageMode::kNone;
  std::string huge_pages_reason_;
};

}  // namespace strata::memory
