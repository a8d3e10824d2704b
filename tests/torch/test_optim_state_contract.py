"""opt.load_state_dict takes every torch.optim optimizer's state for the optimizers strata offers
with a torch equivalent (SGD, Adam, AdamW, Adagrad) and continues: bit-exactly for SGD, within
the kernels' tolerance for the others; what strata cannot continue is refused naming the key, and
nothing is dropped. strata's opt.state_dict() loads into torch.optim and continues (#25, item 4)."""

import pytest
import torch

import strata.torch as st
from harness import assert_identical, config, train_steps
from models import inputs, loss_of, make

TORCH = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW,
         "adagrad": torch.optim.Adagrad}
STRATA = {"sgd": st.SGD, "adam": st.Adam, "adamw": st.AdamW, "adagrad": st.Adagrad}
CASES = {
    "sgd": {"lr": 0.125, "momentum": 0.5},
    "sgd_nesterov": {"lr": 0.125, "momentum": 0.5, "nesterov": True},
    "sgd_plain": {"lr": 0.125},
    "adam": {"lr": 1e-2, "weight_decay": 0.01},
    "adamw": {"lr": 1e-2, "weight_decay": 0.01},
    "adagrad": {"lr": 0.05},
}
NAME = "shared"  # frozen layer, buffers, a shared submodule


def torch_run(opt_name, hyper, steps, seed=0):
    model, kind = make(NAME, seed)
    opt = TORCH[opt_name](model.parameters(), **hyper)
    losses = []
    train_steps(model, opt, kind, steps, losses)
    return model, opt, losses


def strata_model(opt_name, hyper, seed=7):
    model, kind = make(NAME, seed)
    model = st.wrap(model, config(model))
    opt = STRATA[opt_name](model.parameters(), **hyper)
    return model, opt, kind


