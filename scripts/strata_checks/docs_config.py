"""check-docs config: the keys of Config::keys() (read from api/src/config.cpp) against the key
tables of docs/config.md, and their documented defaults against the source's."""
import re

from .docs_common import C_EXTS, HEADER_EXTS, read

KEY = re.compile(r"^[a-z][a-z0-9_]*(?:\.[a-z][a-z0-9_]*)?$")
STRING = re.compile(r'"((?:[^"\\\n]|\\.)*)"')


def mask(text):
    """The text with string and char literals' contents and comments blanked (same length), so
    braces in "{}" do not count."""
    out, i, n = list(text), 0, len(text)
    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out[i:j] = [c if c == "\n" else " " for c in text[i:j]]
            i = j
        elif text[i] in "\"'":
            q, j = text[i], i + 1
            while j < n and text[j] != q:
                j += 2 if text[j] == "\\" else 1
            out[i + 1:j] = " " * (j - i - 1)
            i = j + 1
        else:
            i += 1
    return "".join(out)


def closing(masked, start):
    """Index just past the bracket matching the one at `start`."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(masked)):
        if masked[i] in pairs:
            stack.append(pairs[masked[i]])
        elif stack and masked[i] == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError("unbalanced")


def config_keys(root, files):
    """([(key, its k.push_back statement, (struct alias, field) from the loop's list or None)] in
    table order, source path), or raises ValueError saying what could not be read."""
    srcs = [f for f in files if f.endswith(".cpp") and re.search(r"\bConfig::keys\(\)\s*\{", read(root, f))]
    if len(srcs) != 1:
        raise ValueError(f"no one source defines Config::keys() (found {srcs or 'none'})")
    path = srcs[0]
    text = read(root, path)
    masked = mask(text)
    m = re.search(r"\btable\(\)\s*\{", masked)
    if not m:
        raise ValueError(f"{path}: no table() function building the keys")
    body = text[m.end():closing(masked, m.end() - 1)]
    adders = re.findall(r"\b(add_\w+)\(\s*k\s*\)", body)
    if not adders:
        raise ValueError(f"{path}: table() calls no add_*(k)")
    keys = []
    for adder in adders:
        d = re.search(r"\bvoid\s+" + adder + r"\s*\([^)]*\)\s*\{", masked)
        if not d:
            raise ValueError(f"{path}: {adder} is called by table() but not defined here")
        start, end = d.end(), closing(masked, d.end() - 1)
        since = start
        for p in re.finditer(r"\bk\.push_back\(", masked[start:end]):
            s = start + p.start()
            e = closing(masked, start + p.end() - 1)
            stmt = text[s:e]
            first = re.match(r'k\.push_back\(\s*\{\s*"([^"]*)"', stmt)
            fmt = re.match(r'k\.push_back\(\s*\{?\s*fmt::format\("([a-z0-9_]*)\.\{\}"', stmt)
            if fmt:
                before = text[since:s]
                pairs = re.findall(r'\{\s*"([a-z][a-z0-9_]*)"\s*,\s*&(\w+)::(\w+)\s*\}', before)
                names = [n for n in STRING.findall(before) if re.match(r"^[a-z][a-z0-9_]*$", n)]
                if not names:
                    raise ValueError(f"{path}:{text.count(chr(10), 0, s) + 1}: fmt::format(\"{fmt.group(1)}.{{}}\") "
                                     f"with no list of names before it")
                fields = {n: (alias, f) for n, alias, f in pairs}
                keys += [(f"{fmt.group(1)}.{n}", stmt, fields.get(n)) for n in names]
            elif first and KEY.match(first.group(1)):
                keys.append((first.group(1), stmt, None))
            else:
                raise ValueError(f"{path}:{text.count(chr(10), 0, s) + 1}: a k.push_back whose key "
                                 f"check-docs cannot read (a literal or fmt::format(\"x.{{}}\", name))")
            since = e
    return keys, path


def documented_keys(text):
    """{key: (line, the row's default as written, or None)} from the rows of tables whose first
    column is `key`; a row of several keys splits its default at ", " when the counts agree."""
    found, columns = {}, None
    for n, line in enumerate(text.split("\n"), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if cells is None:
            columns = None
            continue
        if cells[0].lower() == "key":
            columns = [c.lower() for c in cells]
            continue
        if columns is not None and not re.match(r"^:?-+:?$", cells[0]):
            keys = [t for t in re.findall(r"`([^`]+)`", cells[0]) if KEY.match(t)]
            default = cells[columns.index("default")] if "default" in columns and len(cells) == len(columns) else None
            defaults = [None] * len(keys)
            if default is not None:
                parts = [default] if len(keys) == 1 else default.split(", ")
                defaults = parts if len(parts) == len(keys) else defaults
            for key, value in zip(keys, defaults):
                found.setdefault(key, (n, value))
    return found


UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40, "KB": 10**3, "MB": 10**6,
         "GB": 10**9, "TB": 10**12}


def doc_value(cell):
    """A default as docs/config.md writes it (`4GiB`, 2^20, true, `auto`, "1 (note)"), or None
    for none."""
    text = re.split(r"\s+\(|;|,\s", cell.replace("`", "").strip())[0].strip()
    if text.lower() in ("", "none", "-", "—"):
        return None
    m = re.match(r"^2\^(\d+)$", text)
    if m:
        return 2**int(m.group(1))
    m = re.match(r"^(\d+(?:\.\d+)?)\s*(|B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)$", text)
    if m:
        return float(m.group(1)) * UNITS[m.group(2)]
    return {"true": True, "false": False}.get(text.lower(), text.lower())


def cxx_value(expr, enum_text):
    """The value of a C++ default initializer strata writes (4 * kGiB, 1u << 18, "auto", true,
    DType::kF32), or None where this reads no value."""
    import ast
    e = expr.strip()
    if re.match(r'^"[^"]*"$', e):
        return e[1:-1].lower()
    if e in ("true", "false"):
        return e == "true"
    m = re.match(r"^(?:\w+::)*(\w+)::(k\w+)$", e)
    if m:
        return enum_text(m.group(1), m.group(2))
    e = re.sub(r"\b(?:std::)?\w+\{(\d+)\}", r"\1", e)
    e = re.sub(r"\bk([KMGT]iB)\b", lambda u: str(UNITS[u.group(1)]), e)
    e = re.sub(r"(\d)(?:[uUlLfF]+)\b", r"\1", e)
    try:
        tree = ast.parse(e, mode="eval")
    except SyntaxError:
        return None
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.LShift: lambda a, b: a << b, ast.Div: lambda a, b: a / b}

    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError
    try:
        return ev(tree.body)
    except (ValueError, TypeError):
        return None


class Defaults:
    """Each key's default as the source sets it: the field its setter in config.cpp writes
    (a member pointer `&P::field`, `c.runtime.a.b`, or `c.device.set(name)` and the field
    DeviceOptions::set writes), that field's initializer in its struct, and the Config()
    constructor's overrides (`runtime.budgets = {.gpu_bytes = 1 * kGiB, ...}`)."""

    def __init__(self, root, files, cfg_path):
        self.root = root
        headers = [f for f in files if f.endswith(HEADER_EXTS) and "/include/" in f and not f.startswith("tests/")]
        self.sources = [f for f in files if f.endswith(C_EXTS) and not f.startswith("tests/")]
        self.cfg = read(root, cfg_path)
        self.structs = {}
        for h in headers:
            text = read(root, h)
            masked = mask(text)
            for m in re.finditer(r"\bstruct\s+(\w+)\s*\{", masked):
                body = text[m.end():closing(masked, m.end() - 1) - 1]
                self.structs.setdefault(m.group(1), self._members(body))
        self.overrides, self.opaque = {}, set()
        m = re.search(r"\bConfig::Config\(\)\s*\{", mask(self.cfg))
        if m:
            body = self.cfg[m.end():closing(mask(self.cfg), m.end() - 1)]
            for a in re.finditer(r"\b(runtime|device)\.(\w+)\s*=\s*\{([^}]*)\}", body):
                struct = self.walk(self._root_struct(a.group(1)), [a.group(2)])
                for d in re.finditer(r"\.(\w+)\s*=\s*([^,}]+)", a.group(3)):
                    self.overrides[(struct, d.group(1))] = d.group(2)
            # A struct assigned whole from a call (runtime.hyper = optimizer_defaults(...)): its
            # initializers are not its defaults, and this reads no others.
            for a in re.finditer(r"\b(runtime|device)\.(\w+)\s*=\s*(?!\{)[^;]*\(", body):
                self.opaque.add(self.walk(self._root_struct(a.group(1)), [a.group(2)]))
        self.enum_cache = None

    @staticmethod
    def _members(body):
        members, depth = {}, 0
        for line in body.split("\n"):
            code = re.sub(r"//.*$", "", line)
            if depth == 0:
                m = re.match(r"^\s*(?:[\w:]+(?:<[^;=]*>)?)\s+(\w+)\s*(?:=\s*([^;]+?))?\s*;", code)
                if m and not code.lstrip().startswith(("return", "using", "static", "friend")):
                    members[m.group(1)] = (re.match(r"^\s*([\w:]+)", code).group(1).split("::")[-1], m.group(2))
            depth += code.count("{") - code.count("}")
        return members

    def _root_struct(self, name):
        cfg = self.structs.get("Config", {})
        return cfg[name][0] if name in cfg else None

    def walk(self, struct, path):
        for part in path:
            if struct not in self.structs or part not in self.structs[struct]:
                return None
            struct = self.structs[struct][part][0]
        return struct

    def enum_text(self, enum, value):
        pats = [r'"([^"]+)"\)\s*return\s+(?:\w+::)*' + enum + "::" + value + r"\b",
                r"case\s+(?:\w+::)*" + enum + "::" + value + r'\s*:\s*return\s*"([^"]+)"',
                r"\{\s*(?:\w+::)*" + enum + "::" + value + r'\s*,\s*"([^"]+)"']
        for f in self.sources:
            text = read(self.root, f)
            if enum + "::" + value not in text:
                continue
            for pat in pats:
                m = re.search(pat, text)
                if m:
                    return m.group(1).lower()
        return value[1:].lower()

    def field(self, key, stmt, pair):
        """(struct, field) the key sets, or None."""
        if pair:
            alias = re.search(r"\busing\s+" + pair[0] + r"\s*=\s*(?:\w+::)*(\w+)\s*;", self.cfg)
            return (alias.group(1) if alias else pair[0], pair[1])
        m = re.search(r"&(?:\w+::)*(\w+)::(\w+)\s*\)", stmt)
        if m:
            return m.groups()
        if re.search(r"\bc\.device\.set\(", stmt):
            return self._device_field(key.split(".")[-1])
        m = re.search(r"\bc\.runtime\.((?:\w+\.)*\w+)", stmt)
        if m:
            path = m.group(1).split(".")
            for n in range(len(path), 0, -1):
                struct = self.walk(self._root_struct("runtime"), path[:n - 1])
                if struct in self.structs and path[n - 1] in self.structs[struct]:
                    return (struct, path[n - 1])
        return None

    def _device_field(self, name):
        members = self.structs.get("DeviceOptions", {})
        for f in self.sources:
            text = read(self.root, f)
            m = re.search(r'key\s*==\s*"' + name + r'"\s*\)\s*\{(.*?)\}\s*else', text, re.S)
            if m and "DeviceOptions::set" in text:
                for ident in re.findall(r"\b(\w+)\s*(?:=[^=]|,)", m.group(1)):
                    if ident in members:
                        return ("DeviceOptions", ident)
        return None

    def value(self, key, stmt, pair):
        """(the default's value, where it is set) or None."""
        field = self.field(key, stmt, pair)
        if not field or field[0] not in self.structs or field[0] in self.opaque:
            return None
        expr = self.overrides.get(field)
        where = f"Config::Config() sets {field[0]}::{field[1]}"
        if expr is None:
            expr = self.structs[field[0]].get(field[1], (None, None))[1]
            where = f"{field[0]}::{field[1]}'s initializer"
        value = cxx_value(expr, self.enum_text) if expr else None
        return None if value is None else (value, f"{where}, {expr.strip()}")


def same(doc, src):
    if isinstance(doc, bool) or isinstance(src, bool):
        return doc is src
    if isinstance(doc, (int, float)) and isinstance(src, (int, float)):
        return abs(doc - src) <= 1e-9 * max(1, abs(src))
    return doc == src


def check_config(root, files):
    """(failures, keys, defaults compared)."""
    doc = "docs/config.md"
    try:
        keys, src = config_keys(root, files)
    except ValueError as e:
        return [(doc, f"cannot read Config::keys(): {e}")], 0, 0
    names = [k for k, _, _ in keys]
    if doc not in files:
        return [(doc, "missing: it documents every key Config accepts")], len(keys), 0
    documented = documented_keys(read(root, doc))
    failures = [(f"{doc}:1", f"`{k}` (a key of Config::keys(), {src}) has no row in a key table; add one")
                for k in names if k not in documented]
    failures += [(f"{doc}:{line}", f"`{k}` is no key of Config::keys() ({src}); fix or remove the row")
                 for k, (line, _) in sorted(documented.items(), key=lambda kv: kv[1][0]) if k not in names]
    defaults, compared = Defaults(root, files, src), 0
    for key, stmt, pair in keys:
        line, cell = documented.get(key, (0, None))
        want = doc_value(cell) if cell else None
        have = defaults.value(key, stmt, pair) if want is not None else None
        if have is None:
            continue
        compared += 1
        if not same(want, have[0]):
            failures.append((f"{doc}:{line}", f"`{key}` defaults to {cell} here, but to {have[0]} in the source "
                                              f"({have[1]}); fix the row"))
    return failures, len(keys), compared
