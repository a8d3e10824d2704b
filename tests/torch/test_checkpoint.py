"""Checkpoints in torch's own format: save at step 10, load in a fresh process, train 10 more:
equal to 20 straight steps; and strata's checkpoints load into plain torch, and back."""

import os
import subprocess
import sys

import torch

import strata.torch as st
from harness import assert_identical, config, run
from models import inputs, loss_of, make

WORKER = os.path.join(os.path.dirname(__file__), "ckpt_worker.py")


def leg(out, nvme, mode):
    nvme.mkdir(exist_ok=True)
    subprocess.run([sys.executable, WORKER, str(out), str(nvme), mode], check=True, timeout=300,
                   env=dict(os.environ, STRATA_LOG_LEVEL="warn"))
    assert os.listdir(nvme) == [], "swap files left behind"


def test_save_at_10_resume_in_a_fresh_process_equals_20_straight(tmp_path):
    leg(tmp_path, tmp_path / "nvme_a", "straight")
    leg(tmp_path, tmp_path / "nvme_b", "first")
    leg(tmp_path, tmp_path / "nvme_c", "resume")
    straight = torch.load(tmp_path / "modelstraight.pt")
    resumed = torch.load(tmp_path / "modelresumed.pt")
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
    o1, o2 = torch.load(tmp_path / "optstraight.pt"), torch.load(tmp_path / "optresumed.pt")
    assert o1["state"].keys() == o2["state"].keys()
    for i in o1["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(o1["state"][i][name], o2["state"][i][name]), (i, name)


def test_runtime_checkpoint_at_10_resumes_in_a_fresh_process_bit_exactly(tmp_path):
    # opt.save_checkpoint / load_checkpoint: strata's own format (docs/checkpoint.md).
    leg(tmp_path, tmp_path / "nvme_a", "straight")
    leg(tmp_path, tmp_path / "nvme_b", "rt-first")
    assert os.path.exists(tmp_path / "rt" / "manifest.json")
    leg(tmp_path, tmp_path / "nvme_c", "rt-resume")
    straight = torch.load(tmp_path / "modelstraight.pt")
    resumed = torch.load(tmp_path / "modelrtresumed.pt")
    first = torch.load(tmp_path / "modelrt10.pt")
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k
        assert not torch.equal(first[k], resumed[k]), k  # the resumed leg trained
    o1, o2 = torch.load(tmp_path / "optstraight.pt"), torch.load(tmp_path / "optrtresumed.pt")
    assert o1["state"].keys() == o2["state"].keys()
    for i in o1["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(o1["state"][i][name], o2["state"][i][name]), (i, name)


def test_runtime_checkpoint_of_another_model_is_refused(tmp_path):
    (tmp_path / "n1").mkdir()
    (tmp_path / "n2").mkdir()
    model, kind = make("mlp")
    model = st.wrap(model, config(model, tmp_path / "n1"))
    opt = st.AdamW(model.parameters(), lr=1e-2)
    x, y = inputs(model, kind, 0)
    loss_of(model, x, y).backward()
    opt.step()
    opt.save_checkpoint(tmp_path / "ckpt")
    other, _ = make("deep")
    other = st.wrap(other, config(other, tmp_path / "n2"))
    other_opt = st.AdamW(other.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    try:
        other_opt.load_checkpoint(tmp_path / "ckpt")
        raise AssertionError("another model's checkpoint was loaded")
    except RuntimeError as e:
        assert "manifest.json" in str(e), str(e)
    for k, v in other.state_dict().items():
        assert torch.equal(before[k], v), k
    model.strata.close()
    other.strata.close()


def test_strata_checkpoint_loads_into_plain_torch_and_back(tmp_path):
    # strata trains 4 steps (AdamW) and saves.
    model, kind = make("mlp")
    model = st.wrap(model, config(model, tmp_path))
    opt = st.AdamW(model.parameters(), lr=1e-2)
    for step in range(4):
        x, y = inputs(model, kind, step)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    model_sd, opt_sd = model.state_dict(), opt.state_dict()
    # Plain torch, no strata: both load; torch.optim.AdamW continues from strata's moments.
    plain, _ = make("mlp", seed=123)
    plain.load_state_dict(model_sd)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain_opt.load_state_dict(opt_sd)
    for k, v in model_sd.items():
        assert torch.equal(plain.state_dict()[k], v)
    x, y = inputs(plain, kind, 4)
    loss_of(plain, x, y).backward()
    plain_opt.step()
    loss_of(model, x, y).backward()
    opt.step()
    for k, v in plain.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=2e-5, atol=2e-6)
    # And back: a torch-only SGD run's checkpoint continues bit-exactly under strata.
    reference = run("mlp", 6)
    first = run("mlp", 3)
    fresh, _ = make("mlp", seed=7)
    fresh = st.wrap(fresh, config(fresh, tmp_path))
    sgd = st.SGD(fresh.parameters(), lr=0.125)
    fresh.load_state_dict(first[1])
    losses = list(first[0])
    for step in range(3, 6):
        x, y = inputs(fresh, kind, step)
        loss = loss_of(fresh, x, y)
        loss.backward()
        sgd.step()
        sgd.zero_grad()
        losses.append(loss.detach().clone())
    assert_identical(reference, (losses, fresh.state_dict()))


def test_a_non_blocking_save_equals_a_blocking_one_and_leaves_training_unchanged(tmp_path):
    # opt.save_checkpoint(dir, blocking=False): begun after step 2, steps 3-4 run while it is
    # written; its files equal a blocking save's at step 2, and the training equals a run without it.
    runs = []
    for name, blocking in (("a", False), ("b", True)):
        (tmp_path / f"n{name}").mkdir()
        model, kind = make("mlp")
        model = st.wrap(model, config(model, tmp_path / f"n{name}"))
        opt = st.AdamW(model.parameters(), lr=1e-2)
        for step in range(4):
            if step == 2:
                opt.save_checkpoint(tmp_path / f"ckpt{name}", blocking=blocking)
            opt.zero_grad()
            x, y = inputs(model, kind, step)
            loss_of(model, x, y).backward()
            opt.step()
        opt.wait_checkpoint()
        assert not opt.checkpoint_in_flight()
        runs.append({k: v.clone() for k, v in model.state_dict().items()})
        model.strata.close()
    for k in runs[0]:
        assert torch.equal(runs[0][k], runs[1][k]), k
    files_a = sorted(p.name for p in (tmp_path / "ckpta").iterdir())
    files_b = sorted(p.name for p in (tmp_path / "ckptb").iterdir())
    assert files_a == files_b and len(files_a) > 1
    for f in files_a:
        if f.startswith("family-"):
            assert (tmp_path / "ckpta" / f).read_bytes() == (tmp_path / "ckptb" / f).read_bytes(), f
