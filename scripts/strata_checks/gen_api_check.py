"""gen-api --check and --self-test: the regions, the C++ declarations, the binding's .def
names and Engine methods, and the C functions declared and defined, against api/ops.py."""
import re

from .gen_api_regions import marker_lines, py_method, regenerate
from .gen_api_table import (BINDING, C, CPP, CPP_CLASS, CPP_HEADERS, ENGINE, HEADER, PY, ROOT, SHIMS, TYPES,
                            c_name, cpp_return, load_table, ops_of)


# --- Checks --------------------------------------------------------------------------------------------


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def class_body(text, name):
    m = re.search(r"\b(?:class|struct)\s+" + name + r"\b[^;{]*\{", text)
    if not m:
        return ""
    depth, i = 1, m.end()
    while depth and i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[m.end():i - 1]


def split_top(s):
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "<([{":
            depth += 1
        elif ch in ">)]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts]


def norm(t):
    t = re.sub(r"\s+", " ", t).strip()
    return re.sub(r"\s*([<>(),&*])\s*", r"\1", t)


def declarations(body, name):
    """(return type, [(type, arg name)]) of each declaration of `name` in a class body."""
    out = []
    for m in re.finditer(r"([\w:<>,\s&*]*?)\b" + name + r"\s*\(", body):
        depth, i = 1, m.end()
        while depth and i < len(body):
            depth += {"(": 1, ")": -1}.get(body[i], 0)
            i += 1
        ret = m.group(1).strip().split("\n")[-1]
        ret = re.sub(r"^(?:.*[;{}]\s*)?", "", ret)
        ret = re.sub(r"\b(?:static|virtual|inline|constexpr|explicit)\s+", "", ret).strip()
        if not ret or ret in ("return", "&&", "||"):
            continue  # a call, not a declaration
        args = []
        for a in split_top(body[m.end():i - 1]):
            a = a.split("=")[0].strip()
            am = re.fullmatch(r"(.*?)\b(\w+)", a, flags=re.S)
            args.append((norm(am.group(1)), am.group(2)))
        out.append((norm(ret), args))
    return out


def check_cpp(table, texts):
    """Each C++ operation of the table declared with its name, argument names and types."""
    problems = []
    for o in ops_of(table, CPP):
        want = (norm(cpp_return(o)), [(norm(TYPES[t][0]), n) for n, t in o["args"]])
        found = []
        for path in CPP_HEADERS[o["object"]]:
            found += declarations(class_body(strip_comments(texts[path]), CPP_CLASS[o["object"]]), o["name"])
        if want not in found:
            show = lambda d: f"{d[0]} {o['name']}(" + ", ".join(f"{t} {n}" for t, n in d[1]) + ")"
            problems.append(f"C++ {CPP_CLASS[o['object']]}::{o['name']}: the table says {show(want)}; "
                            f"the headers declare {'; '.join(map(show, found)) or 'nothing of that name'}")
    return problems


def check_binding(table, text, engine_hpp):
    """Every Engine .def name known to the table; every Python operation defined once."""
    problems = []
    names = re.findall(r'^\s*\.def\(\s*"(\w+)"', text, flags=re.M)
    known = {o["name"] for o in ops_of(table, PY)} | {a for o in ops_of(table, PY) for a in o["py_old"]}
    for n in sorted(set(names) - known - set(table.BINDING_ONLY)):
        problems.append(f'{BINDING}: .def("{n}") is no operation of api/ops.py (nor in its BINDING_ONLY)')
    for o in ops_of(table, PY):
        if names.count(o["name"]) != 1:
            problems.append(f'{BINDING}: .def("{o["name"]}") appears {names.count(o["name"])} times, not once')
    engine = class_body(strip_comments(engine_hpp), "Engine")
    for o in ops_of(table, PY):
        pyargs = [n for n, t in o["args"] if TYPES[t][4] == "arg"]
        counts = [len(args) for _, args in declarations(engine, py_method(o))]
        if len(pyargs) not in counts:
            problems.append(f"{ENGINE}: Engine::{py_method(o)} (Python {o['name']}) should take {len(pyargs)} "
                            f"arguments ({', '.join(pyargs) or 'none'}); it declares "
                            f"{' or '.join(map(str, counts)) or 'no such method'}")
    for n in table.BINDING_ONLY:
        if n in known:
            problems.append(f"api/ops.py: {n} is both an operation and BINDING_ONLY")
    return problems


