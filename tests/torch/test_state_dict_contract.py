"""model.state_dict() / load_state_dict() of a wrapped model are torch's, key for key and bit for bit:
shared submodules (one module under two parents), ties written as a shared Parameter and as
F.linear(x, self.emb.weight), frozen parameters and buffers (#25, item 4)."""

import pytest
import torch
import torch.nn as nn

import strata.torch as st
from harness import assert_identical, config, run, train_steps
from models import MODELS, inputs, loss_of, make


def continue_from(name, state, first_losses, steps, cfg_model=None, seed=7, **cfg):
    """A fresh wrapped model (other init) loads `state` (a torch state_dict) and trains steps
    len(first_losses).. steps-1 with SGD; returns (losses, state_dict)."""
    model, kind = make(name, seed=seed)
    model = st.wrap(model, config(model, **cfg))
    opt = st.SGD([p for p in model.parameters() if p.requires_grad], lr=0.125)
    result = model.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    losses = train_steps(model, opt, kind, range(len(first_losses), steps), list(first_losses))
    return losses, {k: v.clone() for k, v in model.state_dict().items()}, model


@pytest.mark.parametrize("name", ["shared", "tied", "ftied", "frozen_unused"])
def test_state_dict_equals_torchs_key_for_key_and_bit_for_bit(name, tmp_path):
    model, _ = make(name)
    reference = run(name, 8)
    strata = run(name, 8, config(model))
    assert list(strata[1].keys()) == list(reference[1].keys())  # the same keys, in torch's order
    assert_identical(reference, strata)
    if name == "shared":
        m = strata[2]
        assert m.a.shared is m.b.shared
        assert torch.equal(strata[1]["b.shared.weight"], reference[1]["b.shared.weight"])
        assert strata[1]["b.shared.weight"].abs().sum() > 0
        # A submodule's own state_dict (under its own prefix) too.
        sub, ref_sub = m.b.state_dict(), reference[2].b.state_dict()
        assert sub.keys() == ref_sub.keys()
        for k in sub:
            assert torch.equal(sub[k], ref_sub[k]), k
        sd = m.state_dict()
        assert sd["a.shared.weight"] is sd["b.shared.weight"]  # one tensor per parameter, as torch's
    m = strata[2]
    plain, _ = make(name, seed=3)  # strata's dict loads into plain torch, strictly
    plain.load_state_dict(m.state_dict())
    for k, v in plain.state_dict().items():
        assert torch.equal(v, reference[1][k]), k
    m.strata.close()


@pytest.mark.parametrize("name", ["shared", "tied", "ftied"])
def test_load_state_dict_takes_torchs_own_dict_and_continues_bit_exactly(name, tmp_path):
    reference = run(name, 6)
    first = run(name, 3)
    assert any(k.startswith("b.shared.") for k in first[1]) or name != "shared"  # the duplicate keys
    losses, state, model = continue_from(name, first[1], first[0], 6)
    assert_identical(reference, (losses, state))
    model.strata.close()


def test_duplicate_keys_load_as_torch_loads_them(tmp_path):
    # Two different values under the two paths of one shared module: torch keeps the last.
    state = dict(run("shared", 1)[1])
    state["a.shared.weight"] = torch.full_like(state["a.shared.weight"], 0.25)
    torch_model, _ = make("shared", seed=5)
    torch_model.load_state_dict(state)
    model, _ = make("shared", seed=5)
    model = st.wrap(model, config(model))
    st.SGD([p for p in model.parameters() if p.requires_grad], lr=0.125)
    model.load_state_dict(state)
    for k, v in torch_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    model.strata.close()


def test_load_state_dict_of_a_submodule_and_non_strict(tmp_path):
    reference = run("shared", 2)
    model, _ = make("shared", seed=9)
    model = st.wrap(model, config(model))
    st.SGD([p for p in model.parameters() if p.requires_grad], lr=0.125)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sub = {k[len("b."):]: v for k, v in reference[1].items() if k.startswith("b.")}
    model.b.load_state_dict(sub)  # a submodule: the shared layer and b.own
    partial = {k: v for k, v in reference[1].items() if k.startswith("out.")}
    result = model.load_state_dict(partial, strict=False)
    assert "frozen.weight" in result.missing_keys
    for k, v in model.state_dict().items():
        expect = reference[1][k] if k.startswith(("b.", "a.shared.", "out.")) else before[k]
        assert torch.equal(v, expect), k
    model.strata.close()


