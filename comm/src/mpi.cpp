#include "strata/comm/mpi.hpp"

#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace strata::comm {
namespace {

//! Every call into MPI (Note [MPI waits]).
std::mutex& mpi_mutex() {
  static std::mutex mu;
  return mu;
}

std::string mpi_error(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  return std::string(text, static_cast<std::size_t>(len));
}

//! State shared by a communicator and its operations in flight.
struct Shared {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  CommOptions options;
  std::mutex mu;  // guards broken
  Status broken;  // the first failure; later calls fail with it
};

class MpiOp final : public PendingOp {
 public:
  //! `finish` runs once the request completed (e.g. the rank-ordered sum).
  MpiOp(std::shared_ptr<Shared> s, MPI_Request req, std::string what, std::vector<std::byte> scratch,
        std::function<void(const std::vector<std::byte>&)> finish)
      : s_(std::move(s)),
        req_(req),
        what_(std::move(what)),
        scratch_(std::move(scratch)),
        finish_(std::move(finish)) {}
  Status wait() override;

 private:
  std::shared_ptr<Shared> s_;
  MPI_Request req_;
  std::string what_;
  std::vector<std::byte> scratch_;
  std::function<void(const std::vector<std::byte>&)> finish_;
};

Status MpiOp::wait() {
  const auto deadline = std::chrono::steady_clock::now() + s_->options.timeout;
  auto backoff = std::chrono::microseconds(50);
  for (;;) {
    int done = 0;
    int rc;
    {
      std::lock_guard lk(mpi_mutex());
      rc = MPI_Test(&req_, &done, MPI_STATUS_IGNORE);
    }
    if (rc != MPI_SUCCESS) {
      std::lock_guard lk(s_->mu);
      if (s_->broken.ok())
        s_->broken =
            unavailable("comm mpi rank {} of {}: {} failed: {}", s_->rank, s_->size, what_, mpi_error(rc));
      return s_->broken;
    }
    if (done) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::lock_guard lk(s_->mu);
      if (s_->broken.ok()) {
        s_->broken = unavailable(
            "comm mpi rank {} of {}: {} did not complete within {} ms: a peer rank died, hangs, or issued a "
            "different sequence of collectives; the job must end (Communicator::abort)",
            s_->rank, s_->size, what_, s_->options.timeout.count());
      }
      return s_->broken;
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::microseconds(1000));
  }
  if (finish_) finish_(scratch_);
  return Status::Ok();
}

