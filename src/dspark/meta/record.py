"""``with dspark.meta_init():``: build a model with no memory for its parameters, and remember how its
code initialised each one, so that the engine can give each unit its exact values later.

[Note: recorded initialisation] Inside the context, parameters live on the meta device (no memory)
and every in-place operation on one of them is recorded, in order, with what it needs to run again:
the function (``nn.init.normal_``, ``Tensor.uniform_``, ``fill_``, ``mul_``, ``__setitem__``, ...), its
arguments, which part of the parameter it wrote (a view's size, strides and offset: ``weight[0].zero_()``
writes one row) and, for a random operation, the state of the generator before it. It does not matter
where the operation comes from: ``reset_parameters()`` in a constructor, ``self.apply(fn)``, a loop over
``named_parameters()``, HuggingFace's ``post_init()`` / ``_init_weights``, a tie made half-way. A
``copy.deepcopy`` of a recorded parameter (peft's ``modules_to_save`` copy of a head) takes the
operations recorded so far. The
engine replays a parameter's operations on a real tensor when it materialises that parameter's unit
(:func:`replay`), so the result is bitwise the value the same code gives on the CPU with the same seed.

Random operations on meta tensors draw nothing, so each one is also run on a scratch CPU tensor of the
same shape and dtype: the generator advances exactly as it does when the model is built on the CPU,
and every later operation (and the user's code after the model) sees the same random stream.

Only *uninitialised* tensors go to the meta device (``torch.empty`` and its kin, when no device is
given): a parameter made from values (``nn.Parameter(torch.ones(d))``, ``torch.randn(..) * 0.02``)
keeps those values as its starting point, and buffers computed from values (a rotary ``inv_freq``)
stay real. What cannot be replayed is never guessed: an in-place operation that reads another meta
tensor's data (``weight.copy_(q)`` where ``q`` was computed on meta, as ``nn.init.orthogonal_`` does),
or a parameter replaced by such a value, marks the parameter as unreproducible, and the engine refuses
it before the first step, naming it and the operation.

Example::

    with dspark.meta_init():
        model = GPT(config)          # no parameter memory; apply(_init_weights) etc. recorded
    engine = dspark.Engine(model, optimizer=..., strategy="zero3")   # each unit replayed, sharded
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["InitRecord", "forget", "meta_init", "record_of", "replay"]

_RECORDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Parameter or buffer built under meta_init -> its :class:`InitRecord`."""

_RANDOM_METHODS = frozenset({"normal_", "uniform_", "bernoulli_", "random_", "exponential_", "geometric_",
                             "log_normal_", "cauchy_"})
_INIT_FUNCTIONS = {"uniform_": True, "normal_": True, "trunc_normal_": True, "constant_": False,
                   "ones_": False, "zeros_": False, "eye_": False, "dirac_": False, "xavier_uniform_": True,
                   "xavier_normal_": True, "kaiming_uniform_": True, "kaiming_normal_": True,
                   "orthogonal_": True, "sparse_": True}
"""``torch.nn.init``'s functions -> whether they draw random numbers. Several return at once on a meta
tensor (drawing nothing), so inside meta_init they are replaced by wrappers that record the call."""
_RANDOM_LIKE = frozenset({"randn_like", "rand_like", "randint_like", "normal", "bernoulli", "poisson",
                          "multinomial"})
_EMPTY_FACTORIES = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad"})
_DATA_SETTER = torch.Tensor.data.__set__  # type: ignore[attr-defined]
_CONSTANT_MIN_NUMEL = 4096
"""A starting value this large that is one constant is kept as that constant, not as a tensor."""


class _Target:
    """Placeholder for the tensor an operation writes, in a recorded argument list."""


class _Generator:
    """Placeholder for a generator argument; the state it had is in the operation."""


_TARGET = _Target()
_GENERATOR = _Generator()


@dataclass(slots=True)
class _Op:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    rng_state: torch.Tensor | None = None


@dataclass(slots=True)
class InitRecord:
    """How one parameter (or buffer) of a meta_init model gets its value."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    start: torch.Tensor | None = None
    """The value it was made from (None: uninitialised, ``torch.empty``)."""
    fill: float | bool | None = None
    """... or the one constant it was made from."""
    ops: list[_Op] = field(default_factory=list)
    problem: str | None = None
    """Why it cannot be replayed (the first reason found), or None."""
    base_offset: int = 0
    """The storage offset of the meta tensor the ops' offsets are relative to."""

    def refuse(self, reason: str) -> None:
        if self.problem is None:
            self.problem = reason


