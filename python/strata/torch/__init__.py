"""strata.torch: train an unmodified torch.nn.Module whose state does not fit the device.

    import strata.torch as st
    model = st.wrap(MyModel(), {"budgets": {"gpu": "64MiB", "host": "1GiB", "nvme": "8GiB"},
                                "nvme": {"dirs": ["/mnt/nvme/strata"]}})
    opt = st.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    for x, y in data:
        loss = loss_fn(model(x), y)
        loss.backward()      # gradients go to strata's grad chunks; optimizer steps overlap backward
        opt.step()           # strata's step: the rest of the optimizer, re-planning
        opt.zero_grad()      # torch's semantics (Note [Zero gradients] in _grads.py)
    torch.save(model.state_dict(), "model.pt")   # plain torch tensors

wrap() keeps the model's Parameter objects; their storage is rebound to strata's memory
while their module runs (see Note [Hooks] in _hooks.py); between steps they read and write
strata's values (Note [Lazy parameters]), and torch's clip_grad_norm_ works on them
(Note [Gradients in torch]). state_dict()/load_state_dict()
of the model and the optimizer use torch's formats.
"""

from . import functional
from ._deferred import init
from ._wrap import StrataError, Wrapped, wrap
from .optim import LAMB, LARS, SGD, Adagrad, Adam, AdamW, Lion

__all__ = ["wrap", "init", "Wrapped", "StrataError", "AdamW", "Adam", "LAMB", "LARS", "SGD", "Lion", "Adagrad",
           "functional"]
