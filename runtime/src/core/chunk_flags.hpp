#pragma once
// Data parallelism's per-chunk flags (Note [Sharded step] in data_parallel.cpp):
// a side table by family beside Core's chunk table, not fields of Chunk.
// DataParallel owns the table and is its one writer (and checks it:
// DataParallel::check_invariants); Residency reads it (eviction keeps what a
// collective holds and evicts a gradient awaiting its reduction last; prefetch
// skips a param awaiting its gather). Empty until finalize sizes it; every flag
// stays clear with one rank.

#include <cstddef>
#include <vector>

#include "core/chunk.hpp"

namespace strata::runtime {

class DpChunkFlags {
 public:
  //! One family's flags.
  struct Family {
    //! Its complete gradient's round has not started its reduction yet: evicted
    //! only when nothing else can be.
    bool awaiting_reduction = false;
    //! Its param's update (another rank's shards) is still arriving by
    //! all-gather: the param's host and device copies are stale; not prefetched;
    //! its first use waits for the gather (DataParallel::finish_gather).
    bool awaiting_gather = false;
    //! The gradient's (param's) device slot is read or written by a collective
    //! in flight (a device-buffer communicator): the slot is not reused.
    bool grad_in_collective = false;
    bool param_in_collective = false;
  };

  //! Every family's flags clear, for `families` families (finalize).
  void reset(std::size_t families) { families_.assign(families, Family{}); }
  std::size_t size() const { return families_.size(); }
  const Family& operator[](FamilyId f) const { return families_[f]; }
  Family& operator[](FamilyId f) { return families_[f]; }

  //! c is a gradient awaiting its reduction.
  bool awaiting_reduction(const Chunk& c) const {
    return c.kind == StateKind::kGrad && c.family < families_.size() &&
           families_[c.family].awaiting_reduction;
  }
  //! c is a param awaiting its gather.
  bool awaiting_gather(const Chunk& c) const {
    return c.kind == StateKind::kParam && c.family < families_.size() && families_[c.family].awaiting_gather;
  }
  //! c's device slot is held by a collective in flight.
  bool in_collective(const Chunk& c) const {
    if (c.family >= families_.size()) return false;
    const Family& f = families_[c.family];
    return (c.kind == StateKind::kGrad && f.grad_in_collective) ||
           (c.kind == StateKind::kParam && f.param_in_collective);
  }

 private:
  std::vector<Family> families_;
};

}  // namespace strata::runtime
