"""strata.torch and processes: the group a wrapped model shards over, and what wrap() refuses.

Note [Ranks under torchrun]
A script launched by torchrun (or Accelerate, Lightning, a Slurm script) with W > 1 processes calls
torch.distributed.init_process_group(...) and then wrap(model, cfg), as it would for DDP or FSDP.
wrap() takes the group given as `process_group=`, else torch.distributed's default group, and when
it has more than one rank the runtime shards over it: strata's communicator over that group
(_C.TorchComm, Note [Comm over torch.distributed] in python/src/torch_comm.cpp) becomes the runtime's
data-parallel group (Note [Sharded step] in runtime/src/dp/data_parallel.cpp). Each rank then holds
1/W of every family's masters and optimizer states, gradients are reduce-scattered during backward
and averaged over the ranks (as DDP and FSDP average them), params are all-gathered before their
next use, rank 0's initial values are broadcast at the first use, and clipping's norm is exact
across ranks. Losses and params are bit-identical to one process that takes the same global batch
as W micro-batches of gradient accumulation (loss divided by W, as a script accumulating does),
for W a power of two, where dividing by W is exact.
What is refused, each with what to do:
  - WORLD_SIZE > 1 in the environment with no initialised process group and no `process_group=`:
    W processes would train W independent copies without a word;
  - a group whose backend cannot carry host memory (NCCL alone): strata's collectives move host
    buffers (the sim device, and every tier off the GPU); gloo, or "cpu:gloo,cuda:nccl", can;
  - a model that is already DistributedDataParallel or FSDP (FSDP1's class, FSDP2's fully_shard),
    and, at the first forward, a wrapped model called from inside their forward (a wrapper put
    around it after wrap()): their reducers and shards would read and reduce what strata owns.
    That check looks only while torch.distributed has an initialised group, so single-process
    scripts pay nothing.
A group of one rank (init_process_group with world_size 1, or a one-rank subgroup given as
`process_group=`) is the single-process case.
Ranks share a node: unless the config sets "threads", a rank's CPU workers are the node's cores /
LOCAL_WORLD_SIZE (torchrun's), at least 1; budgets.host and budgets.nvme are the node's, and each
rank's runtime gets 1/LOCAL_WORLD_SIZE of them, unless "budgets_per": "rank" says the config's are
each rank's own (per_rank_budgets). budgets.gpu is a rank's (one device each).
"""

import os
import sys

import torch

from . import _C

_WHAT_TO_DO = ("Put no data-parallel wrapper around the model: strata shards it over the process group itself "
               "(Note [Ranks under torchrun] in strata/torch/_processes.py).")

# Backends of a group whose collectives carry CPU tensors.
_HOST_BACKENDS = ("gloo", "mpi")

# The frames above the model's forward that DistributedDataParallel's or FSDP's forward can be in:
# DDP.forward -> _run_ddp_forward -> module(...) -> _call_impl -> forward wrapper (torch 1.13 to 2.x).
_FRAMES_UP = 12


def _world_size_env():
    text = os.environ.get("WORLD_SIZE")
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"strata.torch.wrap: WORLD_SIZE = {text!r} in the environment is not an integer; "
                         "unset it, or set it to the job's number of processes") from None


def _dist():
    """torch.distributed where it is built and has an initialised default group, else None."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed


_WRAPPER_CLASSES = None


def _parallel_wrapper_classes():
    """The classes of torch's data-parallel wrappers this torch has (DDP, FSDP1, FSDP2's mixin)."""
    global _WRAPPER_CLASSES
    if _WRAPPER_CLASSES is not None:
        return _WRAPPER_CLASSES
    classes = [torch.nn.parallel.DistributedDataParallel]
    if torch.distributed.is_available():
        # torch 1.13's FSDP does not import under Python 3.11 (a dataclass with a mutable default
        # raises ValueError): there is no FSDP to refuse then.
        try:
            from torch.distributed.fsdp import FullyShardedDataParallel
            classes.append(FullyShardedDataParallel)
        except (ImportError, ValueError):
            pass
        for where in ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"):
            try:
                module = __import__(where, fromlist=["FSDPModule"])
                classes.append(module.FSDPModule)
                break
            except (ImportError, AttributeError, ValueError):
                continue
    _WRAPPER_CLASSES = tuple(classes)
    return _WRAPPER_CLASSES


def _backend_of(group):
    """The group's backend as torch names it ("gloo", "nccl", "cpu:gloo,cuda:nccl", ...)."""
    return str(torch.distributed.get_backend(group)).lower()


