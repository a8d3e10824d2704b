"""Where the benches build DeepSpeed's JIT ops, and with which compiler (bench/peers.py and
bench/zero_infinity.py share it, so that both load the same built ops)."""

import os
import shutil
import sys


def set_torch_extensions_dir(torch_version):
    """TORCH_EXTENSIONS_DIR, unless the environment sets it: once per torch version and Python (an op
    built for another torch does not load: "compiled with a different torch"), outside the checkout so
    `make clean` keeps it. scripts/install-deps builds the ops there."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "strata", "torch-extensions",
        f"torch-{torch_version.split('+')[0]}-py{sys.version_info[0]}{sys.version_info[1]}"))
    return os.environ["TORCH_EXTENSIONS_DIR"]


def pin_cxx():
    """Resolves $CXX (default "c++") to its path. torch writes $CXX into an op's build.ninja as given, and
    ninja rebuilds when a command line changes: ctest's environment says /usr/bin/c++, a shell says c++,
    and each rebuilt the op (90 s). The resolved path makes every environment write the same line."""
    cxx = os.environ.get("CXX", "c++")
    os.environ["CXX"] = shutil.which(cxx) or cxx
