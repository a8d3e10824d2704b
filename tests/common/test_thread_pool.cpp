#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include "strata/common/thread_pool.hpp"

namespace strata {
namespace {

std::unique_ptr<ThreadPool> make_pool(std::size_t threads) {
  auto pool = ThreadPool::create({.threads = threads});
  EXPECT_TRUE(pool.ok());
  return std::move(pool).value();
}

TEST(ThreadPool, RunsHookOnEveryWorker) {
  std::atomic<int> started{0};
  std::set<std::size_t> seen;
  std::mutex m;
  {
    auto pool = ThreadPool::create({.threads = 3, .on_worker_start = [&](std::size_t i) {
                                      started.fetch_add(1);
                                      std::lock_guard lock(m);
                                      seen.insert(i);
                                    }});
    ASSERT_TRUE(pool.ok());
    EXPECT_EQ((*pool)->size(), 3u);
  }
  EXPECT_EQ(started.load(), 3);
  EXPECT_EQ(seen, (std::set<std::size_t>{0, 1, 2}));
}

TEST(ThreadPool, RejectsTooManyThreads) {
  auto pool = ThreadPool::create({.threads = 10, .threads_max = 4});
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kInvalidArgument);
}

TEST(ThreadPool, DestructorDrainsPostedWork) {
  std::atomic<int> done{0};
  {
    auto pool = make_pool(2);
    for (int i = 0; i < 1000; ++i) pool->post([&] { done.fetch_add(1); });
  }
  EXPECT_EQ(done.load(), 1000);
}

TEST(ThreadPool, StrandSerialises) {
  auto pool = make_pool(4);
  auto strand = pool->make_strand();
  int counter = 0;  // unguarded: the strand is the guard (TSan checks this)
  std::atomic<int> finished{0};
  for (int i = 0; i < 2000; ++i) {
    boost::asio::post(strand, [&] {
      ++counter;
      finished.fetch_add(1);
    });
  }
  while (finished.load() < 2000) std::this_thread::yield();
  boost::asio::post(strand, [&] { EXPECT_EQ(counter, 2000); });
}

TEST(ThreadPool, SplitCoversRangeExactly) {
  for (std::size_t count : {0u, 1u, 7u, 100u, 1001u}) {
    for (std::size_t parts : {1u, 2u, 3u, 8u}) {
      std::size_t expect_begin = 0;
      for (std::size_t p = 0; p < parts; ++p) {
        auto [b, e] = ThreadPool::split(count, parts, p);
        EXPECT_EQ(b, expect_begin);
        EXPECT_LE(e - b, count / parts + 1);
        expect_begin = e;
      }
      EXPECT_EQ(expect_begin, count);
    }
  }
}

TEST(ThreadPool, ParallelForSumIsDeterministic) {
  auto pool = make_pool(2);
  std::vector<double> data(100003);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = 1.0 / static_cast<double>(i + 1);
  auto sum_with = [&](std::size_t parts) {
    std::vector<double> partial(parts, 0.0);
    pool->parallel_for(data.size(), parts, [&](std::size_t p, std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) partial[p] += data[i];
    });
    return std::accumulate(partial.begin(), partial.end(), 0.0);
  };
  double first = sum_with(8);
  for (int rep = 0; rep < 20; ++rep) EXPECT_EQ(sum_with(8), first);  // bit-identical
}

TEST(ThreadPool, NestedParallelForDoesNotDeadlock) {
  auto pool = make_pool(2);
  std::atomic<long> total{0};
  pool->parallel_for(8, 8, [&](std::size_t, std::size_t, std::size_t) {
    pool->parallel_for(100, 4, [&](std::size_t, std::size_t b, std::size_t e) {
      total.fetch_add(static_cast<long>(e - b));
    });
  });
  EXPECT_EQ(total.load(), 800);
}

TEST(ThreadPool, ParallelForRunsOnExactlyThePoolsThreads) {
  // The pool's size is the number of threads that run ranges: the caller and
  // size() - 1 workers, whether the caller is a worker or not.
  for (std::size_t threads : {std::size_t{1}, std::size_t{3}}) {
    auto pool = make_pool(threads);
    std::mutex mu;
    std::set<std::thread::id> seen;
    auto record = [&](std::size_t, std::size_t, std::size_t) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let every helper start
      std::lock_guard lock(mu);
      seen.insert(std::this_thread::get_id());
    };
    pool->parallel_for(64, 0, record);
    EXPECT_LE(seen.size(), threads);
    EXPECT_EQ(seen.count(std::this_thread::get_id()), 1u) << "the caller ran no range";
    if (threads == 1) {
      EXPECT_EQ(seen.size(), 1u);  // the caller alone
    }
    EXPECT_FALSE(pool->on_worker());
    seen.clear();
    std::atomic<bool> done{false};
    pool->post([&] {
      EXPECT_TRUE(pool->on_worker());
      pool->parallel_for(64, 0, record);
      done = true;
    });
    while (!done.load()) std::this_thread::yield();
    EXPECT_LE(seen.size(), threads);
  }
}

TEST(ThreadPool, ParallelForFinishesWhileEveryWorkerIsBusy) {
  // A caller outside the pool (a device stream's thread) needs no free worker.
  auto pool = make_pool(2);
  std::atomic<bool> release{false};
  std::atomic<int> blocked{0};
  for (int i = 0; i < 2; ++i) {
    pool->post([&] {
      ++blocked;
      while (!release.load()) std::this_thread::yield();
    });
  }
  while (blocked.load() < 2) std::this_thread::yield();
  std::atomic<long> total{0};
  pool->parallel_for(
      100, 0, [&](std::size_t, std::size_t b, std::size_t e) { total.fetch_add(static_cast<long>(e - b)); });
  EXPECT_EQ(total.load(), 100);
  release = true;
}

}  // namespace
}  // namespace strata
