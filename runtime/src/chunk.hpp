#pragma once
// The runtime's bookkeeping records: a chunk (one state kind of one family) with
// its copies on the tiers, a device slot, a registered tensor. Plain data; the
// parts that change them are named on each field. Not a public header.
//
// Note [Chunk state machine]
// A chunk is one state kind of one family. It may have a host copy, a device
// copy (in a device slot) and an NVMe copy; `absent` means no tier holds a value
// yet (optimizer states start as zeros, a gradient as undefined). Exactly one copy
// is authoritative: the device copy when `dev_dirty`, else the host copy when
// `host_valid`, else the NVMe copy. A device copy is never dropped while a lease
// holds it (readers/writers); a dirty one is written back to host before its
// device slot is reused. Device slots carry two events: `fence` (everything that
// used the slot's previous content is done: compute releases and d2h write-backs
// record it) and `ready` (the content is loaded). Every writer of a slot waits on
// `fence` first, then records it, so `fence` always covers all earlier users.

#include <cstdint>
#include <vector>

#include "strata/runtime/runtime.hpp"

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

//! One chunk; see Note [Chunk state machine].
struct Chunk {
  FamilyId family = 0;
  StateKind kind = StateKind::kParam;
  std::uint64_t bytes = 0;  //!< 0: this family has no such kind
  std::byte* host = nullptr;
  bool host_valid = false;
  bool absent = true;
  std::int32_t device_slot = -1;  //!< index into Residency's device slots, -1 when none
  bool dev_valid = false;
  bool dev_dirty = false;
  std::vector<std::uint32_t> nvme_slots;  //!< NvmeStore slots holding the NVMe copy, in order
  bool nvme_valid = false;
  int readers = 0;
  int writers = 0;
  std::uint64_t tick = 0;  //!< last use, for LRU
  //! The last copy that reads the host copy (a load); the host copy is not
  //! written or freed before it completes (Residency::wait_host_reads).
  memory::Event host_read;
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

//! The kinds the optimizer owns (they live where the family's optimizer states live).
inline bool is_optim_kind(StateKind k) {
  return k == StateKind::kMaster || k == StateKind::kState0 || k == StateKind::kState1;
}

//! Base pointers of one family's chunks, per StateKind, on one tier.
struct FamilyPtrs {
  std::byte* at[kStateKindCount] = {};
};

}  // namespace strata::runtime
