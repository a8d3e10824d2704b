// Poison regions and the SIGSEGV handler that turns a touch into a recorded hit
// (Note [Poisoned parameters] in poison.hpp).
#include "poison.hpp"

#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <utility>

#include "strata/common/assert.hpp"

namespace strata::torch_binding {
namespace {

// What a fault in a region means (Note [Poisoned parameters]).
enum Mode : int { kPoison = 0, kViewReadOnly = 1, kViewWritable = 2 };

struct Entry {
  std::atomic<std::uintptr_t> base{0};  // 0: free
  std::atomic<std::size_t> bytes{0};
  std::atomic<bool> hit{false};
  std::atomic<int> mode{kPoison};
  std::atomic<bool> dirty{false};  // a sealed view was written
};

Entry g_entries[kPoisonRegionsMax];
std::atomic<std::size_t> g_used{0};  // entries [0, g_used) may be live
std::atomic<bool> g_any_hit{false};
std::mutex g_table_mu;  // allocation of entries (never taken by the handler)
struct sigaction g_previous;
std::atomic<bool> g_installed{false};

void map_zero_pages(void* base, std::size_t bytes) {
  // mmap is a plain system call: safe in a signal handler in practice.
  ::mmap(base, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
}

void on_segv(int sig, siginfo_t* info, void* context) {
  const auto address = reinterpret_cast<std::uintptr_t>(info->si_addr);
  const std::size_t used = g_used.load(std::memory_order_acquire);
  for (std::size_t i = 0; i < used; ++i) {
    const std::uintptr_t base = g_entries[i].base.load(std::memory_order_acquire);
    if (base == 0) continue;
    if (address >= base && address < base + g_entries[i].bytes.load(std::memory_order_relaxed)) {
      const int mode = g_entries[i].mode.load(std::memory_order_acquire);
      if (mode != kPoison) {
        // A write to a sealed view: remember it and let it through. (kViewWritable:
        // another thread made it writable between this fault and now.)
        g_entries[i].dirty.store(true, std::memory_order_release);
        ::mprotect(reinterpret_cast<void*>(base), g_entries[i].bytes.load(std::memory_order_relaxed),
                   PROT_READ | PROT_WRITE);
        g_entries[i].mode.store(kViewWritable, std::memory_order_release);
        return;
      }
      g_entries[i].hit.store(true, std::memory_order_release);
      g_any_hit.store(true, std::memory_order_release);
      map_zero_pages(reinterpret_cast<void*>(base), g_entries[i].bytes.load(std::memory_order_relaxed));
      return;  // the faulting instruction runs again, on zeros
    }
  }
  // Not ours: hand it to whoever handled SIGSEGV before.
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 && g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
    return;
  }
  ::signal(SIGSEGV, SIG_DFL);  // the instruction faults again and the default action ends the process
}

}  // namespace

void install_poison_handler() {
  std::lock_guard lock(g_table_mu);
  struct sigaction current;
  ::sigaction(SIGSEGV, nullptr, &current);
  if (g_installed.load() && (current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == &on_segv) return;
  struct sigaction action;
  std::memset(&action, 0, sizeof action);
  action.sa_sigaction = &on_segv;
  action.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGSEGV, &action, &g_previous);
  g_installed.store(true);
}

bool any_poison_hit() {
  return g_any_hit.load(std::memory_order_acquire);
}

Result<PoisonRegion> PoisonRegion::create(std::size_t bytes) {
  STRATA_CHECK(bytes > 0);
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const std::size_t rounded = (bytes + page - 1) / page * page;
  void* base = ::mmap(nullptr, rounded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) {
    return out_of_memory("poison region of {} bytes: mmap failed: {}", rounded, std::strerror(errno));
  }
  std::lock_guard lock(g_table_mu);
  std::int64_t slot = -1;
  const std::size_t used = g_used.load();
  for (std::size_t i = 0; i < used; ++i) {
    if (g_entries[i].base.load() == 0) {
      slot = static_cast<std::int64_t>(i);
      break;
    }
  }
  if (slot < 0) {
    if (used == kPoisonRegionsMax) {
      ::munmap(base, rounded);
      return out_of_budget("more than {} parameters are bound to strata in this process", kPoisonRegionsMax);
    }
    slot = static_cast<std::int64_t>(used);
  }
  Entry& e = g_entries[slot];
  e.hit.store(false);
  e.mode.store(kPoison);
  e.dirty.store(false);
  e.bytes.store(rounded);
  e.base.store(reinterpret_cast<std::uintptr_t>(base), std::memory_order_release);
  if (static_cast<std::size_t>(slot) == used) g_used.store(used + 1, std::memory_order_release);
  PoisonRegion r;
  r.base_ = base;
  r.bytes_ = rounded;
  r.slot_ = slot;
  return r;
}

PoisonRegion::PoisonRegion(PoisonRegion&& other) noexcept {
  *this = std::move(other);
}

PoisonRegion& PoisonRegion::operator=(PoisonRegion&& other) noexcept {
  if (this != &other) {
    this->~PoisonRegion();
    base_ = std::exchange(other.base_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    slot_ = std::exchange(other.slot_, -1);
  }
  return *this;
}

PoisonRegion::~PoisonRegion() {
  if (base_ == nullptr) return;
  {
    std::lock_guard lock(g_table_mu);
    g_entries[slot_].base.store(0, std::memory_order_release);
  }
  ::munmap(base_, bytes_);
  base_ = nullptr;
}

bool PoisonRegion::hit() const {
  return base_ != nullptr && g_entries[slot_].hit.load(std::memory_order_acquire);
}

void PoisonRegion::rearm() {
  if (base_ == nullptr) return;
  // Poison before the pages go: a touch in between is a recorded hit, never a view's write.
  g_entries[slot_].mode.store(kPoison, std::memory_order_release);
  g_entries[slot_].dirty.store(false, std::memory_order_release);
  ::mmap(base_, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  g_entries[slot_].hit.store(false, std::memory_order_release);
  // g_any_hit is cleared by the binding once it has looked at every region.
}

Status PoisonRegion::open_view() {
  STRATA_CHECK(base_ != nullptr);
  // Writable before the pages exist, so the binding's own fill does not fault.
  g_entries[slot_].mode.store(kViewWritable, std::memory_order_release);
  void* got = ::mmap(base_, bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
  if (got == MAP_FAILED) {
    const int err = errno;
    rearm();
    return out_of_memory("a view of {} bytes over a parameter's poison region: mmap failed: {}", bytes_,
                         std::strerror(err));
  }
  return Status::Ok();
}

void PoisonRegion::seal_view() {
  STRATA_CHECK(in_view());
  g_entries[slot_].dirty.store(false, std::memory_order_release);
  g_entries[slot_].mode.store(kViewReadOnly, std::memory_order_release);
  ::mprotect(base_, bytes_, PROT_READ);
}

bool PoisonRegion::in_view() const {
  return base_ != nullptr && g_entries[slot_].mode.load(std::memory_order_acquire) != kPoison;
}

bool PoisonRegion::view_dirty() const {
  return base_ != nullptr && g_entries[slot_].dirty.load(std::memory_order_acquire);
}

void clear_any_poison_hit() {
  g_any_hit.store(false, std::memory_order_release);
}

}  // namespace strata::torch_binding
