"""Note [No zero_grad]: a loop that does not zero gradients between steps gets torch's sum with
"grad_reads": true, and otherwise a one-time warning at the step where strata's update first
differs from torch's; every way torch code zeroes a gradient counts as zeroing."""

import warnings

import pytest
import torch

import strata.torch as st
from harness import config
from models import inputs, loss_of, make

STEPS = 4


def zero_torch_style(model, opt, how):
    if how == "optimizer":
        opt.zero_grad()
    elif how == "optimizer_keep":
        opt.zero_grad(set_to_none=False)
    elif how == "module":
        model.zero_grad()
    elif how == "by_hand_none":
        for p in model.parameters():
            p.grad = None
    elif how == "by_hand_zero":
        for p in model.parameters():
            if p.grad is not None:
                p.grad.zero_()


def train(wrap_cfg, zero, steps=STEPS, micro=1):
    """(state_dict, warnings) of `steps` SGD steps on the mlp; zero: how (or None: never) gradients are
    zeroed, at the top of each step."""
    model, kind = make("mlp")
    if wrap_cfg is not None:
        cfg = config(model)
        cfg.update(wrap_cfg)
        model = st.wrap(model, cfg)
        opt = st.SGD(model.parameters(), lr=0.125, momentum=0.5)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.125, momentum=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(steps):
            if zero is not None:
                zero_torch_style(model, opt, zero)
            for m in range(micro):
                x, y = inputs(model, kind, s, m)
                loss_of(model, x, y).backward()
            opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if wrap_cfg is not None:
        model.strata.close()
    return state, [w for w in caught if "zero_grad" in str(w.message)]


def identical(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("how", ["optimizer", "optimizer_keep", "module", "by_hand_none", "by_hand_zero"])
@pytest.mark.parametrize("grad_reads", [False, "auto"])
def test_zeroed_loop_is_exact_and_quiet(how, grad_reads):
    reference, _ = train(None, how)
    got, caught = train({"grad_reads": grad_reads}, how)
    assert identical(reference, got)
    assert caught == []


def test_micro_batches_are_not_a_missed_zero():
    reference, _ = train(None, "optimizer", micro=3)
    got, caught = train({"gradient_accumulation_steps": 3}, "optimizer", micro=3)
    assert identical(reference, got)
    assert caught == []


@pytest.mark.parametrize("grad_reads", [False, "auto"])
def test_never_zeroed_warns_once(grad_reads):
    reference, _ = train(None, None)
    got, caught = train({"grad_reads": grad_reads}, None)
    assert not identical(reference, got), "the loop must differ from torch's here, or the warning is wrong"
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "step 2" in message and '"grad_reads": true' in message and "Note [No zero_grad]" in message
    assert caught[0].filename == __file__, "the warning points at the caller's optimizer.step()"


def test_never_zeroed_with_grad_reads_is_torch_sum():
    reference, _ = train(None, None)
    got, caught = train({"grad_reads": True}, None)
    assert identical(reference, got)
    assert caught == []
