#pragma once
// RecordPool: records for work whose completion runs on another thread (Note
// [Completion records]).
//
// Note [Completion records]
// A completion (a host function enqueued on a device stream, an I/O request's
// callback) needs a few values when it runs (a copy's start time, span name and
// size; a launch's function and trace position; a slot read's stripes and
// checksums). Carried in the closure, they make std::function allocate; carried
// in a record from this pool, the closure holds one or two words, which
// std::function stores in place. The pool only grows past its high water of
// records in flight, so a steady step allocates nothing (Note
// [Allocation-free hot paths] in runtime/src/leases.cpp); created() is the
// counter a test checks. It has its own lock: completion threads give records
// back without their owner's lock. Used by the runtime (copies, launches, NVMe
// pieces), offload::SwapStore (slot operations) and the CUDA device
// (launch_host).
//
// Lifetime: a record taken is the caller's until it is given back, exactly once;
// the pool must outlive every record in flight. take() hands out a freshly
// value-initialised T (destroyed and constructed in place, so T need not be
// movable: a record may hold a mutex or an atomic).

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>

namespace strata {

template <typename T>
class RecordPool {
 public:
  //! A value-initialised record (reused, or created when every one is in
  //! flight). Thread-safe; allocates only when it creates one.
  T* take() {
    std::lock_guard g(mu_);
    if (free_ == nullptr) return &nodes_.emplace_back().value;
    Node* n = std::exchange(free_, free_->next);
    std::destroy_at(&n->value);
    std::construct_at(&n->value);
    return &n->value;
  }
  //! Creates records until `count` exist (the ones made are free). For an owner
  //! that knows a bound on the records in flight: past it, take() never allocates.
  void reserve(std::size_t count) {
    std::lock_guard g(mu_);
    while (nodes_.size() < count) {
      Node& n = nodes_.emplace_back();
      n.next = std::exchange(free_, &n);
    }
  }
  //! Returns a record taken from this pool. Thread-safe; never allocates.
  void give_back(T* record) {
    auto* n = reinterpret_cast<Node*>(record);  // value is Node's first member
    std::lock_guard g(mu_);
    n->next = std::exchange(free_, n);
  }
  //! Records ever created: the high water of records in flight.
  std::uint64_t created() const {
    std::lock_guard g(mu_);
    return nodes_.size();
  }

 private:
  struct Node {
    T value{};  // first: give_back finds the node from the value
    Node* next = nullptr;
  };
  mutable std::mutex mu_;
  std::deque<Node> nodes_;  // stable addresses
  Node* free_ = nullptr;
};

}  // namespace strata
