// The communicators' capabilities (caps.hpp), per backend.
#include "strata/comm/caps.hpp"

namespace strata::comm {

bool rank_ordered_sum(const Communicator& comm) {
  // nccl's ring and tree reductions sum in an order of their own; local, mpi and
  // torch (python/src/torch_comm.cpp: c10d moves, sum_in_rank_order adds) do not.
  return comm.backend() != "nccl";
}

bool needs_cuda_memory(const Communicator& comm) {
  return comm.backend() == "nccl";
}

}  // namespace strata::comm
