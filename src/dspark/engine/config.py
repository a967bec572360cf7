"""``dspark.EngineConfig``: every option of :class:`dspark.Engine`, declared once.

[Note: options declared once] An option is one field of :class:`EngineConfig` or of one of its
groups: its type, its default, its check (``option(default, check)``) and, on the next line, its
docstring. Everything else reads that declaration: ``Engine(**options)`` routes keyword arguments
to it (:meth:`EngineConfig.replace`), ``__post_init__`` runs each field's check, the settings every
rank must agree on come from it (:meth:`EngineConfig.agreed_settings`), ``inspect.signature(Engine)``
lists it, and docs/engine.md's options table is generated from it (:func:`options_table`;
tests/engine/test_config.py fails when the page or the README's table drifts). Adding an option is
one field here plus its use. The groups follow the engine's concerns, as FSDP2 groups its policies:
communication, checks, observation; what every user sets stays at the top.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import torch
from torch import nn

from dspark.engine.batch_check import DEFAULT_BATCH_CHECK_EVERY
from dspark.engine.loss_scaler import LossScaler
from dspark.engine.param_groups import ParamGroupsFn
from dspark.policy.strategies import PRECISIONS, all_strategies
from dspark.policy.units import UnitPolicy

__all__ = ["GROUPS", "GROUP_OF", "ChecksConfig", "CommunicationConfig", "EngineConfig", "ObservationConfig",
           "loss_scaler_for", "option", "spells_out_options"]

_Init = TypeVar("_Init", bound=Callable[..., None])
Check = Callable[[str, Any], None]
"""``check(name, value)`` raises ``ValueError``/``TypeError`` naming the value and the fix."""


def option(default: Any, check: Check | None = None, *, agreed: bool = True) -> Any:
    """One option's default and check (its docstring goes on the line below the field).
    ``agreed=False``: ranks may differ in it (a per-rank trace directory); every other option must
    be equal on every rank, or construction raises on every rank.

    Example::

        bucket_mb: float = option(25.0, _number_above_0("megabytes per bucket"))
        \"\"\"Gradient bucket size in MiB.\"\"\"
    """
    return field(default=default, metadata={"check": check, "agreed": agreed})


def _one_of(*choices: str) -> Check:
    def check(name: str, value: Any) -> None:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{name}={value!r} is not one of {', '.join(map(repr, choices))}")
    return check


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least(minimum: int, meaning: str, *, none: str | None = None) -> Check:
    def check(name: str, value: Any) -> None:
        if value is None and none is not None:
            return
        if not _is_int(value) or value < minimum:
            also = f", or None {none}" if none is not None else ""
            raise ValueError(f"{name}={value!r} must be an int >= {minimum} ({meaning}){also}")
    return check


def _number_above_0(meaning: str, *, optional: bool = False) -> Check:
    def check(name: str, value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name}={value!r} must be {'None or ' if optional else ''}a number > 0 "
                             f"({meaning})")
    return check


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")


def _reduce_dtype(name: str, value: Any) -> None:
    if value not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}={value!r} must be None, torch.float32, torch.bfloat16 or torch.float16")


def _loss_scaler(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, LossScaler):
        raise TypeError(f"{name}={value!r} must be None or a dspark.engine.LossScaler "
                        "(e.g. LossScaler(scale=2.0**10))")


def _function(shape: str) -> Check:
    def check(name: str, value: Any) -> None:
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be a function {shape}, got {type(value).__name__}")
    return check


def _unit_policy(name: str, value: Any) -> None:
    if isinstance(value, type):  # a class is callable too, but as a predicate it would be built, not asked
        raise TypeError(f"{name}={value!r} must be a list of nn.Module classes, e.g. [{value.__name__}], or a "
                        "function (name, module) -> bool")
    if value is None or callable(value):
        return
    classes = value if isinstance(value, (list, tuple)) else None
    if classes is None or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise TypeError(f"{name}={value!r} must be a list of nn.Module classes or a function "
                        "(name, module) -> bool")


def _trace_dir(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}={value!r} must be None or a directory path (str or PathLike)")


def _trace_steps(name: str, value: Any) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and all(_is_int(n) for n in value)
            and value[0] >= 0 and value[1] >= 1):
        raise ValueError(f"{name}={value!r} must be (warmup, active): ints, warmup >= 0 untraced "
                         "steps first, then active >= 1 traced steps, e.g. (1, 2)")


def _batch_check_every(name: str, value: Any) -> None:
    if value is not None and (not _is_int(value) or value < 0):
        raise ValueError(f"{name}={value!r} must be an int >= 1 (steps between checks), or None / 0 to "
                         "turn the check off")


def _check_fields(config: Any) -> None:
    for f in fields(config):
        check = f.metadata.get("check")
        if check is not None:
            check(f.name, getattr(config, f.name))


@dataclass(frozen=True, kw_only=True, slots=True)
class CommunicationConfig:
    """How gradients, parameters and buffers travel between ranks."""

    bucket_mb: float = option(25.0, _number_above_0("megabytes per bucket"))
    """Gradient bucket size in MiB; a bucket's reduction starts once its last gradient is ready,
    while backward runs on."""
    reduce_dtype: torch.dtype | None = option(None, _reduce_dtype)
    """The wire dtype of the gradient reduction (``torch.float32``, ``bfloat16`` or ``float16``);
    None: the gradients' own."""
    zero3_units: UnitPolicy = option(None, _unit_policy)
    """Which modules zero3 gathers together: module classes or ``(name, module) -> bool``; None: the
    children of every ``nn.ModuleList`` and ``nn.Sequential``."""
    broadcast_buffers: bool = option(True, _bool)
    """Rank 0's buffers before each training forward, as DDP does."""
    sync_batchnorm: bool = option(False, _bool)
    """BatchNorm with statistics over the global batch, on any backend."""
    shard_group_size: int | None = option(None, _int_at_least(1, "ranks per shard group", none="for a node's ranks"))
    """Hybrid strategies: the ranks that shard between them (a divisor of the world size; each group
    of consecutive ranks holds one replica); None: one node's ranks (``LOCAL_WORLD_SIZE``)."""

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class ChecksConfig:
    """What the engine refuses at run time, and how often it looks."""

    skip_nonfinite: bool = option(True, _bool)
    """Skip a step whose loss (or, when the norm is measured, gradient norm) is inf or nan, on every
    rank, in every precision; False applies it, as DDP does."""
    max_nonfinite_skips: int | None = option(
        20, _int_at_least(1, "skipped steps in a row before the engine raises", none="for no limit"))
    """That many skipped steps in a row raise ``FloatingPointError`` on every rank; None: no limit."""
    batch_check_every: int | None = option(DEFAULT_BATCH_CHECK_EVERY, _batch_check_every)
    """Steps between checks that no two ranks feed the same batch (the first step is always
    checked); None or 0 turns it off."""
    allow_accum_scaled_loss: bool = option(False, _bool)
    """Let ``engine.backward(loss)`` take a loss whose graph ends in a division or multiplication by
    ``grad_accum_steps``; refused by default, since the engine averages the window itself
    (docs/porting.md, "DDP habits caught at run time")."""

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(frozen=True, kw_only=True, slots=True)
class ObservationConfig:
    """What the engine records about its own steps."""

    trace_dir: str | os.PathLike[str] | None = option(None, _trace_dir, agreed=False)
    """A PyTorch profiler trace per rank, written under this directory; None: no trace."""
    trace_steps: tuple[int, int] = option((1, 2), _trace_steps, agreed=False)
    """The trace's ``(warmup, active)`` steps: untraced steps first, then traced ones."""

    def __post_init__(self) -> None:
        _check_fields(self)


