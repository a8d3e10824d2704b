#pragma once
// ExactSum: the exact sum of non-negative floats (sums of squares), in any order.
//
// Note [Exact norms]
// LAMB/LARS trust ratios and the clip norm need sums of squares over tensors
// that data parallelism cuts into parts on several ranks (Note [Sharded step]
// in runtime/src/dp/data_parallel.cpp). Floating-point addition is not
// associative, so summing parts and then the parts' totals gives other bits
// than one rank's sum over the whole tensor. Two things make the result
// independent of how a tensor is cut:
//   1. Fixed groups: the kernels sum squares in fp32 within groups of
//      kGroupElems elements aligned to the chunk's element index (Span::group_phase
//      says where the span starts within its group). With W > 1 every shard
//      boundary is a multiple of kShardAlignElems = 64 = kGroupElems from the
//      chunk's start, so no shard splits a group, and a tensor's edges cut a
//      group the same way on every rank. The order within a group depends only
//      on the positions of its elements (the span's first element in the group
//      and the lane width).
//   2. Exact accumulation: every group's fp32 sum is added into this
//      fixed-point integer (value = sum over limbs of limb[i] 2^(32 i - 149)),
//      whose addition is associative. A float's 24-bit significand lands in
//      two 32-bit limbs; limbs are 64-bit, so carries are propagated only every
//      2^31 additions. to_double() rounds the exact sum to nearest once.
// Inf and NaN are kept as flags: to_double() gives +Inf or NaN as a double sum
// of the same values would (NaN wins), so an overflow or a bad gradient is
// still detected as before.
// Ranks exchange sums with the doubles-only all-reduce of comm/: to_wire()
// writes the carried limbs (each < 2^32) and the two flags as doubles; a sum
// over W <= 2^20 ranks keeps every limb below 2^52, so the doubles add exactly
// in any order, and from_wire() turns the reduced doubles back into a sum.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace strata::kernels {

//! Elements per group of an exact norm (Note [Exact norms]); equals runtime's kShardAlignElems.
inline constexpr std::size_t kGroupElems = 64;

class ExactSum {
 public:
  //! 32-bit limbs: 277 bits span every finite float, the rest absorbs carries.
  static constexpr int kLimbs = 10;
  //! Doubles per sum on the wire (to_wire/from_wire): the limbs, then Inf and NaN flags.
  static constexpr std::size_t kWireDoubles = kLimbs + 2;

  //! Adds x (>= 0, +Inf or NaN; -0 counts as 0). A negative x makes the sum NaN.
  //! Always inlined: the ISA translation units call it (Note [ISA translation units]).
  [[gnu::always_inline]] inline void add(float x) {
    std::uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const std::uint32_t e = (bits >> 23) & 0xffu;
    if ((bits >> 31) != 0 || e == 0xffu) [[unlikely]] {
      add_special(bits);
      return;
    }
    const std::uint32_t normal = e != 0 ? 1u : 0u;
    const std::uint64_t m = (bits & 0x7fffffu) | (normal << 23);
    const std::uint32_t shift = e - normal;  // the significand's lowest bit, in units of 2^-149
    const std::uint64_t v = m << (shift & 31u);
    const std::uint32_t l = shift >> 5;
    limb_[l] += v & 0xffffffffu;
    limb_[l + 1] += v >> 32;
    if (++adds_ == kCarryEvery) [[unlikely]]
      carry();
  }
  //! Adds another sum (exactly).
  void add(const ExactSum& other);

  //! The sum rounded to the nearest double (ties to even); +Inf or NaN as flagged.
  double to_double() const;
  bool has_inf() const { return inf_ != 0; }
  bool has_nan() const { return nan_ != 0; }

  //! Writes kWireDoubles doubles (carried limbs, then 1 or 0 for Inf and for NaN).
  void to_wire(std::span<double> out) const;
  //! A sum from to_wire() doubles, or the element-wise sum of several ranks' (W <= 2^20).
  static ExactSum from_wire(std::span<const double> in);

  //! Same exact value and flags (the limbs compared carried).
  friend bool operator==(const ExactSum& a, const ExactSum& b);

 private:
  static constexpr std::uint32_t kCarryEvery = std::uint32_t{1} << 31;
  void carry();
  void add_special(std::uint32_t bits);

  std::uint64_t limb_[kLimbs] = {};
  std::uint32_t adds_ = 0;  //!< additions since the last carry()
  std::uint32_t inf_ = 0;
  std::uint32_t nan_ = 0;
};

}  // namespace strata::kernels
