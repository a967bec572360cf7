"""The replay of one step's moments (:mod:`dspark.planner.peak_timeline`) on a made-up probe: no
process, no model run."""

from __future__ import annotations

import dataclasses

import torch

from dspark.planner.peak_timeline import step_peak
from dspark.planner.probe_record import Line, Probe, split_loss_backward

HEAD, BLOCK = ((1000, 250), torch.float32), ((250, 250), torch.float32)  # 1 MB root, 0.25 MB block
LOSS_BACKWARD_BYTES = 4_000_000


def _probe(loss_backward: Line | None) -> Probe:
    base = Probe.from_one_step(device="cpu", batch=1, forward_ms=1.0, backward_ms=1.0, optimizer_ms=1.0,
                               step_bytes=1e6, num_params=2, unit_bytes=[1, 1])
    flat = Line(fixed=100_000.0, per_sample=0.0)
    return dataclasses.replace(base, grad_events=(0, 1), interval_bytes=(flat,) * 6,
                               accumulation_bytes=(flat,) * 5, loss_backward_bytes=loss_backward)


def test_the_loss_backward_is_its_own_interval_in_the_probe() -> None:
    assert split_loss_backward([5.0, 9.0, 7.0, 3.0], [4.0, 6.0, 2.0], [-1, -2, -1]) == ([5.0, 7.0, 3.0],
                                                                                         [4.0, 2.0], 9.0)
    assert split_loss_backward([5.0, 7.0], [4.0], [-1]) == ([5.0, 7.0], [4.0], None)


def test_zero3_gathers_nothing_during_the_loss_backward() -> None:
    """zero3 frees the root after forward and gathers it again when the gradient reaches the model's
    output: the loss's own backward (a language model's logits and their gradients) is not added to
    the root's gathered head (the embedding model's zero3 read 9-17% high)."""
    peak = step_peak(trainable=[HEAD, BLOCK], units=[[0], [1]], unit_bytes=[1_000_000, 250_000],
                     probe=_probe(Line(fixed=float(LOSS_BACKWARD_BYTES), per_sample=0.0)), strategy="zero3",
                     num_ranks=2, micro_batch=1, bucket_mb=25.0, resident_bytes=0, grads_bytes=0)
    assert peak.peak_bytes == LOSS_BACKWARD_BYTES and peak.comm_buffer_bytes == 0, peak
