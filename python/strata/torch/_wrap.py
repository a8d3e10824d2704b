"""strata.torch.wrap: hand a torch.nn.Module's state to strata's chunk runtime.

Note [Hooks]
Each module that owns parameters gets a forward pre-hook and a forward hook:
  - before its forward, its parameters are bound: their storage points at the
    param chunk's lease (Note [Rebinding storage] in python/src/engine.cpp);
  - after its forward, they are unbound (their storage points at a poison
    region, Note [Poisoned parameters] in python/src/poison.hpp), and when grad
    is on, a hook on every output tensor that requires grad binds them again as
    soon as backward reaches the module (the first such gradient);
  - a hook on every input tensor that requires grad unbinds them once all of the
    inputs' gradients are computed (the module's backward is over); whatever is
    still bound when backward ends is unbound by a callback queued on the engine;
  - a hook on each trainable parameter's gradient accumulator hands the gradient
    to its grad chunk (overwrite in a step's first micro-batch, add in later ones)
    and sets p.grad = None, so gradients never pile up in torch memory.
Tensor hooks fire when the gradient of that tensor is computed, i.e. before the
nodes that consume it (the module's backward) and after the ones that produce it,
which is what "before/after the module's backward" needs, without rebuilding the
module's inputs or outputs. The root module's forward begins a micro-batch.

Note [Lazy engine]
wrap() registers nothing yet: the runtime needs the optimizer (its states decide
the chunk families), so the engine is built when the strata optimizer is created
or, without one, at the first forward (with the config's optimizer). Until then
the model is plain torch. Building it copies every parameter into the runtime and
frees the torch memory. An optimizer created after the engine was built rebuilds
it (reading the parameters back) as long as no step has run.
"""

import atexit
import functools
import json
import os
import warnings
import weakref

import torch

from . import _C, _compile, _deferred, _layout, _state

# The runtime's StateKind values, generated from the C++ enum by the binding (#26).
PARAM, GRAD, MASTER, STATE0, STATE1 = _C.PARAM, _C.GRAD, _C.MASTER, _C.STATE0, _C.STATE1
StrataError = _C.StrataError

# Keys of the wrap config that the binding handles itself (not the runtime's).
_BINDING_KEYS = ("gradient_accumulation_steps", "bind_subtree", "grad_reads")

# Note [Modules that read their children's parameters]
# Some modules use a child's parameters without calling the child: nn.MultiheadAttention
# passes out_proj.weight to F.multi_head_attention_forward, and the transformer layers'
# inference fast path reads every parameter of the layer. Such a module binds the
# parameters of its whole subtree for its forward and backward. Other classes can be
# added by name with the wrap config's "bind_subtree" list; the poison error names the
# parameter that was read, which tells where one is needed.
_SUBTREE_CLASSES = (torch.nn.MultiheadAttention, torch.nn.TransformerEncoderLayer,
                    torch.nn.TransformerDecoderLayer)
_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_live_engines = weakref.WeakSet()
_WRAPPED_REGISTRY = weakref.WeakSet()


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
# Ops on a gradient placeholder that keep torch's zero_grad() working (Note [Gradients in torch]).
_GRAD_NOOPS = frozenset(("zero_", "detach_", "requires_grad_"))
_LAZY_OWNER = {}  # id(parameter) -> (weakref to Wrapped, pid), from wrap() to close()
_LAZY_CLASSES = {}  # torch class -> its lazy subclass


def _storage(t):
    """t's storage without torch 2's TypedStorage deprecation warning (untyped_storage is torch >= 2.0)."""
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


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


# Note [Gradients in torch]
# strata hands each gradient to its grad chunk during backward and its optimizer may
# run at once, overlapping the rest of backward. torch code that reads or changes
# gradients between backward and step() (torch.nn.utils.clip_grad_norm_,
# clip_grad_value_, logging a gradient norm) needs them as torch tensors, so the wrap
# config's "grad_reads" chooses:
#   - true: gradients stay torch's (p.grad accumulates as in torch) until
#     optimizer.step(), which hands them to strata and runs every family's optimizer
#     there (no overlap with backward; torch's memory for the gradients, as torch alone);
#   - false: gradients are handed during backward, and p.grad is a placeholder (no
#     memory) whose use raises, saying how to get gradients;
#   - "auto" (default): true for the first step, whose optimizer strata defers to
#     step() anyway (the warm-up step); a gradient used by a torch call in it (other
#     than zero_grad's) keeps it true for good, else false from the second step on.
# Either way `p.grad is None` matches torch: a parameter that got a gradient keeps one
# until zero_grad(set_to_none=True) (Note [Zero gradients]).


class _StrataGrad(torch.Tensor):
    """p.grad of a wrapped parameter whose gradient strata holds (Note [Gradients in torch])."""

    _strata_name = "?"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = _func_name(func)
        if name in _GRAD_NOOPS:
            return args[0]
        if name not in _METADATA or getattr(func, "__name__", "") == "__set__":
            t = _tensors_of((args, kwargs or {}), _StrataGrad, [None])[-1]
            raise RuntimeError(
                f"strata.torch: the gradient of {getattr(t, '_strata_name', '?')!r} was handed to strata's optimizer "
                "during backward (it overlaps backward), so torch cannot read or change it. To use gradients in "
                "torch (clip_grad_norm_, clip_grad_value_, logging), wrap with the config key \"grad_reads\": true "
                "(gradients stay torch tensors until optimizer.step()), or pass max_grad_norm= to the strata "
                "optimizer for clipping by global norm (Note [Gradients in torch] in strata/torch/_wrap.py)")
        with torch._C.DisableTorchFunction():
            return func(*args, **(kwargs or {}))


