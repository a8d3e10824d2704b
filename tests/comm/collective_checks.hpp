#pragma once
// Checks of every collective, run by each rank of a group on its own
// Communicator: the local backend's test runs them on W threads, the mpi
// backend's under mpiexec. Every rank can compute every rank's input (a
// function of rank and index), so each checks its output against a reference
// formed here in rank order (Note [Deterministic reduction]): bit-equal.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "strata/comm/communicator.hpp"

namespace strata::comm::testing {

//! Rank r's input element i: values whose sums round (not exact), with a sign mix.
inline float input_value(int rank, std::size_t i) {
  const auto x = static_cast<float>((i * 2654435761u + static_cast<std::size_t>(rank) * 40503u) % 10007u);
  return (x - 5003.0f) * 0.0137f + static_cast<float>(rank) * 1e-3f;
}

inline std::vector<std::uint16_t> encode(const std::vector<float>& v, DType dtype) {
  std::vector<std::uint16_t> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = dtype == DType::kBF16 ? to_bf16(v[i]) : to_f16(v[i]);
  return out;
}

//! Rank r's full send buffer of w * count elements, as bytes of dtype.
inline std::vector<std::byte> send_buffer(int rank, int w, std::size_t count, DType dtype) {
  std::vector<float> v(static_cast<std::size_t>(w) * count);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = input_value(rank, i);
  // One spare byte: never empty, so data() is never null (count 0 is a case).
  std::vector<std::byte> out(v.size() * dtype_size(dtype) + 1);
  if (v.empty()) return out;
  if (dtype == DType::kF32) {
    std::memcpy(out.data(), v.data(), v.size() * 4);
  } else {
    const auto h = encode(v, dtype);
    std::memcpy(out.data(), h.data(), h.size() * 2);
  }
  return out;
}

//! reduce_scatter: this rank's slice equals the rank-ordered sum, bit for bit.
inline void check_reduce_scatter(Communicator& c, std::size_t count, DType dtype) {
  const int w = c.size();
  const std::size_t es = dtype_size(dtype);
  auto send = send_buffer(c.rank(), w, count, dtype);
  std::vector<std::byte> recv(count * es + 1);  // +1: never empty, so data() is not null
  auto h = c.reduce_scatter(send.data(), recv.data(), count, dtype);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->wait().ok());
  // Reference: every rank's slice c.rank(), summed here in rank order.
  std::vector<std::vector<std::byte>> all;
  std::vector<const void*> src;
  for (int r = 0; r < w; ++r) all.push_back(send_buffer(r, w, count, dtype));
  for (int r = 0; r < w; ++r)
    src.push_back(all[static_cast<std::size_t>(r)].data() + count * es * static_cast<std::size_t>(c.rank()));
  std::vector<std::byte> want(count * es + 1);
  sum_in_rank_order(src, want.data(), count, dtype);
  EXPECT_EQ(0, std::memcmp(want.data(), recv.data(), count * es))
      << "rank " << c.rank() << " reduce_scatter " << count << " x " << dtype_name(dtype);
  if (dtype == DType::kF32 && count > 0) {
    // The reference itself: ((s0 + s1) + s2) + ... in fp32.
    float acc = input_value(0, count * static_cast<std::size_t>(c.rank()));
    for (int r = 1; r < w; ++r) acc += input_value(r, count * static_cast<std::size_t>(c.rank()));
    float got;
    std::memcpy(&got, recv.data(), 4);
    EXPECT_EQ(acc, got);
  }
}

//! all_gather, out of place and in place: slice r is rank r's input.
inline void check_all_gather(Communicator& c, std::size_t count, DType dtype, bool in_place) {
  const int w = c.size();
  const std::size_t bytes = count * dtype_size(dtype);
  std::vector<std::byte> recv(bytes * static_cast<std::size_t>(w) + 1, std::byte{0xee});
  auto mine = send_buffer(c.rank(), 1, count, dtype);
  const void* send = mine.data();
  if (in_place) {
    std::memcpy(recv.data() + bytes * static_cast<std::size_t>(c.rank()), mine.data(), bytes);
    send = recv.data() + bytes * static_cast<std::size_t>(c.rank());
  }
  auto h = c.all_gather(send, recv.data(), count, dtype);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->wait().ok());
  for (int r = 0; r < w; ++r) {
    auto want = send_buffer(r, 1, count, dtype);
    EXPECT_EQ(0, std::memcmp(want.data(), recv.data() + bytes * static_cast<std::size_t>(r), bytes))
        << "rank " << c.rank() << " slice " << r;
  }
}

//! all_reduce of the two scalars a step needs: norm² (sum) and the Inf/NaN flag (max).
inline void check_all_reduce(Communicator& c) {
  const int w = c.size();
  std::vector<double> norm{0.1 * (c.rank() + 1), 3.0 + c.rank()};
  auto h = c.all_reduce(norm, ReduceOp::kSum);
  ASSERT_TRUE(h.ok()) << h.status();
  ASSERT_TRUE(h->wait().ok());
  double want0 = 0.1, want1 = 3.0;
  for (int r = 1; r < w; ++r) {
    want0 += 0.1 * (r + 1);
    want1 += 3.0 + r;
  }
  EXPECT_EQ(want0, norm[0]);
  EXPECT_EQ(want1, norm[1]);
  std::vector<double> flag{c.rank() == w - 1 ? 1.0 : 0.0};
  auto m = c.all_reduce(flag, ReduceOp::kMax);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->wait().ok());
  EXPECT_EQ(1.0, flag[0]);
}

//! broadcast from every root in turn.
inline void check_broadcast(Communicator& c) {
  for (int root = 0; root < c.size(); ++root) {
    std::uint64_t value = c.rank() == root ? 0xc0ffee00ull + static_cast<std::uint64_t>(root) : 0;
    auto h = c.broadcast(&value, sizeof(value), root);
    ASSERT_TRUE(h.ok()) << h.status();
    ASSERT_TRUE(h->wait().ok());
    EXPECT_EQ(0xc0ffee00ull + static_cast<std::uint64_t>(root), value) << "rank " << c.rank();
  }
}

//! Several collectives in flight at once, waited for in reverse order.
inline void check_overlapped(Communicator& c) {
  const int w = c.size();
  const std::size_t count = 1000;
  auto s1 = send_buffer(c.rank(), w, count, DType::kF32);
  auto s2 = send_buffer(c.rank(), 1, count, DType::kBF16);
  std::vector<float> r1(count);
  std::vector<std::byte> r2(count * 2 * static_cast<std::size_t>(w));
  auto h1 = c.reduce_scatter(s1.data(), r1.data(), count, DType::kF32);
  auto h2 = c.all_gather(s2.data(), r2.data(), count, DType::kBF16);
  ASSERT_TRUE(h1.ok() && h2.ok());
  ASSERT_TRUE(h2->wait().ok());
  ASSERT_TRUE(h1->wait().ok());
  for (int r = 0; r < w; ++r) {
    auto want = send_buffer(r, 1, count, DType::kBF16);
    EXPECT_EQ(0, std::memcmp(want.data(), r2.data() + count * 2 * static_cast<std::size_t>(r), count * 2));
  }
}

//! Every check above, in the same order on every rank.
inline void check_all_collectives(Communicator& c) {
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4099}}) {
      check_reduce_scatter(c, n, d);
      check_all_gather(c, n, d, false);
      check_all_gather(c, n, d, true);
    }
  }
  check_all_reduce(c);
  check_broadcast(c);
  check_overlapped(c);
}

}  // namespace strata::comm::testing
