"""Note [Gradient hooks] in _grads.py: on torch >= 2.1 the gradient hooks are torch's supported
register_post_accumulate_grad_hook (no autograd internals), removed by close(); on torch 1.13 they
sit on the AccumulateGrad nodes. Either way training is bit-identical to torch alone (test_exact_sgd)."""

import torch

import strata.torch as st
from harness import config
from models import make


def test_gradient_hooks_use_the_supported_api(tmp_path):
    model, _ = make("mlp")
    model = st.wrap(model, config(model))
    w = model.strata
    supported = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
    trainable = [p for p in w.params if p.requires_grad]
    if supported:
        assert w._acc_nodes == []
        assert all(p._post_accumulate_grad_hooks for p in trainable)
    else:
        assert len(w._acc_nodes) == len(trainable)
    w.close()
    if supported:
        assert not any(p._post_accumulate_grad_hooks for p in trainable), "close() left a gradient hook"
