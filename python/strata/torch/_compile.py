"""strata.torch under torch.compile (issue #27).

Note [torch.compile]
strata's work happens in hooks: module forward pre-/post-hooks bind and unbind parameters
(Note [Hooks] in _hooks.py), tensor hooks rebind them when backward reaches a module, and the
gradient hooks hand each gradient over. TorchDynamo inlines module hooks into the graph it
traces. Left alone it traces them too: their Python side effects are replayed after the graph
runs instead of when the module runs, so a parameter is read while it points at its poison
region (the poison check then fails, naming parameters that were never misused) and dynamo's
own bookkeeping can fail on strata's state. So every hook strata installs is marked with
dynamo's disable (eager() below): dynamo never traces it, and where compiled code calls one,
the graph breaks there and the hook runs eagerly, at the point in the forward where torch alone
runs it. A compiled model thus runs as one graph per stretch of code between strata's hooks
(a module's own computation, the code between two modules), each reading its parameters while
they are bound, and its backward runs each graph's backward between the hooks that bind and
unbind, as in eager mode. What this gives and what is refused is in docs/torch.md
("torch.compile"); tests/torch/test_compile.py checks every case against torch alone.

Hooks cost nothing until something compiles (#29). dynamo's disable wrapper costs about 7.5 µs
per hook call on torch 2.11 even where nothing is compiled, so module hooks are registered
through forward_pre_hook()/forward_hook() below: plain functions at first, each handle noted.
dynamo runs its start callbacks (torch._dynamo.callback_handler) before it traces any frame;
strata's callback swaps every noted hook, in place in its module's hook dict (same key, same
order), for its eager() version, and every hook registered later is eager() at once
(torch._dynamo.reset() drops dynamo's callbacks: each wrap and each root forward registers it again
where it is missing, _rewatch()). So the
first trace already sees the disabled hooks, as if they had been disabled from wrap() on, and a
process that never compiles never pays for the wrapper. A trace is not the only way in: compiled
code that calls a module whose _call_impl dynamo does not trace (torch.compile(model) enters the
root's hooks from eager frames with dynamo's frame callback on) would compile the plain hook as a
frame of its own, before any callback of ours could run. So each plain hook's code is also marked
to be skipped by dynamo with everything it calls (set_code_exec_strategy(SKIP, SKIP), the C-level
flag that costs nothing where nothing compiles): entered that way, it runs eagerly as a disabled
one would. A torch without the callback or the flag (older than 2.6) gets eager() hooks from the
start, as before. The swap is one-way: dynamo's compiled
code guards on the hooks it saw, which never change again.

Compiled autograd (torch._dynamo.config.compiled_autograd) traces backward itself, tensor
and gradient hooks included; strata refuses it at the start of backward (check_backward()).

torch 1.x has no torch.compile: eager() returns the function itself and nothing changes.
"""

import weakref

import torch

_HAS_COMPILE = hasattr(torch, "compile")


def eager(fn):
    """fn, never traced by TorchDynamo: a graph break where compiled code calls it (torch >= 2)."""
    if not _HAS_COMPILE:
        return fn
    import torch._dynamo  # noqa: PLC0415 - only where torch.compile exists (torch.optim imports it anyway)

    if not _REFUSE:
        _REFUSE.append(torch._dynamo.disable(_refuse))
    try:
        return torch._dynamo.disable(fn, reason=_REASON)  # shown by fullgraph=True's error
    except TypeError:  # torch < 2.6: no reason=
        return torch._dynamo.disable(fn)


_REASON = ("strata.torch's hooks run eagerly, between torch.compile's graphs (Note [torch.compile] in "
           "strata/torch/_compile.py), so a wrapped model cannot compile to one graph: drop fullgraph=True, or "
           "compile with fullgraph=True only submodules that hold no strata parameter")


_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)


def compiling():
    """Whether TorchDynamo is tracing the caller (a strata hook it should never trace); False on torch 1.x."""
    return _compiling()


def _compiled_autograd_message(where):
    from ._C import StrataError  # noqa: PLC0415 - the extension is loaded by then

    return StrataError(
        f"strata.torch: compiled autograd is on ({where}); it traces backward into a graph, strata's gradient "
        "and backward hooks included, which must run eagerly when backward reaches each module (Note "
        "[torch.compile] in strata/torch/_compile.py). strata got no gradient of this backward. Turn it off "
        "(torch._dynamo.config.compiled_autograd = False, no torch._dynamo.compiled_autograd._enable(...) "
        "around backward), zero the gradients and run forward and backward again; torch.compile of the model "
        "itself works with it off (docs/torch.md, \"torch.compile\")")


def check_forward():
    """At the root module's forward (eager): refuses compiled autograd when it is already switched on."""
    import sys  # noqa: PLC0415

    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:  # never imported: nothing can compile
        return
    _rewatch()  # torch._dynamo.reset() since the wrap
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    if dynamo.config.compiled_autograd:
        raise _compiled_autograd_message("torch._dynamo.config.compiled_autograd = True")
    if ca is not None and ca.compiled_autograd_enabled:
        raise _compiled_autograd_message("torch._dynamo.compiled_autograd._enable(...) is active")


def _refuse():
    raise _compiled_autograd_message("it traced a strata backward hook")


_REFUSE = []  # [eager(_refuse)], made at the first hook registration (wrap): importing dynamo takes seconds


def refuse_traced_backward():
    """Called by a backward hook that TorchDynamo traces: the graph breaks here and the refusal runs eagerly."""
    _REFUSE[0]()


