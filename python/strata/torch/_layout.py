"""Chunk sizes for strata.torch by the runtime's own search (issue #28).

Note [Chunk search bounds]
With layout.chunk_elems 0 (the default) the runtime searches, between
layout.chunk_elems_min and layout.chunk_elems_max, for the chunk size with the least
padding (runtime/plan/layout.cpp). Its default bounds (2^20 .. 2^26 elements) suit
large models on a GPU; a small model or a small device budget needs others: a chunk
must leave 3 slots within budgets.gpu, and a minimum above the model's size leaves
one chunk, mostly padding. So unless the config sets them, strata.torch passes
  - chunk_elems_min = 4096 (the alignment): the search starts at the largest tensor;
  - chunk_elems_max = the largest power of two with 3 slots within budgets.gpu,
    at most 2^26 (and at least the minimum), or fewer where the planner wants more
    slots (Note [Chunks for a streaming plan]).
A fixed layout.chunk_elems is kept as given (examples no longer compute one).

Note [Chunks for a streaming plan]
Three slots are what a plan needs to run, not what it needs to overlap: the planner
wants 2 + 2 x plan.prefetch_depth_max slots (10 by default; runtime/plan/planner.cpp)
and prefetches min(depth, slots - 2) uses ahead. Bounded by three slots alone, the
search packed bench/torch_gpt.py's 25 M GPT, offloaded at a quarter of its state,
into 4 chunks with 3 slots and a prefetch depth of 1: each use of a quarter of the
model waited for its read, 0.10 s of a 0.74 s step, and the step took 1.18-1.22 of
torch's alone (seventeenth session). So the maximum prefers the planner's wanted slots:
  - the largest power of two with 2 + 2 x depth slots within budgets.gpu,
  - but not below twice the largest tensor (rounded up to a power of two): a chunk of
    the largest tensor's size leaves the gaps between such tensors as padding (42 % for
    examples/torch_gpt.py's GPT at 64 K elements, 7.8 % with room for two), and none is
    alone in an oversized family that the three-slot bound would have avoided,
  - and never above the three-slot bound.
Where everything fits on the device the plan keeps every chunk resident; the number of
chunks then sets how early in backward strata's optimizer starts (per chunk family whose
gradients are complete), and the search still minimises padding within the range.
"""

import re

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_ALIGN = 4096
_MAX = 1 << 26
_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def parse_bytes(value):
    """An int, or "<number><unit>" as the C++ config reads it; None when neither."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return None


def _pow2_at_most(n):
    return 1 << max(n, 1).bit_length() - 1 if n >= 1 else 0


def _slots_wanted(cfg):
    """The planner's wanted slot count, 2 + 2 x plan.prefetch_depth_max (Note [Chunks for a streaming plan])."""
    plan = cfg.get("plan") if isinstance(cfg.get("plan"), dict) else {}
    if plan.get("prefetch") is False:
        return 3
    depth = plan.get("prefetch_depth_max", 4)
    return 2 + 2 * depth if isinstance(depth, int) and not isinstance(depth, bool) and depth >= 1 else 10


def search_bounds(cfg, compute, largest=None):
    """Sets layout.chunk_elems_min/max in runtime config `cfg` (Note [Chunk search bounds]); `largest`: the
    largest tensor's elements, where known (Note [Chunks for a streaming plan])."""
    layout = cfg.get("layout", {})
    if not isinstance(layout, dict) or layout.get("chunk_elems", 0):
        return cfg
    layout = dict(layout)
    layout.setdefault("chunk_elems_min", _ALIGN)
    if "chunk_elems_max" not in layout:
        gpu = parse_bytes(cfg.get("budgets", {}).get("gpu")) if isinstance(cfg.get("budgets"), dict) else None
        most = _MAX
        if gpu is not None:
            fit = gpu // (3 * _BYTES.get(compute, 4))
            most = _pow2_at_most(fit) if fit >= 1 else _ALIGN
            if largest is not None:
                wanted = _pow2_at_most(gpu // (_slots_wanted(cfg) * _BYTES.get(compute, 4)))
                tensor = 1 << max(int(largest) - 1, 1).bit_length()  # the largest, rounded up
                most = min(most, max(wanted, 2 * tensor, _ALIGN))
        layout["chunk_elems_max"] = max(min(most, _MAX), layout["chunk_elems_min"]
                                        if isinstance(layout["chunk_elems_min"], int) else _ALIGN)
    cfg["layout"] = layout
    return cfg
