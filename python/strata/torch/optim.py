"""strata.torch optimizers: torch.optim.Optimizer subclasses whose step() is strata's.

The optimizer runs inside strata's runtime, on whichever tier each chunk family's
states live (GPU, pinned host, NVMe), overlapping backward; gradients live in strata's
grad chunks, and p.grad is a placeholder, or torch's own gradient while torch code reads
gradients (Note [Gradients in torch] in _grads.py). Param groups carry their own lr and
weight_decay (read at each step, so torch LR schedulers work unchanged); every
other hyperparameter is shared by all groups. Gradient clipping by global norm
(``max_grad_norm``) and a loss scale (``loss_scale``: strata divides the gradients
by it and skips a step whose gradients are Inf/NaN, leaving every state unchanged)
are options of every optimizer.

Note [When lr is read]
A family's optimizer step starts as soon as its gradients are complete, during
backward, so the groups' lr and weight_decay are handed to the runtime when a
step's first micro-batch begins (its first forward). A scheduler stepped after
optimizer.step() — the usual place — or an lr set before the forward is in time;
an lr changed between backward and optimizer.step() applies from the next step,
and strata warns once when it sees that.
"""

import inspect
import math
import os
import warnings

import torch

from . import _wrap
from ._optim_state import _TorchFormat

# torch.optim.Optimizer.zero_grad's default: False up to torch 1.13, True from torch 2.0. A strata optimizer
# zeroes as the torch it runs under does, or training diverges from torch's silently (momentum applied on
# steps where torch skips a parameter).
_TORCH_SET_TO_NONE = inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default