def shard_group(model, process_group):
    """The torch.distributed group wrap() shards `model` over, or None for one process; refuses what
    Note [Ranks under torchrun] names."""
    env = _world_size_env()
    if process_group is not None and not torch.distributed.is_available():
        raise RuntimeError("strata.torch.wrap: process_group= was given, but this torch is built without "
                           "torch.distributed")
    dist = _dist()
    if env is not None and env > 1 and dist is None and process_group is None:
        raise RuntimeError(
            f"strata.torch.wrap: WORLD_SIZE = {env} (set by torchrun or your launcher) but torch.distributed has "
            "no initialised process group, so each process would train its own copy of the model on its own "
            "batches. Call torch.distributed.init_process_group(\"gloo\") before strata.torch.wrap (strata then "
            "shards the model over the group), or run one process")
    wrappers = _parallel_wrapper_classes()
    for name, module in model.named_modules():
        if isinstance(module, wrappers):
            where = f"its submodule {name!r}" if name else "the model"
            raise TypeError(f"strata.torch.wrap: {where} is a {type(module).__name__}: strata owns the parameters, "
                            "their gradients and the optimizer states, and a data-parallel wrapper around them "
                            f"would reduce and shard what strata holds. Wrap the plain model. {_WHAT_TO_DO}")
    group = process_group
    if group is None:
        if dist is None:
            return None
        group = dist.distributed_c10d._get_default_group()
    if torch.distributed.get_world_size(group) <= 1:
        return None
    backend = _backend_of(group)
    if not any(b in backend for b in _HOST_BACKENDS):
        raise RuntimeError(
            f"strata.torch.wrap: the process group's backend is {backend!r}, which carries CUDA tensors only; "
            "strata reduces gradients and gathers params in host memory (the sim device, and every chunk off the "
            "GPU). Initialise the group with backend \"gloo\", or \"cpu:gloo,cuda:nccl\" (torch 2.x), or pass "
            "a gloo group as process_group=")
    return group


def rank_in(group):
    """This process's rank in `group`."""
    return torch.distributed.get_rank(group)


def ranks_in(group):
    """The number of ranks in `group`."""
    return torch.distributed.get_world_size(group)


def local_threads(config):
    """The CPU workers of one rank when the config leaves "threads" out: the node's cores over the ranks
    on this node (LOCAL_WORLD_SIZE), at least 1 (Note [Ranks under torchrun])."""
    if "threads" in config:
        return None
    local = _local_world_size()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // local)


def per_rank_budgets(config):
    """The config a rank's runtime gets: budgets.host and budgets.nvme, which the wrap config gives per node
    (the node's memory and disk, shared by its ranks), divided by LOCAL_WORLD_SIZE, unless "budgets_per":
    "rank" says they are a rank's own already (Note [Ranks under torchrun]). budgets.gpu is always a rank's
    (one device each). A config without the group is returned unchanged."""
    per = config.get("budgets_per", "node")
    if per not in ("node", "rank"):
        raise ValueError(f"strata.torch.wrap: budgets_per = {per!r}: must be \"node\" (budgets.host and "
                         "budgets.nvme are the node's, shared by its ranks) or \"rank\" (each rank's own)")
    budgets = config.get("budgets")
    if per == "rank" or not isinstance(budgets, dict):
        return config
    local = _local_world_size()
    if local == 1:
        return config
    from ._layout import parse_bytes
    shared = dict(budgets)
    for key in ("host", "nvme"):
        value = parse_bytes(shared.get(key))
        if value is not None:
            shared[key] = value // local
    return dict(config, budgets=shared)


def _local_world_size():
    text = os.environ.get("LOCAL_WORLD_SIZE", "1")
    try:
        return max(1, int(text))
    except ValueError:
        raise ValueError(f"strata.torch.wrap: LOCAL_WORLD_SIZE = {text!r} in the environment is not an "
                         "integer") from None


def comm_timeout_ms(config):
    """The wrap config's comm.timeout_s (default 60 s) in milliseconds: how long a collective waits for the
    other ranks (Note [Peer failure] in comm/include/strata/comm/communicator.hpp)."""
    comm_cfg = config.get("comm", {})
    if not isinstance(comm_cfg, dict) or set(comm_cfg) - {"timeout_s"}:
        raise ValueError(f"strata.torch.wrap: comm = {comm_cfg!r}: the one key is timeout_s (seconds a collective "
                         "may wait for the other ranks)")
    timeout_s = comm_cfg.get("timeout_s", 60)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86400:
        raise ValueError(f"strata.torch.wrap: comm.timeout_s = {timeout_s!r}: must be a number of seconds in "
                         "(0, 86400]")
    return max(1, int(timeout_s * 1000))


def make_comm(group, config):
    """strata's communicator over `group` (_C.TorchComm), rank-ordered sums, comm.timeout_s."""
    return _C.TorchComm(group, timeout_ms=comm_timeout_ms(config), deterministic=True)


