"""strata.torch.wrap: hand a torch.nn.Module's state to strata's chunk runtime.

Wrapped, model.strata, is one wrapped model's state; its methods live in rooms, one file each:
  - _build.py (_Building): the parameters collected at wrap() and the engine built from them
    (Note [Lazy engine]), rebuilt, given back;
  - _hooks.py (_Hooks): the module hooks that bind parameters for a module's forward and
    backward (Note [Hooks]), and a pass that raised;
  - _grads.py (_Grads): gradients handed to strata, what p.grad holds, optimizer.step() and the
    counters (Note [Gradients in torch], Note [Zero gradients]);
  - _views.py (_Views): parameters read and written between steps (Note [Lazy parameters]).
This file has wrap(), Wrapped's construction and close().
"""

import json
import os
import weakref

import torch

from . import _C, _deferred, _processes, _state
from ._build import _Building, _load_config
from ._grads import _Grads, _zero_grad
from ._hooks import _Hooks
from ._views import _LAZY_OWNER, _Views

# The runtime's StateKind values, generated from the C++ enum by the binding (#26).
PARAM, GRAD, MASTER, STATE0, STATE1 = _C.PARAM, _C.GRAD, _C.MASTER, _C.STATE0, _C.STATE1
StrataError = _C.StrataError

_WRAPPED_REGISTRY = weakref.WeakSet()


class Wrapped(_Building, _Hooks, _Grads, _Views):
    """The strata state of one wrapped model: model.strata after wrap(model, config)."""

    def __init__(self, model, config, init=None, init_order="modules", group=None):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"strata.torch.wrap: expected a torch.nn.Module, got {type(model).__name__}")
        if getattr(model, "_strata_wrapped", None) is not None:
            raise RuntimeError(
                "strata.torch.wrap: this model is already wrapped; wrap a model once "
                "(model.strata is its strata state)")
        self.config = _load_config(config)
        accum = self.config.get("gradient_accumulation_steps", 1)
        if not isinstance(accum, int) or isinstance(accum, bool) or accum < 1:
            raise ValueError(
                f"strata.torch.wrap: gradient_accumulation_steps = {accum!r}: must be an integer >= 1")
        self.accumulation_steps = accum
        self._group = group  # the torch.distributed group sharded over, or None (Note [Ranks under torchrun])
        self._comm = None  # the engine's communicator over it
        # This step's kept gradients are the ranks' average (Note [Averaged gradients in torch]).
        self._grads_averaged = False
        _processes.comm_timeout_ms(self.config)  # a bad comm section fails at wrap(), before anything
        _processes.per_rank_budgets(self.config)  # and a bad budgets_per
        grad_reads = self.config.get("grad_reads", "auto")
        if grad_reads not in (True, False, "auto"):
            raise ValueError(f"strata.torch.wrap: grad_reads = {grad_reads!r}: must be true, false or \"auto\" "
                             "(Note [Gradients in torch])")
        self.grad_reads = grad_reads
        self._keep_grads = False  # this step keeps gradients in torch (Note [Gradients in torch])
        self._grads_used = False  # a torch call used a gradient ("auto")
        self._grad_live = []  # pid -> torch's p.grad would not be None (Note [Zero gradients])
        self._placeholders = {}  # pid -> _StrataGrad currently in p.grad
        self._cleared = set()  # pids whose placeholder _clear_placeholders took out of p.grad
        self._unzeroed = set()  # pids whose last step's gradient torch would still hold (Note [No zero_grad])
        self._missed_zero = []  # names of parameters handed while in _unzeroed, this step
        self._warned_no_zero = False
        self._backward_pids = set()  # pids whose gradient arrived in this backward (Note [Gradient pieces])
        self._grad_pieces = False  # a gradient came in pieces ("auto" keeps gradients in torch)
        self._classes = []  # pid -> the parameter's own class
        self._lazy_classes = []  # pid -> its lazy subclass (Note [Lazy parameters])
        self._lazy = False
        # bench/torch_gpt.py --access-ab only: the binding as before #25 (poison between steps, p.grad
        # None after backward), to measure what Note [Lazy parameters] and the placeholders cost.
        self._access = os.environ.get("STRATA_TORCH_BENCH_NO_ACCESS") != "1"
        self.model = model
        self.engine = None
        self.optimizer = None
        self.params = []  # pid -> Parameter
        self.names = []  # pid -> qualified name
        self._pid = {}  # id(Parameter) -> pid
        self._module_pids = {}  # module -> [pid] (its own parameters)
        self._calls = {}  # id(module) -> stack of _Call
        self._grad_waiters = {}  # pid -> calls waiting for its gradient (Note [Module-local input gradients])
        self._acc_nodes = []  # gradient accumulators (kept alive: their hooks are ours)
        self._handles = []
        self._frozen = []
        self._phase = "idle"  # idle | forward | backward
        self._micro_in_step = 0
        self._grad_written = []  # pid -> gradient handed over this step
        self._grads_handed = 0
        self._steps = 0
        self._pushed_groups = None
        self.last_stats = None
        self._last_engine = None  # the newest engine, closed or not: it keeps the totals
        self._hook_calls = 0  # Python hook calls (Note [Step counters])
        self._hold = False  # Note [Holding parameters where everything fits]
        self._deferred = self._deferred_init(init, init_order)
        self._collect()
        self._check_devices_early()
        _C.validate_config(json.dumps(self._runtime_config(None)))  # unknown keys fail here, not later
        self._module_pids.setdefault(model, [])  # the root's call: Note [Parameters read by another module]
        self._install_hooks()
        self._state = _state.ModelState(self)
        self._state.install()  # state_dict, load_state_dict, copy (python/strata/torch/_state.py)
        self._forward_wrapper = None
        self._install_forward_wrapper()
        model._strata_wrapped = self
        self._signature = self._model_signature()
        _WRAPPED_REGISTRY.add(self)
        if self._deferred is not None:
            self._set_lazy(True)  # no values before the build: a read raises (_materialise)

    def _deferred_init(self, init, init_order):
        """Note [Deferred init] in _deferred.py: meta parameters become CPU ones initialised at the build."""
        if not _deferred.Deferred.wanted(self.model):
            if init is not None:
                raise ValueError("strata.torch.wrap: init= initialises parameters built on the meta device "
                                 "(Note [Deferred init]); this model has none: initialise it in torch instead")
            return None
        if self._device_kind_wanted() != "cpu":
            raise ValueError("strata.torch.wrap: deferred init (parameters on the meta device) is supported on the "
                             "sim device only so far; build the model on the GPU, or use device.kind \"sim\"")
        return _deferred.Deferred(self.model, init, init_order)

    def _check_room_to_restore(self):
        """Refuses close() before anything changes when giving the parameters back as torch memory would not
        fit in the memory the system has available (Note [Closing a model larger than RAM])."""
        needed = sum(p.numel() * p.element_size() for p in self.params)
        available = _available_memory()
        if available is not None and needed > 0.9 * available:
            raise MemoryError(
                f"strata.torch close(): giving the {len(self.params)} parameters back as torch memory needs "
                f"{needed / 2**30:.2f} GiB and this system has {available / 2**30:.2f} GiB available; nothing was "
                "changed and the model is still wrapped. Save what you need first (opt.save_checkpoint(dir), or "
                "state_dict() one module at a time), then call close(restore=False), which frees strata's tiers "
                "and leaves the parameters on the meta device")

    def close(self, restore=True):
        """Removes the hooks and frees strata's tiers (swap files included). The model is plain torch afterwards.

        restore=True: every parameter gets its value back as torch memory. Refused with a MemoryError, before
        anything changes, when that would not fit in the memory available (Note [Closing a model larger than
        RAM]). restore=False: the parameters are left on the meta device, their values dropped."""
        error = None
        if self.engine is not None:
            if restore:
                self._check_room_to_restore()
            try:
                self._settle()
                self.engine.flush()
            except StrataError as e:
                error = e  # the last good state is still readable: restore it, then report
            try:
                if restore:
                    self._restore_all()
                else:
                    self._drop_all()
            finally:
                if self.engine is not None:  # a restore failed: free the runtime (and its swap files) anyway
                    self.engine.close()
                    self.engine = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._acc_nodes.clear()
        self._state.uninstall()
        for p in self.params:
            _LAZY_OWNER.pop(id(p), None)
        if self.model.__dict__.get("forward") is self._forward_wrapper:
            del self.model.__dict__["forward"]
        self.model._strata_wrapped = None
        if error is not None:
            raise error


