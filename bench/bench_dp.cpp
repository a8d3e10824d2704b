// strata-bench dp: data parallelism (Note [Sharded step] in
// runtime/src/dp/data_parallel.cpp). W ranks each train bench::DpModel on 1/W of
// the batch; the baseline is one rank with the whole batch (as W micro-batches),
// measured in the same run by rank 0 while the others wait. It reports whether
// the two end bit-identical, each rank's share of the optimizer states, the
// bytes each rank sent per step against the theory (2 (W - 1)/W of the param
// and gradient bytes: reduce-scatter + all-gather), the step times, and where a
// rank's step time goes.
//
// Launch: `mpiexec -n 4 build/release/bench/strata-bench dp --json` (the mpi
// backend); without a launcher it runs --ranks threads on the local backend.
// On the sim device the "GPU" is host memory and every rank shares this
// machine's cores, so W ranks do W times the work of one on the same cores: no
// speed-up is expected here, and the output says so.
#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "dp_model.hpp"
#include "registry.hpp"
#include "strata/comm/local.hpp"
#include "strata/comm/mpi.hpp"
#include "strata/common/bytes.hpp"
#include "strata/common/duration.hpp"
#include "strata/common/log.hpp"
#include "strata/memory/device_factory.hpp"
#include "strata/runtime/runtime.hpp"

