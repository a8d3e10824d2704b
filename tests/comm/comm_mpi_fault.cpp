// Fault test of the mpi backend (ctest label dp): under `mpiexec -n W`, the
// last rank stops taking part mid-step (it hangs, as a dead or stuck peer
// looks from outside); every other rank's wait must fail within the timeout
// with a message naming the collective, and rank 0 then ends the job
// (Communicator::abort). ctest passes on that message, and on nothing else:
// a hang is killed by the test's TIMEOUT and fails.
#include <unistd.h>

#include <chrono>
#include <string_view>
#include <thread>
#include <vector>

#include "strata/comm/mpi.hpp"

int main(int argc, char** argv) {
  const bool dies = argc > 1 && std::string_view(argv[1]) == "--dies";
  using namespace strata::comm;
  // Step 1 on a communicator with a long timeout (start-up skew on a loaded
  // machine is not the fault under test); step 2 on one with a short timeout.
  auto steady = make_mpi_communicator({.timeout = std::chrono::milliseconds(120000)});
  auto c = make_mpi_communicator({.timeout = std::chrono::milliseconds(1500)});
  if (!steady.ok() || !c.ok()) {
    fmt::print(stderr, "comm_mpi_fault: {} / {}\n", steady.status(), c.status());
    return 2;
  }
  Communicator& comm = **c;
  const int w = comm.size();
  std::vector<float> send(static_cast<std::size_t>(w) * 1024, 1.0f), recv(1024);
  // Step 1: everyone takes part.
  if (!(*steady)->reduce_scatter(send.data(), recv.data(), 1024, DType::kF32)->wait().ok()) return 3;
  // Step 2: the last rank stops answering (--dies: it exits without a word).
  if (comm.rank() == w - 1) {
    if (dies) _exit(9);
    std::this_thread::sleep_for(std::chrono::seconds(120));
    return 4;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto h = comm.reduce_scatter(send.data(), recv.data(), 1024, DType::kF32);
  strata::Status s = h.ok() ? h->wait() : h.status();
  const double waited_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (s.ok()) return 5;
  fmt::print("rank {}: failed after {:.1f} s: {}\n", comm.rank(), waited_s, s);
  std::fflush(stdout);
  // Let mpiexec forward that line before MPI_Abort tears the job down (it
  // drops what it has not forwarded yet).
  std::this_thread::sleep_for(std::chrono::seconds(1));
  if (comm.rank() == 0) comm.abort("a peer did not take part in the step");
  std::this_thread::sleep_for(std::chrono::seconds(120));  // MPI_Abort from rank 0 ends this rank too
  return 6;
}
