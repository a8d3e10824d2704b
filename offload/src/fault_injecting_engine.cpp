#include "strata/offload/fault_injecting_engine.hpp"

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <random>
#include <thread>

#include "strata/common/assert.hpp"
#include "strata/common/log.hpp"

namespace strata::offload {

namespace {
using Clock = std::chrono::steady_clock;
// With reordering on, the delivery thread waits this long for more completions
// to choose among before it delivers the ones it holds.
constexpr auto kReorderGather = std::chrono::microseconds(500);
}  // namespace

struct FaultInjectingEngine::State {
  struct Held {
    IoCallback callback;
    Status status;
    Clock::time_point release;
    std::uint64_t sequence;  // arrival order, to count reorderings
  };

  FaultOptions faults;
  std::uint32_t in_flight_max = 0;
  std::uint32_t alignment_bytes = 4096;
  std::mutex mutex;  // guards everything below
  std::condition_variable cv;
  std::mt19937_64 rng;
  FaultStats counts;
  std::deque<Held> held;          // bounded: outstanding <= in_flight_max
  std::uint32_t outstanding = 0;  // accepted, callback not yet returned
  std::uint64_t arrivals = 0;
  bool stopping = false;
  bool delivery_done = false;
  std::thread delivery;

  double uniform() { return std::uniform_real_distribution<double>(0.0, 1.0)(rng); }

  // The inner engine's result filter (Note [Where faults are injected]).
  std::int64_t filter(const IoSite& site, std::int64_t result) {
    std::lock_guard lock(mutex);
    if (result <= 0) return result;
    if (uniform() < faults.eio_probability) {
      ++counts.eio;
      return -EIO;
    }
    if (uniform() < faults.eintr_probability) {
      ++counts.eintr;
      return (rng() & 1) ? -EINTR : -EAGAIN;
    }
    const auto align = static_cast<std::int64_t>(alignment_bytes);
    if (result >= 2 * align && uniform() < faults.short_probability) {
      ++counts.short_transfers;
      std::int64_t blocks = result / align;
      return align * static_cast<std::int64_t>(1 + rng() % static_cast<std::uint64_t>(blocks - 1));
    }
    (void)site;
    return result;
  }

  // The inner engine completed a request: hold it for delivery.
  void completed(IoCallback callback, Status status) {
    std::lock_guard lock(mutex);
    Clock::time_point release = Clock::now();
    if (faults.delay_probability > 0 && uniform() < faults.delay_probability) {
      ++counts.delays;
      release += std::chrono::microseconds(rng() % (faults.delay_us_max + 1));
    }
    held.push_back({std::move(callback), std::move(status), release, arrivals++});
    cv.notify_all();
  }

  void deliver_loop() {
    std::unique_lock lock(mutex);
    std::uint64_t delivered_max = 0;
    bool any_delivered = false;
    for (;;) {
      cv.wait(lock, [&] { return !held.empty() || (stopping && outstanding == 0); });
      if (held.empty()) break;
      if (faults.reorder && !stopping) cv.wait_for(lock, kReorderGather);
      // Choose among those already due (or the earliest due).
      std::size_t pick = 0;
      auto now = Clock::now();
      std::vector<std::size_t> due;
      for (std::size_t i = 0; i < held.size(); ++i) {
        if (held[i].release <= now) due.push_back(i);
        if (held[i].release < held[pick].release) pick = i;
      }
      if (due.empty()) {
        cv.wait_until(lock, held[pick].release);
        continue;
      }
      pick = faults.reorder ? due[rng() % due.size()] : due.front();
      Held item = std::move(held[pick]);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(pick));
      if (any_delivered && item.sequence < delivered_max) ++counts.reordered;
      delivered_max = std::max(delivered_max, item.sequence);
      any_delivered = true;
      // Freed before the callback, as the engines do (Note [Completion
      // contract]): a callback may submit again without waiting on itself.
      --outstanding;
      cv.notify_all();
      lock.unlock();
      if (item.callback) item.callback(std::move(item.status));
      lock.lock();
    }
    delivery_done = true;
  }
};

