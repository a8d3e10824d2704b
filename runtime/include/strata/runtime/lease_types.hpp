#pragma once
// The vocabulary of a lease (strata/runtime/runtime.hpp): what it may do with the
// memory, where its pointer is valid, and what releasing it did. Below Runtime so
// that the runtime's parts name them without Runtime's own header.

#include <cstdint>

namespace strata::runtime {

//! What a lease may do with the memory.
enum class Access : std::uint8_t {
  kRead,        //!< read only (params in forward and backward)
  kWrite,       //!< overwrite the whole tensor (a gradient's first micro-batch)
  kAccumulate,  //!< read-modify-write (later micro-batches add to the gradient)
};

//! Where the lease's pointer is valid.
enum class Where : std::uint8_t { kDevice, kHost };

//! What releasing a lease did besides unpinning (Note [Scheduler] in runtime/src/scheduler.cpp).
enum class Released : std::uint8_t {
  kUnpinned,          //!< the pin alone (or the lease was already released)
  kOptimizerStarted,  //!< and its family's gradients became complete: its optimizer step was started (queued)
};

}  // namespace strata::runtime
