// The CPU backend of step(), grad_stats() and the LAMB/LARS phases: the fixed
// piece split of Note [Deterministic threading] over the thread pool, with the
// ISA's piece function (cpu/isa.cpp) doing the work.
#include <algorithm>
#include <vector>

#include "cpu/table.hpp"
#include "orchestrate.hpp"
#include "strata/common/thread_pool.hpp"

namespace strata::kernels {
namespace {

struct Piece {
  std::size_t span;
  std::size_t begin;
  std::size_t end;
};

detail::PassOutcome run_pieces(cpu::PieceFn fn, Pass pass, const Hyper& h, std::span<const Span> spans,
                               const PassArgs& base, std::span<const float> trust, ThreadPool* pool) {
  // The calling thread's scratch, reused (a pass never runs inside another on
  // one thread): no allocation once it has seen as many pieces.
  thread_local std::vector<Piece> t_pieces;
  thread_local std::vector<cpu::PieceResult> t_results;
  std::vector<Piece>& pieces = t_pieces;
  pieces.clear();
  // Pieces end on group boundaries of the chunk (Span::group_phase): a piece
  // never splits a group of an exact norm (Note [Exact norms]).
  for (std::size_t si = 0; si < spans.size(); ++si) {
    const std::size_t phase = spans[si].group_phase;
    for (std::size_t b = 0; b < spans[si].n;) {
      const std::size_t e = std::min(spans[si].n, ((b + phase) / kPieceElems + 1) * kPieceElems - phase);
      pieces.push_back({si, b, e});
      b = e;
    }
  }
  std::vector<cpu::PieceResult>& results = t_results;
  results.assign(pieces.size(), cpu::PieceResult{});
  struct Context {
    cpu::PieceFn fn;
    Pass pass;
    const Hyper& h;
    std::span<const Span> spans;
    const PassArgs& base;
    std::span<const float> trust;
    std::vector<Piece>& pieces;
    std::vector<cpu::PieceResult>& results;
  } ctx{fn, pass, h, spans, base, trust, pieces, results};
  // One pointer captured: std::function keeps it in place.
  auto body = [c = &ctx](std::size_t /*part*/, std::size_t begin, std::size_t end) {
    for (std::size_t k = begin; k < end; ++k) {
      const Piece& pc = c->pieces[k];
      PassArgs pa = c->base;
      if (!c->trust.empty()) pa.trust = c->trust[pc.span];
      c->results[k] = c->fn(c->pass, c->h, c->spans[pc.span], pc.begin, pc.end, pa);
    }
  };
  if (pool == nullptr || pieces.size() < 2) {
    body(0, 0, pieces.size());
  } else {
    pool->parallel_for(pieces.size(), 0, body);
  }
  detail::PassOutcome out;
  out.per_span = detail::per_span_scratch(spans.size());
  const bool exact = cpu::sums_exactly(pass);
  for (std::size_t k = 0; k < pieces.size(); ++k) {  // fixed order: span, then offset
    TrustPartial& t = out.per_span[pieces[k].span];
    if (exact) {
      t.param_exact.add(results[k].ea);
      t.other_exact.add(results[k].eb);
    } else {
      t.param_sq += results[k].a;
      t.other_sq += results[k].b;
    }
    out.nonfinite = out.nonfinite || results[k].nonfinite;
  }
  if (exact) {
    for (TrustPartial& t : out.per_span) {
      t.param_sq = t.param_exact.to_double();
      t.other_sq = t.other_exact.to_double();
      t.exact = true;
    }
  }
  return out;
}

//! The CPU PassRunner for an Isa (checked against CPUID) and a pool.
Result<detail::PassRunner> cpu_runner(std::optional<Isa> isa, ThreadPool* pool) {
  const Isa chosen = isa.value_or(default_isa());
  if (!isa_supported(chosen)) {
    return unavailable("kernel ISA {} was forced but this CPU lacks it; use scalar or leave the ISA unset",
                       isa_name(chosen));
  }
  cpu::PieceFn fn = cpu::piece_fn(chosen);
  return detail::PassRunner([fn, pool](Pass pass, const Hyper& h, std::span<const Span> spans,
                                       const PassArgs& pa,
                                       std::span<const float> trust) -> Result<detail::PassOutcome> {
    return run_pieces(fn, pass, h, spans, pa, trust, pool);
  });
}

}  // namespace

Result<GradStats> grad_stats_per_span(std::span<const Span> spans, float grad_scale, std::span<double> out,
                                      ThreadPool* pool, std::optional<Isa> isa) {
  STRATA_ASSIGN_OR_RETURN(detail::PassRunner run, cpu_runner(isa, pool));
  return detail::run_grad_stats(run, spans, grad_scale, out);
}

Result<GradStats> grad_stats(std::span<const Span> spans, float grad_scale, ThreadPool* pool,
                             std::optional<Isa> isa) {
  std::vector<double> per_span(spans.size());
  return grad_stats_per_span(spans, grad_scale, per_span, pool, isa);
}

Result<StepReport> trust_phase1(const StepArgs& a, std::span<TrustPartial> partials) {
  STRATA_ASSIGN_OR_RETURN(detail::PassRunner run, cpu_runner(a.isa, a.pool));
  return detail::run_trust_phase1(run, a, partials);
}

Status trust_phase2(const StepArgs& a, std::span<const float> trust_per_span) {
  STRATA_ASSIGN_OR_RETURN(detail::PassRunner run, cpu_runner(a.isa, a.pool));
  return detail::run_trust_phase2(run, a, trust_per_span);
}

Result<StepReport> step(const StepArgs& a) {
  STRATA_ASSIGN_OR_RETURN(detail::PassRunner run, cpu_runner(a.isa, a.pool));
  return detail::run_step(run, a);
}

}  // namespace strata::kernels
