"""torch's contract between steps (#25): reads see current values, writes reach strata's chunks, torch's
own clip_grad_norm_ / clip_grad_value_ work on wrapped parameters, and zero_grad(set_to_none=...) behaves
as in torch. Each case is checked against torch-only training: bit-identical for SGD."""

import re

import pytest
import torch
import torch.nn as nn

import strata.torch as st
from harness import config
from models import inputs, loss_of, make

# --- helpers -------------------------------------------------------------------------------------


def pair(name, tmp_path, nvme=False, opt=("sgd", {"lr": 0.125}), **extra):
    """(torch model, torch optimizer, strata model, strata optimizer, input kind), same initial weights."""
    ref, kind = make(name)
    model, _ = make(name)
    cfg = config(model, tmp_path if nvme else None, "posix")
    cfg.update(extra)
    model = st.wrap(model, cfg)
    opt_name, hyper = opt
    ref_cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[opt_name]
    cls = {"sgd": st.SGD, "adamw": st.AdamW}[opt_name]
    trainable = [p for p in ref.parameters() if p.requires_grad]
    return ref, ref_cls(trainable, **hyper), model, cls([p for p in model.parameters() if p.requires_grad],
                                                          **hyper), kind


def nvme_params_pair(tmp_path, deferred=0):
    """pair() for "deep" with a host budget that holds only 4 of its 16 param chunks: 12 live on NVMe;
    `deferred` of their updates run in the next forward (plan.deferred_updates), with room for their
    gradients."""
    ref, kind = make("deep")
    model, _ = make("deep")
    cfg = config(model, tmp_path, "posix")
    cfg["budgets"]["host"] = 224 * 1024
    if deferred:
        cfg["plan"] = {"deferred_updates": deferred}
        cfg["budgets"]["host"] += deferred * 16 * 1024
    model = st.wrap(model, cfg)
    return ref, torch.optim.SGD(ref.parameters(), lr=0.125), model, st.SGD(model.parameters(), lr=0.125), kind


def assert_params_on_nvme(model):
    plan = model.strata.engine.describe()
    assert re.search(r"params home gpu/host/nvme = \d+/\d+/[1-9]", plan), plan


def step_both(ref, ref_opt, model, opt, kind, step, set_to_none=False):
    x, y = inputs(ref, kind, step)
    a = loss_of(ref, x, y)
    a.backward()
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=set_to_none)
    b = loss_of(model, x, y)
    b.backward()
    opt.step()
    opt.zero_grad(set_to_none=set_to_none)
    assert torch.equal(a, b), f"step {step}: loss {a.item()!r} vs {b.item()!r}"


def assert_same_params(ref, model):
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert torch.equal(a.detach(), b.detach().clone()), n


# --- 1. reads between steps ----------------------------------------------------------------------


def assert_updates_deferred(model):
    """The last step left updates to the next forward (Note [Deferred updates]): the case tests them."""
    assert model.strata.last_stats["updates_deferred"] > 0, model.strata.engine.describe()


@pytest.mark.parametrize("where", ["host", "nvme_states"])
def test_reads_between_steps_see_current_values(where, tmp_path):
    ref, ref_opt, model, opt, kind = pair("mlp", tmp_path, nvme=where != "host")
    ema = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    assert_same_params(ref, model)  # before any step: the initial values, not poison
    for step in range(4):
        step_both(ref, ref_opt, model, opt, kind, step)
        for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            assert torch.equal(b.data, a.data), f"{n}: p.data"
            assert torch.equal(b.clone(), a.clone()), f"{n}: p.clone()"
            assert torch.equal(b.norm(), a.norm()), f"{n}: p.norm()"
            assert torch.equal(b.detach().cpu(), a.detach()), f"{n}: p.detach().cpu()"
            assert str(b) == str(a), f"{n}: print(p)"
            assert b.abs().sum() > 0, f"{n}: zeros"
            with torch.no_grad():
                e = ema[n].clone().mul_(0.5).add_(b, alpha=0.5)
                ema[n].mul_(0.5).add_(a, alpha=0.5)
            assert torch.equal(e, ema[n]), f"{n}: ema"
    assert model.strata.engine.poison_hits() == []


@pytest.mark.parametrize("deferred", [0, 3])
def test_reads_of_nvme_homed_params(deferred, tmp_path):
    ref, ref_opt, model, opt, kind = nvme_params_pair(tmp_path, deferred)
    for step in range(3):
        step_both(ref, ref_opt, model, opt, kind, step)
        if deferred:
            assert_updates_deferred(model)
        assert_same_params(ref, model)
    assert_params_on_nvme(model)


