"""Deferred init (issue #28, Note [Deferred init] in python/strata/torch/_deferred.py): a model built
with its parameters on the meta device gets the values eager construction gives, bit for bit, straight
into strata's chunks; what cannot be replayed exactly is refused with an error saying what to do."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import strata.torch as st

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
sys.path.append(os.path.join(HERE, "..", "..", "bench"))  # after examples/: bench/ has a torch_gpt.py too
from torch_gpt import Gpt, init_weights  # noqa: E402
from torch_scale import swap_file_bytes  # noqa: E402


def cfg(tmp_path=None, host="64MiB"):
    c = {"device": {"kind": "sim", "budget": "64MiB"}, "budgets": {"gpu": "16MiB", "host": host}, "threads": 2,
         "layout": {"chunk_elems_min": 4096}}
    if tmp_path is not None:
        c["budgets"]["nvme"] = "256MiB"
        c["nvme"] = {"dirs": [str(tmp_path)]}
    return c


def values(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_identical(eager, deferred):
    assert eager.keys() == deferred.keys()
    for k in eager:
        assert eager[k].dtype == deferred[k].dtype, k
        assert torch.equal(eager[k], deferred[k]), f"{k} differs"


def test_gpt_in_init_context_is_bit_identical_to_eager():
    torch.manual_seed(7)
    eager = Gpt(d=64, layers=2, seq=16)
    want = values(eager)
    after_eager = torch.rand(4)

    torch.manual_seed(7)
    with st.init():
        model = Gpt(d=64, layers=2, seq=16)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.blocks[0].attn.causal.device.type == "cpu"  # buffers stay real
    model = st.wrap(model, cfg(), init=init_weights)
    with pytest.raises(RuntimeError, match="no value yet"):
        model.wte.weight.sum()  # before the build there is no value: an error, not garbage
    opt = st.AdamW(model.parameters(), lr=1e-3)  # builds the engine: deferred init runs
    assert_identical(want, values(model))
    assert torch.equal(torch.rand(4), after_eager)  # the RNG is where eager construction left it
    assert model.head.weight is model.wte.weight  # the tie survives
    # It trains like the eager model wrapped the same way.
    x = torch.randint(0, 256, (2, 16))
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    opt.step()
    eager = st.wrap(eager, cfg())
    eopt = st.AdamW(eager.parameters(), lr=1e-3)
    eloss = torch.nn.functional.cross_entropy(eager(x).flatten(0, 1), x.flatten())
    eloss.backward()
    eopt.step()
    assert torch.equal(loss.detach(), eloss.detach())
    assert_identical(values(eager), values(model))
    model.strata.close()
    eager.strata.close()


def seq_model(device=None):
    return nn.Sequential(nn.Linear(12, 24, device=device), nn.LayerNorm(24, device=device), nn.GELU(),
                         nn.Linear(24, 5, device=device), nn.Embedding(9, 12, device=device))


def test_meta_device_kwargs_reset_parameters_only(tmp_path):
    """No init fn: each module's reset_parameters() in post-order, NVMe-homed states."""
    torch.manual_seed(3)
    want = values(seq_model())
    torch.manual_seed(3)
    model = st.wrap(seq_model("meta"), cfg(tmp_path))
    st.SGD(model.parameters(), lr=0.1)
    assert_identical(want, values(model))
    model.strata.close()


@pytest.mark.skipif(not hasattr(torch.device("cpu"), "__enter__"), reason="torch.device context is torch 2.x")
def test_torch_device_meta_context():
    torch.manual_seed(5)
    want = values(seq_model())
    torch.manual_seed(5)
    with torch.device("meta"):
        model = seq_model()
    model = st.wrap(model, cfg())
    st.SGD(model.parameters(), lr=0.1)
    assert_identical(want, values(model))
    model.strata.close()