def poison_hint():
    """For the poison error (a parameter read while unbound): what torch.compile has to do with it."""
    import sys  # noqa: PLC0415

    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None or not utils.counters["stats"]["unique_graphs"]:
        return ""
    return (" torch.compile has compiled code in this process: compiled code reads a parameter directly, not "
            "through the attribute access that lets strata bind one used outside the module that owns it (Note "
            "[Parameters read by another module] in strata/torch/_state.py). Compile only submodules that use "
            "their own parameters, or run this model without torch.compile (docs/torch.md, \"torch.compile\").")


_SWAPPED = [not _HAS_COMPILE]  # [True] once hooks are eager(); torch 1.x: nothing to swap
_PLAIN = []  # (handle, weak reference to the plain hook) registered before the swap: weak, so that a wrapped
# model nobody closed is freed with its modules, as before
_EAGER = {}  # plain hook -> its eager() version (one wrapper per hook, shared by modules)


def _eager_of(fn):
    e = _EAGER.get(fn)
    if e is None:
        e = _EAGER[fn] = eager(fn)
    return e


def _on_compile_start(*unused):
    """dynamo's start callback (Note [torch.compile]): before the first trace, every plain hook
    becomes its eager() version, in place."""
    if _SWAPPED[0]:
        return
    _SWAPPED[0] = True
    for handle, ref in _PLAIN:
        fn, hooks = ref(), handle.hooks_dict_ref()
        if fn is not None and hooks is not None and hooks.get(handle.id) == fn:  # == : a bound method anew
            hooks[handle.id] = _eager_of(fn)
    _PLAIN.clear()
    _EAGER.clear()


def _watch_compiles():
    """Registers _on_compile_start once (the first wrap); without dynamo's callbacks, swaps at once."""
    if not _HAS_COMPILE or _WATCHING:
        return
    import torch._dynamo  # noqa: PLC0415 - importing dynamo takes seconds: only once something is wrapped

    if not _REFUSE:  # made here, eagerly: refuse_traced_backward() runs inside a trace
        _REFUSE.append(torch._dynamo.disable(_refuse))
    global _skip_recursively  # noqa: PLW0603 - once per process
    _skip_recursively = _skip_recursive_setter()
    _WATCHING.append(True)
    if _SWAPPED[0]:
        return

    handler = getattr(torch._dynamo, "callback_handler", None)
    if (handler is None or not hasattr(handler, "register_start_callback") or
            not isinstance(getattr(handler, "start_callbacks", None), list) or _skip_recursively is None):
        _on_compile_start()  # no way to see a compile coming: eager() hooks from the start
        return
    _HANDLER.append(handler)
    _rewatch()


_HANDLER = []  # [dynamo's callback_handler] once watching


def _rewatch():
    """(Re-)registers _on_compile_start where it is missing: torch._dynamo.reset() clears dynamo's callbacks,
    so a process that resets dynamo after a wrap (tests, notebooks) would never see its next compile and its
    plain hooks would be traced. Called at each hook registration (wrap) and each root forward
    (check_forward()): a list lookup."""
    if _SWAPPED[0] or not _HANDLER:
        return
    if _on_compile_start not in _HANDLER[0].start_callbacks:
        _HANDLER[0].register_start_callback(_on_compile_start)


def _skip_recursive_setter():
    """set_code_exec_strategy(code, SKIP this frame and every frame it calls), or None (torch < 2.6)."""
    if not _HAS_COMPILE:
        return None
    try:
        from torch._C._dynamo.eval_frame import set_code_exec_strategy  # noqa: PLC0415
        from torch._dynamo.types import FrameAction, FrameExecStrategy  # noqa: PLC0415
    except ImportError:
        return None
    return lambda code: set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


_skip_recursively = None  # set by _watch_compiles (importing dynamo takes seconds)


_WATCHING = []


def _register(register, fn):
    _watch_compiles()
    _rewatch()
    if _SWAPPED[0]:
        return register(eager(fn))  # eager() is fn itself on torch 1.x
    _skip_recursively(getattr(fn, "__func__", fn).__code__)  # entered from compiled code: eager, and its callees
    handle = register(fn)
    if len(_PLAIN) > 64 and len(_PLAIN) & (len(_PLAIN) - 1) == 0:  # now and then: drop the closed ones
        _PLAIN[:] = [(h, f) for h, f in _PLAIN
                     if f() is not None and h.hooks_dict_ref() is not None and h.id in h.hooks_dict_ref()]
    _PLAIN.append((handle, weakref.WeakMethod(fn) if hasattr(fn, "__func__") else weakref.ref(fn)))
    return handle


def forward_pre_hook(module, fn):
    """module.register_forward_pre_hook(fn): plain until torch.compile is first seen, then eager(fn)
    (Note [torch.compile]). Returns the handle."""
    return _register(module.register_forward_pre_hook, fn)


def forward_hook(module, fn):
    """module.register_forward_hook(fn), as forward_pre_hook()."""
    return _register(module.register_forward_hook, fn)


def hooks_swapped():
    """Whether strata's module hooks are eager() now (a compile was seen, or no callback to see one)."""
    return _SWAPPED[0]


def skip_frames(*fns):
    """Dynamo compiles no frame of these functions (called from eager code, strata's attribute-access path would
    otherwise be compiled as frames of its own: a recompile per parameter, then dynamo's recompile limit); unlike
    eager(), no wrapper, so eager mode pays nothing. Nothing on torch 1.x or a torch without skip_code."""
    if not _HAS_COMPILE:
        return
    import torch._dynamo  # noqa: PLC0415

    skip = getattr(getattr(torch._dynamo, "eval_frame", None), "skip_code", None)
    if skip is None:
        return
    for fn in fns:
        skip(fn.__code__)
