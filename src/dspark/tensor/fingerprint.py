"""Batch fingerprints: a few numbers per rank that tell whether two ranks hold the same input batch,
without moving or copying the data.

[Note: batch fingerprint] The seed's bug was a batch replicated on every rank when it should have been
split. Comparing the batches themselves would cost a copy of the data over the wire; comparing a
fingerprint costs one all-gather of ``FINGERPRINT_LEN`` float64 values. Each tensor leaf contributes
its element count, its sum, its sum of squares and a position-weighted sum of up to
``_SAMPLE_POSITIONS`` evenly spaced elements (so a permutation of the same rows still differs); the
leaves are folded with weights that depend on their position in the batch. Identical batches give
bit-identical fingerprints (the same arithmetic on the same values in the same order), different
batches collide only by accident of floating point, which on real data does not happen.

Empty batches (a rank with no samples) have no fingerprint worth comparing and never match.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from dspark.tensor.batch import batch_leaves

__all__ = ["FINGERPRINT_LEN", "batch_fingerprint", "identical_ranks"]

FINGERPRINT_LEN = 6
"""Values in one fingerprint: leaves, elements, then four folded statistics."""
_SAMPLE_POSITIONS = 4096


def _sample(t: torch.Tensor) -> torch.Tensor:
    """Up to ``_SAMPLE_POSITIONS`` evenly spaced elements of ``t`` in row-major order, as float64.
    ``torch.take`` reads them through the strides: no copy of a non-contiguous (channels_last)
    tensor, which ``reshape(-1)`` would make."""
    stride = max(1, t.numel() // _SAMPLE_POSITIONS)
    positions = torch.arange(0, t.numel(), stride, device=t.device)[:_SAMPLE_POSITIONS]
    return torch.take(t, positions).double()


def _leaf_stats(t: torch.Tensor, *, whole: bool) -> torch.Tensor:
    """``[sum, sum of squares, weighted sample sum, sample max]`` of one tensor, in float64; with
    ``whole=False`` the sum and the squares are the sample's too (no pass over the data)."""
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)  # a view: real and imaginary parts as the last dimension
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    sample = torch.nan_to_num(_sample(t))
    if not whole:
        total, squares = sample.sum(), sample.square().sum()
    else:
        total = t.sum(dtype=torch.float64)
        if t.is_floating_point():  # accumulated in float64 by the kernel, no float64 copy
            squares = torch.linalg.vector_norm(t, dtype=torch.float64).square()
        else:  # integer data (token ids): the sample's squares
            squares = sample.square().sum()
        # A NaN or an infinity in the data (a missing value) makes the sums NaN or infinite, alike for
        # any two such batches: they read 0 then (no copy, no host sync), and the sample's
        # statistics, taken with those values replaced, still tell the batches apart.
        total, squares = torch.nan_to_num(total, posinf=0.0, neginf=0.0), torch.nan_to_num(
            squares, posinf=0.0, neginf=0.0)
    weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
    return torch.stack([total, squares, (sample * weights.reciprocal().sqrt()).sum(),
                        sample.abs().max() if sample.numel() else total])


def batch_fingerprint(batch: Any, *, device: torch.device | None = None,
                      whole: bool = True) -> torch.Tensor:
    """A float64 vector of length :data:`FINGERPRINT_LEN` summarising every tensor in ``batch``; equal
    batches give equal vectors (see [Note: batch fingerprint]). It reads the data once and copies
    none of it. ``whole=False`` reads only the sampled positions (a few microseconds whatever the
    size): enough to tell a copy of a tensor from a different one, not two tensors that differ
    in a few elements.

    Example::

        batch_fingerprint((images, labels))   # tensor([2., 1.5e6, ...], dtype=torch.float64)
    """
    leaves = batch_leaves(batch)
    out_device = device or (leaves[0].device if leaves else torch.device("cpu"))
    folded = torch.zeros(4, dtype=torch.float64, device=out_device)
    numel = 0
    for index, leaf in enumerate(leaves):
        if leaf.numel() == 0:
            continue
        numel += leaf.numel()
        folded += _leaf_stats(leaf, whole=whole).to(out_device) * (1.0 + index / len(leaves))
    head = torch.tensor([float(len(leaves)), float(numel)], dtype=torch.float64, device=out_device)
    return torch.cat([head, folded])


def identical_ranks(fingerprints: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """Pairs ``(a, b)`` with ``a < b`` of ranks whose fingerprints are equal and non-empty: ranks that
    received the same batch.

    Example::

        identical_ranks([fp0, fp0.clone(), fp2])   # [(0, 1)]
    """
    # Compared bit for bit: the same arithmetic on the same values gives the same bits, NaN included
    # (NaN == NaN is False, so a comparison of values would call two copies of a batch different).
    values = [fp.detach().cpu().double() for fp in fingerprints]
    rows = [v.numpy().tobytes() for v in values]
    pairs = []
    for a in range(len(rows)):
        if values[a][1] == 0:  # no elements: nothing was received, nothing to compare
            continue
        for b in range(a + 1, len(rows)):
            if rows[a] == rows[b]:
                pairs.append((a, b))
    return pairs
