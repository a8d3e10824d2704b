"""strata.torch and processes: what wrap() refuses while strata.torch runs in one process.

Note [One process]
strata.torch shards nothing across processes yet (issue #48: a communicator over the user's
torch.distributed group is the plan; docs/decisions.md D39).
A script launched by torchrun with W > 1 processes would otherwise train W independent copies of
the model, each on its own batches, and never say so: a silent wrong answer. So wrap() refuses:
  - WORLD_SIZE > 1 in the environment (torchrun, Accelerate, a Slurm script) with or without an
    initialised process group;
  - an initialised default group, or a `process_group=` argument, of more than one rank;
  - a model that is already DistributedDataParallel or FSDP (FSDP1's class, FSDP2's fully_shard).
And the first forward refuses a wrapped model called from inside DistributedDataParallel's or
FSDP's forward (a wrapper put around it after wrap()): their reducers and shards read the
parameters and gradients that strata owns. That check looks only when torch.distributed has an
initialised group (neither wrapper runs without one), so single-process scripts pay nothing.
A group of one rank (init_process_group with world_size 1) is the single-process case and trains.
"""

import os
import sys

import torch

_ISSUE = ("strata.torch runs in one process today: it cannot shard a model across the processes of a "
          "torch.distributed job yet (issue #48), and each process would train its own copy on its own "
          "batches without a word.")
_WHAT_TO_DO = ("Run one process (`python train.py`, or `torchrun --nproc_per_node 1`), or shard with the C++ "
               "runtime over MPI (docs/architecture.md, data parallelism).")

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


def check_world(model, process_group):
    """Refuses a job of more than one process, and a model inside DDP or FSDP (Note [One process])."""
    env = _world_size_env()
    if env is not None and env > 1:
        dist = _dist()
        group = "an initialised process group" if dist is not None else "no initialised process group"
        raise RuntimeError(f"strata.torch.wrap: WORLD_SIZE = {env} (set by torchrun or your launcher), with "
                           f"{group}. {_ISSUE} {_WHAT_TO_DO}")
    if process_group is not None:
        if not torch.distributed.is_available():
            raise RuntimeError("strata.torch.wrap: process_group= was given, but this torch is built without "
                               "torch.distributed")
        size = torch.distributed.get_world_size(process_group)
        if size > 1:
            raise RuntimeError(f"strata.torch.wrap: process_group= has {size} ranks. {_ISSUE} {_WHAT_TO_DO}")
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        raise RuntimeError(f"strata.torch.wrap: torch.distributed's default group has {dist.get_world_size()} "
                           f"ranks (this is rank {dist.get_rank()}). {_ISSUE} {_WHAT_TO_DO}")
    wrappers = _parallel_wrapper_classes()
    for name, module in model.named_modules():
        if isinstance(module, wrappers):
            where = f"its submodule {name!r}" if name else "the model"
            raise TypeError(f"strata.torch.wrap: {where} is a {type(module).__name__}: strata owns the parameters, "
                            "their gradients and the optimizer states, and a data-parallel wrapper around them "
                            f"would reduce and shard what strata holds. Wrap the plain model. {_WHAT_TO_DO}")


def check_not_inside_parallel_wrapper(model):
    """Refuses a forward called by DistributedDataParallel's or FSDP's forward (Note [One process]);
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
