"""Param groups, LR schedulers, clipping, loss scaling, missed hooks and gradients never held by torch."""

import pytest
import torch
import torch.nn as nn

import strata.torch as st
from harness import assert_identical, config, run
from models import Mlp, inputs, loss_of, make


def test_no_decay_groups_match_the_kernel_per_group(tmp_path):
    hyper = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8}
    decay = {"weight_decay": 0.1}

    def groups(model):
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        others = [p for n, p in model.named_parameters() if not n.endswith("weight")]
        return [{"params": weights, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]

    # Reference: strata's kernel on torch tensors, weight decay per group.
    model_ref, kind = make("mlp")
    wd = {id(p): g["weight_decay"] for g in groups(model_ref) for p in g["params"]}
    state = {}
    model, _ = make("mlp")
    model = st.wrap(model, config(model, tmp_path))
    opt = st.AdamW(groups(model), **hyper)
    for step in range(8):
        x, y = inputs(model_ref, kind, step)
        a = loss_of(model_ref, x, y)
        a.backward()
        for p in model_ref.parameters():
            s = state.setdefault(id(p), [torch.zeros_like(p), torch.zeros_like(p), 0])
            s[2] += 1
            with torch.no_grad():
                st.functional.adamw_(p, p.grad, s[0], s[1], s[2], weight_decay=wd[id(p)], **hyper)
            p.grad = None
        b = loss_of(model, x, y)
        b.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert torch.equal(a, b), f"step {step}"
    for k, v in model_ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert decay  # (documents the groups' intent)


def test_lr_scheduler_works_unchanged(tmp_path):
    def schedule(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** (s // 3))

    results = []
    for use_strata in (False, True):
        model, kind = make("mlp")
        if use_strata:
            model = st.wrap(model, config(model, tmp_path))
            opt = st.SGD(model.parameters(), lr=0.25)
        else:
            opt = torch.optim.SGD(model.parameters(), lr=0.25)
        sched = schedule(opt)
        losses = []
        for step in range(10):
            x, y = inputs(model, kind, step)
            loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            losses.append(loss.detach())
        results.append((losses, model.state_dict()))
    assert_identical(results[0], results[1])
    assert opt.param_groups[0]["lr"] == 0.25 * 0.5 ** 3


def test_clipping_matches_clip_grad_norm(tmp_path):
    torch_model, kind = make("mlp")
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.5)
    model, _ = make("mlp")
    model = st.wrap(model, config(model, tmp_path))
    opt = st.SGD(model.parameters(), lr=0.5, max_grad_norm=0.05)
    for step in range(5):
        x, y = inputs(torch_model, kind, step)
        loss_of(torch_model, x, y).backward()
        norm = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), 0.05)
        assert norm > 0.05, "the test must clip"
        torch_opt.step()
        torch_opt.zero_grad()
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    for k, v in torch_model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6)


def test_loss_scale_skips_non_finite_steps(tmp_path):
    model, kind = make("mlp")
    model = st.wrap(model, config(model, tmp_path))
    opt = st.SGD(model.parameters(), lr=0.125, loss_scale=1024.0)
    x, y = inputs(model, kind, 0)
    opt.scale_loss(loss_of(model, x, y)).backward()
    opt.step()
    opt.zero_grad()
    assert opt.last_step_applied
    before = {k: v.clone() for k, v in model.state_dict().items()}
    (loss_of(model, x, y) * float("inf")).backward()
    opt.step()
    assert opt.last_step_applied is False
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed in a skipped step"
    # Scaled gradients are unscaled: the same as an unscaled run.
    ref, _ = make("mlp")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.125)
    loss_of(ref, x, y).backward()
    ref_opt.step()
    for k, v in ref.state_dict().items():
        assert torch.equal(before[k], v), k


class Sneaky(nn.Module):
    """Uses a sibling's weight without calling the sibling and without attribute access (which strata
    sees: Note [Parameters read by another module]): a read strata cannot see."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        return self.a(x) @ next(self.b.parameters())


def test_a_missed_hook_is_an_error_naming_the_parameter(tmp_path):
    model = Sneaky()
    model = st.wrap(model, {"device": {"kind": "sim"}, "budgets": {"gpu": "1MiB", "host": "64MiB"},
                                "layout": {"chunk_elems": 4096}})
    opt = st.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"'b\.weight'.*not bound"):
        model(torch.randn(4, 16)).sum().backward()
    del opt


@pytest.mark.parametrize("grad_reads", [False, "auto"])
def test_gradients_never_stay_in_torch_memory(grad_reads, tmp_path):
    # p.grad is a placeholder of one element (Note [Gradients in torch]); under "auto" from the
    # second step on, when the first step's gradients were not read.
    model, kind = make("mlp")
    cfg = config(model, tmp_path)
    cfg["grad_reads"] = grad_reads
    model = st.wrap(model, cfg)
    opt = st.SGD(model.parameters(), lr=0.125)
    for step in range(2):
        x, y = inputs(model, kind, step)
        loss_of(model, x, y).backward()
        if step == 1 or grad_reads is False:
            with torch._C.DisableTorchFunction():  # (the placeholder refuses every other use)
                assert all(p.grad.storage().size() == 1 for p in model.parameters())
        opt.step()
        opt.zero_grad()
        stats = model.strata.last_stats
        assert stats["step"] == step + 1 and stats["applied"]
