#include "torch_comm.hpp"

#include <ATen/ATen.h>

#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "strata/common/log.hpp"

// Note [Comm over torch.distributed]
// Under torchrun the user has already made a torch.distributed ProcessGroup: it
// chose the transport (gloo on CPU and in sim mode, NCCL on CUDA), the rendezvous
// (env://, file://, a TCPStore) and the timeouts, and its launcher tears the job
// down when a rank fails. strata therefore runs its collectives on that group
// (TorchCommunicator) instead of bootstrapping a transport of its own (strata's
// mpi or nccl backends, their ids exchanged through torch's store): no second
// rendezvous, no second set of sockets or NCCL communicators, and the group's
// ranks are the user's (a subgroup works as well as the world).
//
// Exactness is kept as the mpi backend keeps it (comm/src/mpi.cpp, Note
// [Deterministic reduction]): reduce_scatter is an all-to-all of the W slices
// (alltoall_base, the same bytes on the wire as a reduce-scatter) and then
// sum_in_rank_order here; the fp64 all_reduce is an all-gather of every rank's
// values and a sum (or max) in rank order here. c10d's own reductions are never
// used, so the result does not depend on gloo's or NCCL's reduction order and is
// the same whether or not options().deterministic is set. Only APIs present in
// both torch 1.13 and 2.x are called: alltoall_base, the vector form of allgather
// (gloo in 1.13 has no _allgather_base), broadcast and Work::wait(timeout); host
// buffers are wrapped with at::from_blob, never copied (gloo copies internally
// for allgather).
//
// Failures (Note [Peer failure]): c10d reports a dead peer or a timeout by
// throwing, from the call or from Work::wait(timeout); each becomes Unavailable
// naming the collective, its sequence number and this rank, and the communicator
// is broken from then on. A wait that timed out leaves the collective running on
// c10d's worker thread with the caller's buffers: as with mpi, the job must end.
// abort() cannot end the peers (torch 1.13's ProcessGroup has no abort); it
// breaks this rank's communicator, and the process's exit (torchrun tears the
// rest down) ends the job.
//
// strata.torch.wrap makes one for the group it shards over and hands it to the
// runtime (Note [Ranks under torchrun] in python/strata/torch/_processes.py).
// Not done yet: every buffer is host memory (device_buffers() is false), so the
// group needs a CPU backend (gloo; in torch 2.x a "cpu:gloo,cuda:nccl" group).

namespace strata::torch_binding {
namespace {

using comm::CommOptions;
using comm::DType;
using comm::PendingOp;
using comm::ReduceOp;

//! State shared by the communicator and its operations in flight.
struct Shared {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  int rank = 0, size = 1;
  std::string backend;  // the group's (gloo, nccl), for messages
  CommOptions options;
  std::mutex mu;  // guards broken
  Status broken;  // the first failure; later calls fail with it
};

//! What an exception from c10d says, without torch's C++ backtrace.
std::string exception_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

//! Records the first failure; returns the communicator's error.
Status fail(Shared& s, const std::string& what, const std::string& why) {
  std::lock_guard lk(s.mu);
  if (s.broken.ok()) {
    s.broken = unavailable(
        "comm torch ({}) rank {} of {}: {} failed: {}; a peer rank died, hangs, or issued a different "
        "sequence of collectives (or the timeout of {} ms is too short); the job must end",
        s.backend, s.rank, s.size, what, why, s.options.timeout.count());
  }
  return s.broken;
}

class TorchOp final : public PendingOp {
 public:
  //! `finish` runs once the work completed (the rank-ordered sum); `keep` holds
  //! the tensors the work reads or writes until then.
  TorchOp(std::shared_ptr<Shared> s, c10::intrusive_ptr<c10d::Work> work, std::string what,
          std::vector<at::Tensor> keep, std::function<void()> finish)
      : s_(std::move(s)),
        work_(std::move(work)),
        what_(std::move(what)),
        keep_(std::move(keep)),
        finish_(std::move(finish)) {}

  Status wait() override {
    if (work_) {
      try {
        if (!work_->wait(s_->options.timeout)) return fail(*s_, what_, "Work::wait returned false");
      } catch (const std::exception& e) {
        return fail(*s_, what_, exception_text(e));
      }
    }
    if (finish_) finish_();
    keep_.clear();
    return Status::Ok();
  }
  bool done() override { return work_ == nullptr || work_->isCompleted(); }

