#pragma once
// RecordPool: completion records for work handed to a device stream (Note
// [Completion records]).
//
// Note [Completion records]
// A host function enqueued on a device stream needs a few values when it runs
// (a copy's start time, span name and size; a launch's function and trace
// position). Carried in the closure, they make std::function allocate; carried
// in a record from this pool, the closure holds one pointer, which
// std::function stores in place. The pool only grows past its high water of
// records in flight, so a steady step allocates nothing (Note
// [Allocation-free hot paths] in leases.cpp); created() is the counter a test
// checks. It has its own lock: stream threads give records back without
// Core::mu.

#include <cstdint>
#include <deque>
#include <mutex>
#include <utility>

namespace strata::runtime {

template <typename T>
class RecordPool {
 public:
  //! A record, reset to T{} (reused, or created when every one is in flight).
  //! Thread-safe; allocates only when it creates one.
  T* take() {
    std::lock_guard g(mu_);
    if (free_ == nullptr) return &nodes_.emplace_back().value;
    Node* n = std::exchange(free_, free_->next);
    n->value = T{};
    return &n->value;
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

}  // namespace strata::runtime
