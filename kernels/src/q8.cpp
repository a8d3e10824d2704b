// 8-bit Adam states: the maps (Note [Dynamic quantization maps] in q8.hpp),
// checks and the piece split of step_q8 over the thread pool.
#include "strata/kernels/q8.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/table.hpp"
#include "strata/common/thread_pool.hpp"

namespace strata::kernels {
namespace {

//! bitsandbytes' create_dynamic_map(signed, 7, 8), in double rounded once.
std::array<float, 256> make_dynamic_map(bool is_signed) {
  constexpr int kExponentBits = 7;
  std::vector<double> data;
  for (int i = 0; i < kExponentBits; ++i) {
    const int items = is_signed ? (1 << i) + 1 : (1 << (i + 1)) + 1;  // linspace points
    const double scale = std::pow(10.0, -(kExponentBits - 1) + i);
    for (int k = 0; k + 1 < items; ++k) {
      const double lo = 0.1 + 0.9 * k / (items - 1);
      const double hi = 0.1 + 0.9 * (k + 1) / (items - 1);
      const double mean = (lo + hi) / 2.0;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-scale * mean);
    }
  }
  data.push_back(0.0);
  data.push_back(1.0);
  STRATA_CHECK(data.size() == 256);
  std::array<float, 256> map{};
  for (std::size_t k = 0; k < 256; ++k) map[k] = static_cast<float>(data[k]);
  std::sort(map.begin(), map.end());
  return map;
}

std::uint8_t code_of_zero(const std::array<float, 256>& map) {
  const auto at = std::find(map.begin(), map.end(), 0.0f);
  STRATA_CHECK(at != map.end());
  return static_cast<std::uint8_t>(at - map.begin());
}

//! #{k < 255 : t[k] < x}.
std::uint32_t count_below(const float* t, float x) {
  std::uint32_t c = 0;
  for (std::size_t k = 0; k < 255; ++k) c += t[k] < x ? 1 : 0;
  return c;
}

//! Note [Q8 nearest-code search]: thresholds and each bucket's entry (lo and key).
void make_search(const std::array<float, 256>& map, cpu::Q8Search& s) {
  for (std::size_t k = 0; k < 255; ++k) s.thresholds[k] = (map[k] + map[k + 1]) / 2.0f;
  constexpr std::uint32_t kInfBits = 0x7f800000u;
  s.extra = 0;
  for (std::uint32_t m = 0; m < cpu::kQ8Buckets; ++m) {
    // |x| bits of the bucket's ends: the first takes everything below 2^-24, the last everything above 2.
    const std::uint32_t a_lo = m == 0 ? 0u : cpu::kQ8MagLo + (m << cpu::kQ8BucketShift);
    const std::uint32_t a_hi =
        m + 1 == cpu::kQ8Buckets ? kInfBits : cpu::kQ8MagLo + ((m + 1) << cpu::kQ8BucketShift) - 1;
    for (const bool neg : {false, true}) {
      const float lo_x = neg ? -bits_float(a_hi) : bits_float(a_lo);
      const float hi_x = neg ? -bits_float(a_lo) : bits_float(a_hi);
      const std::uint32_t b = cpu::q8_bucket(float_bits(lo_x));
      STRATA_CHECK(b == cpu::q8_bucket(float_bits(hi_x)));
      const std::uint32_t lo = count_below(s.thresholds, lo_x), hi = count_below(s.thresholds, hi_x);
      s.extra = std::max(s.extra, hi - lo);
      std::uint32_t key = cpu::kQ8KeyMask;  // no threshold inside: never below a key(x)
      if (hi > lo) {
        // t = thresholds[lo] lies in (lo_x, hi_x): in this bucket, so t < x iff key(t) < key(x).
        const std::uint32_t t = float_bits(s.thresholds[lo]);
        STRATA_CHECK(cpu::q8_bucket(t) == b);
        key = cpu::q8_key(t);
      }
      s.entry[b] = lo << 16 | key;
    }
  }
  STRATA_CHECK(s.extra <= 1);  // one threshold per bucket at most: Note [Q8 nearest-code search]
}

cpu::Q8Tables make_tables() {
  cpu::Q8Tables t{};
  const std::array<float, 256>& s = q8_signed_map();
  const std::array<float, 256>& u = q8_unsigned_map();
  for (std::size_t k = 0; k < 256; ++k) {
    t.signed_map[k] = s[k];
    t.unsigned_map[k] = u[k];
  }
  make_search(s, t.signed_search);
  make_search(u, t.unsigned_search);
  t.signed_zero = code_of_zero(s);
  t.unsigned_zero = code_of_zero(u);
  return t;
}

//! Runs the gradient check the caller asked for; true when all are finite.
Result<bool> q8_grads_finite(const Q8StepArgs& a) {
  if (a.check == GradCheck::kCallerChecked) return a.checked->finite;
  thread_local std::vector<Span> t_spans;  // reused: no allocation once warm
  t_spans.clear();
  for (const Q8Span& s : a.spans) {
    Span g;
    g.grad = s.grad;
    g.grad_dtype = s.grad_dtype;
    g.n = s.n;
    t_spans.push_back(g);
  }
  STRATA_ASSIGN_OR_RETURN(GradStats stats, grad_stats(t_spans, a.grad_scale, a.pool, a.isa));
  return stats.finite;
}

struct Q8Piece {
  std::size_t span;
  std::size_t begin;
  std::size_t end;
};

}  // namespace

const std::array<float, 256>& q8_signed_map() {
  static const std::array<float, 256> map = make_dynamic_map(true);
  return map;
}

