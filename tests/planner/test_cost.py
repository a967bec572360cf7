"""[Note: what each strategy sends], checked on a made-up probe and link (no process, no model run)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from dspark.cpu_malloc import mmap_threshold_bytes
from dspark.planner import Interconnect, Probe, RowCost, model_shape
from dspark.planner.co_run import CoRun
from dspark.planner.cost import fresh_map_ms, row_cost


def _model() -> nn.Module:
    return nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))


def _probe(copy_bytes_per_s: float = 0.0) -> Probe:
    base = Probe.from_one_step(device="cpu", batch=8, forward_ms=100.0, backward_ms=200.0, optimizer_ms=40.0,
                               step_bytes=1e6, num_params=8, unit_bytes=[0, 1, 1, 1, 1])
    return Probe(**{**{f: getattr(base, f) for f in base.__dataclass_fields__},
                    "copy_bytes_per_s": copy_bytes_per_s})


def _cost(strategy: str, link: Interconnect, probe: Probe | None = None, bucket_mb: float = 25.0):
    shape = model_shape(_model(), (2, True))
    return row_cost(shape=shape, probe=probe or _probe(), strategy=strategy, num_ranks=2, micro_batch=8,
                    passes=1, bucket_mb=bucket_mb, link=link)


SERIAL = Interconnect(name="serial", bytes_per_s=1e9, latency_s=0.0, overlaps_compute=False, source="by hand")


def test_each_strategy_is_charged_its_own_wire_bytes_on_a_link_without_overlap() -> None:
    grads = 4 * (4 * 512 * 512 + 4 * 512)  # 4 MiB-ish of fp32 gradients
    half_ms = 1e3 * 0.5 * grads / 1e9      # a 2-rank reduce-scatter or all-gather of them
    replicate = _cost("replicate", SERIAL).comm_exposed_ms
    assert replicate == pytest.approx(2 * half_ms, rel=1e-3)                     # all-reduce
    assert _cost("zero1", SERIAL).comm_exposed_ms == pytest.approx(3 * half_ms, rel=1e-3)  # + row gather
    assert _cost("zero2", SERIAL).comm_exposed_ms == pytest.approx(2 * half_ms, rel=1e-3)  # rs + gather
    zero3 = _cost("zero3", SERIAL).comm_exposed_ms  # rs + every unit gathered in forward and in backward
    assert zero3 == pytest.approx(3 * half_ms, rel=1e-2)


def test_the_count_of_collectives_costs_latency() -> None:
    slow_calls = Interconnect(name="calls", bytes_per_s=1e12, latency_s=1e-3, overlaps_compute=False,
                              source="by hand")
    one_bucket = _cost("replicate", slow_calls).comm_exposed_ms
    many = _cost("replicate", slow_calls, bucket_mb=1.0).comm_exposed_ms  # a bucket per weight
    assert many > one_bucket + 2 * 2 * 1.0 * 0.99  # each extra all-reduce: 2 (N-1) hops of 1 ms
    # zero3: 5 units gathered twice (1 ms each), a reduce-scatter, the step's small all-reduce and the
    # non-finite flag's (shards reduced: the engine all-reduces the flag before the step)
    assert _cost("zero3", slow_calls).comm_exposed_ms == pytest.approx(10 + 1 + 2 + 2, rel=1e-2)
    assert _cost("zero1", slow_calls).comm_exposed_ms == pytest.approx(2 + 1 + 2, rel=1e-2)  # no flag


def test_the_engines_copies_cost_what_the_probe_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    probe = _probe(copy_bytes_per_s=1e9)
    grads_ms = 1e3 * 4 * (4 * 512 * 512 + 4 * 512) / 1e9
    # replicate: each fresh gradient copied into the one bucket's flat buffer; a bucket of one
    # parameter adopts its gradient as the buffer: no copy
    extra = _cost("replicate", SERIAL, probe).comm_exposed_ms - _cost("replicate", SERIAL).comm_exposed_ms
    assert extra == pytest.approx(grads_ms, rel=1e-3)
    alone = _cost("replicate", SERIAL, probe, bucket_mb=1e-6).comm_exposed_ms
    assert alone == _cost("replicate", SERIAL, bucket_mb=1e-6).comm_exposed_ms
    # zero2: the send buffer; through shared memory the updated rows are gathered straight into the
    # parameters (every one of them splits evenly), through a process group packed and landed
    extra = _cost("zero2", SERIAL, probe).comm_exposed_ms - _cost("zero2", SERIAL).comm_exposed_ms
    assert extra == pytest.approx(grads_ms, rel=1e-3)
    with monkeypatch.context() as gloo:
        gloo.setenv("DSPARK_SHM", "0")
        extra = _cost("zero2", SERIAL, probe).comm_exposed_ms - _cost("zero2", SERIAL).comm_exposed_ms
        assert extra == pytest.approx(2 * grads_ms, rel=1e-3)
    assert Probe.from_dict({**{f: getattr(probe, f) for f in probe.__dataclass_fields__},
                            "forward_ms": {"fixed": 0.0, "per_sample": 1.0},
                            "backward_ms": {"fixed": 0.0, "per_sample": 1.0},
                            "step_bytes": {"fixed": 0.0, "per_sample": 1.0}}).copy_bytes_per_s == 1e9


def test_each_of_the_engines_copies_pays_the_probes_per_copy_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: per-copy cost]: the engine copies one parameter at a time, so a model of many small
    parameters pays the fixed cost of a copy more often than one of the same bytes in few."""
    many = nn.Sequential(*(nn.Linear(64, 64) for _ in range(32)))  # 64 parameters of 133,120 elements
    few = nn.Linear(4159, 32)  # 2 parameters, the same elements

    def extra_ms(model: nn.Module, strategy: str) -> float:
        with torch.device("meta"):
            shape = model_shape(model, (2, True))
        base = Probe.from_one_step(device="cpu", batch=8, forward_ms=100.0, backward_ms=200.0, optimizer_ms=40.0,
                                   step_bytes=1e6, num_params=len(shape.trainable), unit_bytes=[1])

        def exposed(probe: Probe) -> float:
            return row_cost(shape=shape, probe=probe, strategy=strategy, num_ranks=2, micro_batch=8, passes=1,
                            bucket_mb=25.0, link=SERIAL).comm_exposed_ms
        return exposed(dataclasses.replace(base, per_copy_s=1e-5)) - exposed(base)

    per_copy_ms = 1e-2
    for strategy in ("replicate", "zero2"):  # each fresh gradient into its bucket; each one packed
        assert extra_ms(many, strategy) == pytest.approx(64 * per_copy_ms, rel=1e-6)
        assert extra_ms(few, strategy) == pytest.approx(2 * per_copy_ms, rel=1e-6)
    with monkeypatch.context() as gloo:  # zero2's rows packed (1 copy per parameter) and landed (1 more)
        gloo.setenv("DSPARK_SHM", "0")
        assert extra_ms(many, "zero2") == pytest.approx(3 * 64 * per_copy_ms, rel=1e-6)


