#pragma once
// SimStream and SimEvent: the sim backend's stream (one worker thread running a bounded
// queue of operations in order) and event (a sequence number the streams advance).
// Internal to memory/src/sim/.

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace strata::memory::sim {

//! A move-only void() callable stored in place when it fits kInlineBytes (every
//! operation SimDevice enqueues does), on the heap otherwise: enqueueing a copy,
//! a record or a wait allocates nothing (issue #12: hot paths do not allocate).
class InlineOp {
 public:
  static constexpr std::size_t kInlineBytes = 64;

  InlineOp() = default;
  template <typename F, typename D = std::decay_t<F>,
            typename = std::enable_if_t<!std::is_same_v<D, InlineOp> && std::is_invocable_v<D&>>>
  InlineOp(F&& f) {  // NOLINT(google-explicit-constructor): a callable converts
    if constexpr (kInline<D>) {
      new (buf_) D(std::forward<F>(f));
    } else {
      new (buf_) D*(new D(std::forward<F>(f)));
    }
    ops_ = &kOps<D>;
  }
  InlineOp(InlineOp&& other) noexcept { take(other); }
  InlineOp& operator=(InlineOp&& other) noexcept {
    if (this != &other) {
      reset();
      take(other);
    }
    return *this;
  }
  InlineOp(const InlineOp&) = delete;
  InlineOp& operator=(const InlineOp&) = delete;
  ~InlineOp() { reset(); }

  explicit operator bool() const { return ops_ != nullptr; }
  void operator()() { ops_->call(buf_); }
  void reset() {
    if (ops_ != nullptr) ops_->destroy(buf_);
    ops_ = nullptr;
  }

 private:
  struct Ops {
    void (*call)(void*);
    void (*move)(void* from, void* to);  // move-constructs into `to`, destroys `from`
    void (*destroy)(void*);
  };
  template <typename D>
  static constexpr bool kInline =
      sizeof(D) <= kInlineBytes &&
      alignof(D) <= alignof(std::max_align_t) && std::is_nothrow_move_constructible_v<D>;
  template <typename D>
  static constexpr Ops kOps =
      kInline<D> ? Ops{[](void* p) { (*static_cast<D*>(p))(); },
                       [](void* from, void* to) {
                         new (to) D(std::move(*static_cast<D*>(from)));
                         static_cast<D*>(from)->~D();
                       },
                       [](void* p) { static_cast<D*>(p)->~D(); }}
                 : Ops{[](void* p) { (**static_cast<D**>(p))(); },
                       [](void* from, void* to) { new (to) D*(*static_cast<D**>(from)); },
                       [](void* p) { delete *static_cast<D**>(p); }};
  void take(InlineOp& other) noexcept {
    if (other.ops_ != nullptr) other.ops_->move(other.buf_, buf_);
    ops_ = std::exchange(other.ops_, nullptr);
  }

  alignas(std::max_align_t) unsigned char buf_[kInlineBytes];
  const Ops* ops_ = nullptr;
};

//! One in-order queue of host functions executed by its own worker thread.
//! Thread-safe. enqueue() blocks while the queue holds `queue_depth` operations.
//! Destruction runs everything queued, then joins the worker.
class SimStream {
 public:
  explicit SimStream(std::size_t queue_depth);
  ~SimStream();
  SimStream(const SimStream&) = delete;
  SimStream& operator=(const SimStream&) = delete;

  //! Appends `op`; blocks while the queue is full. Must not be called from this stream's
  //! own worker when the queue may be full (it would wait for itself).
  void enqueue(InlineOp op);
  //! Blocks until every operation enqueued before the call has finished.
  void synchronize();

  using Clock = std::chrono::steady_clock;
  //! When the previous operation finished, in the stream's model: a copy's modelled end,
  //! else the real time it returned. Only for operations running on this stream's worker.
  Clock::time_point previous_finish() const { return previous_finish_; }
  //! Called by a running operation to set its modelled finish (else: now). Worker only.
  void set_finish(Clock::time_point finish) { finish_override_ = finish; }

 private:
  void run();

  std::mutex mutex_;
  std::condition_variable not_empty_;
  std::condition_variable not_full_;
  std::condition_variable progress_;
  std::vector<InlineOp> ring_;  // fixed capacity = queue_depth
  std::size_t head_ = 0;        // next to run
  std::size_t count_ = 0;       // queued, not yet started
  std::uint64_t enqueued_ = 0;
  std::uint64_t completed_ = 0;
  bool stopping_ = false;
  Clock::time_point previous_finish_{};  // worker only
  Clock::time_point finish_override_{};  // worker only; {} = none
  std::thread worker_;
};

//! Event state shared by the event handle and the operations that record or wait on it
//! (Note [Event semantics] in device.hpp). `recorded` counts record() calls; a recorded
//! point k is done when `completed >= k`.
struct SimEventState {
  std::mutex mutex;
  std::condition_variable done;
  std::uint64_t recorded = 0;
  std::uint64_t completed = 0;
};

//! What Event::native() points to for the sim backend.
struct SimEvent {
  std::shared_ptr<SimEventState> state = std::make_shared<SimEventState>();
};

}  // namespace strata::memory::sim
