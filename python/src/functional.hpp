#pragma once
// strata.torch.functional's kernels (functional.cpp): strata's fused optimizer step over
// plain torch tensors, apart from the Engine (engine.hpp), issue #26.

#include <pybind11/pybind11.h>

namespace strata::torch_binding {

//! Defines _C.fused_step and _C.optimizer_states (Note [Optimizer state names]) on the
//! extension module (called from its init).
void register_functional(pybind11::module_& m);

}  // namespace strata::torch_binding
