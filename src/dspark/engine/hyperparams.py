"""The ranks' optimizer hyper-parameters agree at every step, or every rank stops.

[Note: hyper-parameters in step] Ranks kept in step (see [Note: ranks in step] in
:mod:`dspark.engine.window`) run the same window of the same step, but each rank's optimizer
applies its own ``param_groups``: a line that sets ``lr`` on some ranks only (under ``if
master_process:``, or from a value computed per rank) makes replicate's copies of the model part
(every rank then exports another model) and makes zero1-3 step one rank's rows with other values,
all without an error. So each window's reduction also carries a fingerprint of this rank's
hyper-parameters: every entry of every param group except ``params`` (``lr``, ``betas``,
``weight_decay``, ``eps``, ``momentum``, ... whatever the optimizer keeps there; an object of the
program's, such as a function, by its repr without the memory address), in one float64 of
the small vector the reduction all-reduces anyway ([Note: step extras] in
:mod:`dspark.engine.grad_reducer`): no extra collective. Fingerprints that differ are a
``ValueError`` on every rank (each sees every fingerprint), after one gather of the values that
names the group, the key and each rank's value. The values are read when the window's last
``backward()`` reduces it: a change made after that, before ``step()``, is compared at the next
step. A hyper-parameter held in a tensor on an accelerator is left out (reading it would wait for
the device at every step).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import torch

from dspark import comm

__all__ = ["check_same_hyperparameters", "differences", "fingerprint", "hyperparameters"]

_FINGERPRINT_BYTES = 6  # 48 bits: exact in a float64, and a chance of 2**-48 to miss a difference
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _value(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if value.device.type != "cpu" or value.numel() != 1:
            return None  # not read: see the note
        return value.item()
    if isinstance(value, list | tuple):
        return tuple(_value(v) for v in value)
    if isinstance(value, dict):
        return {key: _value(v) for key, v in value.items()}
    if value is None or isinstance(value, int | float | complex | str | bytes):
        return value
    # an object of the program's (a function, an instance of its class): its repr names its address,
    # which differs on every process; compared (and gathered, picklable) as that repr without it
    return _ADDRESS.sub("", repr(value))


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's entries but ``params``, as plain values (see [Note: hyper-parameters in
    step]).

    Example::

        hyperparameters(torch.optim.SGD([w], lr=0.1))[0]["lr"]   # 0.1
    """
    return [{key: _value(value) for key, value in sorted(group.items()) if key != "params"}
            for group in optimizer.param_groups]


def fingerprint(optimizer: torch.optim.Optimizer) -> int:
    """48 bits of :func:`hyperparameters`, the same on every process for the same values.

    Example::

        fingerprint(opt) == fingerprint(copy_of_opt)   # True
    """
    text = repr(hyperparameters(optimizer)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=_FINGERPRINT_BYTES).digest(), "big")


def differences(per_rank: Sequence[Sequence[dict[str, Any]]]) -> list[str]:
    """What differs between the ranks' :func:`hyperparameters` (index = rank): one line per group
    and key, naming each rank's value.

    Example::

        differences([[{"lr": 0.1}], [{"lr": 1.0}]])   # ["param group 0 'lr': 0.1 on rank 0, 1.0 on rank 1"]
    """
    counts = [len(groups) for groups in per_rank]
    if len(set(counts)) > 1:
        return ["param groups: " + ", ".join(f"{c} on rank {r}" for r, c in enumerate(counts))]
    found = []
    for index in range(counts[0] if counts else 0):
        keys = sorted({key for groups in per_rank for key in groups[index]})
        for key in keys:
            values = [groups[index].get(key, "(not set)") for groups in per_rank]
            if any(v != values[0] for v in values[1:]):
                found.append(f"param group {index} {key!r}: "
                             + ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values)))
    return found


def check_same_hyperparameters(fingerprints: Sequence[int], optimizer: torch.optim.Optimizer, *,
                               rank: int) -> None:
    """Raise ``ValueError`` on every rank unless every rank's fingerprint (index = rank) is the same:
    then one gather of the values, to name them. Every rank sees the same fingerprints, so every rank
    gathers and raises alike.

    Example::

        check_same_hyperparameters([fingerprint(opt)] * 2, opt, rank=0)   # agrees: nothing happens
    """
    if len(set(fingerprints)) <= 1:
        return
    per_rank = comm.all_gather_object(hyperparameters(optimizer), label="dspark.hyperparameters.all_gather")
    found = differences(per_rank) or ["values that print alike (a float and an int, or a NaN)"]
    raise ValueError(
        f"rank {rank}: the ranks' optimizers step with different hyper-parameters ({'; '.join(found[:6])}"
        f"{' ...' if len(found) > 6 else ''}): under replicate each rank's copy of the model would "
        "part from the others', under zero1-3 each rank's rows would be stepped with its own values. "
        "A line changed optimizer.param_groups on some ranks only (under `if master_process:`, or with "
        "a value computed from the rank, such as a ReduceLROnPlateau stepped on each rank's own loss): "
        "set them on every rank alike (the same schedule, the same value; a metric a scheduler reads "
        "reduced over the ranks first, with dspark.reduce_metrics), e.g. `for g in "
        "engine.optimizer.param_groups: g['lr'] = lr` on every rank")
