// strata.torch._C.TorchComm: the TorchCommunicator (torch_comm.cpp) as Python sees
// it, made from a torch.distributed ProcessGroup. Each method starts one
// collective on torch CPU tensors' memory and waits for it (without the GIL), so
// that a test can check every collective of the comm layer under torch.distributed
// (tests/torch/test_torch_comm.py). wrap() hands one to the runtime (Note [Ranks
// under torchrun] in python/strata/torch/_processes.py).
#include <torch/extension.h>

#include <string>
#include <vector>

#include "errors.hpp"
#include "torch_comm.hpp"

namespace strata::torch_binding {
namespace {

namespace py = pybind11;

//! The comm layer's element type of a chunk tensor; ValueError for any other.
comm::DType chunk_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return comm::DType::kF32;
    case at::kBFloat16:
      return comm::DType::kBF16;
    case at::kHalf:
      return comm::DType::kF16;
    default:
      throw py::value_error("strata TorchComm: a chunk tensor must be float32, bfloat16 or float16, not " +
                            std::string(c10::toString(t.scalar_type())));
  }
}

//! A CPU, contiguous tensor; ValueError otherwise.
void check_host(const at::Tensor& t, const char* name) {
  if (!t.device().is_cpu() || !t.is_contiguous()) {
    throw py::value_error(std::string("strata TorchComm: ") + name +
                          " must be a contiguous CPU tensor (the communicator moves host memory)");
  }
}

using Comm = comm::Communicator;

//! A chunk collective's tensors: host memory, one chunk dtype (returned), `whole`
//! holding size() times `part`'s elements; ValueError otherwise.
comm::DType chunk_pair(const Comm& c, const at::Tensor& whole, const at::Tensor& part, const char* op) {
  check_host(whole, "a chunk tensor");
  check_host(part, "a chunk tensor");
  const comm::DType dtype = chunk_dtype(part);
  if (whole.scalar_type() != part.scalar_type() || whole.numel() != part.numel() * c.size()) {
    throw py::value_error(std::string("strata TorchComm.") + op +
                          ": both tensors of one dtype, the whole one (reduce_scatter's send, all_gather's "
                          "recv) with size * the other's elements");
  }
  return dtype;
}

void wait(Result<comm::Handle> started) {
  comm::Handle h = value_or_throw(std::move(started));
  Status s;
  {
    py::gil_scoped_release no_gil;
    s = h.wait();
  }
  throw_if(s);
}

}  // namespace

void define_torch_comm(py::module_& m) {
  py::class_<Comm, std::shared_ptr<Comm>>(
      m, "TorchComm", "strata's communicator over a torch.distributed ProcessGroup (host memory; gloo)")
      .def(py::init([](c10::intrusive_ptr<c10d::ProcessGroup> group, std::int64_t timeout_ms,
                       bool deterministic) {
             comm::CommOptions options;
             options.timeout = std::chrono::milliseconds(timeout_ms);
             options.deterministic = deterministic;
             return std::shared_ptr<Comm>(value_or_throw(make_torch_communicator(std::move(group), options)));
           }),
           py::arg("group"), py::arg("timeout_ms") = 30000, py::arg("deterministic") = true)
      .def_property_readonly("rank", &Comm::rank)
      .def_property_readonly("size", &Comm::size)
      .def_property_readonly("backend", [](const Comm& c) { return std::string(c.backend()); })
      .def(
          "reduce_scatter",
          [](Comm& c, const at::Tensor& send, at::Tensor& recv) {
            const comm::DType dtype = chunk_pair(c, send, recv, "reduce_scatter");
            wait(c.reduce_scatter(send.data_ptr(), recv.data_ptr(), static_cast<std::size_t>(recv.numel()),
                                  dtype));
          },
          py::arg("send"), py::arg("recv"), "recv = the sum over ranks, in rank order, of slice rank of send")
      .def(
          "all_gather",
          [](Comm& c, const at::Tensor& send, at::Tensor& recv) {
            const comm::DType dtype = chunk_pair(c, recv, send, "all_gather");
            wait(c.all_gather(send.data_ptr(), recv.data_ptr(), static_cast<std::size_t>(send.numel()),
                              dtype));
          },
          py::arg("send"), py::arg("recv"), "slice r of recv = rank r's send")
      .def(
          "all_reduce",
          [](Comm& c, std::vector<double> values, const std::string& op) {
            if (op != "sum" && op != "max")
              throw py::value_error("strata TorchComm.all_reduce: op is sum or max");
            wait(c.all_reduce(values, op == "sum" ? comm::ReduceOp::kSum : comm::ReduceOp::kMax));
            return values;
          },
          py::arg("values"), py::arg("op") = "sum", "the element-wise sum (in rank order) or max over ranks")
      .def(
          "broadcast",
          [](Comm& c, at::Tensor& data, int root) {
            check_host(data, "data");
            wait(c.broadcast(data.data_ptr(), static_cast<std::size_t>(data.nbytes()), root));
          },
          py::arg("data"), py::arg("root"), "root's bytes of data into every rank's data")
      .def(
          "abort", [](Comm& c, const std::string& reason) { c.abort(reason); }, py::arg("reason"))
      .def("stats", [](const Comm& c) {
        const comm::CommStats s = c.stats();
        py::dict d;
        d["reduce_scatter_bytes"] = s.reduce_scatter_bytes;
        d["all_gather_bytes"] = s.all_gather_bytes;
        d["all_reduce_bytes"] = s.all_reduce_bytes;
        d["broadcast_bytes"] = s.broadcast_bytes;
        d["collectives"] = s.collectives;
        d["wait_s"] = s.wait_s;
        return d;
      });
}

}  // namespace strata::torch_binding
