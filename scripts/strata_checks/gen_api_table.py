"""gen-api: the files it writes and reads, api/ops.py's table and what an entry's C and C++
forms are (types, names, parameters, wrapped lines)."""
import importlib.util
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent  # the checkout
HEADER = "api/include/strata/strata.h"
SHIMS = "api/src/strata_c.cpp"
BINDING = "python/src/binding.cpp"
ENGINE = "python/src/engine.hpp"  # read only: the Engine methods the binding's .def lines name
CPP_HEADERS = {"runtime": ["runtime/include/strata/runtime/runtime.hpp", "api/include/strata/strata.hpp"],
               "config": ["api/include/strata/strata.hpp"]}
CPP_CLASS = {"runtime": "Runtime", "config": "Config"}
BEGIN = "generated from api/ops.py by scripts/gen-api: do not edit"
END = "end of generated"
WIDTH = 110
C, CPP, PY = "c", "cpp", "py"  # the surfaces, as api/ops.py names them

# Abstract argument type -> (C++ parameter type, C parameters ({n}: the argument's name),
# whether the C pointer must not be NULL, the C++ argument made from the C ones, the
# Python binding's: "arg" (a py::arg) or None (returned instead)).
TYPES = {
    "tensor": ("TensorId", ["uint32_t {n}"], False, "{n}", "arg"),
    "state": ("StateKind", ["strata_state {n}"], False, "static_cast<strata::StateKind>({n})", "arg"),
    "access": ("Access", ["strata_access {n}"], False, "static_cast<strata::Access>({n})", "arg"),
    "where": ("Where", ["strata_where {n}"], False, "static_cast<strata::Where>({n})", "arg"),
    "values": ("std::span<const float>", ["const float* {n}", "uint64_t count"], True,
               "std::span<const float>({n}, count)", "arg"),
    "out": ("std::span<float>", ["float* {n}", "uint64_t count"], True, "std::span<float>({n}, count)", None),
    "path": ("const std::string&", ["const char* {n}"], True, "{n}", "arg"),
    "name": ("std::string", ["const char* {n}"], True, "{n}", "arg"),
    "text": ("std::string_view", ["const char* {n}"], True, "{n}", "arg"),
    "file": ("const std::filesystem::path&", ["const char* {n}"], True, "{n}", "arg"),
    "shape": ("std::vector<std::int64_t>", ["const int64_t* {n}", "size_t ndim"], False,
              "std::vector<std::int64_t>({n}, {n} + ndim)", "arg"),
    "u32": ("std::uint32_t", ["uint32_t {n}"], False, "{n}", "arg"),
    "i64": ("std::int64_t", ["int64_t {n}"], False, "{n}", "arg"),
    "f32": ("float", ["float {n}"], False, "{n}", "arg"),
    "bool": ("bool", ["int {n}"], False, "{n} != 0", "arg"),
    "lease": ("const Lease&", ["const strata_lease* {n}"], True, "{n}->lease", "arg"),
    "fn": ("std::function<void()>", ["void (*{n})(void* user)", "void* user"], True, "[{n}, user] {{ {n}(user); }}",
           "arg"),
}
# Result<T> -> (C++ type, the C out parameter ({o}: c_out), the C line storing the value r).
RESULTS = {
    "tensor": ("Result<TensorId>", "uint32_t* {o}", "*{o} = *r;"),
    "i64": ("Result<std::int64_t>", "int64_t* {o}", "*{o} = *r;"),
    "bool": ("Result<bool>", "int* {o}", "*{o} = *r ? 1 : 0;"),
    "lease": ("Result<Lease>", "strata_lease** {o}", "*{o} = new strata_lease{{std::move(r).value()}};"),
    "config": ("Result<Config>", "strata_config** {o}", None),
    "stats": ("Result<StepStats>", "strata_step_stats* {o}, size_t out_size", None),
}
# The enum range checks a generated shim makes (before calling the runtime).
RANGE_CHECKS = {
    "state": ("{n} < STRATA_PARAM || {n} > STRATA_STATE1",
              'fail(strata::invalid_argument("state {{}} is not a strata_state", static_cast<int>({n})))'),
}


def load_table(root=ROOT):
    spec = importlib.util.spec_from_file_location("strata_ops", root / "api/ops.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ops_of(table, surface):
    return [o for o in table.OPS if "name" in o and surface in o["surfaces"]]


def result_of(o):
    m = re.fullmatch(r"Result<(\w+)>", o["returns"])
    return m.group(1) if m else None


def cpp_return(o):
    r = result_of(o)
    return RESULTS[r][0] if r else o["returns"]


def c_name(o):
    if o["c_name"]:
        return o["c_name"]
    prefix = {"config": "config_", "runtime": ""}.get(o["object"], "")
    return f"strata_{prefix}{o['name']}"


def c_params(o):
    """The C parameters of an operation, as "type name" strings."""
    params = []
    if o["object"] == "runtime":
        params.append(("const " if o["const"] else "") + "strata_runtime* runtime")
    elif o["object"] == "config" and not o["static"]:
        params.append("strata_config* config")
    for n, t in o["args"]:
        params += [p.format(n=n) for p in TYPES[t][1]]
    r = result_of(o)
    if r:
        params += [p.strip() for p in RESULTS[r][1].format(o=o["c_out"]).split(",")]
    return params


def param_name(param):
    m = re.search(r"\(\*(\w+)\)|(\w+)$", param)
    return m.group(1) or m.group(2)


def wrap_call(head, items, tail, indent=0, width=WIDTH):
    """head(items, ...)tail on one line, or broken after commas aligned to the open parenthesis."""
    one = " " * indent + head + "(" + ", ".join(items) + ")" + tail
    if len(one) <= width or not items:
        return [one]
    lines, line = [], " " * indent + head + "("
    align = len(line)
    for i, item in enumerate(items):
        piece = item + (", " if i + 1 < len(items) else ")" + tail)
        if len(line) + len(piece.rstrip()) > width and line.strip() and not line.endswith("("):
            lines.append(line.rstrip())
            line = " " * align
        line += piece
    lines.append(line)
    return lines


def c_proto_lines(o, name=None, prefix=""):
    if o["c_proto"] and name is None:
        m = re.fullmatch(r"(.*?\b)(strata_\w+)\((.*)\)", o["c_proto"])
        head, items = m.group(1) + m.group(2), [s.strip() for s in m.group(3).split(",")]
        return wrap_call(prefix + head, items, ";")
    return wrap_call(f"{prefix}strata_status {name or c_name(o)}", c_params(o), ";")


def doc_lines(text, indent=""):
    return textwrap.wrap("/** " + text + " */", WIDTH - len(indent), initial_indent=indent,
                         subsequent_indent=indent + " * ", break_on_hyphens=False)
