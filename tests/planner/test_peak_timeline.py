"""The replay of one step's moments (:mod:`dspark.planner.peak_timeline`) on a made-up probe: no
process, no model run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.planner.cost import row_transport
from dspark.planner.interconnect import get_interconnect
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


def _zero3_peak(transport: str, events: int = 3) -> int:
    flat = Line(fixed=100_000.0, per_sample=0.0)
    base = Probe.from_one_step(device="cpu", batch=1, forward_ms=1.0, backward_ms=1.0, optimizer_ms=1.0,
                               step_bytes=1e6, num_params=events, unit_bytes=[1] * events)
    probe = dataclasses.replace(base, grad_events=tuple(reversed(range(events))), interval_bytes=(flat,) * (events + 4),
                                accumulation_bytes=(flat,) * (events + 3))
    return step_peak(trainable=[HEAD, *[BLOCK] * (events - 1)], units=[[i] for i in range(events)],
                     unit_bytes=[1_000_000, *[250_000] * (events - 1)], probe=probe, strategy="zero3",
                     num_ranks=2, micro_batch=1, bucket_mb=25.0, resident_bytes=0, grads_bytes=0,
                     transport=transport).peak_bytes


def test_collectives_through_a_process_group_hold_a_copy_more() -> None:
    """gpt2-cpu's zero3 on 4 ranks of two launches (gloo, no shared memory) measured 124-131 MB against
    113 MB planned: a gather packs every rank's shards in a buffer of its own until it is waited on,
    and gloo's reduce-scatter runs as an all-to-all into a scratch of the bucket's size. On the made-up
    model (a 1 MB root, two 0.25 MB blocks, one bucket of 1.5 MB) the bucket's scratch lands beside its
    send buffer; a GPU (nccl) packs its gathers but reduce-scatters in place."""
    shm, nccl, gloo = (_zero3_peak(t) for t in ("shm", "nccl", "gloo"))
    assert nccl - shm == 250_000 + 125_000, (shm, nccl)  # the block gathered ahead: packed + its shard sent
    # launching the bucket: its shards, send buffer and the root (2.35 MB) and now its 1.5 MB scratch
    assert gloo == 2_350_000 + 1_500_000 > shm, (shm, gloo)


def test_a_row_knows_how_its_collectives_travel(monkeypatch: pytest.MonkeyPatch) -> None:
    one_machine, two_nodes = get_interconnect("loopback-gloo"), get_interconnect("nvlink+roce-200g")
    monkeypatch.delenv("DSPARK_SHM", raising=False)
    assert row_transport("cpu", one_machine, 4, 4) == "shm"  # dspark run --nproc 4: shared memory
    monkeypatch.setenv("DSPARK_SHM", "0")  # the run's own switch: gloo for everything
    assert row_transport("cpu", one_machine, 4, 4) == "gloo"
    monkeypatch.delenv("DSPARK_SHM")
    assert row_transport("cpu", one_machine, 4, 2) == "gloo"  # hybrid shard groups: subgroups
    assert row_transport("cpu", two_nodes, 16, 16) == "gloo"  # a world over two nodes of 8
    assert row_transport("cpu", two_nodes, 8, 8) == "shm"
    assert row_transport("cuda:0", one_machine, 4, 4) == "nccl"


def test_zero3_through_a_process_group_regathers_its_root_beside_the_loss_backward() -> None:
    """Where the gradient reaches the model's output the root's gather starts, and on a process group
    its packed buffer and shards sent are held with it until backward reaches the root: embed-untied's
    zero3 on 4 gloo ranks without shared memory measured 282-298 MB against 210 MB planned."""
    def peak(transport: str) -> int:
        return step_peak(trainable=[HEAD, BLOCK], units=[[0], [1]], unit_bytes=[1_000_000, 250_000],
                         probe=_probe(Line(fixed=float(LOSS_BACKWARD_BYTES), per_sample=0.0)), strategy="zero3",
                         num_ranks=2, micro_batch=1, bucket_mb=25.0, resident_bytes=0, grads_bytes=0,
                         transport=transport).peak_bytes
    assert peak("shm") == LOSS_BACKWARD_BYTES  # shared memory lands the gather in place, after the loss
    assert peak("nccl") == LOSS_BACKWARD_BYTES + 1_000_000 + 1_000_000 + 500_000  # storage, packed, own shard
    # gloo's all-gather allocates an output of its own while it runs: embed-untied read 241 MB, 282-286 measured
    assert peak("gloo") == peak("nccl") + 1_000_000
