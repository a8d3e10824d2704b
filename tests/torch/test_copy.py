"""copy.deepcopy, copy.copy, pickle and torch.save of a wrapped model give a plain torch model with the
current values (ties and shared submodules kept), and the wrapped model trains on unchanged;
reparametrisations computed in forward pre-hooks (old weight_norm, spectral_norm, pruning) and
parametrizations train bit-identically to torch alone (#25, item 5)."""

import copy
import io
import pickle

import pytest
import torch

import strata.torch as st
from harness import assert_identical, config, run, train_steps
from models import inputs, loss_of, make


def trained(name, steps=3, seed=0):
    model, kind = make(name, seed)
    model = st.wrap(model, config(model))
    opt = st.SGD([p for p in model.parameters() if p.requires_grad], lr=0.125)
    for step in range(steps):
        x, y = inputs(model, kind, step)
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, kind


def assert_plain(copy_, original_state):
    assert not hasattr(copy_, "strata") and getattr(copy_, "_strata_wrapped", None) is None
    for m in copy_.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks and not m._state_dict_hooks, m
        assert not {"load_state_dict", "__deepcopy__", "__reduce_ex__", "_strata_owner"} & m.__dict__.keys()
    state = copy_.state_dict()
    assert state.keys() == original_state.keys()
    for k, v in original_state.items():
        assert torch.equal(state[k], v), k


def continue_plain(model, kind, steps):
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.125)
    return train_steps(model, opt, kind, steps), model.state_dict()


COPIES = {
    "deepcopy": copy.deepcopy,
    "copy": copy.copy,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    # A whole module is a pickle of its classes: torch >= 2.6 loads only weights unless told
    # (weights_only=False; the argument exists since torch 1.13).
    "torch.save": lambda m: (lambda b: (torch.save(m, b), b.seek(0), torch.load(b, weights_only=False))[2])(
        io.BytesIO()),
}


@pytest.mark.parametrize("how", sorted(COPIES))
@pytest.mark.parametrize("name", ["shared", "tied"])
def test_a_copy_is_plain_torch_with_current_values(name, how):
    model, opt, kind = trained(name)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    c = COPIES[how](model)
    assert c is not model
    assert_plain(c, state)
    if name == "shared":
        assert c.a.shared is c.b.shared
    else:
        assert c.head.weight is c.emb.weight
    # The copy trains as plain torch; the wrapped model trains on as before, to the same bits.
    reference = run(name, 6)
    copy_losses, copy_state = continue_plain(c, kind, range(3, 6))
    assert_identical((reference[0][3:], reference[1]), (copy_losses, copy_state))
    losses = []
    for step in range(3, 6):
        x, y = inputs(model, kind, step)
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    assert_identical((reference[0][3:], reference[1]), (losses, model.state_dict()))
    model.strata.close()


def test_deepcopy_of_a_submodule_and_of_a_container():
    model, opt, _ = trained("shared")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sub = copy.deepcopy(model.b)
    assert_plain(sub, {k[2:]: v for k, v in state.items() if k.startswith("b.")})
    params = list(model.parameters())
    c, c_params = copy.deepcopy((model, params))  # one memo: the copied list holds the copy's parameters
    assert all(a is b for a, b in zip(c_params, c.parameters()))
    model.strata.close()


def test_a_copy_before_the_engine_exists_and_after_close():
    model, kind = make("mlp")
    model = st.wrap(model, config(model))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert_plain(copy.deepcopy(model), state)  # no optimizer and no forward yet: plain torch values
    opt = st.SGD(model.parameters(), lr=0.125)
    x, y = inputs(model, kind, 0)
    loss_of(model, x, y).backward()
    opt.step()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.strata.close()
    assert_plain(copy.deepcopy(model), state)


def test_reparametrisations_in_pre_hooks_train_bit_identically():
    # weight_norm (old), spectral_norm (old) and pruning compute the weight in a forward pre-hook
    # registered before wrap; a parametrization computes it in its own module.
    model, _ = make("reparam")
    reference = run("reparam", 10)
    strata = run("reparam", 10, config(model))
    assert_identical(reference, strata)
    assert "wn.weight_g" in strata[1] and "pruned.weight_orig" in strata[1]
    strata[2].strata.close()


def test_a_weight_normed_root_module_trains_bit_identically():
    results = []
    for use_strata in (False, True):
        torch.manual_seed(0)
        model = torch.nn.utils.weight_norm(torch.nn.Linear(64, 10))
        if use_strata:
            model = st.wrap(model, {"device": {"kind": "sim"}, "budgets": {"gpu": "1MiB", "host": "64MiB"},
                                    "layout": {"chunk_elems": 4096}})
        opt = (st.SGD if use_strata else torch.optim.SGD)(model.parameters(), lr=0.125)
        losses = []
        for step in range(5):
            x, y = inputs(model, "dense", step)
            loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
        results.append((losses, {k: v.clone() for k, v in model.state_dict().items()}))
    assert_identical(results[0], results[1])
