"""8-bit optimizer states from strata.torch (issue #49; Note [Optimizer state dtype] in
strata/torch/optim.py): st.AdamW(state_dtype="int8") runs the runtime's q8 states (blockwise m and
v, one fp32 scale per 256 elements), which hold about a quarter of fp32's bytes, train, and go
through torch.optim's state_dict format (dequantized) and back (quantized again, within a code of
the map). What has no 8-bit rule is refused."""

import pytest
import torch

import strata.torch as st
from harness import config
from models import inputs, loss_of, make


def train(state_dtype, steps=6, opt_cls=st.AdamW, cfg_extra=None, model=None, chunk_elems=4096):
    if model is None:
        model, _ = make("mlp")
    cfg = config(model, chunk_elems=chunk_elems)
    cfg.update(cfg_extra or {})
    model = st.wrap(model, cfg)
    opt = opt_cls(model.parameters(), lr=1e-2, weight_decay=0.01, state_dtype=state_dtype)
    losses = []
    for s in range(steps):
        x, y = inputs(model, "dense", s % 2)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, opt, losses


def test_int8_states_train_in_a_quarter_of_the_bytes():
    # Chunks of 64 Ki elements: each state chunk (codes, then scales) rounds up to 4 KiB, which at the
    # tests' usual 4 Ki elements doubles it (4 KiB of codes and 64 B of scales take 8 KiB).
    m8, _, l8 = train("int8", chunk_elems=1 << 16)
    m32, _, l32 = train(None, chunk_elems=1 << 16)
    q8_bytes = m8.strata.engine.layout()["state_bytes"]
    fp32_bytes = m32.strata.engine.layout()["state_bytes"]
    # fp32 compute: the master is the param, so fp32 states are 8 B a param, q8's 2 + 8/256 (plus each
    # tensor's padding to whole 256-element blocks and each chunk's to 4 KiB).
    assert 0.25 <= q8_bytes / fp32_bytes < 0.30, (q8_bytes, fp32_bytes)
    assert l8[-1] < l8[0] * 0.8 and l32[-1] < l32[0] * 0.8, (l8, l32)
    assert abs(l8[-1] - l32[-1]) < 0.05 * l32[-1], (l8, l32)  # 8-bit states follow fp32's closely
    m8.strata.close()
    m32.strata.close()


def test_int8_states_go_through_torchs_format_and_back_within_a_code():
    model, opt, _ = train("int8", steps=3)
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].dtype == torch.float32  # dequantized, torch.optim's format
    params = {k: v.clone() for k, v in model.state_dict().items()}
    other, _ = make("mlp", seed=3)
    other = st.wrap(other, config(other))
    other_opt = st.AdamW(other.parameters(), lr=1e-2, weight_decay=0.01, state_dtype="int8")
    other.load_state_dict(params)
    x, y = inputs(other, "dense", 0)
    loss_of(other, x, y).backward()  # the states exist once a step ran; then they are overwritten
    other_opt.step()
    other_opt.zero_grad()
    other.load_state_dict(params)
    other_opt.load_state_dict(sd)
    again = other_opt.state_dict()
    for i, s in sd["state"].items():
        assert torch.equal(again["state"][i]["step"], s["step"])
        for k in ("exp_avg", "exp_avg_sq"):
            # Quantized again, each value is back within one code of the map: not exact, since a block
            # whose largest |m| is negative has it at the signed map's -0.99297 (it has no -1), so its
            # new scale is 0.99297 of the old and every code is chosen afresh.
            got, want = again["state"][i][k].flatten(), s[k].flatten()
            for b in range(0, want.numel(), 256):
                top = want[b:b + 256].abs().max()
                assert (got[b:b + 256] - want[b:b + 256]).abs().max() <= 0.05 * top, (i, k, b)
    x, y = inputs(other, "dense", 1)
    loss_of(other, x, y).backward()
    other_opt.step()
    model.strata.close()
    other.strata.close()


def test_what_has_no_8bit_rule_or_disagrees_is_refused():
    with pytest.raises(ValueError, match=r"state_dtype = 'int4'.*\"int8\""):
        train("int4")
    with pytest.raises(ValueError, match=r"precision.states = 'bf16' but the optimizer's state_dtype asks for 'q8'"):
        train("int8", cfg_extra={"precision": {"states": "bf16"}})
    model, _ = make("mlp")
    cfg = config(model)
    cfg["precision"] = {"states": "q8"}
    model = st.wrap(model, cfg)
    with pytest.raises((ValueError, RuntimeError), match="optimizer sgd has no 8-bit state rule"):
        st.SGD(model.parameters(), lr=0.1, momentum=0.9)
