"""torch.distributed.checkpoint (DCP) with strata.torch's data parallelism (issue #48; Note
[Optimizer states across ranks] in strata/torch/_optim_state.py): `dcp.save({"model", "optim"})`
at W = 2 writes one file per rank (DCP's planner spreads the entries every rank holds whole over
the ranks), and `dcp.load` at W = 4 gives every rank the saved params and optimizer states bit
for bit; DCP's own dcp_to_torch_save turns the checkpoint into a plain torch.save file that loads
into a plain torch model and torch.optim.AdamW. torch 2.x only (the torch2 label).

    test_dcp.py worker RANK WORLD STORE DIR save|load     (one rank; the tests start them)
"""

import datetime
import os
import sys
import tempfile

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from models import inputs, loss_of, make  # noqa: E402
from procs import run_all  # noqa: E402

pytestmark = pytest.mark.skipif(int(torch.__version__.split(".")[0]) < 2,
                                reason="torch.distributed.checkpoint's save/load API is torch 2.x's")


def worker(rank, world, store, ckpt, mode):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import strata.torch as st
    from harness import config
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    model, kind = make("mlp", seed=rank)
    cfg = config(model)
    cfg["budgets_per"] = "rank"
    model = st.wrap(model, cfg)
    opt = st.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    steps = 2 if mode == "save" else 1  # a load needs the states to exist: one step first
    for step in range(steps):
        x, y = inputs(model, kind, step, rank)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    if mode == "save":
        dcp.save(sd, checkpoint_id=ckpt)
        torch.save(sd, os.path.join(ckpt, "..", f"expected{rank}.pt"))
    else:
        dcp.load(sd, checkpoint_id=ckpt)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
                   os.path.join(ckpt, "..", f"loaded{rank}.pt"))
    model.strata.close()
    dist.destroy_process_group()
    print("ok", flush=True)


def run(world, store, ckpt, mode):
    env = dict(os.environ, STRATA_LOG_LEVEL="error")
    results = run_all([[sys.executable, __file__, "worker", str(r), str(world), store, ckpt, mode]
                       for r in range(world)], env, 80)
    for rank, (rc, out) in enumerate(results):
        assert rc == 0 and out.rstrip().endswith("ok"), f"{mode} rank {rank} (exit {rc}):\n{out}"


def assert_same(got, want):
    for k, v in want["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    for i, s in want["optim"]["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(got["optim"]["state"][i][k]), torch.as_tensor(v)), (i, k)


def test_dcp_saved_at_two_ranks_loads_at_four_and_in_plain_torch():
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory(prefix="strata-dcp-") as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        run(2, os.path.join(tmp, "store-save"), ckpt, "save")
        files = sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))
        assert files == ["__0_0.distcp", "__1_0.distcp"], files
        expected = torch.load(os.path.join(tmp, "expected0.pt"))
        assert_same(torch.load(os.path.join(tmp, "expected1.pt")), expected)  # every rank's state is whole
        run(4, os.path.join(tmp, "store-load"), ckpt, "load")
        for r in range(4):
            assert_same(torch.load(os.path.join(tmp, f"loaded{r}.pt")), expected)
        plain = os.path.join(tmp, "plain.pt")
        dcp_to_torch_save(ckpt, plain)
        sd = torch.load(plain)
        # DCP's flattening writes the optimizer's state keys as strings (as for any torch.optim state dict):
        # torch.optim's load_state_dict wants the parameter indices back.
        assert set(sd["optim"]["state"]) == {str(i) for i in expected["optim"]["state"]}
        sd["optim"]["state"] = {int(k): v for k, v in sd["optim"]["state"].items()}
        assert_same(sd, expected)
        model, _ = make("mlp", seed=5)
        model.load_state_dict(sd["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        opt.load_state_dict(sd["optim"])  # strata's optimizer state is torch.optim's format
        assert opt.state_dict()["state"][0]["exp_avg"].shape == model.fc1.weight.shape


if __name__ == "__main__" and sys.argv[1] == "worker":
    worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6])