# Note [Averaged gradients in torch]
# DDP's contract is that p.grad holds the average over the ranks once backward is done, so that
# torch code between backward and step() (clip_grad_norm_, a logged norm, Hugging Face Trainer)
# sees what one process with the whole batch would. Where strata keeps gradients in torch (Note
# [Gradients in torch]: "grad_reads": true, or the first step of "auto"), the step's last backward
# therefore ends (autograd's final callback) with average_grads: every trainable p.grad becomes the
# exact average, the sum over ranks in rank order (the communicator's reduce-scatter, then an
# all-gather) times 1/W, per dtype, bit for bit what one process accumulating the W micro-batches
# (loss / W) holds in p.grad when W is a power of two. A parameter with no gradient on some rank
# counts as zeros there, and has the average on every rank (as with DDP); one with no gradient on
# any rank keeps None. At step() the runtime reduces once more, as it does any gradient handed to
# it, so the average is handed so that this reduction gives it back unchanged: rank 0 hands W
# times p.grad (exact), the others -0.0 (x + -0.0 is x for every x), and the runtime's rank-ordered
# sum times 1/W is p.grad again (kept_grad_to_hand). Reading gradients in torch under data
# parallelism thus costs an all-reduce of the gradients in torch on top of the runtime's
# reduce-scatter; with "grad_reads": false (or "auto" after a first step that read none) p.grad
# is a placeholder and nothing extra moves. Parameters outside the optimizer (frozen for strata)
# keep this rank's own gradient in p.grad.


def average_grads(comm, params, frozen, kept):
    """Replaces each trainable p.grad with the exact average over the ranks (Note [Averaged gradients in
    torch]); kept(g) says whether p.grad holds a torch gradient (not None, not strata's placeholder).
    Every rank calls it at the same point, with the same parameters."""
    world = comm.size
    trainable = [p for p, f in zip(params, frozen) if not f]
    grads = [p.grad if kept(p.grad) else None for p in trainable]
    present = comm.all_reduce([0.0 if g is None else 1.0 for g in grads], "max")
    by_dtype = {}
    for p, g, has in zip(trainable, grads, present):
        if has:
            by_dtype.setdefault(p.dtype, []).append((p, g))
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        total = sum(p.numel() for p, _ in group)
        count = (total + world - 1) // world
        flat = torch.zeros(count * world, dtype=dtype)
        offset = 0
        for p, g in group:
            n = p.numel()
            if g is not None:
                flat[offset:offset + n].copy_(g.detach().reshape(-1))
            offset += n
        mine = torch.empty(count, dtype=dtype)
        comm.reduce_scatter(flat, mine)
        comm.all_gather(mine, flat)
        flat.mul_(1.0 / world)
        offset = 0
        for p, g in group:
            n = p.numel()
            value = flat[offset:offset + n].view(p.shape).to(p.device)
            if g is None:
                p.grad = value.clone()
            else:
                g.detach().copy_(value)
            offset += n


def sum_over_ranks(comm, tensors):
    """Each fp32 CPU tensor becomes the sum over the ranks of its values, in rank order (exact where at most
    one rank's value is not -0.0: Note [Optimizer states across ranks] in _optim_state.py). Collective."""
    if not tensors:
        return
    world = comm.size
    total = sum(t.numel() for t in tensors)
    count = (total + world - 1) // world
    flat = torch.full((count * world,), -0.0, dtype=torch.float32)
    torch.cat([t.reshape(-1) for t in tensors], out=flat[:total])
    mine = torch.empty(count, dtype=torch.float32)
    comm.reduce_scatter(flat, mine)
    comm.all_gather(mine, flat)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view(t.shape))
        offset += n


def kept_grad_to_hand(comm, g):
    """What this rank hands the runtime for an averaged gradient g (Note [Averaged gradients in torch])."""
    if comm.rank == 0:
        return g * float(comm.size)
    return torch.full_like(g, -0.0)


def check_not_inside_parallel_wrapper(model):
    """Refuses a forward called by DistributedDataParallel's or FSDP's forward (Note [Ranks under torchrun]);
    looks only while torch.distributed has an initialised group."""
    if _dist() is None:
        return
    wrappers = _parallel_wrapper_classes()
    frame = sys._getframe(1)
    for _ in range(_FRAMES_UP):
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        if isinstance(owner, wrappers) and owner is not model:
            raise TypeError(f"strata.torch: a wrapped model was called by {type(owner).__name__}'s forward: put "
                            "no data-parallel wrapper (DistributedDataParallel, FSDP, fully_shard) around a "
                            "model given to strata.torch.wrap; strata owns its parameters, gradients and "
                            f"optimizer states. {_WHAT_TO_DO}")
        frame = frame.f_back
