"""strata: a heterogeneous memory manager and offload runtime for deep-learning training.

The PyTorch binding is ``strata.torch`` (``import strata.torch``).
"""
