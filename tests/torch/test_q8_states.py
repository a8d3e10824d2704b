"""8-bit optimizer states from strata.torch (issue #49; Note [Optimizer state dtype] in
strata/torch/optim.py): st.AdamW(state_dtype="int8") runs the runtime's q8 states (blockwise m and
v, one fp32 scale per 256 elements), which hold about a quarter of fp32's bytes, train, and go
through torch.optim's state_dict format (dequantized) and back (quantized again, within a code of
the map). Its steps equal a plain-torch 8-bit AdamW written here (PlainQ8AdamW) bit for bit. What
has no 8-bit rule is refused."""

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


# ---- a plain-torch 8-bit AdamW, the reference (Note [Q8 state chunks] in runtime/src/pipeline/q8_states.cpp)

def f32(x):
    """x rounded to float32, as a Python float."""
    return torch.tensor(x, dtype=torch.float32).item()


def dynamic_map(signed):
    """bitsandbytes' create_dynamic_map(signed, 7, 8): each entry in double, rounded once to float32, sorted."""
    data = []
    for i in range(7):
        items = (1 << i) + 1 if signed else (1 << (i + 1)) + 1
        scale = 10.0 ** (-6 + i)
        for k in range(items - 1):
            lo, hi = 0.1 + 0.9 * k / (items - 1), 0.1 + 0.9 * (k + 1) / (items - 1)
            data.append(scale * ((lo + hi) / 2.0))
            if signed:
                data.append(-scale * ((lo + hi) / 2.0))
    data += [0.0, 1.0]
    assert len(data) == 256
    return torch.tensor(data, dtype=torch.float64).to(torch.float32).sort().values


class PlainQ8AdamW:
    """AdamW with m and v as 8-bit codes and one fp32 absmax scale per block of 256 elements of each
    parameter (from its element 0), written with torch's fp32 element-wise ops in the kernel's order."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        self.params = list(params)
        self.lr, self.b1, self.b2, self.eps, self.wd = (f32(v) for v in (lr, *betas, eps, weight_decay))
        self.maps = {"m": dynamic_map(True), "v": dynamic_map(False)}
        self.mids = {k: (m[:-1] + m[1:]) / 2 for k, m in self.maps.items()}
        blocks = [(p.numel() + 255) // 256 for p in self.params]
        self.codes = {k: [torch.zeros(p.numel(), dtype=torch.long) for p in self.params] for k in self.maps}
        self.scales = {k: [torch.zeros(b) for b in blocks] for k in self.maps}
        self.t = 0

    def step(self):
        self.t += 1
        bc1, bc2 = 1.0 - self.b1 ** self.t, 1.0 - self.b2 ** self.t  # in double, as the kernel's coefficients
        step_size, inv_sqrt_bc2 = f32(self.lr / bc1), f32(1.0 / bc2 ** 0.5)
        decay = f32(1.0 - self.lr * self.wd)
        b1, omb1 = torch.tensor(self.b1), torch.tensor(1.0) - self.b1
        b2, omb2 = torch.tensor(self.b2), torch.tensor(1.0) - self.b2
        with torch.no_grad():
            for i, p in enumerate(self.params):
                flat, g = p.view(-1), p.grad.reshape(-1)
                for b in range((flat.numel() + 255) // 256):
                    s = slice(256 * b, min(256 * (b + 1), flat.numel()))
                    m = self.maps["m"][self.codes["m"][i][s]] * self.scales["m"][i][b]
                    v = self.maps["v"][self.codes["v"][i][s]] * self.scales["v"][i][b]
                    gb = torch.tensor(0.0) * flat[s] + g[s]  # Adam's L2 term, 0 for AdamW (it can turn -0 into +0)
                    m = b1 * m + omb1 * gb
                    v = b2 * v + (omb2 * gb) * gb
                    denom = torch.sqrt(v) * inv_sqrt_bc2 + self.eps
                    flat[s] = flat[s] * decay - (step_size * m) / denom
                    for k, x in (("m", m), ("v", v)):
                        scale = x.abs().max()
                        self.scales[k][i][b] = scale
                        inv = torch.tensor(1.0) / scale if scale > 0 else torch.tensor(0.0)
                        self.codes[k][i][s] = torch.searchsorted(self.mids[k], x * inv)  # how many midpoints below

    def dequantized(self, i, k):
        p = self.params[i]
        scales = self.scales[k][i].repeat_interleave(256)[:p.numel()]
        return (self.maps[k][self.codes[k][i]] * scales).view(p.shape)


def test_int8_adamw_equals_a_plain_torch_8bit_adamw_bit_for_bit():
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    model, _ = make("mlp")
    reference, _ = make("mlp")
    model = st.wrap(model, config(model, chunk_elems=1 << 16))
    opt = st.AdamW(model.parameters(), state_dtype="int8", **hyper)
    ref_opt = PlainQ8AdamW(reference.parameters(), **hyper)
    for s in range(5):
        for m in (model, reference):
            x, y = inputs(m, "dense", s)
            loss_of(m, x, y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        reference.zero_grad(set_to_none=True)
        got = model.state_dict()
        for k, v in reference.state_dict().items():
            assert torch.equal(got[k], v), f"step {s + 1}: {k} differs (max |d| {(got[k] - v).abs().max()})"
    sd = opt.state_dict()
    for i in range(len(ref_opt.params)):
        assert torch.equal(sd["state"][i]["exp_avg"], ref_opt.dequantized(i, "m")), i
        assert torch.equal(sd["state"][i]["exp_avg_sq"], ref_opt.dequantized(i, "v")), i
    model.strata.close()
