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
#include "torch_comm.hpp"

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

//! The engine's own methods, which strata.torch's hooks and views call (not public operations).
void define_engine_internals(py::class_<Engine>& engine) {
  engine
      .def(py::init<const std::string&, std::shared_ptr<comm::Communicator>>(), py::arg("config_json"),
           py::arg("comm") = py::none())
      .def("close", &Engine::close)
      .def("register_param", &Engine::register_param)
      .def("adopt", &Engine::adopt)
      .def("adopt_unset", &Engine::adopt_unset)  // deferred init (#28)
      .def("init_many", &Engine::init_many)
      .def("family_of", &Engine::family_of)
      .def("state_range", &Engine::state_range)  // #48: this rank's part of a tensor's optimizer states
      .def("layout", &Engine::layout)            // #28: padding of the runtime's chunk search
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
      .def("device_kind", &Engine::device_kind)
      .def("separate_master", &Engine::separate_master)
      // Parameters between steps (Note [Parameters between steps]).
      .def("materialise", &Engine::materialise)
      .def("sync_views", &Engine::sync_views)
      .def("drop_views", &Engine::drop_views)
      .def("is_view", &Engine::is_view)
      .def("counters", &Engine::counters)
      .def("totals", &Engine::totals);  // #26: model.strata.totals
}