class MpiCommunicator final : public Communicator {
 public:
  explicit MpiCommunicator(std::shared_ptr<Shared> s)
      : Communicator(s->rank, s->size, s->options), s_(std::move(s)) {}
  ~MpiCommunicator() override {
    std::lock_guard lk(mpi_mutex());
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && s_->broken.ok()) MPI_Comm_free(&s_->comm);
  }
  std::string_view backend() const override { return "mpi"; }
  void abort(std::string_view reason) override {
    fmt::print(stderr, "comm mpi rank {}: aborting the job: {}\n", rank(), reason);
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 70);
  }

 protected:
  Result<std::unique_ptr<PendingOp>> start_reduce_scatter(const void* send, void* recv, std::size_t count,
                                                          DType dtype) override {
    const std::size_t bytes = count * dtype_size(dtype);
    STRATA_RETURN_IF_ERROR(check_ready("reduce_scatter", bytes * static_cast<std::size_t>(size())));
    const std::string what = fmt::format("reduce_scatter #{} of {} x {}", seq_++, count, dtype_name(dtype));
    stats_.reduce_scatter_bytes += peer_bytes(bytes);
    MPI_Request req;
    if (!options().deterministic && dtype == DType::kF32) {
      if (recv == static_cast<const std::byte*>(send) + bytes * static_cast<std::size_t>(rank())) {
        return invalid_argument(
            "comm mpi: {} in place is not supported (MPI needs MPI_IN_PLACE for it); give "
            "recv its own buffer",
            what);
      }
      std::lock_guard lk(mpi_mutex());
      const int rc =
          MPI_Ireduce_scatter_block(send, recv, static_cast<int>(count), MPI_FLOAT, MPI_SUM, s_->comm, &req);
      STRATA_RETURN_IF_ERROR(check_rc(rc, what));
      return make_op(req, what, {}, {});
    }
    // Rank-ordered: slice r of every rank comes here, then the sum in rank order.
    std::vector<std::byte> scratch(bytes * static_cast<std::size_t>(size()));
    {
      std::lock_guard lk(mpi_mutex());
      const int rc = MPI_Ialltoall(send, static_cast<int>(bytes), MPI_BYTE, scratch.data(),
                                   static_cast<int>(bytes), MPI_BYTE, s_->comm, &req);
      STRATA_RETURN_IF_ERROR(check_rc(rc, what));
    }
    const int w = size();
    return make_op(req, what, std::move(scratch),
                   [recv, count, dtype, bytes, w](const std::vector<std::byte>& s) {
                     std::vector<const void*> src(static_cast<std::size_t>(w));
                     for (std::size_t r = 0; r < src.size(); ++r) src[r] = s.data() + r * bytes;
                     sum_in_rank_order(src, recv, count, dtype);
                   });
  }

  Result<std::unique_ptr<PendingOp>> start_all_gather(const void* send, void* recv, std::size_t count,
                                                      DType dtype) override {
    const std::size_t bytes = count * dtype_size(dtype);
    STRATA_RETURN_IF_ERROR(check_ready("all_gather", bytes * static_cast<std::size_t>(size())));
    const std::string what = fmt::format("all_gather #{} of {} x {}", seq_++, count, dtype_name(dtype));
    stats_.all_gather_bytes += peer_bytes(bytes);
    const bool in_place =
        send == static_cast<const std::byte*>(recv) + bytes * static_cast<std::size_t>(rank());
    MPI_Request req;
    std::lock_guard lk(mpi_mutex());
    const int rc = MPI_Iallgather(in_place ? MPI_IN_PLACE : send, static_cast<int>(bytes), MPI_BYTE, recv,
                                  static_cast<int>(bytes), MPI_BYTE, s_->comm, &req);
    STRATA_RETURN_IF_ERROR(check_rc(rc, what));
    return make_op(req, what, {}, {});
  }

  Result<std::unique_ptr<PendingOp>> start_all_reduce(std::span<double> values, ReduceOp op) override {
    STRATA_RETURN_IF_ERROR(check_ready("all_reduce", values.size_bytes() * static_cast<std::size_t>(size())));
    const std::string what = fmt::format("all_reduce ({}) #{} of {} scalars",
                                         op == ReduceOp::kSum ? "sum" : "max", seq_++, values.size());
    stats_.all_reduce_bytes += peer_bytes(values.size_bytes());
    MPI_Request req;
    if (op == ReduceOp::kMax || !options().deterministic) {
      std::lock_guard lk(mpi_mutex());
      const int rc = MPI_Iallreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE,
                                    op == ReduceOp::kMax ? MPI_MAX : MPI_SUM, s_->comm, &req);
      STRATA_RETURN_IF_ERROR(check_rc(rc, what));
      return make_op(req, what, {}, {});
    }
    // Rank-ordered sum: gather every rank's values, then add them here in rank order.
    std::vector<std::byte> scratch(values.size_bytes() * static_cast<std::size_t>(size()));
    {
      std::lock_guard lk(mpi_mutex());
      const int rc =
          MPI_Iallgather(values.data(), static_cast<int>(values.size()), MPI_DOUBLE, scratch.data(),
                         static_cast<int>(values.size()), MPI_DOUBLE, s_->comm, &req);
      STRATA_RETURN_IF_ERROR(check_rc(rc, what));
    }
    const int w = size();
    return make_op(req, what, std::move(scratch), [values, w](const std::vector<std::byte>& s) {
      const auto* all = reinterpret_cast<const double*>(s.data());
      for (std::size_t i = 0; i < values.size(); ++i) {
        double acc = all[i];
        for (std::size_t r = 1; r < static_cast<std::size_t>(w); ++r) acc += all[r * values.size() + i];
        values[i] = acc;
      }
    });
  }

  Result<std::unique_ptr<PendingOp>> start_broadcast(void* data, std::size_t bytes, int root) override {
    STRATA_RETURN_IF_ERROR(check_ready("broadcast", bytes));
    const std::string what = fmt::format("broadcast #{} of {} bytes from rank {}", seq_++, bytes, root);
    if (rank() == root) stats_.broadcast_bytes += peer_bytes(bytes);
    MPI_Request req;
    std::lock_guard lk(mpi_mutex());
    const int rc = MPI_Ibcast(data, static_cast<int>(bytes), MPI_BYTE, root, s_->comm, &req);
    STRATA_RETURN_IF_ERROR(check_rc(rc, what));
    return make_op(req, what, {}, {});
  }

 private:
  std::uint64_t peer_bytes(std::size_t bytes) const { return bytes * static_cast<std::uint64_t>(size() - 1); }

  Status check_ready(std::string_view op, std::size_t bytes) {
    {
      std::lock_guard lk(s_->mu);
      if (!s_->broken.ok()) return s_->broken;
    }
    if (bytes > static_cast<std::size_t>(INT_MAX)) {
      return invalid_argument("comm mpi: {} of {} bytes exceeds MPI's int count ({}); use smaller chunks", op,
                              bytes, INT_MAX);
    }
    return Status::Ok();
  }

  Status check_rc(int rc, const std::string& what) {
    if (rc == MPI_SUCCESS) return Status::Ok();
    std::lock_guard lk(s_->mu);
    if (s_->broken.ok())
      s_->broken = unavailable("comm mpi rank {}: starting {} failed: {}", rank(), what, mpi_error(rc));
    return s_->broken;
  }

  Result<std::unique_ptr<PendingOp>> make_op(MPI_Request req, std::string what,
                                             std::vector<std::byte> scratch,
                                             std::function<void(const std::vector<std::byte>&)> finish) {
    return std::unique_ptr<PendingOp>(
        std::make_unique<MpiOp>(s_, req, std::move(what), std::move(scratch), std::move(finish)));
  }

  std::shared_ptr<Shared> s_;
  std::uint64_t seq_ = 0;
};

