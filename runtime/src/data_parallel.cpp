// Runtime::Impl: data parallelism over a comm::Communicator (the dp_* members of
// runtime_impl.hpp). Everything here is a no-op for one rank.
//
// Note [Sharded step]
// W ranks each run the same model on 1/W of the batch. They build the same
// layout; family f belongs to rank f % W, so the families form rounds of W
// (round k: families kW .. kW + W - 1; the last round is padded with empty
// slots: "the layout padded to a multiple of W"). A rank allocates masters and
// optimizer states only for its own families (finalize gives the others no
// master/state chunks), so the planner, the budgets and the probe count per-rank
// bytes, and its optimizer runs only on its families, on whatever tier the plan
// gave their states. Sharding is at family granularity, not inside a chunk
// (ZeRO stage 2 over chunk families): a whole tensor's update happens on one
// rank, so LAMB/LARS trust ratios need no extra reduction; the price is balance
// when the family count is not a multiple of W, and oversized families.
//
// Data parallelism defers every optimizer step to step() (Core::deferred), where
//   1. dp_reduce_gradients: per round, the W gradient chunks (each brought to
//      host memory, padded to the round's largest) are one reduce-scatter; the
//      owner's slice is the sum over ranks, in rank order in deterministic mode
//      (Note [Deterministic reduction] in comm/), written back into its grad
//      chunk (and its device copy); the other families' gradients are dropped.
//   2. deferred_prepass: the owners' gradients give local norm² and Inf/NaN,
//      which dp_agree all-reduces (sum, max), so clipping and the Inf/NaN skip
//      agree on every rank. The 1/W averaging folds into the gradient scale.
//   3. the optimizer runs on each rank's own families (as without comm);
//   4. dp_gather_params: per round, the owners' updated param chunks are one
//      all-gather; every rank writes the others' into its param chunks, which
//      the next forward loads as any updated param (the plan's prefetch).
// Bytes sent per step: (W - 1)/W of the gradient and of the param chunks, the
// theory's 2 (W - 1)/W, plus the round padding and a few scalars.
//
// What this is not yet: the reduce-scatter runs at step(), after the gradients
// reached host memory, not as each gradient chunk completes on the GPU (so it
// does not cut PCIe traffic by W), and it moves host buffers, so the nccl
// backend is refused here (options.cpp). Rounds go one after the other.
//
// With one rank holding the whole batch as W micro-batches accumulated in rank
// order, and set_grad_scale(1/W), a step is bit-identical to W ranks in
// deterministic mode, for params and states (tests/runtime/test_data_parallel.cpp),
// except with clipping: the norm² is then summed per rank first, a different
// order (agreeing across ranks, close to but not bit-equal with one rank).
#include <cstring>

#include "runtime_impl.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {
namespace {

comm::DType comm_dtype(DType d) {
  switch (d) {
    case DType::kBF16:
      return comm::DType::kBF16;
    case DType::kF16:
      return comm::DType::kF16;
    default:
      return comm::DType::kF32;
  }
}

//! One line per setting that must agree between ranks, then one per tensor.
std::string describe_config(const Core& core) {
  const RuntimeOptions& o = core.opt;
  const kernels::Hyper& h = o.hyper;
  std::string s = fmt::format(
      "ranks {}\ncompute_dtype {}\nstate_dtype {}\noptimizer {} lr {} betas {} {} eps {} weight_decay {} "
      "momentum {} nesterov {}\nclip_max_norm {}\nloss_scaling {}\nchunk_elems {}\nfamilies {}\ntensors {}\n",
      core.dp_ranks(), runtime::dtype_name(o.compute_dtype), kernels::dtype_name(o.state_dtype),
      kernels::optimizer_name(h.optimizer), h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.momentum,
      h.nesterov, o.clip_max_norm, o.loss_scaling, core.layout.chunk_elems, core.layout.families.size(),
      core.tensors.size());
  for (TensorId t = 0; t < core.tensors.size(); ++t) {
    const TensorSpec& spec = core.tensors[t].spec;
    s += fmt::format("tensor {} \"{}\" shape [{}] {}{}\n", t, spec.name, fmt::join(spec.shape, ", "),
                     runtime::dtype_name(spec.dtype), spec.frozen ? " frozen" : "");
  }
  return s;
}

std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

//! The first line where `a` and `b` differ, as "`a line`" vs "`b line`".
std::pair<std::string, std::string> first_difference(std::string_view a, std::string_view b) {
  while (!a.empty() || !b.empty()) {
    const std::size_t ea = a.find('\n'), eb = b.find('\n');
    const std::string_view la = a.substr(0, ea), lb = b.substr(0, eb);
    if (la != lb) return {std::string(la), std::string(lb)};
    a = ea == std::string_view::npos ? std::string_view{} : a.substr(ea + 1);
    b = eb == std::string_view::npos ? std::string_view{} : b.substr(eb + 1);
  }
  return {};
}

//! The rounds of Note [Sharded step]: W families each, the last one padded.
struct Rounds {
  explicit Rounds(const Core& core)
      : w(static_cast<FamilyId>(core.dp_ranks())),
        me(static_cast<FamilyId>(core.dp_rank())),
        families(core.layout.families.size()),
        elem_bytes(dtype_bytes(core.opt.compute_dtype)),
        dtype(comm_dtype(core.opt.compute_dtype)) {}
  //! One past the last family of the round starting at `first`.
  FamilyId end(FamilyId first) const { return std::min(first + w, families); }
  //! The round's slice: its largest `kind` chunk among the families `use` takes
  //! (0: nothing to move). The same on every rank, as the layout is.
  template <typename Use>
  std::uint64_t slice(Core& core, FamilyId first, StateKind kind, Use use) const {
    std::uint64_t bytes = 0;
    for (FamilyId f = first; f < end(first); ++f) {
      if (use(f)) bytes = std::max(bytes, core.chunk(f, kind).bytes);
    }
    return bytes;
  }
  FamilyId w, me, families;
  std::uint64_t elem_bytes;
  comm::DType dtype;
};

//! Starts a collective and waits for it without the runtime's lock (the other
//! ranks may take a while; nothing here touches the runtime's state meanwhile).
Status run_collective(std::unique_lock<std::mutex>& lock, Result<comm::Handle> started) {
  if (!started.ok()) return started.status();
  lock.unlock();
  Status st = started->wait();
  lock.lock();
  return st;
}

}  // namespace

