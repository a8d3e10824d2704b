#pragma once
// Communicator: the collectives data parallelism needs, and nothing more
// (Note [Comm layer]). comm/ knows no chunks: it moves buffers; the runtime
// decides which.
//
//   reduce_scatter  sum of W equal slices, rank r keeps slice r (gradient chunks)
//   all_gather      every rank's slice to every rank (updated param chunks)
//   all_reduce      sum or max of a few fp64 scalars (grad norm², the Inf/NaN flag)
//   broadcast       bytes from one root (initial values, a config hash, an NCCL id)
//
// Note [Comm layer]
// Every rank issues the same collectives in the same order (as NCCL and MPI
// require); a call starts the collective and returns a Handle at once, and
// Handle::wait() blocks until this rank's output is ready and its input may be
// reused. Backends: `local` (threads of one process, local.hpp), `mpi` (MPICH,
// mpi.hpp), `nccl` (built only when NCCL is found, nccl.hpp; compiled wherever
// CUDA is, against declarations of NCCL's API: comm/nccl_api/nccl.h). For
// `nccl` the chunk collectives (reduce_scatter, all_gather) take device memory
// (device_buffers()), and the runtime reduces and gathers in its device slots
// (Note [Sharded step]); all_reduce and broadcast take host memory everywhere.
// reduce_scatter may run in place (recv = send + rank * count), as NCCL's does.
// The nccl backend has been compiled here, never run on a GPU.
//
// Note [Deterministic reduction]
// In deterministic mode a sum is formed in rank order, rounding to the buffer's
// dtype after each addition: out = ((s0 + s1) + s2) + s3. That is exactly what
// one rank computes when it accumulates the W ranks' micro-batches one after
// the other in the same dtype, so W ranks each with 1/W of the batch can be
// compared bit for bit with one rank holding the whole batch. The local backend
// always reduces this way; mpi does when deterministic (an all-to-all of slices,
// then the sum here: the same bytes on the wire as a reduce-scatter); nccl has
// no rank-ordered reduction and refuses deterministic mode.
//
// Note [Peer failure]
// No wait blocks for ever. A rank that dies, hangs or never issues the
// collective makes every other rank's wait fail within CommOptions::timeout
// with Unavailable naming the collective, its sequence number and the ranks
// missing (where the backend can tell). After such a failure the communicator
// is broken: later calls fail at once with the first error. With MPI the caller
// then ends the job (abort(), i.e. MPI_Abort), since MPI cannot cancel a
// collective in flight.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "strata/common/dtype.hpp"
#include "strata/common/half.hpp"
#include "strata/common/status.hpp"

namespace strata::comm {

//! Element type of a chunk buffer: common's (Note [DType names] in
//! common/dtype.hpp). reduce_scatter and all_gather refuse DType::kNone.
using DType = strata::DType;
using strata::dtype_name;
using strata::dtype_size;

//! Reduction of all_reduce.
enum class ReduceOp : std::uint8_t { kSum, kMax };

//! Settings shared by every backend.
struct CommOptions {
  //! Longest a wait blocks before it fails (Note [Peer failure]).
  std::chrono::milliseconds timeout{30000};
  //! Rank-ordered sums (Note [Deterministic reduction]).
  bool deterministic = true;
};

//! Bytes this rank sent to other ranks, per collective, since creation.
struct CommStats {
  std::uint64_t reduce_scatter_bytes = 0;
  std::uint64_t all_gather_bytes = 0;
  std::uint64_t all_reduce_bytes = 0;
  std::uint64_t broadcast_bytes = 0;
  std::uint64_t collectives = 0;  //!< collectives issued
  double wait_s = 0.0;            //!< time blocked in Handle::wait()
  std::uint64_t total_bytes() const {
    return reduce_scatter_bytes + all_gather_bytes + all_reduce_bytes + broadcast_bytes;
  }
};

//! One collective in flight, as a backend implements it.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  //! Blocks until this rank's part is done or the timeout; called once.
  virtual Status wait() = 0;
  //! Whether wait() would return at once; never blocks. A backend that cannot
  //! tell says false (the caller then waits when it must).
  virtual bool done() { return false; }
};

//! A collective in flight. Move-only. wait() blocks until this rank's output is
//! ready and its input buffer may be reused (or the timeout: Note [Peer
//! failure]); a second wait() returns the first result. Destroying a handle that
//! was not waited for waits (and logs a failure): buffers are never left in use.
//! A Handle must not outlive its Communicator.
class Handle {
 public:
  Handle() = default;
  //! `wait_ns` (may be null) accumulates the time blocked in wait().
  Handle(std::unique_ptr<PendingOp> op, std::atomic<std::uint64_t>* wait_ns);
  Handle(Handle&& other) noexcept = default;
  Handle& operator=(Handle&& other) noexcept;
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle();

