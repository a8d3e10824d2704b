#pragma once
// TorchCommunicator: a strata::comm::Communicator over the c10d ProcessGroup that
// torch.distributed already set up (issue #48; Note [Comm over torch.distributed]
// in torch_comm.cpp). Built against torch 1.13's and torch 2.x's headers alike.

#include <pybind11/pybind11.h>

#include <memory>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "strata/comm/communicator.hpp"

namespace strata::torch_binding {

//! A Communicator whose collectives run on `group` (gloo for host memory: every
//! buffer is host memory, device_buffers() is false). Shares ownership of the
//! group. Rank and size are the group's. Deterministic mode sums in rank order
//! (Note [Deterministic reduction]); without it the sums are the same, since
//! they are formed here either way. Fails: InvalidArgument for a null group or a
//! timeout <= 0.
Result<std::unique_ptr<comm::Communicator>> make_torch_communicator(
    c10::intrusive_ptr<c10d::ProcessGroup> group, comm::CommOptions options);

//! Defines strata.torch._C.TorchComm (torch_comm_binds.cpp).
void define_torch_comm(pybind11::module_& m);

}  // namespace strata::torch_binding
