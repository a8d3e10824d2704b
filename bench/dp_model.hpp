#pragma once
// A model for data-parallel checks: per-element linear regression on every
// tensor, so a step's gradient is a cheap, exact function of the params and the
// samples. `strata-bench dp` and tests/runtime/test_data_parallel.cpp (and its
// mpiexec twin) train it on W ranks with 1/W of the batch each and on one rank
// with the whole batch as W micro-batches accumulated in rank order, and
// compare the two bit for bit (Note [Sharded step]).
//
// Sample s of tensor t has inputs x and targets y per element (hashes of t, s,
// i); its loss is 1/2 (p x - y)^2 per element, so its gradient is (p x - y) x.
// A part's gradient is the mean over its samples.
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "strata/runtime/runtime.hpp"

namespace strata::bench {

struct DpModel {
  std::vector<std::uint64_t> numels;     //!< one tensor each
  std::size_t frozen = ~std::size_t{0};  //!< index of a frozen tensor (none by default)
  std::size_t samples = 8;               //!< the whole batch (a multiple of every W used)
  //! Where backward's leases are: kHost computes the gradients on the host thread.
  runtime::Where grad_where = runtime::Where::kDevice;
  std::vector<runtime::TensorId> ids;

  static float hash01(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
    std::uint64_t h = (a * 0x9e3779b97f4a7c15ull) ^ (b * 0xc2b2ae3d27d4eb4full) ^ (c * 0x165667b19e3779f9ull);
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    return static_cast<float>(h >> 40) / static_cast<float>(1u << 24);  // [0, 1)
  }

  //! Registers the tensors and sets the same initial values on every rank.
  Status build(runtime::Runtime& rt) {
    for (std::size_t t = 0; t < numels.size(); ++t) {
      runtime::TensorSpec spec{.name = fmt::format("t{}", t),
                               .shape = {static_cast<std::int64_t>(numels[t])},
                               .frozen = t == frozen};
      STRATA_ASSIGN_OR_RETURN(runtime::TensorId id, rt.register_tensor(std::move(spec)));
      ids.push_back(id);
    }
    for (std::size_t t = 0; t < numels.size(); ++t) {
      std::vector<float> v(numels[t]);
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = hash01(t, 999, i) - 0.5f;
      STRATA_RETURN_IF_ERROR(rt.init_tensor(ids[t], v));
    }
    return Status::Ok();
  }

  //! The gradient of part `part` of `parts` (samples [part, part+1) * samples/parts)
  //! into each trainable tensor's gradient, last tensor first (as backward goes):
  //! written, or added to what is there (accumulate).
  Status backward(runtime::Runtime& rt, std::size_t part, std::size_t parts, bool accumulate) const {
    const std::size_t per = samples / parts;
    for (std::size_t t = numels.size(); t-- > 0;) {
      if (t == frozen) continue;
      STRATA_ASSIGN_OR_RETURN(runtime::Lease p, rt.acquire(ids[t], runtime::StateKind::kParam,
                                                           runtime::Access::kRead, grad_where));
      STRATA_ASSIGN_OR_RETURN(
          runtime::Lease g,
          rt.acquire(ids[t], runtime::StateKind::kGrad,
                     accumulate ? runtime::Access::kAccumulate : runtime::Access::kWrite, grad_where));
      const float* P = p.as<float>();
      float* G = g.as<float>();
      const std::uint64_t n = numels[t];
      if (grad_where == runtime::Where::kHost) {
        STRATA_RETURN_IF_ERROR(rt.wait(p));
        STRATA_RETURN_IF_ERROR(rt.wait(g));
        gradient(P, G, t, n, part * per, per, accumulate);
        continue;
      }
      STRATA_RETURN_IF_ERROR(rt.launch([=] { gradient(P, G, t, n, part * per, per, accumulate); }));
    }
    return Status::Ok();
  }

  //! Tensor t's gradient over samples [first, first + per) into G (or added to it).
  static void gradient(const float* P, float* G, std::size_t t, std::uint64_t n, std::size_t first,
                       std::size_t per, bool accumulate) {
    for (std::uint64_t i = 0; i < n; ++i) {
      float sum = 0.0f;
      for (std::size_t s = first; s < first + per; ++s) {
        const float x = hash01(t, s, i) + 0.5f;
        const float y = hash01(t, s + 1000, i) - 0.5f;
        sum += (P[i] * x - y) * x;
      }
      const float mean = sum / static_cast<float>(per);
      G[i] = accumulate ? G[i] + mean : mean;
    }
  }

  //! What a run ends with: every tensor's param, and the optimizer states this run
  //! holds: elements [state_first, state_first + state_count) of each tensor (the
  //! whole trainable tensor on one rank, the part in a rank's shard with data
  //! parallelism: Runtime::state_range, Note [Sharded step]); the state vectors are
  //! full length, zero outside that range (empty for the frozen tensor).
  struct Outcome {
    std::vector<std::vector<float>> params, state0, state1;
    std::vector<std::uint64_t> state_first, state_count;
    std::uint64_t state_bytes = 0;
  };

  //! Reads the outcome of a run; `state_count` is the optimizer's
  //! (kernels::optimizer_state_count).
  Result<Outcome> collect(runtime::Runtime& rt, std::uint32_t state_count) const {
    Outcome out;
    for (std::size_t t = 0; t < ids.size(); ++t) {
      std::vector<float> p(numels[t]);
      STRATA_RETURN_IF_ERROR(rt.read_tensor(ids[t], runtime::StateKind::kParam, p));
      out.params.push_back(std::move(p));
      runtime::Runtime::StateRange range;
      if (t != frozen) {
        STRATA_ASSIGN_OR_RETURN(range, rt.state_range(ids[t]));
      }
      std::vector<float> s0, s1;
      if (range.count > 0) {
        s0.resize(state_count > 0 ? numels[t] : 0);
        s1.resize(state_count > 1 ? numels[t] : 0);
        if (!s0.empty()) STRATA_RETURN_IF_ERROR(rt.read_tensor(ids[t], runtime::StateKind::kState0, s0));
        if (!s1.empty()) STRATA_RETURN_IF_ERROR(rt.read_tensor(ids[t], runtime::StateKind::kState1, s1));
      }
      out.state_first.push_back(range.first);
      out.state_count.push_back(range.count);
      out.state0.push_back(std::move(s0));
      out.state1.push_back(std::move(s1));
    }
    out.state_bytes = rt.state_bytes();
    return out;
  }

  //! One step: as rank `rank` of `ranks` with its part of the batch, or with
  //! rank < 0 as one rank holding the whole batch as `ranks` micro-batches in
  //! rank order, averaged through the gradient scale (what the ranks compute).
  //! `backward_s` (optional) gets the seconds spent before step() was called.
  Result<runtime::StepStats> train_step(runtime::Runtime& rt, int rank, std::size_t ranks,
                                        double* backward_s = nullptr) const {
    const auto t0 = std::chrono::steady_clock::now();
    if (rank >= 0) {
      STRATA_RETURN_IF_ERROR(backward(rt, static_cast<std::size_t>(rank), ranks, false));
    } else {
      rt.set_grad_scale(1.0f / static_cast<float>(ranks));
      for (std::size_t part = 0; part < ranks; ++part) {
        STRATA_RETURN_IF_ERROR(rt.begin_micro_batch(part + 1 == ranks));
        STRATA_RETURN_IF_ERROR(backward(rt, part, ranks, part > 0));
      }
    }
    if (backward_s != nullptr)
      *backward_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return rt.step();
  }
};

}  // namespace strata::bench