class Raw(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return x @ self.w


def test_module_without_reset_parameters_is_refused():
    with st.init():
        model = nn.Sequential(nn.Linear(4, 4), Raw())
    with pytest.raises(ValueError, match=r"module '1' \(Raw\) owns parameters \(w\).*no reset_parameters\(\).*init=fn"):
        st.SGD(st.wrap(model, cfg()).parameters(), lr=0.1)


class Bare(nn.Module):
    """Parameters made with torch.empty and no reset_parameters: the model's init sets them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))


def test_init_fn_covers_a_module_without_reset_parameters():
    def init(m):
        if isinstance(m, Bare):
            nn.init.normal_(m.w)

    torch.manual_seed(1)
    eager = nn.Sequential(nn.Linear(4, 4), Bare())
    for m in eager.modules():
        init(m)
    want = values(eager)
    torch.manual_seed(1)
    with st.init():
        model = nn.Sequential(nn.Linear(4, 4), Bare())
    model = st.wrap(model, cfg(), init=init)
    st.SGD(model.parameters(), lr=0.1)
    assert_identical(want, values(model))
    model.strata.close()


def test_init_that_leaves_a_parameter_unset_is_refused():
    def init(m):
        pass

    with st.init():
        model = nn.Sequential(nn.Linear(4, 4), Raw())
    with pytest.raises(ValueError, match=r"parameter 'w' of module '1' \(Raw\) was not set"):
        st.SGD(st.wrap(model, cfg(), init=init).parameters(), lr=0.1)


class Meddler(nn.Module):
    """Its reset writes a child's parameter after the child's own reset (as nn.MultiheadAttention's does)."""

    def __init__(self):
        super().__init__()
        self.child = nn.Linear(4, 4)
        self.own = nn.Parameter(torch.empty(4))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.own)
        nn.init.zeros_(self.child.bias)
        with torch.no_grad():
            self.child.weight.mul_(2.0)  # reads the child's value so far, and draws nothing


def deferred_equals_eager(build, seed=3):
    torch.manual_seed(seed)
    want = values(build())
    after_eager = torch.rand(4)
    torch.manual_seed(seed)
    with st.init():
        model = build()
    model = st.wrap(model, cfg())
    opt = st.SGD(model.parameters(), lr=0.1)
    assert_identical(want, values(model))
    assert torch.equal(torch.rand(4), after_eager)  # the retried reset drew from the RNG once
    return model, opt


def test_reset_writing_a_descendants_parameter_is_bit_identical_to_eager():
    model, _ = deferred_equals_eager(Meddler)
    assert torch.equal(model.child.bias.detach(), torch.zeros(4))
    model.strata.close()


def test_multihead_attention_and_transformer_layer_are_bit_identical_to_eager():
    model, opt = deferred_equals_eager(lambda: nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0,
                                                                          batch_first=True))
    assert torch.equal(model.self_attn.out_proj.bias.detach(), torch.zeros(16))  # MHA's reset wrote it
    x = torch.randn(2, 5, 16)
    model(x).square().mean().backward()
    opt.step()  # and it trains
    model.strata.close()
    model, _ = deferred_equals_eager(lambda: nn.MultiheadAttention(8, 2, kdim=6, vdim=4))  # separate q, k, v
    model.strata.close()


class Sibling(nn.Module):
    """The second child's reset writes the first child's parameter: outside its own subtree."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = Poker(self.a)


class Poker(nn.Module):
    def __init__(self, other):
        super().__init__()
        self.own = nn.Parameter(torch.empty(4))
        self.other = [other]  # not a child
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.zeros_(self.own)
        nn.init.zeros_(self.other[0].bias)


def test_reset_touching_a_parameter_outside_its_subtree_is_refused():
    with st.init():
        model = Sibling()
    with pytest.raises(ValueError, match=r"reset_parameters\(\) of module 'b' \(Poker\) used parameter\(s\) 'a.bias'"):
        st.SGD(st.wrap(model, cfg()).parameters(), lr=0.1)


def test_meta_buffer_is_refused():
    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, device="meta")
            self.register_buffer("scale", torch.ones(4, device="meta"))

    with pytest.raises(ValueError, match="buffer 'scale' is on the meta device.*strata.torch.init"):
        st.wrap(WithBuffer(), cfg())


def test_init_without_meta_parameters_is_refused():
    with pytest.raises(ValueError, match="init= initialises parameters built on the meta device"):
        st.wrap(nn.Linear(4, 4), cfg(), init=lambda m: None)


RSS_WORKER = r"""
import json, resource, sys, torch, torch.nn as nn
import strata.torch as st
layers, width, nvme = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with st.init():
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
host = 64 << 20
device = 32 << 20
model = st.wrap(model, {"device": {"kind": "sim", "budget": device},
                        "budgets": {"gpu": "12MiB", "host": host, "nvme": "2GiB"},
                        "nvme": {"dirs": [nvme]}, "threads": 2})
