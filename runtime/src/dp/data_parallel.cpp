// DataParallel (data_parallel.hpp): data parallelism over a comm::Communicator;
// here start-up, the initial broadcast and the agreements. Everything here is a
// no-op for one rank.
//
// Note [Sharded step]
// W ranks each run the same model on 1/W of the batch. Every rank builds the
// same layout, padded so that every family's capacity C is a multiple of W x
// kShardAlignElems (finalize; the start-up check compares chunk_elems and W),
// and holds shard r = elements [r C/W, (r+1) C/W) of every family: its masters
// and optimizer states are allocated for that shard only (Core::shard_elems,
// shard_begin), so state bytes per rank are 1/W of one rank's, plus padding,
// whatever the family count and sizes (ZeRO stage 2 within chunks;
// DataParallelShards.EveryRankHoldsOneWthOfTheStatesWhateverTheFamilyCount).
// Params and gradients are whole chunks on every rank. The planner, budgets and
// probe count the per-rank bytes; the optimizer runs on each rank's shard of
// every family, on whatever tier the plan gave its states: spans_for cuts each
// tensor to its part in the shard (param and gradient at their chunk offsets,
// master and states at the shard's), so a tensor crossing a shard boundary is
// updated in parts by several ranks. Element-wise optimizers give the same bits
// as one rank. LAMB and LARS need per-tensor norms: each rank's phase 1
// (kernels::trust_phase1) sums ||p||² and ||u||² (LARS ||g||²) over its part of
// each tensor, exactly (Note [Exact norms] in kernels/exact_sum.hpp: fp32 sums
// of 64-element groups aligned to the chunk, which no shard boundary splits,
// added into a fixed-point integer); a per-family all-reduce (two exact sums
// per updated tensor as limbs in doubles, and an Inf/NaN flag) gives every
// rank the whole tensors' exact sums, the very sums one rank has, and phase 2
// applies the same trust ratio to every part
// (OptimizerPipeline::run_trust_exchanged). Params and states are one rank's
// bit for bit (DataParallelTrust.*, DataParallelMpiTrust.*). For the
// all-reduces to be issued in one order on every rank, step() runs the
// families one at a time in family order then (no overlap of families'
// optimizer runs; read-ahead stops).
//
// At start-up (finalize) every rank compares its model and options with rank
// 0's (check_config). At a rank's first acquire, host read or step() (the
// on_use and on_host_access events of Note [Chunk events], or step() itself), every
// param takes rank 0's value by broadcast (broadcast_initial), so ranks need
// not initialise alike (DataParallelStart.RanksTakeRankZerosInitialParams);
// with bf16/fp16 compute a rank whose values differ is refused by name, since
// its fp32 master shard came from its own values.
// init_tensor after that first use changes this rank only.
//
// Data parallelism defers every optimizer step to step() (Core::deferred). The
// gradients are reduced as backward goes:
//   1. post_complete_rounds (on every gradient hand-over, Note [Gradient
//      completion]): once a family's gradient is complete, its whole chunk is
//      packed into a send buffer (from a device slot: a host function on the
//      compute stream after the backward that wrote it, so the training thread
//      does not wait) and its reduce-scatter starts once the pack is done
//      (start_packed, checked at every hand-over, in issue order); backward
//      goes on. Rank r receives the sum over ranks of shard r, in rank order in
//      deterministic mode (Note [Deterministic reduction] in comm/). On the sim
//      device the slot is host memory the communicator reads (on CUDA the
//      mpi/local backends need it copied down first; a device-buffer
//      communicator reads the slot itself: below), and a family whose states
//      are not on the GPU drops its gradient once packed: only the shard's sum
//      lands, in host memory, at step(), so no gradient is copied d2h at all
//      (DataParallelTraffic.GradientsAreReducedFromTheDevice…: d2h per rank <= 1/W
//      of one rank's). A GPU-homed family keeps its slot; the sum of its shard
//      is written there and stays there through the prepass (the device kernel
//      reads it in place), so it is not copied down either. A complete
//      gradient not posted yet is evicted last (DpChunkFlags::Family::awaiting_reduction).
//      Order: every rank must issue collectives in the same order. Families
//      are posted in one fixed order, last family first (backward goes in
//      reverse registration order), and family f only after f + 1 (a reorder
//      window of the families completed early): the order is the same on every
//      rank whatever order its families complete in; a model whose backward is
//      not reverse-registration order only delays reductions to step().
//   2. reduce_gradients (step()): posts the families not posted yet (a
//      tensor without a gradient is refused by name), then waits for each in
//      issue order and writes the shard's sum where the gradient is (device
//      slot or host). step() only waits.
//   3. deferred_prepass: each rank's shard sums give its exact norm² (Note
//      [Exact norms]) and Inf/NaN, which agree all-reduces in one call, so
//      every rank has the exact norm² of the whole gradient, rounded as one
//      rank rounds it: clipping is one rank's bit for bit and the Inf/NaN skip
//      agrees on every rank. The 1/W averaging folds into the gradient scale.
//   4. the optimizer runs on each rank's shard of every family; every rank
//      counts each updated tensor's step;
//   5. gather_params (the end of step(), once every optimizer step ran):
//      per family, each rank's updated shard of the param chunk (read from its
//      device slot when it was updated there, on the sim device) starts one
//      all-gather, asynchronously; the params are marked awaiting_gather (the
//      other shards are stale, device copies dropped) and step() returns. The
//      next step's first use of such a family waits for its gather and writes
//      the whole chunk (finish_gather, at the on_use or on_host_access event;
//      into the device slot when that holds the only copy, on the sim device):
//      the planned prefetch (gather_ahead at on_placed, before Residency::prefetch)
//      finishes the gathers of the params it is about to load, and prefetch
//      skips a param still awaiting its gather. A rank's step() thus never
//      waits for a slower rank's update
//      (DataParallelGather.StepDoesNotWaitForAnotherRanksUpdate); step()
//      finishes gathers the last step did not use before its own. With the
//      local backend a wait completes only when every rank waits for that
//      collective, so code that waits for gathers outside a use (a save, a
//      load) finishes all of them, in issue order, on every rank.
// Bytes sent per step: (W - 1)/W of the gradient and of the param chunks, the
// theory's 2 (W - 1)/W, plus the chunk padding and a few scalars.
//
// Device-buffer communicators (Communicator::device_buffers(): nccl). The
// reduce-scatter and all-gather take device memory, so steps 1, 2 and 5 use the
// slots themselves (stage_round_on_device, land_device_round,
// land_done_rounds in reduce.cpp; stage_gather_on_device in
// gather.cpp):
//   1. a complete gradient in its device slot is not packed: an event on the
//      compute stream after the backward that wrote it is recorded, and once
//      the host sees it complete (at a hand-over, or blocking at step()) the
//      reduce-scatter is issued on the slot in place (recv = slot + this
//      shard's offset, NCCL's in-place form). The ordering goes through the
//      host, so it holds whatever stream the communicator issues on. The slot
//      is pinned meanwhile (DpChunkFlags: in_collective, not evicted); a gradient on
//      host instead goes up into a device buffer of its own (h2d) first.
//   2. once its collective is done (Handle::done at a later hand-over, or the
//      wait at step(); at most half the slots are pinned at once, past that
//      the oldest is waited for), a GPU-homed family's shard sum stays in
//      place in its slot; an off-GPU family's shard alone is copied d2h (1/W of
//      the chunk) and the slot is released. Each rank thus copies at most 1/W
//      of the gradient bytes down (DataParallelDeviceBuffersTraffic.*).
//   5. a param on the device (updated there, or a clean copy whose host value
//      took the update: only this rank's shard goes up) is all-gathered in
//      place in its slot, pinned until its first use, which makes the slot the
//      value (no whole chunk moves h2d; clean copies up to half the slots, the
//      rest go the next way); a param not on the device has its
//      shard copied up into a device buffer, gathered there, and the whole
//      chunk copied down into its host copy at the first use.
// The nccl backend is refused on the sim device (host memory) and in
// deterministic mode (no rank-ordered sum), each with what to use instead. The
// path is tested on the sim device through a local-backend wrapper that issues
// every collective as a launch_host function on a stream of the runtime's
// device (tests/runtime/test_data_parallel_device.cpp: W = 2 and 4, three tiers,
// bit-identical to one rank). With real NCCL it has been compiled only: it has
// never run on a GPU here.
//
// What this is not yet: on CUDA the mpi/local backends still need host buffers
// (the gradient is copied down first), and their all-gather fills host param
// chunks (the first use loads them h2d); the planner does not count the device
// buffers of the device-buffer path's host-resident chunks (one chunk each, in
// flight); LAMB/LARS with their families' runs overlapped. (On CUDA the
// runtime runs LAMB/LARS on the CPU kernels only, gpu_optimizer_supported in
// plan_adoption.cpp, so their exact norms hold there too; the CUDA LAMB/LARS
// kernels themselves sum in their own blocks, not exactly.)
//
// Checkpoints (Note [Sharded checkpoint] in checkpoint/format.cpp): the files are
// per family, as one rank's. At save_checkpoint the ranks all-gather each
// family's master and state shards and rank f mod W writes family f's file; rank
// 0 publishes the manifest after the ranks agree (all_ok, exchange_text,
// max below). A load reads this rank's shard of each tensor's states, so a
// checkpoint saved at W loads at any W'.
//
// With one rank holding the whole batch as W micro-batches accumulated in rank
// order, and set_grad_scale(1/W), a step is bit-identical to W ranks in
// deterministic mode, for params and states (tests/runtime/test_data_parallel.cpp).
#include "data_parallel.hpp"

