"""Deferred init: a model whose parameters are on the meta device is initialised straight into strata.

Note [Deferred init]
A model built on the meta device (`torch.device("meta")`, `device="meta"`) or inside
`strata.torch.init()` (parameters on meta, buffers real) has shapes but no values. wrap()
replaces each meta parameter by a CPU Parameter whose storage is allocated but never
written (untouched pages take no RSS); the engine later points that storage at poison
without copying (Engine.adopt_unset) and takes each module's values from scratch tensors,
handed a chunk family at a time (Engine.init_many, one Runtime::init_tensors: a family
handed whole is written once, an NVMe-homed one without a read first). Torch memory
holds at most one module's scratch parameters plus one family's queued values: peak RSS
is the runtime's own (budgets.host, and device.budget on the sim device) plus about
2 x (the largest module's parameters + one chunk) plus Python/torch's fixed overhead.

The values are torch's eager ones, bit for bit, under this contract:
  1. Pass A replays construction: every module in post-order (children before their
     parent, children in registration order: `model.apply` order, which is the order
     eager construction finishes modules in when children are assigned as they are
     built) that owns parameters gets its `reset_parameters()` (or `_reset_parameters()`)
     called on scratch copies of its own parameters. A parameter tied to one seen
     earlier (head.weight = wte.weight after construction) is reset on a scratch copy
     that is thrown away: eager's reset wrote the module's own, later discarded, tensor,
     so the RNG moves by the same amount.
     A reset may also write its descendants' parameters, as nn.MultiheadAttention's
     zeroes out_proj.bias after out_proj's own reset: eager construction runs the
     parent's reset after its children's, so the parent's values win. The first run
     gives the reset its own parameters only; when the poison check names parameters of
     its descendants, the RNG is put back and the reset runs again with scratch copies
     of those too, holding their values so far, and every copy is written back. A
     parameter outside the module's subtree is refused (below). Pass B does not retry.
  2. Pass B (only with wrap(..., init=fn)) replays the model's own init loop:
     fn(module) for every module in `model.modules()` order (pre-order, as
     `for m in self.modules(): fn(m)` at the end of __init__), or in `model.apply`
     order with init_order="apply" (Hugging Face's post_init uses apply). Each
     module's parameters are read back from strata, given to fn as scratch
     copies, and written back.
  3. The RNG: torch's CPU generator state is captured at wrap() and the passes run from
     it; afterwards the global generator is left where eager construction would leave it
     when nothing drew from it between wrap() and the build (else it is left alone and a
     warning says so). CUDA generators are not replayed (CPU init only).
Refused, with an error naming the module and what to do: a module that owns parameters
but has neither reset_parameters nor an init fn; an init that leaves a parameter unset
(scratch copies start as NaN, and a NaN left after both passes is refused); an init that
touches a parameter outside the module it was called for, or for a reset outside its
subtree (the real parameters are poison during init, the poison check names it); buffers on the meta device (strata
keeps buffers in torch: build them on the CPU, e.g. with strata.torch.init()).
"""

import contextlib
import warnings

import torch

_ORDERS = ("modules", "apply")


class Touched(ValueError):
    """An init used parameters it was not given (`names`); a reset that touched its descendants' runs again with
    them (Note [Deferred init])."""

    def __init__(self, names, message):
        super().__init__(message)
        self.names = list(names)