def record_of(t: torch.Tensor) -> InitRecord | None:
    """The record of a parameter or buffer built under :func:`meta_init`, or None.

    Example::

        with meta_init():
            lin = nn.Linear(2, 2)
        record_of(lin.weight).ops[0].func     # torch.nn.init.kaiming_uniform_
    """
    return _RECORDS.get(t)  # type: ignore[no-any-return]


def forget(t: torch.Tensor) -> None:
    """Drop ``t``'s record once it holds its real value (the record may keep a starting value)."""
    _RECORDS.pop(t, None)


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Build a model whose parameters take no memory; the engine materialises it later with exactly
    the values its own initialisation code gives on the CPU (see [Note: recorded initialisation]).

    Example::

        with dspark.meta_init():
            model = GPT(GPTConfig(n_layer=12))
        engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=6e-4),
                               strategy="zero3")
    """
    recorder = _Recorder()
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    @functools.wraps(register_parameter)
    def on_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(module, name, param)
        if param is not None and _RECORDS.get(param) is None:
            module._parameters[name] = recorder.adopt(param, parameter=True)  # type: ignore[assignment]

    @functools.wraps(register_buffer)
    def on_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        register_buffer(module, name, tensor, persistent)
        if tensor is not None and tensor.is_meta and _RECORDS.get(tensor) is None:
            recorder.adopt(tensor, parameter=False)

    deepcopy_parameter = nn.Parameter.__deepcopy__

    @functools.wraps(deepcopy_parameter)
    def on_deepcopy(param: nn.Parameter, memo: dict[int, Any]) -> nn.Parameter:
        copied = deepcopy_parameter(param, memo)
        record = _RECORDS.get(param)
        if record is not None and copied.is_meta and _RECORDS.get(copied) is None:
            recorder.adopt_copy(copied, record)
        return copied

    tables = _init_tables()
    originals = [(table, name, table[name]) for table in tables for name in _INIT_FUNCTIONS if name in table]
    nn.Module.register_parameter = on_parameter  # type: ignore[method-assign,assignment]
    nn.Module.register_buffer = on_buffer  # type: ignore[method-assign,assignment]
    nn.Parameter.__deepcopy__ = on_deepcopy  # type: ignore[method-assign,assignment]
    for table, name, original in originals:
        table[name] = recorder.init_wrapper(original, random=_INIT_FUNCTIONS[name])
    try:
        with recorder:
            yield
    finally:
        recorder.scratch.release()
        nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign]
        nn.Parameter.__deepcopy__ = deepcopy_parameter  # type: ignore[method-assign]
        for table, name, original in originals:
            table[name] = original


def _init_tables() -> list[dict[str, Any]]:
    """Where initialisation functions are looked up by name at call time: ``torch.nn.init`` and
    HuggingFace's copy of its functions (``transformers.initialization.TORCH_INIT_FUNCTIONS``)."""
    import sys

    tables: list[dict[str, Any]] = [vars(torch.nn.init)]
    hf = sys.modules.get("transformers.initialization")
    copied = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
    if isinstance(copied, dict):
        tables.append(copied)
    return tables


def _storage_key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


