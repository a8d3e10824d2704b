#pragma once
// One torch parameter handed to strata.torch's Engine (engine.hpp), and what the
// binding does with its storage between steps (Note [Parameters between steps] in
// param_views.cpp): the StorageImpl strata rebinds, whether `p.data = t` replaced it,
// the view of its poison region that serves reads between steps, and handing a value
// written there to the runtime.

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "poison.hpp"
#include "strata/strata.hpp"

namespace strata::torch_binding {

//! One parameter handed to the runtime.
struct Param {
  std::string name;
  at::Tensor tensor;  //!< the torch.nn.Parameter (its StorageImpl is rebound)
  TensorId id = 0;
  std::uint64_t numel = 0;
  PoisonRegion poison;
  std::optional<Lease> lease;
  int binds = 0;
  //! The StorageImpl adopt() found: the one strata rebinds. `p.data = t` gives the
  //! tensor another one (Note [Parameters between steps]).
  at::Storage home;
  std::vector<std::int64_t> shape;  //!< the registered shape and dtype (a replacement must keep them)
  at::ScalarType dtype = at::kFloat;
  bool frozen = false;  //!< registered without a gradient
};

//! The storage strata rebinds (the tensor's own until adopt(), then the one adopt() found).
inline c10::StorageImpl* storage(Param& p) {
  return p.home.unsafeGetStorageImpl() != nullptr ? p.home.unsafeGetStorageImpl()
                                                  : p.tensor.storage().unsafeGetStorageImpl();
}
//! `p.data = t` (or set_) gave the parameter another storage than the one strata rebinds.
inline bool replaced(const Param& p) {
  return p.home.unsafeGetStorageImpl() != nullptr &&
         p.tensor.storage().unsafeGetStorageImpl() != p.home.unsafeGetStorageImpl();
}
//! The region as a flat tensor of the parameter's dtype (open views only).
inline at::Tensor view_of(Param& p) {
  return at::from_blob(p.poison.data(), {static_cast<std::int64_t>(p.numel)},
                       at::TensorOptions().dtype(p.dtype));
}

//! Reads the runtime's current value into the parameter's region and seals it
//! read-only (Note [Parameters between steps]). Blocks (releases the GIL); throws on a
//! failed read, the region back to poison.
void fill_view(strata::Runtime& rt, Param& p);
//! Hands a parameter written between steps (a dirty view, or `p.data = t`) to the
//! runtime; afterwards its region is a sealed view holding the value handed. True
//! when it was written. A replacement of another shape or dtype is dropped and raises.
bool push_written(strata::Runtime& rt, Param& p);
//! Points the tensor at the storage strata rebinds again (after `p.data = t`) and the
//! region at poison.
void restore_home(Param& p);

}  // namespace strata::torch_binding
