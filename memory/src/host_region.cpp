#include "host_region.hpp"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <utility>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/log.hpp"

namespace strata::memory {
namespace {

constexpr std::size_t kHugePageBytes = 2 * kMiB;

std::string read_first_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) return "unreadable";
  return line;
}

std::string memlock_limit_text() {
  rlimit limit{};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "unknown";
  if (limit.rlim_cur == RLIM_INFINITY) return "unlimited";
  return format_bytes(limit.rlim_cur);
}

// mlock through the system call: the ASan and TSan runtimes intercept mlock() and return
// success without locking anything, which would hide the RLIMIT_MEMLOCK fallback in
// sanitizer builds. Returns 0 or -1 with errno set, as mlock() does.
int lock_pages(void* data, std::size_t bytes) {
  return static_cast<int>(syscall(SYS_mlock, data, bytes));
}

// Maps `bytes` aligned to `alignment` by over-reserving and trimming both ends.
void* map_aligned(std::size_t bytes, std::size_t alignment, int extra_flags, void** mapping,
                  std::size_t* mapping_bytes) {
  const std::size_t reserve = bytes + (alignment > 4096 ? alignment : 0);
  void* p = mmap(nullptr, reserve, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | extra_flags, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  auto begin = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t aligned = align_up(begin, alignment);
  const std::size_t head = aligned - begin;
  const std::size_t tail = reserve - head - bytes;
  if (head > 0) munmap(p, head);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  *mapping = reinterpret_cast<void*>(aligned);
  *mapping_bytes = bytes;
  return reinterpret_cast<void*>(aligned);
}

}  // namespace

std::string_view pinning_mode_name(PinningMode mode) {
  switch (mode) {
    case PinningMode::kCudaRegistered:
      return "cudaHostRegister";
    case PinningMode::kMlocked:
      return "mlock";
    case PinningMode::kUnpinned:
      return "unpinned";
  }
  return "unknown";
}

std::string_view huge_page_mode_name(HugePageMode mode) {
  switch (mode) {
    case HugePageMode::kHugeTlb:
      return "hugetlb 2 MiB";
    case HugePageMode::kTransparent:
      return "transparent huge pages (madvise)";
    case HugePageMode::kNone:
      return "4 KiB pages";
  }
  return "unknown";
}

namespace {

//! A mapping of the region's bytes and the pages that back it.
struct Mapped {
  void* data = nullptr;
  void* mapping = nullptr;  // what munmap gets
  std::size_t mapping_bytes = 0;
  HugePageMode huge_pages = HugePageMode::kNone;
  std::string reason;
};

//! Maps `bytes`, on huge pages where the system grants them; OutOfMemory when mmap refuses.
Result<Mapped> map_pages(std::size_t bytes, std::size_t alignment_bytes, bool try_huge_pages) {
  // Note [Huge pages for the pinned region]
  // Explicit huge pages (MAP_HUGETLB) need pages reserved by the administrator
  // (vm.nr_hugepages); they are tried first for regions of whole 2 MiB pages. Otherwise
  // the region is mapped with 4 KiB pages and madvise(MADV_HUGEPAGE) asks for transparent
  // huge pages, which the kernel grants only when THP is not "never". The log says which.
  Mapped m;
  std::string hugetlb_why = "not tried (pinned.huge_pages=false)";
  if (try_huge_pages && bytes % kHugePageBytes == 0) {
    m.data = map_aligned(bytes, std::max(alignment_bytes, kHugePageBytes), MAP_HUGETLB, &m.mapping,
                         &m.mapping_bytes);
    if (m.data != nullptr) {
      m.huge_pages = HugePageMode::kHugeTlb;
      m.reason = "MAP_HUGETLB granted";
    } else {
      hugetlb_why = fmt::format("MAP_HUGETLB refused ({}; vm.nr_hugepages = {})", std::strerror(errno),
                                read_first_line("/proc/sys/vm/nr_hugepages"));
    }
  } else if (try_huge_pages) {
    hugetlb_why = "region is not a whole number of 2 MiB pages";
  }
  if (m.data != nullptr) return m;
  m.data = map_aligned(bytes, std::max(alignment_bytes, kHugePageBytes), 0, &m.mapping, &m.mapping_bytes);
  if (m.data == nullptr) {
    return out_of_memory("pinned host: mmap of {} refused: {}; lower pinned.budget", format_bytes(bytes),
                         std::strerror(errno));
  }
  const std::string thp = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
  if (try_huge_pages && thp.find("[never]") == std::string::npos &&
      madvise(m.data, bytes, MADV_HUGEPAGE) == 0) {
    m.huge_pages = HugePageMode::kTransparent;
    m.reason = fmt::format("{}; transparent huge pages requested (THP: {})", hugetlb_why, thp);
  } else {
    m.huge_pages = HugePageMode::kNone;
    m.reason =
        try_huge_pages ? fmt::format("huge pages not available: {}; THP: {}", hugetlb_why, thp) : hugetlb_why;
  }
  return m;
}

//! How the region is pinned, and why.
struct Pinned {
  PinningMode mode = PinningMode::kUnpinned;
  std::string reason;
  Device* device = nullptr;  // set when registered with the device
};

//! Pins [data, data + bytes) as well as the system lets it; never fails.
Pinned pin_pages(void* data, std::size_t bytes, bool try_pin, Device* device) {
  // Note [Pinning the host region]
  // With the cuda device the region is registered (cudaHostRegister) so copies DMA from it.
  // Otherwise mlock keeps it resident (no page-out under memory pressure, stable for
  // io_uring fixed buffers); RLIMIT_MEMLOCK bounds it for unprivileged users (8 MiB by
  // default), and when mlock is refused the region stays plain memory and the log says
  // why and how to raise the limit. Nothing fails: pinning is a speed and stability
  // property, not a correctness one.
  Pinned p;
  if (!try_pin) {
    p.reason = "pinning disabled (pinned.pin=false)";
    return p;
  }
  std::string register_why;
  if (device != nullptr) {
    Result<HostRegistration> reg = device->register_host(data, bytes);
    if (reg.ok() && *reg == HostRegistration::kRegistered) {
      p.device = device;
      p.mode = PinningMode::kCudaRegistered;
      p.reason = fmt::format("registered with {}", device->name());
      return p;
    }
    register_why = reg.ok() ? fmt::format("{} needs no registration", device_kind_name(device->kind()))
                            : fmt::format("cudaHostRegister failed: {}", reg.status().message());
  } else {
    register_why = "no device given";
  }
  if (lock_pages(data, bytes) == 0) {
    p.mode = PinningMode::kMlocked;
    p.reason = fmt::format("{}; mlock granted (RLIMIT_MEMLOCK is {})", register_why, memlock_limit_text());
  } else {
    const int err = errno;
    p.mode = PinningMode::kUnpinned;
    p.reason = fmt::format(
        "{}; mlock refused ({}): RLIMIT_MEMLOCK is {}; using unpinned memory (raise with ulimit -l or "
        "memlock in /etc/security/limits.conf)",
        register_why, std::strerror(err), memlock_limit_text());
  }
  return p;
}

}  // namespace