def test_reads_after_a_no_grad_forward_and_between_micro_batches(tmp_path):
    ref, ref_opt, model, opt, kind = pair("mlp", tmp_path)
    step_both(ref, ref_opt, model, opt, kind, 0)
    x, _ = inputs(ref, kind, 1)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert_same_params(ref, model)
    # A second forward after reads binds leases as before.
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_a_read_between_backward_and_step_raises_naming_the_parameter(tmp_path):
    _, _, model, opt, kind = pair("mlp", tmp_path, grad_reads=False)
    for step in range(2):
        x, y = inputs(model, kind, step)
        loss_of(model, x, y).backward()
        if step == 1:
            with pytest.raises(RuntimeError, match=r"'fc1\.weight'.*between the last backward.*optimizer\.step"):
                model.fc1.weight.norm()
        opt.step()
        opt.zero_grad()
    assert model.fc1.weight.norm() > 0  # after step() it reads


# --- 2. writes between steps ----------------------------------------------------------------------

WRITES = {
    "mul_": lambda p, n: p.mul_(0.5),
    "copy_": lambda p, n: p.copy_(torch.full_like(p, 0.25)),
    "fill_": lambda p, n: p.fill_(0.125),
    "nn.init.normal_": lambda p, n: nn.init.normal_(p, std=0.02),
    "nn.init.zeros_": lambda p, n: nn.init.zeros_(p),
    "p.data.mul_": lambda p, n: p.data.mul_(2.0),
    "p.data.copy_": lambda p, n: p.data.copy_(torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) / 1024),
    "p.data =": lambda p, n: setattr(p, "data", torch.ones(p.shape) / 64),
    "numpy": lambda p, n: p.detach().numpy().__imul__(0.75),
}


@pytest.mark.parametrize("how", sorted(WRITES))
def test_writes_between_steps_are_used_by_the_next_forward(how, tmp_path):
    ref, ref_opt, model, opt, kind = pair("mlp", tmp_path)
    write = WRITES[how]
    for step in range(5):
        if step == 2:
            torch.manual_seed(7)
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    if n.startswith("fc2"):
                        write(p, n)
            torch.manual_seed(7)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n.startswith("fc2"):
                        write(p, n)
            assert torch.equal(model.fc2.weight.clone(), ref.fc2.weight), "the write is visible at once"
            assert torch.equal(model.state_dict()["fc2.weight"], ref.fc2.weight), "state_dict sees the write"
        step_both(ref, ref_opt, model, opt, kind, step)
    assert_same_params(ref, model)


@pytest.mark.parametrize("deferred", [0, 3])
def test_writes_reach_nvme_homed_params(deferred, tmp_path):
    # deferred: a write right after step() lands after the updates carried into the next forward.
    ref, ref_opt, model, opt, kind = nvme_params_pair(tmp_path, deferred)
    for step in range(4):
        if step == 2:
            with torch.no_grad():
                for a, b in zip(ref.parameters(), model.parameters()):
                    a.mul_(0.5)
                    b.mul_(0.5)
        step_both(ref, ref_opt, model, opt, kind, step)
    assert_same_params(ref, model)
    assert_params_on_nvme(model)


def test_writes_before_the_first_step_and_adamw_within_tolerance(tmp_path):
    hyper = {"lr": 1e-2, "weight_decay": 0.1}
    ref, ref_opt, model, opt, kind = pair("mlp", tmp_path, opt=("adamw", hyper))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in ref.parameters():
            nn.init.uniform_(p, -0.1, 0.1)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            nn.init.uniform_(p, -0.1, 0.1)
    for step in range(6):
        for m, o in ((ref, ref_opt), (model, opt)):
            x, y = inputs(ref, kind, step)
            loss_of(m, x, y).backward()
            o.step()
            o.zero_grad()
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.detach().clone(), a.detach(), rtol=0, atol=2e-5, msg=n)


def test_a_replacement_of_another_shape_raises_naming_the_parameter(tmp_path):
    _, _, model, opt, kind = pair("mlp", tmp_path)
    x, y = inputs(model, kind, 0)
    loss_of(model, x, y).backward()
    opt.step()
    model.fc2.bias.data = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'fc2\.bias'|\"fc2\.bias\""):
        loss_of(model, x, y)