#include <algorithm>
#include <cstring>
#include <optional>

#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::runtime {

namespace dp_detail {

comm::DType comm_dtype(DType d) {
  // One DType (common/dtype.hpp, #26): the collectives' dtype is the compute dtype.
  // validate_options refuses a kNone compute dtype, and so does the communicator.
  STRATA_CHECK_MSG(d != DType::kNone, "comm_dtype: DType::kNone has no collective element type");
  return d;
}

Status run_collective(std::unique_lock<std::mutex>& lock, Result<comm::Handle> started) {
  if (!started.ok()) return started.status();
  lock.unlock();
  Status st = started->wait();
  lock.lock();
  return st;
}

}  // namespace dp_detail

using namespace dp_detail;

namespace {

//! One line per setting that must agree between ranks, then one per tensor, then
//! the counts and the layout: the first differing line (first_difference) thus
//! names the first tensor that differs, with its shape on both ranks, rather than
//! a count that differs because of it.
std::string describe_config(const Core& core) {
  const RuntimeOptions& o = core.opt;
  const kernels::Hyper& h = o.hyper;
  std::string s = fmt::format(
      "ranks {}\ncompute_dtype {}\nstate_dtype {}\noptimizer {} lr {} betas {} {} eps {} weight_decay {} "
      "momentum {} nesterov {}\nclip_max_norm {}\nloss_scaling {}\n",
      core.dp_ranks(), runtime::dtype_name(o.compute_dtype), kernels::dtype_name(o.state_dtype),
      kernels::optimizer_name(h.optimizer), h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.momentum,
      h.nesterov, o.clip_max_norm, o.loss_scaling);
  for (TensorId t = 0; t < core.tensors().size(); ++t) {
    const TensorSpec& spec = core.tensors()[t].spec;
    s += fmt::format("tensor {} \"{}\" shape [{}] {}{}\n", t, spec.name, fmt::join(spec.shape, ", "),
                     runtime::dtype_name(spec.dtype), spec.frozen ? " frozen" : "");
  }
  s += fmt::format("tensors {}\nchunk_elems {}\nfamilies {}\n", core.tensors().size(),
                   core.layout().chunk_elems, core.layout().families.size());
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

}  // namespace

Status DataParallel::check_config(std::unique_lock<std::mutex>& lock) {
  flags_.reset(core_.layout().families.size());
  if (core_.opt.comm == nullptr) return Status::Ok();
  comm::Communicator& c = *core_.opt.comm;
  const std::string mine = describe_config(core_);
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
  stats_mark_ = c.stats();  // the start-up check is no step's traffic
  STRATA_LOG_INFO(
      "runtime: data parallel rank {} of {} ({} backend): shard {} of each of {} families ({} elements per "
      "chunk)",
      c.rank(), c.size(), c.backend(), c.rank(), core_.layout().families.size(), core_.layout().chunk_elems);
  return Status::Ok();
}

Status DataParallel::agree(std::unique_lock<std::mutex>& lock, bool* finite, kernels::ExactSum* norm_sq) {
  if (core_.dp_ranks() == 1) return Status::Ok();
  comm::Communicator& c = *core_.opt.comm;
  // This rank's exact norm² of its shards (Note [Exact norms]), then its
  // Inf/NaN flag: the limbs add exactly in any order, so every rank gets the
  // exact norm² of the whole gradient, which one rank rounds the same way.
  constexpr std::size_t kWire = kernels::ExactSum::kWireDoubles;
  std::vector<double> wire(kWire + 1, 0.0);
  norm_sq->to_wire(std::span<double>(wire).first(kWire));
  wire[kWire] = *finite ? 0.0 : 1.0;
  STRATA_RETURN_IF_ERROR(run_collective(lock, c.all_reduce(wire, comm::ReduceOp::kSum)));
  *finite = wire[kWire] == 0.0;
  *norm_sq = kernels::ExactSum::from_wire(std::span<const double>(wire).first(kWire));
  return Status::Ok();
}

Status DataParallel::broadcast_initial(std::unique_lock<std::mutex>& lock) {
  if (core_.dp_ranks() == 1 || initial_sent_) return Status::Ok();
  initial_sent_ = true;
  comm::Communicator& c = *core_.opt.comm;
  std::vector<std::byte> buf, mine;
  std::size_t changed = 0;
  for (FamilyId f = 0; f < core_.layout().families.size(); ++f) {
    const Chunk& p = core_.chunk(f, StateKind::kParam);
    if (p.bytes == 0) continue;
    buf.assign(p.bytes, std::byte{0});
    STRATA_RETURN_IF_ERROR(
        host_copy(lock, p, false, [&](std::byte* h) { std::memcpy(buf.data(), h, p.bytes); }));
    mine = buf;
    STRATA_RETURN_IF_ERROR(run_collective(lock, c.broadcast(buf.data(), buf.size(), 0)));
    if (buf == mine) continue;
    // A separate fp32 master shard (bf16/fp16 compute) was initialised from
    // this rank's values, which rank 0's rounded params cannot restore.
    if (core_.chunk(f, StateKind::kMaster).bytes > 0) {
      return failed_precondition(
          "data parallel: rank {} initialised family {}'s params differently from rank 0, and with {} "
          "compute "
          "its fp32 master shard was initialised from this rank's values, which rank 0's rounded params "
          "cannot restore. Initialise every rank alike (the same init_tensor values), or use fp32 compute",
          c.rank(), f, runtime::dtype_name(core_.opt.compute_dtype));
    }
    ++changed;
    STRATA_RETURN_IF_ERROR(host_copy(
        lock, p, true, [&](std::byte* h) { std::memcpy(h, buf.data(), p.bytes); }, true));
  }
  if (changed > 0) {
    STRATA_LOG_INFO("runtime: data parallel rank {}: {} families' params took rank 0's initial values",
                    c.rank(), changed);
  }
  return Status::Ok();
}

Result<std::vector<std::string>> DataParallel::exchange_text(std::unique_lock<std::mutex>& lock,
                                                             const std::string& text) {
  if (core_.dp_ranks() == 1) return std::vector<std::string>{text};
  comm::Communicator& c = *core_.opt.comm;
  const auto w = static_cast<std::size_t>(c.size());
  std::vector<double> lengths(w, 0.0);
  lengths[static_cast<std::size_t>(c.rank())] = static_cast<double>(text.size());
  STRATA_RETURN_IF_ERROR(run_collective(lock, c.all_reduce(lengths, comm::ReduceOp::kSum)));
  std::vector<std::string> all(w);
  for (std::size_t r = 0; r < w; ++r) {
    all[r] = static_cast<int>(r) == c.rank() ? text : std::string(static_cast<std::size_t>(lengths[r]), '\0');
    if (all[r].empty()) continue;
    STRATA_RETURN_IF_ERROR(
        run_collective(lock, c.broadcast(all[r].data(), all[r].size(), static_cast<int>(r))));
  }
  return all;
}

Status DataParallel::all_ok(std::unique_lock<std::mutex>& lock, Status mine, std::string_view what) {
  if (core_.dp_ranks() == 1) return mine;
  const int me = core_.dp_rank();
  STRATA_ASSIGN_OR_RETURN(std::vector<std::string> all,
                          exchange_text(lock, mine.ok() ? std::string() : mine.to_string()));
  if (!mine.ok()) {
    return Status(mine.code(), fmt::format("{} on rank {} of {} (every rank fails with it): {}", what, me,
                                           core_.dp_ranks(), mine.message()));
  }
  std::string failed;
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) failed += fmt::format("{}rank {}: {}", failed.empty() ? "" : "; ", r, all[r]);
  }
  if (failed.empty()) return Status::Ok();
  return failed_precondition("{} failed on another rank, so it fails on rank {} too: {}", what, me, failed);
}