Result<HostRegion> HostRegion::map(std::size_t bytes, std::size_t alignment_bytes, bool try_huge_pages,
                                   bool try_pin, Device* device,
                                   const std::function<void(void*, std::size_t)>& bind) {
  STRATA_CHECK(bytes > 0);
  STRATA_CHECK(is_pow2(alignment_bytes));
  STRATA_ASSIGN_OR_RETURN(Mapped m, map_pages(bytes, alignment_bytes, try_huge_pages));
  HostRegion region;
  region.mapping_ = m.mapping;
  region.mapping_bytes_ = m.mapping_bytes;
  region.huge_pages_ = m.huge_pages;
  region.huge_pages_reason_ = std::move(m.reason);
  region.data_ = static_cast<std::byte*>(m.data);
  region.size_bytes_ = bytes;
  STRATA_LOG_INFO("pinned host: {} region, {} ({})", format_bytes(bytes),
                  huge_page_mode_name(region.huge_pages_), region.huge_pages_reason_);

  if (bind) bind(m.data, bytes);  // before mlock/registration touch the pages

  Pinned p = pin_pages(m.data, bytes, try_pin, device);
  region.device_ = p.device;
  region.pinning_ = p.mode;
  region.pinning_reason_ = std::move(p.reason);
  if (region.pinning_ == PinningMode::kUnpinned) {
    STRATA_LOG_WARN("pinned host: {} region, {}", format_bytes(bytes), region.pinning_reason_);
  } else {
    STRATA_LOG_INFO("pinned host: {} region, pinned by {} ({})", format_bytes(bytes),
                    pinning_mode_name(region.pinning_), region.pinning_reason_);
  }
  return region;
}

HostRegion::HostRegion(HostRegion&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)),
      mapping_(std::exchange(other.mapping_, nullptr)),
      mapping_bytes_(std::exchange(other.mapping_bytes_, 0)),
      device_(std::exchange(other.device_, nullptr)),
      pinning_(other.pinning_),
      pinning_reason_(std::move(other.pinning_reason_)),
      huge_pages_(other.huge_pages_),
      huge_pages_reason_(std::move(other.huge_pages_reason_)) {}

HostRegion& HostRegion::operator=(HostRegion&& other) noexcept {
  if (this != &other) {
    release();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
    mapping_ = std::exchange(other.mapping_, nullptr);
    mapping_bytes_ = std::exchange(other.mapping_bytes_, 0);
    device_ = std::exchange(other.device_, nullptr);
    pinning_ = other.pinning_;
    pinning_reason_ = std::move(other.pinning_reason_);
    huge_pages_ = other.huge_pages_;
    huge_pages_reason_ = std::move(other.huge_pages_reason_);
  }
  return *this;
}

HostRegion::~HostRegion() {
  release();
}

void HostRegion::release() {
  if (data_ == nullptr) return;
  if (device_ != nullptr) {
    Status s = device_->unregister_host(data_);
    if (!s.ok()) STRATA_LOG_WARN("pinned host: unregistering the region failed: {}", s);
  } else if (pinning_ == PinningMode::kMlocked) {
    syscall(SYS_munlock, data_, size_bytes_);
  }
  munmap(mapping_, mapping_bytes_);
  data_ = nullptr;
  device_ = nullptr;
}

}  // namespace strata::memory
