"""Padding batches: what a rank gets when an epoch's last, partial global batch holds fewer samples
than there are ranks, and how the loader, the metrics and the engine count it.

[Note: padding batches] A rank that has no rows of a global batch (3 samples on 4 ranks, the last
sample of 101 at a global batch of 20 on 2 ranks) still runs the forward, as it must: under zero3
the forward's gathers pair up with the other ranks', and an evaluation step is collective. A batch
of zero rows would do for the collectives, but many models cannot run one (HuggingFace's GPT-2:
``cannot reshape tensor of 0 elements``). So such a rank gets one real sample of that global batch
(its first), collated like any batch, and marked as padding: ``loader.batch_info.padding`` is its
rows and ``loader.batch_info.local_size`` (the real rows) is 0. A batch is either all real or all
padding, never a mix, so "this rank's current batch is padding" says everything:

* :func:`dspark.gather_for_metrics` takes no rows from a rank whose current batch is padding, and
  :func:`dspark.reduce_metrics` weighs it 0, so per-batch metrics count every sample once;
* the engine counts a padding batch's forward as zero rows (an unweighted step with it is an
  ``UnequalBatchesError``, as a zero-row batch was), takes any ``engine.backward(loss, weight=...)``
  of it as 0 (``loader.batch_info.local_size``, or ``len(x)`` and a token count, which would read 1
  row and train the copy), and the replicated-batch check does not compare it (it is a copy of
  another rank's sample by design).

The current batch is the one a ``dspark.DataLoader`` of this process handed out last: a real batch
clears the mark, and so does the end of a pass. A loop that keeps every batch's rows to gather once
after the pass would count the padding copy too; a pass that ended on padding is therefore noted
(the rows it handed out, padding included) until the next batch, and the metrics refuse, on every
rank, a gather or a weight of exactly those rows.

Example::

    for x, y in val_loader:
        preds = dspark.gather_for_metrics(engine(x).argmax(-1))   # a padding rank adds no rows
"""

from __future__ import annotations

__all__ = ["current_batch_is_padding", "mark_current_batch", "mark_pass_end", "rows_with_padding"]

_padding = False
_pass_rows: int | None = None
"""The rows (padding included) of the last pass, when it handed out padding and no batch came since."""


def mark_current_batch(*, padding: bool) -> None:
    """Record whether the batch a loader hands out now is padding (see [Note: padding batches])."""
    global _padding, _pass_rows
    _padding = padding
    _pass_rows = None


def mark_pass_end(*, rows: int, padding_rows: int) -> None:
    """A loader's pass ended, having handed out ``rows`` rows of which ``padding_rows`` were padding."""
    global _padding, _pass_rows
    _padding = False
    _pass_rows = rows if padding_rows > 0 else None


def rows_with_padding() -> int | None:
    """The rows the last pass handed out, padding included, if it handed out padding and no batch
    came since: rows kept over that whole pass count another rank's sample twice.

    Example::

        rows_with_padding()   # 51 after a pass of 50 real rows and 1 padding row on this rank
    """
    return _pass_rows


def current_batch_is_padding() -> bool:
    """Whether the batch this process's ``dspark.DataLoader`` handed out last is padding.

    Example::

        if not current_batch_is_padding():
            predictions.append(logits.argmax(-1))
    """
    return _padding
