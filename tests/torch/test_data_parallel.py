"""strata.torch data parallelism over torch.distributed (issue #48; Note [Ranks under torchrun] in
strata/torch/_processes.py): W = 2 and 4 gloo processes, each running dp_worker.py on its slice of
the global batch, give losses and params bit-identical to one process that takes the same global
batch as W micro-batches of gradient accumulation. A rank that dies or raises is an error on every
other rank within comm.timeout_s, never a hang. Nothing is left on disk."""

import os
import sys
import tempfile
import time

import pytest
import torch

import strata.torch as st
from dp_worker import CASES, optimizer_of, strata_config, train
from models import make
from procs import run_all

WORKER = os.path.join(os.path.dirname(__file__), "dp_worker.py")


def run_ranks(world, case, fault=None, timeout=80, ckpt=None):
    """Runs `world` ranks of dp_worker.py; returns ([(returncode, output)], [saved result or None]).
    The rendezvous file, the outputs and the NVMe directories live in a temporary directory, which
    must hold no swap file once the ranks are gone."""
    with tempfile.TemporaryDirectory(prefix="strata-dp-") as tmp:
        store = os.path.join(tmp, "store")
        env = dict(os.environ, STRATA_LOG_LEVEL="error")
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world)]
        args = [fault or "-"] + ([] if ckpt is None else [ckpt])
        results = run_all([[sys.executable, WORKER, str(r), str(world), store, outs[r], case, *args]
                           for r in range(world)], env, timeout)
        saved = [torch.load(o) if os.path.exists(o) else None for o in outs]
        swap = [os.path.join(d, f) for d, _, files in os.walk(tmp) for f in files
                if os.path.basename(d).startswith("nvme-")]
        assert swap == [], f"swap files left behind: {swap}"
    return results, saved


@pytest.mark.parametrize("world,case", [(2, "sgd"), (2, "adamw_clip"), (4, "adamw_clip"), (2, "adamw_nvme"),
                                        (2, "lamb"), (2, "gpt_deferred"), (2, "unused"), (2, "int8"),
                                        (4, "int8"), (2, "int8_nvme")])
def test_ranks_are_bit_identical_to_one_process(world, case, tmp_path):
    results, saved = run_ranks(world, case)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0 and out.rstrip().endswith("ok"), f"rank {rank} (exit {rc}):\n{out}"
    ref_losses, ref_state, ref_opt = train(case, 0, 1, str(tmp_path), micro=world)
    steps = len(ref_losses) // world
    for rank, got in enumerate(saved):
        assert len(got["losses"]) == steps
        for s, loss in enumerate(got["losses"]):
            want = ref_losses[s * world + rank]
            assert torch.equal(loss * (1.0 / world), want), f"rank {rank} step {s}: {loss.item()!r} / {world} vs {want.item()!r}"
        assert got["state"].keys() == ref_state.keys()
        for k, v in ref_state.items():
            assert torch.equal(got["state"][k], v), f"rank {rank}: {k} differs (max |d| {(got['state'][k] - v).abs().max()})"
        assert_same_opt_state(got["opt_state"], ref_opt, f"rank {rank}")


def assert_same_opt_state(got, want, where):
    """torch.optim format state dicts equal bit for bit (every rank's is the whole state)."""
    assert got["param_groups"] == want["param_groups"], where
    assert got["state"].keys() == want["state"].keys(), where
    for i, s in want["state"].items():
        assert got["state"][i].keys() == s.keys(), (where, i)
        for k, v in s.items():
            g = got["state"][i][k]
            assert (g is None and v is None) or torch.equal(g, v), f"{where}: state {i} {k} differs"


@pytest.mark.parametrize("case", ["adamw_nvme", "int8_nvme"])
def test_a_checkpoint_saved_at_two_ranks_loads_in_one_process(case, tmp_path):
    ckpt = tmp_path / "ckpt"
    results, saved = run_ranks(2, case, ckpt=str(ckpt))
    for rank, (rc, out) in enumerate(results):
        assert rc == 0 and out.rstrip().endswith("ok"), f"rank {rank} (exit {rc}):\n{out}"
    name, opt_name, hyper, _, _, tiers = CASES[case]
    model, _ = make(name, seed=7)
    nvme = tmp_path / "nvme-load"
    nvme.mkdir()
    model = st.wrap(model, strata_config(name, tiers, str(nvme)))
    opt = optimizer_of(opt_name, model.parameters(), hyper)
    opt.load_checkpoint(str(ckpt))
    for k, v in saved[0]["state"].items():
        assert torch.equal(model.state_dict()[k], v), f"{k} differs after the load"
    assert_same_opt_state(opt.state_dict(), saved[0]["opt_state"], "loaded at W = 1")
    model.strata.close()


@pytest.mark.parametrize("fault", ["kill", "raise"])
def test_a_failed_rank_is_an_error_on_every_other_rank_not_a_hang(fault):
    t0 = time.monotonic()
    results, _ = run_ranks(3, "sgd", fault)
    took = time.monotonic() - t0
    assert took < 60, f"the ranks took {took:.0f} s"
    dead = results[-1]
    assert dead[0] != 0, dead[1]
    for rank, (rc, out) in enumerate(results[:-1]):
        assert rc == 3 and f"rank {rank} failed" in out, f"rank {rank} (exit {rc}):\n{out}"


def test_ranks_that_wrap_different_models_are_refused_by_name():
    results, _ = run_ranks(2, "sgd", "differ")
    for rank, (rc, out) in enumerate(results):
        assert rc == 3 and f"rank {rank} failed" in out, f"rank {rank} (exit {rc}):\n{out}"
    out = results[1][1]
    assert ("differ from rank 0's: here `tensor 3 \"fc3.weight\" shape [10, 128] fp32`, on rank 0 "
            "`tensor 3 \"fc2.bias\" shape [128] fp32`") in out, out


def test_hf_trainer_under_torchrun_is_refused_before_anything_changes():
    results, _ = run_ranks(2, "sgd", "trainer")
    for rank, (rc, out) in enumerate(results):
        assert rc == 3 and f"this process is rank {rank} of 2, and Trainer under torchrun" in out, out


def test_gradient_accumulation_on_each_rank_trains_close_to_one_process(tmp_path):
    """W = 2 ranks with 2 micro-batches each against one process with the same 4: the sums are
    ((g00 + g01) + (g10 + g11)) against (((g00 + g01) + g10) + g11), so the result is close, not
    bit-identical (Note [Ranks under torchrun])."""
    results, saved = run_ranks(2, "adamw_clip", "accum2")
    for rank, (rc, out) in enumerate(results):
        assert rc == 0 and out.rstrip().endswith("ok"), f"rank {rank} (exit {rc}):\n{out}"
    ref_losses, ref_state, _ = train("adamw_clip", 0, 1, str(tmp_path), micro=4)
    assert torch.allclose(saved[0]["losses"][0] * 0.5, ref_losses[0])  # the first step's are exact
    for k, v in ref_state.items():
        assert torch.equal(saved[0]["state"][k], saved[1]["state"][k]), k  # every rank the same
        d = (saved[0]["state"][k] - v).abs().max().item()
        assert d < 1e-4, (k, d)  # an AdamW step moves a weight by up to lr = 1e-3
