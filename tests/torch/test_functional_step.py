"""strata.torch.functional.step_'s options (issue #27, bench/peers.py uses them): threads, bf16
states with a bf16 param copy, grad_checked, and the refusal of a non-finite gradient."""
import pytest
import torch

import strata.torch as st

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
N = 3 * 65536 + 5  # several of the kernel's pieces, and a ragged tail


def run(threads=1, bf16=False, grad_checked=False, steps=3):
    g = torch.Generator().manual_seed(0)
    master = torch.randn(N, generator=g)
    sd = torch.bfloat16 if bf16 else torch.float32
    states = [torch.zeros(N, dtype=sd), torch.zeros(N, dtype=sd)]
    copy = torch.zeros(N, dtype=torch.bfloat16) if bf16 else None
    for t in range(1, steps + 1):
        grad = torch.randn(N, generator=g).to(sd)
        st.functional.step_("adamw", master, grad, states, t, param_copy=copy, threads=threads,
                            grad_checked=grad_checked, **HYPER)
    return master, states, copy


def test_threads_are_bit_identical():
    a, sa, _ = run(threads=1)
    b, sb, _ = run(threads=2)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(sa, sb))


def test_grad_checked_changes_nothing_for_finite_grads():
    a, _, _ = run(grad_checked=False)
    b, _, _ = run(grad_checked=True)
    assert torch.equal(a, b)


def test_bf16_states_write_the_param_copy_and_stay_close():
    ref, _, _ = run(bf16=False)
    master, states, copy = run(bf16=True)
    assert all(s.dtype == torch.bfloat16 for s in states)
    # the copy is the master rounded to bf16 (to nearest: within half a bf16 ulp)
    assert float((copy.float() - master).abs().max()) <= float(master.abs().max()) * 2 ** -8
    # bf16 states and gradients move each update by far less than lr
    assert float((master - ref).abs().max()) < 3 * HYPER["lr"] * 0.1


def test_non_finite_gradient_raises_and_writes_nothing():
    master = torch.ones(1000)
    before = master.clone()
    grad = torch.zeros(1000)
    grad[500] = float("nan")
    with pytest.raises(st.StrataError, match="Inf/NaN"):
        st.functional.step_("adamw", master, grad, [torch.zeros(1000), torch.zeros(1000)], 1, **HYPER)
    assert torch.equal(master, before)


def test_bad_arguments_name_the_fix():
    m = torch.zeros(10)
    with pytest.raises(ValueError, match="all fp32 or all bf16"):
        st.functional.step_("adamw", m, torch.zeros(10), [torch.zeros(10), torch.zeros(10, dtype=torch.bfloat16)], 1)
    with pytest.raises(ValueError, match="param_copy"):
        st.functional.step_("adamw", m, torch.zeros(10), [torch.zeros(10), torch.zeros(10)], 1,
                            param_copy=torch.zeros(10))
    with pytest.raises(ValueError, match="threads"):
        st.functional.step_("adamw", m, torch.zeros(10), [torch.zeros(10), torch.zeros(10)], 1, threads=0)


def test_tensors_off_the_cpu_are_refused_before_any_is_read():
    # The kernels read and write host memory: a CUDA tensor's pointer read on the host would fault.
    # This machine has no GPU; meta tensors stand for any device but the CPU.
    m, z = torch.zeros(10), lambda: torch.zeros(10)
    meta = torch.zeros(10, device="meta")
    for args, what in [((meta, z(), [z(), z()]), "param"), ((m, meta, [z(), z()]), "grad"),
                       ((m, z(), [z(), meta]), "a state")]:
        with pytest.raises(ValueError, match=f"fused_step: {what} is on meta.*pass CPU tensors"):
            st.functional.step_("adamw", *args, 1)
    with pytest.raises(ValueError, match="param_copy is on meta"):
        st.functional.step_("adamw", m, z(), [z(), z()], 1, param_copy=torch.zeros(10, dtype=torch.bfloat16,
                                                                                   device="meta"))
    assert not m.any(), "nothing was written"


def test_omitted_hyperparameters_are_the_optimizers_defaults():
    """#26: fused_step starts from kernels::optimizer_defaults (the runtime config's defaults), so a key left out
    means the same as in strata.torch's optimizers: AdamW's weight decay 0.01, Lion's lr 1e-4 and beta2 0.99."""
    def run(name, nstates, **hyper):
        g = torch.Generator().manual_seed(1)
        m = torch.randn(257, generator=g)
        states = [torch.zeros(257) for _ in range(nstates)]
        for t in (1, 2):
            st.functional.step_(name, m, torch.randn(257, generator=g), states, t, **hyper)
        return m
    assert torch.equal(run("adamw", 2), run("adamw", 2, weight_decay=0.01))
    assert not torch.equal(run("adamw", 2), run("adamw", 2, weight_decay=0.0))
    assert torch.equal(run("lion", 1), run("lion", 1, lr=1e-4, beta2=0.99))
    assert not torch.equal(run("lion", 1), run("lion", 1, lr=1e-3, beta2=0.999))


def test_unknown_names_are_refused_with_the_choices():
    m = torch.zeros(10)
    with pytest.raises(ValueError, match="fused_step: unknown optimizer \"adamx\": use adamw"):
        st.functional.step_("adamx", m, torch.zeros(10), [], 1)
    with pytest.raises(ValueError, match="fused_step: came keeps factored"):
        st.functional.step_("came", m, torch.zeros(10), [torch.zeros(10), torch.zeros(10)], 1)
    with pytest.raises(ValueError, match="unknown hyperparameter \"betas\""):
        st.functional.step_("adamw", m, torch.zeros(10), [torch.zeros(10), torch.zeros(10)], 1, betas=(0.9, 0.99))
