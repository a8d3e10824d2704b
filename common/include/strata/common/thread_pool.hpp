#pragma once
// ThreadPool: the one pool of CPU workers (Boost.Asio thread_pool), with strands
// for serialised work and a deadlock-free fork-join `parallel_for` for kernels.
//
// Size and placement are decided by the caller (Topology in memory/ picks the
// count and passes a `bind` hook that pins each worker near the GPU); common/
// has no policy of its own.

#include <atomic>
#include <boost/asio/post.hpp>
#include <boost/asio/strand.hpp>
#include <boost/asio/thread_pool.hpp>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "strata/common/status.hpp"

namespace strata {

// Note [Handler memory]
// Every post() queues an operation that asio allocates. Outside the pool's own
// threads (device-stream callbacks, the training thread) asio's per-thread
// recycling does not apply, so each post would allocate from the heap. The
// pool therefore hands asio fixed-size blocks from its own free list
// (HandlerMemory, through the handler's associated allocator); the list grows
// only past its high water of operations in flight (kReservedBlocks are made
// at start), so steady work allocates nothing (Note [Allocation-free hot paths] in runtime/src/leases.cpp). A
// request larger than a block goes to the heap and is counted.

//! Recycled blocks for the pool's queued operations (Note [Handler memory]). Thread-safe.
class HandlerMemory {
 public:
  static constexpr std::size_t kBlockBytes = 256;
  //! Blocks made at start: posts in flight beyond them take new ones (counted).
  static constexpr std::size_t kReservedBlocks = 64;
  HandlerMemory();
  ~HandlerMemory();
  HandlerMemory(const HandlerMemory&) = delete;
  HandlerMemory& operator=(const HandlerMemory&) = delete;

  void* allocate(std::size_t bytes);
  void deallocate(void* p, std::size_t bytes);
  //! Blocks created beyond the reserved ones (operations in flight past kReservedBlocks).
  std::uint64_t blocks_created() const;
  //! Requests larger than a block, served by the heap.
  std::uint64_t oversized() const;

 private:
  struct Block {
    Block* next;
  };
  mutable std::mutex mu_;
  Block* free_ = nullptr;
  std::uint64_t created_ = 0;
  std::uint64_t oversized_ = 0;
};

//! An allocator over HandlerMemory, for asio's associated allocator.
template <typename T>
struct HandlerAllocator {
  using value_type = T;
  HandlerMemory* memory;
  explicit HandlerAllocator(HandlerMemory* m) noexcept : memory(m) {}
  template <typename U>
  HandlerAllocator(const HandlerAllocator<U>& other) noexcept : memory(other.memory) {}  // NOLINT: rebind
  T* allocate(std::size_t n) { return static_cast<T*>(memory->allocate(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { memory->deallocate(p, n * sizeof(T)); }
  template <typename U>
  bool operator==(const HandlerAllocator<U>& o) const noexcept {
    return memory == o.memory;
  }
  template <typename U>
  bool operator!=(const HandlerAllocator<U>& o) const noexcept {
    return memory != o.memory;
  }
};

//! A posted function with the pool's handler memory as its allocator.
template <typename Fn>
struct PooledHandler {
  Fn fn;
  HandlerMemory* memory;
  using allocator_type = HandlerAllocator<void>;
  allocator_type get_allocator() const noexcept { return allocator_type(memory); }
  void operator()() { fn(); }
};

//! Fixed-size pool of worker threads. Create once at start-up; destruction
//! drains the queue (waits for posted work) and joins. post() and parallel_for()
//! are thread-safe; parallel_for may be called from a worker (nesting is safe).
class ThreadPool {
 public:
  using Executor = boost::asio::thread_pool::executor_type;
  using Strand = boost::asio::strand<Executor>;

  struct Options {
    std::size_t threads = 0;         //!< 0 = std::thread::hardware_concurrency()
    std::size_t threads_max = 1024;  //!< bound; creating more is InvalidArgument
    //! Called on each worker before it takes work (e.g. bind to a NUMA node).
    //! Its index is in [0, threads). May be empty.
    std::function<void(std::size_t worker)> on_worker_start;
  };

  //! Starts the workers. Fails (InvalidArgument) when threads > threads_max.
  static Result<std::unique_ptr<ThreadPool>> create(Options options);

  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  std::size_t size() const { return workers_.size(); }
  Executor executor() { return pool_.get_executor(); }

  //! A new strand: work posted to it runs one at a time, in order.
  Strand make_strand() { return boost::asio::make_strand(pool_.get_executor()); }

  //! Runs fn() on some worker. Never blocks. Allocates only past the high water
  //! of posts in flight, or for a function larger than a block (Note [Handler memory]).
  template <typename Fn>
  void post(Fn&& fn) {
    boost::asio::post(pool_, PooledHandler<std::decay_t<Fn>>{std::forward<Fn>(fn), &handler_memory_});
  }
  //! The handler memory's counters (Note [Handler memory]).
  const HandlerMemory& handler_memory() const { return handler_memory_; }

  //! Splits [0, count) into `parts` contiguous ranges of near-equal size (the
  //! same split for the same count and parts, so per-range partial results can
  //! be combined in a fixed order) and calls fn(part, begin, end) for each, on
  //! the calling thread and at most size() - 1 workers: size() is the number of
  //! threads that run fn, whether the caller is a worker or not. Blocks until
  //! all ranges are done. parts == 0 means size(). fn must not throw.
  //!
  //! Note [Deadlock-free fork-join]: ranges are claimed from a shared atomic
  //! counter by the posted helpers *and* by the caller, so the caller never waits
  //! on a range nobody has started; it waits only for ranges already running.
  //! So a caller needs no free worker to finish (a device-stream thread may call
  //! it while every worker waits for a lock that thread's stream is synchronised under).
  void parallel_for(std::size_t count, std::size_t parts,
                    const std::function<void(std::size_t part, std::size_t begin, std::size_t end)>& fn);

  //! True when the calling thread is one of this pool's workers.
  bool on_worker() const;

  //! The bounds of range `part` of `parts` over [0, count), as parallel_for uses them.
  static std::pair<std::size_t, std::size_t> split(std::size_t count, std::size_t parts, std::size_t part);

 private:
  explicit ThreadPool(std::size_t threads);
  HandlerMemory handler_memory_;  // before pool_: outlives the operations it holds
  boost::asio::thread_pool pool_;
  std::vector<std::thread> workers_;
};

}  // namespace strata
