"""``BatchCheck``: the engine's runtime check that ranks are not all training on the same batch.

[Note: replicated batch check] The seed's bug, a batch replicated on every rank when it should be
split, mostly comes from data loading (a plain DataLoader with no sampler, the same seed on every
rank, ``shard_dim=REPLICATE``), where no placement check sees it. So the engine looks at what
actually reaches the model: on checked steps, each training forward's inputs as the engine records
them (see [Note: forward inputs] in :mod:`dspark.engine.inputs`) are fingerprinted
(:func:`dspark.tensor.fingerprint.batch_fingerprint`, a few float64 statistics: no copy of the
data), and at the first ``backward()`` of that step, before any gradient
exists, one all-gather of the fingerprints compares them. Every rank gathers the same values and
so reaches the same verdict: identical batches raise :class:`dspark.PlacementError` on every rank
at once (no rank hangs waiting for another). The first step this engine runs is checked, then every
``every`` steps (steps that are multiples of ``every``); other steps cost a step-count lookup. Only
forwards with autograd on are recorded: an evaluation under ``torch.no_grad()`` may rightly feed
every rank the same data. The last recorded inputs name the shapes in the error message.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dspark import comm
from dspark.data.padding import current_batch_is_padding
from dspark.engine.inputs import ForwardInputs
from dspark.errors import PlacementError
from dspark.tensor.fingerprint import FINGERPRINT_LEN, identical_ranks

__all__ = ["DEFAULT_BATCH_CHECK_EVERY", "BatchCheck", "InputLeaf", "replication_cost"]

DEFAULT_BATCH_CHECK_EVERY = 1000
"""Steps between two checks. The first step catches a wrong setup (it is wrong from the start); the
later checks catch a loader rebuilt wrongly mid-run (after an evaluation, on resume) at the cost of
one all-gather of 48 bytes and one host sync every 1000 steps (what that costs a step:
docs/figures.md#batch-check-cost)."""


@dataclass(frozen=True, slots=True)
class InputLeaf:
    """One tensor of the last input batch: its shape, dtype and bytes (what this rank holds)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


def replication_cost(pairs: list[tuple[int, int]], world_size: int) -> str:
    """What identical batches on the rank ``pairs`` cost, in words: all ranks alike, or some.

    Example::

        replication_cost([(0, 2)], 3)   # 'those ranks train on the same samples, so 3 ranks do the work of 2'
    """
    distinct = world_size - len({b for _, b in pairs})  # ranks that match no lower rank
    if distinct == 1:
        return f"every rank trains on the same samples, so {world_size} ranks do the work of one"
    return f"those ranks train on the same samples, so {world_size} ranks do the work of {distinct}"


class BatchCheck:
    """Checks, on the first step and every ``every`` steps after, that no two ranks feed the model
    the same input batch (see [Note: replicated batch check]). ``every`` None or 0 turns it off.

    Example::

        check = BatchCheck(every=1000, step_count=lambda: engine.step_count)
        check.record(ForwardInputs.of(x), (x,), {})   # fingerprinted on a checked step
        check.before_backward()        # compares across ranks; raises dspark.PlacementError if equal
    """

    def __init__(self, *, every: int | None, step_count: Callable[[], int]) -> None:
        self.every = every or 0
        self._world = comm.get_world()
        self._step_count = step_count
        self._next_check: int | None = None  # None: the first step this engine runs is checked
        self._fingerprint: torch.Tensor | None = None
        self._last: ForwardInputs | None = None
        self.checks = 0
        """How many comparisons ran."""
        self._warned_blind = False
        self.enabled = bool(self.every) and self._world.world_size > 1
        """Whether steps are checked (``every`` set, and more than one rank to compare)."""

    @property
    def last_inputs(self) -> list[InputLeaf]:
        """Shapes, dtypes and bytes of the tensors of the last input batch (with autograd on)."""
        leaves = () if self._last is None else self._last.leaves
        return [InputLeaf(tuple(t.shape), t.dtype, t.numel() * t.element_size()) for t in leaves]

    def _due(self) -> bool:
        return self._next_check is None or self._step_count() >= self._next_check

    def record(self, inputs: ForwardInputs, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A training forward's recorded ``inputs`` (and the arguments they came from, for a warning
        when they hold no tensor)."""
        if not self.enabled:
            return
        self._last = inputs
        if current_batch_is_padding():  # a copy of another rank's sample by design: compared with none
            self._fingerprint = None
            return
        if self._due():  # the last forward before the step's first backward is the one compared
            self._fingerprint = inputs.fingerprint(device=self._world.device)
            if not inputs.leaves and (args or kwargs) and not self._warned_blind:
                self._warned_blind = True
                kinds = ", ".join(sorted({type(v).__name__ for v in (*args, *kwargs.values())}))
                warnings.warn(
                    f"dspark.Engine: the replicated-batch check finds no tensor in the model's inputs "
                    f"({kinds}), so it cannot tell whether every rank got the same batch. Pass the "
                    f"tensors in tuples, lists, dicts or dataclasses, or batch_check_every=None to "
                    f"turn the check off knowingly", stacklevel=2)

    def before_backward(self) -> None:
        """Compare the recorded fingerprints across ranks if this step is checked. Every rank calls it
        at the same backward, so the all-gather always meets; a rank that recorded nothing sends an
        empty fingerprint, which matches none."""
        if not self.enabled or not self._due():
            return
        step = self._step_count()
        mine = self._fingerprint
        if mine is None:
            mine = torch.zeros(FINGERPRINT_LEN, dtype=torch.float64, device=self._world.device)
        self._fingerprint = None
        self._next_check = (step // self.every + 1) * self.every
        self.checks += 1
        pairs = identical_ranks(comm.all_gather(mine, label="dspark.batch_check.all_gather"))
        if pairs:
            raise PlacementError(self._message(step, pairs))

    def _message(self, step: int, pairs: list[tuple[int, int]]) -> str:
        same = ", ".join(f"{a} and {b}" for a, b in pairs[:6]) + (" ..." if len(pairs) > 6 else "")
        shapes = "" if self._last is None else self._last.describe()
        cost = replication_cost(pairs, self._world.world_size)
        return (
            f"rank {self._world.rank}: ranks {same} fed the model identical input batches at step "
            f"{step} (this rank's inputs: {shapes or 'no tensors'}): {cost}. Likely causes and fixes:\n"
            f"  1. a torch.utils.data.DataLoader with no sampler: every rank reads the same batches. "
            f"Use dspark.DataLoader(dataset, global_batch_size=...) (or a DistributedSampler, with "
            f"set_epoch every epoch).\n"
            f"  2. every rank generates its data with the same random seed: build the global batch "
            f"once and split it with dspark.distribute_batch(batch, shard_dim=0), or seed by rank.\n"
            f"  3. dspark.distribute_batch(batch, shard_dim=dspark.REPLICATE): use shard_dim=0.\n"
            f"If identical inputs on every rank are intended, pass batch_check_every=None to "
            f"dspark.Engine.")
