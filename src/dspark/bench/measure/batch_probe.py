"""What each rank's model really received: fingerprints of the inputs of the root module and of every
submodule, compared across ranks.

[Note: batch probe] The seed's bug was a batch replicated on every rank. The lab does not trust the
configuration to say whether that happened: for two untimed training steps it puts a forward
pre-hook on every module of the model (the root first), fingerprints the tensors each call receives
(:func:`dspark.tensor.fingerprint.batch_fingerprint`: a few numbers, no copy of the data; the
root's inputs read whole, a submodule's sampled), and all ranks exchange their fingerprints. Three facts come out:

* ``samples_by_rank``: how many samples (rows of the first input) each rank's model received in
  the step, over every pass (a step in micro-batches calls the model once per micro-batch);
* ``identical_input_ranks``: ranks whose models received the very same batch;
* ``replicated_modules``: modules inside the model that received the same *batch-derived* input
  on two ranks although the model's own inputs differed: a replication in the model's code (a
  gather of the whole batch, a global buffer). An input counts as batch-derived when it changed
  between the two steps (which feed different batches); inputs that do not depend on the batch
  (position ids, masks) are the same on every rank by design and are left out.

Everything here runs outside the timed steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dspark.engine.for_the_lab import batch_fingerprint, batch_leaves, identical_ranks

__all__ = ["BatchInspection", "BatchProbe", "compare_ranks", "inspect_batches"]

_MAX_MODULES_LISTED = 5

# (module name, call index within the step): a module called twice per forward has two keys.
CallKey = tuple[str, int]
StepPrints = dict[CallKey, tuple[float, ...]]


@dataclass(frozen=True, kw_only=True, slots=True)
class BatchInspection:
    """What the ranks' models received, measured (see [Note: batch probe])."""

    samples_by_rank: list[int]
    """Rows of the first tensor each rank's root module received per step, over all its calls
    (a step run in micro-batches calls the root once per micro-batch)."""
    identical_input_ranks: list[list[int]] = field(default_factory=list)
    """``[a, b]`` pairs of ranks whose root module received the same batch."""
    replicated_modules: list[str] = field(default_factory=list)
    """The outermost modules (up to 5) that received the same batch-derived input on two ranks
    while the root's inputs differed."""
    replicated_module_count: int = 0
    """How many module calls matched in that way, listed or not."""


class BatchProbe:
    """Forward pre-hooks that fingerprint every module call's tensor inputs, one step at a time.

    Example::

        probe = BatchProbe(engine.module)
        train_step(batch_a); first = probe.take()
        train_step(batch_b); second = probe.take()
        probe.close()
    """

    def __init__(self, root: nn.Module, *, submodules: bool = True) -> None:
        self._prints: StepPrints = {}
        self._calls: dict[str, int] = {}
        self._samples: int | None = None
        modules = root.named_modules() if submodules else [("", root)]
        self._handles = [module.register_forward_pre_hook(self._hook(name), with_kwargs=True)
                         for name, module in modules]

    def _hook(self, name: str) -> Callable[..., None]:
        def record(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            leaves = batch_leaves((args, kwargs))
            if not leaves:
                return
            index = self._calls.get(name, 0)
            self._calls[name] = index + 1
            with torch.no_grad():
                # the root's inputs are read whole; a submodule's activations are sampled, which
                # tells a replicated input from a different one without a pass over each activation
                # (read whole, they cost more than the step itself on an image model)
                self._prints[(name, index)] = tuple(batch_fingerprint(leaves, whole=not name).tolist())
            if name == "":  # every pass of the step: micro-batches add up to the rank's share
                first = leaves[0]
                self._samples = (self._samples or 0) + (int(first.shape[0]) if first.dim() else 1)
        return record

    def take(self) -> tuple[int, StepPrints]:
        """``(samples the root received, fingerprints by call)`` of the step since the last take."""
        out = (self._samples or 0, self._prints)
        self._prints, self._calls, self._samples = {}, {}, None
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def compare_ranks(first: Sequence[StepPrints], second: Sequence[StepPrints],
                  samples_by_rank: Sequence[int]) -> BatchInspection:
    """Judge the fingerprints of two steps from every rank (index = rank); pure, no process group.

    Example::

        compare_ranks([a0, a1], [b0, b1], [16, 16]).identical_input_ranks   # [[0, 1]] if replicated
    """
    root = ("", 0)

    def as_tensor(prints: tuple[float, ...] | None) -> torch.Tensor:
        return torch.tensor(prints if prints is not None else (), dtype=torch.float64)

    root_pairs = identical_ranks([as_tensor(p.get(root)) for p in first]) if all(
        root in p for p in first) else []
    root_identical = {tuple(pair) for pair in root_pairs}
    keys = [key for key in first[0] if all(key in p for p in (*first, *second))] if first else []
    matched: list[str] = []
    for key in keys:
        if key == root:
            continue
        derived = [first[r][key] != second[r][key] for r in range(len(first))]
        pairs_a = identical_ranks([as_tensor(p[key]) for p in first])
        pairs_b = {tuple(pair) for pair in identical_ranks([as_tensor(p[key]) for p in second])}
        if any(derived[a] and derived[b] and (a, b) in pairs_b and (a, b) not in root_identical
               for a, b in pairs_a):
            matched.append(key[0])
    # Outermost first: a module whose parent is already listed adds nothing.
    outermost: list[str] = []
    for name in dict.fromkeys(matched):
        if not any(name.startswith(parent + ".") for parent in outermost):
            outermost.append(name)
    return BatchInspection(samples_by_rank=list(samples_by_rank),
                           identical_input_ranks=[list(pair) for pair in root_pairs],
                           replicated_modules=outermost[:_MAX_MODULES_LISTED],
                           replicated_module_count=len(matched))


def inspect_batches(root: nn.Module, steps: Sequence[Callable[[], object]],
                    all_gather_object: Callable[[Any], list[Any]], *,
                    submodules: bool = True) -> BatchInspection:
    """Run the two training ``steps`` (different batches) under a :class:`BatchProbe` on ``root``
    and compare what every rank's modules received. Every rank must call it. ``submodules=False``
    probes the root only (one rank: there is no other rank to compare a submodule's input with).

    Example::

        inspection = inspect_batches(engine.module, [lambda: step(a), lambda: step(b)],
                                     comm.all_gather_object)
    """
    if len(steps) != 2:
        raise ValueError(f"steps has {len(steps)} entries; the probe compares exactly two steps")
    probe = BatchProbe(root, submodules=submodules)
    try:
        steps[0]()
        samples, first = probe.take()
        steps[1]()
        _, second = probe.take()
    finally:
        probe.close()
    everyone = all_gather_object((samples, first, second))
    return compare_ranks([e[1] for e in everyone], [e[2] for e in everyone],
                         [int(e[0]) for e in everyone])