 private:
  std::shared_ptr<Shared> s_;
  c10::intrusive_ptr<c10d::Work> work_;  // null: nothing to move (count 0)
  std::string what_;
  std::vector<at::Tensor> keep_;
  std::function<void()> finish_;
};

//! `bytes` bytes at `data` as a uint8 tensor, not owned (the caller's buffer).
at::Tensor bytes_of(const void* data, std::size_t bytes) {
  return at::from_blob(const_cast<void*>(data), {static_cast<std::int64_t>(bytes)},
                       at::TensorOptions().dtype(at::kByte));
}

class TorchCommunicator final : public comm::Communicator {
 public:
  explicit TorchCommunicator(std::shared_ptr<Shared> s)
      : Communicator(s->rank, s->size, s->options), s_(std::move(s)) {}
  std::string_view backend() const override { return "torch"; }
  void abort(std::string_view reason) override {
    STRATA_LOG_ERROR("comm torch ({}) rank {}: aborted: {}", s_->backend, rank(), reason);
    std::lock_guard lk(s_->mu);
    if (s_->broken.ok()) {
      s_->broken = unavailable("comm torch ({}) rank {} of {}: aborted: {}; the job must end", s_->backend,
                               rank(), size(), reason);
    }
  }

 protected:
  Result<std::unique_ptr<PendingOp>> start_reduce_scatter(const void* send, void* recv, std::size_t count,
                                                          DType dtype) override {
    const std::size_t bytes = count * dtype_size(dtype);
    const std::string what = fmt::format("reduce_scatter #{} of {} x {}", seq_++, count, dtype_name(dtype));
    STRATA_RETURN_IF_ERROR(check_ready());
    stats_.reduce_scatter_bytes += peer_bytes(bytes);
    if (count == 0) return make_op({}, what, {}, {});
    // Rank-ordered: slice r of every rank comes here, then the sum in rank order.
    const std::size_t w = static_cast<std::size_t>(size());
    at::Tensor in = bytes_of(send, bytes * w);
    at::Tensor out = at::empty({static_cast<std::int64_t>(bytes * w)}, at::TensorOptions().dtype(at::kByte));
    std::vector<std::int64_t> equal_splits;  // empty: W equal slices
    auto finish = [out, recv, count, dtype, bytes, w] {
      const auto* base = static_cast<const std::byte*>(out.data_ptr());
      std::vector<const void*> src(w);
      for (std::size_t r = 0; r < w; ++r) src[r] = base + r * bytes;
      comm::sum_in_rank_order(src, recv, count, dtype);
    };
    return issue(
        what, [&] { return s_->group->alltoall_base(out, in, equal_splits, equal_splits); }, {in, out},
        std::move(finish));
  }

  Result<std::unique_ptr<PendingOp>> start_all_gather(const void* send, void* recv, std::size_t count,
                                                      DType dtype) override {
    const std::size_t bytes = count * dtype_size(dtype);
    const std::string what = fmt::format("all_gather #{} of {} x {}", seq_++, count, dtype_name(dtype));
    STRATA_RETURN_IF_ERROR(check_ready());
    stats_.all_gather_bytes += peer_bytes(bytes);
    if (count == 0) return make_op({}, what, {}, {});
    // In place (send is recv's slice rank()) needs nothing special: gloo copies
    // the input before it writes the outputs.
    auto* out = static_cast<std::byte*>(recv);
    return gather(what, bytes_of(send, bytes), out, bytes, {});
  }

  Result<std::unique_ptr<PendingOp>> start_all_reduce(std::span<double> values, ReduceOp op) override {
    const std::string what = fmt::format("all_reduce ({}) #{} of {} scalars",
                                         op == ReduceOp::kSum ? "sum" : "max", seq_++, values.size());
    STRATA_RETURN_IF_ERROR(check_ready());
    stats_.all_reduce_bytes += peer_bytes(values.size_bytes());
    if (values.empty()) return make_op({}, what, {}, {});
    // Every rank's values here, then the sum (or max) in rank order.
    const std::size_t w = static_cast<std::size_t>(size());
    auto all = std::make_shared<std::vector<double>>(values.size() * w);
    auto* out = reinterpret_cast<std::byte*>(all->data());
    auto finish = [values, all, op, w] {
      for (std::size_t i = 0; i < values.size(); ++i) {
        double acc = (*all)[i];
        for (std::size_t r = 1; r < w; ++r) {
          const double v = (*all)[r * values.size() + i];
          acc = op == ReduceOp::kSum ? acc + v : std::max(acc, v);
        }
        values[i] = acc;
      }
    };
    return gather(what, bytes_of(values.data(), values.size_bytes()), out, values.size_bytes(),
                  std::move(finish));
  }

