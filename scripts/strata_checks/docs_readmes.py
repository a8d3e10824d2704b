"""check-docs readmes: each library folder's README "May call:" / "Called by:" against the
#includes and strata imports between owners (see scripts/check-docs for the rules)."""
import fnmatch
import os
import re

from .docs_common import C_EXTS, HEADER_EXTS, NOT_LIBRARIES, read, under

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
IMPORT = re.compile(r"^\s*(?:from\s+strata(?:\.[\w.]+)?\s+import\b|import\s+strata\b)", re.M)
LABEL = re.compile(r"^[\s>*_-]*(May call|Called by)\**:\s*", re.M)
PATHLIKE = re.compile(r"^[\w.*\-/]+$")


class Tree:
    """The files, their owners and the include edges between owners."""

    def __init__(self, root, files):
        self.root, self.files = root, files
        self.fileset = set(files)
        self.dirs = {os.path.dirname(f) for f in files}
        for d in list(self.dirs):
            while d:
                d = os.path.dirname(d)
                self.dirs.add(d)
        code = [f for f in files if f.endswith(C_EXTS) or f.endswith(".py")]
        self.libraries = sorted(
            os.path.dirname(f) for f in files
            if f.endswith("/README.md") and f.split("/")[0] not in NOT_LIBRARIES and
            any(under(c, os.path.dirname(f)) for c in code))
        self.owner = {f: self._owner(f) for f in code}
        by_stem = {}
        for f in code:
            if f.endswith((".c", ".cc", ".cpp", ".cu")):
                by_stem.setdefault((f.split("/")[0], os.path.splitext(os.path.basename(f))[0]), set()).add(
                    self.owner[f])
        for f in code:
            if f.endswith(HEADER_EXTS) and "/include/" in f:
                impl = by_stem.get((f.split("/")[0], os.path.splitext(os.path.basename(f))[0]), set())
                if len(impl) == 1:
                    (lib,) = impl
                    if lib in self.libraries and os.path.join(lib, "CMakeLists.txt") in self.fileset:
                        self.owner[f] = lib
        self.by_name = {}
        for f in files:
            self.by_name.setdefault(os.path.basename(f), []).append(f)
        self.edges = []  # (includer, included, line) across owners
        package = self._python_package()
        for f in code:
            text = read(self.root, f)
            if f.endswith(".py"):
                if package:
                    for m in IMPORT.finditer(text):
                        self._edge(f, package, text.count("\n", 0, m.start()) + 1)
                continue
            for m in INCLUDE.finditer(text):
                quote, inc = m.group(1), m.group(2)
                if quote == "<" and not inc.startswith("strata/"):
                    continue
                target = self._resolve(f, inc, quote)
                if target:
                    self._edge(f, target, text.count("\n", 0, m.start()) + 1)

    def _owner(self, path):
        lib = max((l for l in self.libraries if under(path, l)), key=len, default=None)
        return lib if lib is not None else (path.split("/")[0] if "/" in path else "")

    def _python_package(self):
        inits = [f for f in self.files if f == "strata/__init__.py" or f.endswith("/strata/__init__.py")]
        return min(inits, key=len) if inits else None

    def _edge(self, a, b, line):
        if b in self.owner and self.owner[a] != self.owner[b]:
            self.edges.append((a, b, line))

    def _resolve(self, includer, inc, quote):
        if quote == '"':
            here = os.path.normpath(os.path.join(os.path.dirname(includer), inc))
            if here in self.fileset:
                return here
        found = [f for f in self.by_name.get(os.path.basename(inc), []) if f == inc or f.endswith("/" + inc)]
        if not found:
            return None
        return max(found, key=lambda f: (len(os.path.commonpath([f, includer])) if "/" in includer else 0, f))

    def outermost_library(self, lib, other):
        """The outermost library folder holding `other`'s owner that does not hold `lib`."""
        owner = self.owner[other]
        outer = [l for l in self.libraries if under(owner, l) and not under(lib, l)]
        return min(outer, key=len) if outer else owner

    def resolve_claim(self, folder, claim):
        """(files the claim names, or None)."""
        path = claim.rstrip("/")
        base = folder
        while True:
            cand = os.path.normpath(os.path.join(base, path)) if base else os.path.normpath(path)
            if not cand.startswith(".."):
                if any(c in cand for c in "*?["):
                    hits = {f for f in self.files if fnmatch.fnmatch(f, cand)}
                    if hits:
                        return hits
                elif cand in self.fileset:
                    return {cand}
                elif cand in self.dirs:
                    hits = {f for f in self.files if under(f, cand)}
                    hits |= {f for f, o in self.owner.items() if o in self.libraries and under(o, cand)}
                    return hits
            if not base:
                return None
            base = os.path.dirname(base)


