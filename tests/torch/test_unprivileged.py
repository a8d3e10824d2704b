"""strata.torch as a user without CAP_IPC_LOCK and the default 8 MiB memlock limit: the pinned
pool falls back to unpinned memory, says so in the log, and training works."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

SCRIPT = r'''
import os, sys, torch, strata.torch as st
nvme = sys.argv[1]
m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
m = st.wrap(m, {"device": {"kind": "sim"}, "budgets": {"gpu": "1MiB", "host": "64MiB", "nvme": "16MiB"},
                "nvme": {"dirs": [nvme]}, "layout": {"chunk_elems": 4096}})
opt = st.AdamW(m.parameters(), lr=1e-2)
for i in range(3):
    m(torch.randn(4, 64)).sum().backward()
    opt.step()
m.strata.close()
print("trained as uid", os.getuid())
'''


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None,
                    reason="needs root and runuser to drop to uid 65534 (nobody)")
def test_unprivileged_user_falls_back_to_unpinned_memory_and_says_so():
    package = os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "strata", "torch", "_C" + "")
    readable = subprocess.run([shutil.which("runuser"), "-u", "nobody", "--", "test", "-r",
                               os.path.dirname(package) + "/__init__.py"], capture_output=True)
    if readable.returncode != 0:
        pytest.skip("the build directory is not readable by uid 65534 (a parent directory is private)")
    runnable = subprocess.run([shutil.which("runuser"), "-u", "nobody", "--", "test", "-x", sys.executable],
                              capture_output=True)
    if runnable.returncode != 0:  # a venv under /root (scripts/install-deps's torch 2.x venv when run as root)
        pytest.skip(f"the interpreter {sys.executable} is not executable by uid 65534 (a parent directory is private)")
    work = tempfile.mkdtemp(prefix="strata-unpriv-")
    try:
        os.chmod(work, 0o777)
        script = os.path.join(work, "train.py")
        with open(script, "w") as f:
            f.write(SCRIPT)
        os.chmod(script, 0o644)
        nvme = os.path.join(work, "nvme")
        os.mkdir(nvme)
        os.chmod(nvme, 0o777)
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "STRATA_LOG_LEVEL": "info",
               "PYTHONPATH": os.environ["PYTHONPATH"]}
        cmd = [shutil.which("runuser"), "-u", "nobody", "--", "sh", "-c",
               f'ulimit -l 8192 && exec {sys.executable} "$0" "$1"', script, nvme]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "trained as uid 65534" in r.stdout
        assert "unpinned" in r.stderr and "RLIMIT_MEMLOCK" in r.stderr, r.stderr[-2000:]
        assert os.listdir(nvme) == [], "swap files left behind"
    finally:
        shutil.rmtree(work, ignore_errors=True)