# --- 3. torch's clip_grad_norm_ / clip_grad_value_ and p.grad ------------------------------------


@pytest.mark.parametrize("grad_reads", ["auto", True])
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_torch_clipping_is_bit_identical(clip, grad_reads, tmp_path):
    hyper = {"lr": 0.5, "momentum": 0.5}
    ref, ref_opt, model, opt, kind = pair("mlp", tmp_path, opt=("sgd", hyper), grad_reads=grad_reads)
    for step in range(6):
        norms = []
        for m, o in ((ref, ref_opt), (model, opt)):
            x, y = inputs(ref, kind, step)
            loss_of(m, x, y).backward()
            if clip == "norm":
                norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
            else:
                torch.nn.utils.clip_grad_value_(m.parameters(), 0.002)
                norms.append(torch.stack([p.grad.norm() for p in m.parameters()]))
            o.step()
            o.zero_grad()
        assert torch.equal(norms[0], norms[1]), f"step {step}: {norms[0]} vs {norms[1]}"
        if clip == "norm":
            assert norms[0] > 0.05, "the test must clip"
    assert_same_params(ref, model)


def test_gradients_read_after_backward_equal_torchs(tmp_path):
    ref, ref_opt, model, opt, kind = pair("mlp", tmp_path, grad_reads=True, gradient_accumulation_steps=2)
    for step in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            for micro in range(2):
                x, y = inputs(ref, kind, step, micro)
                (loss_of(m, x, y) * 0.5).backward()
        for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            assert torch.equal(a.grad, b.grad), n
        for o in (ref_opt, opt):
            o.step()
            o.zero_grad()
    assert_same_params(ref, model)


def test_a_gradient_handed_to_strata_raises_saying_how_to_get_it(tmp_path):
    _, _, model, opt, kind = pair("mlp", tmp_path, grad_reads=False)
    x, y = inputs(model, kind, 0)
    loss_of(model, x, y).backward()
    g = model.fc1.weight.grad
    assert g is not None, "torch would hold a gradient: p.grad is not None"
    assert g.shape == model.fc1.weight.shape and g.dtype == model.fc1.weight.dtype
    with torch._C.DisableTorchFunction():  # the placeholder refuses every torch call, untyped_storage() included
        held = g.untyped_storage().nbytes() if hasattr(g, "untyped_storage") else g.storage().nbytes()
    assert held <= 8, held  # no memory held
    with pytest.raises(RuntimeError, match=r"'fc1\.weight'.*grad_reads.*max_grad_norm"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match=r"grad_reads"):
        g.norm()
    opt.step()
    opt.zero_grad()  # torch's default (set_to_none=False) works on the placeholder
    model.zero_grad()
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())


def test_auto_keeps_gradients_only_while_someone_reads_them(tmp_path):
    _, _, model, opt, kind = pair("mlp", tmp_path)  # grad_reads "auto"
    for step in range(3):
        x, y = inputs(model, kind, step)
        loss_of(model, x, y).backward()
        g = model.fc1.weight.grad
        if step == 0:
            assert type(g).__name__ == "_WatchedGrad", "step 1 keeps torch's gradient"
        else:
            assert type(g).__name__ == "_StrataGrad", "no one read gradients in step 1: handed in backward"
        opt.step()
        opt.zero_grad()


# --- 6. zero_grad(set_to_none=...) -----------------------------------------------------------------