class _Recorder(TorchFunctionMode):
    """The mode behind :func:`meta_init`: sends uninitialised tensors to meta, records in-place
    operations on recorded tensors, and advances the generators as the CPU would."""

    def __init__(self) -> None:
        super().__init__()
        self._by_storage: dict[int, tuple[torch.Tensor, InitRecord]] = {}
        self.scratch = _Scratch()
        """Where random operations run to move the generator (see [Note: one scratch buffer])."""

    def adopt(self, t: torch.Tensor, *, parameter: bool) -> torch.Tensor:
        """Start recording ``t`` (a parameter or buffer); returns the meta tensor to register."""
        record = InitRecord(tuple(t.shape), tuple(t.stride()), t.dtype)
        if not t.is_meta:
            with torch.no_grad():
                host = t.detach()
                flat = host.reshape(-1)
                if host.numel() >= _CONSTANT_MIN_NUMEL and bool((flat == flat[0]).all()):
                    record.fill = flat[0].item()
                else:
                    record.start = host.to("cpu", copy=True)
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            t = nn.Parameter(meta, requires_grad=t.requires_grad) if parameter else meta
        record.base_offset = int(t.storage_offset())
        _RECORDS[t] = record
        self._by_storage[_storage_key(t)] = (t, record)
        return t

    def adopt_copy(self, copied: torch.Tensor, source: InitRecord) -> None:
        """Record ``copied`` (a ``copy.deepcopy`` of a recorded parameter: peft's ``modules_to_save``,
        an EMA copy) as the source's value so far: its operations up to now, not those made on the
        source afterwards. The recorded values are never written, so both records share them."""
        record = InitRecord(source.shape, source.stride, source.dtype, start=source.start, fill=source.fill,
                            ops=list(source.ops), problem=source.problem,
                            base_offset=int(copied.storage_offset()))
        _RECORDS[copied] = record
        self._by_storage[_storage_key(copied)] = (copied, record)

    def _record_of_alias(self, t: torch.Tensor) -> InitRecord | None:
        if not t.is_meta:
            return None
        found = self._by_storage.get(_storage_key(t))
        return None if found is None else found[1]

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in _EMPTY_FACTORIES and kwargs.get("device") is None and not _on_real_device(args):
            kwargs["device"] = "meta"
            return func(*args, **kwargs)
        if func is _DATA_SETTER:
            return self._set_data(args[0], args[1])
        target = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("tensor")
        if not isinstance(target, torch.Tensor) or not target.is_meta:
            return func(*args, **kwargs)
        if (getattr(func, "__module__", None) or "") == "torch.nn.init":
            # the wrappers meta_init installed (torch.nn.init's functions dispatch to a mode through
            # their module's names, which are the wrappers now): they record the call themselves
            return func(*args, **kwargs)
        random = name in _RANDOM_METHODS or name in _RANDOM_LIKE
        in_place = name not in _NOT_WRITES and (
            (name.endswith("_") and not name.startswith("__")) or name == "__setitem__"
            or (name.startswith("__i") and name.endswith("__")))
        states = _advance_like_the_cpu(func, target, args, kwargs, self.scratch) if random else None
        if in_place:
            record = self._record_of_alias(target)
            if record is not None:
                self._record(record, func, target, args, kwargs, states)
        return func(*args, **kwargs)

    def init_wrapper(self, original: Callable[..., Any], *, random: bool) -> Callable[..., Any]:
        """``original`` (a ``torch.nn.init`` function) that, on a meta tensor, records the call and
        advances the generator as on the CPU instead of returning at once."""

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            target = args[0] if args else kwargs.get("tensor")
            if not isinstance(target, torch.Tensor) or not target.is_meta:
                return original(*args, **kwargs)
            states = _advance_like_the_cpu(original, target, args, kwargs, self.scratch) if random else None
            record = self._record_of_alias(target)
            if record is not None:
                self._record(record, original, target, args, kwargs, states)
            return target

        return wrapper

    def _record(self, record: InitRecord, func: Any, target: torch.Tensor, args: tuple[Any, ...],
                kwargs: dict[str, Any], states: torch.Tensor | None) -> None:
        name = getattr(func, "__qualname__", repr(func))
        others = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor) and a is not target]
        if any(o.is_meta for o in others):
            record.refuse(f"{name}() copies from a tensor computed on the meta device (its data does not "
                          "exist until the model is materialised)")
            return

        def placeholder(value: Any) -> Any:
            if value is target:
                return _TARGET
            if isinstance(value, torch.Generator):
                return _GENERATOR
            if isinstance(value, torch.Tensor):
                return value.detach().clone()
            return value

        record.ops.append(_Op(func, tuple(placeholder(a) for a in args),
                              {k: placeholder(v) for k, v in kwargs.items()},
                              tuple(target.shape), tuple(target.stride()),
                              int(target.storage_offset()) - record.base_offset, target.dtype, states))

    def _set_data(self, t: torch.Tensor, value: torch.Tensor) -> None:
        record = self._record_of_alias(t) if isinstance(t, torch.Tensor) else None
        if record is None:
            _DATA_SETTER(t, value)
            return
        if value.is_meta:
            source = self._record_of_alias(value)
            if source is not record or tuple(value.shape) != record.shape:
                record.refuse("its .data was replaced by a tensor computed on the meta device")
            if source is record:  # a cast or copy of itself (model.to(dtype)): later ops see it
                del self._by_storage[_storage_key(t)]
                _DATA_SETTER(t, value)
                record.base_offset = int(t.storage_offset())
                self._by_storage[_storage_key(t)] = (t, record)
            return
        # a real value: the parameter starts again from it
        record.ops.clear()
        record.start, record.fill = value.detach().to("cpu", copy=True), None
        record.shape, record.stride, record.dtype = tuple(value.shape), tuple(value.stride()), value.dtype
        del self._by_storage[_storage_key(t)]
        _DATA_SETTER(t, torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta"))
        record.base_offset = int(t.storage_offset())
        self._by_storage[_storage_key(t)] = (t, record)


def _on_real_device(args: tuple[Any, ...]) -> bool:
    """``empty_like(x)`` / ``x.new_empty(..)`` follow ``x``'s device: real when ``x`` is."""
    return bool(args) and isinstance(args[0], torch.Tensor) and not args[0].is_meta


def _generator_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Generator):
            return value
    return torch.default_generator


