// Runtime::Impl: host access to any chunk between steps, wherever it lives
// (read_tensor, write_tensor, init_tensor; tensor_state.cpp).
#include <cstring>

#include "runtime_impl.hpp"
#include "strata/common/assert.hpp"

namespace strata::runtime {

Status Runtime::Impl::with_host_copy(std::unique_lock<std::mutex>& lock, FamilyId f, StateKind k, bool write,
                                     const std::function<void(std::byte*)>& fn, bool whole) {
  Chunk& c = core().chunk_mut(f, k);
  const bool param = c.kind == StateKind::kParam;
  // Rank 0's initial params first, another rank's update still arriving (Note [Chunk events]).
  if (events() != nullptr) STRATA_RETURN_IF_ERROR(events()->on_host_access(lock, c, write));
  const bool on_nvme =
      (is_optim_kind(c.kind) && core().on_nvme(c.family)) || (param && core().param_on_nvme(c.family));
  if (on_nvme && param && write) {
    // The param changes: its staging copy and device copy go stale (Note [NVMe-homed params]).
    if (c.readers > 0) {
      return failed_precondition("family {} param: written on host while leased on the device", c.family);
    }
    STRATA_RETURN_IF_ERROR(residency().drop_staging(lock, c));
    STRATA_RETURN_IF_ERROR(residency().wait_host_reads(c));
    residency().drop_device_copy(c);
  }
  if (!on_nvme) {
    STRATA_RETURN_IF_ERROR(residency().ensure_on_host(c));
    // A load or prefetch may still be copying from the host copy.
    if (write) STRATA_RETURN_IF_ERROR(core().device.synchronize(core().h2d));
    fn(c.host);
    if (write && c.device_copy) {
      STRATA_CHECK(c.readers == 0);
      residency().drop_device_copy(c);
    }
    return Status::Ok();
  }
  if (c.value == ChunkValue::kHost) {
    // An NVMe write-back failed and left the states in host memory (Note [Write-back after step]).
    fn(c.host);
    return Status::Ok();
  }
  if (write) pipeline().drop_read_ahead(c.family);
  STRATA_ASSIGN_OR_RETURN(std::byte * tmp, core().host->allocate(c.bytes));
  std::span<std::byte> data(tmp, c.bytes);
  Status st = Status::Ok();
  if (c.value == ChunkValue::kNvme && !(write && whole)) {
    st = core().nvme_transfer(lock, false, data, c.nvme_slots);
  } else {
    std::memset(tmp, 0, c.bytes);
  }
  if (st.ok()) {
    fn(tmp);
    if (write) {
      st = core().nvme_transfer(lock, true, data, c.nvme_slots);
      if (st.ok()) {
        c.move_value(ChunkValue::kNvme);
      }
    }
  }
  core().host->free(tmp, c.bytes);
  return st;
}

}  // namespace strata::runtime