namespace strata::bench {
namespace {

using runtime::Runtime;

struct DpOptions {
  std::size_t tensors = 24;              // one chunk family each
  std::uint64_t tensor_elems = 1 << 18;  // 1 MiB of fp32 each
  std::size_t samples = 8;
  int steps = 4;  // after the warm-up step
  int ranks = 4;  // without an MPI launcher: threads on the local backend
  bool json = false;
  //! How long a rank waits in a collective for its peers before the run fails.
  std::string comm_timeout = "10m";
};

//! --comm-timeout: 1 ms .. kSecondsMax.
Result<std::chrono::milliseconds> comm_timeout_of(const std::string& text) {
  STRATA_ASSIGN_OR_RETURN(double seconds, parse_seconds(text, "--comm-timeout"));
  if (seconds < 1e-3) {
    return invalid_argument("--comm-timeout = {}: use 1ms .. {:.0f}s (how long a rank waits for its peers)",
                            text, kSecondsMax);
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

//! What one run (one rank, or the single-rank baseline) measured and ended with.
struct RankRun {
  Status status;
  std::vector<double> step_s;  // steady steps: backward + step()
  double backward_s = 0, step_call_s = 0, comm_s = 0;
  double backward_comm_s = 0;    // blocked in collectives before step() (a param's gather)
  std::uint64_t bytes_comm = 0;  // steady steps, summed
  std::uint64_t bytes_d2h = 0;   // steady steps, summed
  std::uint64_t state_bytes = 0;
  std::vector<float> params, states;  // every tensor's param; its two states (zeros where not this run's)
  std::vector<std::uint64_t> state_first,
      state_count;  // per tensor: the elements whose states are this run's
};

runtime::RuntimeOptions dp_runtime_options(const DpOptions& o, int ranks) {
  runtime::RuntimeOptions r;
  r.hyper.optimizer = kernels::Optimizer::kAdamW;
  r.hyper.lr = 1e-3f;
  r.layout.chunk_elems = o.tensor_elems;
  // States on host: a device budget of a few chunk slots (the common offload case).
  r.budgets = {.gpu_bytes = 8 * o.tensor_elems * 4, .host_bytes = 64 * o.tensor_elems * 4 + 64 * kMiB};
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  r.threads = std::max<std::size_t>(1, hw / static_cast<unsigned>(ranks));
  return r;
}

//! Trains on rank `rank` of `ranks` (rank < 0: the whole batch on one rank).
RankRun train(const DpOptions& o, std::shared_ptr<comm::Communicator> c, int rank, int ranks) {
  RankRun out;
  DpModel model;
  model.numels.assign(o.tensors, o.tensor_elems);
  model.samples = o.samples;
  memory::DeviceOptions dopt;
  dopt.kind = memory::DeviceChoice::kSim;
  dopt.budget_bytes = 64 * o.tensor_elems * 4;
  auto device = memory::make_device(dopt);
  if (!device.ok()) {
    out.status = device.status();
    return out;
  }
  runtime::RuntimeOptions ro = dp_runtime_options(o, rank < 0 ? 1 : ranks);
  ro.comm = rank < 0 ? nullptr : c;
  auto made = Runtime::create(**device, std::move(ro));
  if (!made.ok()) {
    out.status = made.status();
    return out;
  }
  Runtime& rt = **made;
  auto run = [&]() -> Status {
    STRATA_RETURN_IF_ERROR(model.build(rt));
    for (int s = 0; s <= o.steps; ++s) {  // step 0: the warm-up step (traced, then planned)
      const double t0 = now_s();
      const double w0 = c != nullptr && rank >= 0 ? c->stats().wait_s : 0.0;
      double backward_s = 0;
      // The communicator's wait time at the end of backward (before step()).
      double w1 = w0;
      runtime::StepStats st;
      if (rank >= 0) {
        STRATA_RETURN_IF_ERROR(
            model.backward(rt, static_cast<std::size_t>(rank), static_cast<std::size_t>(ranks), false));
        backward_s = now_s() - t0;
        w1 = c->stats().wait_s;
        STRATA_ASSIGN_OR_RETURN(st, rt.step());
      } else {
        STRATA_ASSIGN_OR_RETURN(st, model.train_step(rt, rank, static_cast<std::size_t>(ranks), &backward_s));
      }
      const double t2 = now_s();
      if (s == 0) continue;
      out.step_s.push_back(t2 - t0);
      out.backward_s += backward_s;
      out.step_call_s += t2 - t0 - backward_s;
      out.backward_comm_s += w1 - w0;
      out.comm_s += st.comm_s - (w1 - w0);  // blocked inside step()
      out.bytes_comm += st.bytes_comm;
      out.bytes_d2h += st.bytes_d2h;
    }
    STRATA_ASSIGN_OR_RETURN(DpModel::Outcome got, model.collect(rt, 2));  // AdamW: two states
    for (std::size_t t = 0; t < model.ids.size(); ++t) {
      const std::vector<float> zeros(o.tensor_elems, 0.0f);
      const std::vector<float>& s0 = got.state_count[t] > 0 ? got.state0[t] : zeros;
      const std::vector<float>& s1 = got.state_count[t] > 0 ? got.state1[t] : zeros;
      out.state_first.push_back(got.state_first[t]);
      out.state_count.push_back(got.state_count[t]);
      out.params.insert(out.params.end(), got.params[t].begin(), got.params[t].end());
      out.states.insert(out.states.end(), s0.begin(), s0.end());
      out.states.insert(out.states.end(), s1.begin(), s1.end());
    }
    out.state_bytes = got.state_bytes;
    return Status::Ok();
  };
  out.status = run();
  made->reset();
  return out;
}

//! Waits for a collective (the bench's own: reference values, agreement).
Status collect(Result<comm::Handle> h) {
  if (!h.ok()) return h.status();
  return h->wait();
}

//! Rank 0's report: the verdict, the bytes against theory and where the time goes;
//! `agree` and `counted` are run_rank's reductions over the ranks.
nlohmann::json dp_report(const DpOptions& o, const comm::Communicator& c, const RankRun& single,
                         const RankRun& mine, const std::vector<double>& agree,
                         const std::vector<double>& counted) {
  const int w = c.size();
  const std::size_t n = o.tensors * o.tensor_elems;
  const double steps = static_cast<double>(o.steps);
  const double param_bytes = static_cast<double>(n) * 4, grad_bytes = param_bytes;
  const double theory = (w - 1.0) / w * (param_bytes + grad_bytes);
  const double comm_per_step = static_cast<double>(mine.bytes_comm) / steps;
  return {
      {"bench", "dp"},
      {"backend", std::string(c.backend())},
      {"device", "sim (host memory; every rank shares this machine's cores)"},
      {"ranks", w},
      {"model",
       {{"tensors", o.tensors},
        {"params", n},
        {"families", o.tensors},
        {"optimizer", "adamw"},
        {"states_on", "host"},
        {"samples_per_step", o.samples}}},
      {"bit_identical_to_single_rank", agree[0] == 0.0 && counted[0] == static_cast<double>(n)},
      {"state_elements_checked", counted[0]},
      {"state_bytes_per_rank_ratio", agree[1] / static_cast<double>(single.state_bytes)},
      {"comm_bytes_per_step_per_rank", comm_per_step},
      {"comm_bytes_theory", theory},
      {"comm_bytes_ratio_to_theory", w > 1 ? comm_per_step / theory : 0.0},
      {"d2h_bytes_per_step_per_rank", static_cast<double>(mine.bytes_d2h) / steps},
      {"single_rank_d2h_bytes_per_step", static_cast<double>(single.bytes_d2h) / steps},
      {"step_s", median(mine.step_s)},
      {"single_rank_step_s", median(single.step_s)},
      {"where_time_goes_rank0_per_step_s",
       {{"backward_enqueue", mine.backward_s / steps},
        {"backward_blocked_in_collectives", mine.backward_comm_s / steps},
        {"step_call", mine.step_call_s / steps},
        {"of_which_blocked_in_collectives", mine.comm_s / steps},
        {"of_which_optimizer_copies_and_compute_drain", (mine.step_call_s - mine.comm_s) / steps}}},
      {"slowest_rank_per_step_s",
       {{"blocked_in_collectives", agree[2] / steps},
        {"step_call", agree[3] / steps},
        {"backward_enqueue", agree[4] / steps}}},
      {"steps", o.steps},
      {"note",
       "bit identity: W ranks with 1/W of the batch each vs one rank with the whole batch as W micro-batches "
       "accumulated in rank order (deterministic mode). No speed-up is expected on this machine: the W ranks "
       "share its cores, so they do W times the work of one rank on the same cores; 'blocked in collectives' "
       "is mostly waiting for the slower ranks"},
      {"load_average_1m", load_average_1m()},
  };
}

//! One rank's part: rank 0 first runs the single-rank baseline alone, then every
//! rank trains its part; rank 0's reference is broadcast and every rank checks
//! its params and its own states against it. Rank 0 fills `report`.
Status run_rank(const DpOptions& o, std::shared_ptr<comm::Communicator> c, nlohmann::json* report) {
  const int w = c->size(), me = c->rank();
  RankRun single;
  double flag = 0.0;
  if (me == 0) {
    single = train(o, nullptr, -1, w);
    flag = single.status.ok() ? 0.0 : 1.0;
  }
  std::vector<double> failed{flag};  // also the barrier: the others wait here while rank 0 measures
  STRATA_RETURN_IF_ERROR(collect(c->all_reduce(failed, comm::ReduceOp::kMax)));
  if (failed[0] != 0.0) return me == 0 ? single.status : internal_error("rank 0's single-rank run failed");

  RankRun mine = train(o, c, me, w);
  STRATA_RETURN_IF_ERROR(mine.status);

  // The reference, from rank 0, and every rank's verdict.
  const std::size_t n = o.tensors * o.tensor_elems;
  std::vector<float> ref_params(n), ref_states(2 * n);
  if (me == 0) {
    ref_params = single.params;
    ref_states = single.states;
  }
  STRATA_RETURN_IF_ERROR(collect(c->broadcast(ref_params.data(), n * 4, 0)));
  STRATA_RETURN_IF_ERROR(collect(c->broadcast(ref_states.data(), 2 * n * 4, 0)));
  bool same = std::memcmp(ref_params.data(), mine.params.data(), n * 4) == 0;
  std::size_t states_checked = 0;
  for (std::size_t t = 0; t < o.tensors; ++t) {
    // This rank's part of the tensor's states (Note [Sharded step]); the rest is on other ranks.
    const std::size_t first = mine.state_first[t], count = mine.state_count[t];
    if (count == 0) continue;
    states_checked += count;
    for (const std::size_t at : {t * 2 * o.tensor_elems + first, (t * 2 + 1) * o.tensor_elems + first}) {
      same = same && std::memcmp(ref_states.data() + at, mine.states.data() + at, count * 4) == 0;
    }
  }
  std::vector<double> agree{same ? 0.0 : 1.0, static_cast<double>(mine.state_bytes), mine.comm_s,
                            mine.step_call_s, mine.backward_s};
  std::vector<double> counted{static_cast<double>(states_checked)};
  STRATA_RETURN_IF_ERROR(collect(c->all_reduce(agree, comm::ReduceOp::kMax)));
  STRATA_RETURN_IF_ERROR(collect(c->all_reduce(counted, comm::ReduceOp::kSum)));
  if (me != 0) return Status::Ok();

  *report = dp_report(o, *c, single, mine, agree, counted);
  return Status::Ok();
}

int run(const DpOptions& o) {
  if (o.tensors == 0 || o.tensor_elems == 0 || o.steps < 1 || o.ranks < 1 || o.samples == 0) {
    fmt::print(stderr,
               "strata-bench dp: --tensors, --tensor-elems, --samples, --steps and --ranks must be >= 1\n");
    return 2;
  }
  auto timeout = comm_timeout_of(o.comm_timeout);
  if (!timeout.ok()) {
    fmt::print(stderr, "strata-bench dp: {}\n", timeout.status());
    return 2;
  }
  const comm::CommOptions copt{.timeout = *timeout};
  std::vector<std::shared_ptr<comm::Communicator>> comms;
  if (comm::launched_by_mpi()) {
    auto c = comm::make_mpi_communicator(copt);
    if (!c.ok()) {
      fmt::print(stderr, "strata-bench dp: {}\n", c.status());
      return 1;
    }
    comms.push_back(std::move(c).value());
  } else {
    auto g = comm::make_local_group(o.ranks, copt);
    if (!g.ok()) {
      fmt::print(stderr, "strata-bench dp: {}\n", g.status());
      return 1;
    }
    for (auto& c : *g) comms.push_back(std::move(c));
  }
  const int w = comms[0]->size();
  if (o.samples % static_cast<std::size_t>(w) != 0) {
    fmt::print(stderr, "strata-bench dp: --samples {} is not a multiple of the {} ranks\n", o.samples, w);
    return 2;
  }
  std::vector<Status> statuses(comms.size());
  nlohmann::json report;
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < comms.size(); ++i) {
    threads.emplace_back([&, i] { statuses[i] = run_rank(o, comms[i], &report); });
  }
  for (auto& t : threads) t.join();
  for (std::size_t i = 0; i < statuses.size(); ++i) {
    if (!statuses[i].ok()) {
      fmt::print(stderr, "strata-bench dp: rank {}: {}\n", comms[i]->rank(), statuses[i]);
      comms[i]->abort("strata-bench dp failed");
      return 1;
    }
  }
  if (report.is_null()) return 0;  // not rank 0
  if (o.json) {
    fmt::print("{}\n", report.dump());
  } else {
    fmt::print("{}\n", report.dump(2));
  }
  return report["bit_identical_to_single_rank"].get<bool>() ? 0 : 1;
}

Registrar reg{
    "dp", "data parallelism: W ranks vs one rank (bit identity, state share, comm bytes, step time)",
    [](CLI::App& app) {
      auto o = std::make_shared<DpOptions>();
      app.add_option("--tensors", o->tensors, "tensors (one chunk family each)")->capture_default_str();
      app.add_option("--tensor-elems", o->tensor_elems, "elements per tensor (fp32)")->capture_default_str();
      app.add_option("--samples", o->samples, "samples per step, all ranks together")->capture_default_str();
      app.add_option("--steps", o->steps, "steady steps after the warm-up step")->capture_default_str();
      app.add_option("--ranks", o->ranks, "ranks as threads (local backend) when not under mpiexec")
          ->capture_default_str();
      app.add_flag("--json", o->json, "print one JSON object (rank 0)");
      app.add_option("--comm-timeout", o->comm_timeout,
                     "how long a rank waits in a collective for its peers (500ms, 30s, 10m; 1ms .. 24h)")
          ->capture_default_str();
      return [o] { return run(*o); };
    }};

}  // namespace
}  // namespace strata::bench
