#pragma once
// The `local` backend: W ranks as threads of one process, for unit tests (and
// TSan). Collectives meet in shared memory: each rank reads the others' input
// buffers and writes only its own output, so every sum is formed in rank order
// (Note [Deterministic reduction]) whatever CommOptions::deterministic says.

#include <memory>
#include <vector>

#include "strata/comm/communicator.hpp"

namespace strata::comm {

//! Creates a group of `size` communicators; element r is rank r, to be used by
//! one thread (one per rank). The group's shared state lives while any of them
//! does. Destroying a rank's communicator makes collectives it never joined fail
//! on the other ranks at once ("rank r left"). Fails: InvalidArgument for size
//! outside [1, 4096] or a zero timeout.
Result<std::vector<std::unique_ptr<Communicator>>> make_local_group(int size, CommOptions options = {});

}  // namespace strata::comm
