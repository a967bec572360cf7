"""Parameter groups keyed on the whole parameter: ``Engine(param_groups=lambda name, param: {...})``.

The function sees each trainable parameter once, by its first name in ``model.named_parameters()`` and
with its full shape (before any sharding), and returns the optimizer options that differ for it
(``{"weight_decay": 0.0}``), or ``{}`` / None for none. Parameters with equal overrides share a group;
groups keep the order in which their first parameter appears. The optimizer factory then receives
torch-style group dicts holding this rank's shards, so ``optimizer.param_groups`` is what LR schedulers
drive, under every strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from torch import nn

__all__ = ["ParamGroupsFn", "group_by_overrides"]

ParamGroupsFn = Callable[[str, nn.Parameter], Mapping[str, Any] | None]


def _hashable(value: Any) -> Hashable:
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value  # type: ignore[no-any-return]


def group_by_overrides(named: Sequence[tuple[str, nn.Parameter]],
                       fn: ParamGroupsFn) -> list[tuple[dict[str, Any], list[int]]]:
    """``[(overrides, indices into named)]``: one entry per distinct override dict, in first-seen order.

    Example::

        group_by_overrides([("w", w), ("b", b)], lambda n, p: {"weight_decay": 0.0} if p.ndim < 2 else {})
        # [({}, [0]), ({"weight_decay": 0.0}, [1])]
    """
    groups: dict[Hashable, tuple[dict[str, Any], list[int]]] = {}
    for index, (name, param) in enumerate(named):
        overrides = fn(name, param)
        if overrides is None:
            overrides = {}
        if not isinstance(overrides, Mapping):
            raise TypeError(f"param_groups({name!r}, ...) returned {type(overrides).__name__}; it must "
                            "return a dict of optimizer options (e.g. {'weight_decay': 0.0}) or None")
        bad = [k for k in overrides if not isinstance(k, str) or k == "params"]
        if bad:
            raise ValueError(f"param_groups({name!r}, ...) returned keys {bad!r}: keys are optimizer "
                             "option names such as 'lr' or 'weight_decay' ('params' is the engine's)")
        key = _hashable(dict(overrides))
        if key not in groups:
            groups[key] = (dict(overrides), [])
        groups[key][1].append(index)
    return list(groups.values())