class _WatchedGrad(torch.Tensor):
    """A torch gradient during the first step of "grad_reads": "auto": notes that torch code used it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = _func_name(func)
        if name not in _METADATA and name not in _GRAD_NOOPS:
            for t in _tensors_of((args, kwargs or {}), _WatchedGrad, []):
                w = getattr(t, "_strata_owner", None)
                if w is not None:
                    w._grads_used = True
                t.__class__ = torch.Tensor
        with torch._C.DisableTorchFunction():
            return func(*args, **(kwargs or {}))


def _strip_json_comments(text):
    """JSON with // and /* */ comments (as the C++ loader accepts) to plain JSON."""
    out, i, n, in_string = [], 0, len(text), False
    while i < n:
        c = text[i]
        if in_string:
            out.append(c)
            if c == "\\" and i + 1 < n:
                out.append(text[i + 1])
                i += 1
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
            out.append(c)
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
            continue
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        else:
            out.append(c)
        i += 1
    return "".join(out)


def _load_config(config):
    if config is None:
        return {}
    if isinstance(config, dict):
        return json.loads(json.dumps(config))  # a deep copy, and JSON-serialisable or an error
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"strata.torch.wrap: cannot read the config file {path!r}: {e.strerror}") from None
        try:
            loaded = json.loads(_strip_json_comments(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"strata.torch.wrap: {path!r} is not JSON: {e}") from None
        if not isinstance(loaded, dict):
            raise ValueError(f"strata.torch.wrap: {path!r} must hold a JSON object")
        return loaded
    raise TypeError(f"strata.torch.wrap: config must be a dict or a JSON file path, not {type(config).__name__}")


def _tensors_in(obj, out):
    """Every tensor in a module's inputs or outputs (tuples, lists, dicts, dataclasses)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            _tensors_in(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _tensors_in(o, out)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _tensors_in(getattr(obj, name, None), out)
    return out


# Note [Module-local input gradients]
# A module's parameters are unbound in backward once the gradients of its inputs are computed
# (Note [Hooks]). A hook on an input tensor fires when that tensor's whole gradient is computed,
# which for a tensor that several modules take (T5's encoder output, an input of every decoder
# block's cross-attention k and v) is only once backward is past all of them: each holds its
# slot until then. Where the plan streams, a leaf module of torch.nn's own (Linear, Embedding,
# LayerNorm, ...: none changes its input in place) instead takes its tensor inputs through
# _InputsDone, an identity node (views of the same tensors, the same one for a tensor passed
# twice): its backward runs once this module's own part of those gradients is computed, and
# unbinds there. The gradients pass through unchanged. Not for other modules (an identity's view
# must not be changed in place, as for torch's full backward hooks), tensors nested in containers
# or passed as keywords (their tensor hooks stay), nor where everything fits (nothing is unbound
# in backward). Under torch.compile the identity runs in strata's eager hook, at a graph break.
# A call with no input that needs a gradient (an embedding of token ids, T5's relative attention
# bias of bucket indices) has no input hook at all and stayed bound to the end of backward; it is
# now unbound once the gradients of all of its trainable parameters are computed (their gradient
# hooks, _gradient_computed): backward is then past every node that reads them.
class _InputsDone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, done, *tensors):
        ctx.done = done
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.done(None)
        return (None,) + grads


class _Call:
    """One call of a module: its parameters and whether backward bound them."""

    __slots__ = ("pids", "bound", "inputs_pending", "grads_pending")

    def __init__(self, pids):
        self.pids = pids
        self.bound = False
        self.inputs_pending = 0
        self.grads_pending = 0


class Wrapped:
    """The strata state of one wrapped model: model.strata after wrap(model, config)."""

    def __init__(self, model, config, init=None, init_order="modules"):
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

    # --- registration ---------------------------------------------------------------

    def _collect(self):
        dtype = None
        storages = set()
        for mname, module in self.model.named_modules():
            pids = []
            for pname, p in module.named_parameters(recurse=False):
                if p is None:
                    continue
                if id(p) in self._pid:  # tied: counted once, bound by every owner
                    pids.append(self._pid[id(p)])
                    continue
                name = f"{mname}.{pname}" if mname else pname
                if p.numel() == 0:
                    continue  # nothing to offload; stays a torch tensor
                if p.dtype not in _DTYPES:
                    raise ValueError(f"strata.torch.wrap: parameter {name!r} has dtype {p.dtype}; "
                                     "strata keeps float32, bfloat16 or float16 parameters")
                if dtype is None:
                    dtype = p.dtype
                elif p.dtype != dtype:
                    raise ValueError(
                        f"strata.torch.wrap: parameter {name!r} is {p.dtype} but earlier ones are {dtype}; "
                        "every parameter must have the same (compute) dtype")
                if p.is_sparse:
                    raise ValueError(f"strata.torch.wrap: parameter {name!r} is sparse")
                # Each parameter needs a storage of its own, exactly its size (Note [Rebinding storage]).
                key = (p.device, p.untyped_storage().data_ptr() if hasattr(p, "untyped_storage")
                       else p.storage().data_ptr())
                own = (p.is_contiguous() and p.storage_offset() == 0 and key not in storages and
                       _storage(p).nbytes() == p.numel() * p.element_size())
                if not own:
                    with torch.no_grad():
                        p.set_(p.detach().clone(memory_format=torch.contiguous_format))
                    key = (p.device, _storage(p).data_ptr())
                storages.add(key)
                pid = len(self.params)
                self._pid[id(p)] = pid
                self.params.append(p)
                self.names.append(name)
                pids.append(pid)
            if pids:
                self._module_pids[module] = pids
        extra = self.config.get("bind_subtree", [])
        if not isinstance(extra, list) or not all(isinstance(n, str) for n in extra):
            raise ValueError("strata.torch.wrap: bind_subtree must be a list of module class names")
        for module in self.model.modules():
            if isinstance(module, _SUBTREE_CLASSES) or type(module).__name__ in extra:
                pids = []
                for p in module.parameters():
                    pid = self._pid.get(id(p))
                    if pid is not None and pid not in pids:
                        pids.append(pid)
                if pids:
                    self._module_pids[module] = pids
        if not self.params:
            raise ValueError("strata.torch.wrap: the model has no parameters to hand over")
        self.dtype = dtype
        self._grad_written = [False] * len(self.params)
        self._grad_live = [False] * len(self.params)
        self._classes = [type(p) for p in self.params]
        self._lazy_classes = [_lazy_class(c) for c in self._classes]
        me = weakref.ref(self)
        for pid, p in enumerate(self.params):
            _LAZY_OWNER[id(p)] = (me, pid)

    def _device_config(self):
        device = self.config.get("device")
        return device if isinstance(device, dict) else {}

    def _device_kind_wanted(self):
        kind = self._device_config().get("kind", "auto")
        if kind == "sim":
            return "cpu"
        if kind == "cuda":
            return "cuda"
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _device_wanted(self):
        """The torch device strata's device is: cpu for the sim device, else cuda:<device.cuda_ordinal>."""
        if self._device_kind_wanted() == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", int(self._device_config().get("cuda_ordinal", 0)))

    def _check_devices_early(self):
        want = self._device_wanted()
        for name, p in zip(self.names, self.params):
            if p.device.type != want.type or (want.type == "cuda" and p.device.index != want.index):
                where = ("the sim device (CPU memory)" if want.type == "cpu" else
                         f"GPU {want.index} (device.cuda_ordinal {want.index})")
                raise ValueError(
                    f"strata.torch.wrap: parameter {name!r} is on {p.device} but strata's device is {where}; "
                    f"move the model with model.to({str(want)!r}) before wrapping")

    def _model_signature(self):
        return tuple((id(p), p.requires_grad) for p in self.model.parameters())

    # --- the engine (Note [Lazy engine]) ----------------------------------------------

    def _runtime_config(self, settings):
        cfg = {k: v for k, v in self.config.items() if k not in _BINDING_KEYS}
        precision = dict(cfg.get("precision", {}))
        want = _DTYPES[self.dtype]
        if precision.get("compute", want) not in (want, {"fp32": "float32", "bf16": "bfloat16",
                                                         "fp16": "float16"}[want]):
            raise ValueError(f"strata.torch: precision.compute = {precision['compute']!r} but the model's "
                             f"parameters are {self.dtype}; leave it out or convert the model")
        precision["compute"] = want
        cfg["precision"] = precision
        largest = max((p.numel() for p in self.params), default=None)
        _layout.search_bounds(cfg, want, largest)  # Note [Chunk search bounds] in _layout.py
        plan = dict(cfg.get("plan", {})) if isinstance(cfg.get("plan"), dict) else cfg.get("plan", {})
        if isinstance(plan, dict):
            # Gradients wait on host between micro-batches (Note [Host room] in runtime/plan/planner.cpp).
            plan.setdefault("micro_batches", self.accumulation_steps)
            cfg["plan"] = plan
        if settings is not None:
            given = cfg.get("optimizer", {}).get("name") if isinstance(cfg.get("optimizer"), dict) else None
            if given is not None and given != settings["optimizer"]["name"]:
                raise ValueError(
                    f"strata.torch: the config says optimizer.name = {given!r} but the optimizer is "
                    f"{settings['optimizer']['name']!r}; leave optimizer out of the config")
            for key, value in settings.items():
                if not key.startswith("_"):
                    cfg[key] = value
        return cfg

    def _build(self, settings=None):
        """Creates the engine and hands every parameter over (Note [Lazy engine])."""
        if self.engine is not None:
            if self._steps > 0:
                raise RuntimeError(
                    "strata.torch: an optimizer was created after training started; create the strata "
                    "optimizer before the first optimizer.step()")
            self._restore_all()
        engine = _C.Engine(json.dumps(self._runtime_config(settings)))
        try:
            if engine.device_kind() != self._device_kind_wanted():
                raise ValueError(
                    f"strata.torch: strata runs on {engine.device_kind()} but the parameters are on "
                    f"{self._device_kind_wanted()}")
            adopted = 0
            trainable_in_opt = None if settings is None else settings.get("_trainable")
            self._frozen = []
            for pid, (name, p) in enumerate(zip(self.names, self.params)):
                frozen = not p.requires_grad or (trainable_in_opt is not None and id(p) not in trainable_in_opt)
                self._frozen.append(frozen)
                got = engine.register_param(name, p, frozen)
                assert got == pid
            adopted = 0
            deferred = self._deferred is not None and self._deferred.pending
            if deferred:
                adopted = len(self.params)  # adopt_unset holds their storage: restore each on failure
                self._deferred.run(self, engine)
            for pid in range(len(self.params)):
                if not deferred or id(self.params[pid]) not in self._deferred.meta:
                    engine.adopt(pid)
                adopted = max(adopted, pid + 1)
        except BaseException:
            for pid in range(adopted):
                if self._deferred is not None and self._deferred.pending and id(self.params[pid]) in self._deferred.meta:
                    self._deferred.unset(self.params[pid])  # no value yet: fresh memory, still guarded
                else:
                    engine.restore(pid)  # give the torch values back before the engine goes
            engine.close()
            raise
        self.engine = engine
        self._last_engine = engine
        _live_engines.add(engine)
        self._pushed_groups = None
        self._keep_grads = self._next_keep_grads()
        self._update_hold()
        self._set_lazy(True)

    def _ensure_engine(self):
        if self.engine is None:
            self._build(None)

    def _restore_all(self):
        self._set_lazy(False)
        for pid in range(len(self.params)):
            self.engine.restore(pid)
        self.engine.close()
        self.engine = None

    def _drop_all(self):
        """close(restore=False): the runtime is freed, then the model's parameters are replaced by meta-device
        Parameters of the same shape, dtype and requires_grad (tied parameters stay one). The old Parameter
        objects, which the optimizer still holds, become empty tensors: a stale reference has no elements to
        read, rather than memory strata no longer owns."""
        self._set_lazy(False)
        self.engine.close()
        self.engine = None
        meta = {}
        with torch.no_grad():
            for p in self.params:
                meta[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                 requires_grad=p.requires_grad)
                p.data = torch.empty(0, dtype=p.dtype)
        for module in self.model.modules():
            for name, q in module._parameters.items():
                if q is not None and id(q) in meta:
                    module._parameters[name] = meta[id(q)]

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

    # --- failed passes (Note [Failed steps] in runtime/src/step_abort.cpp) --------------------

    def _install_forward_wrapper(self):
        """Catches an exception raised anywhere in the model's forward: the step is discarded at once
        (every parameter unbound, every gradient of the step dropped), so state_dict(), a checkpoint and
        the next forward see the last good values."""
        inner = self.model.forward
        wrapped = weakref.ref(self)

        def forward(*args, **kwargs):
            try:
                return inner(*args, **kwargs)
            except BaseException:
                w = wrapped()
                if w is not None:
                    w._abort_pass("an exception was raised in forward")
                raise

        # inspect.signature(model.forward) stays the model's (it follows __wrapped__): transformers.Trainer
        # keeps the dataset columns that forward names (remove_unused_columns).
        functools.update_wrapper(forward, inner)
        self._forward_wrapper = forward
        object.__setattr__(self.model, "forward", forward)

    def _abort_pass(self, why):
        """Discards the step in progress: unbinds every parameter, drops its gradients (every
        micro-batch of it) and starts the next step clean."""
        self._calls.clear()
        self._grad_waiters.clear()
        self._phase = "idle"
        had_grads = self._grads_handed > 0 or self._micro_in_step > 0
        self._reset_step_counts()
        if self.engine is None:
            return
        self.engine.abort_step()
        if had_grads:
            warnings.warn(f"strata.torch: {why}; the gradients of this step were discarded (parameters keep "
                          "their last good values)", stacklevel=3)

    def _reset_step_counts(self):
        self._micro_in_step = 0
        self._grads_handed = 0
        self._grad_written = [False] * len(self.params)

    def _settle(self):
        """A backward that raised never reached its end (Note [Hooks]): its parameters are still
        bound and its gradients half handed over. Discards that step before anything reads or steps."""
        if self._phase == "backward":
            self._abort_pass("the last backward raised before it ended")

    # Note [Holding parameters where everything fits]
    # Where the plan keeps every family's params on the device for the whole step (the engine's
    # layout()["plan_params_resident"]: all_gpu, or params resident with optimizer states
    # elsewhere), a module's forward post-hook keeps its parameters bound instead of unbinding them,
    # and its backward finds them bound instead of binding them again: one bind (forward) and one
    # unbind (the module's backward, or the sweep at backward's end) per call instead of two each.
    # The forward unbind released a lease that the runtime records (its release wakes its threads:
    # ~0.3 ms a module on a loaded 2-core machine, the largest of the binding's costs in a profile of
    # a fit step, #29). What stays:
    #   - backward's unbind per module: the family's optimizer starts only when no lease reads its
    #     params (gradients_complete() in runtime/src/optimizer_pipeline.cpp), so it is what lets the
    #     optimizer overlap the rest of backward;
    #   - the sweep at backward's end and lazy parameters between steps (Note [Lazy parameters]):
    #     state_dict, p.data and reads between steps are served as before;
    #   - forward without grad (or a module whose outputs need no gradient): unbound at once, as before.
    # A parameter read through attribute access by another module while it is held only by a finished
    # call binds for that read as if it were unbound (ModelState.touched in _state.py): the owner's
    # backward may end before the reader's.
    # What changes, only where everything fits: a parameter read through a reference kept outside
    # attribute access after its module's forward and before its backward (Sneaky in
    # tests/torch/test_features.py reads one never bound, which still raises) reads its value instead of
    # raising the poison error; the same code raises once the plan streams. The value read is the right
    # one (the lease holds it; the optimizer cannot run under it), so never a silent wrong answer. The plan
    # is read at the build and after each step (step() may re-plan); STRATA_TORCH_BENCH_NO_HOLD=1 turns
    # this off (bench/torch_hook_cost.py's A/B).
    def _update_hold(self):
        self._hold = (self.engine is not None and self.engine.layout()["plan_params_resident"] and
                      os.environ.get("STRATA_TORCH_BENCH_NO_HOLD") != "1")  # no plan yet: False

    # --- hooks (Note [Hooks]) ------------------------------------------------------------

    def _install_hooks(self):
        root = self.model
        # Note [torch.compile] in _compile.py: plain hooks, dynamo-disabled once a compile is seen.
        pre_hook, hook = _compile.forward_pre_hook, _compile.forward_hook
        pre, post = self._pre_forward, self._post_forward
        self._handles.append(pre_hook(root, self._root_pre_forward))
        # Note [Module-local input gradients]: torch.nn's own leaf modules.
        self._local_inputs = {m for m in self._module_pids
                              if type(m).__module__.startswith("torch.nn.modules.") and not any(m.children())}
        for module in self._module_pids:
            self._handles.append(pre_hook(module, pre))
            self._handles.append(hook(module, post))
        self._handles.append(hook(root, self._root_post_forward))
        for pid, p in enumerate(self.params):
            if p.requires_grad:
                self._install_grad_hook(pid, p)

    # Note [Gradient hooks]
    # Each trainable parameter's hook runs once its gradient has been accumulated into p.grad.
    # torch >= 2.1 has the supported hook for that, Tensor.register_post_accumulate_grad_hook,
    # kept by the parameter and removed with its handle at close(). torch 1.13 has none: the
    # hook goes on the parameter's AccumulateGrad node, reached through autograd's internals
    # (p.expand_as(p).grad_fn.next_functions), which fires at the same point.

    def _install_grad_hook(self, pid, p):
        hook = self._make_grad_hook(pid, p)
        if hasattr(p, "register_post_accumulate_grad_hook"):
            self._handles.append(p.register_post_accumulate_grad_hook(hook))
            return
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(hook)
        self._acc_nodes.append(acc)

    def _check_unchanged(self):
        if self._model_signature() != self._signature:
            now = {id(p) for p in self.model.parameters()}
            known = {id(p) for p in self.params}
            added = [n for n, p in self.model.named_parameters() if id(p) not in known]
            gone = [n for n, p in zip(self.names, self.params) if id(p) not in now]
            detail = []
            if added:
                detail.append(f"new or replaced: {', '.join(added)}")
            if gone:
                detail.append(f"removed or replaced: {', '.join(gone)}")
            if not detail:
                detail.append("a parameter's requires_grad changed")
            raise RuntimeError(
                "strata.torch: the model changed after wrap (" + "; ".join(detail) + "); strata holds the "
                "parameters it found at wrap: build the model completely, then wrap it")

    def _check_poison(self):
        if self.engine is None:
            return
        hits = self.engine.poison_hits()
        if hits:
            raise RuntimeError(
                f"strata.torch: parameter(s) {', '.join(repr(h) for h in hits)} were used while not bound to "
                "strata's memory: a hook was missed (a parameter used outside its own module's forward, a "
                "module called without its hooks, or a parameter read directly). The values read were zeros. "
                "Use parameters only inside the module that owns them, read them with model.state_dict(), or, "
                "for a module that reads its children's parameters, name its class in the wrap config's "
                "\"bind_subtree\" list (Note [Modules that read their children's parameters])." +
                self._state.poison_context() + _compile.poison_hint())

    def _root_pre_forward(self, module, inputs):
        _compile.check_forward()  # compiled autograd (Note [torch.compile])
        self._set_lazy(False)
        self._check_unchanged()
        self._ensure_engine()
        if self.engine.device_kind() == "cuda":
            # Binds and releases are ordered against torch's current stream by events, not by host
            # waits (Note [Torch's stream] in python/src/stream_order.hpp).
            self.engine.set_torch_stream(torch.cuda.current_stream(self._device_wanted()).cuda_stream)
        if self._access:
            self.engine.sync_views()  # writes between steps reach the chunks (Note [Parameters between steps])
        self._clear_placeholders()
        self._check_poison()
        self._settle()
        if self._phase != "idle":
            # An earlier forward or backward raised before its hooks ended (the root module is
            # never run again inside backward): start clean.
            self.engine.unbind_all()
            self._calls.clear()
            self._grad_waiters.clear()
            self._phase = "idle"
        if torch.is_grad_enabled() and self._phase != "backward":
            self._begin_micro_batch()

    def _begin_micro_batch(self):
        if self._micro_in_step >= self.accumulation_steps:
            raise RuntimeError(
                f"strata.torch: micro-batch {self._micro_in_step + 1} before optimizer.step(), but "
                f"gradient_accumulation_steps = {self.accumulation_steps}; call optimizer.step() after that many "
                "backward passes, or raise gradient_accumulation_steps in the wrap config")
        if self._micro_in_step == 0 and self.optimizer is not None:
            self.optimizer._push_groups()
        self.engine.begin_micro_batch(self._micro_in_step == self.accumulation_steps - 1)
        self._phase = "forward"

    def _pre_forward(self, module, inputs):
        self._hook_calls += 1
        if self.engine is None:
            self._ensure_engine()
        pids = self._module_pids[module]
        if pids:  # the root owns none of its own: no call
            self.engine.bind_many(pids)  # one call per module (Note [Batched binds] in engine.hpp)
        call = _Call(pids)
        self._calls.setdefault(id(module), []).append(call)
        if torch.is_grad_enabled():
            waiting = [t for t in _tensors_in(inputs, []) if t.requires_grad]
            if waiting and module in self._local_inputs and not self._hold:
                direct = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
                if len(direct) == len(waiting):  # Note [Module-local input gradients]
                    call.inputs_pending = 1
                    unique = list({id(inputs[i]): inputs[i] for i in direct}.values())
                    views = dict(zip(map(id, unique), _InputsDone.apply(self._make_input_hook(call), *unique)))
                    return tuple(views.get(id(t), t) if i in direct else t for i, t in enumerate(inputs))
            self._await_backward_end(call, waiting)
        return None

    def _await_backward_end(self, call, waiting):
        """What ends the call's backward, where its parameters are unbound: the gradients of `waiting`, its
        inputs that need one (tensor hooks), or, with none, its trainable parameters' gradients (Note
        [Module-local input gradients])."""
        call.inputs_pending = len(waiting)
        for t in waiting:
            t.register_hook(self._make_input_hook(call))
        if not waiting and call.pids and not self._hold:
            trainable = [pid for pid in call.pids if self.params[pid].requires_grad]
            call.grads_pending = len(trainable)
            for pid in trainable:
                self._grad_waiters.setdefault(pid, []).append(call)

    def _post_forward(self, module, inputs, output):
        self._hook_calls += 1
        self._end_call(self._calls[id(module)].pop(), output)
        return None

    def _end_call(self, call, output, inputs=None):
        """A call's forward ended: its parameters are unbound (or held, where everything fits) and hooks on
        its outputs bind them again when backward reaches it. `inputs`: a reader's call, made after its
        forward began (ModelState.touched), whose input hooks are put on here."""
        waiting = [t for t in _tensors_in(output, []) if t.requires_grad] if torch.is_grad_enabled() else []
        if call.pids and waiting and self._hold:
            call.bound = True  # held until its backward (Note [Holding parameters where everything fits])
        elif call.pids and self.engine.unbind_many(call.pids):  # a poisoned region was touched
            self._check_poison()
        for t in waiting:
            t.register_hook(self._make_output_hook(call))
        if inputs is not None and waiting:
            self._await_backward_end(call, [t for t in _tensors_in(inputs, []) if t.requires_grad])

    @staticmethod
    def _reader_call():
        """A call for a module that owns no strata parameter and read one in its forward (Note [Parameters
        read by another module]): it ends with the module's forward (ModelState._pop), not the caller's."""
        return _Call([])

    def _make_output_hook(self, call):
        def hook(grad):
            if _compile.compiling():  # compiled autograd traces backward (Note [torch.compile])
                _compile.refuse_traced_backward()
            self._hook_calls += 1
            self._on_backward_begins()  # returns at once after the first (a held call is bound already)
            if not call.bound:
                call.bound = True
                if call.pids:
                    self.engine.bind_many(call.pids)
            return None
        return hook

    def _make_input_hook(self, call):
        def hook(grad):
            self._hook_calls += 1
            call.inputs_pending -= 1
            if call.inputs_pending == 0 and call.bound:
                call.bound = False
                if call.pids:
                    self.engine.unbind_many(call.pids)
            return None
        return hook

    def _on_backward_begins(self):
        if self._phase == "backward":
            return
        self._phase = "backward"
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_ends)

    def _on_backward_ends(self):
        self.engine.unbind_all()
        if self.engine.gradients_pending():  # Note [Gradients in pieces] in strata/runtime/gradient_order.hpp
            # Families some of whose params got no gradient complete now, not at step(): a param whose
            # torch p.grad would be a zero tensor gets zeros (Note [Zero gradients]), the others none.
            zero = [live and not written and not frozen
                    for live, written, frozen in zip(self._grad_live, self._grad_written, self._frozen)]
            for pid in self.engine.end_backward(zero):
                self._grad_written[pid] = True
                if self._access and self.params[pid].grad is None:
                    self.params[pid].grad = self._placeholder(pid)  # torch's zero gradient stays in p.grad
        self._calls.clear()
        self._grad_waiters.clear()
        self._phase = "idle"
        self._micro_in_step += 1
        self._set_lazy(True)
        self._check_poison()

    def _root_post_forward(self, module, inputs, output):
        if self._phase == "idle":  # a forward without grad: parameters are readable again
            self._set_lazy(True)
        return None

    def _make_grad_hook(self, pid, p):
        def hook(*unused):
            if _compile.compiling():  # compiled autograd traces backward (Note [torch.compile])
                _compile.refuse_traced_backward()
            self._hook_calls += 1
            if self._grad_waiters:
                self._gradient_computed(pid)
            g = p.grad
            if g is None or self.engine is None:
                return
            if self._frozen[pid]:
                return  # not in the optimizer: torch keeps its gradient in p.grad and updates nothing
            if self._keep_grads:  # handed at step() (Note [Gradients in torch])
                if self.grad_reads == "auto" and type(g) is torch.Tensor:
                    g.__class__ = _WatchedGrad
                    g._strata_owner = self
                return
            self.engine.hand_grad(pid, g, self._grad_written[pid])
            self._grad_written[pid] = True
            self._grads_handed += 1
            self._grad_live[pid] = True
            p.grad = self._placeholder(pid) if self._access else None
        return hook

    def _gradient_computed(self, pid):
        """Backward is past every use of parameter pid: a call that had no input to wait for is over once
        all of its parameters' gradients are (Note [Module-local input gradients])."""
        for call in self._grad_waiters.pop(pid, ()):
            call.grads_pending -= 1
            if call.grads_pending == 0 and call.bound:
                call.bound = False
                self.engine.unbind_many(call.pids)

    def _placeholder(self, pid):
        """The placeholder to put in p.grad (the caller puts it there)."""
        self._cleared.discard(pid)
        ph = self._placeholders.get(pid)
        if ph is None:
            p = self.params[pid]
            ph = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape).as_subclass(_StrataGrad)
            ph._strata_name = self.names[pid]
            self._placeholders[pid] = ph
        return ph

    def _clear_placeholders(self):
        """Takes placeholders out of p.grad before a backward (autograd would accumulate into them).
        One that is gone was set to None by torch code (a submodule's zero_grad(set_to_none=True)):
        torch would skip that parameter in a step without a gradient (Note [Zero gradients])."""
        for pid, ph in self._placeholders.items():
            p = self.params[pid]
            if p.grad is ph:
                p.grad = None
                self._cleared.add(pid)
            elif p.grad is None and pid not in self._cleared:
                self._grad_live[pid] = False
            # (None where this took the placeholder out at an earlier forward with no backward since, a
            # no-grad one included: still torch's zero gradient. torch code that sets that None to None,
            # e.g. a submodule's own zero_grad(set_to_none=True), is not seen then; a strata optimizer's
            # zero_grad(set_to_none=True) is)

    # --- parameters between steps (Note [Lazy parameters]) --------------------------------

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

    # Note [Zero gradients]
    # torch.optim skips a parameter whose p.grad is None and steps one whose p.grad is
    # a tensor of zeros (SGD's momentum and weight decay, Adam's moments go on). torch
    # 1.13's zero_grad() leaves zeros (set_to_none=False) unless asked for None, so a
    # parameter that got a gradient once and none in this step is still updated. strata
    # keeps torch's answer to "is p.grad None" per parameter (_grad_live: set when a
    # gradient is handed, cleared by zero_grad(set_to_none=True)) and, at step(),
    # hands a zero gradient for each live one that got none in this step. With
    # gradients kept in torch (Note [Gradients in torch]) p.grad is torch's own and
    # this needs nothing.

    def zero_grad(self, params, set_to_none):
        for p in params:
            pid = self._pid.get(id(p))
            g = p.grad
            if g is None:
                if set_to_none and pid is not None:
                    self._grad_live[pid] = False  # torch's zero gradient (placeholder taken out) is None now
                continue
            if set_to_none:
                p.grad = None
                if pid is not None:
                    self._grad_live[pid] = False
            elif isinstance(g, _StrataGrad):
                continue  # strata's gradient is consumed; the next is written whole
            else:
                if g.grad_fn is not None:
                    g.detach_()
                else:
                    g.requires_grad_(False)
                g.zero_()

    # --- steps -----------------------------------------------------------------------------

    def _hand_kept_grads(self):
        """Hands torch's gradients to strata at step() (Note [Gradients in torch]); p.grad stays torch's.
        Besides the kept ones, a tensor found in p.grad that strata did not get (a gradient set by hand,
        or one whose accumulator hook was lost to p.set_()) is handed too, as torch.optim would use it.
        Last parameter first, the order backward produces gradients in."""
        for pid in reversed(range(len(self.params))):
            p = self.params[pid]
            g = p.grad
            if g is None or self._frozen[pid] or isinstance(g, _StrataGrad) or self._grad_written[pid]:
                continue
            if type(g) is _WatchedGrad:
                g.__class__ = torch.Tensor
            self.engine.hand_grad(pid, g.detach(), False)
            self._grad_written[pid] = True
            self._grads_handed += 1
            self._grad_live[pid] = True

    def _hand_zero_grads(self):
        """A zero gradient for each parameter whose p.grad torch would hold but that got none (Note [Zero gradients])."""
        if self._keep_grads:
            return  # p.grad is torch's own: a zero one was handed with the others
        for pid, p in enumerate(self.params):
            if self._grad_live[pid] and not self._grad_written[pid] and not self._frozen[pid]:
                self.engine.hand_grad(pid, torch.zeros(p.shape, dtype=p.dtype, device=p.device), False)
                self._grad_written[pid] = True
                if self._access and p.grad is None:
                    p.grad = self._placeholder(pid)  # torch's zero gradient stays in p.grad

    def _next_keep_grads(self):
        if self.grad_reads == "auto":
            return self._steps == 0 or self._grads_used
        return bool(self.grad_reads)

    def step(self):
        if self._phase == "backward":
            # A backward that raised never reached its end (or step() was called inside backward).
            self._settle()
            raise RuntimeError(
                "strata.torch: optimizer.step() after a backward that raised (or during backward): its "
                "gradients were discarded; run forward and backward again")
        if self.engine is not None:
            self._set_lazy(False)
            self.engine.sync_views()
            if self._micro_in_step > 0:
                self._hand_kept_grads()
        if self.engine is None or self._grads_handed == 0:
            raise RuntimeError(
                "strata.torch: optimizer.step() without a backward since the last step: no gradient reached "
                "strata (call loss.backward() first)")
        self._hand_zero_grads()
        try:
            stats = self.engine.step()
        except StrataError:
            # The runtime discarded the step (Note [Failed steps]): the next one starts clean.
            self._reset_step_counts()
            self._phase = "idle"
            raise
        self._steps += 1
        self._update_hold()  # step() may have re-planned
        self._set_lazy(True)
        self._micro_in_step = 0
        self._grads_handed = 0
        self._grad_written = [False] * len(self.params)
        self._phase = "idle"
        was_keeping = self._keep_grads
        self._keep_grads = self._next_keep_grads()
        if was_keeping and not self._keep_grads:
            # "auto" stops keeping gradients: torch's p.grad from this step become placeholders.
            for pid, p in enumerate(self.params):
                if p.grad is not None and not isinstance(p.grad, _StrataGrad) and not self._frozen[pid]:
                    p.grad = self._placeholder(pid)
        self.last_stats = stats
        return stats

    @property
    def totals(self):
        """Steps, bytes per link and stall since wrap: the C++ runtime's running totals
        (strata::Runtime::stats, kept in that one place, #26), read, not summed here. An
        engine is rebuilt only before the first step, so the newest one holds them all."""
        engine = self._last_engine
        return engine.totals() if engine is not None else _C.zero_totals()

    # --- state_dict (plain torch tensors) -----------------------------------------------

    # Note [Step counters]
    # counters() is strata's own work so far, for bench/torch_gpt.py and the tests that hold a
    # fit step to zero extra work (tests/torch/test_step_cost.py): bytes moved between tiers
    # (the runtime's StepStats, summed over steps), Python hook calls (module and tensor hooks,
    # gradient hand-overs) and the engine's crossings (calls into the binding from hooks) and
    # param leases taken. Differences over N steps divided by N are per-step figures.

    def counters(self):
        c = {k: v for k, v in self.totals.items() if k != "steps"}
        c["steps"] = self.totals["steps"]
        c["bytes_moved"] = c["bytes_h2d"] + c["bytes_d2h"] + c["bytes_disk_read"] + c["bytes_disk_write"]
        c["hook_calls"] = self._hook_calls
        e = self.engine.counters() if self.engine is not None else {}
        c["crossings"] = e.get("crossings", 0)
        c["param_leases"] = e.get("param_leases", 0)
        return c

    def read_param(self, pid):
        p = self.params[pid]
        return self.engine.read(pid, PARAM).to(p.dtype)

    def load_state_dict(self, state_dict, strict=True):
        """torch's Module.load_state_dict for the wrapped model (Note [load_state_dict of a wrapped model]):
        a dict that torch refuses loads nothing."""
        return self._state.load(self.model, state_dict, strict)


