#pragma once
// Data parallelism (private to data_parallel.cpp, dp_reduce.cpp, dp_gather.cpp):
// what the collectives of Note [Sharded step] (in data_parallel.cpp) share: the
// ranks and the communicator's dtype, and running a collective
// without the runtime's lock. data_parallel.cpp owns start-up, broadcasts and
// agreements; dp_reduce.cpp the gradient reduce-scatters during backward;
// dp_gather.cpp the param all-gathers after the update. They may call Core and
// Runtime::Impl; every function expects Core::mu held.

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "runtime_impl.hpp"

namespace strata::runtime::dp_detail {

//! The communicator's dtype of a compute dtype.
comm::DType comm_dtype(DType d);

//! What the collectives of Note [Sharded step] need to know: W, this rank, the
//! families, and the compute dtype's size and comm dtype.
struct Rounds {
  explicit Rounds(const Core& core)
      : w(static_cast<FamilyId>(core.dp_ranks())),
        me(static_cast<FamilyId>(core.dp_rank())),
        families(core.layout.families.size()),
        elem_bytes(dtype_bytes(core.opt.compute_dtype)),
        dtype(comm_dtype(core.opt.compute_dtype)) {}
  FamilyId w, me, families;
  std::uint64_t elem_bytes;
  comm::DType dtype;
};

//! Starts a collective and waits for it without the runtime's lock (the other
//! ranks may take a while; nothing here touches the runtime's state meanwhile).
Status run_collective(std::unique_lock<std::mutex>& lock, Result<comm::Handle> started);

}  // namespace strata::runtime::dp_detail