void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace

bool launched_by_mpi() {
  return std::getenv("PMI_RANK") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
         std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
}

Result<std::unique_ptr<Communicator>> make_mpi_communicator(CommOptions options) {
  if (options.timeout.count() <= 0) {
    return invalid_argument("comm mpi: timeout {} ms must be > 0 (Note [MPI waits])",
                            options.timeout.count());
  }
  std::lock_guard lk(mpi_mutex());
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized)
    return unavailable("comm mpi: MPI was already finalised in this process; it cannot start again");
  int initialized = 0;
  MPI_Initialized(&initialized);
  int provided = 0;
  if (!initialized) {
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) {
      return unavailable("comm mpi: MPI_Init_thread failed; start the program with mpiexec");
    }
    std::atexit(finalize_at_exit);
  } else {
    MPI_Query_thread(&provided);
  }
  if (provided < MPI_THREAD_SERIALIZED) {
    return unavailable("comm mpi: MPI gives thread level {} but strata needs MPI_THREAD_SERIALIZED ({})",
                       provided, MPI_THREAD_SERIALIZED);
  }
  auto s = std::make_shared<Shared>();
  s->options = options;
  MPI_Comm_dup(MPI_COMM_WORLD, &s->comm);
  MPI_Comm_set_errhandler(s->comm, MPI_ERRORS_RETURN);
  MPI_Comm_rank(s->comm, &s->rank);
  MPI_Comm_size(s->comm, &s->size);
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(std::move(s)));
}

}  // namespace strata::comm
