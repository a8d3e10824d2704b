# api/ops.py: the table of strata's public operations, read by scripts/gen-api.
#
# Note [Public operations]
# Every operation that more than one public surface carries -- the C++ API
# (strata::Runtime, which is runtime::Runtime; strata::Config), the C ABI (strata.h,
# src/strata_c.cpp) and strata.torch's engine (_C.Engine, python/src/binding.cpp) --
# is declared once, here: its canonical name, its arguments (name, abstract type),
# what it returns, one doc line (what it does, ownership, whether it blocks, how it
# fails) and the surfaces that carry it. From this table scripts/gen-api writes
# strata.h's prototypes, the C shims in strata_c.cpp and the binding's .def lines,
# each between "generated from api/ops.py" markers; the files are checked in (a
# reader of strata.h sees plain C), and ctest api_ops_generated runs
# `scripts/gen-api --check`, which fails when a generated region differs from what
# the table gives, when a C++ declaration (runtime.hpp, strata.hpp) differs from the
# table's name, argument names or types, or when binding.cpp defines a name the
# table does not know. Adding an operation to a surface is one entry here, then
# `scripts/gen-api`.
#
# Why a Python file rather than an X-macro or JSON: an entry needs multi-line doc
# text and, for a few C shims, a check written in C++ (acquire's enum ranges):
# macro arguments cannot hold commas or quotes comfortably, JSON has no comments
# and no string concatenation. This file is data only (no logic beyond op()), read
# by the Python 3 standard library; nothing runs it at build time.
#
# Names: the C++ API's name is canonical (the name its users read). The C symbol
# is "strata_" + the object's prefix (config_, lease_; none for the runtime) + the
# name, unless c_name says otherwise and why. A renamed C symbol keeps its old one
# exported as a deprecated alias (c_old): a C ABI must not break silently. The
# engine's Python name (`_C.Engine`) is the canonical one too. For a rename in
# progress, py_method names the Engine method that implements it while engine.hpp
# still uses another name, and py_old keeps an old Python name as an alias; no
# operation uses either today.
#
# Abstract argument types (scripts/gen-api, TYPES, maps them per surface):
#   tensor  TensorId / uint32_t          state   StateKind / strata_state
#   access  Access / strata_access       where   Where / strata_where
#   values  span<const float> / (const float* values, uint64_t count) / a tensor
#   out     span<float> / (float* out, uint64_t count) / returned as a tensor
#   path    const std::string& / const char*   name  std::string / const char*
#   text    std::string_view / const char*     file  const std::filesystem::path& / const char*
#   shape   vector<int64_t> / (const int64_t* shape, size_t ndim)
#   u32 i64 f32 bool  (bool is int in C)
#   lease   const Lease& / const strata_lease*
#   fn      std::function<void()> / (void (*fn)(void* user), void* user)
# Returns: Status, void, Result<T> (C: a status and T through the pointer named
# c_out), or a plain C++ type. Every C function over a runtime returns a
# strata_status; no C++ exception crosses the ABI (Note [C shims] in
# scripts/gen-api).

C, CPP, PY = "c", "cpp", "py"


def op(name, args="", returns="Status", doc="", surfaces=(CPP, C), **extra):
    """One public operation. args: "name: type, ..." (abstract types above).
    extra: object ("runtime", "config"), static (no handle in C), const (the C
    handle is const), c_name, c_old (deprecated C aliases), c_out (the C name of a
    Result's value), c_doc (C-only detail), c_check (C++ lines replacing the
    generated range checks), c_shim ("gen" or "hand": written in strata_c.cpp),
    c_proto (a C-only function's literal prototype), py_method, py_old."""
    parsed = []
    for a in filter(None, (s.strip() for s in args.split(","))):
        n, t = (x.strip() for x in a.split(":"))
        parsed.append((n, t))
    entry = dict(name=name, args=parsed, returns=returns, doc=" ".join(doc.split()), surfaces=tuple(surfaces),
                 object="runtime", static=False, const=False, c_name=None, c_old=(), c_out="out", c_doc="",
                 c_check=None, c_shim="gen", c_proto=None, py_method=None, py_old=())
    unknown = set(extra) - set(entry)
    assert not unknown, f"op {name}: unknown fields {unknown}"
    entry.update(extra)
    if entry["c_doc"]:
        entry["c_doc"] = " ".join(entry["c_doc"].split())
    return entry


def section(title):
    """A heading in strata.h between groups of operations."""
    return dict(section=title)