//! The engine's public operations: one .def each, written by scripts/gen-api from api/ops.py.
void define_engine_operations(py::class_<Engine>& engine) {
  engine
      // generated from api/ops.py by scripts/gen-api: do not edit (Note [Public operations])
      // clang-format off
      .def("read_tensor", &Engine::read_tensor, py::arg("tensor"), py::arg("kind"),
           "Copies a tensor's state `kind` as fp32 into out (as many values as its elements). Between steps;"
           " blocks (flushes, may read NVMe). Fails: InvalidArgument (unknown id, wrong count), "
           "FailedPrecondition (a state this optimizer does not keep).")
      .def("step", &Engine::step,
           "Ends the step: runs or waits for every optimizer step, re-plans after the warm-up step. Blocks. "
           "Fails with the first background error (an NVMe EIO, a corrupt chunk); the last completed step's "
           "state is intact and abort_step discards this one.")
      .def("abort_step", &Engine::abort_step,
           "Discards the step in progress (Note [Failed steps]): waits for background work and launched "
           "compute, drops the step's gradients, forgets its trace and clears the runtime's error, so the "
           "next step starts clean. Blocks. Fails: FailedPrecondition while leases are held (release them "
           "first).")
      .def("flush", &Engine::flush,
           "Waits until the last step's states are on their home tiers (NVMe write-backs outlive step). "
           "Returns the first background error. Blocks. read_tensor and freeing the runtime flush by "
           "themselves.")
      .def("write_chrome_trace", &Engine::write_chrome_trace, py::arg("path"),
           "Writes the Chrome trace (chrome://tracing, Perfetto) of the recorded timeline to `path`. Blocks "
           "on the write. Fails: the file's error, naming the path.")
      .def("begin_micro_batch", &Engine::begin_micro_batch, py::arg("last"),
           "Starts a micro-batch: with last false no optimizer runs and gradients are kept for the next "
           "micro-batch to add to (access accumulate). Fails: FailedPrecondition while leases are held.")
      .def("set_grad_scale", &Engine::set_grad_scale, py::arg("scale"),
           "Multiplies every gradient by scale (1/loss_scale) from the next optimizer step on; set it before"
           " backward.")
      .def("set_tensor_group", &Engine::set_tensor_group, py::arg("tensor"), py::arg("group"),
           "Puts a tensor in parameter group `group` (< 65536; 0 by default; Note [Parameter groups]). "
           "Before the first lease and between steps. Fails: InvalidArgument (unknown id, group too large).")
      .def("add_to_working_set", &Engine::add_to_working_set, py::arg("tensor"), py::arg("set"),
           "Declares that `tensor` is leased together with the other tensors of working set `set` (a torch "
           "module's parameters and its ancestors'): every plan keeps a GPU chunk slot for each family of "
           "the largest set, and one for a gradient (Note [Working sets]). Before the first acquire or init;"
           " later ones count from the next plan. Fails: InvalidArgument (unknown id).")
      .def("set_group_hyper", &Engine::set_group_hyper, py::arg("group"), py::arg("lr"),
           py::arg("weight_decay"),
           "Sets a group's lr and weight decay (finite, >= 0), overriding the optimizer's; the values in "
           "effect when a family's optimizer starts are used. Between step and the next backward; "
           "FailedPrecondition otherwise, InvalidArgument for a bad value.")
      .def("write_tensor", &Engine::write_tensor, py::arg("tensor"), py::arg("kind"), py::arg("values"),
           "Overwrites state `kind` of a tensor (param, master, state0/1; not grad) from fp32 values (as "
           "many as its elements; a checkpoint's load). Between steps; blocks. Fails: InvalidArgument "
           "(unknown id, wrong count), FailedPrecondition (leases held, a state it does not have, grad).")
      .def("tensor_steps", &Engine::tensor_steps, py::arg("tensor"),
           "The optimizer steps applied to a tensor (its bias-correction step counter). Fails: "
           "InvalidArgument (unknown id).")
      .def("set_tensor_steps", &Engine::set_tensor_steps, py::arg("tensor"), py::arg("steps"),
           "Sets a tensor's step counter (>= 0; a checkpoint's load). Between steps. Fails: InvalidArgument "
           "(unknown id, negative).")
      .def("save_checkpoint", &Engine::save_checkpoint, py::arg("dir"),
           "Writes a crash-safe checkpoint of every tensor's param, master, optimizer states and step "
           "counter into directory `dir` (created when missing; not inside an NVMe swap directory). A crash "
           "or error at any point leaves the previous checkpoint there loadable. Between steps; blocks. "
           "Fails: InvalidArgument, FailedPrecondition (leases held), PermissionDenied / NoSpace / IoError "
           "naming the file.")
      .def("begin_checkpoint", &Engine::begin_checkpoint, py::arg("dir"),
           "Starts a checkpoint of the state as of this call into `dir` and returns at once; training goes "
           "on while it is written. Between steps; waits for a save still in flight first (returning its "
           "error). Errors of the background save surface in finish_checkpoint / checkpoint_in_flight and "
           "leave the previously published checkpoint untouched.")
      .def("finish_checkpoint", &Engine::finish_checkpoint,
           "Waits for the save begun by begin_checkpoint; its outcome (Ok when none). Blocks.")
      .def("checkpoint_in_flight", &Engine::checkpoint_in_flight,
           "Polls the save begun by begin_checkpoint: true while it runs, else false; its error when it "
           "failed (finish_checkpoint collects it). Never blocks.")
      .def("load_checkpoint", &Engine::load_checkpoint, py::arg("dir"),
           "Loads the checkpoint published in `dir` (chunk size, budgets and placement may differ from the "
           "saving runtime's). A checkpoint of another model, a newer format, a flipped byte, a truncated "
           "file or a missing manifest is refused whole, naming the file. Between steps; blocks.")
      .def("describe", &Engine::describe,
           "\"device sim (...); plan: ...\" for a progress line or a log. Never fails.")
      // clang-format on
      // end of generated
      ;  // the generated chain ends here
}

}  // namespace
}  // namespace strata::torch_binding

PYBIND11_MODULE(_C, m) {
  using strata::torch_binding::Engine;
  m.doc() = "strata.torch's C++ engine (see strata/torch/__init__.py)";
  py::register_exception<strata::torch_binding::StrataError>(m, "StrataError", PyExc_RuntimeError);
  strata::torch_binding::define_torch_comm(
      m);  // TorchComm (torch_comm_binds.cpp, #48), before Engine takes one
  py::class_<Engine> engine(m, "Engine");
  strata::torch_binding::define_engine_internals(engine);
  strata::torch_binding::define_engine_operations(engine);
  m.def("zero_totals",
        [] { return strata::torch_binding::totals_dict(strata::Stats{}); });  // before an engine
  strata::torch_binding::export_state_kinds(m);  // #26: PARAM..STATE1 from the C++ enum
  m.def("validate_config", &strata::torch_binding::validate_config, py::arg("config_json"));
  strata::torch_binding::register_functional(m);  // fused_step (functional.cpp, #26)
}
