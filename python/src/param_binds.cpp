// strata.torch._C.Engine's binds (engine.hpp): a parameter's storage pointed at its param
// chunk's lease while a module runs, and back at its poison region after.
//
// Note [Rebinding storage]
// A parameter keeps its torch.nn.Parameter object and its StorageImpl for its
// whole life; only the StorageImpl's data pointer changes: to the param chunk's
// lease (bind) or to the parameter's poison region (unbind, Note [Poisoned
// parameters]). Views autograd saved share the StorageImpl, so they follow. A
// parameter bound by several modules at once (tied weights, a layer called twice)
// keeps one lease and a count of binds.
#include <algorithm>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine.hpp"
#include "poison.hpp"
#include "strata/common/log.hpp"

namespace strata::torch_binding {

void Engine::bind(std::uint32_t id) {
  ++crossings_;
  Param& p = param(id);
  if (p.binds == 0 && (p.poison.in_view() || replaced(p))) drop_view(p);
  if (p.binds++ > 0) return;
  py::gil_scoped_release release;  // acquire may wait for the chunk's optimizer, wait for its load
  bind_now(p);
  order_.torch_after_strata();  // Note [Torch's stream]
}

void Engine::bind_many(const std::vector<std::uint32_t>& ids) {
  ++crossings_;
  std::vector<Param*> first_binds;
  first_binds.reserve(ids.size());
  for (std::uint32_t id : ids) {
    Param& p = param(id);
    if (p.binds == 0 && (p.poison.in_view() || replaced(p))) drop_view(p);
    if (p.binds++ == 0) first_binds.push_back(&p);
  }
  if (first_binds.empty()) return;
  std::size_t done = 0;
  try {
    py::gil_scoped_release release;
    for (; done < first_binds.size(); ++done) bind_now(*first_binds[done]);
    order_.torch_after_strata();  // one order for the whole batch (Note [Torch's stream])
  } catch (...) {
    for (std::size_t i = done + 1; i < first_binds.size(); ++i)
      --first_binds[i]->binds;  // bind_now undid its own
    throw;
  }
}

bool Engine::unbind_many(const std::vector<std::uint32_t>& ids) {
  ++crossings_;
  bool ordered = false;  // one order for the whole batch (Note [Torch's stream])
  for (std::uint32_t id : ids) {
    Param& p = param(id);
    if (p.binds > 0 && --p.binds == 0) unbind_now(p, &ordered);
  }
  return any_poison_hit();
}

void Engine::unbind(std::uint32_t id) {
  ++crossings_;
  Param& p = param(id);
  if (p.binds == 0) return;
  if (--p.binds == 0) unbind_now(p);
}

void Engine::unbind_all() {
  bool ordered = false;  // one order for all (Note [Torch's stream])
  for (Param& p : params_) unbind_now(p, &ordered);
}

void Engine::set_torch_stream(std::uintptr_t stream) {
  check_open();
  order_.set_torch_stream(stream);
}

std::vector<std::string> Engine::poison_hits() {
  std::vector<std::string> names;
  if (!any_poison_hit()) return names;
  for (Param& p : params_) {
    if (p.poison.hit()) {
      names.push_back(p.name);
      p.poison.rearm();
    }
  }
  clear_any_poison_hit();
  return names;
}

void Engine::bind_now(Param& p) {
  ++param_leases_;
  auto lease = rt_->acquire(p.id, StateKind::kParam, Access::kRead, Where::kDevice);
  if (!lease.ok()) {
    --p.binds;
    Status st = lease.status();
    st.with_context(fmt::format("binding parameter \"{}\"", p.name));
    if (st.code() == StatusCode::kOutOfBudget) st = Status(st.code(), st.message() + working_set_note());
    throw_if(st);
  }
  // On the sim device torch computes on this thread: wait here. On cuda torch's stream
  // waits instead, once the caller has acquired all it binds (Note [Torch's stream]).
  Status st = order_.active() ? Status::Ok() : rt_->wait(*lease);
  if (!st.ok()) {
    --p.binds;
    throw_if(st);
  }
  storage(p)->set_data_ptr_noswap(at::DataPtr(lease->data(), device_));
  p.lease = std::move(lease).value();
}

std::string Engine::working_set_note() const {
  const runtime::ChunkLayout& l = rt_->layout();
  std::vector<const Param*> bound;
  std::set<std::uint32_t> families;
  for (const Param& q : params_) {
    if (!q.lease.has_value()) continue;
    bound.push_back(&q);
    if (q.id < l.slots.size()) families.insert(l.slots[q.id].family);
  }
  constexpr std::size_t kNamed = 6;
  std::string names;
  for (std::size_t i = 0; i < std::min(bound.size(), kNamed); ++i)
    names += fmt::format("{}\"{}\"", i == 0 ? "" : ", ", bound[i]->name);
  if (bound.size() > kNamed) names += fmt::format(" and {} more", bound.size() - kNamed);
  return fmt::format(
      ". strata.torch held {} parameters of {} chunk families bound at this point ({}), each family in "
      "a GPU slot: the modules running at once and the parameters they read (the working set, "
      "docs/torch.md); it shows only when the model runs, so wrap() cannot check it up front",
      bound.size(), families.size(), names);
}

void Engine::unbind_now(Param& p, bool* ordered) {
  p.binds = 0;
  if (!p.lease.has_value()) return;
  if (ordered == nullptr || !*ordered) order_.strata_after_torch();  // the release's fence after torch's use
  if (ordered != nullptr) *ordered = true;
  if (p.poison.data() != nullptr) storage(p)->set_data_ptr_noswap(at::DataPtr(p.poison.data(), device_));
  p.lease.reset();
}

}  // namespace strata::torch_binding
