// ExactSum (Note [Exact norms] in strata/kernels/exact_sum.hpp): carries,
// rounding to double and the all-reduce wire form.
#include "strata/kernels/exact_sum.hpp"

#include <bit>
#include <cmath>
#include <limits>

#include "strata/common/assert.hpp"

namespace strata::kernels {

__extension__ typedef unsigned __int128 U128;

void ExactSum::carry() {
  for (int i = 0; i + 1 < kLimbs; ++i) {
    limb_[i + 1] += limb_[i] >> 32;
    limb_[i] &= 0xffffffffu;
  }
  // 2^(320 - 277) sums of FLT_MAX-sized groups: no real sum gets there.
  STRATA_CHECK(limb_[kLimbs - 1] <= 0xffffffffu);
  adds_ = 0;
}

void ExactSum::add_special(std::uint32_t bits) {
  const bool negative = (bits >> 31) != 0;
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude == 0) return;  // -0
  if (magnitude > 0x7f800000u || negative) {
    ++nan_;  // NaN, or a negative value (never a sum of squares): the sum is undefined
  } else {
    ++inf_;
  }
}

void ExactSum::add(const ExactSum& other) {
  // Both sides hold fewer than 2^31 additions since their carry: no limb overflows.
  for (int i = 0; i < kLimbs; ++i) limb_[i] += other.limb_[i];
  inf_ += other.inf_;
  nan_ += other.nan_;
  carry();
}

double ExactSum::to_double() const {
  if (nan_ != 0) return std::numeric_limits<double>::quiet_NaN();
  if (inf_ != 0) return std::numeric_limits<double>::infinity();
  ExactSum c = *this;
  c.carry();
  int top = kLimbs - 1;
  while (top >= 0 && c.limb_[top] == 0) --top;
  if (top < 0) return 0.0;
  auto limb = [&](int i) -> U128 { return i >= 0 ? c.limb_[i] : 0; };
  // The top three limbs (96 bits, the top one non-zero), then a sticky bit for the rest.
  const U128 hi = (limb(top) << 64) | (limb(top - 1) << 32) | limb(top - 2);
  bool sticky = false;
  for (int i = 0; i < top - 2; ++i) sticky = sticky || c.limb_[i] != 0;
  const int lz = std::countl_zero(static_cast<std::uint64_t>(hi >> 64));  // 2^64 <= hi < 2^96
  const U128 u = hi << lz;
  auto r = static_cast<std::uint64_t>(u >> 64);
  sticky = sticky || static_cast<std::uint64_t>(u) != 0;
  // 64 significant bits: bit 0 lies 11 bits under the double's last one, so a
  // sticky bit there breaks ties the right way; the conversion rounds once.
  if (sticky) r |= 1u;
  const int exponent = 64 - lz + 32 * (top - 2) - 149;
  return std::ldexp(static_cast<double>(r), exponent);
}

void ExactSum::to_wire(std::span<double> out) const {
  STRATA_CHECK(out.size() >= kWireDoubles);
  ExactSum c = *this;
  c.carry();
  for (int i = 0; i < kLimbs; ++i) out[static_cast<std::size_t>(i)] = static_cast<double>(c.limb_[i]);
  out[kLimbs] = inf_ != 0 ? 1.0 : 0.0;
  out[kLimbs + 1] = nan_ != 0 ? 1.0 : 0.0;
}

ExactSum ExactSum::from_wire(std::span<const double> in) {
  STRATA_CHECK(in.size() >= kWireDoubles);
  ExactSum s;
  for (int i = 0; i < kLimbs; ++i) {
    const double v = in[static_cast<std::size_t>(i)];
    // Limbs of up to 2^20 ranks, each < 2^32: integers below 2^52.
    STRATA_CHECK(v >= 0.0 && v < 0x1p52 && v == std::floor(v));
    s.limb_[i] = static_cast<std::uint64_t>(v);
  }
  s.inf_ = in[kLimbs] != 0.0 ? 1 : 0;
  s.nan_ = in[kLimbs + 1] != 0.0 ? 1 : 0;
  s.carry();
  return s;
}

bool operator==(const ExactSum& a, const ExactSum& b) {
  ExactSum x = a, y = b;
  x.carry();
  y.carry();
  for (int i = 0; i < ExactSum::kLimbs; ++i) {
    if (x.limb_[i] != y.limb_[i]) return false;
  }
  return (x.inf_ != 0) == (y.inf_ != 0) && (x.nan_ != 0) == (y.nan_ != 0);
}

}  // namespace strata::kernels
