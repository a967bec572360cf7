"""[Note: what each strategy sends], checked on a made-up probe and link (no process, no model run)."""

from __future__ import annotations

import pytest
from torch import nn

from dspark.planner import Interconnect, Probe, model_shape
from dspark.planner.cost import row_cost


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
    # zero3: 5 units gathered twice (1 ms each), a reduce-scatter, the step's small all-reduce
    assert _cost("zero3", slow_calls).comm_exposed_ms == pytest.approx(10 + 1 + 2, rel=1e-2)


def test_the_engines_copies_cost_what_the_probe_measured() -> None:
    probe = _probe(copy_bytes_per_s=1e9)
    assert _cost("replicate", SERIAL, probe).comm_exposed_ms == _cost("replicate", SERIAL).comm_exposed_ms
    grads_ms = 1e3 * 4 * (4 * 512 * 512 + 4 * 512) / 1e9
    extra = _cost("zero2", SERIAL, probe).comm_exposed_ms - _cost("zero2", SERIAL).comm_exposed_ms
    assert extra == pytest.approx(2 * grads_ms, rel=1e-3)  # the send buffer, then the rows' pack and landing
    assert Probe.from_dict({**{f: getattr(probe, f) for f in probe.__dataclass_fields__},
                            "forward_ms": {"fixed": 0.0, "per_sample": 1.0},
                            "backward_ms": {"fixed": 0.0, "per_sample": 1.0},
                            "step_bytes": {"fixed": 0.0, "per_sample": 1.0}}).copy_bytes_per_s == 1e9


def test_sharding_the_optimizer_divides_its_time_but_not_its_fixed_part() -> None:
    assert _cost("zero1", SERIAL).optimizer_ms == pytest.approx(_cost("replicate", SERIAL).optimizer_ms / 2)
    base = _probe()
    fixed = Probe(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, "optimizer_fixed_ms": 10.0})
    assert _cost("replicate", SERIAL, fixed).optimizer_ms == 40.0
    assert _cost("zero2", SERIAL, fixed).optimizer_ms == pytest.approx(10.0 + 30.0 / 2)
