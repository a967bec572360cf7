"""What a training loop keeps besides the engine: objects with ``state_dict()`` /
``load_state_dict()`` passed as ``engine.save(path, extra={...})`` (an LR scheduler, a data loader, a
dict of counters), and every rank's random number generators.

[Note: extra state] An extra object's state is taken on rank 0 (a scheduler or ``dspark.DataLoader``
holds the same state on every rank) and stored as JSON (:mod:`dspark.checkpoint.json_values`); each
tensor inside it (an EMA copy of weights, a running mean) goes into DCP's files as
``extra/<name>/<i>`` and the JSON keeps a reference to it. Plain dicts of values are accepted as
they are. On load every rank gets the same state back.

[Note: random state] Each rank's torch CPU generator (and CUDA generators when present) are DCP
tensors ``rng/rank<R>/...``; Python's ``random`` and NumPy's global generator are JSON per rank. A
rank restores the state its own rank saved; at a larger world size the new ranks keep their own.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["TensorRef", "extract_tensors", "python_rng_state", "restore_python_rng", "restore_tensors",
           "rng_tensors", "set_rng_tensors", "state_of"]


class TensorRef:
    """A tensor of an extra state stored in DCP's files under ``key``."""

    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorRef) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"TensorRef({self.key!r})"


def state_of(name: str, obj: Any) -> Any:
    """``obj.state_dict()``, or ``obj`` itself when it is a plain dict of values."""
    getter = getattr(obj, "state_dict", None)
    if callable(getter):
        return getter()
    if isinstance(obj, Mapping):
        return dict(obj)
    raise TypeError(f"extra[{name!r}] is a {type(obj).__name__}: pass objects with state_dict() and "
                    "load_state_dict() (an LR scheduler, a dspark.DataLoader) or a dict of values")


def extract_tensors(value: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """``value`` with every tensor replaced by a :class:`TensorRef`, and the tensors by key."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            key = f"{prefix}/{len(tensors)}"
            tensors[key] = v.detach()
            return TensorRef(key)
        if isinstance(v, Mapping):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, tuple):
            return tuple(walk(x) for x in v)
        return v

    return walk(value), tensors


def restore_tensors(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`extract_tensors`."""
    if isinstance(value, TensorRef):
        return tensors[value.key]
    if isinstance(value, dict):
        return {k: restore_tensors(x, tensors) for k, x in value.items()}
    if isinstance(value, list):
        return [restore_tensors(x, tensors) for x in value]
    if isinstance(value, tuple):
        return tuple(restore_tensors(x, tensors) for x in value)
    return value


def rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    """This rank's torch generator states as DCP entries."""
    out = {f"rng/rank{rank}/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng/rank{rank}/cuda{index}"] = state
    return out


def set_rng_tensors(rank: int, loaded: Mapping[str, torch.Tensor]) -> None:
    prefix = f"rng/rank{rank}/"
    if prefix + "torch" in loaded:
        torch.set_rng_state(loaded[prefix + "torch"].to(torch.uint8))
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            key = f"{prefix}cuda{index}"
            if key in loaded:
                torch.cuda.set_rng_state(loaded[key].to(torch.uint8), index)


def python_rng_state() -> dict[str, Any]:
    """Python's and NumPy's global generators, as JSON-able values."""
    version, internal, gauss = random.getstate()
    out: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return out
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    out["numpy"] = [str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    return out


def check_rng_state(rank: int, state: Mapping[str, Any], entries: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``rank``'s saved generator states would be accepted: Python's
    and NumPy's (``state``, from the JSON) tried on throwaway generators, the torch state's entry
    in DCP's metadata (``entries``) the size of this process's. Run before anything is loaded, so a
    damaged state fails every rank at once instead of one rank half-way."""
    try:
        if "python" in state:
            version, internal, gauss = state["python"]
            random.Random().setstate((int(version), tuple(int(v) for v in internal), gauss))
        if "numpy" in state:
            import numpy as np

            name, keys, pos, has_gauss, cached = state["numpy"]
            np.random.RandomState().set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos),
                                               int(has_gauss), float(cached)))
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"rank {rank}'s saved Python/NumPy random state is refused "
                         f"({type(exc).__name__}: {exc})") from exc
    entry = entries.get(f"rng/rank{rank}/torch")
    if entry is not None:
        want = tuple(torch.get_rng_state().shape)
        if tuple(entry.size) != want or entry.properties.dtype != torch.uint8:
            raise ValueError(f"rank {rank}'s saved torch random state is {tuple(entry.size)} "
                             f"{entry.properties.dtype}, a generator state is {want} torch.uint8")


def restore_python_rng(state: Mapping[str, Any]) -> None:
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss),
                             float(cached)))