# Note [Closing a model larger than RAM]
# close() gives every parameter its value back as torch memory, so that the model is plain torch
# again. For a model built with deferred init whose parameters exceed the RAM (the reason it was
# built that way) that is the whole model in memory at once, beside strata's host tier: the kernel's
# OOM killer ends the process, or another one. So close() first compares the parameters' bytes with
# the system's MemAvailable and, where they do not fit in 90% of it, refuses with a MemoryError
# before it changes anything. close(restore=False) frees strata's tiers and leaves the parameters on
# the meta device: values the user saved (a strata checkpoint, a state_dict taken a module at a time)
# are the way back.
def _available_memory():
    """MemAvailable of /proc/meminfo in bytes, or None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def wrap(model, config=None, *, init=None, init_order="modules", process_group=None):
    """Hands `model`'s parameters to strata and returns the model (the same object).

    config: a dict or the path of a JSON file, with the keys of strata's C++ Config
    (docs/config.md: device, budgets, nvme, precision, plan, layout, ...) and
    ``gradient_accumulation_steps`` (backward passes per optimizer.step(), default 1).
    The optimizer comes from strata.torch's optimizer classes (strata.torch.AdamW, ...).
    model.strata is the wrapped state (stats, close()).
    A model with its parameters on the meta device is initialised straight into strata's chunks
    by each module's reset_parameters() and then init(module) (Note [Deferred init] in _deferred.py).
    process_group: the torch.distributed group to shard over; None = the default group when one is
    initialised (torchrun), else one process. Over W > 1 ranks each rank holds 1/W of the optimizer
    states and gradients are averaged over the ranks, as DDP does; the config's ``comm.timeout_s``
    (default 60) bounds a wait for the other ranks. A model inside DistributedDataParallel or FSDP is
    refused (Note [Ranks under torchrun] in _processes.py).
    """
    group = _processes.shard_group(model, process_group)
    wrapped = Wrapped(model, config, init, init_order, group)
    # An instance attribute (not a Parameter, Module or Tensor) shadows the class's methods.
    object.__setattr__(model, "zero_grad", _zero_grad.__get__(model))
    object.__setattr__(model, "strata", wrapped)
    return model


def _owner_of(params):
    """The Wrapped instance whose model owns every parameter in `params` (a list of tensors)."""
    owner = None
    for p in params:
        for w in list(_WRAPPED_REGISTRY):
            if id(p) in w._pid:
                if owner is not None and owner is not w:
                    raise ValueError("strata.torch: the optimizer's parameters belong to two wrapped models")
                owner = w
                break
        else:
            raise ValueError(
                "strata.torch: a parameter given to the optimizer does not belong to a wrapped model "
                "(call strata.torch.wrap(model, config) first and pass model.parameters())")
    return owner
