#pragma once
// StreamOrder: torch's CUDA stream against strata's compute stream, by events
// (Note [Torch's stream]).
//
// Note [Torch's stream]
// On the GPU torch queues its kernels on its current stream; strata's runtime orders a
// chunk's arrival (acquire) and its reuse (release) against its own compute stream, a
// different, non-blocking stream. Without an order between the two, torch could read a
// parameter before its copy lands, and strata could copy over a slot, or copy a gradient
// down, while torch's kernels still use it. On the sim device torch computes on the host
// thread, so the binding waits for each lease on the host (Runtime::wait). On cuda the
// host does not wait (#27 item 5): after acquiring, torch's stream waits for the compute
// stream (which waits for the chunk's arrival); before releasing, the compute stream
// waits for torch's stream (so the release's fence comes after torch's last use). One
// event does both, recorded and waited at once (Note [Event semantics] in
// strata/memory/device.hpp). Torch's stream is the one current when the root module's
// forward starts (_hooks.py sets it); torch runs a backward node on its forward's stream,
// so backward's hooks use the same one. A forward that switches streams inside itself is
// not ordered: strata.torch cannot see it.

#include <cstdint>

#include "errors.hpp"
#include "strata/strata.hpp"

namespace strata::torch_binding {

class StreamOrder {
 public:
  //! Active on cuda only; on sim every call is a no-op and callers wait on the host.
  void attach(strata::Runtime& rt) {
    if (rt.device().kind() != memory::DeviceKind::kCuda) return;
    rt_ = &rt;
    event_ = value_or_throw(rt.device().create_event());
  }
  bool active() const { return rt_ != nullptr; }
  //! Torch's current stream (a cudaStream_t's value; 0 is the legacy default stream).
  void set_torch_stream(std::uintptr_t stream) { torch_ = memory::NativeStream{stream}; }

  //! Torch's later work waits for what the compute stream has queued (a lease's arrival).
  void torch_after_strata() {
    if (!active()) return;
    throw_if(rt_->device().record(event_, rt_->compute_stream()));
    throw_if(rt_->device().wait_native(torch_, event_));
  }
  //! The compute stream's later work (a release's fence) waits for torch's queued work.
  void strata_after_torch() {
    if (!active()) return;
    throw_if(rt_->device().record_native(event_, torch_));
    throw_if(rt_->device().wait(rt_->compute_stream(), event_));
  }
  //! Blocks until torch's queued work is done; errors are ignored (the engine is closing,
  //! and a failed device reports again on the runtime's own synchronize).
  void finish_torch() noexcept {
    if (!active()) return;
    if (rt_->device().record_native(event_, torch_).ok()) rt_->device().synchronize(event_).ignore();
  }
  //! Frees the event (before the runtime that made it).
  void detach() {
    event_ = {};
    rt_ = nullptr;
  }

 private:
  strata::Runtime* rt_ = nullptr;
  memory::Event event_;
  memory::NativeStream torch_{};
};

}  // namespace strata::torch_binding
