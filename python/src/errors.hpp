#pragma once
// How strata.torch._C reports a failed strata call to Python, shared by the Engine
// Engine (engine.cpp), the module (binding.cpp) and the functional kernels (functional.cpp).

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <utility>

#include "strata/common/status.hpp"

namespace strata::torch_binding {

//! Thrown for every failed strata call; Python sees strata.torch.StrataError
//! (a RuntimeError, registered by the module init), or ValueError for InvalidArgument.
struct StrataError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void throw_if(const Status& status) {
  if (status.ok()) return;
  if (status.code() == StatusCode::kInvalidArgument) throw pybind11::value_error(status.to_string());
  throw StrataError(status.to_string());
}

template <typename T>
T value_or_throw(Result<T> result) {
  throw_if(result.status());
  return std::move(result).value();
}

}  // namespace strata::torch_binding
