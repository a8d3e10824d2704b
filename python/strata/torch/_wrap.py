"""strata.torch.wrap: hand a torch.nn.Module's state to strata's chunk runtime.

Note [Hooks]
Each module that owns parameters gets a forward pre-hook and a forward hook:
  - before its forward, its parameters are bound: their storage points at the
    param chunk's lease (Note [Rebinding storage] in python/src/binding.cpp);
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
import json
import os
import re
import warnings
import weakref

import torch

from . import _C

PARAM, GRAD, MASTER, STATE0, STATE1 = range(5)
StrataError = _C.StrataError

# Keys of the wrap config that the binding handles itself (not the runtime's).
_BINDING_KEYS = ("gradient_accumulation_steps", "bind_subtree")

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


class _Call:
    """One call of a module: its parameters and whether backward bound them."""

    __slots__ = ("pids", "bound", "inputs_pending")

    def __init__(self, pids):
        self.pids = pids
        self.bound = False
        self.inputs_pending = 0


class Wrapped:
    """The strata state of one wrapped model: model.strata after wrap(model, config)."""

    def __init__(self, model, config):
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
        self.model = model
        self.engine = None
        self.optimizer = None
        self.params = []  # pid -> Parameter
        self.names = []  # pid -> qualified name
        self._pid = {}  # id(Parameter) -> pid
        self._module_pids = {}  # module -> [pid] (its own parameters)
        self._calls = {}  # id(module) -> stack of _Call
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
        self.totals = {"steps": 0, "bytes_h2d": 0, "bytes_d2h": 0, "bytes_disk_read": 0,
                       "bytes_disk_write": 0, "stall_s": 0.0}
        self._collect()
        self._check_devices_early()
        _C.validate_config(json.dumps(self._runtime_config(None)))  # unknown keys fail here, not later
        self._install_hooks()
        model._strata_wrapped = self
        self._signature = self._model_signature()
        _WRAPPED_REGISTRY.add(self)

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
                       p.storage().nbytes() == p.numel() * p.element_size())
                if not own:
                    with torch.no_grad():
                        p.set_(p.detach().clone(memory_format=torch.contiguous_format))
                    key = (p.device, p.storage().data_ptr())
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

    def _device_kind_wanted(self):
        kind = self.config.get("device", {}).get("kind", "auto") if isinstance(self.config.get("device"), dict) \
            else "auto"
        if kind == "sim":
            return "cpu"
        if kind == "cuda":
            return "cuda"
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _check_devices_early(self):
        want = self._device_kind_wanted()
        for name, p in zip(self.names, self.params):
            if p.device.type != want:
                raise ValueError(
                    f"strata.torch.wrap: parameter {name!r} is on {p.device} but strata's device is "
                    f"{'the sim device (CPU memory)' if want == 'cpu' else 'a CUDA GPU'}; "
                    f"move the model with model.to({want!r}) before wrapping")

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
        plan = dict(cfg.get("plan", {})) if isinstance(cfg.get("plan"), dict) else cfg.get("plan", {})
        if isinstance(plan, dict):
            # Gradients wait on host between micro-batches (Note [Host room] in runtime/src/planner.cpp).
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
            for pid in range(len(self.params)):
                engine.adopt(pid)
                adopted += 1
        except BaseException:
            for pid in range(adopted):
                engine.restore(pid)  # give the torch values back before the engine goes
            engine.close()
            raise
        self.engine = engine
        _live_engines.add(engine)
        self._pushed_groups = None

    def _ensure_engine(self):
        if self.engine is None:
            self._build(None)

    def _restore_all(self):
        for pid in range(len(self.params)):
            self.engine.restore(pid)
        self.engine.close()
        self.engine = None

    def close(self):
        """Gives every parameter its value back as torch memory, removes the hooks and frees strata's
        tiers (swap files included). The model is plain torch afterwards."""
        error = None
        if self.engine is not None:
            try:
                self.engine.flush()
            except StrataError as e:
                error = e  # the last good state is still readable: restore it, then report
            self._restore_all()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._acc_nodes.clear()
        self.model._strata_wrapped = None
        if error is not None:
            raise error

    # --- hooks (Note [Hooks]) ------------------------------------------------------------

    def _install_hooks(self):
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._root_pre_forward))
        for module in self._module_pids:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward))
            self._handles.append(module.register_forward_hook(self._post_forward))
        self._handles.append(root._register_state_dict_hook(self._state_dict_hook))
        for pid, p in enumerate(self.params):
            if p.requires_grad:
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(self._make_grad_hook(pid, p))
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
                "\"bind_subtree\" list (Note [Modules that read their children's parameters]).")

    def _root_pre_forward(self, module, inputs):
        self._check_unchanged()
        self._ensure_engine()
        self._check_poison()
        if self._phase != "idle":
            # An earlier forward or backward raised before its hooks ended (the root module is
            # never run again inside backward): start clean.
            self.engine.unbind_all()
            self._calls.clear()
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
        if self.engine is None:
            self._ensure_engine()
        pids = self._module_pids[module]
        for pid in pids:
            self.engine.bind(pid)
        call = _Call(pids)
        self._calls.setdefault(id(module), []).append(call)
        if torch.is_grad_enabled():
            waiting = [t for t in _tensors_in(inputs, []) if t.requires_grad]
            call.inputs_pending = len(waiting)
            for t in waiting:
                t.register_hook(self._make_input_hook(call))
        return None

    def _post_forward(self, module, inputs, output):
        call = self._calls[id(module)].pop()
        for pid in call.pids:
            self.engine.unbind(pid)
        self._check_poison()
        if torch.is_grad_enabled():
            for t in _tensors_in(output, []):
                if t.requires_grad:
                    t.register_hook(self._make_output_hook(call))
        return None

    def _make_output_hook(self, call):
        def hook(grad):
            if not call.bound:
                self._on_backward_begins()
                call.bound = True
                for pid in call.pids:
                    self.engine.bind(pid)
            return None
        return hook

    def _make_input_hook(self, call):
        def hook(grad):
            call.inputs_pending -= 1
            if call.inputs_pending == 0 and call.bound:
                call.bound = False
                for pid in call.pids:
                    self.engine.unbind(pid)
            return None
        return hook

    def _on_backward_begins(self):
        if self._phase == "backward":
            return
        self._phase = "backward"
        torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_ends)

    def _on_backward_ends(self):
        self.engine.unbind_all()
        self._calls.clear()
        self._phase = "idle"
        self._micro_in_step += 1
        self._check_poison()

    def _make_grad_hook(self, pid, p):
        def hook(*unused):
            g = p.grad
            if g is None or self.engine is None:
                return
            if self._frozen[pid]:
                p.grad = None  # not in the optimizer: torch would not update it either
                return
            self.engine.hand_grad(pid, g, self._grad_written[pid])
            self._grad_written[pid] = True
            self._grads_handed += 1
            p.grad = None
        return hook

    # --- steps -----------------------------------------------------------------------------

    def step(self):
        if self.engine is None or self._grads_handed == 0:
            raise RuntimeError(
                "strata.torch: optimizer.step() without a backward since the last step: no gradient reached "
                "strata (call loss.backward() first)")
        if self._phase == "backward":
            raise RuntimeError("strata.torch: optimizer.step() during backward")
        stats = self.engine.step()
        self._steps += 1
        self._micro_in_step = 0
        self._grads_handed = 0
        self._grad_written = [False] * len(self.params)
        self._phase = "idle"
        self.last_stats = stats
        self.totals["steps"] += 1
        for k in ("bytes_h2d", "bytes_d2h", "bytes_disk_read", "bytes_disk_write", "stall_s"):
            self.totals[k] += stats[k]
        return stats

    # --- state_dict (plain torch tensors) -----------------------------------------------

    def read_param(self, pid):
        p = self.params[pid]
        return self.engine.read(pid, PARAM).to(p.dtype)

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        if self.engine is None:
            return state_dict
        self.engine.flush()
        by_key = {}
        for mname, m in self.model.named_modules():
            for pname, p in m.named_parameters(recurse=False):
                if p is not None and id(p) in self._pid:
                    by_key[prefix + (f"{mname}.{pname}" if mname else pname)] = self._pid[id(p)]
        for key, pid in by_key.items():
            if key in state_dict:
                state_dict[key] = self.read_param(pid)
        return state_dict

    def load_state_dict(self, state_dict, strict=True):
        """torch's Module.load_state_dict for a wrapped model: every key and shape is checked before
        anything is written, so a bad checkpoint loads nothing."""
        if self.engine is None:
            return _ORIGINAL_LOAD(self.model, state_dict, strict)
        expected = {}  # key -> ("param", pid) | ("buffer", module, name)
        for mname, m in self.model.named_modules():
            pre = f"{mname}." if mname else ""
            for pname, p in m._parameters.items():
                if p is None:
                    continue
                if id(p) in self._pid:
                    expected[pre + pname] = ("param", self._pid[id(p)], p)
                else:
                    expected[pre + pname] = ("plain", m, pname, p)
            for bname, b in m._buffers.items():
                if b is not None and bname not in m._non_persistent_buffers_set:
                    expected[pre + bname] = ("plain", m, bname, b)
        missing = [k for k in expected if k not in state_dict]
        unexpected = [k for k in state_dict if k not in expected]
        errors = []
        if strict and missing:
            errors.append(f"missing keys: {', '.join(missing)}")
        if strict and unexpected:
            errors.append(f"unexpected keys: {', '.join(unexpected)}")
        for key, entry in expected.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            target = entry[-1]
            if not isinstance(value, torch.Tensor):
                errors.append(f"{key}: not a tensor ({type(value).__name__})")
            elif tuple(value.shape) != tuple(target.shape):
                errors.append(f"{key}: shape {tuple(value.shape)} in the checkpoint, {tuple(target.shape)} in the model")
        if errors:
            raise RuntimeError("strata.torch: load_state_dict refused, nothing was loaded: " + "; ".join(errors))
        self.engine.flush()
        done = set()
        with torch.no_grad():
            for key, entry in expected.items():
                if key not in state_dict:
                    continue
                if entry[0] == "param":
                    if entry[1] in done:
                        continue
                    done.add(entry[1])
                    self.engine.write(entry[1], PARAM, state_dict[key])
                else:
                    entry[-1].copy_(state_dict[key])
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


_ORIGINAL_LOAD = torch.nn.Module.load_state_dict


def _load_state_dict(self, state_dict, strict=True):
    wrapped = getattr(self, "_strata_wrapped", None)
    if wrapped is not None and wrapped.model is self:
        return wrapped.load_state_dict(state_dict, strict)
    return _ORIGINAL_LOAD(self, state_dict, strict)


def wrap(model, config=None):
    """Hands `model`'s parameters to strata and returns the model (the same object).

    config: a dict or the path of a JSON file, with the keys of strata's C++ Config
    (docs/config.md: device, budgets, nvme, precision, plan, layout, ...) and
    ``gradient_accumulation_steps`` (backward passes per optimizer.step(), default 1).
    The optimizer comes from strata.torch's optimizer classes (strata.torch.AdamW, ...).
    model.strata is the wrapped state (stats, close()).
    """
    wrapped = Wrapped(model, config)
    # An instance attribute (not a Parameter, Module or Tensor) shadows the class's methods.
    object.__setattr__(model, "load_state_dict", _load_state_dict.__get__(model))
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