OPS = [
    # --- The library and its errors (C only: C++ and Python have Status and exceptions) ---
    op("abi_version", surfaces=(C,), object=None, c_shim="hand", c_proto="uint32_t strata_abi_version(void)",
       doc="""The ABI version of the library that is loaded (STRATA_ABI_VERSION of the headers it was built
       with). A caller built against version N needs a library of version N or newer."""),
    op("last_error", surfaces=(C,), object=None, c_shim="hand", c_proto="const char* strata_last_error(void)",
       doc="""The message of this thread's last failed call ("" when none; a call that returns STRATA_OK clears it).
       Valid until the next call on this thread."""),
    op("status_name", surfaces=(C,), object=None, c_shim="hand",
       c_proto="const char* strata_status_name(strata_status status)",
       doc='"invalid_argument", "out_of_budget", ... ("unknown" for a value that is no strata_status).'),

    # --- Settings (strata::Config) ---
    op("config_new", surfaces=(C,), object=None, c_shim="hand",
       c_proto="strata_status strata_config_new(strata_config** out)",
       doc="New settings with defaults (strata::Config()), owned by the caller (strata_config_free). Fails only "
           "when out of memory."),
    op("from_json_text", "text: text", returns="Result<config>", object="config", static=True, c_shim="hand",
       c_old=("strata_config_from_json",), c_doc="(Named strata_config_from_json before ABI 5.)",
       doc="""Settings from JSON text (the keys of docs/config.md), owned by the caller. Unknown keys, wrong
       types and bad values are refused by name (InvalidArgument). Never blocks."""),
    op("from_json_file", "path: file", returns="Result<config>", object="config", static=True, c_shim="hand",
       c_old=("strata_config_from_file",), c_doc="(Named strata_config_from_file before ABI 5.)",
       doc="""Settings from a JSON file, as from_json_text; NotFound / PermissionDenied name the path,
       InvalidArgument a file that is not regular or larger than 1 MiB. Blocks on the read."""),
    op("set", "key: text, value: text", object="config", c_shim="hand",
       doc="""Sets one setting from text by its key ("budgets.gpu", "optimizer.name", "nvme.dirs" as a comma
       list, ...). InvalidArgument names the key and the value and says what is accepted."""),
    op("config_free", surfaces=(C,), object=None, c_shim="hand",
       c_proto="void strata_config_free(strata_config* config)", doc="Frees settings (NULL is ignored)."),

    # --- The runtime ---
    op("runtime_new", surfaces=(C,), object=None, c_shim="hand",
       c_proto="strata_status strata_runtime_new(const strata_config* config, strata_runtime** out)",
       doc="""Creates a runtime and its device from a copy of `config` (strata::Runtime::create), owned by the
       caller (strata_runtime_free). Blocks while tiers are reserved. Fails: InvalidArgument naming a
       setting, Unavailable (cuda forced, no GPU), the NVMe directory's error."""),
    op("runtime_free", surfaces=(C,), object=None, c_shim="hand",
       c_proto="void strata_runtime_free(strata_runtime* runtime)",
       doc="""Waits for background work and frees everything (NULL is ignored). Leases must be released
       first."""),
    op("register_tensor", "name: name, shape: shape, frozen: bool", returns="Result<tensor>", c_out="id_out",
       c_doc="The id goes to *id_out; frozen is 0 or 1.",
       doc="""Registers a tensor of `shape` (a frozen one gets no gradient and no optimizer states); its id is
       the result. Before the first lease. Fails: InvalidArgument (no elements, a duplicate name),
       FailedPrecondition after the first lease."""),
    op("init_tensor", "tensor: tensor, values: values",
       doc="""Sets a tensor's initial value (as many values as its elements); its optimizer states start at
       zero. Between steps; blocks (may read and write NVMe). Fails: InvalidArgument (unknown id, wrong
       count)."""),
    op("read_tensor", "tensor: tensor, kind: state, out: out", surfaces=(CPP, C, PY),
       doc="""Copies a tensor's state `kind` as fp32 into out (as many values as its elements). Between steps;
       blocks (flushes, may read NVMe). Fails: InvalidArgument (unknown id, wrong count),
       FailedPrecondition (a state this optimizer does not keep)."""),
    op("acquire", "tensor: tensor, kind: state, access: access, where: where", returns="Result<lease>",
       c_check='''if (kind < STRATA_PARAM || kind > STRATA_STATE1 || access < STRATA_READ || access > STRATA_ACCUMULATE ||
    where < STRATA_ON_DEVICE || where > STRATA_ON_HOST) {
  return fail(strata::invalid_argument("strata_acquire: state {}, access {} or where {} out of range",
                                       static_cast<int>(kind), static_cast<int>(access),
                                       static_cast<int>(where)));
}''',
       c_doc="The lease handle goes to *out, owned by the caller (strata_lease_release).",
       doc="""Pins state `kind` of a tensor on `where` and returns a lease on it. Blocks only for CPU work the
       chunk depends on or for a free slot. Fails: InvalidArgument (bad id or kind), FailedPrecondition (a
       second write lease, a frozen tensor's grad), OutOfBudget (every slot pinned)."""),
    op("lease_data", surfaces=(C,), object=None, c_shim="hand",
       c_proto="void* strata_lease_data(const strata_lease* lease)",
       doc="""The lease's first element (Lease::data(): device memory on STRATA_ON_DEVICE; host-addressable on
       the sim device); NULL for a NULL lease."""),
    op("lease_numel", surfaces=(C,), object=None, c_shim="hand",
       c_proto="uint64_t strata_lease_numel(const strata_lease* lease)",
       doc="Elements the lease covers (Lease::numel()); 0 for a NULL lease."),
    op("lease_release", surfaces=(C,), object=None, c_shim="hand",
       c_proto="void strata_lease_release(strata_lease* lease)",
       doc="Releases the pin (Lease::release()) and frees the handle (NULL is ignored)."),
    op("launch", "fn: fn",
       c_doc="fn must not longjmp out.",
       doc="""Runs fn on the compute stream, after the work of the leases taken so far; its time counts as
       compute. Does not wait for fn. Fails with the device's error."""),
    op("step", returns="Result<stats>", surfaces=(CPP, C, PY), c_shim="hand",
       c_doc="""*out (may be NULL) receives its figures. out_size is sizeof(strata_step_stats) as the caller's
       header declares it: only that many bytes are written. A size smaller than the first published struct
       (ABI 1, up to nvme_bytes) is refused with STRATA_INVALID_ARGUMENT before the step runs.""",
       doc="""Ends the step: runs or waits for every optimizer step, re-plans after the warm-up step. Blocks.
       Fails with the first background error (an NVMe EIO, a corrupt chunk); the last completed step's state
       is intact and abort_step discards this one."""),
    op("abort_step", surfaces=(CPP, C, PY), c_doc="(C: ABI 5.)",
       doc="""Discards the step in progress (Note [Failed steps]): waits for background work and launched
       compute, drops the step's gradients, forgets its trace and clears the runtime's error, so the next step
       starts clean. Blocks. Fails: FailedPrecondition while leases are held (release them first)."""),
    op("flush", surfaces=(CPP, C, PY),
       doc="""Waits until the last step's states are on their home tiers (NVMe write-backs outlive step).
       Returns the first background error. Blocks. read_tensor and freeing the runtime flush by
       themselves."""),
    op("write_chrome_trace", "path: path", surfaces=(CPP, C, PY), const=True, c_old=("strata_write_trace",),
       c_doc="(Named strata_write_trace before ABI 5.)",
       doc="""Writes the Chrome trace (chrome://tracing, Perfetto) of the recorded timeline to `path`. Blocks on
       the write. Fails: the file's error, naming the path."""),

    section("For training frameworks (the torch binding uses these)"),
    op("wait", "lease: lease", c_name="strata_lease_wait",
       doc="""Blocks until a lease's memory holds its tensor, for math run on the calling thread instead of
       launch (torch CPU ops on the sim device). The lease stays valid. Fails with the device's error."""),
    op("begin_micro_batch", "last: bool", surfaces=(CPP, C, PY),
       doc="""Starts a micro-batch: with last false no optimizer runs and gradients are kept for the next
       micro-batch to add to (access accumulate). Fails: FailedPrecondition while leases are held."""),
    op("no_gradient", "tensor: tensor", c_doc="(C: ABI 5.)",
       doc="""Declares that `tensor` gets no gradient in this micro-batch (its branch was unused), so its
       family's gradients may complete before step; a later write of its gradient in this micro-batch is
       refused. Fails: InvalidArgument (unknown id), FailedPrecondition (frozen, gradient already handed over
       or declared absent, data parallelism)."""),
    op("set_grad_scale", "scale: f32", returns="void", surfaces=(CPP, C, PY),
       c_check='''if (!std::isfinite(scale) || scale <= 0.0f)
  return fail(strata::invalid_argument("strata_set_grad_scale: scale {} must be finite and > 0", scale));''',
       c_doc="STRATA_INVALID_ARGUMENT for a scale that is not finite and > 0.",
       doc="""Multiplies every gradient by scale (1/loss_scale) from the next optimizer step on; set it before
       backward."""),
    op("set_tensor_group", "tensor: tensor, group: u32", surfaces=(CPP, C, PY),
       doc="""Puts a tensor in parameter group `group` (< 65536; 0 by default; Note [Parameter groups]). Before
       the first lease and between steps. Fails: InvalidArgument (unknown id, group too large)."""),
    op("add_to_working_set", "tensor: tensor, set: u32", surfaces=(CPP, PY),
       doc="""Declares that `tensor` is leased together with the other tensors of working set `set` (a torch
       module's parameters and its ancestors'): every plan keeps a GPU chunk slot for each family of the largest
       set, and one for a gradient (Note [Working sets]). Before the first acquire or init; later ones count
       from the next plan. Fails: InvalidArgument (unknown id)."""),
    op("set_group_hyper", "group: u32, lr: f32, weight_decay: f32", surfaces=(CPP, C, PY),
       doc="""Sets a group's lr and weight decay (finite, >= 0), overriding the optimizer's; the values in
       effect when a family's optimizer starts are used. Between step and the next backward;
       FailedPrecondition otherwise, InvalidArgument for a bad value."""),
    op("write_tensor", "tensor: tensor, kind: state, values: values", surfaces=(CPP, C, PY),
       doc="""Overwrites state `kind` of a tensor (param, master, state0/1; not grad) from fp32 values (as many
       as its elements; a checkpoint's load). Between steps; blocks. Fails: InvalidArgument (unknown id, wrong
       count), FailedPrecondition (leases held, a state it does not have, grad)."""),
    op("tensor_steps", "tensor: tensor", returns="Result<i64>", surfaces=(CPP, C, PY),
       c_doc="The count goes to *out.",
       doc="""The optimizer steps applied to a tensor (its bias-correction step counter). Fails: InvalidArgument
       (unknown id)."""),
    op("set_tensor_steps", "tensor: tensor, steps: i64", surfaces=(CPP, C, PY),
       doc="""Sets a tensor's step counter (>= 0; a checkpoint's load). Between steps. Fails: InvalidArgument
       (unknown id, negative)."""),
    op("save_checkpoint", "dir: path", surfaces=(CPP, C, PY),
       doc="""Writes a crash-safe checkpoint of every tensor's param, master, optimizer states and step counter
       into directory `dir` (created when missing; not inside an NVMe swap directory). A crash or error at any
       point leaves the previous checkpoint there loadable. Between steps; blocks. Fails: InvalidArgument,
       FailedPrecondition (leases held), PermissionDenied / NoSpace / IoError naming the file."""),
    op("begin_checkpoint", "dir: path", surfaces=(CPP, C, PY),
       doc="""Starts a checkpoint of the state as of this call into `dir` and returns at once; training goes on
       while it is written. Between steps; waits for a save still in flight first (returning its error).
       Errors of the background save surface in finish_checkpoint / checkpoint_in_flight and leave the
       previously published checkpoint untouched."""),
    op("finish_checkpoint", surfaces=(CPP, C, PY),
       doc="Waits for the save begun by begin_checkpoint; its outcome (Ok when none). Blocks."),
    op("checkpoint_in_flight", returns="Result<bool>", surfaces=(CPP, C, PY), c_out="in_flight",
       c_doc="*in_flight is 1 while it runs, else 0.",
       doc="""Polls the save begun by begin_checkpoint: true while it runs, else false; its error when it
       failed (finish_checkpoint collects it). Never blocks."""),
    op("load_checkpoint", "dir: path", surfaces=(CPP, C, PY),
       doc="""Loads the checkpoint published in `dir` (chunk size, budgets and placement may differ from the
       saving runtime's). A checkpoint of another model, a newer format, a flipped byte, a truncated file or a
       missing manifest is refused whole, naming the file. Between steps; blocks."""),
    op("describe", returns="std::string", surfaces=(CPP, PY),
       doc='"device sim (...); plan: ..." for a progress line or a log. Never fails.'),
]

# The engine's own calls, which are no runtime operation: how strata.torch binds torch
# parameters' storage, hands gradients over and reports (python/src/engine.hpp).
# binding.cpp writes them by hand; gen-api --check refuses a .def name that is
# neither here nor an operation above.
BINDING_ONLY = (
    "close", "register_param", "adopt", "adopt_unset", "init_many", "family_of", "layout", "restore", "bind",
    "unbind", "bind_many", "unbind_many", "unbind_all", "set_torch_stream", "binds", "hand_grad",
    "gradients_pending", "end_backward", "poison_hits", "device_kind", "separate_master", "materialise",
    "sync_views", "drop_views", "is_view", "counters", "totals",
    "state_range",  # runtime::Runtime::state_range as a (first, count) pair, for strata.torch's state gathers
)
