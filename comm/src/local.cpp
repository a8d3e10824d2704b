#include "strata/comm/local.hpp"

#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace strata::comm {
namespace {

enum class Kind : std::uint8_t { kReduceScatter, kAllGather, kAllReduce, kBroadcast };

std::string_view kind_name(Kind k) {
  switch (k) {
    case Kind::kReduceScatter:
      return "reduce_scatter";
    case Kind::kAllGather:
      return "all_gather";
    case Kind::kAllReduce:
      return "all_reduce";
    case Kind::kBroadcast:
      return "broadcast";
  }
  return "?";
}

//! What one rank brought to a collective.
struct Part {
  const void* send = nullptr;
  void* recv = nullptr;
  std::vector<double> scalars;  // all_reduce: a copy taken at issue (the buffer is reduced in place)
};

//! One collective, keyed by its sequence number (the same on every rank).
struct Op {
  Kind kind = Kind::kReduceScatter;
  std::size_t count = 0;  // elements (bytes for broadcast)
  DType dtype = DType::kF32;
  ReduceOp reduce = ReduceOp::kSum;
  int root = 0;
  std::vector<Part> parts;
  std::vector<bool> present;
  int arrived = 0, finished = 0, left = 0;
};

std::string describe(const Op& op) {
  if (op.kind == Kind::kBroadcast)
    return fmt::format("broadcast of {} bytes from rank {}", op.count, op.root);
  if (op.kind == Kind::kAllReduce) {
    return fmt::format("all_reduce ({}) of {} scalars", op.reduce == ReduceOp::kSum ? "sum" : "max",
                       op.count);
  }
  return fmt::format("{} of {} x {}", kind_name(op.kind), op.count, dtype_name(op.dtype));
}

struct Group {
  Group(int n, CommOptions o) : size(n), options(o), gone(static_cast<std::size_t>(n), false) {}
  const int size;
  const CommOptions options;
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::uint64_t, Op> ops;  // node-based: references stay valid while others insert
  std::vector<bool> gone;
  Status failed;  // the first failure; every later wait returns it

  //! Records the group's first failure and wakes every waiter. Caller holds mu.
  Status fail(Status s) {
    if (failed.ok()) failed = std::move(s);
    cv.notify_all();
    return failed;
  }
};

class LocalOp final : public PendingOp {
 public:
  LocalOp(std::shared_ptr<Group> g, std::uint64_t seq, int rank) : g_(std::move(g)), seq_(seq), rank_(rank) {}
  Status wait() override;