GROUPS: dict[str, type] = {"communication": CommunicationConfig, "checks": ChecksConfig,
                           "observation": ObservationConfig}
"""The option groups of :class:`EngineConfig`, by field name."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """Every option of :class:`dspark.Engine`, typed and checked, in one frozen value (see [Note:
    options declared once]). ``Engine(model, optimizer=..., config=config)``; keyword options
    given to the engine as well are applied on top (``config.replace(**options)``), so a base
    config from a file can be overridden per run. Groups: :class:`CommunicationConfig`,
    :class:`ChecksConfig`, :class:`ObservationConfig`; every option also goes by its own name.

    Example::

        config = dspark.EngineConfig(strategy="zero3", precision="bf16", grad_accum_steps=4)
        config = config.replace(bucket_mb=50.0, max_nonfinite_skips=None)   # names reach the groups
        engine = dspark.Engine(model, optimizer=functools.partial(torch.optim.AdamW, lr=3e-4),
                               config=config)
        EngineConfig.from_dict(tomllib.load(f)["engine"])   # {"strategy": ..., "checks": {...}}
    """

    strategy: str = option("replicate", _one_of(*all_strategies(), "auto"))
    """What each rank shards: ``"replicate"``, ``"zero1"``, ``"zero2"``, ``"zero3"``; the same stage
    inside a node's ranks, replicated across nodes: ``"hybrid-zero1"``, ``"hybrid-zero2"``,
    ``"hybrid-zero3"``; or ``"auto"``, the planner's pick of the fastest that fits ``memory_budget``
    (``engine.plan``)."""
    precision: str = option("fp32", _one_of(*PRECISIONS))
    """Autocast dtype of ``engine(x)``: ``"fp32"``, ``"bf16"`` or ``"fp16"`` (with dynamic loss
    scaling); parameters and optimizer state stay fp32."""
    grad_accum_steps: int | None = option(None, _int_at_least(1, "backward() calls per step()",
                                                              none="for 1"))
    """``backward()`` calls per ``step()``; the update is their mean (never divide the loss by it).
    None: 1, or auto's choice when ``strategy="auto"`` is given ``sample_batch=``."""
    clip_grad_norm: float | None = option(None, _number_above_0("the global L2 norm", optional=True))
    """Clip the gradients to this global L2 norm, as ``torch.nn.utils.clip_grad_norm_`` in one
    process; None: no clip."""
    loss_scaler: LossScaler | None = option(None, _loss_scaler)
    """fp16 only: the ``LossScaler`` to start from (the engine works on a copy); None: scale 2**16,
    halved on overflow, doubled after 2000 good steps, at least 1."""
    param_groups: ParamGroupsFn | None = option(None, _function("(name, param) -> dict of optimizer options"))
    """``(name, param) -> dict`` of optimizer overrides (weight-decay groups), seen on the whole
    parameter."""
    memory_budget: int | None = option(
        None, _int_at_least(1, "bytes per rank", none="for the device's memory less a margin"), agreed=False)
    """``"auto"`` only: bytes of process memory per rank the choice must fit (its resident peak on a
    CPU, its device memory on a GPU: libraries, allocator, auto's own probes and a margin for the
    plan's error included; where ranks pass different budgets, the smallest); None: the device's
    memory less a margin."""
    communication: CommunicationConfig = field(default_factory=CommunicationConfig)
    """Buckets, wire dtype, zero3 units, buffers and BatchNorm statistics."""
    checks: ChecksConfig = field(default_factory=ChecksConfig)
    """Non-finite steps and the replicated-batch check."""
    observation: ObservationConfig = field(default_factory=ObservationConfig)
    """The engine's own profiler trace."""

    def __post_init__(self) -> None:
        _check_fields(self)
        for name, group in GROUPS.items():
            value = getattr(self, name)
            if not isinstance(value, group):
                raise TypeError(f"{name}={value!r} must be a dspark.engine.config.{group.__name__}; or pass "
                                f"its options by name (EngineConfig().replace(bucket_mb=...))")
        if self.loss_scaler is not None and self.precision != "fp16":
            raise ValueError(f"loss_scaler={self.loss_scaler!r} with precision={self.precision!r}: only fp16 "
                             "scales its loss; pass precision='fp16', or leave loss_scaler out")
        group_size = self.communication.shard_group_size
        if group_size is not None and self.strategy != "auto" and not all_strategies()[self.strategy].hybrid:
            raise ValueError(f"shard_group_size={group_size!r} sizes a hybrid strategy's shard groups; "
                             f"strategy={self.strategy!r} shards over the whole world: pass strategy="
                             f"'hybrid-zero3' (or -zero1, -zero2) with it, or leave it out")
        if self.memory_budget is not None and self.strategy != "auto":
            raise ValueError(f"memory_budget={self.memory_budget!r} is what strategy='auto' plans with; with "
                             f"strategy={self.strategy!r} leave it out, or pass strategy='auto'")

    def replace(self, **options: Any) -> EngineConfig:
        """A copy with ``options`` changed, each by its own name (``bucket_mb=``, not
        ``communication=``...; a whole group goes by its group's name). An unknown name is a
        ``TypeError`` naming the nearest option.

        Example::

            EngineConfig(strategy="zero2").replace(precision="bf16", batch_check_every=None)
        """
        top, grouped = _by_group(options)
        for group, values in grouped.items():
            top[group] = dataclasses.replace(top.get(group, getattr(self, group)), **values)
        return dataclasses.replace(self, **top)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> EngineConfig:
        """The config ``values`` describe, as a TOML or JSON file holds it: options by name, each
        group's as a table of its own or by name at the top; ``reduce_dtype`` may be a dtype's name
        (``"bfloat16"``). :meth:`to_dict` writes the same shape.

        Example::

            EngineConfig.from_dict({"strategy": "zero2", "communication": {"bucket_mb": 50}})
        """
        if not isinstance(values, Mapping):
            raise TypeError(f"EngineConfig.from_dict takes a mapping of options by name (a TOML table, a JSON "
                            f"object), got {type(values).__name__}")
        flat: dict[str, Any] = {}
        for key, value in values.items():
            if key in GROUPS and isinstance(value, Mapping):
                for name, inner in value.items():
                    if GROUP_OF.get(name) != key:
                        raise ValueError(f"{key}.{name}: {key} has no option {name!r}; its options: "
                                         f"{', '.join(f.name for f in fields(GROUPS[key]))}")
                    flat[name] = inner
            else:
                flat[key] = value
        if isinstance(flat.get("reduce_dtype"), str):
            flat["reduce_dtype"] = _dtype_named(flat["reduce_dtype"])
        if isinstance(flat.get("loss_scaler"), Mapping):  # as to_dict writes it
            flat["loss_scaler"] = LossScaler(**flat["loss_scaler"])
        if isinstance(flat.get("trace_steps"), list):
            flat["trace_steps"] = tuple(flat["trace_steps"])
        return cls().replace(**flat)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain values (JSON and TOML can hold them), in :meth:`from_dict`'s shape; a
        function or a class given as an option is written as its name (a record, not reloadable).

        Example::

            json.dump(engine.config.to_dict(), f)   # next to a run's results
        """
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in GROUPS:
                out[f.name] = {g.name: _plain(getattr(value, g.name)) for g in fields(value)}
            else:
                out[f.name] = _plain(value)
        return out

    def agreed_settings(self) -> dict[str, Any]:
        """The options every rank must pass alike, by name, as comparable plain values (the engine
        compares them across ranks at construction).

        Example::

            EngineConfig().agreed_settings()["bucket_mb"]   # 25.0
        """
        return {name: _plain(value) for name, (f, value) in _walk(self) if f.metadata.get("agreed", True)}

    def options(self) -> dict[str, Any]:
        """Every option by its own name, with this config's value.

        Example::

            EngineConfig(strategy="zero2").options()["max_nonfinite_skips"]   # 20
        """
        return {name: value for name, (_, value) in _walk(self)}


def _walk(config: EngineConfig) -> Iterator[tuple[str, tuple[dataclasses.Field[Any], Any]]]:
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in GROUPS:
            for g in fields(value):
                yield g.name, (g, getattr(value, g.name))
        else:
            yield f.name, (f, value)


GROUP_OF: dict[str, str | None] = {
    **{f.name: None for f in fields(EngineConfig)},
    **{g.name: name for name, group in GROUPS.items() for g in fields(group)},
}
"""Every name :meth:`EngineConfig.replace` takes: an option's group (None: the top), or a group."""


