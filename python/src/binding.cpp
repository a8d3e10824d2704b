// strata.torch._C: the torch extension under strata.torch, the module's
// definition. An Engine (engine.hpp, engine.cpp) owns one strata::Runtime and the
// torch parameters handed to it; the functional kernels are functional.cpp.
#include <torch/extension.h>

#include <cctype>
#include <string>

#include "engine.hpp"
#include "errors.hpp"
#include "functional.hpp"
#include "strata/strata.hpp"

namespace py = pybind11;

namespace strata::torch_binding {
namespace {

//! StateKind as module constants generated from the enum (issue #26): PARAM = 0,
//! GRAD, MASTER, STATE0, STATE1 (state_kind_name upper-cased), and STATE_KINDS,
//! the names in value order. _wrap.py takes them from here rather than numbering
//! the kinds itself.
void export_state_kinds(py::module_& m) {
  py::list names;
  for (std::size_t k = 0; k < runtime::kStateKindCount; ++k) {
    const std::string name(runtime::state_kind_name(static_cast<StateKind>(k)));
    std::string upper = name;
    for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    m.attr(upper.c_str()) = static_cast<int>(k);
    names.append(name);
  }
  m.attr("STATE_KINDS") = py::tuple(names);
}

//! Parses config text as Runtime creation will (unknown keys, types, values), without creating anything.
void validate_config(const std::string& config_json) {
  throw_if(Config::from_json_text(config_json).status());
}

}  // namespace
}  // namespace strata::torch_binding

PYBIND11_MODULE(_C, m) {
  using strata::torch_binding::Engine;
  m.doc() = "strata.torch's C++ engine (see strata/torch/__init__.py)";
  py::register_exception<strata::torch_binding::StrataError>(m, "StrataError", PyExc_RuntimeError);
  py::class_<Engine>(m, "Engine")
      .def(py::init<const std::string&>(), py::arg("config_json"))
      .def("close", &Engine::close)
      .def("register_param", &Engine::register_param)
      .def("adopt", &Engine::adopt)
      .def("adopt_unset", &Engine::adopt_unset)  // deferred init (#28)
      .def("init_many", &Engine::init_many)
      .def("family_of", &Engine::family_of)
      .def("layout", &Engine::layout)  // #28: padding of the runtime's chunk search
      .def("restore", &Engine::restore)
      .def("bind", &Engine::bind)
      .def("unbind", &Engine::unbind)
      .def("bind_many", &Engine::bind_many)
      .def("unbind_many", &Engine::unbind_many)
      .def("unbind_all", &Engine::unbind_all)
      .def("set_torch_stream", &Engine::set_torch_stream)
      .def("binds", &Engine::binds)
      .def("hand_grad", &Engine::hand_grad)
      .def("gradients_pending", &Engine::gradients_pending)
      .def("end_backward", &Engine::end_backward)
      .def("poison_hits", &Engine::poison_hits)
      .def("begin_micro_batch", &Engine::begin_micro_batch)
      .def("set_grad_scale", &Engine::set_grad_scale)
      .def("set_group", &Engine::set_group)
      .def("set_group_hyper", &Engine::set_group_hyper)
      .def("read", &Engine::read)
      .def("write", &Engine::write)
      .def("steps", &Engine::steps)
      .def("set_steps", &Engine::set_steps)
      .def("step", &Engine::step)
      .def("flush", &Engine::flush)
      .def("abort_step", &Engine::abort_step)
      .def("save_checkpoint", &Engine::save_checkpoint)
      .def("load_checkpoint", &Engine::load_checkpoint)
      .def("begin_checkpoint", &Engine::begin_checkpoint)
      .def("finish_checkpoint", &Engine::finish_checkpoint)
      .def("checkpoint_in_flight", &Engine::checkpoint_in_flight)
      .def("describe", &Engine::describe)
      .def("device_kind", &Engine::device_kind)
      .def("separate_master", &Engine::separate_master)
      .def("write_trace", &Engine::write_trace)
      // Parameters between steps (Note [Parameters between steps]).
      .def("materialise", &Engine::materialise)
      .def("sync_views", &Engine::sync_views)
      .def("drop_views", &Engine::drop_views)
      .def("is_view", &Engine::is_view)
      .def("counters", &Engine::counters)
      .def("totals", &Engine::totals);  // #26: model.strata.totals
  m.def("zero_totals",
        [] { return strata::torch_binding::totals_dict(strata::Stats{}); });  // before an engine
  strata::torch_binding::export_state_kinds(m);  // #26: PARAM..STATE1 from the C++ enum
  m.def("validate_config", &strata::torch_binding::validate_config, py::arg("config_json"));
  strata::torch_binding::register_functional(m);  // fused_step (functional.cpp, #26)
}