void DataParallel::count_traffic(StepStats& stats) {
  if (core_.opt.comm == nullptr) return;
  // Since the last step ended: the reductions started during backward count.
  const comm::CommStats now = core_.opt.comm->stats();
  stats.bytes_comm = now.total_bytes() - stats_mark_.total_bytes();
  stats.comm_s = now.wait_s - stats_mark_.wait_s;
  stats_mark_ = now;
}

Result<std::int64_t> DataParallel::max(std::unique_lock<std::mutex>& lock, std::int64_t value) {
  if (core_.dp_ranks() == 1) return value;
  std::vector<double> v{static_cast<double>(value)};
  STRATA_RETURN_IF_ERROR(run_collective(lock, core_.opt.comm->all_reduce(v, comm::ReduceOp::kMax)));
  return static_cast<std::int64_t>(v[0]);
}

// Note [Sharded step]: the data-parallel flags and shard sizes.
void DataParallel::check_invariants() const {
  const auto w = static_cast<std::uint64_t>(core_.dp_ranks());
  const bool device_buffers = core_.opt.comm != nullptr && core_.opt.comm->device_buffers();
  STRATA_CHECK(flags_.size() == core_.layout().families.size());
  std::size_t gathering = 0;
  for (FamilyId f = 0; f < flags_.size(); ++f) {
    const DpChunkFlags::Family& flag = flags_[f];
    // Only a gradient awaits its reduction, only a param its gather, only with W > 1.
    if (flag.awaiting_reduction) {
      STRATA_CHECK_MSG(core_.chunk(f, StateKind::kGrad).bytes > 0 && w > 1,
                       "awaiting_reduction is set on a family without a data-parallel gradient");
    }
    if (flag.awaiting_gather) {
      STRATA_CHECK_MSG(core_.chunk(f, StateKind::kParam).bytes > 0 && w > 1,
                       "awaiting_gather is set on a family without a data-parallel param");
    }
    // Only a device-buffer communicator's collectives hold device slots.
    if (flag.grad_in_collective || flag.param_in_collective) {
      STRATA_CHECK_MSG(device_buffers && w > 1,
                       "in_collective is set without a device-buffer communicator's collective");
    }
    gathering += flag.awaiting_gather ? 1 : 0;
  }
  // A param awaits its gather exactly while that gather is in flight.
  STRATA_CHECK(gathering == gathers_.size());
  for (const Gather& g : gathers_) {
    STRATA_CHECK(flags_[g.first].awaiting_gather);
    // A host gather fills `all`; a device-buffer one fills `dev` and leaves `all` empty.
    if (g.dev != nullptr) {
      STRATA_CHECK(g.all.empty());
    } else {
      STRATA_CHECK(g.all.size() == g.slice * w);
    }
  }
  STRATA_CHECK(rounds_posted_ <= core_.layout().families.size());
  for (FamilyId f = 0; f < core_.layout().families.size(); ++f) {
    // Shards are whole 64-element groups (Note [Exact norms] in kernels/exact_sum.hpp), whole
    // 256-element scale blocks with q8 states (Note [Q8 state chunks]).
    if (w > 1) {
      STRATA_CHECK(
          core_.layout().families[f].capacity_elems % (w * shard_align_elems(core_.opt.state_dtype)) == 0);
    }
    // Masters and states hold (at least) this rank's shard.
    for (StateKind k : {StateKind::kMaster, StateKind::kState0, StateKind::kState1}) {
      const Chunk& c = core_.chunks().at(f, k);
      if (c.bytes > 0) STRATA_CHECK(c.bytes >= core_.shard_elems(f) * dtype_bytes(core_.kind_dtype(k)));
    }
  }
}

}  // namespace strata::runtime
