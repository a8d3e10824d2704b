"""gen-api: the three generated regions (strata.h's prototypes, strata_c.cpp's shims,
binding.cpp's .def lines) and rewriting a file's region between its markers."""
import textwrap

from .gen_api_table import (BEGIN, BINDING, C, END, HEADER, PY, RANGE_CHECKS, RESULTS, SHIMS, TYPES, WIDTH,
                            c_name, c_params, c_proto_lines, doc_lines, ops_of, param_name, result_of,
                            wrap_call)


# --- strata.h ------------------------------------------------------------------------------------------


def header_region(table):
    out = []
    for o in table.OPS:
        if "section" in o:
            out += ["", f"/* --- {o['section']} " + "-" * max(3, WIDTH - 12 - len(o["section"])) + " */", ""]
            continue
        if C not in o["surfaces"]:
            continue
        doc = o["doc"] + (" " + o["c_doc"] if o["c_doc"] else "")
        out += doc_lines(doc) + c_proto_lines(o)
    aliases = [(old, o) for o in ops_of(table, C) for old in o["c_old"]]
    if aliases:
        out += ["", "/* --- Deprecated names: renamed in ABI 5 (one name per operation on every surface); still",
                " * exported, so that callers built against ABI 4 keep linking. --- */", ""]
        for old, o in aliases:
            out += doc_lines(f"Deprecated: {c_name(o)} under its ABI 4 name (it calls {c_name(o)}).")
            out += [f'STRATA_DEPRECATED("use {c_name(o)}")'] + c_proto_lines(o, name=old)
    return out


# --- strata_c.cpp ---------------------------------------------------------------------------------------
# The checks each generated shim makes: Note [C shims] in scripts/gen-api.


def join_names(names):
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def shim_lines(o):
    params = c_params(o)
    lines = wrap_call(f"strata_status {c_name(o)}", params, " {")
    nonnull = []
    if o["object"] == "runtime":
        nonnull.append("runtime")
    for n, t in o["args"]:
        if TYPES[t][2]:
            nonnull.append(n)
    r = result_of(o)
    assert not r or RESULTS[r][2], f"api/ops.py: {o['name']}: a Result<{r}> has no generated shim (c_shim='hand')"
    if r:
        nonnull.append(o["c_out"])
    if nonnull:
        cond = " || ".join(f"{n} == nullptr" for n in nonnull)
        lines += wrap_if(f"if ({cond})", f'return null_argument("{join_names(nonnull)}");')
    for n, t in o["args"]:
        if t == "shape":
            lines.append(f'  if ({n} == nullptr && ndim > 0) return null_argument("{n}");')
    if o["c_check"] is not None:
        lines += ["  " + line if line else "" for line in o["c_check"].split("\n")]
    else:
        for n, t in o["args"]:
            if t in RANGE_CHECKS:
                cond, fail = RANGE_CHECKS[t]
                lines += wrap_if(f"if ({cond.format(n=n)})", "return " + fail.format(n=n) + ";")
    call_args = [TYPES[t][3].format(n=n) for n, t in o["args"]]
    call = f"runtime->rt->{o['name']}"
    one = wrap_call("  return guarded([&] { return from(" + call, call_args, "); });")
    if o["returns"] == "Status" and len(one) == 1:
        lines += one
    elif o["returns"] == "Status":
        lines += ["  return guarded([&] {"] + wrap_call("    return from(" + call, call_args, ");") + ["  });"]
    else:
        lines.append("  return guarded([&] {")
        if o["returns"] == "void":
            lines += wrap_call("    " + call, call_args, ";")
        else:
            lines += wrap_call("    auto r = " + call, call_args, ";")
            lines += ["    if (!r.ok()) return fail(r.status());", "    " + RESULTS[r][2].format(o=o["c_out"])]
        lines += ["    return ok();", "  });"]
    return lines + ["}"]


def wrap_if(cond, then):
    one = f"  {cond} {then}"
    return [one] if len(one) <= WIDTH else [f"  {cond}", f"    {then}"]


def shims_region(table):
    out = []
    for o in ops_of(table, C):
        if o["c_shim"] == "gen":
            out += [""] + shim_lines(o)
    for o in ops_of(table, C):
        for old in o["c_old"]:
            params = c_params(o)
            out += ["", f"// Deprecated: the ABI 4 name of {c_name(o)}."]
            out += wrap_call(f"strata_status {old}", params, " {")
            out += wrap_call(f"  return {c_name(o)}", [param_name(p) for p in params], ";") + ["}"]
    return out[1:] if out and out[0] == "" else out


# --- binding.cpp ----------------------------------------------------------------------------------------


def py_method(o):
    return o["py_method"] or o["name"]


def def_lines(name, method, pyargs, doc):
    """.def("name", method, py::arg(...)..., "doc") with the doc as string literals of at most WIDTH columns."""
    head = wrap_call(".def", [f'"{name}"', method] + pyargs, "", indent=6)
    head[-1] = head[-1][:-1] + ","  # the closing parenthesis comes after the doc
    quote = lambda t: '"' + t.replace("\\", "\\\\").replace('"', '\\"') + '"'
    pieces = textwrap.wrap(doc, WIDTH - 14, break_on_hyphens=False, drop_whitespace=False)
    body = [" " * 11 + quote(p) for p in pieces]
    body[-1] += ")"
    return head + body


def binding_region(table):
    out = []
    for o in ops_of(table, PY):
        pyargs = [f'py::arg("{n}")' for n, t in o["args"] if TYPES[t][4] == "arg"]
        method = f"&Engine::{py_method(o)}"
        out += def_lines(o["name"], method, pyargs, o["doc"])
        for old in o["py_old"]:
            out += def_lines(old, method, pyargs, f"Deprecated name of {o['name']}.")
    return out


# --- Regions -------------------------------------------------------------------------------------------

REGION = {HEADER: ("/* ", " */", header_region), SHIMS: ("// ", "", shims_region),
          BINDING: ("      // ", "", binding_region)}


def marker_lines(path, text):
    """Line indices of the BEGIN and END markers in text (ValueError when missing)."""
    lines = text.split("\n")
    begin = [i for i, line in enumerate(lines) if BEGIN in line]
    end = [i for i, line in enumerate(lines) if END in line and BEGIN not in line]
    if len(begin) != 1 or len(end) != 1 or end[0] < begin[0]:
        raise ValueError(f"{path}: expected one '{BEGIN}' marker and one '{END}' marker after it")
    return lines, begin[0], end[0]


def regenerate(path, text, table):
    lines, b, e = marker_lines(path, text)
    open_, close, make = REGION[path]
    body = make(table)
    begin_line = f"{open_}{BEGIN} (Note [Public operations]){close}"
    end_line = f"{open_}{END}{close}"
    off = "// clang-format off" if path != HEADER else "/* clang-format off */"
    on = "// clang-format on" if path != HEADER else "/* clang-format on */"
    indent = "      " if path == BINDING else ""
    return "\n".join(lines[:b] + [begin_line, indent + off] + body + [indent + on, end_line] + lines[e + 1:])
