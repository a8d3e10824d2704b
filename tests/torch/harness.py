"""Training loops run both ways — torch only, and through strata.torch — on the same data."""

import torch

import strata.torch as st
from models import MODELS, inputs, loss_of, make


def train_steps(model, opt, kind, steps, losses=None):
    """Trains `model` with `opt` on the batches of `steps` (zero_grad after each step); appends
    each step's loss to `losses` (a new list when None) and returns it."""
    losses = [] if losses is None else losses
    for step in steps:
        x, y = inputs(model, kind, step)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    return losses


def align(n, a=4096):
    return (n + a - 1) // a * a


def config(model, nvme_dir=None, engine="uring", chunk_elems=4096, gpu_slots=None, host_factor=3.0,
           host_extra=2 * 1024 * 1024):
    """A sim-device config whose GPU budget holds only the model's fewest working chunk slots
    (MODELS: every layer is evicted in every step)."""
    if gpu_slots is None:
        gpu_slots = next(slots for cls, _, slots in MODELS.values() if isinstance(model, cls))
    largest = max(p.numel() for p in model.parameters())
    slot = (largest + chunk_elems - 1) // chunk_elems * chunk_elems * 4
    params = sum(align(p.numel() * 4) for p in model.parameters())
    cfg = {
        "device": {"kind": "sim", "budget": "256MiB"},
        "budgets": {"gpu": gpu_slots * slot, "host": int(params * host_factor) + host_extra},
        "layout": {"chunk_elems": chunk_elems},
        "threads": 2,
    }
    if nvme_dir is not None:
        cfg["budgets"]["nvme"] = "64MiB"
        cfg["nvme"] = {"dirs": [str(nvme_dir)], "engine": engine}
    return cfg


def run(name, steps, strata_cfg=None, optimizer=("sgd", {"lr": 0.125}), micro=1, reference_step=None,
        on_step=None):
    """Trains `name` for `steps` steps; returns (losses, state_dict, model, optimizer).

    strata_cfg None: torch only, with torch.optim (or reference_step(params, step) when given).
    """
    model, kind = make(name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt_name, hyper = optimizer
    if strata_cfg is not None:
        model = st.wrap(model, strata_cfg)
        cls = {"sgd": st.SGD, "adamw": st.AdamW, "adam": st.Adam}[opt_name]
        opt = cls(trainable, **hyper)
    elif reference_step is None:
        cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[opt_name]
        opt = cls(trainable, **hyper)
    else:
        opt = None
    losses = []
    for step in range(steps):
        if hasattr(model, "use_branch"):
            model.use_branch = step % 2 == 0
        total = 0.0
        for m in range(micro):
            x, y = inputs(model, kind, step, m)
            loss = loss_of(model, x, y)
            if micro > 1:
                loss = loss * (1.0 / micro)
            loss.backward()
            losses.append(loss.detach().clone())
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:
            reference_step(trainable, step + 1)
        if on_step is not None:
            on_step(step, model, opt)
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, model, opt


def assert_identical(a, b):
    losses_a, state_a = a[0], a[1]
    losses_b, state_b = b[0], b[1]
    assert len(losses_a) == len(losses_b)
    for i, (x, y) in enumerate(zip(losses_a, losses_b)):
        assert torch.equal(x, y), f"loss {i} differs: {x.item()!r} vs {y.item()!r}"
    assert state_a.keys() == state_b.keys()
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), f"{k} differs (max |d| = {(state_a[k] - state_b[k]).abs().max()})"


def tiered_config(name, nvme_dir, engine="uring"):
    """A config whose host budget holds the params, half of the Adam states and generous staging:
    the other optimizer states live on NVMe."""
    model, _ = make(name)
    cfg = config(model, nvme_dir, engine, host_extra=0)
    largest = max(p.numel() for p in model.parameters())
    slot = (largest + 4095) // 4096 * 4096 * 4
    params = sum(align(p.numel() * 4) for p in model.parameters())
    cfg["budgets"]["host"] = int(params * 2.2) + 10 * slot  # part of the states (2 x params) fit
    return cfg