class _StrataOptimizer(_TorchFormat, torch.optim.Optimizer):
    """Base of strata.torch's optimizers. Subclasses set _name and map hyperparameters."""

    _name = None
    # torch's group key -> strata's config key (tuples split betas).
    _per_group = ("lr", "weight_decay")

    def __init__(self, params, defaults, max_grad_norm=0.0, loss_scale=None):
        if not math.isfinite(max_grad_norm) or max_grad_norm < 0:
            raise ValueError(f"{type(self).__name__}: max_grad_norm = {max_grad_norm} must be finite and >= 0")
        if loss_scale is not None and (not math.isfinite(loss_scale) or loss_scale <= 0):
            raise ValueError(f"{type(self).__name__}: loss_scale = {loss_scale} must be finite and > 0")
        super().__init__(params, defaults)
        self.max_grad_norm = float(max_grad_norm)
        self._loss_scale = loss_scale
        all_params = [p for g in self.param_groups for p in g["params"]]
        self._wrapped = _wrap._owner_of(all_params)
        self._check_groups()
        self._wrapped.optimizer = self
        self._wrapped._build(self._settings())
        self._assign_groups()
        self._warned_lr = False
        self.last_step_applied = None

    def add_param_group(self, param_group):
        if hasattr(self, "_wrapped"):
            raise RuntimeError(f"{type(self).__name__}: strata's optimizers take every param group when they are "
                               "created (the runtime's chunk families are built from them)")
        super().add_param_group(param_group)

    # --- settings --------------------------------------------------------------------------

    def _hyper(self, group):
        """strata's optimizer keys for one group (subclasses)."""
        raise NotImplementedError

    def _check_groups(self):
        first = {k: v for k, v in self._hyper(self.param_groups[0]).items() if k not in self._per_group}
        for i, g in enumerate(self.param_groups[1:], start=1):
            other = {k: v for k, v in self._hyper(g).items() if k not in self._per_group}
            if other != first:
                diff = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
                raise ValueError(
                    f"{type(self).__name__}: param group {i} sets {', '.join(diff)} differently from group 0; "
                    "strata's groups may differ in lr and weight_decay only")
            for k in ("lr", "weight_decay"):
                if not math.isfinite(g[k]) or g[k] < 0:
                    raise ValueError(f"{type(self).__name__}: param group {i}: {k} = {g[k]} must be >= 0")

    def _settings(self):
        opt = {"name": self._name}
        opt.update(self._hyper(self.param_groups[0]))
        trainable = {id(p) for g in self.param_groups for p in g["params"] if p.requires_grad}
        return {"optimizer": opt, "clip_max_norm": self.max_grad_norm,
                "loss_scaling": self._loss_scale is not None, "_trainable": trainable,
                "_states": getattr(self, "_state_dtype", None)}

    def _assign_groups(self):
        engine = self._wrapped.engine
        for gi, g in enumerate(self.param_groups):
            for p in g["params"]:
                engine.set_tensor_group(self._wrapped._pid[id(p)], gi)
        self._push_groups()

    def _group_values(self):
        return tuple((float(g["lr"]), float(g["weight_decay"])) for g in self.param_groups)

    def _push_groups(self):
        """Hands the groups' lr and weight decay to the runtime (Note [When lr is read])."""
        values = self._group_values()
        w = self._wrapped
        if w._pushed_groups != values:
            for gi, (lr, wd) in enumerate(values):
                w.engine.set_group_hyper(gi, lr, wd)
            w._pushed_groups = values
        w.engine.set_grad_scale(1.0 / self._loss_scale if self._loss_scale is not None else 1.0)

    @property
    def loss_scale(self):
        """The static loss scale (None: off). Multiply the loss by it before backward
        (or use scale_loss); strata divides the gradients by it."""
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, value):
        if self._loss_scale is None:
            raise RuntimeError(f"{type(self).__name__}: loss scaling was not enabled (pass loss_scale= when "
                               "creating the optimizer)")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"loss_scale = {value} must be finite and > 0")
        self._loss_scale = float(value)

    def scale_loss(self, loss):
        return loss * self._loss_scale if self._loss_scale is not None else loss

    # --- torch.optim.Optimizer ---------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._wrapped._pushed_groups != self._group_values() and not self._warned_lr:
            warnings.warn(
                f"{type(self).__name__}: a group's lr or weight_decay changed after this step's backward began; "
                "strata applies it from the next step (Note [When lr is read] in strata/torch/optim.py)",
                stacklevel=2)
            self._warned_lr = True
        stats = self._wrapped.step()
        self.last_step_applied = stats["applied"]
        return loss

    def zero_grad(self, set_to_none=None):
        """torch.optim's zero_grad, with the running torch's default (torch 1.x: set_to_none=False, a parameter
        that got a gradient keeps a zero one, so the next step updates it even without a new gradient; torch
        2.x: True, its gradient is dropped and a step without a new one skips it; Note [Zero gradients] in
        strata/torch/_grads.py)."""
        if set_to_none is None:
            set_to_none = _TORCH_SET_TO_NONE
        self._wrapped.zero_grad([p for g in self.param_groups for p in g["params"]], set_to_none)

    def save_checkpoint(self, directory, blocking=True):
        """Writes strata's own checkpoint of the model and this optimizer (params, fp32 masters,
        optimizer states and step counters, from whichever tier holds them) into `directory`:
        one file per chunk family and a manifest, CRC32C-checked, published atomically, so a
        crash leaves the previous checkpoint there loadable (docs/checkpoint.md). Between steps.
        With blocking=False it returns at once and training goes on while the state as of the
        call is written (an update waits only until the save has captured its family);
        wait_checkpoint() waits for it and raises its error. The param groups'
        hyperparameters are the optimizer's constructor arguments: they are not restored by
        load_checkpoint."""
        self._wrapped._settle()  # a backward that raised leaves nothing leased (Note [Failed steps])
        if blocking:
            self._wrapped.engine.save_checkpoint(os.fspath(directory))
        else:
            self._wrapped.engine.begin_checkpoint(os.fspath(directory))

    def wait_checkpoint(self):
        """Waits for a save_checkpoint(..., blocking=False) in flight (a no-op when none) and
        raises strata.torch.StrataError when it failed; the previous checkpoint is then intact."""
        self._wrapped.engine.finish_checkpoint()

    def checkpoint_in_flight(self):
        """True while a save_checkpoint(..., blocking=False) runs; raises its error if it failed."""
        return self._wrapped.engine.checkpoint_in_flight()

    def load_checkpoint(self, directory):
        """Loads a checkpoint written by save_checkpoint (possibly with other budgets, chunk size or
        placement) into the model and this optimizer; a checkpoint of another model, a newer
        format, a flipped byte, a truncated file or a missing manifest is refused whole
        (strata.torch.StrataError naming the file) and nothing is loaded."""
        self._wrapped.engine.load_checkpoint(os.fspath(directory))


# Note [Optimizer state dtype]
# AdamW's and Adam's state_dtype= sets the config's precision.states for the runtime this optimizer
# builds: "fp32", "bf16", or "int8" (the runtime's "q8": blockwise 8-bit m and v, one fp32 scale per
# 256 elements, bitsandbytes' dynamic maps; Note [Q8 state chunks] in runtime/src/pipeline/q8_states.cpp).
# None keeps the config's (fp32 by default). A config that names another is refused, naming both.
# state_dict() gives the states dequantized to fp32, torch.optim's format; load_state_dict()
# quantizes them back, as a checkpoint's conversion does (docs/checkpoint.md): each value comes back
# within one code of the map, not exactly (a block whose largest |m| is negative holds it at the signed
# map's -0.99297, which has no -1, so quantizing again rescales the block), so a resume through
# state_dict() (Hugging Face Trainer's optimizer.pt) is not bit-exact with int8 states.
# opt.save_checkpoint() keeps the codes and scales as they are: a resume from it is.
# Trainer's optim names adamw_bnb_8bit, adamw_8bit and adamw_torch_8bit map to state_dtype "int8"
# (strata.torch.hf.create_optimizer). Under data parallelism each rank holds whole 256-element blocks.
_STATE_DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "int8": "q8", "q8": "q8"}