def outside(path, text):
    lines, b, e = marker_lines(path, text)
    return "\n".join(lines[:b] + lines[e + 1:])


def check_c(table, header, shims):
    """No C function declared outside the generated region of strata.h; each C operation
    defined exactly once in strata_c.cpp, and nothing else defined there."""
    problems = []
    for m in re.finditer(r"^[\w ]+?[\s*](strata_\w+)\(", strip_comments(outside(HEADER, header)), flags=re.M):
        problems.append(f"{HEADER}: {m.group(1)} is declared by hand; declare it in api/ops.py")
    want = {c_name(o) for o in ops_of(table, C)} | {a for o in ops_of(table, C) for a in o["c_old"]}
    defined = re.findall(r"^(?:const )?[\w]+\*? ?\*?(strata_\w+)\([^;]*?\)\s*(?:noexcept\s*)?\{", shims,
                         flags=re.M)
    for n in sorted(want):
        if defined.count(n) != 1:
            problems.append(f"{SHIMS}: {n} is defined {defined.count(n)} times, not once")
    for n in sorted(set(defined) - want):
        problems.append(f"{SHIMS}: {n} is defined but is no operation of api/ops.py")
    for o in ops_of(table, C):
        if o["c_proto"] and not re.search(r"\b" + re.escape(c_name(o)) + r"\(", o["c_proto"]):
            problems.append(f"api/ops.py: {o['name']}'s c_proto does not declare {c_name(o)}")
    return problems


def check(root=ROOT, texts=None, table=None):
    table = table or load_table(root)
    texts = texts or {p: (root / p).read_text() for p in
                      [HEADER, SHIMS, BINDING, ENGINE] + sorted({h for hs in CPP_HEADERS.values() for h in hs})}
    problems = []
    for path in (HEADER, SHIMS, BINDING):
        try:
            if regenerate(path, texts[path], table) != texts[path]:
                problems.append(f"{path}: its generated region differs from api/ops.py (run scripts/gen-api)")
        except ValueError as e:
            problems.append(str(e))
    problems += check_cpp(table, texts)
    problems += check_binding(table, texts[BINDING], texts[ENGINE])
    try:
        problems += check_c(table, texts[HEADER], texts[SHIMS])
    except ValueError as e:
        problems.append(str(e))
    return problems


def self_test():
    """--check must fail on each kind of drift, on copies changed in memory."""
    table = load_table()
    texts = {p: (ROOT / p).read_text() for p in
             [HEADER, SHIMS, BINDING, ENGINE] + sorted({h for hs in CPP_HEADERS.values() for h in hs})}
    assert check(texts=texts, table=table) == [], "the tree itself must pass"
    runtime_hpp = CPP_HEADERS["runtime"][0]
    drifts = {
        "a renamed C++ argument": (runtime_hpp, "Status no_gradient(TensorId tensor)", "Status no_gradient(TensorId t)"),
        "a renamed C++ method": (runtime_hpp, "Status abort_step()", "Status discard_step()"),
        "a hand-edited prototype": (HEADER, "strata_status strata_flush(strata_runtime* runtime);",
                                    "strata_status strata_flush(strata_runtime* rt, int x);"),
        "a prototype outside the region": (HEADER, "#ifdef __cplusplus\n}",
                                           "strata_status strata_extra(void);\n#ifdef __cplusplus\n}"),
        "an unknown .def": (BINDING, '.def("close", &Engine::close)',
                            '.def("close", &Engine::close)\n      .def("read2", &Engine::read)'),
        "an Engine method gone": (ENGINE, "void set_tensor_steps(", "void set_counter("),
        "a shim defined twice": (SHIMS, "}  // extern \"C\"",
                                 "strata_status strata_flush(strata_runtime* runtime) {\n  return STRATA_OK;\n}\n"
                                 "}  // extern \"C\""),
    }
    failed = 0
    for what, (path, old, new) in drifts.items():
        assert old in texts[path], f"self-test: {what}: {old!r} not in {path}"
        changed = dict(texts, **{path: texts[path].replace(old, new, 1)})
        found = check(texts=changed, table=table)
        print(f"gen-api self-test: {what}: {'caught: ' + found[0] if found else 'NOT CAUGHT'}")
        failed += not found
    return failed