def _by_group(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """``options`` split by where each lives: the top's (and whole groups), and each group's."""
    top: dict[str, Any] = {}
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in options.items():
        if name not in GROUP_OF:
            raise TypeError(_unknown(name))
        if (group := GROUP_OF[name]) is None:
            top[name] = value
        else:
            grouped.setdefault(group, {})[name] = value
    return top, grouped


_fields_init = EngineConfig.__init__


def _init_by_option_names(self: EngineConfig, **options: Any) -> None:
    """``EngineConfig(bucket_mb=50.0)`` as ``EngineConfig().replace(bucket_mb=50.0)``: every option by
    its own name, as the engine takes it, an unknown one named with the nearest."""
    top, grouped = _by_group(options)
    _fields_init(self, **top)
    for group, values in grouped.items():
        object.__setattr__(self, group, dataclasses.replace(getattr(self, group), **values))


setattr(EngineConfig, "__init__", _init_by_option_names)  # noqa: B010 (mypy forbids assigning a method)


def _unknown(name: str) -> str:
    near = difflib.get_close_matches(name, list(GROUP_OF), n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (f"dspark.Engine got an unexpected option {name!r}{hint} Its options: "
            f"{', '.join(n for n, g in GROUP_OF.items() if n not in GROUPS)}")


def _dtype_named(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"reduce_dtype={name!r} names no torch dtype; pass 'float32', 'bfloat16' or 'float16'")
    return value


def _plain(value: Any) -> Any:
    """``value`` as JSON and a comparison across ranks see it: names for dtypes, classes and
    functions (a function's identity differs per process), settings for a loss scaler."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, LossScaler):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, type) or callable(value):
        return f"<{getattr(value, '__qualname__', type(value).__name__)}>"
    return repr(value)


def spells_out_options(init: _Init) -> _Init:
    """``init``, whose ``**options`` are the options of :class:`EngineConfig`, with a signature that
    names each (keyword-only, with its default and type), so that ``inspect.signature``, ``help()``
    and editors list them; ``init`` itself is unchanged.

    Example::

        @spells_out_options
        def __init__(self, model, *, optimizer, config=None, **options): ...
    """
    signature = inspect.signature(init)
    kept = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    named = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=value, annotation=f.type)
             for name, (f, value) in _walk(EngineConfig())]
    init.__signature__ = signature.replace(parameters=[*kept, *named])  # type: ignore[attr-defined]
    return init


def loss_scaler_for(config: EngineConfig) -> LossScaler | None:
    """The loss scaler an engine built from ``config`` runs with: a copy of the config's (whose
    scale the engine then moves), a default one under fp16, else None; so one config can build
    several engines."""
    if config.precision != "fp16":
        return None
    return LossScaler() if config.loss_scaler is None else copy.copy(config.loss_scaler)