@pytest.mark.parametrize("grad_reads", [False, "auto"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_parameters_without_a_gradient_step_as_in_torch(set_to_none, grad_reads, tmp_path):
    # frozen_unused: its branch gets a gradient on even steps only; momentum and weight decay
    # update it on odd steps too unless zero_grad(set_to_none=True) made its grad None.
    hyper = {"lr": 0.125, "momentum": 0.5, "weight_decay": 0.25}
    ref, ref_opt, model, opt, kind = pair("frozen_unused", tmp_path, opt=("sgd", hyper), grad_reads=grad_reads)
    branch = model.branch.weight.clone()
    for step in range(6):
        ref.use_branch = model.use_branch = step % 2 == 0
        step_both(ref, ref_opt, model, opt, kind, step, set_to_none=set_to_none)
        if step == 1:
            moved = not torch.equal(model.branch.weight.clone(), branch)
            assert moved != set_to_none, "an unused step moves the branch only with zero grads"
        branch = model.branch.weight.clone()
    assert_same_params(ref, model)


def test_a_submodules_zero_grad_set_to_none_is_seen(tmp_path):
    # torch's own Module.zero_grad on a submodule sets p.grad = None: the branch is then skipped in
    # the steps where it gets no gradient, as in torch.
    hyper = {"lr": 0.125, "momentum": 0.5}
    ref, ref_opt, model, opt, kind = pair("frozen_unused", tmp_path, opt=("sgd", hyper), grad_reads=False)
    for step in range(6):
        ref.use_branch = model.use_branch = step % 2 == 0
        for m, o in ((ref, ref_opt), (model, opt)):
            x, y = inputs(ref, kind, step)
            loss_of(m, x, y).backward()
            o.step()
            o.zero_grad()
            if step == 2:
                torch.nn.Module.zero_grad(m.branch, set_to_none=True)
    assert_same_params(ref, model)


def test_bf16_parameters_read_and_write_between_steps(tmp_path):
    model, kind = make("mlp")
    model = model.to(torch.bfloat16)
    cfg = config(model, None)
    model = st.wrap(model, cfg)
    opt = st.AdamW(model.parameters(), lr=1e-3)
    x, y = inputs(model, kind, 0)
    loss_of(model, x.to(torch.bfloat16), y).backward()
    opt.step()
    opt.zero_grad()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.fc1.weight.dtype == torch.bfloat16
    assert torch.equal(model.fc1.weight.clone().float(), saved["fc1.weight"])
    with torch.no_grad():
        model.fc1.weight.mul_(2)
    assert torch.equal(model.state_dict()["fc1.weight"], saved["fc1.weight"] * 2)
    loss_of(model, x.to(torch.bfloat16), y).backward()  # the next forward takes the write
    opt.step()
    assert model.strata.engine.poison_hits() == []


def test_a_parameter_left_out_of_the_optimizer_keeps_torchs_gradient(tmp_path):
    ref, kind = make("mlp")
    model, _ = make("mlp")
    model = st.wrap(model, config(model, None))
    ref_opt = torch.optim.SGD([p for n, p in ref.named_parameters() if not n.startswith("fc1")], lr=0.125)
    opt = st.SGD([p for n, p in model.named_parameters() if not n.startswith("fc1")], lr=0.125)
    for step in range(3):  # no zero_grad of fc1: its gradient adds up in torch
        step_both(ref, ref_opt, model, opt, kind, step)
        assert torch.equal(model.fc1.weight.grad, ref.fc1.weight.grad)
    assert_same_params(ref, model)


def test_zero_grad_defaults_as_the_running_torchs(tmp_path):
    # torch.optim's zero_grad() sets gradients to None from torch 2.0 (zeroes them before): strata's optimizer
    # follows the torch it runs under, so p.grad after zero_grad() is what torch's would be.
    ref, ref_opt, model, opt, kind = pair("mlp", tmp_path, opt=("sgd", {"lr": 0.125, "momentum": 0.5}),
                                          grad_reads=True)
    for m, o in ((ref, ref_opt), (model, opt)):
        x, y = inputs(ref, kind, 0)
        loss_of(m, x, y).backward()
        o.step()
        o.zero_grad()
    for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert (a.grad is None) == (b.grad is None), (n, a.grad, b.grad)
        if a.grad is not None:
            assert torch.equal(a.grad, b.grad.clone()), n


@pytest.mark.parametrize("between", ["no_grad_forward", "grad_forward_twice"])
def test_zero_gradients_survive_forwards_between_steps(tmp_path, between):
    # zero_grad(set_to_none=False) leaves torch a zero gradient; a branch unused in the next step is
    # then still stepped (momentum). A forward between steps (an eval under no_grad, or a grad-enabled
    # forward whose output is dropped before the real one) took strata's placeholder out of p.grad, and the
    # next forward read the None as "set to None": the branch was skipped, silently (before this fix).
    hyper = {"lr": 0.125, "momentum": 0.5}
    ref, ref_opt, model, opt, kind = pair("frozen_unused", tmp_path, opt=("sgd", hyper), grad_reads=False)
    for step in range(6):
        ref.use_branch = model.use_branch = step % 2 == 0
        x, y = inputs(ref, kind, step)
        if between == "no_grad_forward":
            with torch.no_grad():
                assert torch.equal(ref(x), model(x)), step
        else:
            model(x)
            ref(x)
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad(set_to_none=False)
            loss_of(m, x, y).backward()
            o.step()
    assert_same_params(ref, model)