st.SGD(model.parameters(), lr=0.1)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"before": before, "after": after, "host": host, "device": device, "model": layers * (width * width + width) * 4,
                  "module": (width * width + width) * 4}))
model.strata.close()
"""


def test_peak_rss_stays_within_host_budget_plus_one_module(tmp_path):
    """A 252 MB model (60 Linear(1024, 1024); SGD: params and grads on NVMe beyond the 64 MiB host budget)
    initialised into strata: RSS grows by at most the host budget, the sim device's 32 MiB, 2 x (the largest
    module + one chunk of at most 4 MiB, the 12 MiB GPU budget's third) and 32 MiB, and by less than half
    the model (Note [Deferred init])."""
    out = subprocess.run([sys.executable, "-c", RSS_WORKER, "60", "1024", str(tmp_path)], check=True,
                         capture_output=True, text=True, env=dict(os.environ, STRATA_LOG_LEVEL="warn"))
    r = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    growth = r["after"] - r["before"]
    bound = r["host"] + r["device"] + 2 * (r["module"] + (4 << 20)) + (32 << 20)
    assert growth <= bound, f"RSS grew by {growth} bytes; bound {bound} ({r})"
    assert growth < r["model"] / 2, r


def test_nvme_budget_is_a_cap_swap_files_hold_the_plan(tmp_path):
    """Issue #28 item 2 on the strata.torch path: budgets.nvme far above the disk's free space is a cap
    (the free-space check compares the plan), and the swap files hold what the plan puts on NVMe."""
    with st.init():
        model = Gpt(d=128, layers=4, seq=16)  # 13 MB of state
    c = cfg(tmp_path, host="7MiB")
    c["budgets"]["gpu"] = "2MiB"
    c["budgets"]["nvme"] = "64TiB"
    model = st.wrap(model, c, init=init_weights)
    opt = st.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 16))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    planned, held = model.strata.engine.layout()["plan_nvme_bytes"], swap_file_bytes(tmp_path)
    assert planned > 0, "the plan put nothing on NVMe: the test needs a smaller host budget"
    # The file holds the plan's bytes (plus its 4 KiB header and the slot rounding), not the 64 TiB cap.
    assert 0 < held <= planned + (1 << 20), (held, planned)
    model.strata.close()


def _train_step(model, opt):
    x = torch.randint(0, 256, (1, 16))
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_close_refuses_a_restore_that_does_not_fit_and_changes_nothing(monkeypatch):
    """Note [Closing a model larger than RAM]: close() compares the parameters' bytes with MemAvailable first."""
    from strata.torch import _wrap

    torch.manual_seed(3)
    with st.init():
        model = Gpt(d=64, layers=2, seq=16)
    model = st.wrap(model, cfg(), init=init_weights)
    opt = st.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt)
    before = values(model)
    monkeypatch.setattr(_wrap, "_available_memory", lambda: 1 << 16)  # 64 KiB available: the model does not fit
    with pytest.raises(MemoryError, match=r"close\(restore=False\)"):
        model.strata.close()
    assert_identical(before, values(model))  # still wrapped, nothing lost: it trains on
    _train_step(model, opt)
    monkeypatch.setattr(_wrap, "_available_memory", lambda: None)  # no /proc/meminfo: no check
    after = values(model)
    model.strata.close()
    assert_identical(after, {k: v.detach().clone() for k, v in model.state_dict().items()})


def test_close_without_restore_leaves_parameters_on_meta(tmp_path):
    torch.manual_seed(3)
    with st.init():
        model = Gpt(d=64, layers=2, seq=16)
    model = st.wrap(model, cfg(tmp_path, host="2MiB"), init=init_weights)
    opt = st.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt)
    shapes = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    old = opt.param_groups[0]["params"][0]
    model.strata.close(restore=False)
    assert old.numel() == 0  # the optimizer's stale reference reads no memory strata no longer owns
    assert not os.listdir(tmp_path)  # strata's tiers are freed, swap files included
    assert all(p.device.type == "meta" for p in model.parameters())
    assert {n: (p.shape, p.dtype) for n, p in model.named_parameters()} == shapes
    assert model.head.weight is model.wte.weight  # the tie survives
    assert model.blocks[0].attn.causal.device.type == "cpu"  # buffers are torch's, untouched