 private:
  void compute(const Op& op);
  std::shared_ptr<Group> g_;
  std::uint64_t seq_;
  int rank_;
};

Status LocalOp::wait() {
  Group& g = *g_;
  std::unique_lock lk(g.mu);
  const auto deadline = std::chrono::steady_clock::now() + g.options.timeout;
  Op& op = g.ops.at(seq_);
  auto where = [&] {
    return fmt::format("comm local rank {} of {}: {} #{}", rank_, g.size, describe(op), seq_);
  };
  // Phase 1: every rank has brought its buffers.
  while (op.arrived < g.size && g.failed.ok()) {
    std::string missing;
    bool left = false;
    for (int r = 0; r < g.size; ++r) {
      if (op.present[static_cast<std::size_t>(r)]) continue;
      missing += fmt::format("{}{}", missing.empty() ? "" : ", ", r);
      left = left || g.gone[static_cast<std::size_t>(r)];
    }
    if (left) {
      return g.fail(
          unavailable("{}: rank(s) {} left the group (communicator destroyed: the rank ended or "
                      "failed) before joining it",
                      where(), missing));
    }
    if (g.cv.wait_until(lk, deadline) == std::cv_status::timeout && op.arrived < g.size) {
      return g.fail(
          unavailable("{}: rank(s) {} did not join it within {} ms (died, hung, or issued a "
                      "different sequence of collectives); the group is now failed",
                      where(), missing, g.options.timeout.count()));
    }
  }
  if (!g.failed.ok()) return g.failed;
  // Every input is fixed until all ranks finished: compute without the lock.
  lk.unlock();
  compute(op);
  lk.lock();
  ++op.finished;
  g.cv.notify_all();
  // Phase 2: no rank reuses its input while another still reads it.
  while (op.finished < g.size && g.failed.ok()) {
    if (g.cv.wait_until(lk, deadline) == std::cv_status::timeout && op.finished < g.size) {
      return g.fail(unavailable("{}: a rank joined it but did not finish within {} ms (hung in wait?)",
                                where(), g.options.timeout.count()));
    }
  }
  if (!g.failed.ok()) return g.failed;
  if (++op.left == g.size) g.ops.erase(seq_);
  return Status::Ok();
}

void LocalOp::compute(const Op& op) {
  const Part& mine = op.parts[static_cast<std::size_t>(rank_)];
  const auto w = static_cast<std::size_t>(g_->size);
  const std::size_t es =
      op.kind == Kind::kBroadcast || op.kind == Kind::kAllReduce ? 1 : dtype_size(op.dtype);
  const std::size_t bytes = op.count * es;
  switch (op.kind) {
    case Kind::kReduceScatter: {
      std::vector<const void*> src(w);
      for (std::size_t r = 0; r < w; ++r) {
        src[r] = static_cast<const std::byte*>(op.parts[r].send) + bytes * static_cast<std::size_t>(rank_);
      }
      if (mine.recv == src[static_cast<std::size_t>(rank_)] && rank_ != 0) {
        // In place: the sum starts from rank 0's slice, so this rank's own is
        // read before it is overwritten (no other rank reads this slice).
        std::vector<std::byte> sum(bytes);
        sum_in_rank_order(src, sum.data(), op.count, op.dtype);
        if (bytes > 0) std::memcpy(mine.recv, sum.data(), bytes);
        return;
      }
      sum_in_rank_order(src, mine.recv, op.count, op.dtype);
      return;
    }
    case Kind::kAllGather:
      for (std::size_t r = 0; r < w; ++r) {
        auto* dst = static_cast<std::byte*>(mine.recv) + bytes * r;
        if (dst != op.parts[r].send && bytes > 0) std::memcpy(dst, op.parts[r].send, bytes);
      }
      return;
    case Kind::kAllReduce: {
      auto* out = static_cast<double*>(mine.recv);
      for (std::size_t i = 0; i < op.count; ++i) {
        double acc = op.parts[0].scalars[i];
        for (std::size_t r = 1; r < w; ++r) {
          const double v = op.parts[r].scalars[i];
          acc = op.reduce == ReduceOp::kSum ? acc + v : (v > acc || v != v ? v : acc);
        }
        out[i] = acc;
      }
      return;
    }
    case Kind::kBroadcast:
      if (rank_ != op.root && bytes > 0) {
        std::memcpy(mine.recv, op.parts[static_cast<std::size_t>(op.root)].send, bytes);
      }
      return;
  }
}

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<Group> g, int rank)
      : Communicator(rank, g->size, g->options), g_(std::move(g)) {}
  ~LocalCommunicator() override {
    std::lock_guard lk(g_->mu);
    g_->gone[static_cast<std::size_t>(rank())] = true;
    g_->cv.notify_all();
  }
  std::string_view backend() const override { return "local"; }
  void abort(std::string_view reason) override {
    std::lock_guard lk(g_->mu);
    g_->fail(unavailable("comm local: rank {} aborted the group: {}", rank(), reason)).ignore();
  }

 protected:
  Result<std::unique_ptr<PendingOp>> start_reduce_scatter(const void* send, void* recv, std::size_t count,
                                                          DType dtype) override {
    stats_.reduce_scatter_bytes += peer_bytes(count * dtype_size(dtype));
    return join({.kind = Kind::kReduceScatter, .count = count, .dtype = dtype}, {.send = send, .recv = recv});
  }
  Result<std::unique_ptr<PendingOp>> start_all_gather(const void* send, void* recv, std::size_t count,
                                                      DType dtype) override {
    stats_.all_gather_bytes += peer_bytes(count * dtype_size(dtype));
    return join({.kind = Kind::kAllGather, .count = count, .dtype = dtype}, {.send = send, .recv = recv});
  }
  Result<std::unique_ptr<PendingOp>> start_all_reduce(std::span<double> values, ReduceOp op) override {
    stats_.all_reduce_bytes += peer_bytes(values.size_bytes());
    return join({.kind = Kind::kAllReduce, .count = values.size(), .reduce = op},
                {.recv = values.data(), .scalars = std::vector<double>(values.begin(), values.end())});
  }
  Result<std::unique_ptr<PendingOp>> start_broadcast(void* data, std::size_t bytes, int root) override {
    if (rank() == root) stats_.broadcast_bytes += peer_bytes(bytes);
    return join({.kind = Kind::kBroadcast, .count = bytes, .root = root}, {.send = data, .recv = data});
  }

 private:
  //! Bytes this rank's slice of `bytes` sends to the other ranks.
  std::uint64_t peer_bytes(std::size_t bytes) const { return bytes * static_cast<std::uint64_t>(size() - 1); }

  Result<std::unique_ptr<PendingOp>> join(Op shape, Part part) {
    Group& g = *g_;
    std::lock_guard lk(g.mu);
    if (!g.failed.ok()) return g.failed;
    const std::uint64_t seq = next_seq_++;
    auto [it, fresh] = g.ops.try_emplace(seq);
    Op& op = it->second;
    if (fresh) {
      shape.parts.resize(static_cast<std::size_t>(g.size));
      shape.present.assign(static_cast<std::size_t>(g.size), false);
      op = std::move(shape);
    } else if (op.kind != shape.kind || op.count != shape.count || op.dtype != shape.dtype ||
               op.root != shape.root || op.reduce != shape.reduce) {
      return g.fail(
          invalid_argument("comm local: collective #{} differs between ranks: rank {} issued {}, another "
                           "rank {}; every rank must "
                           "issue the same collectives in the same order",
                           seq, rank(), describe(shape), describe(op)));
    }
    op.parts[static_cast<std::size_t>(rank())] = std::move(part);
    op.present[static_cast<std::size_t>(rank())] = true;
    ++op.arrived;
    g.cv.notify_all();
    return std::unique_ptr<PendingOp>(std::make_unique<LocalOp>(g_, seq, rank()));
  }

  std::shared_ptr<Group> g_;
  std::uint64_t next_seq_ = 0;
};

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> make_local_group(int size, CommOptions options) {
  if (size < 1 || size > 4096) return invalid_argument("comm local: group size {} is not in [1, 4096]", size);
  if (options.timeout.count() <= 0) {
    return invalid_argument("comm local: timeout {} ms must be > 0 (Note [Peer failure])",
                            options.timeout.count());
  }
  auto g = std::make_shared<Group>(size, options);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<LocalCommunicator>(g, r));
  return out;
}

}  // namespace strata::comm
