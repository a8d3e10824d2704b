"""strata.torch's module hooks cost no dynamo wrapper until torch.compile is used (issue #29, Note
[torch.compile] in strata/torch/_compile.py): wrap() installs plain hooks; the first compile swaps
them, in place and before dynamo traces anything, for dynamo-disabled ones, and a model wrapped after
that gets disabled ones at once. Runs in a fresh interpreter (the swap is once per process, and other
tests compile). Under torch 1.x (no torch.compile) the hooks stay plain. bench/torch_hook_cost.py
measures what the wrapper costs per hook call."""

import os
import subprocess
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import torch, strata.torch as st
    from strata.torch import _compile

    def strata_hooks(model):
        ours = []
        for m in model.modules():
            for d in (m._forward_pre_hooks, m._forward_hooks):
                ours += [h for h in d.values() if getattr(getattr(h, "__self__", None), "__class__", None) in
                         (st._wrap.Wrapped, st._state.ModelState) or getattr(h, "_torchdynamo_disable", False)]
        return ours

    def disabled(h):
        return bool(getattr(h, "_torchdynamo_disable", False))

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
        return st.wrap(model, {"device": {"kind": "sim", "budget": "64MiB"}, "budgets": {"gpu": "16MiB"}})

    model = make()
    opt = st.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 8)
    model(x).sum().backward()
    opt.step()
    hooks = strata_hooks(model)
    assert len(hooks) >= 6, hooks  # root pre/post, each Linear's pre/post, ModelState's push/pop
    assert not any(disabled(h) for h in hooks), "a hook was dynamo-disabled before any compile"
    import gc, weakref
    gone = make()
    gone(x)
    ref = weakref.ref(gone.strata)
    del gone
    gc.collect()
    # The registry of plain hooks holds them weakly (an unclosed wrapped model is freed with its modules).
    assert all(isinstance(f, weakref.ref) for _, f in _compile._PLAIN), _compile._PLAIN
    if not hasattr(torch, "compile"):
        assert ref() is None, "a wrapped model nobody closed outlived its last reference"
        print("plain-only"); raise SystemExit(0)
    with torch.no_grad():
        eager_out = model(x).clone()
        compiled_out = torch.compile(model, backend="eager")(x)
    assert torch.equal(eager_out, compiled_out), (eager_out, compiled_out)
    hooks = strata_hooks(model)
    assert hooks and all(disabled(h) for h in hooks), "the compile did not swap every hook"
    assert _compile.hooks_swapped()
    later = make()
    assert all(disabled(h) for h in strata_hooks(later)), "a model wrapped after a compile got plain hooks"
    model(x).sum().backward()  # still trains after the swap
    opt.step()
    print("swapped")
""")


def test_hooks_are_plain_until_a_compile_then_disabled():
    env = dict(os.environ, STRATA_LOG_LEVEL="warn")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                       cwd=HERE)
    assert r.returncode == 0, r.stdout + r.stderr
    import torch  # noqa: PLC0415

    assert r.stdout.strip().endswith("swapped" if hasattr(torch, "compile") else "plain-only"), r.stdout


RESET_SCRIPT = textwrap.dedent("""
    import torch, strata.torch as st
    from strata.torch import _compile

    def make(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))

    def cfg():
        return {"device": {"kind": "sim", "budget": "64MiB"}, "budgets": {"gpu": "16MiB"}}

    x = torch.randn(5, 8)
    first = st.wrap(make(0), cfg())  # watches for compiles
    first(x).sum().backward()
    torch._dynamo.reset()  # drops dynamo's callbacks, strata's among them
    # A compiled module wrapped after the reset: its hooks must not be traced (dynamo inlines the
    # compiled module's _call_impl, hooks included) and it must train as torch alone does.
    plain, wrapped = make(1), st.wrap(torch.compile(make(1), backend="eager"), cfg())
    opt_p, opt_w = torch.optim.SGD(plain.parameters(), lr=0.125), st.SGD(wrapped.parameters(), lr=0.125)
    for _ in range(3):
        for m, o in ((plain, opt_p), (wrapped, opt_w)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    assert _compile.hooks_swapped(), "the compile after torch._dynamo.reset() was not seen"
    assert torch.equal(plain(x), wrapped(x)), "a compiled module wrapped after a reset trained otherwise"
    print("reset-seen")
""")


def test_a_compile_after_dynamo_reset_is_still_seen():
    import torch  # noqa: PLC0415
    import pytest  # noqa: PLC0415

    if not hasattr(torch, "compile"):
        pytest.skip("torch 1.x: no torch.compile")
    env = dict(os.environ, STRATA_LOG_LEVEL="warn")
    r = subprocess.run([sys.executable, "-c", RESET_SCRIPT], capture_output=True, text=True, env=env, timeout=300,
                       cwd=HERE)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().endswith("reset-seen"), r.stdout
