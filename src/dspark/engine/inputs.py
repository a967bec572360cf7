"""A training forward's inputs, walked once and read by whoever needs them.

[Note: forward inputs] The engine registers one forward pre-hook on the root module. On each forward
with autograd on (an evaluation under ``torch.no_grad()`` may rightly feed every rank the same data,
and a recomputation inside backward is not a new batch), it walks the inputs once
(:func:`dspark.tensor.batch.batch_leaves`) into a :class:`ForwardInputs`: detached references to the
tensors, no copy and no pass over the data. Its readers: the accumulation window counts the rows
(dim 0 of the first tensor) for the unequal-batch check of the reduction; the batch check
fingerprints it on a checked step (:mod:`dspark.engine.batch_check`); ``engine.audit()`` reports the
last one's bytes and fingerprints it when asked (:mod:`dspark.engine.audit`). The previous record is
dropped when the next forward starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dspark.engine.compile_boundary import outside_compile
from dspark.tensor.batch import batch_leaves
from dspark.tensor.fingerprint import batch_fingerprint

__all__ = ["ForwardInputs", "InputRecorder", "Reader"]


@dataclass(frozen=True, slots=True)
class ForwardInputs:
    """The tensors of one forward's arguments, detached (no autograd graph is held), in the walker's
    order. A tensor overwritten in place after its forward is read as it is when a reader asks.

    Example::

        inputs = ForwardInputs.of(((images,), {"labels": labels}))
        inputs.rows, inputs.nbytes      # images.shape[0], bytes of both tensors
    """

    leaves: tuple[torch.Tensor, ...]

    @classmethod
    def of(cls, batch: Any) -> ForwardInputs:
        return cls(tuple(t.detach() for t in batch_leaves(batch)))

    @property
    def rows(self) -> int | None:
        """Samples in the batch: dim 0 of its first tensor (None: no tensor, or a 0-d one)."""
        if not self.leaves or self.leaves[0].dim() == 0:
            return None
        return int(self.leaves[0].shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors (not of larger tensors they may be views of)."""
        return sum(t.numel() * t.element_size() for t in self.leaves)

    def fingerprint(self, device: torch.device | None = None) -> torch.Tensor:
        """:func:`~dspark.tensor.fingerprint.batch_fingerprint` of the tensors, read now."""
        return batch_fingerprint(list(self.leaves), device=device)

    def describe(self, limit: int = 4) -> str:
        """The first ``limit`` tensors' shapes and dtypes, e.g. ``(8, 6) float32``."""
        return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in self.leaves[:limit])


Reader = Callable[[ForwardInputs, tuple[Any, ...], dict[str, Any]], None]
"""Takes a forward's recorded inputs, and the arguments they were walked from."""


class InputRecorder:
    """The engine's root forward pre-hook (see [Note: forward inputs]): records each training
    forward's inputs and hands them to ``readers``, then runs ``before_training_forward`` (the
    buffer broadcast) when the module is in training mode.

    Example::

        recorder = InputRecorder(model, readers=[check.record], in_backward=lambda: False)
        model(x)
        recorder.last.rows              # x.shape[0]
    """

    def __init__(self, module: nn.Module, *, readers: list[Reader],
                 in_backward: Callable[[], bool],
                 before_training_forward: Callable[[], None] | None = None) -> None:
        self.last: ForwardInputs | None = None
        """The last training forward's inputs holding a tensor (what the audit reports)."""
        self._readers = readers
        self._in_backward = in_backward
        self._before_training_forward = before_training_forward
        self._handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    @outside_compile
    def _record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._in_backward() or not torch.is_grad_enabled():
            return
        inputs = ForwardInputs.of((args, kwargs))
        if inputs.leaves:
            self.last = inputs
        for read in self._readers:
            read(inputs, args, kwargs)
        if self._before_training_forward is not None and module.training:
            self._before_training_forward()

    def remove(self) -> None:
        self._handle.remove()
        self.last = None