def test_a_probe_kept_before_the_per_copy_cost_loads_without_it() -> None:
    kept = json.loads(json.dumps(dataclasses.asdict(dataclasses.replace(_probe(), per_copy_s=2e-6))))
    assert Probe.from_dict(kept).per_copy_s == 2e-6
    del kept["per_copy_s"]
    assert Probe.from_dict(kept).per_copy_s == 0.0


def test_zero1_gathers_the_rows_of_evenly_split_parameters_in_place_through_shared_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: rows gathered in place]: no copies and no buffers where every parameter of a bucket
    splits into equal rows and the collective runs through shared memory; a bucket with a padded
    parameter (511 rows on 2 ranks) packs and lands, as through a process group."""
    probe = _probe(copy_bytes_per_s=1e9)

    def row(rows: int) -> RowCost:
        with torch.device("meta"):
            shape = model_shape(nn.Sequential(nn.Linear(512, 512), nn.Linear(512, rows)), (2, True))
        return row_cost(shape=shape, probe=probe, strategy="zero1", num_ranks=2, micro_batch=8, passes=1,
                        bucket_mb=25.0, link=SERIAL)

    shm_even, shm_odd = row(512), row(511)
    with monkeypatch.context() as gloo:
        gloo.setenv("DSPARK_SHM", "0")
        gloo_even, gloo_odd = row(512), row(511)
    rows_ms = 1e3 * 4 * (2 * 512 * 512 + 2 * 512) / 1e9  # the pack and landing of every row
    assert gloo_even.comm_exposed_ms - shm_even.comm_exposed_ms == pytest.approx(rows_ms, rel=1e-3)
    assert gloo_odd.comm_exposed_ms == pytest.approx(shm_odd.comm_exposed_ms)
    assert gloo_even.peak_bytes > shm_even.peak_bytes  # the send and receive buffers after the step
    assert gloo_odd.peak_bytes == shm_odd.peak_bytes


def test_the_gradient_check_pass_costs_a_ranks_own_gradients_at_the_measured_rate() -> None:
    base = _probe()
    probe = Probe(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "check_bytes_per_s": 1e9})
    grads_ms = 1e3 * 4 * (4 * 512 * 512 + 4 * 512) / 1e9
    shape = model_shape(_model(), (2, True))

    def extra(strategy: str, ranks: int) -> float:
        def step_ms(p: Probe) -> float:
            row = row_cost(shape=shape, probe=p, strategy=strategy, num_ranks=ranks, micro_batch=8, passes=1,
                           bucket_mb=25.0, link=SERIAL)
            return row.compute_ms + row.comm_exposed_ms + row.optimizer_ms
        return step_ms(probe) - step_ms(base)
    assert extra("replicate", 1) == pytest.approx(grads_ms, rel=1e-3)  # one rank checks its gradients too
    assert extra("zero1", 2) == pytest.approx(grads_ms, rel=1e-3)      # whole gradients reduced
    assert extra("zero2", 2) == pytest.approx(grads_ms / 2, rel=1e-3)  # its shards only
    assert extra("zero3", 2) == pytest.approx(grads_ms / 2, rel=1e-3)
    one_round = Probe(**{**{f: getattr(probe, f) for f in probe.__dataclass_fields__},
                         "forward_ms_rounds": (probe.forward_ms,), "backward_ms_rounds": (probe.backward_ms,),
                         "optimizer_ms_rounds": (probe.optimizer_ms,)})
    row = row_cost(shape=shape, probe=one_round, strategy="zero2", num_ranks=2, micro_batch=8, passes=1,
                   bucket_mb=25.0, link=SERIAL)
    assert row.step_ms_high == pytest.approx(row.compute_ms + row.comm_exposed_ms + row.optimizer_ms)  # interval
    assert Probe.from_dict({**{f: getattr(probe, f) for f in probe.__dataclass_fields__},
                            "forward_ms": {"fixed": 0.0, "per_sample": 1.0},
                            "backward_ms": {"fixed": 0.0, "per_sample": 1.0},
                            "step_bytes": {"fixed": 0.0, "per_sample": 1.0}}).check_bytes_per_s == 1e9


def test_sharding_the_optimizer_divides_its_time_but_not_its_fixed_part() -> None:
    assert _cost("zero1", SERIAL).optimizer_ms == pytest.approx(_cost("replicate", SERIAL).optimizer_ms / 2)
    base = _probe()
    fixed = Probe(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "optimizer_fixed_ms": 10.0})
    assert _cost("replicate", SERIAL, fixed).optimizer_ms == 40.0
    assert _cost("zero2", SERIAL, fixed).optimizer_ms == pytest.approx(10.0 + 30.0 / 2)


class _FrozenTable(nn.Module):
    """A frozen embedding in the root (no unit of its own) in front of trainable layers."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 256)
        self.embed.weight.requires_grad_(False)
        self.body = nn.Sequential(*(nn.Linear(256, 256) for _ in range(2)))


