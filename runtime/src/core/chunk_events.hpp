#pragma once
// ChunkEvents: what the lease path and the scheduler tell a part that follows
// the chunks' use without owning them (Note [Chunk events]). Not a public header.
//
// Note [Chunk events]
// Data parallelism needs to act at a few moments of a chunk's use: before a use
// is placed (rank 0's initial params, another rank's updated param still
// arriving), after it is placed (finish the gathers the prefetch is about to
// load), before a host access between steps, and when gradients are handed
// over (start the reductions). Rather than the lease path calling it by name,
// Runtime::Impl emits these events to one observer, `Impl::events`:
// DataParallel with W > 1 ranks, null with one rank, so a single-rank run pays
// one pointer test per event. The observer may wait, unlocking `lock`; an error
// it returns fails the call that emitted the event (on_placed's and
// on_gradients_handed_over's become the runtime's error: Note [Failed steps]).
// Who emits what: leases.cpp (on_use, on_placed), host_copy.cpp
// (on_host_access), scheduler.cpp (on_gradients_handed_over, at
// SchedulerEvent::kLeaseReleased of a grad or param lease).

#include <mutex>

#include "core/chunk.hpp"

namespace strata::runtime {

class ChunkEvents {
 public:
  virtual ~ChunkEvents() = default;
  //! Before a lease's chunk c is placed (acquire).
  virtual Status on_use(std::unique_lock<std::mutex>& lock, Chunk& c) = 0;
  //! After a lease was placed, before the prefetch it allows starts (acquire).
  virtual Status on_placed(std::unique_lock<std::mutex>& lock) = 0;
  //! Before chunk c is read (write: written) through a host copy between steps.
  virtual Status on_host_access(std::unique_lock<std::mutex>& lock, Chunk& c, bool write) = 0;
  //! A grad or param lease was released (SchedulerEvent::kLeaseReleased);
  //! takes the place of starting optimizer steps at once.
  virtual Status on_gradients_handed_over() = 0;

 protected:
  ChunkEvents() = default;
  ChunkEvents(const ChunkEvents&) = default;
  ChunkEvents& operator=(const ChunkEvents&) = default;
};

}  // namespace strata::runtime