def test_a_refused_load_loads_nothing_buffers_included(tmp_path):
    model, kind = make("shared")
    model = st.wrap(model, config(model))
    opt = st.SGD([p for p in model.parameters() if p.requires_grad], lr=0.125)
    x, y = inputs(model, kind, 0)
    loss_of(model, x, y).backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = {k: v + 1 for k, v in before.items()}
    bad["out.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=r"(?s)nothing was loaded.*size mismatch for out\.weight"):
        model.load_state_dict(bad)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} was partly loaded"
    model.strata.close()


def test_functional_tie_needs_no_bind_subtree_and_the_module_ties_slots():
    assert MODELS["ftied"][2] == MODELS["tied"][2]
    model, _ = make("ftied")
    cfg = config(model)  # the fewest slots: MODELS["ftied"] = MODELS["tied"]
    assert "bind_subtree" not in cfg
    assert_identical(run("ftied", 20), run("ftied", 20, cfg))


class Reader(nn.Module):
    """Reads a sibling's weight without attribute access: strata cannot see that read."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.a(x) @ next(self.b.parameters())


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Reader()
        self.c = nn.Linear(16, 16)

    def forward(self, x):
        return self.c(self.inner(x))


def test_a_missed_read_names_the_class_to_add_and_that_class_fixes_it():
    cfg = {"device": {"kind": "sim"}, "budgets": {"gpu": "1MiB", "host": "64MiB"}, "layout": {"chunk_elems": 4096}}
    torch.manual_seed(0)
    model = st.wrap(Outer(), cfg)
    opt = st.SGD(model.parameters(), lr=0.125)
    with pytest.raises(RuntimeError, match=r"(?s)'inner\.b\.weight'.*forward of 'inner' \(class Reader\).*"
                                           r"add 'Reader' to the wrap config's \"bind_subtree\""):
        model(torch.randn(4, 16)).sum().backward()
    del opt
    torch.manual_seed(0)
    reference = Outer()
    torch.manual_seed(0)
    model = st.wrap(Outer(), dict(cfg, bind_subtree=["Reader"]))
    opt = st.SGD(model.parameters(), lr=0.125)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.125)
    for step in range(4):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(step))
        a, b = reference(x).square().mean(), model(x).square().mean()
        assert torch.equal(a, b), step
        a.backward()
        b.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    for k, v in reference.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    model.strata.close()


def test_functional_tie_under_no_grad_and_in_a_head_module():
    # Without gradients the read is bound for the reading call only (no alias); and a head module
    # that owns nothing (its forward reads the embedding through the parent) frames the read too.
    reference, strata = run("ftied", 3), run("ftied", 3, config(make("ftied")[0]))
    x, _ = inputs(reference[2], "tokens", 99)
    with torch.no_grad():
        assert torch.equal(reference[2](x), strata[2](x))

    class Head(nn.Module):
        def __init__(self, owner):
            super().__init__()
            object.__setattr__(self, "owner", owner)  # not a submodule: a plain reference

        def forward(self, h):
            return torch.nn.functional.linear(h, self.owner.emb.weight)

    class WithHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = make("ftied")[0]
            self.head = Head(self.body)

        def forward(self, idx):
            b = self.body
            return self.head(torch.tanh(b.mid2(torch.tanh(b.mid(b.emb(idx))))))

    torch.manual_seed(0)
    ref_model, model = WithHead(), WithHead()
    model.load_state_dict(ref_model.state_dict())
    model = st.wrap(model, config(model.body, gpu_slots=MODELS["tied"][2]))
    opt, ref_opt = st.SGD(model.parameters(), lr=0.125), torch.optim.SGD(ref_model.parameters(), lr=0.125)
    for step in range(5):
        x, y = inputs(model, "tokens", step)
        a, b = loss_of(ref_model, x, y), loss_of(model, x, y)
        assert torch.equal(a, b), step
        a.backward()
        b.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    for k, v in ref_model.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    model.strata.close()
