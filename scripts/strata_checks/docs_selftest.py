"""check-docs --self-test: small trees each part must pass, and the same trees broken."""
import os
import tempfile

from .docs_run import run

SELF_TEST_TREES = {
    "readmes": {
        "base/README.md": "May call: the C++ standard library.\nCalled by: `lib/`, `app/`, `tests/base/`.\n",
        "base/include/strata/base/b.hpp": "#pragma once\n",
        "base/b.cpp": '#include "strata/base/b.hpp"\n',
        "lib/README.md": "May call: `base/`.\nCalled by: `app/` (its\nmain). Not `tests/`.\n",
        "lib/CMakeLists.txt": "",
        "lib/include/strata/lib/l.hpp": '#include "strata/base/b.hpp"\n',
        "lib/include/strata/lib/c.hpp": "#pragma once\n",
        "lib/src/source.cpp": '#include "part/p.hpp"\n#include "strata/lib/c.hpp"\n',
        "lib/src/part/README.md": "May call: `base/`.\nCalled by: `lib/src/` (`source.cpp`).\n",
        "lib/src/part/p.hpp": "#include <strata/base/b.hpp>\n",
        "lib/ckpt/README.md": "May call: `base/`.\nCalled by: `lib/src/` (`source.cpp`).\n",
        "lib/ckpt/CMakeLists.txt": "",
        "lib/ckpt/c.cpp": '#include "strata/lib/c.hpp"\n#include "strata/base/b.hpp"\n',
        "app/README.md": "May call: `lib/`, `base/`.\nCalled by: users (a program).\n",
        "app/main.cpp": '#include "strata/lib/l.hpp"\n#include "strata/base/b.hpp"\n',
        "tests/base/t.cpp": '#include "strata/base/b.hpp"\n',
    },
    "config": {
        "api/include/strata/options.hpp": """struct Budgets {
  std::uint64_t gpu_bytes = 0;  //!< replaced by Config()
};
struct RuntimeOptions {
  std::uint64_t x_bytes = 4 * kGiB;  //!< x
  std::uint32_t y = 1u << 4;
  bool z = true;
  Budgets budgets;
  std::size_t threads = 0;
};
struct Config {
  RuntimeOptions runtime;
};
""",
        "api/src/config.cpp": """void add_a_keys(std::vector<Key>& k) {
  using O = RuntimeOptions;
  for (const auto& [name, field] : {std::pair<const char*, std::uint64_t O::*>{"x", &O::x_bytes}, {"y", &O::y}}) {
    k.push_back({fmt::format("a.{}", name), Kind::kSize,
                 [field](Config& c, std::string_view, std::string_view v) { return c.set(field, "{}"); }});
  }
  k.push_back(
      {"a.z", Kind::kBool, [](Config& c, std::string_view key, std::string_view v) -> Status {
         STRATA_ASSIGN_OR_RETURN(c.runtime.z, to_bool(key, v));
         return invalid_argument("{} = \\"{}\\": use {{true}}", key, v);
       }});
}
void add_top_keys(std::vector<Key>& k) {
  k.push_back({"budgets.gpu", Kind::kSize, size_into(&Budgets::gpu_bytes)});
  k.push_back({"threads", Kind::kInteger, [](Config& c, auto, auto v) { c.runtime.threads = n(v); }});
}
const std::vector<Key>& table() {
  static const std::vector<Key> keys = [] { std::vector<Key> k; add_a_keys(k); add_top_keys(k); return k; }();
  return keys;
}
Config::Config() { runtime.budgets = {.gpu_bytes = 1 * kGiB}; }
std::vector<std::string> Config::keys() { return names(table()); }
""",
        "docs/config.md": "# Config\n\n| key | type | default |\n|---|---|---|\n| `a.x`, `a.y` | size | `4GiB`, 2^4 |\n"
                          "| `a.z` | bool | true |\n| `budgets.gpu` | size | `1GiB` (of the device's) |\n\n"
                          "Top level (`a.q` in prose is no row):\n\n| key | type | default |\n|---|---|---|\n"
                          "| `threads` | integer | 0 |\n",
    },
    "links": {
        "README.md": "See [the part](docs/c.md#top-part-one), [out](https://example.com), `docs/c.md` and\n"
                     "[c]: docs/c.md\n```\n[in code](../nowhere.md)\n```\n",
        "docs/c.md": "# Top part: one\n\n[back](../README.md#), [self](#top-part-one), `../README.md`.\n",
    },
}
# Each part's tree edited to break it, and the failures each edit must bring.
SELF_TEST_BREAKS = {
    "readmes": ({"lib/src/part/README.md": "May call: `base/`.\nCalled by: `lib/src/`, `ckpt/` (stale).\n",
                 "base/README.md": "May call: the C++ standard library.\nCalled by: `lib/`, `tests/nothing/`.\n",
                 "app/README.md": "Called by: users.\n"},
                ["names `ckpt/`, but nothing in it includes", "omits `app/`", "`tests/nothing/`, which is no",
                 "no 'May call:' line"]),
    "config": ({"docs/config.md": "| key | type | default |\n|---|---|---|\n| `a.x`, `a.w` | size | `8GiB`, 1 |\n"
                                  "| `a.z` | bool | true |\n| `threads` | integer | 0 |\n"
                                  "| `budgets.gpu` | size | 0 |\n"},
               ["`a.y` (a key of Config::keys()", "`a.w` is no key of Config::keys()",
                "`a.x` defaults to `8GiB` here, but to 4294967296", "`budgets.gpu` defaults to 0 here"]),
    "links": ({"README.md": "[s](../shared/S.md) [m](docs/missing.md) [a](docs/c.md#nope) `../shared/A.md`\n"},
              ["`../shared/S.md` leaves", "no file docs/missing.md", "no heading whose anchor is #nope",
               "`../shared/A.md` leaves"]),
}


def self_test():
    """Each part on a small tree that passes, then on the same tree with breaks it must report
    (ctest check_docs_self_test: a check that cannot fail is none)."""
    ok = True
    for part, tree in SELF_TEST_TREES.items():
        breaks, expected = SELF_TEST_BREAKS[part]
        results = []
        for files in (tree, {**tree, **breaks}):
            with tempfile.TemporaryDirectory() as root:
                for path, text in files.items():
                    os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
                    with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                        f.write(text)
                results.append(run(root, [part])[0])
        good, bad = results
        messages = [msg for _, msg in bad]
        missed = [e for e in expected if not any(e in m for m in messages)]
        passed, failed = not good, len(bad) == len(expected) and not missed
        ok = ok and passed and failed
        print(f"check-docs self-test: {part}: good tree {'passes' if passed else 'FAILS'}, broken tree "
              f"{'fails as expected' if failed else 'does not fail as expected'}")
        for where, msg in good + (bad if not failed else []):
            print(f"  {where}: {msg}")
        for e in missed:
            print(f"  expected a failure containing: {e}")
    return 0 if ok else 1
