"""Processes of one multi-process test (ranks, torchrun agents)."""

import subprocess


def run_all(cmds, env, timeout):
    """Starts every command at once (stdout and stderr together, as text) and waits for all of them;
    returns [(returncode, output)] in order. Any still running at the timeout, or when waiting
    fails, is killed, so that no process outlives the test."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for c in cmds]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results