def _zero_grad(self, set_to_none=False):
    """Module.zero_grad for a wrapped model (Note [Zero gradients])."""
    wrapped = getattr(self, "_strata_wrapped", None)
    if wrapped is None:
        return torch.nn.Module.zero_grad(self, set_to_none)
    wrapped.zero_grad(list(self.parameters()), set_to_none)
    return None


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


def wrap(model, config=None, *, init=None, init_order="modules"):
    """Hands `model`'s parameters to strata and returns the model (the same object).

    config: a dict or the path of a JSON file, with the keys of strata's C++ Config
    (docs/config.md: device, budgets, nvme, precision, plan, layout, ...) and
    ``gradient_accumulation_steps`` (backward passes per optimizer.step(), default 1).
    The optimizer comes from strata.torch's optimizer classes (strata.torch.AdamW, ...).
    model.strata is the wrapped state (stats, close()).
    A model with its parameters on the meta device is initialised straight into strata's chunks
    by each module's reset_parameters() and then init(module) (Note [Deferred init] in _deferred.py).
    """
    wrapped = Wrapped(model, config, init, init_order)
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


@atexit.register
def _close_engines():
    # Swap files are removed when an engine closes; at exit nothing reads the parameters again.
    for engine in list(_live_engines):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - exit must go on
            pass
