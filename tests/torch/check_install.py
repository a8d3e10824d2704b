"""Checks a pip-installed strata.torch (Note [torch2 tests] in CMakeLists.txt).

Run by the venv's interpreter with no PYTHONPATH, from a directory outside the source tree:
the package must come from this interpreter's site-packages, carry every Python file of
python/strata, be built against the torch it runs with, and its extension must load
through its own rpath before torch is imported (ctypes, in a fresh interpreter).
"""
import argparse
import os
import pathlib
import subprocess
import sys
import sysconfig

SOURCE = pathlib.Path(__file__).resolve().parents[2] / "python" / "strata"


def fail(message):
    print(f"check_install: {message}", file=sys.stderr)
    sys.exit(1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--major", type=int, required=True, help="torch major version expected")
    args = parser.parse_args()
    if os.environ.get("PYTHONPATH"):
        fail(f"PYTHONPATH is set ({os.environ['PYTHONPATH']}); the check is of the installed package")

    # A fresh interpreter loads the extension with ctypes, torch not imported: only the
    # extension's rpath can find libtorch*.so there.
    site = pathlib.Path(sysconfig.get_paths()["platlib"]).resolve()
    exts = sorted((site / "strata" / "torch").glob("_C*.so"))
    if len(exts) != 1:
        fail(f"expected one strata/torch/_C*.so in {site}, found {[str(e) for e in exts]}; "
             "run pip install --no-build-isolation . in this venv")
    probe = "import ctypes, sys; ctypes.CDLL(sys.argv[1]); print('torch' in sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", probe, str(exts[0])],
                            capture_output=True, text=True)
    if loaded.returncode != 0 or loaded.stdout.strip() != "False":
        fail(f"{exts[0]} does not load by itself (rpath?): {loaded.stderr.strip()[-400:]}")

    import torch
    import strata.torch as st

    where = pathlib.Path(st.__file__).resolve()
    if site not in where.parents:
        fail(f"strata.torch imported from {where}, not from this interpreter's site-packages {site}")
    if int(torch.__version__.split(".")[0]) != args.major:
        fail(f"torch {torch.__version__} found, expected {args.major}.x")
    wanted = sorted(p.relative_to(SOURCE).as_posix() for p in SOURCE.rglob("*.py"))
    installed = sorted(p.relative_to(site / "strata").as_posix() for p in (site / "strata").rglob("*.py"))
    if wanted != installed:
        fail(f"installed Python files differ from python/strata: missing "
             f"{sorted(set(wanted) - set(installed))}, extra {sorted(set(installed) - set(wanted))}")
    print(f"check_install: strata.torch {where.parent} on torch {torch.__version__}; "
          f"{len(installed)} Python files; {exts[0].name} loads through its rpath")




if __name__ == "__main__":
    main()