  Result<std::unique_ptr<PendingOp>> start_broadcast(void* data, std::size_t bytes, int root) override {
    const std::string what = fmt::format("broadcast #{} of {} bytes from rank {}", seq_++, bytes, root);
    STRATA_RETURN_IF_ERROR(check_ready());
    if (root < 0 || root >= size()) {
      return invalid_argument("comm torch: {}: root {} is not a rank of this group of {}", what, root,
                              size());
    }
    if (rank() == root) stats_.broadcast_bytes += peer_bytes(bytes);
    if (bytes == 0) return make_op({}, what, {}, {});
    std::vector<at::Tensor> tensors{bytes_of(data, bytes)};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    return issue(what, [&] { return s_->group->broadcast(tensors, opts); }, tensors, {});
  }

 private:
  std::uint64_t peer_bytes(std::size_t bytes) const { return bytes * static_cast<std::uint64_t>(size() - 1); }

  Status check_ready() {
    std::lock_guard lk(s_->mu);
    return s_->broken;
  }

  //! The vector form of allgather: rank r's `in` lands at out + r * bytes.
  Result<std::unique_ptr<PendingOp>> gather(const std::string& what, at::Tensor in, std::byte* out,
                                            std::size_t bytes, std::function<void()> finish) {
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < size(); ++r)
      outputs[0].push_back(bytes_of(out + static_cast<std::size_t>(r) * bytes, bytes));
    std::vector<at::Tensor> inputs{in};
    std::vector<at::Tensor> keep = outputs[0];
    keep.push_back(in);
    return issue(
        what, [&] { return s_->group->allgather(outputs, inputs); }, std::move(keep), std::move(finish));
  }

  //! Starts the work (`start` calls the group) and wraps it; c10d's exception
  //! becomes the communicator's first failure. `keep` lives until the wait.
  template <class Start>
  Result<std::unique_ptr<PendingOp>> issue(const std::string& what, Start&& start,
                                           std::vector<at::Tensor> keep, std::function<void()> finish) {
    c10::intrusive_ptr<c10d::Work> work;
    try {
      work = start();
    } catch (const std::exception& e) {
      return fail(*s_, what, exception_text(e));
    }
    return make_op(std::move(work), what, std::move(keep), std::move(finish));
  }

  Result<std::unique_ptr<PendingOp>> make_op(c10::intrusive_ptr<c10d::Work> work, std::string what,
                                             std::vector<at::Tensor> keep, std::function<void()> finish) {
    return std::unique_ptr<PendingOp>(
        std::make_unique<TorchOp>(s_, std::move(work), std::move(what), std::move(keep), std::move(finish)));
  }

  std::shared_ptr<Shared> s_;
  std::uint64_t seq_ = 0;
};

}  // namespace

Result<std::unique_ptr<comm::Communicator>> make_torch_communicator(
    c10::intrusive_ptr<c10d::ProcessGroup> group, comm::CommOptions options) {
  if (!group)
    return invalid_argument("comm torch: no process group (call torch.distributed.init_process_group)");
  if (options.timeout.count() <= 0) {
    return invalid_argument("comm torch: timeout {} ms must be > 0 (Note [Peer failure])",
                            options.timeout.count());
  }
  auto s = std::make_shared<Shared>();
  s->rank = group->getRank();
  s->size = group->getSize();
  s->backend = group->getBackendName();
  if (s->backend == "nccl") {
    return invalid_argument(
        "comm torch: the group's backend is nccl, which moves CUDA memory only, and this communicator moves "
        "host memory; give it a gloo group (torch.distributed.new_group(backend=\"gloo\")) (Note [Comm over "
        "torch.distributed])");
  }
  s->group = std::move(group);
  s->options = options;
  return std::unique_ptr<comm::Communicator>(std::make_unique<TorchCommunicator>(std::move(s)));
}

}  // namespace strata::torch_binding
