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
    at most 2^26 (and at least the minimum).
A fixed layout.chunk_elems is kept as given (examples no longer compute one).
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


def search_bounds(cfg, compute):
    """Sets layout.chunk_elems_min/max in runtime config `cfg` (Note [Chunk search bounds])."""
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
            most = 1 << max(fit, 1).bit_length() - 1 if fit >= 1 else _ALIGN
        layout["chunk_elems_max"] = max(min(most, _MAX), layout["chunk_elems_min"]
                                        if isinstance(layout["chunk_elems_min"], int) else _ALIGN)
    cfg["layout"] = layout
    return cfg
