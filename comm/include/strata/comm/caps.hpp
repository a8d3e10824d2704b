#pragma once
// What a communicator can do, beside Communicator::device_buffers() (issue #26:
// the runtime asks capabilities, never compares backend names). The answers per
// backend live in comm/src/caps.cpp, with the backends.
//
// (A virtual on Communicator is the natural home; it is a free function for now
// because communicator.hpp is included by runtime.hpp, so a change there rebuilds
// the whole tree; move it when that header next changes.)

#include "strata/comm/communicator.hpp"

namespace strata::comm {

//! Whether reductions sum the ranks' values in rank order, so every run gives the
//! same bits (Note [Deterministic reduction]): local and mpi, not nccl.
bool rank_ordered_sum(const Communicator& comm);
//! Whether its device-buffer collectives need CUDA device memory (nccl). Not the
//! same as device_buffers(): a test's device-buffer communicator reduces the sim
//! device's memory, which is host memory.
bool needs_cuda_memory(const Communicator& comm);

}  // namespace strata::comm
