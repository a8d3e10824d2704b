#pragma once
// The runtime's bookkeeping records: a chunk (one state kind of one family) with
// its copies on the tiers, a device slot, a registered tensor. Plain data; the
// parts that change them are named on each field. Not a public header.
//
// Note [Chunk state machine]
// A chunk is one state kind of one family. Its value lives in exactly one place,
// `Chunk::value` (ChunkValue): nowhere yet (kAbsent: optimizer states start as
// zeros, a gradient as undefined), the host copy, the device copy (dirty: a host
// buffer, if any, is stale), the NVMe copy, or the optimizer pipeline's grad
// staging buffer (a gradient on its way to the kernel). Besides, a device slot
// may hold a clean copy (`device_copy`). Every change of `value` goes through
// Chunk::move_value, which checks it against the allowed transitions:
//
//   absent  -> host (zeros, init, written on host) | device (written on device,
//              device optimizer) | nvme (written through staging)
//   host    -> device (written on device) | nvme (home moved, write-back) | absent
//              (consumed, skipped step)
//   device  -> host (written back) | staged (gradient landed) | absent (consumed)
//   nvme    -> host (home moved, failed write-back, an NVMe-homed param updated
//              and not yet written) | nvme (write-back)
//   staged  -> absent (consumed)
//
// A device copy is never dropped while a lease holds it (readers/writers); a
// dirty one is written back to host before its device slot is reused
// (Residency::drop_device_copy refuses to drop the only copy). Device slots
// carry two events: `fence` (everything that used the slot's previous content
// is done: compute releases and d2h write-backs record it) and `ready` (the
// content is loaded). Every writer of a slot waits on `fence` first, then
// records it, so `fence` always covers all earlier users.

#include <cstdint>
#include <vector>

#include "strata/common/assert.hpp"
#include "strata/memory/device.hpp"
#include "strata/runtime/state_kind.hpp"
#include "strata/runtime/tensor.hpp"

namespace strata::runtime {

//! One device slot: a piece of device memory that holds one chunk at a time
//! (Residency owns them).
struct DeviceSlot {
  std::byte* ptr = nullptr;
  std::uint64_t bytes = 0;
  std::int32_t chunk = -1;  //!< occupant chunk index, -1 when free
  bool dedicated = false;   //!< belongs to one chunk for good (everything-on-GPU plans)
  memory::Event fence;      //!< Note [Chunk state machine]
  memory::Event ready;
};

//! Where a chunk's value is (Note [Chunk state machine]).
enum class ChunkValue : std::uint8_t { kAbsent, kHost, kDevice, kNvme, kStaged };

//! The transitions Note [Chunk state machine] allows.
constexpr bool value_move_allowed(ChunkValue from, ChunkValue to) {
  using V = ChunkValue;
  switch (from) {
    case V::kAbsent:
      return to == V::kAbsent || to == V::kHost || to == V::kDevice || to == V::kNvme;
    case V::kHost:
      return to != V::kStaged;
    case V::kDevice:
      return to == V::kDevice || to == V::kHost || to == V::kStaged || to == V::kAbsent;
    case V::kNvme:
      return to == V::kHost || to == V::kNvme;
    case V::kStaged:
      return to == V::kAbsent;
  }
  return false;
}

//! One chunk; see Note [Chunk state machine].
struct Chunk {
  FamilyId family = 0;
  StateKind kind = StateKind::kParam;
  std::uint64_t bytes = 0;  //!< 0: this family has no such kind
  ChunkValue value = ChunkValue::kAbsent;
  bool device_copy = false;       //!< the device slot holds the value or a clean copy of it
  std::int32_t device_slot = -1;  //!< index into Residency's device slots, -1 when none
  //! Host buffer: the value when kHost; for an NVMe-homed param whose value is
  //! kNvme or kAbsent, its staging copy (Note [NVMe-homed params] in residency.hpp).
  std::byte* host = nullptr;
  std::vector<std::uint32_t> nvme_slots;  //!< NvmeStore slots holding the NVMe copy, in order
  int readers = 0;
  int writers = 0;
  std::uint64_t tick = 0;  //!< last use, for LRU
  //! The last copy that reads the host copy (a load); the host copy is not
  //! written or freed before it completes (Residency::wait_host_reads).
  memory::Event host_read;

  //! The one place `value` changes (Note [Chunk state machine]).
  void move_value(ChunkValue to) {
    STRATA_CHECK(value_move_allowed(value, to));
    value = to;
  }
  bool absent() const { return value == ChunkValue::kAbsent; }
  //! The device copy is the only one (a write-back must precede dropping it).
  bool dirty() const { return value == ChunkValue::kDevice; }
};

//! A registered tensor and its per-step flags.
struct TensorInfo {
  TensorSpec spec;
  std::uint64_t numel = 0;
  bool grad_written = false;            //!< a gradient was written since the last optimizer step
  bool written_in_micro_batch = false;  //!< Note [Gradient completion]
  int write_leases = 0;
  std::int64_t updates = 0;  //!< optimizer steps applied to this tensor (its bias-correction step)
  std::uint32_t group = 0;   //!< Note [Parameter groups]
};

//! A parameter group's overrides of the optimizer's lr and weight decay (Note [Parameter groups]).
struct GroupHyper {
  bool set = false;
  float lr = 0.0f;
  float weight_decay = 0.0f;
};

//! Base pointers of one family's chunks, per StateKind, on one tier.
struct FamilyPtrs {
  std::byte* at[kStateKindCount] = {};
};

}  // namespace strata::runtime
