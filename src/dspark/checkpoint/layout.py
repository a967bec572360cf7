"""Where each piece of an engine's state lives in a checkpoint, as pure rules (no process group).

[Note: checkpoint layout] One flat DCP state dict of tensors, keyed by name, independent of the
strategy and world size that wrote it (built from the engine's sharded state dict, see [Note: sharded
state dict] in :mod:`dspark.engine.state_dict`):

    model/<name>              trainable parameters, in their *rows view* (a 0-d parameter is saved
                              as shape (1,), the only way to split it along dim 0), written as
                              Shard(0) shards by every rank under zero1/2/3, once under replicate;
                              frozen parameters and persistent buffers whole, from rank 0 only,
                              after rank 0's values were broadcast to every rank (BatchNorm
                              statistics drift apart when each rank sees its own batch)
    optim/<name>/<key>        optimizer state of that parameter: per-element tensors (AdamW's
                              exp_avg, exp_avg_sq) in the parameter's rows view and split like it;
                              tensor scalars (``step``) replicated
    rng/rank<R>/torch, cuda<i>  each rank's torch generators
    extra/<name>/<i>          tensors inside ``engine.save(extra=...)`` objects' states
    save/rank<R>              the save's id (16 bytes), in the file rank R wrote ([Note: checkpoint
                              integrity] in :mod:`dspark.checkpoint.manifest`)

Every other value is JSON, beside DCP's files: ``training_state.json`` (step count, fp16 loss
scaler, param groups' hyper-parameters and members, non-tensor optimizer state, extra states, each
rank's Python and NumPy random state), ``dspark.json`` (what wrote the checkpoint, a tied
parameter's other names among it), ``config.json`` when the model carried a HuggingFace config
(its ``to_json_string()``, what ``from_pretrained`` reads) and ``manifest.json`` (every file's size
and digests, checked by every load). A tied parameter is saved once, under its first name. Because every sharded tensor
is saved with its global shape, DCP can load it at any world size and into any strategy.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

CONFIG_FILE = "config.json"
"""The model's HuggingFace config, kept beside the weights (an export copies it)."""

__all__ = [
    "CONFIG_FILE",
    "first_mismatch",
    "model_key",
    "optim_key",
    "optim_prefix",
]


def model_key(name: str) -> str:
    """The checkpoint key of a parameter or buffer: ``model_key("layers.0.weight")`` is
    ``"model/layers.0.weight"``."""
    return f"model/{name}"


def optim_prefix(name: str) -> str:
    """The prefix of every optimizer-state key of parameter ``name`` (names never hold ``/``)."""
    return f"optim/{name}/"


def optim_key(name: str, state_key: str) -> str:
    """The checkpoint key of one optimizer-state entry: ``optim_key("w", "exp_avg")`` is
    ``"optim/w/exp_avg"``."""
    return optim_prefix(name) + state_key


def first_mismatch(model: Sequence[tuple[str, tuple[int, ...]]],
                   checkpoint: Mapping[str, tuple[int, ...]], *,
                   aliases: Collection[str] = ()) -> str | None:
    """The first difference between a model's tensors and a checkpoint's, in the model's order,
    worded for an error message; None when they match.

    ``model`` lists ``(name, shape)``; ``checkpoint`` maps name to shape; ``aliases`` are the model's
    other names of tied parameters (a checkpoint may hold them, e.g. one written by an untied model).

    Example::

        first_mismatch([("w", (3, 2))], {"w": (4, 2)})
        # "parameter 'w' has shape (3, 2) in the model but (4, 2) in the checkpoint"
    """
    for name, shape in model:
        if name not in checkpoint:
            return (f"parameter {name!r} {tuple(shape)} is not in the checkpoint (it holds "
                    f"{_some(checkpoint)})")
        if tuple(checkpoint[name]) != tuple(shape):
            return (f"parameter {name!r} has shape {tuple(shape)} in the model but "
                    f"{tuple(checkpoint[name])} in the checkpoint")
    known = {name for name, _ in model} | set(aliases)
    extra = [name for name in checkpoint if name not in known]
    if extra:
        return (f"the checkpoint holds parameter {extra[0]!r} {tuple(checkpoint[extra[0]])} that the "
                f"model does not have ({len(extra)} such tensor(s))")
    return None


def _some(names: Mapping[str, object], limit: int = 4) -> str:
    listed = ", ".join(repr(n) for n in list(names)[:limit])
    more = len(names) - limit
    return f"{listed}{f' and {more} more' if more > 0 else ''}" if names else "no parameters"
