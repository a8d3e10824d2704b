#pragma once
// The `mpi` backend (MPICH): one rank per process, for several processes on
// one machine and for CPU clusters. Launch with `mpiexec -n W <program>`.
//
// Note [MPI waits]
// MPI has no timeout on a collective, so Handle::wait() polls MPI_Test (backing
// off from 50 us to 1 ms) until CommOptions::timeout; a peer that died or hangs
// then fails the wait with Unavailable instead of hanging the job. The request
// cannot be cancelled: the communicator is broken from then on and the caller
// ends the job with abort() (MPI_Abort), as MPI's own error handling would.
// Calls into MPI are serialised by one process-wide mutex, so handles may be
// waited for on another thread (MPI_THREAD_SERIALIZED is enough).

#include <memory>

#include "strata/comm/communicator.hpp"

namespace strata::comm {

//! True when this process was started by an MPI launcher (PMI_RANK or
//! PMI_SIZE / OMPI_COMM_WORLD_SIZE in the environment).
bool launched_by_mpi();

//! This process's rank in a duplicate of MPI_COMM_WORLD. Initialises MPI
//! (MPI_Init_thread) when the program has not, and then finalises it at exit.
//! Blocks until every rank has called it (MPI_Comm_dup). Fails: Unavailable
//! when MPI gives less than MPI_THREAD_SERIALIZED or MPI was already finalised;
//! InvalidArgument for a zero timeout.
Result<std::unique_ptr<Communicator>> make_mpi_communicator(CommOptions options = {});

}  // namespace strata::comm