def _frozen_cost(vocab: int, link: Interconnect = SERIAL, **probe_fields: object) -> float:
    base = _probe()
    probe = Probe(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "unit_forward_share": (0, 1, 1),
                     **probe_fields})
    with torch.device("meta"):
        shape = model_shape(_FrozenTable(vocab), (2, True))
    return row_cost(shape=shape, probe=probe, strategy="zero3", num_ranks=2, micro_batch=8, passes=1,
                    bucket_mb=25.0, link=link).comm_exposed_ms


def test_zero3_regathers_for_backward_only_the_frozen_parameters_backward_reads() -> None:
    table_ms = 1e3 * 0.5 * (4 * 1000 * 256) / 1e9  # one 2-rank gather of the frozen table
    assert _frozen_cost(1000) - _frozen_cost(1000, frozen_unread=(0,)) == pytest.approx(table_ms, rel=1e-3)


def test_a_gathered_storage_above_the_mmap_threshold_costs_its_page_faults_each_time() -> None:
    assert fresh_map_ms(_probe(), [64 << 20], 32 << 20) == 0.0  # not measured: nothing
    faulting = Probe(**{**{f: getattr(_probe(), f) for f in Probe.__dataclass_fields__}, "fault_bytes_per_s": 1e9})
    assert fresh_map_ms(faulting, [64 << 20, 31 << 20], 32 << 20) == pytest.approx(1e3 * (64 << 20) / 1e9)
    vocab = (mmap_threshold_bytes() // (4 * 256)) + 1000  # the table's whole storage is mapped afresh
    table_bytes = 4 * vocab * 256
    for unread, gathers in (((0,), 1), ((), 2)):  # in forward; in backward only where backward reads it
        extra = (_frozen_cost(vocab, fault_bytes_per_s=1e9, frozen_unread=unread)
                 - _frozen_cost(vocab, frozen_unread=unread))
        assert extra == pytest.approx(gathers * 1e3 * table_bytes / 1e9, rel=1e-3)


def test_the_engines_copies_and_first_touches_take_the_co_run_slowdown() -> None:
    """[Note: co-run slowdown]: the node's ranks copy and fault in at once, as they step."""
    # twice as slow at every working set measured, 1 MiB to 1 GiB (past the largest nothing is priced)
    twice = dataclasses.replace(SERIAL, co_run=CoRun(ranks=2, pass_points=((1 << 20, 1.0, 2.0), (1 << 30, 1.0, 2.0)),
                                                     compute_alone_s=1.0, compute_together_s=1.0))
    probe = _probe(copy_bytes_per_s=1e9)
    for strategy in ("replicate", "zero2"):
        alone = _cost(strategy, SERIAL, probe).comm_exposed_ms - _cost(strategy, SERIAL).comm_exposed_ms
        shared = _cost(strategy, twice, probe).comm_exposed_ms - _cost(strategy, twice).comm_exposed_ms
        assert alone > 0 and shared == pytest.approx(2 * alone, rel=1e-6)
    vocab = (mmap_threshold_bytes() // (4 * 256)) + 1000  # the table's whole storage is mapped afresh
    alone = _frozen_cost(vocab, fault_bytes_per_s=1e9) - _frozen_cost(vocab)
    shared = _frozen_cost(vocab, twice, fault_bytes_per_s=1e9) - _frozen_cost(vocab, twice)
    assert alone > 0 and shared == pytest.approx(2 * alone, rel=1e-6)
