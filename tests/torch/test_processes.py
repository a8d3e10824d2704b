"""Note [Ranks under torchrun]: what strata.torch refuses around torch.distributed, with a message that
says what to do (WORLD_SIZE > 1 without a group, a group that cannot carry host memory, a model inside
DistributedDataParallel or FSDP, a bad comm section); a group of one rank trains as one process.
test_data_parallel.py trains over groups of 2 and 4."""

import multiprocessing
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import strata.torch as st
from harness import config
from models import inputs, loss_of, make

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="this torch is built without torch.distributed")


@pytest.fixture
def one_rank_group():
    """An initialised gloo group of one rank, destroyed after the test, its store file removed."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_world_size_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model, _ = make("mlp")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE = 2 .*no initialised process group.*own copy.*"
                                           r"init_process_group\(\"gloo\"\) before strata.torch.wrap"):
        st.wrap(model, config(model))
    assert not hasattr(model, "strata")


def test_world_size_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "two")
    model, _ = make("mlp")
    with pytest.raises(ValueError, match="WORLD_SIZE = 'two'"):
        st.wrap(model, config(model))


def test_a_group_of_one_rank_trains_as_one_process(one_rank_group, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    model, kind = make("mlp")
    reference, _ = make("mlp")
    model = st.wrap(model, config(model), process_group=one_rank_group)
    opt = st.SGD(model.parameters(), lr=0.125)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.125)
    for s in range(2):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            x, y = inputs(m, kind, s)
            loss_of(m, x, y).backward()
            o.step()
    got = model.state_dict()
    for k, v in reference.state_dict().items():
        assert torch.equal(got[k], v), k
    model.strata.close()


def test_a_ddp_model_is_refused(one_rank_group):
    model, _ = make("mlp")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    with pytest.raises(TypeError, match="the model is a DistributedDataParallel.*Wrap the plain model"):
        st.wrap(ddp, config(model))
    outer = torch.nn.Sequential(ddp)
    with pytest.raises(TypeError, match="its submodule '0' is a DistributedDataParallel"):
        st.wrap(outer, config(model))


def test_ddp_around_a_wrapped_model_is_refused_at_its_forward(one_rank_group):
    model, kind = make("mlp")
    model = st.wrap(model, config(model))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x, y = inputs(model, kind, 0)
    with pytest.raises(TypeError, match="called by DistributedDataParallel's forward"):
        ddp(x)
    loss_of(model, x, y).backward()  # the model itself still trains
    model.strata.close()


def _rank_wraps(rank, store, results):
    import strata.torch._processes as processes
    processes._backend_of = lambda group: "nccl"  # as a group made with init_process_group("nccl") says
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        model, _ = make("mlp")
        try:
            st.wrap(model, config(model))
            results.put((rank, "wrapped"))
        except RuntimeError as e:
            results.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


def test_a_group_whose_backend_carries_cuda_tensors_only_is_refused_on_each_rank():
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        env = os.environ.pop("WORLD_SIZE", None)
        try:
            procs = [ctx.Process(target=_rank_wraps, args=(r, f"{tmp}/store", results)) for r in range(2)]
            for p in procs:
                p.start()
            got = dict(results.get(timeout=120) for _ in procs)
            for p in procs:
                p.join(timeout=60)
                assert p.exitcode == 0
        finally:
            if env is not None:
                os.environ["WORLD_SIZE"] = env
        assert os.listdir(tmp) == [] or all(not n.startswith("strata") for n in os.listdir(tmp))
    for rank in range(2):
        assert "backend is 'nccl', which carries CUDA tensors only" in got[rank], got[rank]
        assert 'backend "gloo"' in got[rank]


@pytest.mark.parametrize("comm,match", [({"timeout_s": 0}, "comm.timeout_s = 0"),
                                        ({"timeout": 5}, "the one key is timeout_s"),
                                        ("fast", "the one key is timeout_s")])
def test_a_bad_comm_section_is_refused(comm, match):
    model, _ = make("mlp")
    cfg = config(model)
    cfg["comm"] = comm
    with pytest.raises(ValueError, match=match):
        st.wrap(model, cfg)
    assert not hasattr(model, "strata")


def _fully_shard():
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except (ImportError, ValueError):
        return None
    return lambda m: fully_shard(m, mesh=init_device_mesh("cpu", (1,)))


@pytest.mark.skipif(_fully_shard() is None, reason="this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
def test_fsdp2_before_or_after_wrap_is_refused(one_rank_group):
    shard = _fully_shard()
    model, kind = make("mlp")
    cfg = config(model)
    shard(model)
    with pytest.raises(TypeError, match="the model is a FSDP.*Wrap the plain model"):
        st.wrap(model, cfg)
    model, kind = make("mlp")
    model = st.wrap(model, config(model))
    shard(model)  # replaces every parameter with a DTensor
    x, y = inputs(model, kind, 0)
    with pytest.raises(RuntimeError, match="the model changed after wrap"):
        model(x)
    model.strata.close()


def test_host_and_nvme_budgets_are_the_nodes_shared_by_its_ranks(monkeypatch):
    from strata.torch import _processes
    cfg = {"budgets": {"gpu": "64MiB", "host": "1GiB", "nvme": 3 << 30}}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    got = _processes.per_rank_budgets(cfg)
    assert got["budgets"] == {"gpu": "64MiB", "host": 1 << 28, "nvme": 3 << 28}
    assert cfg["budgets"]["host"] == "1GiB"  # the user's config is not changed
    assert _processes.per_rank_budgets(dict(cfg, budgets_per="rank"))["budgets"] == cfg["budgets"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert _processes.per_rank_budgets(cfg) == cfg
    with pytest.raises(ValueError, match="budgets_per = 'gpu'"):
        _processes.per_rank_budgets(dict(cfg, budgets_per="gpu"))


def test_a_ranks_threads_are_the_nodes_cores_over_its_ranks(monkeypatch):
    from strata.torch import _processes
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _processes.local_threads({}) == max(1, cores // 2)
    assert _processes.local_threads({"threads": 3}) is None  # the config's own
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE = 'x'"):
        _processes.local_threads({})