class _Scratch:
    """The CPU memory random operations run on to move the generator (see [Note: recorded
    initialisation]): one buffer, grown to the largest parameter and reused, released when the
    ``meta_init()`` block ends.

    [Note: one scratch buffer] A fresh scratch tensor per random operation was freed at once, but
    glibc kept the freed memory: after a large one is unmapped it raises its mmap threshold, so every
    smaller scratch came from the heap, where frees of mixed sizes left holes the next request could
    not reuse. A model built under ``meta_init()`` then held more than its own size and peaked at
    about one and a half copies of it, for a model with no memory (docs/figures.md#process-peak-rss
    measures the process as it is now). One buffer keeps the peak at the largest parameter. A random
    operation draws the same numbers on a view of it with the parameter's shape and strides as on a
    tensor of its own: the kernels see the same sizes, strides and alignment (the view starts at the buffer's
    start)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def like(self, target: torch.Tensor) -> torch.Tensor:
        """A CPU tensor of ``target``'s shape, strides and dtype, in the buffer (its values are garbage)."""
        span = 1 + sum((size - 1) * stride for size, stride in zip(target.shape, target.stride(), strict=True)
                       ) if target.numel() else 0
        num_bytes = span * target.element_size()
        if self._flat is None or self._flat.numel() < num_bytes:
            self._flat = None  # the old one goes first: never two buffers at once
            # not meta: see __torch_function__
            self._flat = torch.empty(max(num_bytes, 1), dtype=torch.uint8, device="cpu")
        return self._flat[:num_bytes].view(target.dtype).as_strided(target.shape, target.stride())

    def release(self) -> None:
        self._flat = None


def _advance_like_the_cpu(func: Any, target: torch.Tensor, args: tuple[Any, ...],
                          kwargs: dict[str, Any], scratch_memory: _Scratch) -> torch.Tensor:
    """Run the random ``func`` on a CPU scratch tensor shaped like ``target``, so the generator moves
    on as it does when the model is built on the CPU; returns the generator's state before."""
    generator = _generator_of(args, kwargs)
    state = generator.get_state()
    scratch = scratch_memory.like(target)

    def swap(value: Any) -> Any:
        return scratch if value is target else value

    with torch.no_grad():
        func(*tree_map(swap, args), **tree_map(swap, kwargs))
    return state


def replay(record: InitRecord, name: str) -> torch.Tensor:
    """The value the recorded operations give, on the CPU (see [Note: recorded initialisation]);
    the default generator's state is restored afterwards. ``ValueError`` naming ``name`` when the
    record cannot be replayed or leaves elements uninitialised.

    Example::

        value = replay(record_of(model.lm_head.weight), "lm_head.weight")
    """
    if record.problem is not None:
        raise ValueError(f"{name}: {record.problem}")
    if record.start is not None:
        value = record.start.clone()
    else:
        value = torch.empty_strided(record.shape, record.stride, dtype=record.dtype)
        value.fill_(record.fill if record.fill is not None else _poison_value(record.dtype))
    before = torch.default_generator.get_state()
    try:
        with torch.no_grad():
            for op in record.ops:
                if value.dtype != op.dtype:
                    value = value.to(op.dtype)
                view = value.as_strided(op.size, op.stride, value.storage_offset() + op.offset)
                generator = None
                if op.rng_state is not None:
                    generator = torch.Generator().set_state(op.rng_state) if _uses_generator(op) else None
                    if generator is None:
                        torch.default_generator.set_state(op.rng_state)

                def fill_in(v: Any, view: torch.Tensor = view, generator: Any = generator) -> Any:
                    if isinstance(v, _Target):
                        return view
                    if isinstance(v, _Generator):
                        return generator
                    return v

                op.func(*[fill_in(a) for a in op.args], **{k: fill_in(v) for k, v in op.kwargs.items()})
    finally:
        torch.default_generator.set_state(before)
    if record.start is None and record.fill is None and _poisoned(value):
        raise ValueError(f"{name} (shape {record.shape}) was made with torch.empty under "
                         "dspark.meta_init() and its initialisation never wrote "
                         f"{'all of it' if value.numel() > 1 else 'it'}: the CPU build would train "
                         "from uninitialised memory. Initialise it in the model's code")
    return value


def _uses_generator(op: _Op) -> bool:
    return any(isinstance(v, _Generator) for v in (*op.args, *op.kwargs.values()))


def _poison_value(dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point or dtype.is_complex:
        return math.nan
    if dtype == torch.bool:
        return False
    return torch.iinfo(dtype).min


def _poisoned(t: torch.Tensor) -> bool:
    if t.numel() == 0 or t.dtype == torch.bool:
        return False
    if t.is_floating_point() or t.is_complex():
        return bool(torch.isnan(t).any())
    return bool((t == torch.iinfo(t.dtype).min).any())
