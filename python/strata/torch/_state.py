"""A wrapped model's state in torch's forms: state_dict, load_state_dict, copy and pickle, and the
parameters a module reads without owning them (Wrapped.__init__ installs all of it).

Note [state_dict of a wrapped model]
Between steps a parameter's storage points at its poison region (Note [Rebinding storage] in
python/src/param_binds.cpp), so torch's state_dict (the parameter, detached) would hold no values.
A state_dict hook on every module that owns strata parameters puts each one's current value
(read from the runtime, on the CPU, in the parameter's dtype) under that module's keys. The hook
runs once per path torch walks, so a module shared by two parents fills both of its keys, and a
tied parameter fills the keys of each owner, as torch does; within one state_dict() call every
key of one parameter holds the same tensor (as torch's do). With keep_vars=True torch returns the
Parameter objects themselves, and so does strata: reading their values between steps is
Note [Hooks]'s business, not this hook's.

Note [load_state_dict of a wrapped model]
load_state_dict runs torch's own Module.load_state_dict (its key matching, strict checks,
per-module _load_from_state_dict overrides and load hooks) on stand-ins: each strata parameter
of the module's subtree is replaced, for the call, by a CPU tensor holding its current value, and
each buffer by a clone. When torch's load succeeds, the stand-ins torch wrote to (their version
counter moved) go to the runtime and into the buffers; when it raises, nothing was written and
the error says so. Duplicate keys of a shared module or tied parameter are loaded as torch loads
them: in order, the last one wins. The stand-ins are one copy of the subtree's values in host
memory for the length of the call.

Note [Copying a wrapped model]
copy.deepcopy, copy.copy and pickle (torch.save(model) too) of a wrapped module give a plain
torch module: no strata hooks or attributes, each strata parameter a new torch Parameter with
its current value (tied parameters stay tied, shared modules stay shared). The instance
attributes __deepcopy__ and __reduce_ex__ of every module of the model do this: for the copy,
strata's hooks and attributes are taken off the subtree, deepcopy's memo maps each strata
parameter to its plain copy, and everything is put back afterwards. A copy is plain torch: to
train it with strata, wrap it.

Note [Parameters read by another module]
A module may read a parameter of a module it does not call: a tie written as
F.linear(x, self.wte.weight), a head reading an embedding, a reparametrisation's pre-hook. Every
such read goes through Module.__getattr__ (parameters live in _parameters, not in __dict__).
strata.torch wraps Module.__getattr__ (one dict look-up more per module attribute read; nothing
more for modules that own no strata parameter): a strata parameter read while a forward runs and
while nothing binds it is bound there and then, as a parameter of the innermost module whose
forward is running (the root's at least; modules above an owner push a frame too, naming the
reader exactly). A reader that owns no parameter gets a call of its own at its first such read
(a reader's call, ended by its frame's pop as an owner's by strata's forward hook); until #27 it
took the enclosing owner's call, so T5's DenseReluDense, which reads wo.weight's dtype, kept
every block's wo.weight bound to the end of the forward. It is unbound with that module's other
parameters at its forward's end and bound again when backward reaches that module, like its own; with gradients on, the read returns an
alias (a view made by an autograd Function, the same one for every read in that call) whose
backward runs once backward is past every use of it, and unbinds the parameter there rather than
with the rest of the call. So F.linear(h, self.wte.weight) holds the weight's slot in backward
for as long as a head module owning it would, and the tie needs the module tie's slots. A read
that does not go through attribute access (a reference stored earlier, iterating
module.parameters() inside forward) is still missed; the poison error names the parameter, and
the class of the module whose forward must bind it goes into the config's "bind_subtree".
strata's forward pre-hooks are moved in front of hooks registered before wrap (weight_norm's,
spectral_norm's, pruning's), so a reparametrisation computed in a pre-hook reads bound values.
"""

import copy
import weakref

import torch

from . import _C, _compile

