#include "sim/sim_stream.hpp"

#include <utility>

#include "strata/common/assert.hpp"

namespace strata::memory::sim {

SimStream::SimStream(std::size_t queue_depth) : ring_(queue_depth) {
  STRATA_CHECK(queue_depth > 0);
  worker_ = std::thread([this] { run(); });
}

SimStream::~SimStream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  not_empty_.notify_all();
  worker_.join();
  STRATA_ASSERT(count_ == 0);
}

void SimStream::enqueue(InlineOp op) {
  std::unique_lock lock(mutex_);
  STRATA_ASSERT(!stopping_);
  not_full_.wait(lock, [&] { return count_ < ring_.size(); });
  ring_[(head_ + count_) % ring_.size()] = std::move(op);
  ++count_;
  ++enqueued_;
  lock.unlock();
  not_empty_.notify_one();
}

void SimStream::synchronize() {
  std::unique_lock lock(mutex_);
  const std::uint64_t target = enqueued_;
  progress_.wait(lock, [&] { return completed_ >= target; });
}

void SimStream::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    not_empty_.wait(lock, [&] { return count_ > 0 || stopping_; });
    if (count_ == 0) return;  // stopping and drained
    {
      InlineOp op = std::move(ring_[head_]);
      head_ = (head_ + 1) % ring_.size();
      --count_;
      lock.unlock();
      not_full_.notify_one();
      finish_override_ = {};
      op();  // destroyed (with what it captured) before the lock is taken again
      previous_finish_ = finish_override_ != Clock::time_point{} ? finish_override_ : Clock::now();
    }
    lock.lock();
    ++completed_;
    progress_.notify_all();
  }
}

}  // namespace strata::memory::sim
