"""Bad input: one clear Python exception naming the thing; no crash, no hang, no files left."""

import os

import pytest
import torch
import torch.nn as nn

import strata.torch as st
from harness import config
from models import inputs, loss_of, make


def wrapped(tmp_path, name="mlp"):
    model, kind = make(name)
    return st.wrap(model, config(model, tmp_path)), kind


def test_model_modified_after_wrap(tmp_path):
    model, kind = wrapped(tmp_path)
    opt = st.SGD(model.parameters(), lr=0.1)
    model.fc2.weight = nn.Parameter(torch.zeros(128, 128))
    with pytest.raises(RuntimeError, match=r"changed after wrap.*fc2\.weight"):
        model(inputs(model, kind, 0)[0])
    model2, kind = wrapped(tmp_path / "b" if (tmp_path / "b").mkdir() is None else tmp_path)
    model2.extra = nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match=r"changed after wrap.*extra\.weight"):
        model2(inputs(model2, kind, 0)[0])
    del opt


def test_wrapping_twice(tmp_path):
    model, _ = wrapped(tmp_path)
    with pytest.raises(RuntimeError, match="already wrapped"):
        st.wrap(model, config(model))


def test_unknown_config_key(tmp_path):
    model, _ = make("mlp")
    with pytest.raises(ValueError, match="budgets.gpx"):
        st.wrap(model, {"budgets": {"gpx": "1GiB"}})
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        st.wrap(model, {"gradient_accumulation_steps": 0})
    path = tmp_path / "bad.json"
    path.write_text('{"device": {"kind": "tpu"}}')
    with pytest.raises(ValueError, match="tpu"):
        st.wrap(model, str(path))
    with pytest.raises(ValueError, match="cannot read"):
        st.wrap(model, str(tmp_path / "missing.json"))
    assert getattr(model, "_strata_wrapped", None) is None, "a failed wrap must leave the model alone"


def test_parameter_on_the_wrong_device(tmp_path):
    # Meta parameters are deferred init (issue #28, test_deferred_init.py); mixed with real ones, or on a
    # CUDA device, they are refused.
    model = nn.Sequential(nn.Linear(4, 4, device="meta"), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"parameter '1.weight' is on cpu while others are on the meta device"):
        st.wrap(model, {"device": {"kind": "sim"}})
    with pytest.raises(ValueError, match=r"deferred init .* sim device only"):
        st.wrap(nn.Linear(4, 4, device="meta"), {"device": {"kind": "cuda"}})
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"'weight' is on cpu but strata's device is GPU 0 .*model.to\('cuda:0'\)"):
        st.wrap(model, {"device": {"kind": "cuda"}})
    # The GPU is device.cuda_ordinal's, not always cuda:0 (a tensor on cuda:0 is checked the same way).
    with pytest.raises(ValueError, match=r"GPU 1 \(device.cuda_ordinal 1\).*model.to\('cuda:1'\)"):
        st.wrap(model, {"device": {"kind": "cuda", "cuda_ordinal": 1}})


def test_step_without_backward(tmp_path):
    model, kind = wrapped(tmp_path)
    opt = st.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="without a backward"):
        opt.step()
    x, y = inputs(model, kind, 0)
    loss_of(model, x, y).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="without a backward"):
        opt.step()


def test_load_state_dict_missing_or_misshaped_loads_nothing(tmp_path):
    model, kind = wrapped(tmp_path)
    opt = st.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {k: torch.ones_like(v) for k, v in before.items()}
    del bad["fc3.bias"]
    with pytest.raises(RuntimeError, match=r"(?s)nothing was loaded.*Missing key\(s\) in state_dict: \"fc3\.bias\""):
        model.load_state_dict(bad)
    bad = {k: torch.ones_like(v) for k, v in before.items()}
    bad["fc1.weight"] = torch.ones(3, 3)
    with pytest.raises(RuntimeError, match=r"(?s)nothing was loaded.*size mismatch for fc1\.weight"):
        model.load_state_dict(bad)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was partly loaded"
    good = opt.state_dict()
    good["param_groups"][0]["params"] = good["param_groups"][0]["params"][:-1]
    with pytest.raises(ValueError, match="params in the checkpoint"):
        opt.load_state_dict(good)


def test_too_many_micro_batches(tmp_path):
    model, kind = wrapped(tmp_path)
    opt = st.SGD(model.parameters(), lr=0.1)
    x, y = inputs(model, kind, 0)
    loss_of(model, x, y).backward()
    with pytest.raises(RuntimeError, match="gradient_accumulation_steps = 1"):
        loss_of(model, x, y).backward()
    del opt


def test_budget_too_small_is_an_error_and_leaves_no_files(tmp_path):
    model, kind = make("mlp")
    cfg = config(model, tmp_path)
    cfg["budgets"]["gpu"] = 3 * 16384  # 3 slots of layout.chunk_elems, fewer than the largest tensor needs
    model = st.wrap(model, cfg)
    with pytest.raises(st.StrataError, match="gpu_budget"):
        st.SGD(model.parameters(), lr=0.1)
    assert os.listdir(tmp_path) == []
    x, y = inputs(model, kind, 0)
    with pytest.raises(st.StrataError, match="gpu_budget"):
        loss_of(model, x, y)  # the same clear error, not a crash
    # Nothing was handed over: unwrapped, the model is plain torch with its values.
    model.strata.close()
    assert torch.isfinite(loss_of(model, x, y))


def test_a_failed_backward_leaves_the_model_usable(tmp_path):
    model, kind = wrapped(tmp_path)
    opt = st.SGD(model.parameters(), lr=0.125)
    x, y = inputs(model, kind, 0)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        torch.nn.functional.cross_entropy(Boom.apply(model(x)), y).backward()
    loss_of(model, x, y).backward()
    opt.step()
    assert opt.last_step_applied
    with pytest.raises(RuntimeError, match="take every param group"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
