// The nccl backend of a build without NCCL (comm/CMakeLists.txt chooses this file).
#include "strata/comm/nccl.hpp"

namespace strata::comm {

bool nccl_compiled() {
  return false;
}

Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator& /*bootstrap*/,
                                                             void* /*cuda_stream*/, CommOptions /*options*/) {
  return unavailable(
      "comm nccl: this build has no NCCL backend (CMake found no nccl.h / libnccl; set NCCL_HOME and "
      "reconfigure); use the mpi backend");
}

}  // namespace strata::comm