Status Runtime::Impl::dp_check_config(std::unique_lock<std::mutex>& lock) {
  if (core.opt.comm == nullptr) return Status::Ok();
  comm::Communicator& c = *core.opt.comm;
  const std::string mine = describe_config(core);
  // Rank 0's hash and length, then its text (to name a difference).
  std::uint64_t head[2] = {fnv1a(mine), mine.size()};
  STRATA_RETURN_IF_ERROR(run_collective(lock, c.broadcast(head, sizeof(head), 0)));
  std::string theirs(head[1], '\0');
  if (c.rank() == 0) theirs = mine;
  STRATA_RETURN_IF_ERROR(run_collective(lock, c.broadcast(theirs.data(), theirs.size(), 0)));
  const bool differs = head[0] != fnv1a(mine) || theirs != mine;
  std::vector<double> flags(static_cast<std::size_t>(c.size()), 0.0);
  flags[static_cast<std::size_t>(c.rank())] = differs ? 1.0 : 0.0;
  STRATA_RETURN_IF_ERROR(run_collective(lock, c.all_reduce(flags, comm::ReduceOp::kMax)));
  if (differs) {
    auto [here, there] = first_difference(mine, theirs);
    return failed_precondition(
        "data parallel: rank {}'s model or options differ from rank 0's: here `{}`, on rank 0 `{}`; every "
        "rank must register the same tensors with the same options",
        c.rank(), here, there);
  }
  std::string others;
  for (std::size_t r = 0; r < flags.size(); ++r) {
    if (flags[r] != 0.0) others += fmt::format("{}{}", others.empty() ? "" : ", ", r);
  }
  if (!others.empty()) {
    return failed_precondition(
        "data parallel: rank(s) {} have a model or options that differ from rank 0's (their error names the "
        "difference); every rank must register the same tensors with the same options",
        others);
  }
  STRATA_LOG_INFO("runtime: data parallel rank {} of {} ({} backend): {} of {} families are this rank's",
                  c.rank(), c.size(), c.backend(),
                  (core.layout.families.size() + static_cast<std::size_t>(c.size() - c.rank() - 1)) /
                      static_cast<std::size_t>(c.size()),
                  core.layout.families.size());
  return Status::Ok();
}

