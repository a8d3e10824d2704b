"""Every error leaves a usable or cleanly closable strata.torch model (issue #24; Note [Failed steps]
in runtime/src/step_abort.cpp): OutOfBudget, an NVMe EIO, a CRC mismatch and an exception raised in
forward or in backward. After the error, state_dict() and a checkpoint hold the last good values,
the next step (the cause gone) is the one a clean run takes, a new runtime opens on the same swap
directory, and the process exits promptly (each scenario runs in recovery_worker.py, in a process of
its own, under a timeout)."""

import json
import os
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "recovery_worker.py")


def run(scenario, tmp_path):
    nvme = tmp_path / "nvme"
    out = tmp_path / "out"
    nvme.mkdir()
    out.mkdir()
    for sub in ("ref", "run", "check"):
        (nvme / sub).mkdir()
    env = dict(os.environ)
    env["STRATA_IO_FAULT_FILE"] = str(tmp_path / "faults")
    (tmp_path / "faults").write_text("")
    try:
        done = subprocess.run([sys.executable, WORKER, scenario, str(nvme), str(out)], capture_output=True,
                              text=True, timeout=240, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{scenario}: the process hung (no exit within 240 s); output: {e.stdout} {e.stderr}")
    assert done.returncode == 0, f"{scenario}: exit {done.returncode}\n{done.stdout}\n{done.stderr[-4000:]}"
    findings = json.loads(done.stdout.strip().splitlines()[-1])
    # No swap file is left behind by the exit.
    for sub in ("ref", "run", "check"):
        assert not any(n.startswith("strata-swap") for n in os.listdir(nvme / sub)), f"{scenario}: {sub}"
    return findings


def expect_recovered(f, scenario):
    assert f["error"] is not None, f"{scenario}: the error went unnoticed"
    assert f["state_dict_is_last_good"], f"{scenario}: state_dict() after the error is not the last good state"
    assert f["checkpoint_is_last_good"], f"{scenario}: a checkpoint saved after the error is not the last good state"
    assert f["next_step_is_clean_runs"], f"{scenario}: the step after the error differs from a clean run's"


def test_out_of_budget_in_forward(tmp_path):
    f = run("oob", tmp_path)
    assert "OutOfBudget" in f["error"] and "streaming chunk slots" in f["error"], f["error"]
    # What was bound when the slots ran out (the working set: docs/torch.md, "Working set"):
    # AllAtOnce binds layers 0..3 (4 families, weight and bias each) before it needs layer 4's.
    assert ("strata.torch held 8 parameters of 4 chunk families bound at this point "
            "(\"all_at_once.layers.0.weight\"") in f["error"], f["error"]
    assert "and 2 more)" in f["error"], f["error"]
    expect_recovered(f, "oob")


def test_exception_in_forward(tmp_path):
    f = run("forward", tmp_path)
    assert "user forward failed" in f["error"], f["error"]
    expect_recovered(f, "forward")


def test_exception_in_backward(tmp_path):
    f = run("backward", tmp_path)
    assert "user backward failed" in f["error"], f["error"]
    expect_recovered(f, "backward")


def test_exception_in_backward_with_deferred_steps(tmp_path):
    # Clipping defers every optimizer step to step(): half the gradients were handed over when
    # backward raised, and none of them may reach the next step.
    f = run("backward_deferred", tmp_path)
    assert "user backward failed" in f["error"], f["error"]
    expect_recovered(f, "backward_deferred")


def test_nvme_eio(tmp_path):
    f = run("eio", tmp_path)
    assert f["disk_read"] > 0, "the states were not on NVMe"
    assert "IoError" in f["error"] or "Input/output error" in f["error"], f["error"]
    expect_recovered(f, "eio")
    assert f["reopened"]


def test_crc_mismatch(tmp_path):
    f = run("crc", tmp_path)
    assert "CRC32C mismatch" in f["error"], f["error"]
    assert f["loaded_is_last_good"]
    assert f["checkpoint_is_last_good"] and f["next_step_is_clean_runs"], f
    assert f["reopened"]