def _state_dtype(owner, value):
    """The runtime's precision.states for state_dtype= (Note [Optimizer state dtype]); None for None."""
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        value = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}.get(value, str(value))
    if value not in _STATE_DTYPES:
        raise ValueError(f"{owner}: state_dtype = {value!r}: use \"fp32\", \"bf16\" or \"int8\" (8-bit blockwise "
                         "states), or leave it out for the config's precision.states")
    return _STATE_DTYPES[value]


class AdamW(_StrataOptimizer):
    """torch.optim.AdamW, run by strata (decoupled weight decay)."""

    _name = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 max_grad_norm=0.0, loss_scale=None, state_dtype=None):
        if amsgrad:
            raise ValueError(f"{type(self).__name__}: amsgrad is not supported by strata's kernels")
        self._state_dtype = _state_dtype(type(self).__name__, state_dtype)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False),
                         max_grad_norm, loss_scale)

    def _hyper(self, g):
        return {"lr": g["lr"], "beta1": g["betas"][0], "beta2": g["betas"][1], "eps": g["eps"],
                "weight_decay": g["weight_decay"]}


class Adam(AdamW):
    """torch.optim.Adam, run by strata (L2 weight decay)."""

    _name = "adam"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 max_grad_norm=0.0, loss_scale=None, state_dtype=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, max_grad_norm=max_grad_norm,
                         loss_scale=loss_scale, state_dtype=state_dtype)


class LAMB(_StrataOptimizer):
    """LAMB (You et al.), per-tensor trust ratios."""

    _name = "lamb"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True, *,
                 max_grad_norm=0.0, loss_scale=None):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction), max_grad_norm, loss_scale)

    def _hyper(self, g):
        return {"lr": g["lr"], "beta1": g["betas"][0], "beta2": g["betas"][1], "eps": g["eps"],
                "weight_decay": g["weight_decay"], "bias_correction": bool(g["bias_correction"])}


class LARS(_StrataOptimizer):
    """LARS (You et al.), SGD with momentum and per-tensor trust ratios."""

    _name = "lars"

    def __init__(self, params, lr, momentum=0.9, weight_decay=0.0, trust_coefficient=0.001, eps=1e-8,
                 clip=False, *, max_grad_norm=0.0, loss_scale=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps, clip=clip),
                         max_grad_norm, loss_scale)

    def _hyper(self, g):
        return {"lr": g["lr"], "momentum": g["momentum"], "weight_decay": g["weight_decay"],
                "trust_coefficient": g["trust_coefficient"], "eps": g["eps"], "lars_clip": bool(g["clip"])}


class SGD(_StrataOptimizer):
    """torch.optim.SGD, run by strata (momentum, dampening, Nesterov, L2 weight decay)."""

    _name = "sgd"

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 max_grad_norm=0.0, loss_scale=None):
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                                      nesterov=nesterov), max_grad_norm, loss_scale)

    def _hyper(self, g):
        return {"lr": g["lr"], "momentum": g["momentum"], "dampening": g["dampening"],
                "weight_decay": g["weight_decay"], "nesterov": bool(g["nesterov"])}


class Lion(_StrataOptimizer):
    """Lion (Chen et al.): sign of an interpolated momentum, decoupled weight decay."""

    _name = "lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, max_grad_norm=0.0,
                 loss_scale=None):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), max_grad_norm, loss_scale)

    def _hyper(self, g):
        return {"lr": g["lr"], "beta1": g["betas"][0], "beta2": g["betas"][1], "weight_decay": g["weight_decay"]}


class Adagrad(_StrataOptimizer):
    """torch.optim.Adagrad, run by strata (initial_accumulator_value 0)."""

    _name = "adagrad"

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 *, max_grad_norm=0.0, loss_scale=None):
        if initial_accumulator_value != 0:
            raise ValueError("Adagrad: strata starts the sum of squares at 0 (initial_accumulator_value = 0)")
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=0.0, eps=eps), max_grad_norm, loss_scale)

    def _hyper(self, g):
        return {"lr": g["lr"], "lr_decay": g["lr_decay"], "weight_decay": g["weight_decay"], "eps": g["eps"]}
