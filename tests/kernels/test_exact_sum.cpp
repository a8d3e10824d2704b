// #14: ExactSum (Note [Exact norms]): the exact sum of non-negative floats,
// the same bits in any order, and its all-reduce wire form.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "strata/kernels/exact_sum.hpp"

namespace strata::kernels {
namespace {

std::vector<float> random_values(std::size_t n, unsigned seed, int span = 60) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(-span, span);
  std::vector<float> v(n);
  for (float& x : v) x = std::ldexp(mantissa(rng), exponent(rng));
  return v;
}

ExactSum sum_of(const std::vector<float>& v) {
  ExactSum s;
  for (float x : v) s.add(x);
  return s;
}

__extension__ typedef __float128 Quad;

//! A reference sum in binary128: exact while the values span fewer than ~100 bits.
double quad_sum(const std::vector<float>& v) {
  Quad s = 0;
  for (float x : v) s += x;
  return static_cast<double>(s);  // rounded once, to nearest
}

TEST(ExactSum, ShuffledOrdersGiveIdenticalBits) {
  std::vector<float> v = random_values(5000, 1);
  const ExactSum first = sum_of(v);
  const double d = first.to_double();
  std::vector<double> naive;
  std::mt19937 rng(7);
  for (int k = 0; k < 20; ++k) {
    std::shuffle(v.begin(), v.end(), rng);
    const ExactSum s = sum_of(v);
    EXPECT_TRUE(s == first);
    EXPECT_EQ(s.to_double(), d);  // bit for bit
    double n = 0;
    for (float x : v) n += x;
    naive.push_back(n);
  }
  // The data is such that plain double addition does depend on the order.
  EXPECT_NE(*std::min_element(naive.begin(), naive.end()), *std::max_element(naive.begin(), naive.end()));
}

TEST(ExactSum, SplitRangesAddedInAnyOrderMatchTheWhole) {
  const std::vector<float> v = random_values(4096, 2);
  const ExactSum whole = sum_of(v);
  for (std::size_t cut : {1u, 63u, 64u, 1000u, 4095u}) {
    ExactSum a, b;
    for (std::size_t i = 0; i < cut; ++i) a.add(v[i]);
    for (std::size_t i = cut; i < v.size(); ++i) b.add(v[i]);
    ExactSum ab = a, ba = b;
    ab.add(b);
    ba.add(a);
    EXPECT_TRUE(ab == whole) << cut;
    EXPECT_TRUE(ba == whole) << cut;
    EXPECT_EQ(ab.to_double(), whole.to_double()) << cut;
  }
}

TEST(ExactSum, RoundsTheExactSumToNearest) {
  for (unsigned seed = 3; seed < 8; ++seed) {
    const std::vector<float> v = random_values(3000, seed, 20);  // 24 + 40 + 12 bits: exact in binary128
    EXPECT_EQ(sum_of(v).to_double(), quad_sum(v)) << seed;
  }
  // 1 + 2^-53 + 2^-80: the sticky part decides a tie that a truncation would round down.
  ExactSum s;
  s.add(1.0f);
  s.add(0x1p-53f);
  s.add(0x1p-80f);
  EXPECT_EQ(s.to_double(), 1.0 + 0x1p-52);
  ExactSum tie;
  tie.add(1.0f);
  tie.add(0x1p-53f);
  EXPECT_EQ(tie.to_double(), 1.0);  // a tie goes to even
}

TEST(ExactSum, EdgeValues) {
  EXPECT_EQ(ExactSum{}.to_double(), 0.0);
  ExactSum zeros;
  zeros.add(0.0f);
  zeros.add(-0.0f);
  EXPECT_EQ(zeros.to_double(), 0.0);
  EXPECT_FALSE(std::signbit(zeros.to_double()));
  ExactSum denormals;
  const float tiny = std::numeric_limits<float>::denorm_min();
  for (int i = 0; i < 3; ++i) denormals.add(tiny);
  EXPECT_EQ(denormals.to_double(), 3.0 * static_cast<double>(tiny));
  ExactSum big;  // FLT_MAX twice and FLT_MAX² (as a double would hold them) exceed a float
  big.add(FLT_MAX);
  big.add(FLT_MAX);
  big.add(tiny);
  EXPECT_EQ(big.to_double(), 2.0 * static_cast<double>(FLT_MAX));
  ExactSum many;
  for (int i = 0; i < 100000; ++i) many.add(FLT_MAX);
  EXPECT_EQ(many.to_double(), 100000.0 * static_cast<double>(FLT_MAX));
}

TEST(ExactSum, InfAndNanPropagateAsADoubleSumWould) {
  ExactSum inf;
  inf.add(1.0f);
  inf.add(std::numeric_limits<float>::infinity());
  EXPECT_TRUE(inf.has_inf());
  EXPECT_EQ(inf.to_double(), std::numeric_limits<double>::infinity());
  ExactSum nan;
  nan.add(std::numeric_limits<float>::quiet_NaN());
  nan.add(std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(nan.to_double()));
  ExactSum negative;  // never a sum of squares: the sum is undefined, not silently dropped
  negative.add(-1.0f);
  EXPECT_TRUE(std::isnan(negative.to_double()));
  ExactSum merged;
  merged.add(2.0f);
  merged.add(inf);
  EXPECT_EQ(merged.to_double(), std::numeric_limits<double>::infinity());
}

TEST(ExactSum, WireSumsOfRanksMatchOneSum) {
  const std::vector<float> v = random_values(8000, 4);
  for (int ranks : {2, 4, 7}) {
    std::vector<double> reduced(ExactSum::kWireDoubles, 0.0);
    std::vector<double> wire(ExactSum::kWireDoubles);
    for (int r = ranks - 1; r >= 0; --r) {  // any order of ranks
      ExactSum part;
      for (std::size_t i = static_cast<std::size_t>(r); i < v.size(); i += static_cast<std::size_t>(ranks)) {
        part.add(v[i]);
      }
      part.to_wire(wire);
      for (std::size_t k = 0; k < wire.size(); ++k) {
        EXPECT_LT(wire[k], 0x1p32);  // carried limbs
        reduced[k] += wire[k];
      }
    }
    const ExactSum back = ExactSum::from_wire(reduced);
    EXPECT_TRUE(back == sum_of(v)) << ranks;
    EXPECT_EQ(back.to_double(), sum_of(v).to_double()) << ranks;
  }
  ExactSum inf;
  inf.add(std::numeric_limits<float>::infinity());
  std::vector<double> wire(ExactSum::kWireDoubles);
  inf.to_wire(wire);
  EXPECT_TRUE(ExactSum::from_wire(wire).has_inf());
}

}  // namespace
}  // namespace strata::kernels
