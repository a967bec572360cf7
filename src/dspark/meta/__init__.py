"""Models built on the meta device: :func:`meta_init` records the user's own initialisation while
the model is built with shapes only, and :func:`materialize` replays it on a real device, one module
at a time. The engine builds from it (zero3: one unit at a time), the planner's probe copies a model
with it; neither is needed to use it.

Example::

    with dspark.meta_init():
        model = GPT(config)                          # no memory for the weights yet
    materialize(model, torch.device("cpu"), lambda name, param: None)
"""

from dspark.meta.materialize import has_meta_tensors, materialize
from dspark.meta.record import meta_init

__all__ = ["has_meta_tensors", "materialize", "meta_init"]