_ORIGINAL_LOAD = torch.nn.Module.load_state_dict
_ORIGINAL_GETATTR = torch.nn.Module.__getattr__
# Instance attributes strata puts on a wrapped model's modules (taken off for a copy).
_ATTRS = ("load_state_dict", "zero_grad", "__deepcopy__", "__reduce_ex__", "_strata_owner", "_strata_wrapped", "strata")
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_state_dict_hooks",
               "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")
_PARAM = _C.PARAM  # StateKind::kParam, from the binding (#26)
# What the call of a frame of ModelState.active is (Note [Parameters read by another module]):
# the module's own (strata's pre-hook made it: the module owns parameters), the enclosing frame's,
# or one made for the module when it read a parameter it does not own (a reader's).
_OWN, _INHERITED, _READER = "own", "inherited", "reader"


def _module_getattr(self, name):
    """Module.__getattr__, telling strata when one of its parameters is read (Note [Parameters
    read by another module])."""
    d = self.__dict__
    params = d.get("_parameters")
    if params is not None and name in params:
        p = params[name]
        owner = d.get("_strata_owner")
        if owner is not None and p is not None:
            return owner._state.touched(p)
        return p
    return _ORIGINAL_GETATTR(self, name)


class _Use(torch.autograd.Function):
    """The alias of a lazily bound parameter: its backward runs once backward is past every use."""

    @staticmethod
    def forward(ctx, p, state, call, pid):
        ctx.state, ctx.call, ctx.pid = state, call, pid
        return p.view_as(p)

    @staticmethod
    def backward(ctx, grad):
        ctx.state.released(ctx.call, ctx.pid)
        return grad, None, None, None


