#pragma once
// Poison regions: what a parameter's storage points at while it is not bound to
// its chunk (Note [Poisoned parameters]).
//
// Note [Poisoned parameters]
// Between its module's hooks a parameter's torch storage points at a poison
// region: address space reserved with PROT_NONE, as large as the parameter. Any
// read or write of it faults; a SIGSEGV handler finds the region, records the
// hit, maps zero pages over the region (so the faulting op finishes on zeros
// instead of crashing) and returns. The binding checks the hits at every hook and
// at step() and raises an exception that names the parameter: a missed hook is a
// clear error, never a segfault or silently wrong numbers. Faults outside every
// region go to the handler that was installed before (Python's faulthandler, or
// the default). The table has a fixed capacity and entries never move, so the
// handler reads it without locks.
//
// A region can also serve as a *view* between steps (Note [Parameters between
// steps] in param_views.cpp): open_view() maps fresh read-write pages over it, the
// binding copies the parameter's current value in, and seal_view() makes it
// read-only. The first write then faults; the handler marks the region dirty and
// makes it writable, so a write through any alias (p.data, numpy, a raw pointer)
// is seen at no cost to the reads. rearm() puts the region back to poison.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/common/status.hpp"

namespace strata::torch_binding {

//! One reserved region; move-only, unreserved by the destructor.
class PoisonRegion {
 public:
  //! Reserves `bytes` (> 0) of PROT_NONE address space. Fails: OutOfMemory (mmap refused), OutOfBudget (the
  //! table of kPoisonRegionsMax regions is full).
  static Result<PoisonRegion> create(std::size_t bytes);
  PoisonRegion() = default;
  PoisonRegion(PoisonRegion&& other) noexcept;
  PoisonRegion& operator=(PoisonRegion&& other) noexcept;
  PoisonRegion(const PoisonRegion&) = delete;
  PoisonRegion& operator=(const PoisonRegion&) = delete;
  ~PoisonRegion();

  void* data() const { return base_; }
  //! Whether the region was touched since the last rearm(); rearm() clears the
  //! mark and makes the region fault again.
  bool hit() const;
  void rearm();

  //! Maps fresh read-write zero pages over the region (a view, Note [Parameters
  //! between steps]). Fails: OutOfMemory (mmap refused).
  Status open_view();
  //! Makes an open view read-only and clean: its next write faults once, marks it
  //! dirty and makes it writable again.
  void seal_view();
  //! Whether the region is a view (open_view() since the last rearm()).
  bool in_view() const;
  //! Whether a sealed view was written since seal_view().
  bool view_dirty() const;

 private:
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
  std::int64_t slot_ = -1;
};

//! Installs the SIGSEGV handler (idempotent, also after another library replaced
//! it). Thread-safe.
void install_poison_handler();
//! Regions touched since their last rearm(), anywhere in the process (cheap: one atomic load when none).
bool any_poison_hit();
//! Clears the process-wide mark after every region was looked at (and rearmed).
void clear_any_poison_hit();

inline constexpr std::size_t kPoisonRegionsMax = 1 << 16;

}  // namespace strata::torch_binding