Status Runtime::Impl::dp_reduce_gradients(std::unique_lock<std::mutex>& lock) {
  if (core.dp_ranks() == 1) return Status::Ok();
  comm::Communicator& c = *core.opt.comm;
  const Rounds rounds(core);
  std::vector<std::byte> send, recv;
  for (FamilyId first = 0; first < rounds.families; first += rounds.w) {
    const std::uint64_t slice = rounds.slice(core, first, StateKind::kGrad, [](FamilyId) { return true; });
    if (slice == 0) continue;
    send.assign(slice * rounds.w, std::byte{0});
    recv.resize(slice);
    for (FamilyId f = first; f < rounds.end(first); ++f) {
      Chunk& g = core.chunk(f, StateKind::kGrad);
      if (g.bytes == 0) continue;
      for (TensorId t : core.layout.families[f].tensors) {
        const TensorInfo& info = core.tensors[t];
        if (!info.spec.frozen && !info.grad_written) {
          return failed_precondition(
              "data parallel: tensor \"{}\" got no gradient this step on rank {}; every rank must hand over "
              "every trainable tensor's gradient each step (write zeros for an unused one), or the others "
              "would wait for it",
              info.spec.name, c.rank());
        }
      }
      STRATA_RETURN_IF_ERROR(residency.ensure_on_host(g));
      std::memcpy(send.data() + (f - first) * slice, g.host, g.bytes);
    }
    STRATA_RETURN_IF_ERROR(run_collective(
        lock, c.reduce_scatter(send.data(), recv.data(), slice / rounds.elem_bytes, rounds.dtype)));
    for (FamilyId f = first; f < rounds.end(first); ++f) {
      Chunk& g = core.chunk(f, StateKind::kGrad);
      if (g.bytes == 0) continue;
      if (f - first == rounds.me) {
        // The sum over ranks replaces this rank's gradient, on host and on the device.
        STRATA_RETURN_IF_ERROR(residency.wait_host_reads(g));
        std::memcpy(g.host, recv.data(), g.bytes);
        if (g.device_copy) {
          STRATA_RETURN_IF_ERROR(residency.load_to_slot(g, residency.slot_of(g)));
          STRATA_RETURN_IF_ERROR(core.device.synchronize(core.h2d));
        }
        continue;
      }
      // Another rank's family: its gradient went there; nothing to update here.
      if (g.host != nullptr) {
        STRATA_RETURN_IF_ERROR(residency.wait_host_reads(g));
        core.host->free(g.host, g.bytes);
      }
      g.host = nullptr;
      g.move_value(ChunkValue::kAbsent);
      residency.drop_device_copy(g);
      for (TensorId t : core.layout.families[f].tensors) core.tensors[t].grad_written = false;
    }
  }
  return Status::Ok();
}

Status Runtime::Impl::dp_agree(std::unique_lock<std::mutex>& lock, bool* finite, double* sum_squares) {
  if (core.dp_ranks() == 1) return Status::Ok();
  comm::Communicator& c = *core.opt.comm;
  std::vector<double> bad{*finite ? 0.0 : 1.0};
  STRATA_RETURN_IF_ERROR(run_collective(lock, c.all_reduce(bad, comm::ReduceOp::kMax)));
  *finite = bad[0] == 0.0;
  std::vector<double> norm{*sum_squares};
  STRATA_RETURN_IF_ERROR(run_collective(lock, c.all_reduce(norm, comm::ReduceOp::kSum)));
  *sum_squares = norm[0];
  return Status::Ok();
}

Status Runtime::Impl::dp_gather_params(std::unique_lock<std::mutex>& lock) {
  if (core.dp_ranks() == 1) return Status::Ok();
  comm::Communicator& c = *core.opt.comm;
  const Rounds rounds(core);
  // Only families with trainable tensors change (those with a gradient chunk).
  auto trainable = [&](FamilyId f) { return core.chunk(f, StateKind::kGrad).bytes > 0; };
  std::vector<std::byte> all;
  for (FamilyId first = 0; first < rounds.families; first += rounds.w) {
    const std::uint64_t slice = rounds.slice(core, first, StateKind::kParam, trainable);
    if (slice == 0) continue;
    all.assign(slice * rounds.w, std::byte{0});
    std::byte* mine = all.data() + rounds.me * slice;
    const FamilyId own = first + rounds.me;
    if (own < rounds.families && trainable(own)) {
      Chunk& p = core.chunk(own, StateKind::kParam);
      STRATA_RETURN_IF_ERROR(
          with_host_copy(lock, p, false, [&](std::byte* h) { std::memcpy(mine, h, p.bytes); }));
    }
    STRATA_RETURN_IF_ERROR(
        run_collective(lock, c.all_gather(mine, all.data(), slice / rounds.elem_bytes, rounds.dtype)));
    for (FamilyId f = first; f < rounds.end(first); ++f) {
      if (f == own || !trainable(f)) continue;
      Chunk& p = core.chunk(f, StateKind::kParam);
      const std::byte* theirs = all.data() + (f - first) * slice;
      STRATA_RETURN_IF_ERROR(
          with_host_copy(lock, p, true, [&](std::byte* h) { std::memcpy(h, theirs, p.bytes); }));
    }
  }
  return Status::Ok();
}

}  // namespace strata::runtime
