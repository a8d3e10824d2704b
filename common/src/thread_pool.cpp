#include "strata/common/thread_pool.hpp"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <new>
#include <utility>

#include "strata/common/assert.hpp"

namespace strata {
namespace {
// The pool whose worker the current thread is (null outside any pool).
thread_local const ThreadPool* t_worker_of = nullptr;
}  // namespace

HandlerMemory::HandlerMemory() {
  for (std::size_t i = 0; i < kReservedBlocks; ++i) free_ = new (::operator new(kBlockBytes)) Block{free_};
}

HandlerMemory::~HandlerMemory() {
  while (free_ != nullptr) ::operator delete(std::exchange(free_, free_->next));
}

void* HandlerMemory::allocate(std::size_t bytes) {
  {
    std::lock_guard g(mu_);
    if (bytes > kBlockBytes) {
      ++oversized_;
    } else if (free_ != nullptr) {
      return std::exchange(free_, free_->next);
    } else {
      ++created_;
    }
  }
  return ::operator new(std::max(bytes, kBlockBytes));
}

void HandlerMemory::deallocate(void* p, std::size_t bytes) {
  if (bytes > kBlockBytes) {
    ::operator delete(p);
    return;
  }
  std::lock_guard g(mu_);
  free_ = new (p) Block{free_};
}

std::uint64_t HandlerMemory::blocks_created() const {
  std::lock_guard g(mu_);
  return created_;
}

std::uint64_t HandlerMemory::oversized() const {
  std::lock_guard g(mu_);
  return oversized_;
}

// The asio pool is created with zero threads of its own; our workers attach()
// to it after running the caller's start hook, so the hook runs on every worker.
ThreadPool::ThreadPool(std::size_t /*threads*/) : pool_(0) {}

Result<std::unique_ptr<ThreadPool>> ThreadPool::create(Options options) {
  std::size_t threads = options.threads;
  if (threads == 0) threads = std::max<std::size_t>(1, std::thread::hardware_concurrency());
  if (threads > options.threads_max) {
    return invalid_argument("thread pool threads = {} exceeds threads_max = {}; lower the thread count",
                            threads, options.threads_max);
  }
  std::unique_ptr<ThreadPool> pool(new ThreadPool(threads));
  pool->workers_.reserve(threads);
  for (std::size_t i = 0; i < threads; ++i) {
    pool->workers_.emplace_back([raw = pool.get(), i, hook = options.on_worker_start] {
      if (hook) hook(i);
      t_worker_of = raw;
      raw->pool_.attach();
    });
  }
  return pool;
}

ThreadPool::~ThreadPool() {
  // join() waits until the queue is drained; then stop() releases the attached
  // workers, whose attach() returns.
  pool_.wait();
  for (auto& worker : workers_) worker.join();
}

std::pair<std::size_t, std::size_t> ThreadPool::split(std::size_t count, std::size_t parts,
                                                      std::size_t part) {
  STRATA_ASSERT(parts > 0);
  STRATA_ASSERT(part < parts);
  std::size_t base = count / parts;
  std::size_t extra = count % parts;
  std::size_t begin = part * base + std::min(part, extra);
  std::size_t end = begin + base + (part < extra ? 1 : 0);
  return {begin, end};
}

bool ThreadPool::on_worker() const {
  return t_worker_of == this;
}

void ThreadPool::parallel_for(std::size_t count, std::size_t parts,
                              const std::function<void(std::size_t, std::size_t, std::size_t)>& fn) {
  if (parts == 0) parts = size();
  if (parts == 1 || count == 0 || size() == 1) {
    for (std::size_t p = 0; p < parts; ++p) {
      auto [b, e] = split(count, parts, p);
      fn(p, b, e);
    }
    return;
  }

  struct Shared {
    std::atomic<std::size_t> next{0};
    std::size_t done = 0;  // guarded by mutex
    std::mutex mutex;
    std::condition_variable cv;
  };
  // From the pool's handler memory, like the helpers' operations (Note [Handler memory]).
  auto shared = std::allocate_shared<Shared>(HandlerAllocator<Shared>(&handler_memory_));

  // Claims ranges until none are left; returns how many it ran.
  auto run = [shared, count, parts, &fn]() {
    std::size_t ran = 0;
    for (;;) {
      std::size_t p = shared->next.fetch_add(1, std::memory_order_relaxed);
      if (p >= parts) break;
      auto [b, e] = split(count, parts, p);
      fn(p, b, e);
      ++ran;
    }
    if (ran > 0) {
      std::lock_guard lock(shared->mutex);
      shared->done += ran;
      if (shared->done == parts) shared->cv.notify_all();
    }
  };

  // Helpers that start after all ranges are claimed return at once without
  // touching fn (which may be gone by then): they only read `next`. The caller
  // is one of the size() threads.
  const std::size_t helpers = std::min(parts - 1, size() - 1);
  for (std::size_t i = 0; i < helpers; ++i) post(run);
  run();
  std::unique_lock lock(shared->mutex);
  shared->cv.wait(lock, [&] { return shared->done == parts; });
}

}  // namespace strata
