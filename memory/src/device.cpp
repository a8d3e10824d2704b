#include "strata/memory/device.hpp"

#include <utility>

#include "strata/common/assert.hpp"
#include "strata/common/bytes.hpp"

namespace strata::memory {

std::string_view device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kSim:
      return "sim";
    case DeviceKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

std::string_view copy_kind_name(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return "h2d";
    case CopyKind::kDeviceToHost:
      return "d2h";
    case CopyKind::kDeviceToDevice:
      return "d2d";
  }
  return "unknown";
}

double CopyStats::gib_per_s() const {
  if (bytes == 0 || busy_s <= 0.0) return 0.0;
  return static_cast<double>(bytes) / static_cast<double>(kGiB) / busy_s;
}

// ---- handles ---------------------------------------------------------------------------

DeviceAllocation::DeviceAllocation(DeviceAllocation&& other) noexcept
    : device_(std::exchange(other.device_, nullptr)),
      data_(std::exchange(other.data_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

DeviceAllocation& DeviceAllocation::operator=(DeviceAllocation&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

DeviceAllocation::~DeviceAllocation() {
  reset();
}

void DeviceAllocation::reset() {
  if (device_ == nullptr) return;
  device_->do_free(data_, size_bytes_);
  device_->budget_.sub(size_bytes_);
  device_->live_handles_.fetch_sub(1, std::memory_order_relaxed);
  device_ = nullptr;
  data_ = nullptr;
  size_bytes_ = 0;
}

// ---- Device ----------------------------------------------------------------------------

Device::Device(std::uint64_t budget_bytes) : budget_(budget_bytes) {
  STRATA_CHECK(budget_bytes > 0);
}

Device::~Device() = default;

void Device::release(detail::StreamTag, std::uintptr_t native) {
  do_destroy_stream(native);
  live_handles_.fetch_sub(1, std::memory_order_relaxed);
}

void Device::release(detail::EventTag, std::uintptr_t native) {
  do_destroy_event(native);
  live_handles_.fetch_sub(1, std::memory_order_relaxed);
}

void Device::check_stream(const Stream& stream) const {
  STRATA_CHECK_MSG(stream.valid(), "empty Stream handle");
  STRATA_CHECK_MSG(stream.device() == this, "Stream belongs to another Device");
}

void Device::check_event(const Event& event) const {
  STRATA_CHECK_MSG(event.valid(), "empty Event handle");
  STRATA_CHECK_MSG(event.device() == this, "Event belongs to another Device");
}

Result<DeviceAllocation> Device::allocate(std::size_t bytes) {
  if (bytes == 0)
    return invalid_argument("{}: device allocation of 0 bytes; ask for at least 1 byte", name());
  if (!budget_.try_add(bytes)) {
    return out_of_budget(
        "{}: allocating {} would exceed the device budget of {} ({} in use); raise the device "
        "budget (device.budget) or allocate less",
        name(), format_bytes(bytes), format_bytes(budget_.budget_bytes()),
        format_bytes(budget_.used_bytes()));
  }
  Result<void*> data = do_allocate(bytes);
  if (!data.ok()) {
    budget_.sub(bytes);
    return data.status();
  }
  STRATA_CHECK(reinterpret_cast<std::uintptr_t>(*data) % alignment_bytes() == 0);
  live_handles_.fetch_add(1, std::memory_order_relaxed);
  return DeviceAllocation(this, *data, bytes);
}

Result<Stream> Device::create_stream() {
  STRATA_ASSIGN_OR_RETURN(std::uintptr_t native, do_create_stream());
  live_handles_.fetch_add(1, std::memory_order_relaxed);
  return Stream(this, native);
}

Result<Event> Device::create_event() {
  STRATA_ASSIGN_OR_RETURN(std::uintptr_t native, do_create_event());
  live_handles_.fetch_add(1, std::memory_order_relaxed);
  return Event(this, native);
}

Status Device::record(const Event& event, const Stream& stream) {
  check_event(event);
  check_stream(stream);
  return do_record(event.native(), stream.native());
}

Status Device::wait(const Stream& stream, const Event& event) {
  check_stream(stream);
  check_event(event);
  return do_wait(stream.native(), event.native());
}

Status Device::record_native(const Event& event, NativeStream stream) {
  check_event(event);
  STRATA_RETURN_IF_ERROR(do_check_native(stream));
  return do_record(event.native(), stream.value);
}

Status Device::wait_native(NativeStream stream, const Event& event) {
  check_event(event);
  STRATA_RETURN_IF_ERROR(do_check_native(stream));
  return do_wait(stream.value, event.native());
}

Status Device::synchronize(const Event& event) {
  check_event(event);
  return do_synchronize_event(event.native());
}

Result<bool> Device::query(const Event& event) {
  check_event(event);
  return do_query(event.native());
}

Status Device::copy_async(const Stream& stream, void* dst, const void* src, std::size_t bytes,
                          CopyKind kind) {
  check_stream(stream);
  if (bytes == 0) return Status::Ok();
  if (dst == nullptr || src == nullptr) {
    return invalid_argument("{}: {} copy of {} with a null {} pointer", name(), copy_kind_name(kind),
                            format_bytes(bytes), dst == nullptr ? "destination" : "source");
  }
  return do_copy_async(stream.native(), dst, src, bytes, kind);
}

Status Device::launch_host(const Stream& stream, std::function<void()> fn) {
  check_stream(stream);
  STRATA_CHECK_MSG(static_cast<bool>(fn), "launch_host with an empty function");
  return do_launch_host(stream.native(), std::move(fn));
}

Status Device::synchronize(const Stream& stream) {
  check_stream(stream);
  return do_synchronize_stream(stream.native());
}

MemoryInfo Device::memory_info() const {
  MemoryInfo info;
  info.budget_bytes = budget_.budget_bytes();
  info.used_bytes = budget_.used_bytes();
  info.free_bytes = info.budget_bytes - info.used_bytes;
  info.high_water_bytes = budget_.high_water_bytes();
  return info;
}

CopyStats Device::copy_stats(CopyKind kind) const {
  const CopyCounters& c = copy_counters_[static_cast<std::size_t>(kind)];
  CopyStats stats;
  stats.bytes = c.bytes.load(std::memory_order_relaxed);
  stats.copies = c.copies.load(std::memory_order_relaxed);
  stats.busy_s = static_cast<double>(c.busy_ns.load(std::memory_order_relaxed)) * 1e-9;
  return stats;
}

void Device::count_copy(CopyKind kind, std::uint64_t bytes, double busy_s) {
  CopyCounters& c = copy_counters_[static_cast<std::size_t>(kind)];
  c.bytes.fetch_add(bytes, std::memory_order_relaxed);
  c.copies.fetch_add(1, std::memory_order_relaxed);
  c.busy_ns.fetch_add(static_cast<std::uint64_t>(busy_s * 1e9), std::memory_order_relaxed);
}

}  // namespace strata::memory
