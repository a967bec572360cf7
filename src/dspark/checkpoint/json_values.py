"""Non-tensor values of a training state (an optimizer's hyper-parameters, a scaler's counters) as
plain JSON, so that a checkpoint never holds a pickle (see [Note: loading runs no code]).

JSON lacks tuples, non-finite floats and tensors; they are written as one-key objects tagged with
``"__tuple__"``, ``"__float__"``, ``"__tensor__"``, ``"__dtype__"`` (and ``"__ref__"`` for a tensor
kept in DCP's files, see :mod:`dspark.checkpoint.extra_state`), and every dict as
``{"__dict__": {...}}`` so that a user's dict can never be read back as a tag; a dict with keys
other than strings (numbers, None, tuples of them) as ``{"__items__": [[key, value], ...]}``, and a
``collections.Counter`` (``MultiStepLR``'s milestones) as ``{"__counter__": [...]}``, read back as
one. Decoding builds only these plain values: JSON text cannot name a function, so reading it runs
nothing.

Example::

    encode({"lr": 1e-3, "betas": (0.9, 0.95)})
    # {'__dict__': {'lr': 0.001, 'betas': {'__tuple__': [0.9, 0.95]}}}
    decode(encode({"lr": 1e-3, "betas": (0.9, 0.95)}))   # {'lr': 0.001, 'betas': (0.9, 0.95)}
"""

from __future__ import annotations

import collections
import math
from typing import Any

import torch

from dspark.checkpoint.extra_state import TensorRef

__all__ = ["MAX_TENSOR_ELEMENTS", "decode", "encode"]

MAX_TENSOR_ELEMENTS = 4096
"""A tensor-valued hyper-parameter (an ``lr`` kept as a tensor) is written as a list of numbers;
bigger tensors belong in the tensor part of the checkpoint."""

_FLOATS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def encode(value: Any, where: str = "value") -> Any:
    """``value`` as JSON-ready data; ``TypeError`` naming ``where`` for a type JSON cannot hold.

    Example::

        encode(float("inf"))   # {'__float__': 'inf'}
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": str(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        counter = isinstance(value, collections.Counter)
        if counter or not all(isinstance(k, str) for k in value):
            # other keys (MultiStepLR's milestones: a Counter of ints) as [key, value] pairs
            items = [[_encode_key(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]
            return {"__counter__" if counter else "__items__": items}
        return {"__dict__": {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, TensorRef):
        return {"__ref__": value.key}
    if isinstance(value, torch.Tensor):
        return {"__tensor__": _encode_tensor(value, where)}
    raise TypeError(f"{where} is a {type(value).__name__} ({value!r:.80}); a checkpoint stores "
                    "tensors, numbers, strings, None, and lists, tuples and dicts of them")


def decode(data: Any, where: str = "value") -> Any:
    """The value :func:`encode` wrote; ``ValueError`` naming ``where`` for anything it never writes.

    Example::

        decode({"__tuple__": [0.9, 0.999]})   # (0.9, 0.999)
    """
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(data)]
    if isinstance(data, dict) and len(data) == 1:
        (tag, body), = data.items()
        if tag == "__dict__" and isinstance(body, dict):
            return {k: decode(v, f"{where}[{k!r}]") for k, v in body.items()}
        if tag in ("__items__", "__counter__") and isinstance(body, list):
            pairs = {_decode_key(pair, where): decode(pair[1], f"{where}[{pair[0]!r}]") for pair in body}
            return collections.Counter(pairs) if tag == "__counter__" else pairs
        if tag == "__tuple__" and isinstance(body, list):
            return tuple(decode(v, f"{where}[{i}]") for i, v in enumerate(body))
        if tag == "__float__" and body in _FLOATS:
            return _FLOATS[body]
        if tag == "__dtype__":
            return _dtype(body, where)
        if tag == "__ref__" and isinstance(body, str) and body.startswith("extra/"):
            return TensorRef(body)
        if tag == "__tensor__" and isinstance(body, dict):
            return _decode_tensor(body, where)
    raise ValueError(f"{where} = {data!r:.120} is not a value DSpark writes")


_KEY_TYPES = (str, int, float, bool, type(None), tuple)


def _encode_key(key: object, where: str) -> Any:
    if not isinstance(key, _KEY_TYPES) or (isinstance(key, tuple) and not all(isinstance(k, _KEY_TYPES) for k in key)):
        raise TypeError(f"{where} has a key of type {type(key).__name__} ({key!r:.60}); a checkpoint "
                        "stores dict keys that are strings, numbers, None or tuples of them")
    return encode(key, f"{where} key")


def _decode_key(pair: object, where: str) -> Any:
    if not (isinstance(pair, list) and len(pair) == 2):
        raise ValueError(f"{where} = {pair!r:.120} is not a [key, value] pair DSpark writes")
    key = decode(pair[0], f"{where} key")
    if not isinstance(key, _KEY_TYPES) or (isinstance(key, tuple) and not all(isinstance(k, _KEY_TYPES) for k in key)):
        raise ValueError(f"{where} has key {key!r:.60}, which is not a key DSpark writes")
    return key


def _encode_tensor(value: torch.Tensor, where: str) -> dict[str, Any]:
    if value.numel() > MAX_TENSOR_ELEMENTS:
        raise TypeError(f"{where} is a tensor of {value.numel()} elements; only small tensors "
                        f"(<= {MAX_TENSOR_ELEMENTS}) can be stored as a hyper-parameter")
    if value.is_complex():
        raise TypeError(f"{where} is a complex tensor, which a checkpoint cannot store as JSON")
    host = value.detach().to("cpu")
    numbers = host.double().tolist() if host.is_floating_point() else host.tolist()
    return {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape),
            "values": encode(numbers, where)}


def _decode_tensor(body: dict[str, Any], where: str) -> torch.Tensor:
    if set(body) != {"dtype", "shape", "values"} or not isinstance(body["shape"], list):
        raise ValueError(f"{where} is not a tensor DSpark writes (fields {sorted(body)!r})")
    dtype = _dtype(body["dtype"], where)
    shape = body["shape"]
    if not all(isinstance(s, int) and s >= 0 for s in shape) or math.prod(shape) > MAX_TENSOR_ELEMENTS:
        raise ValueError(f"{where} has tensor shape {shape!r}")
    values = decode(body["values"], where)
    return torch.tensor(values, dtype=dtype).reshape(shape)


def _dtype(name: object, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where} names dtype {name!r}, which is not a torch dtype")
    return dtype
