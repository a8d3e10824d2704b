"""strata's fused optimizer kernels on plain torch tensors, one tensor at a time.

The same code the runtime runs on its chunks (kernels/, one rule header per
optimizer, the CPU ISA chosen by CPUID), for comparing strata.torch training
against torch-only training that uses the same arithmetic. Every call updates
``param`` (contiguous fp32) and its states in place.
"""

import torch  # noqa: F401  -- loads libtorch (and libtorch_cuda) before the extension that links them

from . import _C


def step_(optimizer, param, grad, states, step, grad_scale=1.0, *, param_copy=None, threads=1, grad_checked=False,
          **hyper):
    """One step of `optimizer` ("adamw", "adam", "lamb", "lars", "sgd", "lion", "adagrad") for one tensor.

    states: tensors like param (exp_avg, exp_avg_sq for the Adam family; momentum
    for SGD with momentum, LARS and Lion; the sum of squares for Adagrad), all fp32,
    or all bf16 for Adam, AdamW and LAMB (strata's bf16-state variant). step: 1-based.
    param_copy: an optional bf16/fp16 tensor the updated fp32 param is rounded into in
    the same pass (mixed precision: param is the fp32 master). threads: the kernel's
    thread count (1: the calling thread; more: a pool kept for the process).
    grad_checked: skip the kernel's separate Inf/NaN read of the gradient (the
    runtime's path when the device checked it); a non-finite gradient then still
    raises, but after the update was written. A non-finite gradient raises StrataError.
    hyper: lr, beta1, beta2, eps, weight_decay, momentum, dampening, nesterov, ...
    """
    _C.fused_step(optimizer, param, grad.contiguous(), list(states), int(step), hyper, float(grad_scale),
                  param_copy, int(threads), bool(grad_checked))


def adamw_(param, grad, exp_avg, exp_avg_sq, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
    step_("adamw", param, grad, [exp_avg, exp_avg_sq], step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
          weight_decay=weight_decay)


def adam_(param, grad, exp_avg, exp_avg_sq, step, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0):
    step_("adam", param, grad, [exp_avg, exp_avg_sq], step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
          weight_decay=weight_decay)