Result<std::unique_ptr<FaultInjectingEngine>> FaultInjectingEngine::create(IoEngineOptions inner,
                                                                           FaultOptions faults) {
  for (double p : {faults.eio_probability, faults.short_probability, faults.eintr_probability,
                   faults.delay_probability}) {
    if (!(p >= 0.0 && p <= 1.0)) return invalid_argument("fault probability {} is outside [0, 1]", p);
  }
  if (inner.result_filter) return invalid_argument("the inner engine's result_filter must be empty");
  auto state = std::make_shared<State>();
  state->faults = faults;
  state->rng.seed(faults.seed);
  state->in_flight_max = inner.requests_in_flight_max;
  state->alignment_bytes = inner.alignment_bytes;
  inner.result_filter = [weak = std::weak_ptr<State>(state)](const IoSite& site, std::int64_t result) {
    auto s = weak.lock();
    return s ? s->filter(site, result) : result;
  };
  STRATA_ASSIGN_OR_RETURN(auto engine, make_io_engine(std::move(inner)));
  std::unique_ptr<FaultInjectingEngine> wrapper(new FaultInjectingEngine());
  wrapper->name_ = fmt::format("faulty({})", engine->name());
  wrapper->inner_ = std::move(engine);
  wrapper->state_ = state;
  state->delivery = std::thread([s = state.get()] { s->deliver_loop(); });
  STRATA_LOG_INFO(
      "fault-injecting io engine over {}: seed {} (eio {}, short {}, eintr {}, delay {}, reorder {})",
      wrapper->inner_->name(), faults.seed, faults.eio_probability, faults.short_probability,
      faults.eintr_probability, faults.delay_probability, faults.reorder);
  return wrapper;
}

FaultInjectingEngine::~FaultInjectingEngine() {
  shutdown(ShutdownMode::kDrain);
}

const IoEngineOptions& FaultInjectingEngine::options() const {
  return inner_->options();
}

Result<FileId> FaultInjectingEngine::register_file(int fd, std::string_view label) {
  return inner_->register_file(fd, label);
}

Status FaultInjectingEngine::unregister_file(FileId file) {
  return inner_->unregister_file(file);
}

Status FaultInjectingEngine::submit(std::span<IoRequest> batch) {
  State& s = *state_;
  while (!batch.empty()) {
    std::size_t part = std::min<std::size_t>(batch.size(), s.in_flight_max);
    {
      std::unique_lock lock(s.mutex);
      s.cv.wait(lock, [&] { return s.stopping || s.outstanding + part <= s.in_flight_max; });
      if (s.stopping) return failed_precondition("{} is shut down; no new requests", name_);
      s.outstanding += static_cast<std::uint32_t>(part);
    }
    std::vector<IoCallback> originals;
    for (std::size_t i = 0; i < part; ++i) {
      originals.push_back(std::move(batch[i].on_done));
      batch[i].on_done = [state = state_.get(), callback = originals.back()](Status status) mutable {
        state->completed(std::move(callback), std::move(status));
      };
    }
    Status submitted = inner_->submit(batch.first(part));
    if (!submitted.ok()) {
      std::lock_guard lock(s.mutex);
      s.outstanding -= static_cast<std::uint32_t>(part);
      s.cv.notify_all();
      for (std::size_t i = 0; i < part; ++i) batch[i].on_done = std::move(originals[i]);
      return submitted;
    }
    batch = batch.subspan(part);
  }
  return Status::Ok();
}

void FaultInjectingEngine::shutdown(ShutdownMode mode) {
  if (!state_) return;
  inner_->shutdown(mode);  // every inner callback has run: all completions are held or delivered
  {
    std::lock_guard lock(state_->mutex);
    if (state_->delivery_done && !state_->delivery.joinable()) return;
    state_->stopping = true;
    state_->cv.notify_all();
  }
  if (state_->delivery.joinable()) state_->delivery.join();
}

IoEngineStats FaultInjectingEngine::stats() const {
  return inner_->stats();
}

std::uint64_t FaultInjectingEngine::seed() const {
  return state_->faults.seed;
}

FaultStats FaultInjectingEngine::fault_stats() const {
  std::lock_guard lock(state_->mutex);
  return state_->counts;
}

}  // namespace strata::offload
