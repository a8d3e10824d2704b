"""Building the engine: a wrapped model's parameters collected and checked at wrap(), the runtime's
config, and the engine built, rebuilt and given back (Wrapped takes these methods from _Building).

Note [Lazy engine]
wrap() registers nothing yet: the runtime needs the optimizer (its states decide
the chunk families), so the engine is built when the strata optimizer is created
or, without one, at the first forward (with the config's optimizer). Until then
the model is plain torch. Building it copies every parameter into the runtime and
frees the torch memory. An optimizer created after the engine was built rebuilds
it (reading the parameters back) as long as no step has run.
"""

import atexit
import json
import os
import weakref

import torch

from . import _C, _layout, _processes
from ._views import _LAZY_OWNER, _lazy_class

# Keys of the wrap config that the binding handles itself (not the runtime's).
_BINDING_KEYS = ("gradient_accumulation_steps", "bind_subtree", "grad_reads", "comm", "budgets_per")

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


def _storage(t):
    """t's storage without torch 2's TypedStorage deprecation warning (untyped_storage is torch >= 2.0)."""
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()


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


class _Building:
    """Wrapped's engine: registration at wrap(), the build (Note [Lazy engine]) and giving it back."""

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
        if self._group is not None:
            cfg = _processes.per_rank_budgets(dict(cfg, budgets_per=self.config.get("budgets_per", "node")))
            cfg.pop("budgets_per")
            threads = _processes.local_threads(cfg)  # Note [Ranks under torchrun]
            if threads is not None:
                cfg["threads"] = threads
        precision = dict(cfg.get("precision", {}))
        want = _DTYPES[self.dtype]
        if precision.get("compute", want) not in (want, {"fp32": "float32", "bf16": "bfloat16",
                                                         "fp16": "float16"}[want]):
            raise ValueError(f"strata.torch: precision.compute = {precision['compute']!r} but the model's "
                             f"parameters are {self.dtype}; leave it out or convert the model")
        precision["compute"] = want
        states = settings.get("_states") if settings is not None else None
        if states is not None:  # the optimizer's state_dtype= (Note [Optimizer state dtype] in optim.py)
            given = precision.get("states")
            if given is not None and given != states:
                raise ValueError(f"strata.torch: the config says precision.states = {given!r} but the optimizer's "
                                 f"state_dtype asks for {states!r}; give it in one place")
            precision["states"] = states
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

    def _working_sets(self):
        """The parameters each module binds at once with those of its ancestors, which stay bound while it runs
        (Note [Working sets] in runtime/src/core/core.cpp): one set per module with parameters, per path to it."""
        sets, seen = [], set()

        def walk(module, bound):
            own = self._module_pids.get(module, ())
            now = bound | set(own)
            key = (id(module), frozenset(now))
            if key in seen:
                return
            seen.add(key)
            if own:
                sets.append(sorted(now))
            for child in module.children():
                walk(child, now)

        walk(self.model, frozenset())
        return sets

    def _build(self, settings=None):
        """Creates the engine and hands every parameter over (Note [Lazy engine])."""
        if self.engine is not None:
            if self._steps > 0:
                raise RuntimeError(
                    "strata.torch: an optimizer was created after training started; create the strata "
                    "optimizer before the first optimizer.step()")
            self._restore_all()
        comm = None if self._group is None else _processes.make_comm(self._group, self.config)
        engine = _C.Engine(json.dumps(self._runtime_config(settings)), comm)
        self._comm = comm  # Note [Averaged gradients in torch] in _processes.py
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
            for set_id, pids in enumerate(self._working_sets()):
                for pid in pids:
                    engine.add_to_working_set(pid, set_id)
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


@atexit.register
def _close_engines():
    # Swap files are removed when an engine closes; at exit nothing reads the parameters again.
    for engine in list(_live_engines):
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - exit must go on
            pass