def compare(a, b, exact):
    for k, v in a.items():
        if exact:
            assert torch.equal(b[k], v), f"{k} differs (max |d| = {(b[k] - v).abs().max()})"
        else:
            torch.testing.assert_close(b[k], v, rtol=2e-5, atol=2e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_optimizer_state_loads_and_continues(case):
    opt_name, hyper = case.split("_")[0], CASES[case]
    exact = opt_name == "sgd"
    reference, _, ref_losses = torch_run(opt_name, hyper, range(6))
    first, first_opt, losses = torch_run(opt_name, hyper, range(3))
    saved = first_opt.state_dict()
    # torch holds torch.optim.SGD's momentum with no 'step'; the frozen layer (passed to torch's
    # optimizer, no gradient) has no state.
    model, opt, kind = strata_model(opt_name, hyper)
    model.load_state_dict(first.state_dict())
    opt.load_state_dict(saved)
    mine = opt.state_dict()
    assert mine["state"].keys() == saved["state"].keys()  # nothing dropped
    for i, s in saved["state"].items():
        assert mine["state"][i].keys() == s.keys(), i
        for key, value in s.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(mine["state"][i][key].to(value.dtype), value), (i, key)
            else:
                assert mine["state"][i][key] == value, (i, key)
    train_steps(model, opt, kind, range(3, 6), losses)
    compare(reference.state_dict(), model.state_dict(), exact)
    for i, (a, b) in enumerate(zip(ref_losses, losses)):
        assert torch.equal(a, b) if exact else torch.allclose(a, b, rtol=2e-5, atol=2e-6), i
    model.strata.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_strata_optimizer_state_loads_into_torch_and_continues(case):
    opt_name, hyper = case.split("_")[0], CASES[case]
    exact = opt_name == "sgd"
    model, opt, kind = strata_model(opt_name, hyper, seed=0)
    losses = []
    train_steps(model, opt, kind, range(3), losses)
    plain, _ = make(NAME, seed=11)
    plain.load_state_dict(model.state_dict())
    plain_opt = TORCH[opt_name](plain.parameters(), **hyper)
    plain_opt.load_state_dict(opt.state_dict())
    train_steps(model, opt, kind, range(3, 6), losses)
    train_steps(plain, plain_opt, kind, range(3, 6), [])
    compare(plain.state_dict(), model.state_dict(), exact)
    model.strata.close()


def refused(opt_name, hyper, saved, match):
    model, opt, kind = strata_model(opt_name, hyper)
    x, y = inputs(model, kind, 0)
    loss_of(model, x, y).backward()
    opt.step()
    before = opt.state_dict()
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    for i, s in before["state"].items():
        for key, value in s.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
    model.strata.close()


@pytest.mark.parametrize("opt_name", ["adam", "adamw"])
def test_amsgrad_state_is_refused_naming_the_key(opt_name):
    _, torch_opt, _ = torch_run(opt_name, dict(CASES[opt_name], amsgrad=True), range(2))
    refused(opt_name, CASES[opt_name], torch_opt.state_dict(),
            r"(?s)\['amsgrad'\] = True.*'max_exp_avg_sq' is not a state of strata's")


def test_a_hyperparameter_fixed_at_creation_is_refused_naming_it():
    _, torch_opt, _ = torch_run("sgd", {"lr": 0.125, "momentum": 0.9}, range(2))
    refused("sgd", CASES["sgd"], torch_opt.state_dict(),
            r"\['momentum'\] = 0\.9 in the state dict but 0\.5 in this optimizer.*SGD\(\.\.\., momentum=0\.9\)")
    _, torch_opt, _ = torch_run("adamw", dict(CASES["adamw"], betas=(0.8, 0.99)), range(2))
    refused("adamw", CASES["adamw"], torch_opt.state_dict(), r"\['betas'\] = \(0\.8, 0\.99\)")
    _, torch_opt, _ = torch_run("sgd", dict(CASES["sgd"], maximize=True), range(2))
    refused("sgd", CASES["sgd"], torch_opt.state_dict(), r"\['maximize'\] = True")


def test_lr_and_weight_decay_come_from_the_state_dict_as_in_torch():
    _, torch_opt, _ = torch_run("adamw", dict(CASES["adamw"], lr=0.5, weight_decay=0.25), range(2))
    model, opt, _ = strata_model("adamw", CASES["adamw"])
    opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[0]["weight_decay"] == 0.25
    model.strata.close()


@pytest.mark.parametrize("opt_name", ["lamb", "lars", "lion", "adamw", "sgd"])
def test_strata_state_dict_round_trip_continues_bit_exactly(opt_name):
    # LAMB, LARS and Lion have no torch.optim equivalent: strata's own dict into a fresh model and
    # optimizer continues to the bits of a straight run (every state and step counter carried).
    cls = {"lamb": st.LAMB, "lars": st.LARS, "lion": st.Lion, "adamw": st.AdamW, "sgd": st.SGD}[opt_name]
    hyper = {"lr": 0.125, "momentum": 0.5} if opt_name in ("sgd", "lars") else {"lr": 1e-2}
    runs = []
    for split in (None, 3):
        model, kind = make(NAME, 0)
        model = st.wrap(model, config(model))
        opt = cls(model.parameters(), **hyper)
        losses = []
        train_steps(model, opt, kind, range(3 if split else 6), losses)
        if split:
            model_sd, opt_sd = model.state_dict(), opt.state_dict()
            assert len(opt_sd["state"]) == 10  # every trained parameter (the frozen two have none)
            model.strata.close()
            model, kind = make(NAME, 5)
            model = st.wrap(model, config(model))
            opt = cls(model.parameters(), **hyper)
            model.load_state_dict(model_sd)
            opt.load_state_dict(opt_sd)
            train_steps(model, opt, kind, range(3, 6), losses)
        runs.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
        model.strata.close()
    assert_identical(runs[0], runs[1])


def test_trained_state_of_a_parameter_frozen_here_is_refused():
    # torch trained the layer that strata's model holds frozen: its state cannot be kept.
    model, kind = make(NAME, 0)
    model.frozen.requires_grad_(True)
    torch_opt = torch.optim.SGD(model.parameters(), **CASES["sgd"])
    x, y = inputs(model, kind, 0)
    loss_of(model, x, y).backward()
    torch_opt.step()
    refused("sgd", CASES["sgd"], torch_opt.state_dict(), r"state of param 0: the parameter is frozen here")