def readme_claims(text):
    """{label: (line, [(claim, line)])} for each `May call:` / `Called by:` line; duplicates
    as extra entries under label + '#2'."""
    out = {}
    for m in LABEL.finditer(text):
        label = m.group(1)
        key = label if label not in out else label + "#2"
        claims, depth, i, tick = [], 0, m.end(), None
        while i < len(text):
            ch = text[i]
            if tick is not None:
                if ch == "`":
                    token = text[tick + 1:i]
                    if depth == 0 and "/" in token and PATHLIKE.match(token):
                        claims.append((token, text.count("\n", 0, tick) + 1))
                    tick = None
            elif ch == "`":
                tick = i
            elif ch == "(":
                depth += 1
            elif ch == ")":
                depth = max(0, depth - 1)
            elif ch == "." and depth == 0 and (i + 1 == len(text) or text[i + 1].isspace()):
                break
            elif ch == "\n" and text[i + 1:i + 2] == "\n":
                break
            i += 1
        out[key] = (text.count("\n", 0, m.start()) + 1, claims)
    return out


def check_readmes(root, files):
    """(failures as (where, message), library folders, claims of Called by, claims of May call)."""
    tree = Tree(root, files)
    failures, callers, calls = [], 0, 0
    for lib in tree.libraries:
        readme = os.path.join(lib, "README.md")
        own = {f for f, o in tree.owner.items() if o in tree.libraries and under(o, lib)}
        found = readme_claims(read(root, readme))
        for label in ("May call", "Called by"):
            if label not in found:
                whose = "its sources include" if label == "May call" else "whose sources include its own"
                failures.append((f"{readme}:1", f"no '{label}:' line; add one naming, in backticks, the "
                                                f"folders {whose}"))
                continue
            if label + "#2" in found:
                failures.append((f"{readme}:{found[label + '#2'][0]}", f"a second '{label}:' line; keep one"))
            at, claims = found[label]
            if label == "May call":
                edges = [(a, b, line, b) for a, b, line in tree.edges if a in own and b not in own]
                calls += len(claims)
            else:
                edges = [(a, b, line, a) for a, b, line in tree.edges if b in own and a not in own]
                callers += len(claims)
            named = []
            for claim, line in claims:
                hits = tree.resolve_claim(lib, claim)
                if hits is None:
                    failures.append((f"{readme}:{line}", f"'{label}' names `{claim}`, which is no file or folder "
                                                         f"here or in a folder above; write its path from the root"))
                    continue
                named.append(hits)
                if not any(far in hits for _, _, _, far in edges):
                    what = ("nothing in it is included by this folder's sources" if label == "May call" else
                            "nothing in it includes this folder's files")
                    failures.append((f"{readme}:{line}", f"'{label}' names `{claim}`, but {what}; remove it "
                                                         f"(or say how in parentheses, which is not checked)"))
            missing = {}
            for a, b, line, far in edges:
                owner = tree.owner[far]
                if owner not in tree.libraries or under(lib, owner) or any(far in h for h in named):
                    continue
                missing.setdefault(tree.outermost_library(lib, far), (a, b, line))
            for other, (a, b, line) in sorted(missing.items()):
                failures.append((f"{readme}:{at}", f"'{label}' omits `{other}/` ({a}:{line} includes {b})"))
    return failures, len(tree.libraries), callers, calls
