"""torch.compile of a wrapped model (issue #27; Note [torch.compile] in strata/torch/_compile.py,
docs/torch.md "torch.compile"). strata's hooks run eagerly between the compiled graphs, so each way
of compiling trains, with every layer evicted each step, to the bits of torch alone compiled the same
way: with backend "eager" and "aot_eager" against plain torch.compile; with "inductor", whose kernels
depend on where the graphs end, against torch alone compiled with the same graph breaks (a no-op
hook that dynamo does not trace on the same modules) and within 1e-4 of plain torch.compile.
Compiled autograd and fullgraph=True are refused with a message. Skipped (pytest exit 5) under torch 1.x, which has no torch.compile."""

import pytest
import torch

if not hasattr(torch, "compile"):
    pytest.skip("torch.compile needs torch >= 2 (this is torch " + torch.__version__ + ")", allow_module_level=True)

import strata.torch as st  # noqa: E402
from harness import config, train_steps  # noqa: E402
from models import inputs, loss_of, make  # noqa: E402

STEPS = 3


def _breaks(model):
    """torch alone with graph breaks where strata's hooks are: the modules that own parameters, and the root."""
    nop = torch._dynamo.disable(lambda *args: None)
    for m in model.modules():
        if m is model or any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(nop)
            m.register_forward_hook(nop)


def _child(model):
    return [n for n, c in model.named_children() if any(True for _ in c.parameters())][1]


def _train(how, backend, strata, name="mlp", breaks=False):
    torch._dynamo.reset()
    model, kind = make(name)
    params = list(model.parameters())
    if strata and how == "wrap_compiled":
        run = st.wrap(torch.compile(model, backend=backend), config(model))
        wrapped = run
    else:
        if strata:
            model = st.wrap(model, config(model))  # the fewest GPU slots: every layer evicted each step
            wrapped = model
        elif breaks:
            _breaks(model)
        run = model
        if how in ("compile", "wrap_compiled"):
            run = torch.compile(model, backend=backend)
        elif how == "method":
            model.compile(backend=backend)
        elif how == "submodule":
            cname = _child(model)
            setattr(model, cname, torch.compile(getattr(model, cname), backend=backend))
        elif how == "submodule_method":
            getattr(model, _child(model)).compile(backend=backend)
    opt = (st.SGD if strata else torch.optim.SGD)(params, lr=0.125)
    losses = train_steps(run, opt, kind, range(STEPS))  # (inputs() finds a compiled module's Linear too)
    if not strata:
        return losses, [p.detach().clone() for p in params], None
    assert wrapped.strata.last_stats["bytes_h2d"] > 0, "nothing was evicted: the test would not test offload"
    return losses, None, wrapped


def _check(how, backend, name="mlp"):
    got, _, model = _train(how, backend, True, name)
    sd = {k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()}  # strata's values
    ref_model, _ = make(name)
    keys = [k for k, _ in ref_model.named_parameters()]
    got_w = [sd[k] for k in keys]
    if backend == "inductor":
        ref, ref_w, _ = _train(how, backend, False, name, breaks=True)
        plain, plain_w, _ = _train(how, backend, False, name)
        for a, b in zip(got_w, plain_w):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    else:
        ref, ref_w, _ = _train(how, backend, False, name)
    assert [x.item() for x in got] == [x.item() for x in ref]
    for k, a, b in zip(keys, got_w, ref_w):
        assert torch.equal(a, b), f"{k}: {how} {backend} differs from torch alone"
    model.strata.close()


# Every way with the default backend and "eager"; "aot_eager" (AOTAutograd's graphs run eagerly) for the two
# that compile the wrapped root (the others run the same graphs): the file's time goes to compiling.
@pytest.mark.parametrize("how,backend", [(how, backend) for how in ("compile", "method", "wrap_compiled", "submodule",
                                                                     "submodule_method")
                                         for backend in ("eager", "inductor")] +
                         [("compile", "aot_eager"), ("wrap_compiled", "aot_eager")])
def test_compiled_mlp_trains_as_torch_alone(how, backend):
    _check(how, backend)


# ftied reads emb.weight in the root's forward (Note [Parameters read by another module]): the attribute access
# that binds it runs eagerly (a graph break) under torch.compile too.
@pytest.mark.parametrize("name", ["encoder", "tied", "checkpoint", "ftied"])
def test_compiled_models_train_as_torch_alone(name):
    _check("compile", "aot_eager", name)


def test_fullgraph_is_refused_naming_strata():
    model, kind = make("mlp")
    model = st.wrap(model, config(model))
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager", fullgraph=True)
    x, y = inputs(model, kind, 0)
    with pytest.raises(Exception, match="strata.torch's hooks run eagerly.*fullgraph=True"):
        loss_of(run, x, y)


@pytest.mark.parametrize("where", ["config", "context", "backward_only"])
def test_compiled_autograd_is_refused(where):
    from torch._dynamo import compiled_autograd

    model, kind = make("mlp")
    model = st.wrap(model, config(model))
    opt = st.SGD(model.parameters(), lr=0.125)
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager")
    x, y = inputs(model, kind, 0)
    with pytest.raises(st.StrataError, match="compiled autograd is on"):
        if where == "config":
            with torch._dynamo.config.patch(compiled_autograd=True):
                loss_of(run, x, y)
        elif where == "context":
            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss_of(run, x, y)
        else:
            loss = loss_of(run, x, y)
            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
    # With it off again the model trains (from torch's values: nothing was stepped).
    opt.zero_grad(set_to_none=True)
    loss = loss_of(run, x, y)
    loss.backward()
    opt.step()
    ref, _ = make("mlp")
    assert torch.equal(loss.detach(), loss_of(ref, x, y).detach())


def test_exception_in_compiled_forward_discards_the_pass():
    """Note [Failed steps]: a forward that raises inside compiled code leaves strata idle; training goes on to
    torch alone's bits."""
    model, kind = make("mlp")
    inner, boom = model.fc2.forward, [False]

    def forward(x):
        if boom[0]:
            raise KeyError("boom")
        return inner(x)

    model.fc2.forward = forward
    model = st.wrap(model, config(model))
    opt = st.SGD(model.parameters(), lr=0.125)
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager")
    ref, _ = make("mlp")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.125)
    for step in range(3):
        x, y = inputs(model, kind, step)
        if step == 1:
            boom[0] = True
            with pytest.raises(KeyError, match="boom"):
                loss_of(run, x, y).backward()
            boom[0] = False
            assert model.strata._phase == "idle"
        loss = loss_of(run, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert torch.equal(loss.detach(), ref_loss.detach())
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
