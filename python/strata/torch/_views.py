"""Parameters between steps: torch code that reads or writes a wrapped model's parameters
outside its forward and backward (Note [Lazy parameters]), and the checks that guard it.
Wrapped takes these methods from _Views."""

import torch

from . import _C

# Note [Lazy parameters]
# Between steps a parameter's storage points at its poison region (Note [Parameters
# between steps] in python/src/param_views.cpp). To serve torch code that reads or writes
# it there, each parameter's Python class is switched, between steps only, to a
# subclass whose __torch_function__ asks the engine to fill the region with the
# current value (Engine.materialise) and switches the class back; the op then runs
# on torch's ordinary path. Metadata (shape, dtype, device, grad, requires_grad, ...)
# needs no value and does not materialise. The switch costs two class assignments
# per parameter and step; during forward and backward the class is torch's own, so
# the hot path has no Python in it. Tensors that share the parameter's storage
# (p.data, p.detach()) follow it: they read the value until the next forward and
# poison after it (copy with .clone() to keep values).
_METADATA = frozenset((
    "shape", "dtype", "device", "grad", "requires_grad", "is_leaf", "layout", "ndim", "is_sparse", "is_cuda",
    "is_quantized", "is_meta", "grad_fn", "names", "_version", "_base", "is_mkldnn", "output_nr", "is_nested",
    "_grad", "_grad_fn", "_backward_hooks", "is_mps", "is_complex", "is_floating_point", "size", "dim",
    "numel", "element_size", "stride", "is_contiguous", "get_device", "__len__", "requires_grad_", "__hash__",
    "nelement", "ndimension", "storage_offset", "data_ptr", "register_hook", "retain_grad", "__format__"))
_LAZY_OWNER = {}  # id(parameter) -> (weakref to Wrapped, pid), from wrap() to close()
_LAZY_CLASSES = {}  # torch class -> its lazy subclass


def _func_name(func):
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _tensors_of(obj, cls, out):
    if isinstance(obj, cls):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors_of(o, cls, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors_of(o, cls, out)
    return out


def _lazy_owner(t):
    """(Wrapped, pid) of a lazy parameter, or (None, None) for a copy of one."""
    owner = _LAZY_OWNER.get(id(t))
    if owner is None:
        return None, None
    w = owner[0]()
    if w is None or w.params[owner[1]] is not t:
        return None, None
    return w, owner[1]


def _lazy_torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    name = _func_name(func)
    setter = getattr(func, "__name__", "") == "__set__"  # reads no value (p.grad = g, p.data = t)
    if name not in _METADATA and not setter:
        for t in _tensors_of((args, kwargs), _LazyBase, []):
            w, pid = _lazy_owner(t)
            if w is not None:
                w._materialise(pid, name)
            else:  # a copy of a lazy parameter (deepcopy builds type(p)(...)): plain torch
                t.__class__ = type(t).__mro__[1]
    elif setter and name == "data":
        w, pid = _lazy_owner(args[0])
        if w is not None:
            w._check_window(pid, "p.data = ...")
    with torch._C.DisableTorchFunction():
        return func(*args, **kwargs)


class _LazyBase:
    """Marks the lazy subclasses (Note [Lazy parameters])."""

    __slots__ = ()


def _lazy_class(base):
    cls = _LAZY_CLASSES.get(base)
    if cls is None:
        cls = type(f"Strata{base.__name__}", (base, _LazyBase),
                   {"__torch_function__": classmethod(_lazy_torch_function), "__module__": __name__})
        _LAZY_CLASSES[base] = cls
        globals().setdefault(cls.__name__, cls)  # pickle finds classes by name
    return cls


class _Views:
    """Wrapped's parameters between steps (Note [Lazy parameters])."""

    def _set_lazy(self, on):
        if on == self._lazy or not self._access:
            return
        self._lazy = on
        classes = self._lazy_classes if on else self._classes
        for p, cls in zip(self.params, classes):
            p.__class__ = cls

    def _materialise(self, pid, what):
        p = self.params[pid]
        if self.engine is None and self._deferred is not None and self._deferred.pending:
            if self._deferred.current is not None:  # an init touched a parameter it does not own
                raise self._deferred.touched([self.names[pid]])
            raise RuntimeError(
                f"strata.torch: parameter {self.names[pid]!r} has no value yet ({what}): it was built on the meta "
                "device and deferred init runs when the engine is built (the strata optimizer's creation or the "
                "first forward; Note [Deferred init] in strata/torch/_deferred.py)")
        if self.engine is not None:
            self._check_window(pid, what)
            self.engine.materialise(pid)
        p.__class__ = self._classes[pid]

    def _check_window(self, pid, what):
        if self.engine is not None:
            if self._micro_in_step >= self.accumulation_steps and not self._keep_grads:
                raise RuntimeError(
                    f"strata.torch: parameter {self.names[pid]!r} was used ({what}) between the last backward of a "
                    "step and optimizer.step(): strata's optimizer runs during backward and may already have "
                    "updated it, while torch would show the old value. Use parameters after optimizer.step() "
                    "(or before the forward), or wrap with \"grad_reads\": true, which defers the optimizer to "
                    "step() (Note [Parameters between steps] in python/src/param_views.cpp)")

    def read_param(self, pid):
        p = self.params[pid]
        return self.engine.read_tensor(pid, _C.PARAM).to(p.dtype)

    def load_state_dict(self, state_dict, strict=True):
        """torch's Module.load_state_dict for the wrapped model (Note [load_state_dict of a wrapped model]):
        a dict that torch refuses loads nothing."""
        return self._state.load(self.model, state_dict, strict)