  bool valid() const { return op_ != nullptr || waited_; }
  Status wait();
  //! Whether wait() would return at once (PendingOp::done); never blocks.
  bool done() { return waited_ || (op_ != nullptr && op_->done()); }

 private:
  std::unique_ptr<PendingOp> op_;
  std::atomic<std::uint64_t>* wait_ns_ = nullptr;  // the communicator's; handles never outlive it
  bool waited_ = false;
  Status result_;
};

//! One rank's end of a group of W ranks. Calls are made from one thread at a
//! time (the handles may be waited for from another thread, one wait per
//! handle). Every rank must issue the same collectives in the same order, with
//! the same counts and dtypes; a mismatch is an error where the backend can
//! see it (local), undefined for MPI/NCCL (as with MPI itself).
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const CommOptions& options() const { return options_; }
  //! "local", "mpi" or "nccl".
  virtual std::string_view backend() const = 0;
  //! Whether reduce_scatter's and all_gather's buffers are device memory (nccl):
  //! the runtime then reduces gradients in their device slots and gathers params
  //! into them (Note [Sharded step]). all_reduce and broadcast take host memory
  //! on every backend. A device-buffer collective is ordered on the backend's
  //! stream; Handle::wait() returns once it is done there.
  virtual bool device_buffers() const { return false; }

  //! `send` holds size() * count elements; `recv` (count elements, not
  //! overlapping `send`, or exactly send + rank() * count: in place, as NCCL
  //! allows) receives the sum over ranks of slice rank() of send.
  //! Fails: InvalidArgument (null buffer with count > 0, overlap), or the
  //! communicator's first failure.
  Result<Handle> reduce_scatter(const void* send, void* recv, std::size_t count, DType dtype);
  //! `send` holds count elements; `recv` (size() * count) receives rank r's
  //! send at slice r. `send` may be recv's own slice (in place).
  Result<Handle> all_gather(const void* send, void* recv, std::size_t count, DType dtype);
  //! Reduces `values` element-wise over ranks, in place (sum in rank order when
  //! deterministic; max is exact either way).
  Result<Handle> all_reduce(std::span<double> values, ReduceOp op);
  //! Copies `bytes` bytes of root's `data` into every other rank's `data`.
  Result<Handle> broadcast(void* data, std::size_t bytes, int root);

  //! Ends the whole group after a failure: local marks the group failed (every
  //! other rank's wait fails at once with `reason`); mpi calls MPI_Abort (does
  //! not return). Thread-safe.
  virtual void abort(std::string_view reason) = 0;

  //! A snapshot of the counters. Thread-safe against waits on other threads.
  CommStats stats() const {
    CommStats s = stats_;
    s.wait_s = static_cast<double>(wait_ns_.load(std::memory_order_relaxed)) * 1e-9;
    return s;
  }

 protected:
  Communicator(int rank, int size, CommOptions options) : rank_(rank), size_(size), options_(options) {}

  virtual Result<std::unique_ptr<PendingOp>> start_reduce_scatter(const void* send, void* recv,
                                                                  std::size_t count, DType dtype) = 0;
  virtual Result<std::unique_ptr<PendingOp>> start_all_gather(const void* send, void* recv, std::size_t count,
                                                              DType dtype) = 0;
  virtual Result<std::unique_ptr<PendingOp>> start_all_reduce(std::span<double> values, ReduceOp op) = 0;
  virtual Result<std::unique_ptr<PendingOp>> start_broadcast(void* data, std::size_t bytes, int root) = 0;

  //! Backends add the bytes each collective sends from this rank (issuing thread only).
  CommStats stats_;
  std::atomic<std::uint64_t> wait_ns_{0};

 private:
  Result<Handle> finish_start(Result<std::unique_ptr<PendingOp>> op);
  int rank_;
  int size_;
  CommOptions options_;
};

//! Sums `sources` (each count elements of dtype) into `out` in rank order,
//! rounding to dtype after each addition (Note [Deterministic reduction]).
//! `out` may alias none of the sources except the first.
void sum_in_rank_order(std::span<const void* const> sources, void* out, std::size_t count, DType dtype);

//! fp32 <-> bf16 / fp16 with round-to-nearest-even (NaN stays NaN): the scalar
//! conversions of common/half.hpp, which kernels/ uses too.
inline constexpr std::uint16_t (*to_bf16)(float) = &strata::float_to_bf16;
inline constexpr float (*from_bf16)(std::uint16_t) = &strata::bf16_to_float;
inline constexpr std::uint16_t (*to_f16)(float) = &strata::float_to_f16;
inline constexpr float (*from_f16)(std::uint16_t) = &strata::f16_to_float;

}  // namespace strata::comm
