#pragma once
// The `nccl` backend: GPU clusters. Compiled only when CMake finds NCCL (and
// CUDA); otherwise make_nccl_communicator says so. Chunk buffers
// (reduce_scatter, all_gather) are device memory (device_buffers() is true);
// all_reduce's scalars and broadcast's data are host memory, staged through
// device buffers (a small fixed one; one per broadcast, at start-up). The NCCL unique id travels over a
// bootstrap communicator (mpi), as NCCL's own examples do with MPI_Bcast.
//
// NCCL has no rank-ordered reduction: deterministic mode is refused
// (Note [Deterministic reduction]); waits poll the stream's event and
// ncclCommGetAsyncError until the timeout, then ncclCommAbort (Note [Peer failure]).

#include <memory>

#include "strata/comm/communicator.hpp"

namespace strata::comm {

//! True when this build has the nccl backend.
bool nccl_compiled();

//! A communicator over the same ranks as `bootstrap` (rank 0 makes the NCCL
//! id and broadcasts it), issuing collectives on `cuda_stream` (a cudaStream_t;
//! null = the default stream) of the current device. Blocks until every rank
//! called it. Fails: Unavailable (no NCCL in this build, NCCL/CUDA errors),
//! InvalidArgument (deterministic mode, zero timeout).
Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& bootstrap, void* cuda_stream,
                                                             CommOptions options = {});

}  // namespace strata::comm