class ModelState:
    """strata.torch's state_dict, load_state_dict, copy and lazy-bind machinery for one Wrapped."""

    def __init__(self, wrapped):
        self.w = wrapped
        self.active = []  # modules whose forward runs, innermost last (Note [Parameters read by another module])
        self._sd_key = None  # (weakref to the state_dict being filled, steps) for the one-tensor-per-parameter cache
        self._sd_values = {}  # pid -> weakref to the tensor put in that state_dict
        self._aliases = {}  # (id(call), pid) -> the alias a lazily bound parameter's reads return

    # --- installation ------------------------------------------------------------------------

    def install(self):
        w = self.w
        model = w.model
        torch.nn.Module.__getattr__ = _module_getattr
        for m in model.modules():
            if any(p is not None and id(p) in w._pid for p in m._parameters.values()):
                object.__setattr__(m, "_strata_owner", w)
                w._handles.append(m._register_state_dict_hook(self._state_dict_hook))
            self._set_copy_attrs(m)
        framed = [m for m in model.modules() if m in w._module_pids or
                  any(p is not None and id(p) in w._pid for p in m.parameters())]
        push, pop = self._push, self._pop  # plain until a compile is seen (Note [torch.compile])
        _compile.skip_frames(ModelState.touched, _Use.forward, _Use.backward)
        for m in framed:  # the root, owners and every module above one: those that can read a parameter
            w._handles.append(_compile.forward_pre_hook(m, push))
            w._handles.append(_compile.forward_hook(m, pop))
        ours = {h.id for h in w._handles}
        for m in framed:
            hooks = m._forward_pre_hooks
            for key in reversed([k for k in hooks if k in ours]):
                hooks.move_to_end(key, last=False)

    def _set_copy_attrs(self, m):
        state = self

        def load_state_dict(state_dict, strict=True):
            return state.load(m, state_dict, strict)

        def deepcopy(memo):
            return state.plain_copy(m, memo)

        def reduce_ex(protocol):
            return state.plain_copy(m, {}).__reduce_ex__(protocol)

        load_state_dict.__doc__ = torch.nn.Module.load_state_dict.__doc__
        object.__setattr__(m, "load_state_dict", load_state_dict)
        object.__setattr__(m, "__deepcopy__", deepcopy)
        object.__setattr__(m, "__reduce_ex__", reduce_ex)

    def uninstall(self):
        """After close(): a copy of the model still leaves model.strata behind, so the copy attributes stay."""
        for m in self.w.model.modules():
            m.__dict__.pop("_strata_owner", None)
        self.active.clear()
        self._aliases.clear()

    # --- parameters read by another module ---------------------------------------------------

    def _push(self, module, inputs):
        if module is self.w.model:
            self.active.clear()  # an earlier forward that raised left its frames
            self._aliases.clear()
        else:
            self.w._check_poison()  # a read missed in the parent's forward: Note [Parameters read by another module]
        calls = self.w._calls.get(id(module))  # strata's pre-hook made the call; else the enclosing one's
        if calls:
            self.active.append((module, calls[-1], _OWN))
        else:
            self.active.append((module, self.active[-1][1] if self.active else None, _INHERITED))

    def _pop(self, module, inputs, output):
        if self.active and self.active[-1][0] is module:
            self.w._check_poison()  # before the frame goes: it names this module
            _, call, kind = self.active.pop()
            if kind is _READER:  # Note [Parameters read by another module]: its forward ends like an owner's
                self.w._end_call(call, output, inputs)
            if self._aliases and not (self.active and self.active[-1][1] is call):
                for key in [k for k in self._aliases if k[0] == id(call)]:
                    del self._aliases[key]

    def touched(self, p):
        """A strata parameter was read through attribute access: what the read returns."""
        if not self.active:
            return p
        w = self.w
        pid = w._pid.get(id(p))
        engine = w.engine
        if pid is None or engine is None:
            return p
        module, call, kind = self.active[-1]
        alias = self._aliases.get((id(call), pid))  # (an enclosing call's, for a frame that inherits it)
        if alias is not None:
            return alias
        if engine.binds(pid) > 0 and (not w._hold or self._bound_by_active(pid)):
            return p
        if kind is _INHERITED:  # a reader owning no parameter: a call of its own, ended with its forward
            call = w._reader_call()
            self.active[-1] = (module, call, _READER)
        engine.bind(pid)
        call.pids = list(call.pids) + [pid]  # this call's own list: unbound and rebound with it
        if not (torch.is_grad_enabled() and p.requires_grad):
            return p
        alias = _Use.apply(p, self, call, pid)
        self._aliases[(id(call), pid)] = alias
        return alias

    def _bound_by_active(self, pid):
        """Bound by a call whose forward is running (unbound only after this read's backward), not only held by a
        finished one (Note [Holding parameters where everything fits] in _hooks.py): such a read binds for itself."""
        return any(c is not None and pid in c.pids for _, c, _ in reversed(self.active))

    def poison_context(self):
        """Where a missed read happened, for the poison error: the module whose own forward code ran it
        (every forward start and end checks, so it is the innermost forward running)."""
        if not self.active:
            return ""
        module = self.active[-1][0]
        path = next((n for n, m in self.w.model.named_modules() if m is module), "")
        return (f" The read happened in the forward of {path or 'the root module'!r} (class "
                f"{type(module).__name__}), not through attribute access (module.weight), which strata "
                f"binds by itself: read it as an attribute there, or add {type(module).__name__!r} to the wrap "
                "config's \"bind_subtree\" list.")

    def released(self, call, pid):
        """Backward is past every use of a lazily bound parameter (Note [Parameters read by another
        module]): unbind it now rather than with the rest of its call."""
        if pid in call.pids:
            call.pids = [x for x in call.pids if x != pid]
            if call.bound:
                self.w.engine.unbind(pid)

    # --- state_dict (Note [state_dict of a wrapped model]) -----------------------------------

    def _value(self, pid, state_dict):
        w = self.w
        try:
            ref = weakref.ref(state_dict)
        except TypeError:
            ref = None
        key = (ref, w._steps)
        if ref is None or self._sd_key is None or self._sd_key[0]() is not state_dict or self._sd_key[1] != w._steps:
            self._sd_key, self._sd_values = key, {}
        cached = self._sd_values.get(pid)
        value = cached() if cached is not None else None
        if value is None:
            p = w.params[pid]
            value = w.engine.read_tensor(pid, _PARAM).to(p.dtype)
            if ref is not None:
                self._sd_values[pid] = weakref.ref(value)
        return value

    def _state_dict_hook(self, module, state_dict, prefix, local_metadata):
        w = self.w
        if w.engine is None:
            return None
        w._settle()  # a backward that raised is discarded first (Note [Failed steps])
        for name, p in module._parameters.items():
            key = prefix + name
            if p is None or id(p) not in w._pid or key not in state_dict or state_dict[key] is p:
                continue  # not strata's, not saved, or keep_vars=True (the Parameter itself)
            state_dict[key] = self._value(w._pid[id(p)], state_dict)
        return None

    # --- load_state_dict (Note [load_state_dict of a wrapped model]) -------------------------

    def load(self, module, state_dict, strict=True):
        w = self.w
        if w.engine is None or getattr(w.model, "_strata_wrapped", None) is None:
            return _ORIGINAL_LOAD(module, state_dict, strict)
        params, buffers = {}, {}  # id -> [original, stand-in, version], one entry per tensor
        slots = []  # (dict, name, id)
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is None or id(p) not in w._pid:
                    continue
                if id(p) not in params:
                    stand_in = w.engine.read_tensor(w._pid[id(p)], _PARAM).to(p.dtype)
                    params[id(p)] = [p, stand_in, stand_in._version]
                slots.append((m._parameters, name, id(p)))
            for name, b in m._buffers.items():
                if b is None:
                    continue
                if id(b) not in buffers:
                    stand_in = b.detach().clone()
                    buffers[id(b)] = [b, stand_in, stand_in._version]
                slots.append((m._buffers, name, id(b)))
        table = {**params, **buffers}
        for d, name, key in slots:
            d[name] = table[key][1]
        replaced = {}
        try:
            result = _ORIGINAL_LOAD(module, state_dict, strict)
        except RuntimeError as e:
            raise RuntimeError(f"strata.torch: load_state_dict refused, nothing was loaded: {e}") from None
        finally:
            for d, name, key in slots:
                if d.get(name) is not table[key][1]:
                    replaced[key] = d.get(name)  # a custom loader put a new tensor there
                d[name] = table[key][0]
        with torch.no_grad():
            for key, (p, stand_in, version) in params.items():
                new = replaced.get(key, stand_in)
                if new is not stand_in or stand_in._version != version:
                    w.engine.write_tensor(w._pid[key], _PARAM, new)
            for key, (b, stand_in, version) in buffers.items():
                new = replaced.get(key, stand_in)
                if new is not stand_in or stand_in._version != version:
                    b.copy_(new)
        return result

    # --- copy and pickle (Note [Copying a wrapped model]) ------------------------------------

    def plain_copy(self, module, memo):
        w = self.w
        memo = {} if memo is None else memo
        ours = {h.id for h in w._handles}
        stash = []
        try:
            for m in module.modules():
                attrs = {k: m.__dict__.pop(k) for k in _ATTRS if k in m.__dict__}
                if m is w.model and m.__dict__.get("forward") is w._forward_wrapper is not None:
                    attrs["forward"] = m.__dict__.pop("forward")  # strata's forward wrapper (Note [Failed steps])
                hooks = {}
                for dname in _HOOK_DICTS:
                    d = m.__dict__.get(dname)
                    if d and any(k in ours for k in d):
                        hooks[dname] = list(d.items())
                        for k in [k for k in d if k in ours]:
                            del d[k]
                stash.append((m, attrs, hooks))
                if w.engine is None:
                    continue
                for p in m._parameters.values():
                    if p is not None and id(p) in w._pid and id(p) not in memo:
                        value = w.engine.read_tensor(w._pid[id(p)], _PARAM).to(dtype=p.dtype, device=p.device)
                        memo[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
            return copy.deepcopy(module, memo)
        finally:
            for m, attrs, hooks in stash:
                m.__dict__.update(attrs)
                for dname, items in hooks.items():
                    d = m.__dict__[dname]
                    d.clear()
                    d.update(items)