@contextlib.contextmanager
def init():
    """Builds modules with their parameters on the meta device and their buffers real.

        with strata.torch.init():
            model = Gpt(...)           # no parameter memory; buffers as usual
        model = strata.torch.wrap(model, config, init=Gpt.init_weights)

    Parameters registered while the context is open are replaced by meta tensors of the
    same shape, dtype and requires_grad (Note [Deferred init])."""
    original = torch.nn.Module.register_parameter

    def register_parameter(self, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        return original(self, name, param)

    torch.nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def _post_order(module, seen, out):
    for child in module.children():
        if id(child) not in seen:
            _post_order(child, seen, out)
    if id(module) not in seen:
        seen.add(id(module))
        out.append(module)
    return out


class Deferred:
    """The deferred-init state of one wrapped model (Note [Deferred init])."""

    def __init__(self, model, fn, order):
        if order not in _ORDERS:
            raise ValueError(f"strata.torch.wrap: init_order = {order!r}: must be one of {_ORDERS}")
        if fn is not None and not callable(fn):
            raise TypeError("strata.torch.wrap: init must be a callable taking a module")
        self.model, self.fn, self.order = model, fn, order
        self.rng = torch.get_rng_state()
        self.meta = {}  # id(new Parameter) -> True for the parameters this init owns
        self.pending = True
        self.current = None  # (what, where) while an init runs
        self.queue = []  # (pid, values) of one chunk family, written together (_put)
        self.comm = None  # the data-parallel communicator, set by run()
        for name, b in model.named_buffers():
            if b is not None and b.device.type == "meta":
                raise ValueError(
                    f"strata.torch.wrap: buffer {name!r} is on the meta device; strata takes only parameters, "
                    "so buffers must hold their values: build the model inside strata.torch.init() (parameters "
                    "on meta, buffers real), or register the buffer on the CPU")
        self._replace_meta_params()

    @staticmethod
    def wanted(model):
        return any(p.device.type == "meta" for p in model.parameters())

    def _replace_meta_params(self):
        new_of = {}
        for mname, module in self.model.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is None:
                    continue
                if p.device.type != "meta":
                    raise ValueError(
                        f"strata.torch.wrap: parameter {mname + '.' + pname if mname else pname!r} is on {p.device} "
                        "while others are on the meta device; build every parameter on meta for deferred init "
                        "(Note [Deferred init]) or none")
                q = new_of.get(id(p))
                if q is None:
                    # Allocated, never written: no RSS until strata points it at poison (adopt_unset).
                    q = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                    new_of[id(p)] = q
                    self.meta[id(q)] = True
                module._parameters[pname] = q

    # --- the passes, at the engine's build --------------------------------------------------

    def run(self, w, engine):
        """Initialises every deferred parameter of Wrapped `w` into `engine` (registered, not adopted)."""
        pids = [pid for pid, p in enumerate(w.params) if id(p) in self.meta]
        self.comm = w._comm  # data parallelism: rank 0's values go to every rank (_flush)
        for pid in pids:
            engine.adopt_unset(pid)
        engine.init_many([], [])  # fixes the layout: family_of answers
        before = torch.get_rng_state()
        untouched = torch.equal(before, self.rng)
        torch.set_rng_state(self.rng)
        try:
            done = set()
            for module in _post_order(self.model, set(), []):
                self._reset(w, engine, module, done)
            self._flush(engine)
            if self.fn is not None:
                modules = list(self.model.modules()) if self.order == "modules" else _post_order(self.model, set(), [])
                for module in modules:
                    self._apply_fn(w, engine, module)
                self._flush(engine)
            after = torch.get_rng_state()
        finally:
            torch.set_rng_state(before)
        if untouched:
            torch.set_rng_state(after)
        else:
            warnings.warn("strata.torch: the CPU RNG was used between wrap() and the engine's build; deferred init "
                          "ran from its state at wrap() and left it as it was (Note [Deferred init])")
        self.pending = False

    @staticmethod
    def unset(p):
        """After a failed build: the parameter's storage leaves strata's poison for fresh, unwritten memory
        (deferred init runs again at the next build)."""
        with torch.no_grad():
            p.data = torch.empty(p.shape, dtype=p.dtype)

    def _own(self, w, module):
        out = []
        for pname, p in module._parameters.items():
            if p is not None and id(p) in self.meta and p.numel() > 0:
                out.append((pname, p, w._pid[id(p)]))
        return out

    def _where(self, w, module):
        path = next((n for n, m in self.model.named_modules() if m is module), "")
        return f"module {path or '<root>'!r} ({type(module).__name__})"

    def _reset(self, w, engine, module, done):
        own = self._own(w, module)
        if not own:
            return
        reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
        if reset is None and self.fn is None:
            names = ", ".join(n for n, _, _ in own)
            raise ValueError(
                f"strata.torch.wrap: {self._where(w, module)} owns parameters ({names}) on the meta device but "
                "defines no reset_parameters(), so deferred init cannot give them values. Pass init=fn to "
                "strata.torch.wrap (fn(module) sets a module's own parameters; Note [Deferred init]), add a "
                "reset_parameters() method, or build the model on the CPU")
        rng = torch.get_rng_state()
        below = []  # (submodule, name, Parameter, pid) of descendants the reset writes (Note [Deferred init])
        while True:
            scratch = self._swap_in(module, own, lambda p: torch.full(p.shape, float("nan"), dtype=p.dtype))
            below_scratch = [self._swap_in(sub, [(pname, p, pid)], None, engine=engine)[0]
                             for sub, pname, p, pid in below]
            self.current = ("reset_parameters()", self._where(w, module))
            try:
                try:
                    if reset is not None:
                        with torch.no_grad():
                            reset()
                except Touched as e:  # a torch call on a parameter it was not given (its lazy class)
                    engine.poison_hits()  # rearmed: this run is discarded
                    hits = e.names
                else:
                    hits = engine.poison_hits()
            finally:
                self.current = None
                self._swap_out(module, own)
                for sub, pname, p, pid in below:
                    self._swap_out(sub, [(pname, p, pid)])
            if not hits:
                break
            more = self._descendants_hit(w, module, hits)
            if more is None or {m[3] for m in more} & {b[3] for b in below}:
                self.current = ("reset_parameters()", self._where(w, module))
                raise self.touched(hits)
            below = below + more  # run it again from the same RNG state, those parameters given too
            torch.set_rng_state(rng)
        for (_, _, _, pid), s in zip(below, below_scratch):
            self._put(engine, pid, s)
        for (pname, p, pid), s in zip(own, scratch):
            if pid in done:
                continue  # tied to an earlier module's: eager discarded this reset's values
            done.add(pid)
            if self.fn is None:
                self._check_set(w, module, pname, s, "reset_parameters()")
            self._put(engine, pid, s)

    def _put(self, engine, pid, values):
        """Queues a parameter's values; a family's are handed together (Engine.init_many), so that the
        runtime writes each chunk family once."""
        for i, (queued, _) in enumerate(self.queue):
            if queued == pid:  # a tied parameter set again (pass B): the later value wins
                self.queue[i] = (pid, values.detach())
                return
        if self.queue and engine.family_of(pid) != engine.family_of(self.queue[0][0]):
            self._flush(engine)
        self.queue.append((pid, values.detach()))

    def _current_value(self, engine, pid, dtype):
        for queued, v in self.queue:
            if queued == pid:
                return v.clone()
        return engine.read_tensor(pid, 0).to(dtype)

    def _flush(self, engine):
        if self.queue:
            values = [v for _, v in self.queue]
            if self.comm is not None:
                # The runtime's broadcast of rank 0's params (Note [Sharded step]) ran when the layout was
                # fixed, before these values existed, and init_tensors changes this rank only: so rank 0's
                # values are broadcast here, every rank flushing the same families in the same order.
                values = [v.contiguous().clone() for v in values]
                for v in values:
                    self.comm.broadcast(v, 0)
            engine.init_many([pid for pid, _ in self.queue], values)
            self.queue = []

    def _apply_fn(self, w, engine, module):
        own = self._own(w, module)
        if not own:
            return
        scratch = self._swap_in(module, own, None, engine=engine)
        self.current = ("init", self._where(w, module))
        try:
            with torch.no_grad():
                self.fn(module)
            self._check_poison(w, engine, module, "init")
        finally:
            self.current = None
            self._swap_out(module, own)
        for (pname, p, pid), s in zip(own, scratch):
            self._check_set(w, module, pname, s, "reset_parameters() or init")
            self._put(engine, pid, s)

    def _descendants_hit(self, w, module, hits):
        """The deferred parameters of `module`'s strict descendants named in `hits`, as (submodule, name,
        Parameter, pid); None when a hit is not one of them."""
        found = {}
        for sub in module.modules():
            if sub is module:
                continue
            for pname, p in sub._parameters.items():
                if p is not None and id(p) in self.meta and w.names[w._pid[id(p)]] in hits:
                    found.setdefault(w._pid[id(p)], (sub, pname, p, w._pid[id(p)]))
        named = {w.names[pid] for pid in found}
        return list(found.values()) if all(h in named for h in hits) else None

    def _swap_in(self, module, own, make, engine=None):
        scratch = []
        for pname, p, pid in own:
            value = make(p) if engine is None else self._current_value(engine, pid, p.dtype)
            s = torch.nn.Parameter(value, requires_grad=p.requires_grad)
            module._parameters[pname] = s
            scratch.append(s)
        return scratch

    @staticmethod
    def _swap_out(module, own):
        for pname, p, _ in own:
            module._parameters[pname] = p

    def _check_poison(self, w, engine, module, by):
        hits = engine.poison_hits()
        if hits:
            self.current = (by, self._where(w, module))
            raise self.touched(hits)

    def touched(self, names):
        """The error for an init that used parameters `names` outside its module (self.current: what ran,
        where)."""
        by, where = self.current
        return Touched(
            names,
            f"strata.torch.wrap: {by} of {where} used parameter(s) {', '.join(repr(n) for n in names)} that it does "
            "not own; deferred init "
            "gives each module's init its own parameters only (Note [Deferred init]). Initialise those parameters "
            "in their own module's reset_parameters() or in init=fn when fn is called for that module")

    def _check_set(self, w, module, pname, s, by):
        if s.is_floating_point() and bool(torch.isnan(s).any()):
            raise ValueError(
                f"strata.torch.wrap: parameter {pname!r} of {self._where(w, module)} was not set by {by} "
                "(its scratch copy still holds NaN). Give it a value in the module's reset_parameters() or in "
                "the init=fn passed to strata.torch.wrap (Note [Deferred init])")