const std::array<float, 256>& q8_unsigned_map() {
  static const std::array<float, 256> map = make_dynamic_map(false);
  return map;
}

void q8_zero_states(const Q8Span& s) {
  const cpu::Q8Tables& t = cpu::q8_tables();
  std::fill_n(s.m_codes, s.n, t.signed_zero);
  std::fill_n(s.v_codes, s.n, t.unsigned_zero);
  std::fill_n(s.m_scales, q8_blocks(s.n), 0.0f);
  std::fill_n(s.v_scales, q8_blocks(s.n), 0.0f);
}

Result<StepReport> step_q8(const Q8StepArgs& a) {
  STRATA_RETURN_IF_ERROR(cpu::q8_validate(a));
  const Isa isa = a.isa.value_or(default_isa());
  if (!isa_supported(isa)) {
    return unavailable("kernel ISA {} was forced but this CPU lacks it; use scalar or leave the ISA unset",
                       isa_name(isa));
  }
  STRATA_ASSIGN_OR_RETURN(bool finite, q8_grads_finite(a));
  if (!finite) return StepReport{.grads_finite = false, .applied = false};
  // Pieces of kPieceElems (a multiple of kQ8BlockElems) from each span's start,
  // independent of the thread count (Note [Deterministic threading]).
  static_assert(kPieceElems % kQ8BlockElems == 0, "pieces hold whole blocks");
  thread_local std::vector<Q8Piece> t_pieces;
  thread_local std::vector<unsigned char> t_bad;
  std::vector<Q8Piece>& pieces = t_pieces;
  pieces.clear();
  for (std::size_t si = 0; si < a.spans.size(); ++si) {
    for (std::size_t b = 0; b < a.spans[si].n; b += kPieceElems) {
      pieces.push_back({si, b, std::min(a.spans[si].n, b + kPieceElems)});
    }
  }
  std::vector<unsigned char>& bad = t_bad;
  bad.assign(pieces.size(), 0);
  const cpu::Q8PieceFn fn = cpu::q8_piece_fn(isa);
  const cpu::Q8Tables& tab = cpu::q8_tables();
  const AdamCoeffs c = adam_coeffs(a.hyper, a.step);
  const float scale = a.grad_scale;
  auto body = [&](std::size_t /*part*/, std::size_t begin, std::size_t end) {
    for (std::size_t k = begin; k < end; ++k) {
      const Q8Piece& p = pieces[k];
      bad[k] = fn(a.spans[p.span], p.begin, p.end, c, scale, tab) ? 1 : 0;
    }
  };
  if (a.pool == nullptr || pieces.size() < 2) {
    body(0, 0, pieces.size());
  } else {
    a.pool->parallel_for(pieces.size(), 0, body);
  }
  if (std::find(bad.begin(), bad.end(), 1) != bad.end()) {
    return failed_precondition(
        "step_q8: a gradient was Inf/NaN in the fused pass although the check said finite: gradients changed "
        "between grad_stats() and step_q8(); states are now updated with them — recompute the check right "
        "before the step");
  }
  return StepReport{.grads_finite = true, .applied = true};
}

namespace cpu {

Status q8_validate(const Q8StepArgs& a) {
  STRATA_RETURN_IF_ERROR(validate_hyper(a.hyper));
  if (a.hyper.optimizer != Optimizer::kAdam && a.hyper.optimizer != Optimizer::kAdamW) {
    return invalid_argument("step_q8 runs adam and adamw, not {}; use step() with fp32 or bf16 states",
                            optimizer_name(a.hyper.optimizer));
  }
  if (a.step < 1) return invalid_argument("step = {} must be >= 1 (1-based, after the increment)", a.step);
  if (!std::isfinite(a.grad_scale)) return invalid_argument("grad_scale = {} is not finite", a.grad_scale);
  if (a.check == GradCheck::kCallerChecked && a.checked == nullptr) {
    return invalid_argument(
        "GradCheck::kCallerChecked needs the GradStats of grad_stats() in Q8StepArgs::checked");
  }
  for (std::size_t i = 0; i < a.spans.size(); ++i) {
    const Q8Span& s = a.spans[i];
    if (s.grad_dtype != DType::kF32 && s.grad_dtype != DType::kBF16 && s.grad_dtype != DType::kF16) {
      return invalid_argument("step_q8: span {} grad dtype {} is unsupported; use fp32, bf16 or fp16", i,
                              dtype_name(s.grad_dtype));
    }
    const bool param_ok = s.param_dtype == DType::kNone || s.param_dtype == DType::kF32 ||
                          s.param_dtype == DType::kBF16 || s.param_dtype == DType::kF16;
    const bool param_mismatch = s.n != 0 && (s.param == nullptr) != (s.param_dtype == DType::kNone);
    if (!param_ok || param_mismatch) {
      return invalid_argument(
          "step_q8: span {} param dtype {} with param {}: give fp32/bf16/fp16 with a "
          "pointer, or kNone with none",
          i, dtype_name(s.param_dtype), s.param == nullptr ? "null" : "set");
    }
    if (s.n == 0) continue;
    if (s.master == nullptr || s.grad == nullptr || s.m_codes == nullptr || s.m_scales == nullptr ||
        s.v_codes == nullptr || s.v_scales == nullptr) {
      return invalid_argument("step_q8: span {} has n = {} but a null master, grad, codes or scales", i, s.n);
    }
  }
  return Status::Ok();
}

const Q8Tables& q8_tables() {
  static const Q8Tables tables = make_tables();
  return tables;
}

}  // namespace cpu
}  // namespace strata::kernels
